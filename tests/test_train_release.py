"""A finished in-process run leaves no model alive in a reference cycle (trainer/train.py's import note).

Checked in a fresh interpreter, with the cycle collector off: the first import of the model stack is what
used to pin the run's frames, and this test process has long done it. Both rollout engines that run on a CPU:
the static decode engine used to hold a bound method of itself (trainer/rollout.py `_SlotForward`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import dataclasses, gc, json, sys
    import torch
    from trainer.train import train
    from verlaudit.run.suite import load_suite

    cfg = load_suite(sys.argv[1], device="cpu").variants[sys.argv[2]]
    gc.collect()
    gc.disable()

    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine=sys.argv[3]))

    def case():
        train(dataclasses.replace(cfg, steps=1))

    case()
    alive = sorted(
        type(o).__name__ for o in gc.get_objects()
        if isinstance(o, torch.nn.Module) and type(o).__name__.endswith(("ForCausalLM", "ValueModel"))
    )
    print(json.dumps(alive))
    """
)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_finished_run_leaves_no_model_in_a_cycle(tmp_path, engine):
    from verlaudit.run.suite import load_suite

    suite = ROOT / "suites" / "grpo_tiny_cpu.yaml"
    variant = next(iter(load_suite(str(suite), device="cpu").variants))
    script = tmp_path / "release.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script), str(suite), variant, engine],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    alive = json.loads(out.stdout.strip().splitlines()[-1])
    assert alive == [], f"models kept alive after train() returned, until the cycle collector runs: {alive}"
