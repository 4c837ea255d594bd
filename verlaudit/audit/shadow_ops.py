"""The fp32 shadow's tools (`verlaudit.audit.shadow`): the blocks a model is copied by, hook-free fp32
copies, fp32 computed as fp32 (`exact_fp32`), vector-Jacobian products, the log-prob error and the
stopwatch that times the shadow without waiting on the device. Exercised by
`pytest tests/test_audit_shadow.py`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from verlaudit.audit import opcount
from verlaudit.audit.rounding import unit_roundoff

_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks in definition order: the items of its module lists (decoder layers) and the
    leaves outside them (embedding, final norm, rotary, head). Everything shadowed lives in a block."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or not any(True for _ in child.children()):
                out.append((path, child))
            else:
                walk(path + ".", child)

    walk("", model)
    return out


def hookless_copy(module: nn.Module, dtype: torch.dtype | None = None, *, share: bool = False) -> nn.Module:
    """A deep copy without any hook (a deep copy would otherwise copy the hooks' owners) and without
    activation checkpointing; parameters and floating buffers in ``dtype`` (None: as they are).
    ``share`` (no ``dtype``): the parameters are new leaves on the module's own storage, no copy
    (gradients taken with respect to them leave the module's ``.grad`` alone)."""
    if share and dtype is not None:
        raise ValueError("hookless_copy: share=True keeps the parameters' storage, so no dtype can be given")
    memo: dict[int, Any] = {}
    for m in module.modules():
        for attr in _HOOK_DICTS:
            d = m.__dict__.get(attr)
            if d is not None:
                memo[id(d)] = type(d)()
    for p in module.parameters():
        data = p.detach() if share else p.detach().to(dtype=dtype or p.dtype, copy=True)
        memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
    for b in module.buffers():
        to = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
        memo[id(b)] = b.detach().to(dtype=to, copy=True)
    out = copy.deepcopy(module, memo)
    for m in out.modules():
        if getattr(m, "gradient_checkpointing", False):
            m.gradient_checkpointing = False
    return out


def float_leaves(obj: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def first_rows(obj: Any, b: int, k: int) -> Any:
    """The first ``k`` rows of every tensor whose first dimension is the batch (``b``)."""
    if k >= b:
        return obj
    return pytree.tree_map(
        lambda t: t[:k] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == b else t, obj
    )


def fp32_copy(obj: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.detach().float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj
    )


def coarsest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    return max(dtypes, key=unit_roundoff, default=None)


MATMULS = ("fp32", "tf32x3")
"""How the shadow's fp32 matrix products run (`exact_fp32`): ``fp32`` on the CUDA cores (an H200's
fp32 is 1/8 of its TF32 tensor cores), ``tf32x3`` as three TF32 tensor-core products of each operand
split into a high and a low TF32 part, hi*hi + hi*lo + lo*hi with fp32 accumulation (CUTLASS's 3xTF32):
each operand is kept to 2^-22 of its value and the dropped lo*lo term is below 2^-22 too, so the
product is within a few 2^-22 of fp32's (`tests/test_audit_shadow_accuracy.py`), at about a third of
fp32's time on a GPU; on a CPU, which has no TF32, it is the same numbers at three times the cost."""


def tf32_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo): hi is ``x`` rounded to TF32 (10 mantissa bits, to nearest), lo the rest rounded to
    TF32; hi + lo is within 2^-22 of x. Infinities and NaNs stay non-finite (a NaN may become an
    infinity)."""
    hi = _round_tf32(x)
    return hi, _round_tf32(x - hi)


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    # half of the 13 dropped bits added, then dropped: round to nearest on the bit pattern (a carry
    # into the exponent is the right rounding; fp32's infinities keep their pattern)
    return (x.view(torch.int32) + 0x1000).bitwise_and_(-0x2000).view(torch.float32)


_SPLITS: Any = None
"""Parameter -> (its version, hi, lo): a weight is split once for all its products (each linear runs
in the module's local measure, its parents', the block's and the chain's, and the backward's),
dropped with the parameter (the block's fp32 copy)."""


def _split_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tf32_split` of ``t``; of a parameter, or a view of one (``weight.t()``), from `_SPLITS`."""
    global _SPLITS
    base = t if isinstance(t, nn.Parameter) else t._base
    if not isinstance(base, nn.Parameter) or not base.is_contiguous():
        return tf32_split(t)
    if _SPLITS is None:
        from torch.utils.weak import WeakIdKeyDictionary

        _SPLITS = WeakIdKeyDictionary()
    hit = _SPLITS.get(base)
    if hit is None or hit[0] != base._version:
        hit = (base._version, *tf32_split(base.detach()))
        _SPLITS[base] = hit
    if t is base:
        return hit[1], hit[2]
    offset = t.storage_offset() - base.storage_offset()
    return tuple(h.as_strided(t.shape, t.stride(), h.storage_offset() + offset) for h in hit[1:])  # type: ignore[return-value]


def forget_splits() -> None:
    """Drops every cached split (they go with their parameters anyway; this is for the end of a step)."""
    if _SPLITS is not None:
        _SPLITS.clear()


def _split_product(mul: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mul(a, b)`` (mm or bmm) as hi*hi + (hi*lo + lo*hi), each a TF32 tensor-core product."""
    a_hi, a_lo = _split_of(a)
    b_hi, b_lo = _split_of(b)
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32: exact on the operands rounded above
    try:
        small = mul(a_hi, b_lo) + mul(a_lo, b_hi)
        return mul(a_hi, b_hi) + small
    finally:
        torch.set_float32_matmul_precision(prec)


class Fp32Everywhere(TorchDispatchMode):
    """Every op that would make a float tensor coarser than fp32 (a cast, a factory, autocast's own
    casts, a reduction's ``dtype=``) makes an fp32 one instead: the shadow computes the module's code
    in fp32 even where the code itself casts down (``x.to(torch.bfloat16)``, an inner autocast).
    ``matmul="tf32x3"``: fp32 matrix products as split TF32 ones (`MATMULS`)."""

    def __init__(self, matmul: str = "fp32") -> None:
        super().__init__()
        if matmul not in MATMULS:
            raise ValueError(f"shadow matmul: {matmul!r}; expected one of {', '.join(MATMULS)}")
        self.split = matmul == "tf32x3"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        dt = kwargs.get("dtype")
        if isinstance(dt, torch.dtype) and dt.is_floating_point and torch.finfo(dt).eps > _EPS32:
            kwargs = {**kwargs, "dtype": torch.float32}
        if self.split and func in _PRODUCTS and all(a.dtype == torch.float32 for a in args[:3]):
            return _PRODUCTS[func](args, kwargs)
        return func(*args, **kwargs)


_EPS32 = torch.finfo(torch.float32).eps
_aten = torch.ops.aten
_PRODUCTS = {
    _aten.mm.default: lambda a, k: _split_product(torch.mm, a[0], a[1]),
    _aten.bmm.default: lambda a, k: _split_product(torch.bmm, a[0], a[1]),
    _aten.addmm.default: lambda a, k: torch.add(
        a[0] * k.get("beta", 1), _split_product(torch.mm, a[1], a[2]), alpha=k.get("alpha", 1)
    ),
    _aten.baddbmm.default: lambda a, k: torch.add(
        a[0] * k.get("beta", 1), _split_product(torch.bmm, a[1], a[2]), alpha=k.get("alpha", 1)
    ),
}
"""The fp32 products `Fp32Everywhere` splits (a linear is an mm or addmm below autograd, attention's
math path a bmm), by what they compute."""


@contextlib.contextmanager
def exact_fp32(device_type: str, matmul: str = "fp32") -> Iterator[None]:
    """fp32 as fp32: autocast off, TF32 off, no cast below fp32 (`Fp32Everywhere`), and not counted
    by `opcount` (the shadow's own work); ``matmul`` as in `MATMULS`."""
    prec = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False), opcount.suspended(), Fp32Everywhere(matmul):
            yield
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cudnn.allow_tf32 = cudnn


class Stopwatch:
    """The shadow's time without waiting on the device: on CUDA an event pair around each piece of
    work (device time from its first to its last kernel, the gaps the host leaves included), summed
    by `total` after one wait at the step's end; on CPU the wall clock. Reentrant pieces count once."""

    def __init__(self) -> None:
        self.host = 0.0
        self.events: list[tuple[Any, Any]] = []
        self._depth = 0
        self._t0 = 0.0
        self._ev: Any = None

    def __enter__(self) -> Stopwatch:
        self._depth += 1
        if self._depth == 1:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._ev = torch.cuda.Event(enable_timing=True)
                self._ev.record()
            else:
                self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._ev is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._ev, end))
            self._ev = None
        else:
            self.host += time.perf_counter() - self._t0

    def total(self) -> float:
        """Seconds; waits once for the device (the backward's pieces may be on another stream)."""
        if self.events:
            torch.cuda.synchronize()
        return self.host + sum(a.elapsed_time(b) for a, b in self.events) / 1000.0


DROP = object()
"""A `Later` that resolves to this drops its field (a log-prob record with no token kept)."""


def detached(obj: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)


def vjp(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    grads: list[torch.Tensor],
    device: str,
    autocast: tuple[bool, torch.dtype] | None,
    *,
    params: bool = True,
    matmul: str = "fp32",
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients of ``module``'s float outputs (weighted by ``grads``) with respect to its positional
    float inputs and (``params``) its parameters; ``autocast`` None: exact fp32 (``matmul``:
    `MATMULS`)."""
    args = tuple(
        a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )
    xs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    named = [(n, q) for n, q in module.named_parameters() if q.requires_grad] if params else []
    ctx = (
        exact_fp32(device, matmul)
        if autocast is None
        else torch.autocast(device, dtype=autocast[1], enabled=autocast[0])
    )
    with torch.enable_grad(), ctx, opcount.suspended():
        outs = float_leaves(module(*args, **kwargs))
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        got = torch.autograd.grad(
            [o for o, _ in pairs], xs + [q for _, q in named], [g for _, g in pairs], allow_unused=True
        )
    g_x = [g if g is not None else torch.zeros_like(x) for g, x in zip(got[: len(xs)], xs)]
    g_p = {n: g for (n, _), g in zip(named, got[len(xs) :]) if g is not None}
    return g_x, g_p


def logprob_error(
    logits: torch.Tensor, shadow: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None
) -> dict[str, Any]:
    """|log p(next token)| differences between low-precision and fp32 logits [k, T', V] over the last
    T' positions of ``input_ids`` [k, T]: mean, rms and max over the tokens the mask keeps."""
    tokens, total, sq, top = logprob_terms(logits, shadow, input_ids, mask).tolist()
    if not tokens:
        return {"tokens": 0}
    return {"tokens": int(tokens), "mean_abs": total / tokens, "rms": math.sqrt(sq / tokens), "max_abs": top}


def logprob_terms(
    logits: torch.Tensor, shadow: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """`logprob_error`'s sums on the device: fp64 [tokens kept, sum |d|, sum d^2, max |d|]."""
    t_all, t_keep = input_ids.shape[1], logits.shape[1]
    first = t_all - t_keep + 1  # logit j predicts the token at position t_all - t_keep + j + 1
    labels = input_ids[:, first:]
    n = labels.shape[1]
    with torch.no_grad(), exact_fp32(logits.device.type):
        lp = logits[:, :n].float().log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        ref = shadow[:, :n].float().log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        diff = (lp - ref).abs().double()
        keep = torch.ones_like(diff, dtype=torch.bool)
        if mask is not None and mask.dim() == 2:
            keep = mask[:, first:].bool()
        elif mask is not None and mask.dim() == 4:
            last = mask[:, 0, -1, first:]
            keep = last.bool() if last.dtype == torch.bool else last == 0
        if not diff.numel():
            return torch.zeros(4, dtype=torch.float64, device=diff.device)
        d = torch.where(keep, diff, torch.zeros_like(diff))  # |d| >= 0: a dropped token adds nothing
        return torch.stack([keep.sum().double(), d.sum(), d.pow(2).sum(), d.max()])
