"""Adapters that audit a run where it runs: any PyTorch loop (`watch`), TRL's trainers (`trl`), and the
TensorBoard export of a run directory (`tensorboard`).

Each adapter turns its host's events into the trainer's observer protocol (`trainer.events`) through
one `session.AuditSession`, which drives the same `verlaudit.audit.Auditor` our worker uses and writes
a standard run directory (`verlaudit.rundir`), so ``verlaudit diagnose``, ``compare`` and the report
read it like one of ours. Exercised by `pytest tests/test_integrations_watch.py
tests/test_integrations_trl.py tests/test_integrations_tensorboard.py`.
"""
