"""Inside the user's plug-ins: what a reward function, reward model or collator computed, and in which dtype.

The trainer hands every call of user code at a plug-in point to its observer
(`trainer.events.Observer.plugin_call`); on audited steps the auditor runs it through `watch`:

* `Recorder`, a `TorchDispatchMode` over the real call, notes the dtype of every floating op, the
  first op whose output is non-finite while its inputs were finite (with the user's file:line: the
  innermost stack frame outside torch, trainer and verlaudit), the ops that ran in fp16/bf16, the
  first fp16/bf16 pointwise op that flushed to 0 a value fp32 holds (the op again on fp32 copies of
  its inputs: an underflow, for user arithmetic, not a reward model's forward), and integers (ids)
  held in a float dtype past the largest integer it holds exactly. It watches the call inside the
  rollout phase too, where the op counter is suspended (a collator runs there).
* A second call under `Promote` (every floating op of the call, explicit casts and autocast's
  included, run in fp32 for a reward model, fp64 for a function) gives the same scores in higher
  precision; `compare` says how far they moved and how many distinct scores the real call kept
  ("12 distinct values became 3"). A reward model's forward is repeated always (it is a pure
  function of its inputs); a reward function or collator only with ``audit.rerun_plugins`` (it may
  keep state, count calls or hit a service). Either way the random number generators are restored
  after the second call, so the run samples what it would have sampled.

* Integer arithmetic that wraps: an add / sub / mul / sum / cumsum ... writing uint8, int8 or int16
  is run again on int64 copies of its inputs (only those ops, so the clean path pays nothing), and
  numpy's own overflow report inside the call (``np.errstate(over='call')``: a numpy integer scalar
  wraps, a float one becomes inf) is kept with the user's line and the narrow integers in scope.
* A collapse of distinct scores is called a cancellation when a low-precision op of the call held
  values far larger than the scores (``CANCEL_RATIO``): the scores are differences of rounded sums.
* A collator's ids of another rank than [batch, length] are checked on every batch by
  `verlaudit.audit.boundaries` (``boundary/collator_shape``).

The findings (`verlaudit.kinds`: ``plugin/nonfinite_op``, ``plugin/low_precision``, ``plugin/underflow``,
``plugin/precision_loss``, ``plugin/int_precision``, ``plugin/int_wrap``, ``plugin/round_trip``) name
the plug-in, its line and the dtype to use. Exercised by `pytest tests/test_audit_plugins.py
tests/test_plugin_wrap_and_rank.py`.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from verlaudit import kinds as K
from verlaudit.audit import guard as audit_guard
from verlaudit.audit import opcount
from verlaudit.audit.frames import user_frame
from verlaudit.dtypes import dtype_name
from verlaudit.rundir import Finding

LOW = (torch.float16, torch.bfloat16)
NARROW_INTS = (torch.uint8, torch.int8, torch.int16)
"""Integer dtypes whose arithmetic wraps within the values a length, a count or a sum reaches."""
_INT_ARITH = frozenset({"add", "sub", "rsub", "mul", "neg", "abs", "pow", "sum", "cumsum", "prod", "cumprod"})
"""Integer ops recomputed in int64 when they write a narrow integer dtype (`Recorder`)."""
KEEP_LINES = 3
"""Distinct user lines kept per finding."""


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _all_finite(ts: list[torch.Tensor]) -> torch.Tensor:
    """One device bool: every value of ``ts`` is finite (no host read)."""
    fine = torch.isfinite(ts[0]).all()
    for t in ts[1:]:
        fine = fine & torch.isfinite(t).all()
    return fine


def _ints(tree: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor)
        and not t.is_floating_point()
        and not t.is_complex()
        and t.dtype != torch.bool
    ]


def _mantissa(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps))


def exact_int_limit(dtype: torch.dtype) -> int:
    """The largest integer up to which every integer is exact in a float dtype (fp16 2048, bf16 256)."""
    return 2 ** (_mantissa(dtype) + 1)


def spacing(dtype: torch.dtype, magnitude: float) -> float:
    """The distance between neighbouring values of ``dtype`` at ``magnitude`` (bf16 at 48: 0.25)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return float(torch.finfo(dtype).tiny)
    return 2.0 ** (math.floor(math.log2(magnitude)) - _mantissa(dtype))


