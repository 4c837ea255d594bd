"""`AuditCallback`: the audit inside a `transformers.Trainer` subclass (TRL's DPOTrainer, GRPOTrainer,
SFTTrainer ...), writing a standard run directory.

    trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(bf16=True, ...), ...)
    AuditCallback.attach(trainer, "runs/dpo")       # = trainer.add_callback(AuditCallback("runs/dpo", trainer=trainer))
    trainer.train()

At ``on_train_begin`` it takes the model and optimizer from the callback's arguments and, from the
trainer, the reference model, the accelerator's GradScaler (tapped: the scale the backward ran at,
skipped steps, the loss-scale history) and the precision the user asked for (``bf16`` / ``fp16``,
GRPO's ``cast_lm_head_to_fp32``, the vLLM settings where ``use_vllm`` is on), recorded as the
contract. It wraps, on the trainer instance and only until training ends: ``training_step`` (the
collated batch is the collator boundary; an exception there becomes the run's failure status),
``compute_loss`` (phase ``actor_update``), DPO's ``compute_ref_log_probs`` (``ref``), GRPO's
``_generate_and_score_completions`` (``rollout``: its ids and masks are checked too) and each
callable in GRPO's ``reward_funcs`` (the reward boundary, named by the function's own name).
Gradient health runs at ``on_pre_optimizer_step``, the update and the scaler at
``on_optimizer_step``, and TRL's logged metrics are mapped to our names at ``on_log`` (`METRIC_NAMES`;
the others are kept under ``trl/``). The manifest's ``integration`` section tells ``verlaudit
diagnose`` how TRL spells each fix (`TRL_KEYS`). Under accelerate's several processes, process k writes
``out_dir/rank<k>`` (untested: CPU tests run one process). Exercised by `pytest tests/test_integrations_trl.py`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from verlaudit import kinds as K
from verlaudit.audit.settings import AuditSettings
from verlaudit.dtypes import dtype_name as dn
from verlaudit.integrations import contract
from verlaudit.integrations.session import AuditSession, ScalerTap, grad_norm
from verlaudit.rundir import RANK_DIR

METRIC_NAMES = {
    "loss": "actor/loss",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
    "rewards/chosen": "rewards/chosen",
    "rewards/rejected": "rewards/rejected",
    "rewards/margins": "rewards/margins",
    "rewards/accuracies": "rewards/accuracies",
    "logps/chosen": "logps/chosen",
    "logps/rejected": "logps/rejected",
    "reward": "critic/score/mean",
    "reward_std": "critic/score/std",
    "frac_reward_zero_std": "reward/identical_group_frac",  # the audit's own name (reward_signal.METRIC)
    "completions/mean_length": "response_length/mean",
    "kl": "actor/kl_loss",
    "entropy": "actor/entropy",
    "clip_ratio/region_mean": "actor/pg_clipfrac",
    "sampling/importance_sampling_ratio/mean": "rollout_corr/token_ratio_mean",
    "sampling/importance_sampling_ratio/min": "rollout_corr/token_ratio_min",
    "sampling/importance_sampling_ratio/max": "rollout_corr/token_ratio_max",
    "sampling/sampling_logp_difference/mean": "rollout_corr/logp_abs_diff_mean",
    "sampling/sampling_logp_difference/max": "rollout_corr/logp_abs_diff_max",
}
"""TRL's log keys -> ours (verl's where verl has one: ``actor/pg_clipfrac``, ``rollout_corr/token_ratio_*``).
Other ``rewards/*`` and ``logps/*`` keys (GRPO's ``rewards/<function>/mean``) keep their names, which are
ours too; the rest go under ``trl/``."""
SAME_NAMES = ("rewards/", "logps/")

TRL_KEYS = {
    "precision.preset: bf16": "bf16=True, fp16=False (TrainingArguments)",
    "precision.preset: fp32": "bf16=False, fp16=False (TrainingArguments)",
    "data.collator": "data_collator",
    "data.reward_fn": "reward_funcs",
    "model.reward_model": "reward_funcs",
}
"""Our suite keys (a prefix of a fix's) -> the TRL argument that makes the same change."""
TRL_ROLES = {"actor": "model", "reference": "ref_model", "reward": "reward_funcs"}
"""Roles -> the trainer argument that supplied the role's model."""

_PHASES = {
    "compute_loss": "actor_update",
    "compute_ref_log_probs": "ref",
    "_generate_and_score_completions": "rollout",
}
"""Trainer methods run inside a phase (those a trainer does not have are skipped)."""


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _name(obj: Any) -> str:
    fn = getattr(obj, "func", obj)  # functools.partial
    return getattr(fn, "__name__", None) or type(obj).__name__


def trl_contract(args: Any, models: Mapping[str, nn.Module], device: torch.device) -> tuple[Any, dict]:
    """(policy, record) from what the user asked TRL for: ``bf16`` / ``fp16`` autocast over the
    actor's parameter dtype; frozen roles expected where TRL itself puts them (its reference is a copy
    of the actor in the actor's dtype), computing under the same autocast."""
    autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    actor = models["actor"]
    pd = contract.param_dtype(actor)
    preset = contract.preset_for(pd, autocast)
    asked = {"bf16": bool(args.bf16), "fp16": bool(args.fp16)}
    for key in ("cast_lm_head_to_fp32", "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_dtype"):
        if hasattr(args, key):
            asked[key] = getattr(args, key)
    init_dtype = (getattr(args, "model_init_kwargs", None) or {}).get("dtype")
    if init_dtype is not None:
        asked["model_init_kwargs.dtype"] = str(init_dtype)
    reason = "TRL: " + ", ".join(f"{k}={v}" for k, v in asked.items()) + f"; actor parameters {dn(pd)}"
    expected = {"actor": actor, **{role: actor for role in models if role == "reference"}}
    policy = contract.contract_for(
        preset,
        expected,
        autocast=autocast,
        device=device,
        loss_scaling="dynamic" if args.fp16 else None,
        reason=reason,
    )
    return policy, {"source": "trl", "preset": preset, "asked": asked}


class AuditCallback(TrainerCallback):
    """See the module docstring. ``trainer`` is required (the callback's arguments carry neither the
    reference model nor the scaler); `attach` passes it and registers the callback."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        trainer: Any = None,
        level: str = "boundary",
        settings: AuditSettings | None = None,
        name: str | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.trainer = trainer
        self.settings = settings or AuditSettings(level=level)
        self.name = name or self.out_dir.name
        self.session: AuditSession | None = None
        self._tap: ScalerTap | None = None
        self._wrapped: list[str] = []
        self._reward_funcs: list[Any] | None = None
        self._norm = math.nan
        self._optimizer: Any = None

    @classmethod
    def attach(cls, trainer: Any, out_dir: str | Path, **kwargs: Any) -> AuditCallback:
        """Builds the callback for ``trainer`` and adds it to the trainer's callbacks."""
        cb = cls(out_dir, trainer=trainer, **kwargs)
        trainer.add_callback(cb)
        return cb

    # -- training begins ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
        t = self.trainer
        if t is None:
            raise ValueError(
                "AuditCallback: no trainer; build it with AuditCallback.attach(trainer, out_dir) (or "
                "AuditCallback(out_dir, trainer=trainer)) so it can read the reference model and the scaler"
            )
        actor = _unwrap(model if model is not None else t.model)
        models: dict[str, nn.Module] = {"actor": actor}
        ref = getattr(t, "ref_model", None)
        if isinstance(ref, nn.Module):
            models["reference"] = _unwrap(ref)
        device = next(actor.parameters()).device
        policy, record = trl_contract(args, models, device)
        tok = getattr(t, "processing_class", None)
        tok = getattr(tok, "tokenizer", tok)  # a processor wraps its tokenizer
        collator = getattr(t, "data_collator", None)
        trainer_name = type(t).__name__
        algo = {"DPOTrainer": "dpo", "GRPOTrainer": "grpo", "SFTTrainer": "sft"}.get(
            trainer_name, trainer_name
        )
        self._optimizer = optimizer
        rank = int(getattr(args, "process_index", 0) or 0)  # one run directory per process under accelerate
        self.session = AuditSession(
            self.out_dir if rank == 0 else self.out_dir / RANK_DIR.format(rank=rank),
            rank=rank,
            models=models,
            policy=policy,
            settings=self.settings,
            device=device,
            manifest={
                "variant": self.name,
                "suite": "trl",
                "seed": int(args.seed),
                "config": {
                    "algo": {"name": algo, **({"group_size": t.num_generations} if algo == "grpo" else {})},
                    "precision": {"preset": policy.preset},
                    "steps": int(state.max_steps) if state.max_steps else None,
                    "data": {"collator": f"{_name(collator)}" if collator is not None else None},
                    "model": {"path": getattr(actor.config, "_name_or_path", None) or None},
                    "trl": {"trainer": trainer_name, **record["asked"]},
                },
                "contract": record,
                "integration": {
                    "framework": "trl",
                    "adapter": "verlaudit.integrations.trl.AuditCallback",
                    "keys": TRL_KEYS,
                    "roles": TRL_ROLES,
                },
            },
            tokenizer_info=_tokenizer_info(tok),
        )
        if getattr(args, "cast_lm_head_to_fp32", False):
            # asked for: the LM head's fp32 weights are the contract, not a stray dtype
            self.session.intend(
                lambda f: f.kind in (K.PARAM_STORAGE, K.GRAD) and f.where == "lm_head",
                "intended: cast_lm_head_to_fp32=True keeps the LM head in fp32",
            )
        scaler = getattr(getattr(t, "accelerator", None), "scaler", None)
        if scaler is not None:
            self._tap = ScalerTap(scaler, before_unscale=self._before_unscale)
        self._wrap(t, "training_step", self._training_step)
        for method, phase in _PHASES.items():
            if callable(getattr(t, method, None)):
                self._wrap(t, method, functools.partial(self._in_phase, phase))
        funcs = getattr(t, "reward_funcs", None)
        if isinstance(funcs, list):
            self._reward_funcs = list(funcs)
            names = list(getattr(t, "reward_func_names", [_name(f) for f in funcs]))
            for i, fn in enumerate(funcs):
                # an async function stays as it is: TRL awaits it only if it still looks async
                if callable(fn) and not isinstance(fn, nn.Module) and not inspect.iscoroutinefunction(fn):
                    funcs[i] = self._reward_boundary(fn, names[i] if i < len(names) else _name(fn))

    def _wrap(self, trainer: Any, method: str, around: Callable[..., Any]) -> None:
        original = getattr(trainer, method)
        setattr(trainer, method, functools.wraps(original)(functools.partial(around, original)))
        self._wrapped.append(method)

    def _unwrap_all(self) -> None:
        t = self.trainer
        for method in self._wrapped:
            t.__dict__.pop(method, None)
        self._wrapped.clear()
        if self._reward_funcs is not None:
            t.reward_funcs[:] = self._reward_funcs
            self._reward_funcs = None
        if self._tap is not None:
            self._tap.remove()
            self._tap = None

    # -- the wrapped methods -----------------------------------------------------------------------
    def _training_step(
        self, original: Callable[..., Any], model: Any, inputs: Any, *args: Any, **kw: Any
    ) -> Any:
        s = self.session
        assert s is not None
        s.begin_step()
        if isinstance(inputs, Mapping):
            collator = getattr(self.trainer, "data_collator", None)
            s.auditor.on_batch(role="actor", batch=inputs, source=_name(collator))
        try:
            return original(model, inputs, *args, **kw)
        except BaseException as e:
            self._fail(e)
            raise

    def _in_phase(self, phase: str, original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        s = self.session
        assert s is not None
        if not s.models["actor"].training:  # evaluation and prediction are not training steps
            return original(*args, **kw)
        with s.phase(phase):
            out = original(*args, **kw)
        if phase == "rollout" and isinstance(out, Mapping):
            ids = {
                k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k.endswith(("_ids", "_mask"))
            }
            s.auditor.on_batch(role="actor", batch=ids, source=f"{type(self.trainer).__name__}.generate")
        return out

    def _reward_boundary(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def reward(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            s = self.session
            if s is not None:
                prompts = kw.get("prompts", args[0] if args else None)
                n = len(prompts) if prompts is not None else None
                converted = _as_rewards(out)
                s.auditor.on_reward(
                    source=f"function:{name}",
                    raw=out,
                    rewards=converted,
                    expected_shape=(n,) if n is not None else tuple(converted.shape),
                    model=None,
                )
            return out

        return reward

    def _before_unscale(self, optimizer: Any, scale: float) -> None:
        if self.session is not None:
            self.session.backward("actor", scale)

    # -- the optimizer step ------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
        s = self.session
        if s is None:
            return
        opt = self._optimizer or getattr(self.trainer, "optimizer", None)
        s.before_optimizer_step("actor", opt)
        self._norm = grad_norm(s.models["actor"])

    def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
        s = self.session
        if s is None:
            return
        acc = getattr(self.trainer, "accelerator", None)
        if self._tap is not None and self._tap.found_inf is not None:
            skipped = self._tap.found_inf  # what the scaler saw, not a guess from the scale
        else:
            skipped = bool(getattr(acc, "optimizer_step_was_skipped", False))
        scaler_state = self._tap.state() if self._tap is not None else {"mode": "none", "scale": 1.0}
        opt = self._optimizer or getattr(self.trainer, "optimizer", None)
        s.optimizer_step("actor", opt, scaler_state=scaler_state, skipped=skipped, grad_norm=self._norm)
        self._norm = math.nan

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.session is not None:
            self.session.finish_step()

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if self.session is None or not logs or any(str(k).startswith("eval_") for k in logs):
            return
        self.session.log(map_metrics(logs))

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.session is None:
            return
        try:
            self.session.close(steps=int(state.max_steps) if state.max_steps else None)
        finally:
            self._unwrap_all()

    def _fail(self, exc: BaseException) -> None:
        if self.session is not None:
            try:
                self.session.close(exc)
            finally:
                self._unwrap_all()


def map_metrics(logs: Mapping[str, Any]) -> dict[str, float]:
    """TRL's log dict in our names (`METRIC_NAMES`, `SAME_NAMES`); other numbers kept as ``trl/<key>``."""
    out: dict[str, float] = {}
    for k, v in logs.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = METRIC_NAMES.get(k) or (k if k.startswith(SAME_NAMES) else f"trl/{k}")
        out[name] = float(v)
    return out


def _as_rewards(raw: Any) -> torch.Tensor:
    """The float32 rewards TRL makes of a reward function's output (None -> nan)."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().float().reshape(-1)
    try:
        return torch.tensor([math.nan if r is None else float(r) for r in raw], dtype=torch.float32)
    except (TypeError, ValueError):
        return torch.full((len(raw) if hasattr(raw, "__len__") else 1,), math.nan)


def _tokenizer_info(tok: Any) -> dict[str, Any]:
    """No ``padding_side``: TRL's collators pad training batches on the right whatever the tokenizer
    says (only generation needs left padding, and TRL pads its prompts itself)."""
    if tok is None or not hasattr(tok, "__len__"):
        return {}
    return {
        "vocab_size": len(tok),
        "pad_token_id": getattr(tok, "pad_token_id", None),
        "eos_token_id": getattr(tok, "eos_token_id", None),
    }
