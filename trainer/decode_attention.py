"""Single-token attention over a static KV cache that reads only the slots in use.

A decode step's query attends to a preallocated cache ``[B, Hkv, S, D]`` of which only the first
``slot + 1`` slots have been written (and, within those, the prompt's left padding is masked out).
SDPA over the whole cache reads all ``S`` slots every step (at the 7B rollout shape a third again on
top of the weights: reports/gpu/rollout.md). `decode_attention` reads
only the slots that are both written and valid, with the number written held on the device, so the
same launch serves every step of a captured CUDA graph.

On CUDA it is a Triton kernel (flash-decoding: each program takes one (row, query head) and a chunk
of slots with an online softmax in fp32; with few rows x heads the slots are split over several
programs and the partial results combined by a second kernel). Elsewhere, and as the reference the
kernel is tested against, it is SDPA over the whole cache with the same mask. Registered as the
custom op ``trainer::decode_attention`` so a ``torch.compile``d decode step keeps it whole.

Exercised by ``pytest tests/test_fused_decode.py`` (the kernel runs on CPU under Triton's
interpreter there when triton is installed) and, on a GPU, by ``-m gpu`` and
``benchmarks/rollout_bench.py``.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:  # ships with CUDA builds of torch; without it only the reference runs
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

BLOCK = 32
WARPS = 2
"""Cache slots per inner iteration and warps per program: the fastest of a sweep at the 7B rollout
shape on the H200 (33.7 us per layer against 48.8 for 64 / 4; benchmarks/decode_kernels_bench.py,
reports/gpu/rollout.md)."""


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA over the whole cache: ``q`` [B, H, D], ``k``/``v`` [B, Hkv, S, D], ``valid`` Bool[B, S],
    ``slot`` Long[1] (the last slot written; later slots are masked too). Returns [B, H, D]."""
    b, h, d = q.shape
    s = k.shape[2]
    group = h // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    written = torch.arange(s, device=q.device)[None, :] <= slot
    mask = (valid.bool() & written)[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale)
    return out[:, :, 0]


def _layout_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    h, d, hkv = q.shape[1], q.shape[2], k.shape[1]
    if h % hkv or d & (d - 1) or min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        return (
            f"heads {h}, kv heads {hkv}, head dim {d}: the kernel needs heads divisible by kv heads, a "
            "power-of-two head dim and contiguous last dims"
        )
    return None


def triton_available() -> bool:
    return triton is not None


