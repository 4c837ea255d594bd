"""fp32 shadow: how far each module's low-precision output and gradient are from fp32, layer by layer.

On a sampled step, the first forward of each role in each grad mode (outside the rollout) is
shadowed on its first ``rows`` rows. Nothing needs a whole fp32 model: the copies are made one block
at a time (a block is a decoder layer, the embedding, the final norm, the head: `blocks`), so the
extra memory is one block's fp32 weights (0.8 GB for a 7B decoder layer) and a few rows of fp32
activations (the backward's parameter gradients add up to two more block-sized tensors for a moment);
a block's tensors are let go of at its backward, so the model's own checkpoint boundaries are freed
as without the shadow (checked by test_shadow_memory_is_one_block_whatever_the_depth). Four
measures, each a record (`ShadowProbe.records`, written to shadow.jsonl):

- ``local`` (every module inside a block, and the block): the module's fp32 copy runs on the fp32
  cast of the input the module actually received, so the error is the one the module itself adds.
  Compared with the rounding model below, it names where the error first exceeds what the dtype's
  rounding explains (`culprits`).
- ``chain`` (blocks): the fp32 copies run on the fp32 shadow of their inputs, carried from block to
  block by tensor identity, which is the error an fp32 model would show on the same tokens, vs
  depth; at a causal LM's head, the log-prob error per token (``logprob``).
- backward (grad-enabled forwards): per block, ``local`` (the fp32 copy backpropagates the gradient
  the block received) and ``chain`` (the fp32 gradient carried from block to block, seeded with the
  gradient at the head), both against the gradient the block actually passed on; and per module,
  ``param_grad``: its weight gradients from an unhooked copy of the block in its own precision vs
  fp32 on the same rows and output gradient, with the fraction of elements that are zero in low
  precision but not in fp32 (gradients lost to underflow).

The rounding model that says what a dtype explains is in `verlaudit.audit.rounding`.
Exercised by `pytest tests/test_audit_shadow.py`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from verlaudit.audit import opcount
from verlaudit.audit.dtype_checks import module_kind
from verlaudit.audit.rounding import (  # noqa: F401  (the shadow's names for them, as before)
    EXCESS,
    FLOOR_ULPS,
    RHO2,
    expected_composite,
    expected_leaf,
    expected_linear,
    floor_err,
    rel_err,
    unit_roundoff,
)
from verlaudit.dtypes import dtype_name

ROWS = 2
"""Rows of the micro-batch that are shadowed (per-module errors are norms over thousands of
elements: a few rows measure them as well as the whole batch, at a fraction of the cost)."""
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


def _float_leaves(obj: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _rows(obj: Any, b: int, k: int) -> Any:
    """The first ``k`` rows of every tensor whose first dimension is the batch (``b``)."""
    if k >= b:
        return obj
    return pytree.tree_map(
        lambda t: t[:k] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == b else t, obj
    )


def _fp32(obj: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.detach().float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj
    )


def _coarsest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    return max(dtypes, key=unit_roundoff, default=None)


class Fp32Everywhere(TorchDispatchMode):
    """Every op that would make a float tensor coarser than fp32 (a cast, a factory, autocast's own
    casts, a reduction's ``dtype=``) makes an fp32 one instead: the shadow computes the module's code
    in fp32 even where the code itself casts down (``x.to(torch.bfloat16)``, an inner autocast)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        dt = kwargs.get("dtype")
        if isinstance(dt, torch.dtype) and dt.is_floating_point and torch.finfo(dt).eps > _EPS32:
            kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


_EPS32 = torch.finfo(torch.float32).eps


@contextlib.contextmanager
def exact_fp32(device_type: str) -> Iterator[None]:
    """fp32 as fp32: autocast off, TF32 off, no cast below fp32 (`Fp32Everywhere`), and not counted
    by `opcount` (the shadow's own work)."""
    prec = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False), opcount.suspended(), Fp32Everywhere():
            yield
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cudnn.allow_tf32 = cudnn


@dataclasses.dataclass
class _Frame:
    """One module call inside a shadowed pass."""

    module: nn.Module
    args: tuple
    kwargs: dict
    children: list[tuple[float, torch.dtype]] = dataclasses.field(default_factory=list)
    """(expected error, allowed dtype) of the module's children, as they finish."""
    originals: tuple = ()
    """Block calls: the positional arguments as received, before `_pre` put views on them."""
    views: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """Block calls: (original input, the view whose gradient is the block's input gradient)."""


