"""CI regression reports: `compare` (a run against a committed baseline: markdown, JUnit XML, exit
status), `tolerance` (the kernel-noise model behind the per-step tolerances), `gates` (the checks a
comparison runs), `baseline_notes` (a baseline's BASELINE.md)."""