# long: the two Triton kernels are defined together inside the lazy import of triton
@functools.cache
def _kernels(interpret: bool):
    """The two Triton kernels, built on first use (``interpret``: built for Triton's CPU interpreter,
    which reads TRITON_INTERPRET when a kernel is defined; the kernels name ``tl`` as a module global,
    which is what the interpreter patches)."""

    @triton.jit
    def partial_kernel(
        Q,
        K,
        V,
        VALID,
        SLOT,
        OUT,
        MS,
        LS,
        H,
        CHUNK,
        scale,
        sqb,
        sqh,
        skb,
        skh,
        sks,
        svb,
        svh,
        svs,
        svalb,
        sob,
        soh,
        sos,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLK: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        part = tl.program_id(1)
        b = pid // H
        h = pid % H
        kh = h // GROUP
        n = tl.load(SLOT) + 1  # slots written so far
        lo = part * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        den = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for start in range(lo, hi, BLK):
            j = start + tl.arange(0, BLK)
            ok = (j < hi) & (tl.load(VALID + b * svalb + j, mask=j < hi, other=0) != 0)
            kb = tl.load(K + b * skb + kh * skh + j[:, None] * sks + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.sum(kb.to(tl.float32) * q[None, :], 1) * scale
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk with nothing valid yet
            alpha = tl.exp(m - base)
            p = tl.exp(s - base)
            vb = tl.load(V + b * svb + kh * svh + j[:, None] * svs + d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * vb.to(tl.float32), 0)
            den = den * alpha + tl.sum(p, 0)
            m = m_new
        if SPLIT:
            tl.store(OUT + b * sob + h * soh + part * sos + d, acc)
            tl.store(MS + pid * tl.num_programs(1) + part, m)
            tl.store(LS + pid * tl.num_programs(1) + part, den)
        else:
            tl.store(OUT + b * sob + h * soh + d, (acc / den).to(OUT.dtype.element_ty))

    @triton.jit
    def combine_kernel(ACC, MS, LS, OUT, H, sab, sah, sas, sob, soh, D: tl.constexpr, PARTS: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // H
        h = pid % H
        p = tl.arange(0, PARTS)
        d = tl.arange(0, D)
        m = tl.load(MS + pid * PARTS + p)
        den = tl.load(LS + pid * PARTS + p)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        acc = tl.load(ACC + b * sab + h * sah + p[:, None] * sas + d[None, :])
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * den, 0)
        tl.store(OUT + b * sob + h * soh + d, out.to(OUT.dtype.element_ty))

    return partial_kernel, combine_kernel


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _parts(rows_heads: int, slots: int, device: torch.device) -> int:
    """How many programs share one (row, head)'s slots: enough programs for every SM to hold a few,
    at least one `BLOCK` of slots each, a power of two (the combine kernel's width)."""
    sms = _sm_count(device)
    want = max(1, math.ceil(8 * sms / rows_heads))
    most = max(1, slots // BLOCK)
    return 1 << (min(want, most).bit_length() - 1)


def triton_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    *,
    parts: int | None = None,
    block: int = BLOCK,
    warps: int = WARPS,
    stages: int = 1,
) -> torch.Tensor:
    """`reference`'s result through the Triton kernels (``parts``: override the slot split; ``block``
    slots per inner iteration, ``warps`` per program and software-pipelining ``stages`` are tuning knobs
    for the benchmark)."""
    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if (why := _layout_error(q, k, v)) is not None:
        raise ValueError(f"decode_attention: {why}")
    partial_kernel, combine_kernel = _kernels(os.environ.get("TRITON_INTERPRET") == "1")
    parts = parts or _parts(b * h, s, q.device)
    chunk = math.ceil(s / parts / block) * block
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    split = parts > 1
    if split:
        acc = torch.empty((b, h, parts, d), dtype=torch.float32, device=q.device)
        ms = torch.empty((b * h, parts), dtype=torch.float32, device=q.device)
        ls = torch.empty((b * h, parts), dtype=torch.float32, device=q.device)
        o, so = acc, (acc.stride(0), acc.stride(1), acc.stride(2))
    else:
        ms = ls = out  # unused
        o, so = out, (out.stride(0), out.stride(1), 0)
    partial_kernel[(b * h, parts)](
        q,
        k,
        v,
        valid,
        slot,
        o,
        ms,
        ls,
        h,
        chunk,
        float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        valid.stride(0),
        *so,
        GROUP=h // hkv,
        D=d,
        BLK=block,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    if split:
        combine_kernel[(b * h,)](
            acc,
            ms,
            ls,
            out,
            h,
            acc.stride(0),
            acc.stride(1),
            acc.stride(2),
            out.stride(0),
            out.stride(1),
            D=d,
            PARTS=parts,
        )
    return out


@torch.library.custom_op("trainer::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one new query per row over the written, valid cache slots: ``q`` [B, H, D],
    ``k``/``v`` [B, Hkv, S, D], ``valid`` Bool[B, S], ``slot`` Long[1] (last slot written).
    Returns [B, H, D] in ``q``'s dtype."""
    if q.is_cuda and triton_available() and _layout_error(q, k, v) is None:
        return triton_decode_attention(q, k, v, valid, slot, scale)
    return reference(q, k, v, valid, slot, scale).contiguous()


@decode_attention.register_fake
def _(q, k, v, valid, slot, scale):
    return torch.empty_like(q)
