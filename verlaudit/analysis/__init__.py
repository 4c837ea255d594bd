"""Analysing run directories and foreign logs: everything here reads, nothing runs a model.

Four parts that do not import each other, over the shared `causes` types:
`report/` (the comparison table, CSV and plots of a suite's runs), `ci/` (compare a run with a
baseline: tolerances, gates, baseline notes), `diagnose/` (cause, culprit, fix for a run directory,
and the run-directory readings the planner's failure view needs), `logs/` (the rule families for a
plain training log or traceback, ours or another framework's).
"""
