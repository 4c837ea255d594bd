"""Small readers over a `verlaudit.rundir.RunDir` that the run diagnosis modules share: the recorded
config and policy, the runner's record, the phases the worker started, number formatting.
Exercised by `pytest tests/test_diagnose.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit.analysis.causes import Fix
from verlaudit.rundir import RUNNER, RunDir, read_json, to_float


def cfg(run: RunDir, *path: str, default: Any = None) -> Any:
    """``manifest.config`` at ``path`` (``cfg(run, "algo", "name")``), or ``default``."""
    cur: Any = run.manifest.get("config") or {}
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur


def role_policy(run: RunDir, role: str) -> Mapping[str, Any]:
    return ((run.manifest.get("policy") or {}).get("roles") or {}).get(role) or {}


def uses_reference(run: RunDir) -> bool:
    """Whether the run built the frozen reference (trainer.config.AlgoConfig.uses_reference); runs
    recorded before the verl KL keys had one whenever kl_coef was positive."""
    algo = (run.manifest.get("config") or {}).get("algo") or {}
    if "use_kl_loss" not in algo:
        return algo.get("name") == "dpo" or bool(algo.get("kl_coef", 0.05))
    return algo.get("name") == "dpo" or bool(algo.get("use_kl_in_reward") or algo.get("use_kl_loss"))


def preset(run: RunDir) -> str | None:
    return (run.manifest.get("policy") or {}).get("preset") or cfg(run, "precision", "preset")


def setup_plugin(run: RunDir, role: str | None) -> str | None:
    """The ``model.setup`` plug-in that ran on ``role``'s model, if any."""
    setup = cfg(run, "model", "setup")
    role = "actor" if role == "rollout" else role  # the rollout engine runs the actor's modules
    if isinstance(setup, str):
        return setup
    if isinstance(setup, Mapping) and role is not None:
        return setup.get(role) or setup.get("*")
    return None


def runner_record(run: RunDir) -> Mapping[str, Any]:
    """runner.json (the command, the child's exit code, wall time); empty when the runner wrote none."""
    try:
        rec = read_json(run.path / RUNNER)
    except ValueError:
        return {}
    return rec if isinstance(rec, Mapping) else {}


def last_phase_started(run: RunDir) -> tuple[int | None, str | None]:
    """(step, phase) of the last ``phase_start`` event the worker wrote (events.jsonl)."""
    starts = [e for e in run.events if e.get("kind") == "phase_start"]
    if not starts:
        return None, None
    last = starts[-1]
    return last.get("step"), last.get("phase")


def last_step(run: RunDir) -> int | None:
    steps = [int(m["step"]) for m in run.metrics if "step" in m]
    return max(steps) if steps else None


def fmt(v: float) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def gib(v: float) -> str:
    """A memory size with the precision it has: 0.45 stays 0.45, 79.6 stays 79.6, 131.379 -> 131.4."""
    return f"{v:.4g}"


def num(v: Any) -> float | None:
    try:
        f = to_float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def user_hook_fix(run: RunDir, role: str | None, module: str | None) -> Fix | None:
    """A fix pointing at the user's forward hook on ``module`` (``model/user_hook``, recorded at setup),
    when there is one: the hook's code is what changed that module's output."""
    model = "actor" if role == "rollout" else role
    for f in run.findings:
        if f.kind == K.USER_HOOK and f.role == model and module and f.where == module:
            hooks = ", ".join(f.observed) if isinstance(f.observed, list) else str(f.observed)
            plugin = setup_plugin(run, model)
            key = f"model.setup ({plugin})" if plugin else None
            return Fix(
                key,
                None,
                f"a forward hook from user code sits on {module} ({hooks}) and runs before the "
                "audit sees its output: check what it does to the output first",
            )
    return None
