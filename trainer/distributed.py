"""Several processes, one model: torchrun + FSDP2 (`fully_shard` with `MixedPrecisionPolicy`).

What is here, and why each piece exists:

- `init_distributed()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and joins the
  process group: NCCL with one GPU per rank (``cuda:LOCAL_RANK``), gloo on CPU (so CI runs the same
  code path with two CPU processes). Without torchrun it is a no-op that describes one process.
- `fsdp_mixed_precision()` turns a role's precision contract into FSDP2's `MixedPrecisionPolicy`
  (the mapping is tabled in its docstring), with the reason for each choice.
- `shard_model()` applies `fully_shard` to every decoder layer, then to the root;
  ``reshard_after_forward=True`` is FULL_SHARD (parameters freed after forward, gathered again for
  backward), ``False`` is SHARD_GRAD_OP (kept gathered from forward to backward: less communication,
  more memory).
- `build_sharded()` builds a model on the meta device, shards it, materialises only the local
  shards on the device (`to_empty`) and fills them with the values one process would draw from the
  same seed (`trainer.meta_init`), so a 7B model never exists whole in one process's memory.
- `clip_grad_norm_()` clips DTensor gradients and returns the global norm as a plain tensor.
- `local_slice()`, `reduce_metrics()`, `full_state_dict()`: the batch split, metric averaging and
  gathering that a data-parallel recipe needs.

Loss scaling under FSDP2 is `trainer.precision.LossScaler`: it unscales the local shards and
all-reduces ``found_inf`` over the gradients' device mesh, so every rank skips the same steps.

Exercised by `pytest tests/test_distributed.py` (two gloo processes under torchrun on CPU) and, on
two GPUs, by `python benchmarks/fsdp_llama7b.py --out DIR`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.precision import RolePolicy, dtype_name

SHARDING = {"full_shard": True, "shard_grad_op": False}
"""Sharding strategy name -> ``reshard_after_forward``. FULL_SHARD frees each layer's gathered
parameters after its forward and gathers them again in backward (least memory); SHARD_GRAD_OP keeps
them from forward to backward (one all-gather per layer instead of two, one layer's full
parameters held per layer until its backward)."""


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """``nccl``, ``gloo``, or None for a single process without a process group."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "device": str(self.device),
            "backend": self.backend,
        }


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"environment: {name} is not set although WORLD_SIZE={os.environ.get('WORLD_SIZE')}; "
            "launch with `torchrun --nproc_per_node N ...` (it sets RANK, WORLD_SIZE and LOCAL_RANK)"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment: {name}={value!r} is not an integer") from None


