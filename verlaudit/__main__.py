import sys

from verlaudit.cli import main

sys.exit(main())