def _to_fp32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW else x


def _recomputable(func: Any, op: str, kwargs: dict) -> bool:
    """A pointwise op that writes a new tensor (not in place, no ``out=``): running it again on fp32
    copies of its inputs changes nothing the call sees."""
    return torch.Tag.pointwise in func.tags and not op.endswith("_") and "out" not in kwargs


def _arithmetic(func: Any, op: str) -> bool:
    """An op that computes (pointwise, reduction, matmul, softmax, norm), not one that makes, copies or
    casts a tensor: ``torch.tensor(x, dtype=torch.bfloat16)`` is the reward's dtype, not its arithmetic."""
    if op in opcount.CAST:
        return False
    tags = func.tags
    return (
        torch.Tag.pointwise in tags
        or torch.Tag.reduction in tags
        or op in opcount.MATMUL
        or op in opcount.SOFTMAX
        or op in opcount.NORM
        or op in _SCANS
    )


_SCANS = frozenset({"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"})
"""Running sums and products: arithmetic that is neither pointwise nor a reduction by torch's tags."""


class Recorder(TorchDispatchMode):
    """Watches one call: dtype counts of its floating ops, the first op that produced a non-finite
    value, its fp16/bf16 ops and its integers held in floats beyond their exact range. The checks
    stay on the device until `settle` (one read at the end of the call)."""

    def __init__(self, *, underflow: bool = True) -> None:
        super().__init__()
        self.underflow = underflow
        """Recompute each fp16/bf16 pointwise op in fp32 to see values it flushed to 0 (user arithmetic;
        off for a reward model, whose dtype is its policy's and whose softmax tails flush by design)."""
        self._flushed: list[tuple[str, str | None, str, torch.Tensor, torch.Tensor]] = []
        """(op, line, dtype, elements flushed to 0, the largest fp32 value among them) per checked op."""
        self._depth = 0
        """The op counter's suspension depth where the call runs (`__enter__`)."""
        self.dtypes: Counter = Counter()
        self.low: dict[tuple[str, str | None, str], int] = {}
        self._low_max: dict[tuple[str, str | None, str], torch.Tensor] = {}
        """(op, line, dtype) -> the largest |value| its outputs held (where a cancellation starts)."""
        """(op, user line, dtype) -> count, in first-seen order."""
        self._nonfinite: list[tuple[str, str | None, str, torch.Tensor, torch.Tensor | bool]] = []
        """(op, line, dtype, outputs finite, inputs from outside the call finite) per computing op."""
        self._produced: dict[int, weakref.ref] = {}
        self._ints: list[tuple[str, str | None, str, torch.Tensor]] = []
        self._wraps: list[tuple[str, str | None, str, torch.Tensor]] = []
        """(op, line, dtype, elements whose int64 result differs) per narrow-integer op."""
        self.numpy_overflows: list[dict[str, Any]] = []
        """numpy's overflow reports inside the call (``np.errstate(over='call')``): line, dtypes in scope."""
        self._np: Any = None
        self._down: dict[int, tuple[weakref.ref, torch.dtype, str | None]] = {}
        """id(tensor) -> (it, the wider dtype it was cast from, the line): casts down inside the call."""
        self.round_trips: list[dict[str, Any]] = []
        """Values cast to fp16/bf16 and back up (rounded, nothing computed in between), first few."""
        self.ops = 0

    broken = False
    """The recorder's own bookkeeping raised once (`guard`): the user's ops then run unrecorded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        wide = None
        if not self.broken:
            try:
                op = func.overloadpacket.__name__
                if op.rstrip("_") in _INT_ARITH and opcount.suspension_depth() <= self._depth:
                    wide = self._int64_reference(
                        func, args, kwargs
                    )  # before an in-place op overwrites its input
            except Exception as exc:  # noqa: BLE001  (the audit's bug: the user's op still runs)
                self._broke(exc)
        out = func(*args, **kwargs)
        if not self.broken:
            try:
                self._record(func, args, kwargs, out, wide)
            except Exception as exc:  # noqa: BLE001
                self._broke(exc)
        return out

    def _broke(self, exc: Exception) -> None:
        self.broken = True
        audit_guard.report("plugin recorder", exc)

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any, wide: Any) -> None:
        """What one op of the plug-in's call did: dtypes, low-precision maxima, non-finite outputs."""
        op = func.overloadpacket.__name__
        if opcount.suspension_depth() > self._depth:
            return  # the audit's own work inside the call (not the rollout phase's suspension)
        if wide is not None:
            self._check_wrap(op, out, wide)
        outs = _floats(out)
        if not outs:
            if func.overloadpacket.__name__ in opcount.CAST and _ints(out):
                self._float_to_int(func, args, kwargs)
            return
        with opcount.suspended():
            self.ops += 1
            dtype = outs[0].dtype
            self.dtypes[dtype_name(dtype) or str(dtype)] += 1
            op = func.overloadpacket.__name__
            if func.is_view:
                return
            line = user_frame(depth=2)
            if op in opcount.CAST:
                self._round_trip(args, outs[0], line)
            name = dtype_name(dtype) or str(dtype)
            if dtype in LOW and _arithmetic(func, op):
                key = (op, line, name)
                self.low[key] = self.low.get(key, 0) + 1
                if outs[0].numel():
                    m = outs[0].detach().abs().amax().float()
                    m = torch.where(torch.isfinite(m), m, m.new_zeros(()))
                    old = self._low_max.get(key)
                    self._low_max[key] = m if old is None else torch.maximum(old, m)
                if self.underflow and _recomputable(func, op, kwargs):
                    self._check_flush(func, args, kwargs, outs[0], (op, line, name))
            fine_out = _all_finite(outs)
            # inputs the call did not make (weights, its arguments) may bring a NaN in: checked once each
            outside = [t for t in _floats((args, kwargs)) if not self._made(t)]
            written = any(
                isinstance(x, float) and not math.isfinite(x) for x in pytree.tree_leaves((args, kwargs))
            )  # r[0] = float("nan"): written by the user, not produced by arithmetic
            fine_in = _all_finite(outside) if outside and not written else not written
            for t in outs:
                self._produced[id(t)] = weakref.ref(t)
            self._nonfinite.append((op, line, name, fine_out, fine_in))
            converts = op in opcount.CAST or torch.Tag.pointwise in func.tags  # not an index or a lookup
            ints = [t for t in _ints((args, kwargs)) if t.numel()] if converts else []
            if ints:
                amax = torch.stack([t.abs().max().to(torch.float64) for t in ints]).max()
                self._ints.append((op, line, name, amax))

    def __enter__(self) -> Recorder:
        self._depth = opcount.suspension_depth()
        self._np = _numpy_errstate(self._numpy_overflow)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self._np is not None:
                self._np.__exit__(None, None, None)
                self._np = None

    def _numpy_overflow(self, kind: str, flag: int) -> None:
        """numpy's error callback: an overflow in a numpy op of the call (integer scalars wrap; floats inf)."""
        if len(self.numpy_overflows) >= KEEP_LINES:
            return
        f = sys._getframe(1)
        narrow = sorted(
            {
                f"{name} {v.dtype}"
                for name, v in f.f_locals.items()
                if getattr(getattr(v, "dtype", None), "kind", None) in ("i", "u") and v.dtype.itemsize < 8
            }
        )[:4]
        self.numpy_overflows.append({"line": user_frame(depth=2), "kind": kind, "narrow": narrow})

    def _int64_reference(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The op on int64 copies of its narrow-integer inputs (None when it has none)."""
        if not any(isinstance(t, torch.Tensor) and t.dtype in NARROW_INTS for t in pytree.tree_leaves(args)):
            return None
        with opcount.suspended():
            up = pytree.tree_map(
                lambda x: x.to(torch.int64) if isinstance(x, torch.Tensor) and x.dtype in NARROW_INTS else x,
                (args, kwargs),
            )
            kw = dict(up[1])
            if isinstance(kw.get("dtype"), torch.dtype) and kw["dtype"] in NARROW_INTS:
                kw["dtype"] = torch.int64
            kw.pop("out", None)
            try:
                ref = getattr(torch.ops.aten, func.overloadpacket.__name__.rstrip("_"))(*up[0], **kw)
            except (RuntimeError, TypeError, AttributeError):
                return None
        return ref if isinstance(ref, torch.Tensor) else None

    def _check_wrap(self, op: str, out: Any, wide: torch.Tensor) -> None:
        res = out if isinstance(out, torch.Tensor) else None
        if res is None or res.dtype not in NARROW_INTS or res.shape != wide.shape:
            return
        with opcount.suspended():
            bad = (res.to(torch.int64) != wide).sum()
            self._wraps.append((op, user_frame(depth=3), dtype_name(res.dtype) or str(res.dtype), bad))

    def _check_flush(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor, at: tuple) -> None:
        """The op again on fp32 copies of its low-precision inputs: elements the real op returned as 0
        where fp32 holds a finite non-zero value below the dtype's smallest normal (an underflow)."""
        up_args, up_kwargs = pytree.tree_map(_to_fp32, (args, kwargs))
        ref = _floats(func(*up_args, **up_kwargs))
        if not ref or ref[0].shape != out.shape:
            return
        r = ref[0]
        tiny = torch.finfo(out.dtype).tiny
        lost = (out == 0) & (r != 0) & torch.isfinite(r) & (r.abs() < tiny)
        biggest = torch.where(lost, r.abs(), r.new_zeros(())).amax() if r.numel() else r.new_zeros(())
        self._flushed.append((*at, lost.sum(), biggest))

    def _round_trip(self, args: tuple, out: torch.Tensor, line: str | None) -> None:
        """A cast down (remembered) or a cast back up of a remembered tensor (a round trip)."""
        src = next((t for t in _floats(args)), None)
        if src is None or src.dtype == out.dtype:
            return
        bits_in, bits_out = torch.finfo(src.dtype).bits, torch.finfo(out.dtype).bits
        if bits_out < bits_in and out.dtype in LOW:
            self._down[id(out)] = (weakref.ref(out), src.dtype, line)
            return
        hit = self._down.get(id(src))
        if hit is not None and hit[0]() is src and bits_out > bits_in and len(self.round_trips) < KEEP_LINES:
            self.round_trips.append({"down": hit[2], "up": line, "high": dtype_name(hit[1]),
                                     "low": dtype_name(src.dtype), "elements": src.numel()})  # fmt: skip

    def _peak(self) -> dict[str, Any] | None:
        """The low-precision op whose outputs reached the largest magnitude (op, line, dtype, value)."""
        if not self._low_max:
            return None
        keys = list(self._low_max)
        values = torch.stack([self._low_max[k].to(torch.float64).cpu() for k in keys]).tolist()
        k = max(range(len(keys)), key=lambda i: values[i])
        op, line, name = keys[k]
        return {"op": op, "line": line, "dtype": name, "value": values[k]}

    def _made(self, t: torch.Tensor) -> bool:
        ref = self._produced.get(id(t))
        return ref is not None and ref() is t

    def _float_to_int(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A float tensor cast to integers: exact only while its values fit the float dtype's integers."""
        ins = [t for t in _floats((args, kwargs)) if t.numel()]
        if not ins:
            return
        with opcount.suspended():
            src = ins[-1]  # copy_(dst, src): the source
            amax = src.detach().abs().max().to(torch.float64)
            amax = torch.where(torch.isfinite(amax), amax, amax.new_zeros(()))
            name = dtype_name(src.dtype) or str(src.dtype)
            self._ints.append((func.overloadpacket.__name__, user_frame(depth=3), name, amax))

    def settle(self) -> dict[str, Any]:
        """What the call did, read once: ``dtypes``, ``low`` (op, line, dtype, count), ``first_nonfinite``
        (op, line, dtype, whether its inputs were already non-finite) and ``int_loss`` (op, line, dtype,
        largest integer, exact limit)."""
        first = None
        if self._nonfinite:
            outs = torch.stack([o for *_, o, _ in self._nonfinite]).tolist()
            at = next((k for k, fine in enumerate(outs) if not fine), None)
            if at is not None:
                op, line, name, _, fine_in = self._nonfinite[at]
                fine_in = bool(fine_in.item()) if isinstance(fine_in, torch.Tensor) else fine_in
                first = {"op": op, "line": line, "dtype": name, "inputs_nonfinite": not fine_in}
        int_loss = []
        if self._ints:
            maxima = torch.stack([a for *_, a in self._ints]).tolist()
            for (op, line, name, _), amax in zip(self._ints, maxima, strict=True):
                limit = exact_int_limit(_DTYPES[name]) if name in _DTYPES else math.inf
                if amax > limit:
                    int_loss.append({"op": op, "line": line, "dtype": name, "max": amax, "limit": limit})
        low = [{"op": op, "line": line, "dtype": d, "count": n} for (op, line, d), n in self.low.items()]
        wrap = None
        if self._wraps:
            counts = torch.stack([n for *_, n in self._wraps]).tolist()
            at = next((k for k, n in enumerate(counts) if n), None)
            if at is not None:
                op, line, name, _ = self._wraps[at]
                wrap = {"op": op, "line": line, "dtype": name, "elements": int(counts[at]), "source": "torch"}
        if wrap is None and self.numpy_overflows:
            wrap = {**self.numpy_overflows[0], "source": "numpy", "reports": len(self.numpy_overflows)}
        underflow = None
        if self._flushed:
            counts = torch.stack([n for *_, n, _ in self._flushed]).tolist()
            at = next((k for k, n in enumerate(counts) if n), None)
            if at is not None:
                op, line, name, _, biggest = self._flushed[at]
                underflow = {"op": op, "line": line, "dtype": name, "elements": int(counts[at]),
                             "ops": sum(1 for n in counts if n), "largest_lost": float(biggest)}  # fmt: skip
        return {
            "int_wrap": wrap,
            "round_trips": self.round_trips,
            "underflow": underflow,
            "dtypes": dict(self.dtypes),
            "ops": self.ops,
            "low": low,
            "low_peak": self._peak(),
            "first_nonfinite": first,
            "int_loss": int_loss,
        }


_DTYPES = {dtype_name(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


class Promote(TorchDispatchMode):
    """Runs every floating op in ``dtype`` (or wider): floating inputs narrower than it are cast up and
    a narrower ``dtype=`` argument (an explicit ``.half()``, autocast's casts, a factory) is raised."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._bits = torch.finfo(dtype).bits

    def _up(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.finfo(x.dtype).bits < self._bits:
            return x.to(self.dtype)
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        want = kwargs.get("dtype")
        if isinstance(want, torch.dtype) and want.is_floating_point and torch.finfo(want).bits < self._bits:
            kwargs["dtype"] = self.dtype
        args, kwargs = pytree.tree_map(self._up, (args, kwargs))
        return func(*args, **kwargs)


def scores_of(result: Any) -> list[float] | None:
    """The numbers a reward returned (a tensor, an array, a list of numbers or of verl's score dicts)."""
    if isinstance(result, torch.Tensor):
        return (
            result.detach().to(torch.float64).flatten().cpu().tolist() if result.is_floating_point() else None
        )
    if hasattr(result, "tolist") and hasattr(result, "dtype"):
        result = result.tolist()
    if isinstance(result, (list, tuple)):
        out = []
        for v in result:
            v = v.get("score") if isinstance(v, dict) else v
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return None
            out.append(float(v))
        return out
    return None


def compare(real: list[float], high: list[float], *, dtype: str | None) -> dict[str, Any] | None:
    """How the real call's scores differ from the high-precision call's: max |difference|, distinct values
    in each, the spacing of ``dtype`` (the real call's lowest) at the scores' magnitude; None when the two
    cannot be compared (different lengths)."""
    if len(real) != len(high) or not real:
        return None
    both = [(a, b) for a, b in zip(real, high, strict=True) if math.isfinite(a) and math.isfinite(b)]
    diff = max((abs(a - b) for a, b in both), default=0.0)
    mag = max((abs(b) for _, b in both), default=0.0)
    out = {
        "max_abs_diff": diff,
        "magnitude": mag,
        "distinct": len(set(real)),
        "distinct_high": len(set(high)),
        "nonfinite": sum(not math.isfinite(a) for a in real),
        "nonfinite_high": sum(not math.isfinite(b) for b in high),
        "dtype": dtype,
    }
    if dtype in _DTYPES:
        out["spacing"] = spacing(_DTYPES[dtype], mag)
    return out


CANCEL_RATIO = 16.0
"""Intermediates this many times the scores' magnitude make a collapse a cancellation (a sum of 16
values of one sign already reaches it; normalisation and softmax stay within a few times)."""


def collapsed(c: dict[str, Any]) -> bool:
    """The real call merged distinct scores: at least 2 fewer distinct values and a quarter of them lost."""
    lost = c["distinct_high"] - c["distinct"]
    return lost >= 2 and lost * 4 >= c["distinct_high"]


def moved(c: dict[str, Any], point: str) -> bool:
    """Scores moved by more than a reward model's own dtype explains (a function: by more than 1e-3 of their
    magnitude, fp64 being the intent of a reward computed with Python numbers)."""
    if point == "reward_model":
        return False  # a reward model in bf16 moves by its rounding; only lost ties or NaNs are findings
    return c["max_abs_diff"] > 1e-3 * max(1.0, c["magnitude"])


def rerun(call: Callable[[], Any], dtype: torch.dtype) -> Any:
    """``call()`` again with its floating ops in ``dtype``; the random generators are restored after."""
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with torch.random.fork_rng(devices=devices), opcount.suspended(), torch.no_grad(), Promote(dtype):
        return call()


_WHAT = {"reward_fn": "reward function", "reward_model": "reward model", "collator": "collator"}
_KEY = {"reward_fn": "data.reward_fn", "reward_model": "model.reward_model", "collator": "data.collator"}


def findings(
    point: str,
    source: str,
    record: dict[str, Any],
    comparison: dict[str, Any] | None,
    *,
    high: str | None,
    step: int | None,
    phase: str | None,
) -> list[Finding]:
    """The findings of one watched call (`Recorder.settle`'s record, `compare`'s comparison)."""
    what, where = _WHAT.get(point, point), f"{_KEY.get(point, point)} ({source})"
    ctx = {"role": "reward" if point != "collator" else "actor", "where": where, "step": step, "phase": phase}
    out: list[Finding] = []
    first = record.get("first_nonfinite")
    if first and not first["inputs_nonfinite"]:
        line = first["line"] or "an unknown line"
        hint = (
            f"compute it in fp32 or fp64 (e.g. x.double() before {first['op']})"
            if first["dtype"] in ("fp16", "bf16")
            else f"guard {first['op']} against its undefined inputs (division by zero, log(0), overflow)"
        )
        out.append(
            Finding(
                severity="error",
                kind=K.PLUGIN_NONFINITE_OP,
                message=f"your {what} produced the first NaN/inf in {first['op']} ({first['dtype']}) at {line}",
                observed=first,
                expected="finite",
                fix=f"at {line}: {hint}",
                **ctx,
            )
        )
    trips = record.get("round_trips") if point != "reward_model" else None  # a model's casts are its policy's
    if trips:
        out.append(_round_trip_finding(what, trips, ctx))
    wrap = record.get("int_wrap")
    if wrap:
        out.append(_wrap_finding(what, wrap, ctx))
    under = record.get("underflow")
    if under:
        out.append(_underflow_finding(what, under, record.get("zero_scores"), ctx))
    low = [
        r for r in record.get("low", ()) if point != "reward_model"
    ]  # a reward model's dtype is its policy's
    if low:
        lines = _lines(low)
        dts = "/".join(sorted({r["dtype"] for r in low}))
        n = sum(r["count"] for r in low)
        out.append(
            Finding(
                severity="warning",
                kind=K.PLUGIN_LOW_PRECISION,
                message=f"your {what} ran {n} floating ops in {dts} (first {low[0]['op']} at {low[0]['line']})",
                observed={"ops": n, "dtypes": record.get("dtypes"), "lines": lines},
                expected="fp32 or fp64 arithmetic in user code",
                fix=f"at {', '.join(str(x) for x in lines)}: compute in fp32 (x.float()) instead of {dts}",
                **ctx,
            )
        )
    for r in record.get("int_loss", ())[:1]:
        out.append(
            Finding(
                severity="error" if point == "collator" else "warning",
                kind=K.PLUGIN_INT_PRECISION,
                message=f"your {what} held integers up to {r['max']:.0f} in {r['dtype']} ({r['op']} at {r['line']}), which "
                f"holds integers exactly only up to {r['limit']}: ids or counts were rounded",
                observed=r,
                expected=f"integers <= {r['limit']} or integer arithmetic",
                fix=f"at {r['line']}: keep ids in torch.long (integer ops, or index with them) instead of {r['dtype']}",
                **ctx,
            )
        )
    if comparison is not None:
        out += _comparison_findings(point, what, record, comparison, high=high, ctx=ctx)
    return out


def _round_trip_finding(what: str, trips: list[dict], ctx: dict) -> Finding:
    """Values cast to fp16/bf16 and straight back up inside the plug-in: rounded, nothing computed."""
    t = trips[0]
    return Finding(
        severity="warning",
        kind=K.PLUGIN_ROUND_TRIP,
        message=f"your {what} cast {t['elements']} value(s) from {t['high']} to {t['low']} at {t['down']} and "
        f"back to {t['high']} at {t['up']}: nothing was computed in {t['low']}, the values were only "
        f"rounded to its spacing",
        observed=trips,
        expected=f"values kept in {t['high']}",
        fix=f"at {t['down']}: drop the cast to {t['low']} (keep {t['high']}), or round on purpose with a "
        "stated precision (torch.round(x, decimals=...))",
        **ctx,
    )


def _wrap_finding(what: str, w: dict, ctx: dict) -> Finding:
    """Integer arithmetic of the plug-in that wrapped around: a torch op on a narrow integer dtype whose
    int64 result differs, or numpy's own overflow report (a numpy integer scalar wraps; a float one
    becomes inf)."""
    line = w.get("line") or "an unknown line"
    if w["source"] == "torch":
        did = f"{w['op']} on {w['dtype']} at {line} wrapped around: {w['elements']} element(s) differ from the same op in int64"
        dtype = w["dtype"]
    else:
        scope = f" (narrow integers there: {', '.join(w['narrow'])})" if w.get("narrow") else ""
        did = (
            f"numpy arithmetic at {line} overflowed{scope}: an integer result wraps around (uint8 3 - 20 is "
            "239), a float one becomes inf"
        )
        dtype = w["narrow"][0].rpartition(" ")[2] if w.get("narrow") else "a narrow dtype"
    return Finding(
        severity="warning",
        kind=K.PLUGIN_INT_WRAP,
        message=f"your {what}'s integer overflow: {did}, so the scores or counts it returned are wrong",
        observed=w,
        expected="integer arithmetic in a dtype wide enough for its values",
        fix=f"at {line}: compute lengths, counts and differences in int64 or Python ints (x.astype(np.int64) / "
        f"x.long()) or floats, not {dtype}",
        **ctx,
    )


def _underflow_finding(what: str, u: dict, zeros: tuple[int, int] | None, ctx: dict) -> Finding:
    """An fp16/bf16 op of the plug-in flushed values to 0: an error when the scores it returned are 0
    for half the batch or more (the underflow reached the reward), else a warning."""
    tiny = torch.finfo(_DTYPES[u["dtype"]]).tiny if u["dtype"] in _DTYPES else None
    below = f", below {u['dtype']}'s smallest normal {tiny:.3g}" if tiny else ""
    reached = ""
    if zeros and zeros[1]:
        reached = f"; {zeros[0]} of the {zeros[1]} scores it returned are exactly 0"
    severe = bool(zeros and zeros[1] and 2 * zeros[0] >= zeros[1])
    line = u["line"] or "an unknown line"
    return Finding(
        severity="error" if severe else "warning",
        kind=K.PLUGIN_UNDERFLOW,
        message=f"your {what}'s {u['op']} in {u['dtype']} at {line} underflowed: {u['elements']} value(s) that "
        f"are non-zero in fp32 (up to {u['largest_lost']:.3g}{below}) became exactly 0{reached}",
        observed={**u, "zero_scores": list(zeros) if zeros else None},
        expected="no value flushed to zero",
        fix=f"at {line}: compute in fp32 or fp64 (torch.float64 / Python floats), and a product of many "
        "probabilities as a sum of their logs (log space) instead of the product",
        **ctx,
    )


def _comparison_findings(
    point: str, what: str, record: dict, c: dict, *, high: str | None, ctx: dict
) -> list[Finding]:
    lines = _lines(record.get("low", ())) or [None]
    at = f" (low-precision ops at {', '.join(str(x) for x in lines)})" if lines[0] else ""
    if c["nonfinite"] > c["nonfinite_high"]:
        msg = (
            f"your {what} returned {c['nonfinite']} non-finite scores; the same call in {high} returned "
            f"{c['nonfinite_high']}: the NaN/inf come from its precision{at}"
        )
    elif collapsed(c):
        sp = (
            f" to {c['dtype']}'s spacing {c['spacing']:g} at magnitude {c['magnitude']:.3g}"
            if "spacing" in c
            else ""
        )
        msg = (
            f"your {what}'s scores rounded{sp}: {c['distinct_high']} distinct values in {high} became "
            f"{c['distinct']}{at}"
        )
        peak = record.get("low_peak")
        if peak and peak["dtype"] in _DTYPES and peak["value"] > CANCEL_RATIO * max(c["magnitude"], 1e-30):
            # intermediates far larger than the scores: the scores are differences of rounded large values
            sp_peak = spacing(_DTYPES[peak["dtype"]], peak["value"])
            msg = (
                f"your {what}'s scores lost precision by cancellation: {peak['op']} at {peak['line']} held values "
                f"up to {peak['value']:.4g} in {peak['dtype']} (spacing {sp_peak:g} there), and the scores "
                f"(magnitude {c['magnitude']:.3g}) are differences of such values: {c['distinct_high']} distinct "
                f"values in {high} became {c['distinct']}{at}"
            )
    elif moved(c, point):
        msg = (
            f"your {what}'s scores moved by up to {c['max_abs_diff']:.3g} against the same call in {high}{at}"
        )
    else:
        return []
    use = "fp32" if point == "reward_model" else "fp64 (Python floats) or fp32"
    fix = (
        f"compute the scores in {use}: cast to float before the normalisation / arithmetic"
        + (f" at {', '.join(str(x) for x in lines)}" if lines[0] else "")
        + (" (or set the reward role's compute dtype to fp32)" if point == "reward_model" else "")
    )
    return [
        Finding(
            severity="error" if c["nonfinite"] > c["nonfinite_high"] or collapsed(c) else "warning",
            kind=K.PLUGIN_PRECISION_LOSS,
            message=msg,
            observed=c,
            expected=f"the same scores as in {high}",
            fix=fix,
            **ctx,
        )
    ]


def _lines(low) -> list[str]:
    """Distinct user lines of low-precision ops, user files first (a preset model's lines are torch's)."""
    seen: list[str] = []
    for r in low:
        if r["line"] and r["line"] not in seen:
            seen.append(r["line"])
    return seen[:KEEP_LINES]


def watch_findings(
    point: str,
    source: str,
    call: Callable[[], Any],
    result: Any,
    recorder: Recorder,
    settings: Any,
    *,
    step: int | None,
    phase: str | None,
) -> list[Finding]:
    """The findings of one watched call: the recorder's, and for a reward model (always) or a reward
    function (with ``settings.rerun_plugins``) the comparison with the same call in higher precision."""
    record = recorder.settle()
    if record.get("underflow"):
        scores = scores_of(result)
        if scores is not None:
            record["zero_scores"] = (sum(v == 0 for v in scores), len(scores))
    comparison, high = None, None
    again = point == "reward_model" or (point == "reward_fn" and getattr(settings, "rerun_plugins", False))
    real = scores_of(result) if again else None
    if real is not None:
        high_dtype = torch.float32 if point == "reward_model" else torch.float64
        high = dtype_name(high_dtype)
        other = scores_of(rerun(call, high_dtype))
        lowest = _lowest(record, result)
        comparison = compare(real, other, dtype=lowest) if other is not None else None
    return findings(point, source, record, comparison, high=high, step=step, phase=phase)


def _lowest(record: dict[str, Any], result: Any) -> str | None:
    """The dtype the scores were last rounded to: the result's when it is a low-precision tensor, else the
    narrowest dtype the call's ops produced."""
    if isinstance(result, torch.Tensor) and result.dtype in LOW:
        return dtype_name(result.dtype)
    seen = set(record.get("dtypes", ()))
    return next((d for d in ("fp16", "bf16", "fp32") if d in seen), None)


def _numpy_errstate(callback: Callable[[str, int], None]) -> Any:
    """An entered ``np.errstate(over='call')`` calling ``callback`` (None without numpy); the user's own
    errstate inside the call wins, and the other error kinds stay as they were."""
    try:
        import numpy as np
    except ImportError:
        return None
    state = np.errstate(over="call", call=callback)
    state.__enter__()
    return state
