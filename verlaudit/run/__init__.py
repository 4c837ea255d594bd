"""Running a suite: suite YAML -> validated `Suite` -> one resolved spec per variant -> one worker
process per variant (torchrun for several GPUs) -> run directories.

`suite` (validation), `hardware` (targets and the GPU present), `runner` (`verlaudit run`: plan,
launch, report), `worker` (``python -m verlaudit.run.worker spec.json``: the only place the trainer
and the auditor meet).
"""
