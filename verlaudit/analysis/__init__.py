"""Analysing run directories (and foreign logs): everything here reads, nothing runs a model.

`report` (the comparison table and plots), `compare` + `gates` (CI regression reports),
`diagnose` (cause, culprit, fix for a run directory), `logparse` (the same for a plain
verl / TRL / PyTorch log).
"""
