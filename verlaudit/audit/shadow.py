"""fp32 shadow: how far each module's low-precision output and gradient are from fp32, layer by layer.

On a sampled step, the first forward of each role in each grad mode (outside the rollout) is
shadowed on its first ``rows`` rows. Nothing needs a whole fp32 model: the copies are made one block
at a time (a block is a decoder layer, the embedding, the final norm, the head: `blocks`), so the
extra memory is one block's fp32 weights (0.8 GB for a 7B decoder layer) and a few rows of fp32
activations (the backward's parameter gradients add up to two more block-sized tensors for a moment);
a block's tensors are let go of at its backward, so the model's own checkpoint boundaries are freed
as without the shadow (checked by test_shadow_memory_is_one_block_whatever_the_depth). Four
measures, each a record (`ShadowProbe.take`, written to shadow.jsonl):

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

The rounding model that says what a dtype explains is in `verlaudit.audit.rounding`. Nothing waits
on the device while the model runs: each error is kept as device sums (`rounding.rel_err_terms`) and
the records' numbers are filled in by `ShadowProbe.take` with one host read per device a step
(`rounding.DeviceReads`, `Later`); the shadow's time comes from CUDA events read at the same moment
(`shadow_ops.Stopwatch`). The copies, exact fp32 and the vector-Jacobian products are in
`verlaudit.audit.shadow_ops`. Exercised by `pytest tests/test_audit_shadow.py
tests/test_audit_shadow_accuracy.py`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from verlaudit.audit import guard as audit_guard
from verlaudit.audit import opcount
from verlaudit.audit.dtype_checks import module_kind
from verlaudit.audit.rounding import (  # noqa: F401  (the shadow's names for them, as before)
    EXCESS,
    FLOOR_ULPS,
    RHO2,
    DeviceReads,
    Later,
    expected_composite,
    expected_leaf,
    expected_linear,
    floor_err,
    rel_err,
    rel_err_of,
    rel_err_terms,
    unit_roundoff,
)
from verlaudit.audit.shadow_ops import (  # noqa: F401  (blocks, exact_fp32, ...: the shadow's names, as before)
    DROP,
    MATMULS,
    Fp32Everywhere,
    Stopwatch,
    blocks,
    coarsest,
    detached,
    exact_fp32,
    first_rows,
    float_leaves,
    forget_splits,
    fp32_copy,
    hookless_copy,
    logprob_error,
    logprob_terms,
    vjp,
)
from verlaudit.dtypes import dtype_name

ROWS = 2
"""Rows of the micro-batch that are shadowed (per-module errors are norms over thousands of
elements: a few rows measure them as well as the whole batch, at a fraction of the cost)."""


@dataclasses.dataclass
class _Frame:
    """One module call inside a shadowed pass."""

    module: nn.Module
    args: tuple
    kwargs: dict
    children: list[tuple[Later, torch.dtype]] = dataclasses.field(default_factory=list)
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
    expected: Later
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
        param_grads: bool = True,
        matmul: str = "fp32",
    ) -> None:
        self.models, self.ctx, self.rows, self.backward = dict(models), ctx, rows, backward
        self.param_grads = param_grads
        if matmul not in MATMULS:
            raise ValueError(f"audit.shadow_matmul: {matmul!r}; expected one of {', '.join(MATMULS)}")
        self.matmul = matmul
        """How the fp32 copies' matrix products run (`shadow_ops.MATMULS`); a role whose policy computes
        in fp32 is always shadowed with exact fp32 products."""
        """Also compare each module's weight gradients (``param_grad`` records): one more backward in
        the role's precision and the fp32 backward's weight gradients, per block."""
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
        self._reads = DeviceReads()
        """The step's errors, on the device until `take` reads them at once."""
        self._watch = Stopwatch()
        """The step's shadow time (device work included), summed at `take`."""
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
        self._done, self.records = set(), []
        self._reads, self._watch = DeviceReads(), Stopwatch()
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
        forget_splits()

    def take(self) -> tuple[list[dict[str, Any]], float]:
        """This step's records and shadow seconds, handed over once: the errors kept on the device
        are read here (one host read per device), and the shadow's time summed (one wait)."""
        out, reads, watch = self.records, self._reads, self._watch
        self.records, self._reads, self._watch = [], DeviceReads(), Stopwatch()
        values = reads.read()
        for r in out:
            for key, v in list(r.items()):
                if isinstance(v, Later):
                    r[key] = v(values)
                    if r[key] is DROP:
                        del r[key]
        return out, watch.total()

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
            try:
                return self._pre_call(module, args, kwargs)
            except Exception as exc:  # noqa: BLE001  (the shadow's bug: it stands aside, the forward goes on)
                self._pass = None
                audit_guard.report("fp32 shadow", exc)
                return None

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
            try:
                self._post_call(module, output)
            except Exception as exc:  # noqa: BLE001
                self._pass = None
                audit_guard.report("fp32 shadow", exc)

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
        with self._watch:
            got = self._guard(name, lambda: self._local(p, frame, name, sub, output))
            if got is not None and p.stack:
                p.stack[-1].children.append(got)
            if sub == "":
                self._guard(name, lambda: self._block_done(p, frame, name, output, got[0] if got else None))
                p.copies.pop(id(module), None)
                p.depth += 1

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
    ) -> tuple[Later, torch.dtype] | None:
        """The module's fp32 copy on the fp32 cast of its own input; records the error and returns
        the rounding model's expectation with the dtype the module may round to (its parent adds
        both to its own). Both stay on the device until the step's end (`take`)."""
        module = frame.module
        c32 = self._copy_of(p, module, sub)
        lp = float_leaves(first_rows(output, p.b, p.k))
        if c32 is None or not lp:
            return None
        args32, kwargs32 = fp32_copy(first_rows((frame.args, frame.kwargs), p.b, p.k))
        with torch.no_grad(), exact_fp32(lp[0].device.type, self._matmul(p.role)):
            ref = float_leaves(c32(*args32, **kwargs32))
        if [t.shape for t in ref] != [t.shape for t in lp]:
            raise ValueError(
                f"fp32 copy gave shapes {[tuple(t.shape) for t in ref]}, the module {[tuple(t.shape) for t in lp]}"
            )
        with torch.no_grad():
            num, den, bad = self._reads.add(rel_err_terms(lp, ref))
        err = Later(lambda v: rel_err_of(num(v), den(v), bad(v)))
        ins = [t.dtype for t in float_leaves((frame.args, frame.kwargs))]
        own = [q.dtype for q in module.parameters(recurse=False) if q.is_floating_point()]
        allowed, expected = self._expected(p, module, ins, own, frame.children, args32, den)
        self._emit(
            p,
            name,
            "local",
            direction="forward",
            kind=module_kind(name, module),
            block=self.info[id(module)][2],
            depth=p.depth,
            dtype=dtype_name(coarsest([t.dtype for t in lp])),
            allowed=dtype_name(allowed),
            rel_err=err,
            expected=expected,
            ratio=Later(lambda v: err(v) / expected(v)),
        )
        return expected, allowed

    def _expected(
        self,
        p: _Pass,
        module: nn.Module,
        ins: list[torch.dtype],
        own: list[torch.dtype],
        children: list[tuple[Later, torch.dtype]],
        args32: Any,
        ref_sq: Later,
    ) -> tuple[torch.dtype, Later]:
        """What the contract allows the module to round to, and the rounding model's expectation
        (``ref_sq``: |fp32 output|^2, read with the errors). A linear computes in the role's compute
        dtype; any other module may round to the coarsest dtype it was handed (inputs, own
        parameters, its children's allowance), never below."""
        if isinstance(module, nn.Linear):
            c = self.compute.get(p.role, torch.float32)
            u_c = unit_roundoff(c)
            x, w = float_leaves(args32)[0], self._copy_of(p, module, self.info[id(module)][3]).weight
            # the spread's numerator sum_tij W_ij^2 x_tj^2 is sum_j (sum_t x_tj^2)(sum_i W_ij^2):
            # two reductions, not a second matmul of the layer's size
            with torch.no_grad():
                x2 = x.detach().pow(2).reshape(-1, x.shape[-1]).sum(0, dtype=torch.float64)
                (num,) = self._reads.add(x2 @ w.detach().pow(2).sum(0, dtype=torch.float64))
            r_x = any(unit_roundoff(d) < u_c for d in ins)
            r_w = unit_roundoff(module.weight.dtype) < u_c
            k_inner = module.in_features

            def linear(v: list[float]) -> float:
                spread = num(v) / ref_sq(v) if ref_sq(v) > 0 else 1.0
                return expected_linear(u_c=u_c, u_out=u_c, r_x=r_x, r_w=r_w, spread=spread, k_inner=k_inner)

            return c, Later(linear)
        allowed = coarsest(ins + own + [d for _, d in children]) or torch.float32
        u = unit_roundoff(allowed)
        if not children and not any(True for _ in module.children()):
            return allowed, Later.known(expected_leaf(u_out=u, r_x=any(unit_roundoff(d) < u for d in ins)))
        kids = [e for e, _ in children]
        return allowed, Later(lambda v: expected_composite([e(v) for e in kids], u_out=u))

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

    def _block_done(self, p: _Pass, frame: _Frame, name: str, output: Any, expected: Later | None) -> None:
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
            return fp32_copy(first_rows(t, p.b, p.k))

        chain_args, chain_kwargs = pytree.tree_map(shadow_of, (frame.originals, frame.kwargs))
        lp_out = float_leaves(output)
        with torch.no_grad(), exact_fp32(lp_out[0].device.type if lp_out else "cpu", self._matmul(p.role)):
            ref = float_leaves(c32(*chain_args, **chain_kwargs))
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
            rel_err=self._err([t[: p.k] for t in lp_out], ref),
        )
        if self.backward and p.grad and frame.views and any(t.requires_grad for t in lp_out):
            self._watch_backward(p, frame, name, output, expected, chain_args, chain_kwargs)

    def _watch_backward(
        self,
        p: _Pass,
        frame: _Frame,
        name: str,
        output: Any,
        expected: Later | None,
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
            outputs=float_leaves(output),
            autocast=ac,
            expected=expected if expected is not None else Later.known(floor_err()),
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
        gradient), and per-module parameter gradients (unhooked copy in its own precision vs fp32,
        when `param_grads`)."""
        with self._watch, torch.no_grad():
            self._backward_measures(call, x, g_in)

    def _backward_measures(self, call: _BlockCall, x: torch.Tensor, g_in: torch.Tensor) -> None:
        b, k = call.b, call.k
        g_out = [call.grad_out.get(i, torch.zeros_like(t[:k])) for i, t in enumerate(call.outputs)]
        g_lp = g_in.detach()[:k]
        device = g_lp.device.type
        args = first_rows(call.args, b, k)
        kwargs = first_rows(call.kwargs, b, k)
        c32 = hookless_copy(call.module, torch.float32)
        g32, p32 = vjp(
            c32,
            fp32_copy(args),
            fp32_copy(kwargs),
            [g.float() for g in g_out],
            device,
            None,
            params=self.param_grads,
            matmul=self._matmul(call.role),
        )
        err = self._err([g_lp], [g32[0]]) if g32 else Later.known(math.nan)
        expected = call.expected
        self._emit(
            call,
            call.name,
            "local",
            direction="backward",
            kind="block",
            depth=call.depth,
            rel_err=err,
            expected=Later(lambda v: expected(v) * math.sqrt(2)),
            ratio=Later(lambda v: err(v) / (expected(v) * math.sqrt(2))),
        )
        if self.param_grads:
            lp_copy = hookless_copy(call.module, share=True)  # the block's own parameters, as new leaves
            _, p_lp = vjp(
                lp_copy,
                detached(args),
                detached(kwargs),
                [g.to(t.dtype) for g, t in zip(g_out, call.outputs)],
                device,
                call.autocast,
            )
            self._param_records(call, p_lp, p32)
            del lp_copy, p_lp
        del p32, g32
        # the chain: the fp32 gradient carried down from the block(s) that consumed this output
        seed = [self._grad_carry.pop(id(t), (None, None))[1] for t in call.outputs]
        carried = [s if s is not None else g.float() for s, g in zip(seed, g_out)]
        g_chain, _ = vjp(
            c32,
            call.chain_args,
            call.chain_kwargs,
            carried,
            device,
            None,
            params=False,
            matmul=self._matmul(call.role),
        )
        del c32
        if g_chain:
            self._emit(
                call,
                call.name,
                "chain",
                direction="backward",
                depth=call.depth,
                seeded=all(s is None for s in seed),
                rel_err=self._err([g_lp], [g_chain[0]]),
            )
            self._carry_grad(x, g_chain[0], b, k)

    def _matmul(self, role: str) -> str:
        return "fp32" if self.compute.get(role, torch.float32) == torch.float32 else self.matmul

    def _err(self, lp: list[torch.Tensor], ref: list[torch.Tensor]) -> Later:
        """`rel_err`, kept on the device until `take`."""
        with torch.no_grad():
            num, den, bad = self._reads.add(rel_err_terms(lp, ref))
        return Later(lambda v: rel_err_of(num(v), den(v), bad(v)))

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
            counts = torch.stack(
                [torch.stack([(r != 0).sum(), ((a == 0) & (r != 0)).sum()]) for a, r in zip(lp, ref)]
            ).sum(0)
            moving, lost = self._reads.add(counts)
            where = f"{call.name}.{mod}" if mod else call.name
            self._emit(
                call,
                where,
                "param_grad",
                direction="backward",
                depth=call.depth,
                dtype=dtype_name(coarsest([t.dtype for t in lp])),
                rel_err=self._err(lp, ref),
                zero_lost_frac=Later(
                    lambda v, lost=lost, moving=moving: lost(v) / moving(v) if moving(v) else 0.0
                ),
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
        with self._watch:
            self._guard(
                "logits",
                lambda: self._emit(
                    p,
                    "logits",
                    "logprob",
                    **self._logprob(
                        logits[: p.k], shadow, p.input_ids[: p.k], None if p.mask is None else p.mask[: p.k]
                    ),
                ),
            )

    def _logprob(self, *args: torch.Tensor | None) -> dict[str, Any]:
        """`logprob_error`'s numbers, kept on the device until `take`."""
        tokens, total, sq, top = self._reads.add(logprob_terms(*args))
        return {
            "tokens": Later(lambda v: int(tokens(v))),
            "mean_abs": Later(lambda v: total(v) / tokens(v) if tokens(v) else DROP),
            "rms": Later(lambda v: math.sqrt(sq(v) / tokens(v)) if tokens(v) else DROP),
            "max_abs": Later(lambda v: top(v) if tokens(v) else DROP),
        }
