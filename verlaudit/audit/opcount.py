"""What actually ran in which dtype: a dispatch-level count of the ops each module executed.

`OpCounter` is a `TorchDispatchMode` (it sees the aten ops that really run, after autocast has
inserted its casts and including the backward) plus a module tracker in the manner of
`torch.utils.module_tracker` (global forward hooks, and multi-gradient hooks for the backward), so
every op is counted under (role, module, phase, pass, category, op, input dtypes, output dtype).
Categories: ``matmul``, ``attention`` (fused attention kernels), ``softmax``, ``norm`` (fused norm
kernels), ``reduction``, ``cast`` (a dtype change), ``pointwise``, ``view`` (no arithmetic) and
``other``. An op whose floating inputs have different dtypes is an implicit promotion (its input
label joins them: ``bf16+fp32``). The ``pass`` is ``forward``, ``backward``, ``recompute`` (a
forward inside the backward: activation checkpointing) or ``optimizer`` (outside the models between
a backward and the next forward: unscale, clipping, the optimizer step). Work done inside `suspended` (the audit's
own: the fp32 shadow, the probes' reductions) is not counted.

Pure functions over the records: `island_ops` answers "is my softmax / norm / loss in fp32?" with
the measured dtypes, `findings` flags a policy's fp32 island that ran in low precision (the report's
tables and differences between variants are `verlaudit.analysis.report.precision`'s). It costs a Python call per op, so it runs
only on sampled full-audit steps. Exercised by `pytest tests/test_audit_opcount.py`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name

_STATE = threading.local()

MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "mv", "addmv",
                    "_scaled_mm", "convolution", "_convolution", "mkldnn_linear"})  # fmt: skip
ATTENTION_PREFIXES = ("_scaled_dot_product", "scaled_dot_product", "_flash_attention", "_efficient_attention",
                      "_cudnn_attention")  # fmt: skip
SOFTMAX = frozenset({"_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax", "logsumexp",
                     "_softmax_backward_data", "_log_softmax_backward_data"})  # fmt: skip
NORM = frozenset({"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
                  "rms_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit"})  # fmt: skip
CAST = frozenset({"_to_copy", "to", "copy_", "_copy_from_and_resize", "_copy_from"})


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Ops run inside are not counted (the audit's own work), on this thread."""
    depth = getattr(_STATE, "suspended", 0)
    _STATE.suspended = depth + 1
    try:
        yield
    finally:
        _STATE.suspended = depth


def is_suspended() -> bool:
    return getattr(_STATE, "suspended", 0) > 0


def suspension_depth() -> int:
    """How many `suspended` blocks are open on this thread: a watcher entered inside one (the plug-in
    recorder in the rollout phase, which is not counted) skips only what is suspended deeper."""
    return getattr(_STATE, "suspended", 0)


def _short(dtype: torch.dtype) -> str:
    return dtype_name(dtype) or str(dtype)


def _order(label: str) -> tuple[int, str]:
    known = ("fp64", "fp32", "bf16", "fp16")
    return (known.index(label) if label in known else len(known), label)


