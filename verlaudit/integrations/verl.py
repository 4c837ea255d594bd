"""The audit inside verl's own workers: a module verl imports in every process that imports verl.

    VERLAUDIT_OUT=runs/verl VERL_USE_EXTERNAL_MODULES=verlaudit.integrations.verl python -m verl.trainer.main_ppo ...

verl imports the modules named by ``VERL_USE_EXTERNAL_MODULES`` (and, in versions that scan them, the
``verl.plugins`` entry points, where pyproject registers this module) when ``verl`` itself is
imported, so in the driver and in each Ray worker alike. Importing it does nothing unless
``VERLAUDIT_OUT`` is set (an installed verlaudit never audits a job that did not ask). With it set,
`install` wraps, on verl's classes and for the life of the process:

- ``TrainingWorker.infer_batch`` -- the actor's old log-probs (phase ``actor_update``) or the
  reference's (``ref``), checked as a forward result (``old_logprobs`` / ``ref_logprobs``) after the
  ids of the batch (collator boundary);
- ``TrainingWorker.train_batch`` -- one training step (``actor_update`` / ``critic_update``), with the
  engine's ``optimizer_step`` as the optimizer step (gradients before it, the update and a skipped
  non-finite step after it, the engine's GradScaler tapped under fp16) and verl's metrics as the step's;
- ``__call__`` of every registered reward manager -- the values its ``compute_score`` returned, as the
  reward boundary, named by the score function's name.

Each worker writes its own run directory: ``$VERLAUDIT_OUT/<role>`` for rank 0, ``.../<role>/rank<k>``
for rank k (role: actor, reference, critic; reward for the reward managers). The contract is the FSDP
engine's mixed precision (``engine_config.mixed_precision.param_dtype``, verl's default bf16) over the
master weights' dtype; ``VERLAUDIT_LEVEL`` sets the audit level (default ``boundary``).
Exercised by `pytest tests/test_integrations_verl.py` (verl 0.9.1 in its own environment, CPU).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.precision import PrecisionPolicy, resolve_policy
from verlaudit.audit.settings import AuditSettings
from verlaudit.dtypes import dtype_name as dn
from verlaudit.integrations import contract
from verlaudit.integrations.session import AuditSession, ScalerTap
from verlaudit.rundir import RANK_DIR

OUT_ENV = "VERLAUDIT_OUT"
LEVEL_ENV = "VERLAUDIT_LEVEL"
_SESSIONS: dict[int, AuditSession] = {}
"""id(worker or reward manager) -> its session (one per worker object in this process)."""
_INSTALLED = False
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _settings() -> AuditSettings:
    return AuditSettings(level=os.environ.get(LEVEL_ENV, "boundary"))


def _run_dir(role: str, rank: int) -> Path:
    base = Path(os.environ[OUT_ENV]) / role
    return base if rank == 0 else base / RANK_DIR.format(rank=rank)


def _role(worker: Any) -> str:
    if getattr(worker.config, "model_type", None) == "value_model":
        return "critic"
    return "reference" if getattr(worker.engine_config, "forward_only", False) else "actor"


def engine_contract(worker: Any, module: torch.nn.Module, role: str, device: torch.device) -> PrecisionPolicy:
    """The FSDP engine's mixed precision (param_dtype: the compute dtype; verl's default bf16) over the
    dtype of the master weights the engine holds."""
    mp = getattr(worker.engine_config, "mixed_precision", None) or {}
    name = str(mp.get("param_dtype", "bf16")).lower() if isinstance(mp, Mapping) else "bf16"
    compute = _DTYPES.get(name)
    pd = contract.param_dtype(module)
    reason = f"verl FSDP engine: mixed_precision.param_dtype={name}, master weights {dn(pd)}"
    models = {"actor" if role == "reference" else role: module}
    policy = contract.contract_for(
        contract.preset_for(pd, compute), models, autocast=compute, device=device, reason=reason
    )
    if (
        role == "reference"
    ):  # a frozen copy computes like the actor: the actor's contract, this role's storage
        policy = PrecisionPolicy(preset=policy.preset, roles={**policy.roles, "reference": policy["actor"]})
    return policy


def _session(worker: Any) -> AuditSession:
    s = _SESSIONS.get(id(worker))
    if s is not None:
        return s
    role = _role(worker)
    engine = worker.engine
    module = engine.module
    param = next(module.parameters())
    device = param.device
    policy = engine_contract(worker, module, role, device)
    s = AuditSession(
        _run_dir(role, int(getattr(worker, "rank", 0))),
        models={role: module},
        policy=policy,
        settings=_settings(),
        device=device,
        rank=int(getattr(worker, "rank", 0)),
        manifest={
            "variant": role,
            "suite": "verl",
            "config": {
                "algo": {"name": "ppo"},
                "precision": {"preset": policy.preset},
                "verl": {
                    "engine": type(engine).__name__,
                    "strategy": getattr(worker.engine_config, "strategy", None),
                },
            },
            "contract": {"source": "verl", "preset": policy.preset},
            "integration": {"framework": "verl", "adapter": "verlaudit.integrations.verl"},
        },
    )
    _SESSIONS[id(worker)] = s
    if role != "reference":
        _wrap_optimizer_step(engine, s, role)
    return s


def _wrap_optimizer_step(engine: Any, s: AuditSession, role: str) -> None:
    original = engine.optimizer_step
    scaler = getattr(engine, "scaler", None)
    tap = ScalerTap(scaler, before_unscale=lambda opt, scale: s.backward(role, scale)) if scaler else None

    @functools.wraps(original)
    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        s.before_optimizer_step(role, engine.optimizer)
        grad_norm = original(*args, **kwargs)
        norm = float(grad_norm) if isinstance(grad_norm, (int, float, torch.Tensor)) else math.nan
        state = tap.state() if tap is not None else {"mode": "none", "scale": 1.0, "found_inf": None}
        skipped = bool(state.get("found_inf")) if tap is not None else not math.isfinite(norm)
        s.optimizer_step(role, engine.optimizer, scaler_state=state, skipped=skipped, grad_norm=norm)
        return grad_norm

    engine.optimizer_step = optimizer_step


def _dense(t: Any) -> Any:
    """A nested (jagged) tensor's packed values; anything else as it is."""
    return t.values() if isinstance(t, torch.Tensor) and t.is_nested else t