def init_distributed(device: str = "auto", *, timeout_s: float = 1800.0) -> DistInfo:
    """This process's place in the job and its device, decided once: joins torchrun's process group
    when there is one; a single process (no WORLD_SIZE, or 1) gets an info without a group.

    ``device`` is the config's ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N``: ``auto`` is ``cuda`` when a
    GPU is visible, and ``cuda`` is ``cuda:LOCAL_RANK`` (``cuda:0`` for a single process), so every
    consumer sees an indexed device. ``cuda:N`` pins one GPU and is refused for several ranks, since
    all of them would land on the same GPU; ``cuda`` without a visible GPU is refused too.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if world > 1 and device not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"device: {device!r} pins every one of the {world} ranks to the same GPU; use 'cuda' or "
            "'auto' under torchrun (each rank takes cuda:LOCAL_RANK)"
        )
    if use_cuda and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but no CUDA GPU is visible; use device: cpu or auto")
    if world <= 1:
        if not use_cuda:
            dev = torch.device("cpu")
        elif device.startswith("cuda:"):
            dev = torch.device(device)
        else:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return DistInfo(rank=0, world_size=1, local_rank=0, device=dev, backend=None)
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"environment: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                "visible; lower --nproc_per_node or check CUDA_VISIBLE_DEVICES"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if backend == "nccl":
            kwargs["device_id"] = dev  # binds the communicator to this rank's GPU up front
        dist.init_process_group(backend, **kwargs)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, backend=backend)


def destroy() -> None:
    """Leaves the process group (no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fsdp_mixed_precision(role_policy: RolePolicy) -> tuple[Any, dict[str, str]]:
    """The FSDP2 `MixedPrecisionPolicy` for a role, and why each field has its value.

    ========================  ===========  ============  ============  =====================
    role policy               param_dtype  reduce_dtype  output_dtype  autocast in recipes
    ========================  ===========  ============  ============  =====================
    fp32                      None (fp32)  fp32          None          none
    fp16 / bf16 (fp32 master) fp16 / bf16  fp32          None          kept (fp32 islands)
    bf16-pure                 None (bf16)  bf16          None          none
    ========================  ===========  ============  ============  =====================

    With ``param_dtype`` set, FSDP2 all-gathers the fp32 master shards, casts them to the compute
    dtype and runs the layer with low-precision weights, so matmuls no longer need autocast to
    cast (nor cache) weight copies. The recipes still enter ``autocast`` because it is what keeps
    the intended fp32 islands (softmax, log-softmax, norms under autocast's fp32 op list) in fp32;
    buffers such as rotary ``inv_freq`` are not parameters and stay fp32. Gradients are computed in
    the compute dtype, cast to ``reduce_dtype`` for the reduce-scatter, and land on the fp32
    master shards. ``output_dtype`` stays None: logits leave the model in the compute dtype and the
    log-prob island upcasts them chunk by chunk, where an fp32 output would materialise the whole
    fp32 logits tensor (16 x 1024 x 32000 x 4 B = 2 GiB per rank for the 7B benchmark).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reasons: dict[str, str] = {}
    param_dtype = None
    if role_policy.autocast and role_policy.compute_dtype != role_policy.param_dtype:
        param_dtype = role_policy.compute_dtype
        reasons["param_dtype"] = (
            f"{dtype_name(role_policy.param_dtype)} master shards, gathered and cast to "
            f"{dtype_name(param_dtype)} for compute (replaces autocast's weight casts)"
        )
    else:
        reasons["param_dtype"] = (
            f"None: parameters are stored in the compute dtype {dtype_name(role_policy.compute_dtype)}"
        )
    reduce_dtype = role_policy.reduce_dtype
    reasons["reduce_dtype"] = f"{dtype_name(reduce_dtype)}: the role policy's reduce_dtype"
    reasons["output_dtype"] = (
        "None: logits stay in the compute dtype; log-probs upcast chunk-wise (fp32 island)"
    )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=None)
    return mp, reasons


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the longest ``nn.ModuleList`` named ``layers``,
    ``h`` or ``blocks`` (``model.model.layers`` of HF Llama-like models, ``backbone.layers`` of the
    trainer's ValueModel, ``transformer.h`` of GPT-2-like ones)."""
    found = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks") and len(m)
    ]
    if not found:
        raise ValueError(
            f"shard_model: no decoder layer list (an nn.ModuleList named layers, h or blocks) in "
            f"{type(model).__name__}; shard it by hand with torch.distributed.fsdp.fully_shard"
        )
    return list(max(found, key=len))


