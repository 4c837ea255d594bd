"""Planning memory before a run: `memory_model` (bytes per phase, from the ops Llama runs),
`planner` (a training step's phases per GPU; ``checkpoint_layers: auto``), `failure` (a failed run
re-planned for `verlaudit diagnose`), `cli` (``verlaudit plan``).
"""
