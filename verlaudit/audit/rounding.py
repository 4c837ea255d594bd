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
    values in ``lp`` give inf, a zero reference with a zero difference gives 0."""
    num = den = 0.0
    for a, b in zip(lp, ref):
        a, b = a.detach().double(), b.detach().double()
        if not bool(torch.isfinite(a).all()):
            return math.inf
        num += float(((a - b) ** 2).sum())
        den += float((b**2).sum())
    if num == 0.0:
        return 0.0
    return math.sqrt(num / den) if den > 0 else math.inf


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
