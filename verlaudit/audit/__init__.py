"""verlaudit.audit: dtype contract checks, numerics and memory telemetry for a training run.

`Auditor` is the `trainer.events.Observer` that the worker (`python -m verlaudit.run.worker SPEC.json`)
passes to `trainer.train.train`; `AuditSettings` says how much it audits. The submodules hold the
collectors it routes events to and the pure checks that turn their records into findings.
"""

from verlaudit.audit.auditor import Auditor
from verlaudit.audit.settings import LEVELS, AuditSettings

__all__ = ["LEVELS", "AuditSettings", "Auditor"]
