"""Diagnosis of a run directory: `diagnosis` (read, order by root cause, render), `rules` (the
root-cause classes and chains), `status` / `trajectory` / `oom` / `mismatch_cause` (causes from the
status, the metric trajectories, an out-of-memory, the mismatch records), `runview` (reading helpers),
`failure` (what the planner needs from a failed run). A foreign log and a run's own recorded error
text are read by the rule families of `verlaudit.analysis.logs`; `diagnosis.diagnose_log` orders a
log's causes with the same rules as a run's."""
