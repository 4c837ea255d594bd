"""What the PPO, GRPO and DPO recipes share: setup, backward, optimizer step, rewards, step logging.

No class hierarchy: each recipe calls these functions in its own readable order. Every precision
decision comes from the resolved `PrecisionPolicy`; every boundary the auditor cares about is an
observer call here or in the recipe. Under torchrun every rank runs the same code: `build_setup`
shards the actor, critic and reference with FSDP2 (`trainer.distributed`), each recipe keeps its
rank's slice of the global batch (`local_batch`), and `StepLog` averages the step's metrics over
ranks. The PPO/GRPO losses divide by the whole mini-batch's token (or sequence) count summed over
ranks, times the world size that FSDP2's gradient averaging divides by again (`mini_batch_norm`,
verl's global-batch normalisation): the gradient is the single-process one for any split into
micro-batches and ranks. DPO averages each micro-batch's pairs and divides by the accumulation count.
Exercised by `pytest tests/test_train.py` and `pytest tests/test_distributed_e2e.py`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainer import distributed as dist_mod
from trainer import losses as L
from trainer.config import TrainConfig
from trainer.events import Observer
from trainer.precision import LossScaler, PrecisionPolicy


class NonFiniteLossError(RuntimeError):
    """Raised when ``abort_on_nonfinite_loss`` consecutive steps had a non-finite actor loss."""

    def __init__(self, step: int, count: int, loss: float) -> None:
        super().__init__(
            f"step {step}: actor loss {loss} was non-finite for {count} consecutive steps "
            "(config abort_on_nonfinite_loss); the run was stopped"
        )
        self.step = step
        self.count = count


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy ships with torch installs in practice
        pass


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; its moments take the parameter dtype (the policy's
    ``optim_state_dtype``). Fused kernels on CUDA, where they exist for every float dtype."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")


@dataclasses.dataclass
class Setup:
    """Everything a recipe needs after setup; ``models`` holds only the roles that exist."""

    config: TrainConfig
    device: torch.device
    policy: PrecisionPolicy
    tokenizer: Any
    models: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    scalers: dict[str, LossScaler]
    dist: dist_mod.DistInfo
    """This process's place in a torchrun job (world_size 1 for a single process)."""

    def autocast(self, role: str):
        return self.policy[role].autocast_ctx(self.device.type)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolved:
    """What is decided before any model exists: this process's place in the job (which fixes its
    device) and the precision policy. `verlaudit run` decides both once, before the worker starts, and
    hands them to `trainer.train.train`; the trainer run alone decides them itself (`resolve`)."""

    dist: dist_mod.DistInfo
    """This process's rank and device (`trainer.distributed.init_distributed`: the process group is
    joined there, once)."""
    policy: PrecisionPolicy

    @property
    def device(self) -> torch.device:
        return self.dist.device


def resolve(config: TrainConfig) -> Resolved:
    """The trainer's own decision when nothing was handed over: joins torchrun's process group if
    there is one, picks the device (``auto``: cuda when visible), and checks the policy against it."""
    info = dist_mod.init_distributed(config.device)  # torchrun env -> nccl (cuda:LOCAL_RANK) or gloo
    return Resolved(dist=info, policy=config.precision.build_policy(info.device))


def build_setup(
    config: TrainConfig,
    observer: Observer,
    resolved: Resolved,
    *,
    critic: bool,
    reference: bool,
    reward_model: bool,
) -> Setup:
    """Builds tokenizer and the models of each role on the resolved device under the resolved policy,
    optimizers and loss scalers for trainable roles, then calls ``observer.on_setup``."""
    from trainer import models as M  # deferred: keeps `import trainer.common` light for the CLI

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    info, policy, device = resolved.dist, resolved.policy, resolved.device
    # the same seed on every rank: each draws the same global batch and keeps its slice
    seed_everything(config.seed)
    tokenizer = M.load_tokenizer(config.model)
    if info.distributed:
        models = _sharded_models(config, tokenizer, policy, info, critic=critic, reference=reference)
    else:
        models = _whole_models(config, tokenizer, policy, device, critic=critic, reference=reference)
    compiled = [r for r in models if config.model.compile and not info.distributed]
    if reward_model:
        # replicated on every rank: frozen, usually small, and a user loader's module need not have
        # a decoder layer list to shard
        rm = M.build_reward_model(config.model, tokenizer, policy["reward"], device)
        if rm is not None:
            models["reward"] = rm
    # what of the user's checkpoint and tokenizer the trainer replaced, both values (the manifest's
    # ``overridden``), read before model.setup may replace a module
    overridden = {s["setting"]: s for s in getattr(tokenizer, "overridden_settings", [])}
    for m in models.values():
        overridden.update({s["setting"]: s for s in getattr(m, "overridden_settings", [])})
    # the user's model code (model.setup) sees every built model before the optimizers and the
    # observer do: a head it adds is trained, and the audit checks the models as modified
    models = M.apply_setup(models, config.model, tokenizer)
    for role in compiled:
        M.compile_layers(models[role])
    algo = config.algo
    lrs = {"actor": algo.lr, "critic": algo.critic_lr}
    optimizers = {r: make_optimizer(models[r], lrs[r], algo.weight_decay, device) for r in lrs if r in models}
    scalers = {r: LossScaler.for_policy(policy[r]) for r in optimizers}
    observer.on_setup(
        config=config.to_dict(),
        policy=policy,
        models=dict(models),
        tokenizer_info={
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "padding_side": tokenizer.padding_side,
            "overridden": list(overridden.values()),
            "tokenizer": tokenizer,  # the audit re-encodes a batch's prompts to check its rows against them
        },
    )
    return Setup(config, device, policy, tokenizer, models, optimizers, scalers, info)


