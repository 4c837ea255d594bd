"""The suite report: `build` (report.md, report.csv, the plots, one row per run), `precision` (the
precision and phase tables from a run's records), `mismatch` (the rollout/trainer mismatch table)."""
