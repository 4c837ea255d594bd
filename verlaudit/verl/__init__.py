"""Bring your verl job: read a verl launch script or Hydra YAML and write the suite that reproduces it.

``launch`` parses the script (shell variables, continuations, comments, quoting, Hydra override
syntax) into overrides that remember their line; ``mapping`` holds the table from verl keys to suite
keys (with verl's defaults and converters), ``reasons`` the reason for every key it cannot map;
``architectures`` maps known model names to their shapes for random-init runs; ``writer`` renders the
suite; ``roundtrip`` writes a diagnosis's fixes back as the script's own lines; ``cli`` is
``verlaudit from-verl``. Exercised by `pytest tests/test_from_verl.py tests/test_verl_launch.py`.
"""