def critic_seed(config: TrainConfig) -> int:
    """The seed `trainer.models.build_critic` gets (its head draws from it, its backbone copies the actor)."""
    return config.seed + 1


def _whole_models(
    config: TrainConfig,
    tokenizer: Any,
    policy: PrecisionPolicy,
    device: torch.device,
    *,
    critic: bool,
    reference: bool,
) -> dict[str, nn.Module]:
    """Actor, critic (a copy of the actor's initial backbone plus a head) and reference, whole."""
    from trainer import models as M

    actor = M.build_causal_lm(config.model, tokenizer, policy["actor"], device, seed=config.seed)
    actor.train()
    models: dict[str, nn.Module] = {"actor": actor}
    if critic:
        models["critic"] = M.build_critic(
            config.model, tokenizer, policy["critic"], device, seed=critic_seed(config), actor=actor
        )
        models["critic"].train()
    if reference:
        models["reference"] = M.build_reference(actor, policy["reference"])
    return models


def _sharded_models(
    config: TrainConfig,
    tokenizer: Any,
    policy: PrecisionPolicy,
    info: dist_mod.DistInfo,
    *,
    critic: bool,
    reference: bool,
) -> dict[str, nn.Module]:
    """The roles sharded with FSDP2 before the optimizers, which must see the DTensor parameters.
    Random-init presets are built on the meta device and each rank materialises only its shards;
    a local ``model.path`` (or ``critic_path``) is loaded whole on every rank, then sharded."""
    from trainer import models as M

    if config.model.compile:
        raise ValueError(
            "model.compile: not supported with several processes yet (FSDP2 + compiled layers is "
            "untested here); set model.compile: false or run one process"
        )
    reshard = dist_mod.SHARDING[config.sharding]
    if config.model.path is None and config.model.critic_path is None:
        models = M.build_sharded_roles(
            config.model,
            tokenizer,
            policy,
            info,
            seed=config.seed,
            critic_seed=critic_seed(config) if critic else None,
            reference=reference,
            reshard_after_forward=reshard,
        )
    else:
        models = _whole_models(config, tokenizer, policy, info.device, critic=critic, reference=reference)
        for role, model in models.items():
            dist_mod.shard_model(model, policy[role], reshard_after_forward=reshard)
    for role in ("actor", "critic"):
        if role in models:
            models[role].train()
    return models


def local_batch(rows: list[Any], setup: Setup, where: str = "algo.batch_size") -> list[Any]:
    """This rank's contiguous slice of the global batch (all of it for one process)."""
    return rows[dist_mod.local_slice(len(rows), setup.dist, where=where)]


def local_size(size: int, setup: Setup, where: str) -> int:
    """A global sequence count (``algo.mini_batch_size``) as this rank's share, so that several
    ranks take as many optimizer steps per epoch as one process would."""
    w = setup.dist.world_size
    if size % w:
        raise ValueError(f"{where}: {size} cannot be split evenly over {w} ranks; use a multiple of {w}")
    return size // w