@dataclasses.dataclass
class _Pass:
    """One shadowed forward of one role: its rows, carried shadows and the copies of its blocks."""

    role: str
    grad: bool
    root: nn.Module
    b: int
    k: int
    step: int | None
    phase: str | None
    input_ids: torch.Tensor | None
    mask: torch.Tensor | None
    copies: dict[int, nn.Module] = dataclasses.field(default_factory=dict)
    carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """id(low-precision tensor) -> (that tensor, its fp32 shadow rows), for the chain."""
    stack: list[_Frame] = dataclasses.field(default_factory=list)
    depth: int = 0
    """Blocks finished so far: the chain's depth index."""


@dataclasses.dataclass
class _BlockCall:
    """What a block's backward needs from its forward."""

    name: str
    module: nn.Module
    depth: int
    role: str
    step: int | None
    phase: str | None
    b: int
    k: int
    args: tuple
    kwargs: dict
    chain_args: tuple | None
    chain_kwargs: dict | None
    outputs: list[torch.Tensor]
    autocast: tuple[bool, torch.dtype]
    expected: float
    grad_out: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Output index -> the first ``k`` rows of the gradient that output received (a copy: the
    whole batch's gradient is not kept)."""
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The block's inputs whose gradient is measured (`_Frame.views`)."""
    pending: int = 1
    """Input gradients still to come; at 0 the call lets go of its tensors (`release`)."""

    def keep_grad(self, i: int, g: torch.Tensor) -> None:
        self.grad_out[i] = g.detach()[: self.k].clone()

    def release(self) -> None:
        """Drops every tensor the call holds: the hooks on its outputs hold the call, the call its
        outputs, a cycle that would otherwise keep them until a garbage collection."""
        self.args, self.kwargs, self.chain_args, self.chain_kwargs = (), {}, None, None
        self.outputs, self.inputs, self.grad_out, self.pending = [], [], {}, 0


class ShadowProbe:
    """The shadow's hooks on every role's blocks. ``ctx`` has ``step``, ``phase`` and ``in_backward``
    (a forward during backward is a checkpoint recompute); `records` holds this step's records."""

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        ctx: Any,
        compute: Mapping[str, torch.dtype],
        *,
        rows: int = ROWS,
        backward: bool = True,
    ) -> None:
        self.models, self.ctx, self.rows, self.backward = dict(models), ctx, rows, backward
        self.compute = dict(compute)
        """Role -> the compute dtype its policy states (what its linears may round to)."""
        self.info: dict[int, tuple[str, str, str | None, str]] = {}
        """id(module) -> (role, name, name of its block or None for the root, name inside the block)."""
        self.block_of: dict[int, nn.Module] = {}
        self.roots: dict[int, str] = {id(m): role for role, m in self.models.items()}
        for role, model in self.models.items():
            for bname, block in blocks(model):
                for sub, m in block.named_modules():
                    if id(m) not in self.info:
                        self.info[id(m)] = (role, f"{bname}.{sub}" if sub else bname, bname, sub)
                        self.block_of[id(m)] = block
        self.handles: list[Any] = []
        self.records: list[dict[str, Any]] = []
        self.seconds = 0.0
        """Time spent in the shadow this step (device work included: it synchronises)."""
        self.disabled: str | None = None
        """Why the shadow does not run (sharded parameters; it ran out of memory), else None."""
        if any(hasattr(q, "to_local") for model in self.models.values() for q in model.parameters()):
            self.disabled = (
                "the models are sharded (FSDP2): the shadow copies whole blocks, which needs one process"
            )
        self._done: set[tuple[str, bool]] = set()
        self._pass: _Pass | None = None
        self._calls: list[_BlockCall] = []
        self._grad_carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> ShadowProbe:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def attach(self) -> None:
        if self.handles or self.disabled:
            return
        self._done, self.records, self.seconds = set(), [], 0.0
        mods = {id(m): m for model in self.models.values() for m in model.modules()}
        for i, m in mods.items():
            if i in self.info or i in self.roots:
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for call in self._calls:
            call.release()
        self._pass, self._calls, self._grad_carry = None, [], {}

    def take(self) -> tuple[list[dict[str, Any]], float]:
        """This step's records and shadow seconds, handed over once."""
        out, secs = self.records, self.seconds
        self.records, self.seconds = [], 0.0
        return out, secs

    # -- forward hooks ----------------------------------------------------------------------------
    def _skip(self) -> bool:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return (
            capturing
            or bool(getattr(self.ctx, "in_backward", False))
            or getattr(self.ctx, "phase", None) == "rollout"
        )

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        with opcount.suspended():  # the shadow's work is not the model's ops
            return self._pre_call(module, args, kwargs)

    def _pre_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._skip():
            return None
        p = self._pass
        if id(module) in self.roots:
            if p is None:
                self._start(module, args, kwargs)
            return None
        info = self.info.get(id(module))
        if p is None or info is None or info[0] != p.role:
            return None
        frame = _Frame(module, args, kwargs, originals=args)
        p.stack.append(frame)
        if info[3] != "":
            return None
        # a block: its fp32 copy serves its own call and every module inside it
        p.copies[id(module)] = self._guard(info[1], lambda: hookless_copy(module, torch.float32))
        if not (self.backward and p.grad and torch.is_grad_enabled()):
            return None
        new_args, changed = list(args), False
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
                new_args[i] = x.view_as(x)  # our own node: its gradient is this block's alone
                frame.views.append((x, new_args[i]))
                changed = True
        frame.args = tuple(new_args)
        return (frame.args, kwargs) if changed else None

    def _start(self, root: nn.Module, args: tuple, kwargs: dict) -> None:
        role, grad = self.roots[id(root)], torch.is_grad_enabled()
        if (role, grad) in self._done or self.disabled:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if ids is None or ids.dim() < 2:
            return
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        b = ids.shape[0]
        self._pass = _Pass(
            role=role,
            grad=grad,
            root=root,
            b=b,
            k=min(self.rows, b),
            step=self.ctx.step,
            phase=self.ctx.phase,
            input_ids=ids,
            mask=mask,
        )

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        with opcount.suspended():
            self._post_call(module, output)

    def _post_call(self, module: nn.Module, output: Any) -> None:
        p = self._pass
        if p is None or self._skip():
            return
        if output is None and sys.exc_info()[0] is not None:
            self._pass = None  # the forward raised: the auditor reports that, the shadow stands aside
            return
        if module is p.root:
            self._finish(p, output)
            return
        if not p.stack or p.stack[-1].module is not module:
            return
        frame = p.stack.pop()
        role, name, bname, sub = self.info[id(module)]
        t0 = self._clock()
        got = self._guard(name, lambda: self._local(p, frame, name, sub, output))
        if got is not None and p.stack:
            p.stack[-1].children.append(got)
        if sub == "":
            self._guard(name, lambda: self._block_done(p, frame, name, output, got[0] if got else None))
            p.copies.pop(id(module), None)
            p.depth += 1
        self.seconds += self._clock() - t0

    def _clock(self) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _guard(self, where: str, fn: Callable[[], Any]) -> Any:
        """Runs one piece of shadow work; a failure becomes a ``skipped`` record (a finding later),
        and running out of memory stops the shadow for the rest of the run."""
        try:
            return fn()
        except torch.OutOfMemoryError as e:
            self.disabled = f"out of memory in the shadow of {where}: {str(e).splitlines()[0]}"
            self._emit(self._pass, where, "skipped", reason=self.disabled)
            self._pass = None
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            self._emit(
                self._pass, where, "skipped", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            )
        return None

    def _emit(self, p: _Pass | _BlockCall | None, module: str, measure: str, **fields: Any) -> None:
        base = {"step": getattr(self.ctx, "step", None), "phase": getattr(self.ctx, "phase", None)}
        if p is not None:
            grad = p.grad if isinstance(p, _Pass) else True  # a block's backward belongs to a grad pass
            base = {"step": p.step, "phase": p.phase, "role": p.role, "grad": grad, "rows": p.k}
        self.records.append({**base, "module": module, "measure": measure, **fields})

    # -- the local measure ------------------------------------------------------------------------
    def _copy_of(self, p: _Pass, module: nn.Module, sub: str) -> nn.Module | None:
        block_copy = p.copies.get(id(self.block_of[id(module)]))
        if block_copy is None:
            return None
        return block_copy.get_submodule(sub) if sub else block_copy

    def _local(
        self, p: _Pass, frame: _Frame, name: str, sub: str, output: Any
    ) -> tuple[float, torch.dtype] | None:
        """The module's fp32 copy on the fp32 cast of its own input; records the error and returns
        the rounding model's expectation with the dtype the module may round to (its parent adds
        both to its own)."""
        module = frame.module
        c32 = self._copy_of(p, module, sub)
        lp = _float_leaves(_rows(output, p.b, p.k))
        if c32 is None or not lp:
            return None
        args32, kwargs32 = _fp32(_rows((frame.args, frame.kwargs), p.b, p.k))
        with torch.no_grad(), exact_fp32(lp[0].device.type):
            ref = _float_leaves(c32(*args32, **kwargs32))
        if [t.shape for t in ref] != [t.shape for t in lp]:
            raise ValueError(
                f"fp32 copy gave shapes {[tuple(t.shape) for t in ref]}, the module {[tuple(t.shape) for t in lp]}"
            )
        err = rel_err(lp, ref)
        ins = [t.dtype for t in _float_leaves((frame.args, frame.kwargs))]
        own = [q.dtype for q in module.parameters(recurse=False) if q.is_floating_point()]
        allowed, expected = self._expected(p, module, ins, own, frame.children, args32, ref)
        self._emit(
            p,
            name,
            "local",
            direction="forward",
            kind=module_kind(name, module),
            block=self.info[id(module)][2],
            depth=p.depth,
            dtype=dtype_name(_coarsest([t.dtype for t in lp])),
            allowed=dtype_name(allowed),
            rel_err=err,
            expected=expected,
            ratio=err / expected,
        )
        return expected, allowed

    def _expected(
        self,
        p: _Pass,
        module: nn.Module,
        ins: list[torch.dtype],
        own: list[torch.dtype],
        children: list[tuple[float, torch.dtype]],
        args32: Any,
        ref: list[torch.Tensor],
    ) -> tuple[torch.dtype, float]:
        """What the contract allows the module to round to, and the rounding model's expectation. A
        linear computes in the role's compute dtype; any other module may round to the coarsest dtype
        it was handed (inputs, own parameters, its children's allowance), never below."""
        if isinstance(module, nn.Linear):
            c = self.compute.get(p.role, torch.float32)
            u_c = unit_roundoff(c)
            x, w = _float_leaves(args32)[0], self._copy_of(p, module, self.info[id(module)][3]).weight
            with torch.no_grad(), exact_fp32(x.device.type):
                num = float(((x * x) @ (w * w).t()).double().sum())
                den = float(sum((t.double() ** 2).sum() for t in ref))
            spread = num / den if den > 0 else 1.0
            r_x = any(unit_roundoff(d) < u_c for d in ins)
            r_w = unit_roundoff(module.weight.dtype) < u_c
            return c, expected_linear(
                u_c=u_c, u_out=u_c, r_x=r_x, r_w=r_w, spread=spread, k_inner=module.in_features
            )
        allowed = _coarsest(ins + own + [d for _, d in children]) or torch.float32
        u = unit_roundoff(allowed)
        if not children and not any(True for _ in module.children()):
            return allowed, expected_leaf(u_out=u, r_x=any(unit_roundoff(d) < u for d in ins))
        return allowed, expected_composite([e for e, _ in children], u_out=u)

    # -- the chain measure and the backward ---------------------------------------------------------
    def _carried(self, p: _Pass, t: torch.Tensor) -> torch.Tensor | None:
        hit = p.carry.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        base = t._base
        hit = p.carry.get(id(base)) if base is not None else None
        if hit is None or hit[0] is not base or not base.is_contiguous() or t.dim() == 0:
            return None
        if t.shape[0] != p.b or t.stride(0) != base.stride(0):
            return None  # a view that picks rows: not the same rows as the shadow's
        return hit[1].as_strided((p.k, *t.shape[1:]), t.stride(), t.storage_offset() - base.storage_offset())

    def _block_done(self, p: _Pass, frame: _Frame, name: str, output: Any, expected: float | None) -> None:
        """The chain: the block's fp32 copy on the carried shadow of its inputs."""
        c32 = p.copies.get(id(frame.module))
        if c32 is None:
            return
        carried = [0]

        def shadow_of(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            s = self._carried(p, t) if t.is_floating_point() else None
            if s is not None:
                carried[0] += 1
                return s
            return _fp32(_rows(t, p.b, p.k))

        chain_args, chain_kwargs = pytree.tree_map(shadow_of, (frame.originals, frame.kwargs))
        lp_out = _float_leaves(output)
        with torch.no_grad(), exact_fp32(lp_out[0].device.type if lp_out else "cpu"):
            ref = _float_leaves(c32(*chain_args, **chain_kwargs))
        if len(ref) != len(lp_out):
            return
        for t, s in zip(lp_out, ref):
            p.carry[id(t)] = (t, s)
        self._emit(
            p,
            name,
            "chain",
            direction="forward",
            depth=p.depth,
            restarted=carried[0] == 0,
            rel_err=rel_err([t[: p.k] for t in lp_out], ref),
        )
        if self.backward and p.grad and frame.views and any(t.requires_grad for t in lp_out):
            self._watch_backward(p, frame, name, output, expected, chain_args, chain_kwargs)

    def _watch_backward(
        self,
        p: _Pass,
        frame: _Frame,
        name: str,
        output: Any,
        expected: float | None,
        chain_args: tuple,
        chain_kwargs: dict,
    ) -> None:
        device = frame.views[0][0].device.type
        ac = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        call = _BlockCall(
            name=name,
            module=frame.module,
            depth=p.depth,
            role=p.role,
            step=p.step,
            phase=p.phase,
            b=p.b,
            k=p.k,
            args=frame.originals,
            kwargs=frame.kwargs,
            chain_args=chain_args,
            chain_kwargs=chain_kwargs,
            outputs=_float_leaves(output),
            autocast=ac,
            expected=expected or floor_err(),
            pending=len(frame.views),
        )
        self._calls.append(call)
        for i, t in enumerate(call.outputs):
            if t.requires_grad:
                t.register_hook(lambda g, i=i, call=call: call.keep_grad(i, g))
        # the view_as made in _pre is the first input's consumer node: its gradient is the block's.
        # The hook lives as long as the step's graph: it names the input by index, the call holds it
        # until the block's backward (a closure holding it would keep every block's input to the end)
        call.inputs = [x for x, _ in frame.views]
        for i, (_, v) in enumerate(frame.views):
            v.register_hook(lambda g, call=call, i=i: self._backward_hook(call, i, g))

    def _backward_hook(self, call: _BlockCall, i: int, g_in: torch.Tensor) -> None:
        with opcount.suspended():
            if call.pending > 0 and i < len(call.inputs):
                x = call.inputs[i]
                self._guard(call.name, lambda: self._backward(call, x, g_in))
            call.pending -= 1
            if call.pending <= 0:
                call.release()
                self._calls = [c for c in self._calls if c is not call]

    def _backward(self, call: _BlockCall, x: torch.Tensor, g_in: torch.Tensor) -> None:
        """The block's gradient: local (fp32 copy, same output gradient), chain (carried fp32
        gradient), and per-module parameter gradients (unhooked copy in its own precision vs fp32)."""
        t0 = self._clock()
        b, k = call.b, call.k
        g_out = [call.grad_out.get(i, torch.zeros_like(t[:k])) for i, t in enumerate(call.outputs)]
        g_lp = g_in.detach()[:k]
        device = g_lp.device.type
        args = _rows(call.args, b, k)
        kwargs = _rows(call.kwargs, b, k)
        c32 = hookless_copy(call.module, torch.float32)
        g32, p32 = _vjp(c32, _fp32(args), _fp32(kwargs), [g.float() for g in g_out], device, None)
        err = rel_err([g_lp], [g32[0]]) if g32 else math.nan
        self._emit(
            call,
            call.name,
            "local",
            direction="backward",
            kind="block",
            depth=call.depth,
            rel_err=err,
            expected=call.expected * math.sqrt(2),
            ratio=err / (call.expected * math.sqrt(2)),
        )
        lp_copy = hookless_copy(call.module, share=True)  # the block's own parameters, as new leaves
        _, p_lp = _vjp(
            lp_copy,
            _detach(args),
            _detach(kwargs),
            [g.to(t.dtype) for g, t in zip(g_out, call.outputs)],
            device,
            call.autocast,
        )
        self._param_records(call, p_lp, p32)
        del lp_copy, p32, p_lp, g32
        # the chain: the fp32 gradient carried down from the block(s) that consumed this output
        seed = [self._grad_carry.pop(id(t), (None, None))[1] for t in call.outputs]
        carried = [s if s is not None else g.float() for s, g in zip(seed, g_out)]
        g_chain, _ = _vjp(c32, call.chain_args, call.chain_kwargs, carried, device, None, params=False)
        del c32
        if g_chain:
            self._emit(
                call,
                call.name,
                "chain",
                direction="backward",
                depth=call.depth,
                seeded=all(s is None for s in seed),
                rel_err=rel_err([g_lp], [g_chain[0]]),
            )
            self._carry_grad(x, g_chain[0], b, k)
        self.seconds += self._clock() - t0

    def _carry_grad(self, x: torch.Tensor, g: torch.Tensor, b: int, k: int) -> None:
        """Adds the fp32 gradient ``g`` of input ``x`` (k rows) to what its producer will be seeded
        with; a view of a block's output (the head's slice of the last positions) is scattered back
        into the whole output's rows."""
        base = x._base
        if (
            base is not None
            and base.is_contiguous()
            and x.dim()
            and x.shape[0] == b
            and x.stride(0) == base.stride(0)
        ):
            into = torch.zeros((k, *base.shape[1:]), dtype=g.dtype, device=g.device)
            into.as_strided((k, *x.shape[1:]), x.stride(), x.storage_offset() - base.storage_offset()).copy_(
                g
            )
            x, g = base, into
        prev = self._grad_carry.get(id(x))
        self._grad_carry[id(x)] = (x, g if prev is None else prev[1] + g)

    def _param_records(
        self, call: _BlockCall, p_lp: dict[str, torch.Tensor], p32: dict[str, torch.Tensor]
    ) -> None:
        by_module: dict[str, list[str]] = {}
        for pname in p32:
            by_module.setdefault(pname.rpartition(".")[0], []).append(pname)
        for mod, names in by_module.items():
            lp = [p_lp[n] for n in names if n in p_lp]
            ref = [p32[n] for n in names if n in p_lp]
            if not lp:
                continue
            moving = sum(int((r != 0).sum()) for r in ref)
            lost = sum(int(((a == 0) & (r != 0)).sum()) for a, r in zip(lp, ref))
            where = f"{call.name}.{mod}" if mod else call.name
            self._emit(
                call,
                where,
                "param_grad",
                direction="backward",
                depth=call.depth,
                dtype=dtype_name(_coarsest([t.dtype for t in lp])),
                rel_err=rel_err(lp, ref),
                zero_lost_frac=lost / moving if moving else 0.0,
                elements=sum(t.numel() for t in lp),
            )

    # -- the head ---------------------------------------------------------------------------------
    def _finish(self, p: _Pass, output: Any) -> None:
        """End of the role's forward: the log-prob error per token at a causal LM's head."""
        self._pass = None
        self._done.add((p.role, p.grad))
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or p.input_ids is None or logits.dim() != 3:
            return
        shadow = self._carried(p, logits)
        if shadow is None:
            self._emit(
                p, "logits", "skipped", reason="the head's output is not a block's output: no fp32 logits"
            )
            return
        t0 = self._clock()
        self._guard(
            "logits",
            lambda: self._emit(
                p,
                "logits",
                "logprob",
                **logprob_error(
                    logits[: p.k], shadow, p.input_ids[: p.k], None if p.mask is None else p.mask[: p.k]
                ),
            ),
        )
        self.seconds += self._clock() - t0


def _detach(obj: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)


def _vjp(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    grads: list[torch.Tensor],
    device: str,
    autocast: tuple[bool, torch.dtype] | None,
    *,
    params: bool = True,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients of ``module``'s float outputs (weighted by ``grads``) with respect to its positional
    float inputs and (``params``) its parameters; ``autocast`` None: exact fp32."""
    args = tuple(
        a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )
    xs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    named = [(n, q) for n, q in module.named_parameters() if q.requires_grad] if params else []
    ctx = (
        exact_fp32(device)
        if autocast is None
        else torch.autocast(device, dtype=autocast[1], enabled=autocast[0])
    )
    with torch.enable_grad(), ctx, opcount.suspended():
        outs = _float_leaves(module(*args, **kwargs))
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
        d = diff[keep]
    if not d.numel():
        return {"tokens": 0}
    return {
        "tokens": int(d.numel()),
        "mean_abs": float(d.mean()),
        "rms": float(d.pow(2).mean().sqrt()),
        "max_abs": float(d.max()),
    }
