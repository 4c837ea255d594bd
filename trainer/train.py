"""The trainer's entry point: `train(config, observer)` dispatches to the recipe ``algo.name`` names
(`trainer.recipes`: PPO, GRPO, DPO).

A plain run without verlaudit, one line per step:
    python -m trainer.train --config cfg.yaml [--steps N]
The config file holds a `TrainConfig` as YAML or JSON (``algo: {name: grpo}``, ``precision: {preset: bf16}``).
Exceptions (OOM, dtype errors, `NonFiniteLossError`) propagate: verlaudit's worker records them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

# The model stack (transformers, and through it torch._dynamo and torch.fx) is imported with this module, not
# lazily on a run's first model build: torch.fx's `wrap`, run at import time, keeps a reference to its own
# frame, so a first import made deep inside `train()` pins every frame of the call stack it ran in (and the
# models their locals hold at exit) in a reference cycle until the cycle collector's next pass. A second run in
# the same process (a benchmark's next case, a notebook) then met the first run's models still allocated
# (session 12: an H200 out of memory). tests/test_train_release.py checks it in a fresh interpreter.
import trainer.models  # noqa: F401
from trainer.common import NonFiniteLossError, Resolved, resolve
from trainer.config import TrainConfig
from trainer.events import NULL_OBSERVER, Observer
from trainer.recipes import recipe_run

__all__ = ["NonFiniteLossError", "Resolved", "TrainResult", "load_config", "main", "train"]


@dataclasses.dataclass
class TrainResult:
    """Per-step metrics of a finished run."""

    history: list[dict[str, float]]
    """One flat metrics dict per step (what ``on_step_end`` received)."""
    final: dict[str, float]
    """The last step's metrics."""


def train(
    config: TrainConfig, observer: Observer | None = None, *, resolved: Resolved | None = None
) -> TrainResult:
    """Runs ``config.steps`` steps of ``config.algo.name`` and returns the metrics history.

    ``resolved``: the device, process group and precision policy decided before the call (what
    ``verlaudit run`` hands over); None: the trainer decides them from ``config`` (`resolve`)."""
    observer = observer or NULL_OBSERVER
    run = recipe_run(config.algo.name)  # TrainConfig refuses unknown names already
    history = run(config, observer, resolved or resolve(config))
    return TrainResult(history=history, final=dict(history[-1]) if history else {})


def load_config(path: str | Path) -> TrainConfig:
    """Reads a YAML or JSON file into a validated `TrainConfig` (errors name the file and the field)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: {p} does not exist; pass a YAML or JSON TrainConfig file")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{p}: not valid {p.suffix.lstrip('.') or 'YAML'}: {e}") from None
    except Exception as e:  # yaml.YAMLError carries the line and column
        if type(e).__module__.startswith("yaml"):
            raise ValueError(f"{p}: not valid YAML: {e}") from None
        raise
    try:
        return TrainConfig.from_dict(data or {})
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def _format(step: int, m: dict[str, float]) -> str:
    keys = [
        "actor/loss",
        "critic/score/mean",
        "rewards/margins",
        "rewards/accuracies",
        "actor/grad_norm",
        "actor/loss_scale",
        "perf/step_time_s",
    ]
    parts = [f"{k}={m[k]:.4g}" for k in keys if k in m]
    return f"step {step}: " + " ".join(parts)


class _PrintObserver(Observer):
    def on_step_end(self, step: int, metrics) -> None:
        print(_format(step, dict(metrics)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as YAML or JSON")
    parser.add_argument("--steps", type=int, default=None, help="override config.steps")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.steps is not None:
            config = TrainConfig.from_dict({**config.to_dict(), "steps": args.steps})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = train(config, _PrintObserver())
    print(json.dumps({"steps": len(result.history), "final": result.final}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