def classify(func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> tuple[str, str, str] | None:
    """(category, input dtypes, output dtype) of one aten op; None when it touches no float tensor."""
    base = func.overloadpacket.__name__
    name = base if base == "copy_" else base.rstrip("_")  # an in-place op counts as its op ("add_": add)
    ins = [
        t.dtype
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    outs = [t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not ins and not outs:
        return None
    in_label = "+".join(sorted({_short(d) for d in ins}, key=_order)) or "-"
    out_label = _short(outs[0]) if outs else "-"
    if name in MATMUL:
        cat = "matmul"
    elif name.startswith(ATTENTION_PREFIXES):
        cat = "attention"
    elif name in SOFTMAX:
        cat = "softmax"
    elif name in NORM:
        cat = "norm"
    elif name in CAST and len(set(ins + outs)) > 1:
        cat = "cast"
        in_label = _short(ins[-1])  # copy_(dst, src): the source's dtype
    elif func.is_view:
        cat = "view"
    elif torch.Tag.reduction in func.tags:
        cat = "reduction"
    elif torch.Tag.pointwise in func.tags:
        cat = "pointwise"
    else:
        cat = "other"
    return cat, in_label, out_label


def _hooks_wanted() -> bool:
    """Backward hooks go on a module's tensors in a grad-enabled forward outside any backward. A
    forward inside a backward is a checkpoint recompute whose graph is never backpropagated: a
    multi-grad hook there never fires, and its closure (which holds the graph's nodes) would keep
    the recomputed activations alive until a garbage collection, undoing the checkpointing."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class OpCounter(TorchDispatchMode):
    """Counts every op of the models in ``names`` (module -> (role, name, kind)), per module and pass;
    ``ctx`` has ``phase``. Use as a context manager around the work to count; `take` returns the
    records and starts afresh."""

    def __init__(self, names: Mapping[int, tuple[str, str, str]], ctx: Any) -> None:
        super().__init__()
        self.names, self.ctx = dict(names), ctx
        self.counts: Counter = Counter()
        self._fwd: list[tuple[str, str, str]] = []
        self._bwd: dict[tuple[str, str, str], int] = {}
        self._handles: list[Any] = []
        self.outside = "forward"
        """The pass of ops outside every module and outside the backward: ``optimizer`` from a backward's
        end (set by the auditor) to the next module forward, else ``forward`` (the loss, the log-probs)."""

    # -- module tracking (the pattern of torch.utils.module_tracker, with role-qualified names) -----
    def _pre(self, module: nn.Module, args: tuple) -> None:
        who = self.names.get(id(module))
        if who is None:
            return
        self.outside = "forward"
        self._fwd.append(who)
        ts = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if ts and _hooks_wanted():
            # the module's backward ends when every input's gradient is computed
            self._handles.append(register_multi_grad_hook(ts, lambda *_, who=who: self._leave_bwd(who)))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        who = self.names.get(id(module))
        if who is None:
            return
        if self._fwd and self._fwd[-1] == who:
            self._fwd.pop()
        ts = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if ts and _hooks_wanted():
            # ... and begins when every output's gradient has arrived
            self._handles.append(register_multi_grad_hook(ts, lambda *_, who=who: self._enter_bwd(who)))

    def _enter_bwd(self, who: tuple[str, str, str]) -> None:
        self._bwd[who] = self._bwd.get(who, 0) + 1

    def _leave_bwd(self, who: tuple[str, str, str]) -> None:
        n = self._bwd.get(who, 0) - 1
        if n > 0:
            self._bwd[who] = n
        else:
            self._bwd.pop(who, None)

    def _where(self) -> tuple[tuple[str, str, str] | None, str]:
        in_bwd = torch._C._current_graph_task_id() != -1
        if self._fwd:
            return self._fwd[-1], "recompute" if in_bwd else "forward"
        if in_bwd:
            deepest = max(self._bwd, key=lambda w: w[1].count(".") + (w[1] != ""), default=None)
            return deepest, "backward"
        return None, self.outside

    # -- the mode ---------------------------------------------------------------------------------
    def __enter__(self) -> OpCounter:
        self._handles += [
            register_module_forward_pre_hook(self._pre),
            # always called: a checkpoint recompute stops early by raising out of the modules it is in
            register_module_forward_hook(self._post, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._fwd.clear()
            self._bwd.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_suspended() and not self.broken:
            try:
                got = classify(func, args, kwargs, out)
                if got is not None:
                    who, pas = self._where()
                    role, name, kind = who if who is not None else (None, "", "")
                    op = func.overloadpacket.__name__
                    self.counts[(role, name, kind, getattr(self.ctx, "phase", None), pas, *got, op)] += 1
            except Exception as exc:  # noqa: BLE001  (the counter's bug: the user's op already ran)
                self.broken = True
                from verlaudit.audit import guard

                guard.report("op counter", exc)
        return out

    broken = False
    """The counter's bookkeeping raised once: it counts nothing more this run (`guard`)."""

    def take(self, step: int | None) -> list[dict[str, Any]]:
        """This period's counts as records, one per distinct key, and a fresh count."""
        counts, self.counts = self.counts, Counter()
        return [
            {
                "step": step,
                "role": role,
                "module": name,
                "kind": kind,
                "phase": phase,
                "pass": pas,
                "category": cat,
                "in": din,
                "out": dout,
                "op": op,
                "count": n,
            }
            for (role, name, kind, phase, pas, cat, din, dout, op), n in sorted(counts.items(), key=str)
        ]


# -- pure functions over records ------------------------------------------------------------------
LOW = ("bf16", "fp16")
PHASE_ROLE = {"ref": "reference", "critic": "critic", "critic_update": "critic", "actor_update": "actor",
              "reward": "reward", "rollout": "rollout"}  # fmt: skip
"""Whose work an op outside every module is (log-probs from logits, losses): the phase's role."""


def _low(label: str) -> bool:
    return any(x in LOW for x in label.split("+"))


def island_ops(records: Iterable[Mapping[str, Any]]) -> dict[str, Counter]:
    """The measured answer to "is my softmax / norm / loss in fp32?": per island, forward op counts by
    input dtype. ``softmax``: softmax ops inside the models; ``attention``: fused attention kernels
    (informative only: they keep their softmax in fp32 internally whatever their inputs); ``norm``:
    reductions and fused norms inside norm modules (the statistics); ``logprobs``: softmax ops outside
    every module (log-probs from logits); ``loss``: reductions outside every module in an update phase."""
    out: dict[str, Counter] = {k: Counter() for k in ("softmax", "attention", "norm", "logprobs", "loss")}
    for r in records:
        cat, inside, n = r["category"], r["role"] is not None, r["count"]
        if r["pass"] != "forward":
            continue
        if cat in ("softmax", "attention") and inside:
            out[cat][r["in"]] += n
        elif inside and r.get("kind") == "norm" and cat in ("reduction", "norm"):
            out["norm"][r["in"]] += n
        elif cat == "softmax" and not inside:
            out["logprobs"][r["in"]] += n
        elif cat == "reduction" and not inside and str(r.get("phase", "")).endswith("update"):
            out["loss"][r["in"]] += n
    return out


def findings(
    records: list[Mapping[str, Any]], islands: Mapping[str, Iterable[str]], *, step: int | None
) -> list:
    """A warning per role and island its policy keeps in fp32 (``islands``: role -> `ISLANDS` names)
    whose ops were measured running on bf16/fp16 inputs."""
    from verlaudit.rundir import Finding

    out = []
    for role, wanted in islands.items():
        mine = [r for r in records if (r["role"] or PHASE_ROLE.get(r["phase"])) == role]
        measured = island_ops(mine)
        for island in wanted:
            low = {k: v for k, v in measured.get(island, Counter()).items() if _low(k)}
            if not low:
                continue
            where = next(
                (
                    r["module"] or "(outside modules)"
                    for r in mine
                    if r["pass"] == "forward" and _low(r["in"]) and _island_of(r) == island
                ),
                None,
            )
            out.append(
                Finding(
                    severity="warning",
                    kind=K.ISLAND_OPS,
                    role=role,
                    where=where,
                    step=step,
                    observed={"island": island, "ops_by_input_dtype": dict(measured[island])},
                    expected="fp32",
                    message=f"the policy keeps {island} in fp32 for {role}, but {sum(low.values())} of its ops ran on "
                    f"{'/'.join(sorted(low))} inputs (first in {where})",
                    fix=f"upcast to fp32 before the {island} computation (x.float()), or run it outside autocast",
                )
            )
    return out


def _island_of(r: Mapping[str, Any]) -> str | None:
    one = island_ops([{**r, "count": 1}])
    return next((k for k, c in one.items() if c), None)
