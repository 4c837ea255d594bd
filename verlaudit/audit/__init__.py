"""verlaudit.audit: dtype contract checks, numerics and memory telemetry for a training run.

`Auditor` is the `trainer.events.Observer` that the worker (`python -m verlaudit.run.worker SPEC.json`)
passes to `trainer.train.train`; the submodules hold the pure checks it runs.
"""

from verlaudit.audit.auditor import LEVELS, Auditor, AuditSettings

__all__ = ["LEVELS", "AuditSettings", "Auditor"]