def _ids(data: Any) -> dict[str, torch.Tensor]:
    """The batch's token ids, packed (verl's no-padding layout): what the collator boundary checks."""
    out = {}
    for key in ("input_ids", "position_ids"):
        try:
            v = data.get(key)
        except (KeyError, AttributeError):
            v = None
        if isinstance(v, torch.Tensor):
            out[key] = _dense(v).reshape(1, -1) if v.is_nested else v
    return out


def _metrics(out: Any) -> dict[str, float]:
    """verl's train_batch metrics: numbers, and lists of its `Metric` objects (mean of their values)."""
    try:
        raw = out.get("metrics")
    except (KeyError, AttributeError):
        return {}
    raw = getattr(raw, "data", raw)
    found: dict[str, float] = {}
    for k, v in (raw or {}).items() if isinstance(raw, Mapping) else ():
        vals = v if isinstance(v, list) else [v]
        nums = []
        for x in vals:
            xs = getattr(x, "values", x)
            nums += [float(y) for y in (xs if isinstance(xs, list) else [xs]) if isinstance(y, (int, float))]
        if nums:
            found[str(k)] = sum(nums) / len(nums)
    return found


def _infer_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def infer_batch(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        s = _session(self)
        role = next(iter(s.models))
        s.begin_step()
        s.auditor.on_batch(role=role, batch=_ids(data), source="verl:DataProto")
        name = "ref_logprobs" if role == "reference" else "old_logprobs"
        with s.phase("ref" if role == "reference" else f"{'critic' if role == 'critic' else 'actor'}_update"):
            out = original(self, data, *args, **kwargs)
        for key, label in (("log_probs", name), ("values", "values")):
            try:
                t = out.get(key) if out is not None else None
            except (KeyError, AttributeError):
                t = None
            if isinstance(t, torch.Tensor):
                s.auditor.on_forward(role=role, name=label, output=_dense(t))
        if role == "reference":
            s.finish_step()
        return out

    return infer_batch


def _train_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train_batch(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        s = _session(self)
        role = next(iter(s.models))
        s.begin_step()
        try:
            with s.phase("critic_update" if role == "critic" else "actor_update"):
                out = original(self, data, *args, **kwargs)
        except BaseException as e:
            s.close(e)
            _SESSIONS.pop(id(self), None)
            raise
        s.log(_metrics(out))
        s.finish_step()
        return out

    return train_batch


def _reward_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        score_fn = getattr(self, "compute_score", None)
        if not callable(score_fn):
            return original(self, data, *args, **kwargs)
        raws: list[Any] = []

        def compute_score(*a: Any, **k: Any) -> Any:
            out = score_fn(*a, **k)
            raws.append(out["score"] if isinstance(out, Mapping) and "score" in out else out)
            return out

        self.compute_score = compute_score
        try:
            out = original(self, data, *args, **kwargs)
        finally:
            self.compute_score = score_fn
        s = _reward_session(self)
        s.begin_step()
        name = getattr(getattr(score_fn, "func", score_fn), "__name__", type(score_fn).__name__)
        raw: Any = raws
        if raws and all(isinstance(r, torch.Tensor) for r in raws):
            raw = torch.stack([r.reshape(()) for r in raws])  # their own dtype, as the function made them
        elif raws and all(hasattr(r, "dtype") and hasattr(r, "shape") for r in raws):  # numpy scalars
            import numpy as np

            raw = np.asarray(raws)
        tensor = out.get("reward_tensor") if isinstance(out, Mapping) else out
        rewards = tensor.sum(-1).float() if isinstance(tensor, torch.Tensor) else torch.tensor([math.nan])
        s.auditor.on_reward(
            source=f"function:verl:{name}", raw=raw, rewards=rewards, expected_shape=(len(raws),), model=None
        )
        s.finish_step()
        return out

    return __call__


def _reward_session(manager: Any) -> AuditSession:
    s = _SESSIONS.get(id(manager))
    if s is None:
        rank = int(os.environ.get("RANK", "0"))
        s = _SESSIONS[id(manager)] = AuditSession(
            _run_dir("reward", rank),
            models={},
            policy=resolve_policy("fp32"),
            settings=_settings(),
            device=torch.device("cpu"),
            rank=rank,
            manifest={
                "variant": "reward",
                "suite": "verl",
                "config": {"algo": {"name": "ppo"}, "verl": {"reward_manager": type(manager).__name__}},
                "integration": {"framework": "verl", "adapter": "verlaudit.integrations.verl"},
            },
        )
    return s


def close_all() -> None:
    """Ends every session of this process (completed); verl workers end with their process, so this
    also runs at interpreter exit."""
    for key in list(_SESSIONS):
        _SESSIONS.pop(key).close()


def install() -> bool:
    """Wraps verl's worker and reward-manager methods once per process; False when ``VERLAUDIT_OUT`` is
    unset (nothing is changed) or it was done already."""
    global _INSTALLED
    if _INSTALLED or not os.environ.get(OUT_ENV):
        return False
    import atexit

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.reward_manager.registry import REWARD_MANAGER_REGISTRY

    TrainingWorker.infer_batch = _infer_batch(TrainingWorker.infer_batch)
    TrainingWorker.train_batch = _train_batch(TrainingWorker.train_batch)
    for cls in set(REWARD_MANAGER_REGISTRY.values()):
        if "__call__" in vars(cls):
            cls.__call__ = _reward_call(vars(cls)["__call__"])
    atexit.register(close_all)
    _INSTALLED = True
    return True


install()
