"""The fp32 "logprobs" island: token log-probs and entropies from logits, without a full fp32 copy.

A naive ``logits.float().log_softmax(-1)`` on a 7B model (32k vocab, 8 x 8k tokens) allocates an
8 GB fp32 copy of the logits, and autograd keeps it (plus the log-softmax output) until backward.
Here the work runs in chunks of rows: each chunk is upcast, reduced to one number per token and
dropped. Custom autograd functions save only the original logits (which the model's graph keeps
anyway) and one fp32 log-sum-exp per token, and recompute softmax chunk by chunk in backward, so
the only full-size tensor they create is the gradient itself, in the logits' dtype.
The training forwards' masks (`attention_inputs`) live here too. Exercised by
`pytest tests/test_models.py -k logprobs` and `pytest tests/test_attention_mask.py`.
"""

from __future__ import annotations

import inspect
import weakref

import torch

CHUNK_ELEMENTS = 1 << 26
"""Logit elements upcast at once (64 Mi elements = 256 MB in fp32); rows per chunk follow from V."""


def _rows_per_chunk(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(vocab, 1))


def _fp32_chunks(logits: torch.Tensor, temperature: float, chunk_elements: int):
    """(row slice, fp32 logits / temperature) for each chunk of rows of a 2-D [N, V] tensor."""
    n, v = logits.shape
    step = _rows_per_chunk(v, chunk_elements)
    for s in range(0, n, step):
        x = logits[s : s + step].float()
        if temperature != 1.0:
            x = x / temperature
        yield slice(s, s + step), x


