"""The rounding model of the fp32 shadow (`verlaudit.audit.shadow`): how much relative error a module's
dtype explains, so that a module adding more is named. Checked against measured errors by
`pytest tests/test_audit_shadow.py` and `python benchmarks/rounding_model.py`.

The rounding model. Round-to-nearest in a dtype of unit roundoff u (2^-8 bf16, 2^-11 fp16, 2^-24
fp32) perturbs each value by a relative error of mean square ``RHO2 * u^2``: the absolute error is
uniform over +-ulp/2 (mean square ulp^2 / 12, ulp = 2u 2^e for x in [2^e, 2^(e+1))) and the
mantissa of products and sums of random data is log-uniform over its binade (Benford), where
E[2^(2e) / x^2] = 3 / (8 ln 2); so RHO2 = 1 / (8 ln 2) = 0.180. Independent perturbations add in
squares. A linear layer y = W x computing in dtype c with fp32 accumulation then has

    E|dy|^2 / |y|^2 = RHO2 * (u_c^2 * (r_x + r_w) * s + u_out^2) + RHO2 * u_32^2 * K * s
    s = sum_ij W_ij^2 x_j^2 / sum_i y_i^2      (computed from the data: 1 without cancellation)

with r_x, r_w = 1 when the input or the weight is held in a finer dtype than c (autocast casts it)
and K the inner dimension (accumulation order). Other leaves (norms, activations, rotary) add
``RHO2 * u_out^2 * (2 + r_x)`` (an upcast compute and up to two roundings of the output); a module
with children adds the children's expected errors in squares plus two roundings of its own output:
it assumes each module passes its input's relative error on unchanged, so a module that amplifies
(softmax over large scores, cancellation) shows as exceeding too. Every expectation has a floor of
`FLOOR_ULPS` fp32 ulps (vectorised vs scalar transcendental functions). A module exceeds when its
measured error is more than `EXCESS` times the expectation. `tests/test_audit_shadow.py` checks the
model against measured errors of bf16 and fp16 linears (within 2x), and that a planted lower
precision is the module named.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

RHO2 = 1.0 / (8.0 * math.log(2.0))
"""Mean square relative rounding error of round-to-nearest, in units of u^2 (0.180; module docstring)."""
EXCESS = 4.0
"""A module's measured error above this multiple of the rounding model's expectation is not
explained by its dtype's rounding."""
FLOOR_ULPS = 8.0
"""Every expectation is at least this many fp32 unit roundoffs."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next value: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def rel_err(lp: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """|lp - ref| / |ref| over all tensors together (Frobenius norms, in fp64 sums); non-finite
    values in ``lp`` give inf, a zero reference with a zero difference gives 0. One host read; the
    shadow keeps `rel_err_terms` on the device instead and reads them all at its step's end."""
    return rel_err_of(*rel_err_terms(lp, ref).tolist())


def rel_err_terms(lp: list[torch.Tensor], ref: list[torch.Tensor]) -> torch.Tensor:
    """`rel_err`'s sums on the device, no host read: fp64 [|lp - ref|^2, |ref|^2, non-finite
    elements of lp] (`rel_err_of` turns them into the error)."""
    dev = (lp or ref or [torch.zeros(())])[0].device
    terms = [torch.zeros(3, dtype=torch.float64, device=dev)]
    for a, b in zip(lp, ref):
        a, b = a.detach().double(), b.detach().double()
        terms.append(torch.stack([((a - b) ** 2).sum(), (b**2).sum(), (~torch.isfinite(a)).sum().double()]))
    return torch.stack(terms).sum(0) if len(terms) > 1 else terms[0]


def rel_err_of(num: float, den: float, bad: float) -> float:
    """The relative error from `rel_err_terms`' three sums, read to the host."""
    if bad:
        return math.inf
    if num == 0.0:
        return 0.0
    return math.sqrt(num / den) if den > 0 else math.inf


class DeviceReads:
    """Device numbers kept until one host read: `add` queues a tensor of numbers (any shape, any
    float dtype; kept as fp64) and returns the `Later` of each, `read` copies everything queued to
    the host with one transfer per device; a `Later` called with what `read` returned is its value.
    The shadow's errors are read this way, once a step, so its device work never waits on the host."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._n = 0

    def add(self, t: torch.Tensor) -> list[Later]:
        flat = t.detach().reshape(-1).to(torch.float64)
        first, self._n = self._n, self._n + flat.numel()
        self._parts.append(flat)
        return [Later(lambda v, i=i: v[i]) for i in range(first, self._n)]

    def read(self) -> list[float]:
        """Everything queued, in order (and the queue emptied)."""
        parts, self._parts, self._n = self._parts, [], 0
        out: list[float] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(parts):
            by_device.setdefault(t.device, []).append(i)
        values: dict[int, list[float]] = {}
        for idx in by_device.values():
            flat = torch.cat([parts[i] for i in idx]).tolist()
            at = 0
            for i in idx:
                n = parts[i].numel()
                values[i], at = flat[at : at + n], at + n
        for i in range(len(parts)):
            out += values[i]
        return out


class Later:
    """A number known once the step's device numbers are read (`DeviceReads.read`): ``fn(values)``,
    computed once and kept (a parent's expectation asks for its children's)."""

    __slots__ = ("_done", "_fn", "_value")

    def __init__(self, fn: Callable[[list[float]], Any]) -> None:
        self._fn, self._done, self._value = fn, False, None

    @classmethod
    def known(cls, value: Any) -> Later:
        return cls(lambda _v: value)

    def __call__(self, values: list[float]) -> Any:
        if not self._done:
            self._value, self._done = self._fn(values), True
        return self._value


def floor_err() -> float:
    return FLOOR_ULPS * unit_roundoff(torch.float32)


def expected_linear(*, u_c: float, u_out: float, r_x: bool, r_w: bool, spread: float, k_inner: int) -> float:
    """The rounding model's relative error of a linear layer (module docstring)."""
    u32 = unit_roundoff(torch.float32)
    sq = RHO2 * (u_c**2 * (int(r_x) + int(r_w)) * spread + u_out**2) + RHO2 * u32**2 * k_inner * spread
    return max(math.sqrt(sq), floor_err())


def expected_leaf(*, u_out: float, r_x: bool) -> float:
    """The rounding model's relative error of a leaf that is not a matmul (norm, activation, rotary)."""
    return max(math.sqrt(RHO2 * u_out**2 * (2 + int(r_x))), floor_err())


def expected_composite(children: list[float], *, u_out: float) -> float:
    """A module with children: theirs in squares, plus two roundings of its own output."""
    return max(math.sqrt(sum(c * c for c in children) + 2 * RHO2 * u_out**2), floor_err())