def backward(
    loss: torch.Tensor, role: str, model: nn.Module, scaler: LossScaler, observer: Observer, accum: float
) -> None:
    """Backward of one micro-batch: ``loss / accum`` times the loss scale."""
    scaler.scale_loss(loss / accum).backward()
    observer.on_backward(role=role, model=model, loss_scale=scaler.scale)


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_step(
    role: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    observer: Observer,
    max_grad_norm: float,
) -> tuple[float, bool]:
    """Unscale, check, clip, step (or skip on non-finite gradients), update the scale -> (grad_norm, skipped).

    ``grad_norm`` is the norm before clipping, like verl's ``actor/grad_norm``. The scaler's ``update``
    runs after the step or skip, so ``scaler_state`` reports the scale the next step will use.
    """
    params = _params(model)
    found_inf = scaler.unscale_(params)
    # the global norm (same on every rank for FSDP2 DTensor gradients); non-finite gradients are
    # left as they are for the auditor instead of becoming nan through clipping
    norm = float(dist_mod.clip_grad_norm_(params, 0.0 if found_inf else max_grad_norm))
    observer.on_before_optimizer_step(role=role, model=model, optimizer=optimizer)
    skipped = not scaler.should_step()
    if not skipped:
        optimizer.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    observer.on_optimizer_step(
        role=role,
        model=model,
        optimizer=optimizer,
        scaler_state=scaler.state(),
        skipped=skipped,
        grad_norm=norm,
    )
    return norm, skipped


def mini_batch_norm(
    mask: torch.Tensor, setup: Setup, horizon: float | None = None, *, per_sequence: bool = True
) -> L.AggNorm:
    """The loss denominators of one mini-batch (``mask``: this rank's rows of it): valid tokens and
    non-empty sequences summed over ranks, and the world size (verl's ``batch_num_tokens``,
    ``global_batch_size``, ``dp_size``). Rows whose every token was rejected (``rollout_rs``) are not
    counted: the seq-mean modes average over the rows that still train, where verl divides by every row
    of the mini-batch, so with rejected rows ours is larger by the fraction rejected (a documented choice:
    a rejected row contributes no gradient, and the loss keeps the scale of the rows that do).
    ``per_sequence``: `trainer.losses.AggNorm`."""
    m = mask.float()
    counts = torch.stack([m.sum(), (m.sum(-1) > 0).float().sum()])
    if setup.dist.distributed:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    tokens, sequences = counts.tolist()
    return L.AggNorm(tokens, sequences, setup.dist.world_size, horizon, per_sequence)


def mean_over_ranks(value: float, setup: Setup) -> float:
    """``value`` averaged over ranks (itself for one process): a statistic the whole batch shares."""
    if not setup.dist.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=setup.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return float(t) / setup.dist.world_size


def convert_rewards(raw: Any, batch_size: int, device: torch.device, where: str) -> torch.Tensor:
    """Whatever a reward function or model returned (list, numpy array, tensor of any dtype) -> float32 [B].

    A [B, 1] result is flattened; any other shape is a user error naming ``where``.
    """
    try:
        t = torch.as_tensor(raw.detach() if isinstance(raw, torch.Tensor) else raw)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"{where}: returned {type(raw).__name__} that is not a list of numbers ({e})"
        ) from None
    if t.numel() != batch_size or (t.dim() > 1 and t.shape[0] != batch_size):
        raise ValueError(
            f"{where}: returned shape {tuple(t.shape)}, expected ({batch_size},) — one score per response"
        )
    return t.reshape(batch_size).to(device=device, dtype=torch.float32)


def split_reward_parts(raw: Any, where: str) -> tuple[Any, dict[str, list[Any]]]:
    """A reward function's result -> (the scores, the named parts). A list of dicts (one per response,
    verl's ``compute_score`` form) gives each dict's ``score`` and, per other key, one value per response
    (None where a response lacks it); anything else is the scores as they are, with no parts."""
    if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(r, Mapping) for r in raw):
        return raw, {}
    for i, r in enumerate(raw):
        if "score" not in r:
            raise ValueError(
                f"{where}: response {i}'s dict has no 'score' (keys: {', '.join(map(str, r))}); a reward "
                "returned as dicts needs 'score' in each, as verl's compute_score"
            )
    keys = dict.fromkeys(k for r in raw for k in r if k != "score")
    return [r["score"] for r in raw], {k: [r.get(k) for r in raw] for k in keys}