class _TokenLogprob(torch.autograd.Function):
    """log_softmax(logits / t)[label] in fp32, chunked over rows. Inputs are 2-D: [N, V], [N]."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_elements):  # noqa: ANN001
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows, x in _fp32_chunks(logits, temperature, chunk_elements):
            # log_softmax then gather (not x - logsumexp): bit-identical to the naive expression.
            logp = x.log_softmax(-1)
            out[rows] = logp.gather(-1, labels[rows, None]).squeeze(-1)
            lse[rows] = torch.logsumexp(x, -1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        logits, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, x in _fp32_chunks(logits, t, ctx.chunk_elements):
            g = grad_out[rows].float()[:, None]
            # d/dx log p_label = onehot - softmax; divided by t for the temperature.
            probs = (x - lse[rows, None]).exp_()
            chunk = -probs * g
            chunk.scatter_add_(-1, labels[rows, None], g)
            if t != 1.0:
                chunk /= t
            grad[rows] = chunk.to(grad.dtype)
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits / t) in fp32, chunked over rows. Input is 2-D: [N, V]."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_elements):  # noqa: ANN001
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows, x in _fp32_chunks(logits, temperature, chunk_elements):
            logp = x.log_softmax(-1)
            out[rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        ctx.chunk_elements = chunk_elements
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        (logits,) = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, x in _fp32_chunks(logits, t, ctx.chunk_elements):
            logp = x.log_softmax(-1)
            p = logp.exp()
            # dH/dx_i = -p_i (log p_i - sum_j p_j log p_j)   (the lse terms cancel)
            centered = logp - (p * logp).sum(-1, keepdim=True)
            chunk = -p * centered * grad_out[rows].float()[:, None]
            if t != 1.0:
                chunk /= t
            grad[rows] = chunk.to(grad.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """fp32 log-probs of ``labels`` [B, T] under ``logits`` [B, T, V] (divided by ``temperature`` in
    fp32). Equal to ``(logits.float() / temperature).log_softmax(-1).gather(-1, labels[..., None])``
    without materialising it; differentiable."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: logits {tuple(logits.shape)} vs labels {tuple(labels.shape)}"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    out = _TokenLogprob.apply(flat, labels.reshape(-1).long(), float(temperature), chunk_elements)
    return out.view(labels.shape)


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """fp32 entropy [B, T] of the softmax of ``logits`` [B, T, V] / ``temperature``; differentiable."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _Entropy.apply(flat, float(temperature), chunk_elements).view(logits.shape[:-1])


def sum_pi_squared_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """fp32 sum_v pi_v^2 [B, T] of pi = softmax(``logits`` [B, T, V] / ``temperature``), as verl's
    ``calculate_sum_pi_squared_from_logits``: exp(logsumexp(2 x) - 2 logsumexp(x)), here in fp32 chunk by
    chunk (verl: in the logits' dtype). No gradient: the optimal token baselines read it from the old
    policy's pass (`trainer.advantages.optimal_token_baseline`)."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for rows, x in _fp32_chunks(flat, float(temperature), chunk_elements):
        out[rows] = torch.exp(torch.logsumexp(2.0 * x, -1) - 2.0 * torch.logsumexp(x, -1))
    return out.view(logits.shape[:-1])


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that ignore left padding: the first real token is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def causal_mask_with_self(key_valid: torch.Tensor, queries: int) -> torch.Tensor:
    """Bool[B, 1, Q, K] attention mask: query i sees the valid keys j <= i (``key_valid``: Bool[B, K],
    queries are the first Q positions), and always key i itself, so no softmax row is empty (a
    padding query's output is never read). The training forwards and the rollout's prefill share it."""
    dev = key_valid.device
    k = key_valid.shape[1]
    causal = torch.arange(k, device=dev)[None, :] <= torch.arange(queries, device=dev)[:, None]
    itself = torch.eye(queries, k, dtype=torch.bool, device=dev)
    return (key_valid[:, None, None, :] & causal[None, None]) | itself[None, None]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive bias eager attention expects: 0 where seen, the
    dtype's lowest value where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


# id(mask) -> (weak reference to it, its version counter when read, the answer); see has_left_padding
_LEFT_PADDED: dict[int, tuple[weakref.ref, int, bool]] = {}


def _first_column_has_padding(attention_mask: torch.Tensor) -> bool:
    return bool((attention_mask[:, 0] == 0).any())  # the host read: a device sync on a GPU


def has_left_padding(attention_mask: torch.Tensor) -> bool:
    """Whether any row of a 2-D [B, T] mask starts with padding.

    The answer needs a host read of the mask's first column, a device sync on a GPU. It is read once
    per mask tensor and kept while the tensor lives unmodified, so the forwards of one step over
    the same rollout mask (old log-probs, reference log-probs, old values) share one read. A caller
    that knows the answer when the batch is built (the collator's CPU mask) passes it to
    `attention_inputs` / `sequence_logprobs` as ``left_padded=`` and no forward reads at all.
    """
    if attention_mask.is_inference():  # no version counter: an in-place change could not be seen
        return _first_column_has_padding(attention_mask)
    key = id(attention_mask)
    hit = _LEFT_PADDED.get(key)
    if hit is not None and hit[0]() is attention_mask and hit[1] == attention_mask._version:
        return hit[2]
    answer = _first_column_has_padding(attention_mask)
    ref = weakref.ref(attention_mask, lambda _, key=key: _LEFT_PADDED.pop(key, None))
    _LEFT_PADDED[key] = (ref, attention_mask._version, answer)
    return answer


def attention_inputs(
    model: torch.nn.Module, attention_mask: torch.Tensor, *, left_padded: bool | None = None
) -> dict[str, torch.Tensor]:
    """``attention_mask`` and ``position_ids`` for a training or scoring forward over left-padded rows.

    A left-padding query row sees no key at all under causal + padding masking. Softmax of an empty
    row is undefined: the math kernel returns zeros, but cuDNN's attention (what torch picks for a
    masked SDPA on Hopper) leaves NaN in that row's backward, and ``NaN x 0`` then poisons every
    weight gradient below it (seen on the H200: all 7B GRPO steps skipped). So when a row starts with
    padding, the mask is built here as 4-D with each padding query attending to itself only; real
    tokens see exactly what HF's mask shows them. Without left padding the 2-D mask goes through
    untouched (HF keeps SDPA's causal fast path).

    ``left_padded``: whether any row of the batch starts with padding, if the caller knows; else
    `has_left_padding` reads it (once per mask tensor). True for a batch without left padding is still
    correct (the 4-D mask then equals the causal mask), only not HF's fast path.
    """
    out = {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn not in ("sdpa", "eager") or attention_mask.dim() != 2:
        return out  # flash-attention unpads instead
    if not (has_left_padding(attention_mask) if left_padded is None else left_padded):
        return out  # no row starts with padding: nothing to fix
    mask = causal_mask_with_self(attention_mask.bool(), attention_mask.shape[1])
    if attn == "eager":  # eager attention adds the mask to the scores
        mask = additive_mask(mask, next(model.parameters()).dtype)
    out["attention_mask"] = mask
    return out


def _accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    left_padded: bool | None = None,
    sum_pi_squared: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] (fp32) of the last ``R = response_length`` tokens of ``input_ids`` [B, P+R]
    (prompt left-padded, response right-padded), and optionally the entropies [B, R]. ``sum_pi_squared``:
    a list that gets sum_v pi_v^2 [B, R] of the same forward appended (`sum_pi_squared_from_logits`;
    the optimal token baselines need it and it costs no second forward).

    Logit at position i predicts token i+1, so the R response tokens are predicted by positions
    P-1 .. P+R-2. Only those R logits are computed when the model takes ``logits_to_keep`` (HF
    causal LMs do): the prompt positions' vocab projection is never materialised. The caller owns
    autocast. Padded response positions get values too; mask them with the response mask.
    ``left_padded``: as for `attention_inputs`.
    """
    r = int(response_length)
    if not 0 < r < input_ids.shape[1]:
        raise ValueError(f"sequence_logprobs: response_length {r} must be in [1, {input_ids.shape[1] - 1}]")
    kwargs = {"input_ids": input_ids, **attention_inputs(model, attention_mask, left_padded=left_padded)}
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = r + 1
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    logits = logits[:, -(r + 1) : -1]
    labels = input_ids[:, -r:]
    logprobs = logprobs_from_logits(logits, labels, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if compute_entropy else None
    if sum_pi_squared is not None:
        sum_pi_squared.append(sum_pi_squared_from_logits(logits, temperature=temperature))
    return logprobs, entropy
