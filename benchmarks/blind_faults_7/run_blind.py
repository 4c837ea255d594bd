"""Seventh blind fault bench for ``verlaudit diagnose``: a thin wrapper over benchmarks/faultbench.py.

python benchmarks/blind_faults_7/run_blind.py [--only a,b] [--keep DIR] [--out FILE] [--jobs 1]
python benchmarks/blind_faults_7/run_blind.py --verify [--only a,b] [--keep DIR]   # no diagnose
python benchmarks/blind_faults_7/run_blind.py --rescore DIR [--out FILE]             # diagnose kept runs
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from faultbench import Bench, main  # noqa: E402

SFT_ENV = "BLIND7_SFT_CKPT"
"""Names the SFT checkpoint for the plug-ins that load it (its siblings are the other model assets)."""

BENCH = Bench(here=HERE, title="Blind fault bench 7", sft_env=SFT_ENV, suite_prefix="blind7")

if __name__ == "__main__":
    sys.exit(main(BENCH))