def reward_parts(
    parts: Mapping[str, list[Any]], keys: tuple[str, ...], batch_size: int, device: torch.device, where: str
) -> torch.Tensor:
    """The reward parts named by ``keys`` as float32 [K, B] (``algo.gdpo_reward_keys``: GDPO's components);
    a key missing from the result, or a response without a number for it, is a user error naming it."""
    rows = []
    for key in keys:
        values = parts.get(key)
        if values is None:
            have = ", ".join(parts) or "none: it returned plain numbers"
            raise ValueError(
                f"algo.gdpo_reward_keys: {key!r} is not among the parts {where} returned ({have}); return one "
                f"dict per response with 'score' and {key!r} (verl's compute_score form)"
            )
        bad = [i for i, v in enumerate(values) if not isinstance(v, (int, float))]  # a bool is 0 / 1, as verl
        if bad:
            raise ValueError(
                f"algo.gdpo_reward_keys: {where}'s {key!r} is {values[bad[0]]!r} for response {bad[0]}; "
                "expected a number for every response"
            )
        rows.append(values)
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(len(keys), batch_size)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions for left-padded rows: cumsum(mask) - 1, clamped at 0 on the padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def split_indices(n: int, size: int) -> list[torch.Tensor]:
    """Consecutive index chunks of ``size`` (the last may be shorter)."""
    return list(torch.arange(n).split(size))


class Averages:
    """Running means of per-micro-batch metric values, keyed by metric name."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, **values: float | torch.Tensor) -> None:
        for k, v in values.items():
            v = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
            self._sums[k] = self._sums.get(k, 0.0) + v
            self._counts[k] = self._counts.get(k, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}


def _reduce_extras(
    extras: Mapping[str, tuple[float, int]], dist: dist_mod.DistInfo | None
) -> dict[str, float]:
    """The step's extra metrics (``name -> (sum, count)``) as means over every rank's values."""
    extras = dict(extras)
    if dist is not None and dist.distributed:
        # every rank, every step (a rank whose rows had no extra key must still join): the key sets
        # may differ between ranks, so the (sum, count) pairs are gathered, not all-reduced
        gathered: list[Any] = [None] * dist.world_size
        torch.distributed.all_gather_object(gathered, extras)
        extras = {}
        for part in gathered:
            for k, (total, count) in part.items():
                t, c = extras.get(k, (0.0, 0))
                extras[k] = (t + total, c + count)
    return {k: total / count for k, (total, count) in extras.items() if count}


class StepLog:
    """Ends every step the same way: step time, ``on_step_end``, history, the non-finite guard.

    ``sources``: objects the recipe calls that have metrics of their own (a verl ``compute_score``'s
    extra dict keys, `trainer.verl_data.VerlReward`): at a step's end each one's ``take_step_metrics()``
    (``name -> (sum, count)`` since it was last asked) joins the step's metrics, averaged over ranks;
    the recipe's own metrics win a name clash. Nothing is kept outside the log and its sources."""

    def __init__(
        self,
        observer: Observer,
        abort_after: int,
        dist: dist_mod.DistInfo | None = None,
        sources: tuple[Any, ...] = (),
    ) -> None:
        self.observer = observer
        self.dist = dist
        self.abort_after = abort_after
        self.sources = tuple(s for s in sources if callable(getattr(s, "take_step_metrics", None)))
        self.history: list[dict[str, float]] = []
        self._bad = 0
        self._t0 = 0.0

    def _take_extras(self) -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {}
        for source in self.sources:
            for k, (total, count) in source.take_step_metrics().items():
                t, c = out.get(k, (0.0, 0))
                out[k] = (t + total, c + count)
        return out

    def start(self, step: int) -> None:
        self._take_extras()  # a step starts with none
        self.observer.on_step_start(step)
        self._t0 = time.perf_counter()

    def end(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        out = {k: float(v) for k, v in metrics.items()}
        out["perf/step_time_s"] = time.perf_counter() - self._t0
        for k, v in _reduce_extras(self._take_extras(), self.dist).items():
            out.setdefault(k, v)
        if self.dist is not None:
            # every rank, every step: means over ranks (max for perf/*). The guard below reads the
            # reduced loss so all ranks raise together; one rank raising alone would leave the
            # others blocked in their next collective.
            out = dist_mod.reduce_metrics(out, self.dist)
        self.observer.on_step_end(step, out)
        self.history.append(out)
        loss = out.get("actor/loss", 0.0)
        self._bad = self._bad + 1 if not math.isfinite(loss) else 0
        if self.abort_after > 0 and self._bad >= self.abort_after:
            raise NonFiniteLossError(step, self._bad, loss)
        return out


def optimizer_metrics(prefix: str, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> dict[str, float]:
    return {f"{prefix}/lr": optimizer.param_groups[0]["lr"], f"{prefix}/loss_scale": scaler.scale}
