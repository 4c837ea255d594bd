"""Planted faults for the runner's end-to-end tests, loaded by the worker through ``data.reward_fn``.

Run: `pytest -q tests/test_runner.py -k failed_variant`.
"""

from __future__ import annotations

_calls = {"n": 0}


def nan_reward_after_first_step(prompts, responses, examples):
    """Rule-like rewards on the first call, NaN from the second on (one call per training step), so a
    variant with ``abort_on_nonfinite_loss: 1`` fails at step 1 after one clean step."""
    _calls["n"] += 1
    value = 0.5 if _calls["n"] == 1 else float("nan")
    return [value] * len(prompts)


def fails_on_rank1_second_step(prompts, responses, examples):
    """Rank 1 of a torchrun job raises on its second call (step 1); every other rank scores 0.5. One
    rank failing alone is the multi-process failure the worker must turn into a prompt exit."""
    import os

    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 2:
        raise RuntimeError("planted failure on rank 1 at step 1")
    return [0.5] * len(prompts)