def shard_model(
    model: nn.Module,
    role_policy: RolePolicy,
    *,
    reshard_after_forward: bool = True,
    mesh: Any = None,
) -> nn.Module:
    """Applies FSDP2 to each decoder layer, then the root (which holds embeddings, final norm and
    head); returns the same module object, now an `FSDPModule`. Needs `init_distributed` first.

    Parameters must already be in ``role_policy.param_dtype`` (the master dtype): FSDP2 shards
    whatever dtype it finds and casts to ``param_dtype`` only for compute. The root is resharded
    after forward only with FULL_SHARD; its parameters are needed again at the start of backward.
    """
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "shard_model: no process group; call trainer.distributed.init_distributed() under torchrun "
            "(single-process runs do not shard)"
        )
    wrong = {dtype_name(p.dtype) for p in model.parameters() if p.dtype != role_policy.param_dtype}
    if wrong:
        raise ValueError(
            f"shard_model: {role_policy.role} parameters are {sorted(wrong)} but the policy stores "
            f"{dtype_name(role_policy.param_dtype)}; cast with trainer.precision.cast_model first"
        )
    mp, _ = fsdp_mixed_precision(role_policy)
    if mesh is None:
        mesh = default_mesh()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def default_mesh() -> Any:
    """A 1-D mesh over every rank, on the device type of the process group's backend. FSDP2's own
    default takes the machine's accelerator, so gloo ranks on a host with one GPU would all try to
    claim a GPU (``invalid device ordinal`` on rank 1) although `init_distributed` chose the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def build_sharded(
    make_model: Callable[[], nn.Module],
    role_policy: RolePolicy,
    info: DistInfo,
    *,
    seed: int = 0,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Builds a big model without ever holding it whole: meta device -> shard -> local shards.

    ``make_model()`` is called on the meta device (e.g. ``lambda: LlamaForCausalLM(config)``) with its
    initialisation recorded (`trainer.meta_init`); parameters are cast to the role's master dtype,
    sharded with `shard_model`, materialised with ``to_empty`` on ``info.device``, and each rank's
    shards get exactly the values of ``torch.manual_seed(seed); make_model().to(param_dtype)`` in one
    process, drawn one full parameter at a time.
    """
    from trainer import meta_init

    model, record = meta_init.record_init(make_model)
    unwritten = sorted({n for n, _ in model.named_parameters()} - {name for name, *_ in record.params})
    if unwritten:
        raise ValueError(f"build_sharded: no initialisation recorded for {', '.join(unwritten[:3])}")
    for p in model.parameters():
        # parameters only: buffers (rotary inv_freq) stay fp32, as from_pretrained keeps them
        p.data = p.data.to(role_policy.param_dtype)
    shard_model(model, role_policy, reshard_after_forward=reshard_after_forward)
    model.to_empty(device=info.device)
    meta_init.replay_init(
        record, info.device, seed, lambda name, value: meta_init.copy_shard_(model.get_parameter(name), value)
    )
    meta_init.rebuild_buffers(model, info.device)
    return model


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (plain or FSDP2 DTensor) as a plain 0-dim tensor,
    identical on every rank; clips to ``max_norm`` when it is > 0 and the norm is finite.

    Unlike ``torch.nn.utils.clip_grad_norm_``, non-finite gradients are left as they are (torch
    would multiply them by inf/inf = nan): the step is skipped anyway, and an auditor looking at
    the gradients before the skip should see the inf that caused it, not a nan made by clipping.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    # get_total_norm reduces DTensor norms across the mesh (Partial -> Replicate), so the clip
    # coefficient is global, not per shard.
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm > 0 and bool(torch.isfinite(full)):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return full


def local_slice(global_size: int, info: DistInfo, *, where: str = "algo.batch_size") -> slice:
    """This rank's contiguous part of a global batch of ``global_size`` rows. Every rank draws the
    same global batch (same seed) and keeps its slice, so the run sees the data the single-process
    run would see."""
    if global_size % info.world_size:
        raise ValueError(
            f"{where}: {global_size} rows cannot be split evenly over {info.world_size} ranks; "
            f"use a multiple of {info.world_size}"
        )
    per = global_size // info.world_size
    return slice(info.rank * per, (info.rank + 1) * per)


def reduce_metrics(metrics: Mapping[str, float], info: DistInfo) -> dict[str, float]:
    """Averages a step's metrics over ranks (losses, rewards, norms), taking the maximum for
    ``perf/*`` (the slowest rank sets the step time and the fullest GPU the memory peak). Every
    rank must call it with the same keys, in any order."""
    if not info.distributed:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=info.device)
    is_max = torch.tensor([k.startswith("perf/") for k in keys], device=info.device)
    summed, peaked = values.clone(), values.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(peaked, op=dist.ReduceOp.MAX)
    out = torch.where(is_max, peaked, summed / info.world_size)
    return dict(zip(keys, out.tolist()))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole onto the CPU (a collective: all ranks call it). For tests and
    small models; a 7B model should be saved with torch.distributed.checkpoint instead."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out
