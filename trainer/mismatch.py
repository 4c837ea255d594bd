"""Rollout-vs-trainer mismatch: metrics and verl's rollout correction, as pure functions over tensors.

The rollout engine records the log-prob of every token it sampled (``rollout``: mu); the trainer
recomputes them with the actor before updating (``old``: pi). They differ when the engine computes
in another dtype, with other kernels or on stale weights. `mismatch_metrics` measures that gap on the
same tokens, for every engine, under verl's names where verl has one (``training/rollout_probs_diff_*``,
``rollout_corr/kl``, ``rollout_corr/k3_kl``, ``rollout_corr/*ppl*``, ``rollout_corr/chi2_*``), NeMo-RL's
``token_mult_prob_error``, and ours for the rest. `rollout_correction` is verl's
``algorithm.rollout_correction``: truncated importance weights (token or sequence) and rejection
(token / sequence divergence thresholds), with verl's metrics for what was clipped or dropped.

Shapes: ``[B, R]`` (rows, response tokens), masks 1 on valid tokens. Log-ratios are clamped to
+-`SAFETY_BOUND` before ``exp``, as verl does. Exercised by `pytest tests/test_mismatch.py`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SAFETY_BOUND = 20.0
"""|log-ratio| bound before exponentiating (verl's): exp(20) ~ 4.9e8 stays finite in fp32."""

QUANTILES = (0.5, 0.9, 0.99)
"""Quantiles of the per-token probability difference reported as ``training/rollout_probs_diff_pNN``."""


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.float()[mask.bool()]


def _seq_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values.float() * mask.float()).sum(-1)


def _seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(values, mask) / mask.float().sum(-1).clamp(min=1.0)


def quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile``'s linear interpolation over a 1-D tensor of any size (torch.quantile
    refuses more than 2**24 elements)."""
    v = values.float().sort().values
    pos = q * (v.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def kl_estimators(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token estimators of KL(rollout || train) from ``log_ratio = log pi_train - log mu_rollout``
    on tokens sampled by the rollout (Schulman's k1, k2, k3): k1 = -r, k2 = r^2 / 2,
    k3 = exp(r) - 1 - r (unbiased and >= 0)."""
    r = log_ratio.float().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -r, "k2": 0.5 * r * r, "k3": torch.expm1(r) - r}


def _probs_metrics(rollout_lp: torch.Tensor, old_lp: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` names plus quantiles of |p_rollout - p_train| per token."""
    p_roll, p_old = _masked(rollout_lp, m).exp(), _masked(old_lp, m).exp()
    diff = (p_roll - p_old).abs()
    signed = _masked(rollout_lp, m) - _masked(old_lp, m)
    out = {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
        "training/rollout_log_probs_abs_diff_mean": float(signed.abs().mean()),
        "training/rollout_log_probs_signed_diff_mean": float(signed.mean()),
    }
    for q in QUANTILES:
        out[f"training/rollout_probs_diff_p{round(q * 100)}"] = quantile(diff, q)
    pearson = float("nan")
    if diff.numel() > 1 and float(p_roll.std()) > 0 and float(p_old.std()) > 0:
        pearson = float(torch.corrcoef(torch.stack([p_old, p_roll]))[0, 1])
    out["training/rollout_actor_probs_pearson_corr"] = pearson
    return out


def _kl_ppl_metrics(rollout_lp: torch.Tensor, old_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL estimators per token and per sequence, perplexities and chi^2 (verl's ``rollout_corr/`` names
    where verl has them: kl, k3_kl, *_ppl, log_ppl_*, ppl_ratio, chi2_token, chi2_seq)."""
    m = mask.float()
    rows = m.sum(-1) > 0
    log_ratio = old_lp.float() - rollout_lp.float()
    est = kl_estimators(log_ratio)
    out: dict[str, float] = {}
    for k, name in (("k1", "kl"), ("k2", "k2_kl"), ("k3", "k3_kl")):
        out[f"rollout_corr/{name}"] = float(_masked(est[k], mask).mean())
        # per sequence: the token estimators summed over the sequence (verl's seq_sum_k*); for k1 that
        # is log mu(y) / pi(y), the sequence-level KL[mu || pi] estimate
        seq = _seq_sum(est[k], mask)[rows]
        out[f"rollout_corr/seq_{name}"] = float(seq.mean())
        out[f"rollout_corr/seq_{name}_max"] = float(seq.max())
    mean_lp_train, mean_lp_roll = _seq_mean(old_lp, mask)[rows], _seq_mean(rollout_lp, mask)[rows]
    log_ppl_diff = mean_lp_roll - mean_lp_train
    out.update(
        {
            "rollout_corr/training_ppl": float((-mean_lp_train).exp().mean()),
            "rollout_corr/training_log_ppl": float((-mean_lp_train).mean()),
            "rollout_corr/rollout_ppl": float((-mean_lp_roll).exp().mean()),
            "rollout_corr/rollout_log_ppl": float((-mean_lp_roll).mean()),
            "rollout_corr/log_ppl_diff": float(log_ppl_diff.mean()),
            "rollout_corr/log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
            "rollout_corr/log_ppl_diff_max": float(log_ppl_diff.max()),
            "rollout_corr/log_ppl_diff_min": float(log_ppl_diff.min()),
            "rollout_corr/ppl_ratio": float(log_ppl_diff.exp().mean()),
        }
    )
    rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    out["rollout_corr/chi2_token"] = float(_masked(rho.square(), mask).mean() - 1.0)
    seq_log_ratio = _seq_sum(log_ratio, mask)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out["rollout_corr/chi2_seq"] = float((2.0 * seq_log_ratio).exp().mean() - 1.0)
    return out


def _ratio_metrics(rollout_lp: torch.Tensor, old_lp: torch.Tensor, mask: torch.Tensor, bound: float) -> dict:
    """Token importance ratios w = pi_train / mu_rollout, untruncated: mean / min / max, the
    normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1], the fraction outside
    [1/bound, bound], and NeMo-RL's token_mult_prob_error = mean exp(|log mu - log pi|)."""
    lr = _masked(old_lp, mask) - _masked(rollout_lp, mask)
    w = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    return {
        "rollout_corr/token_ratio_mean": float(w.mean()),
        "rollout_corr/token_ratio_min": float(w.min()),
        "rollout_corr/token_ratio_max": float(w.max()),
        "rollout_corr/token_ratio_eff_sample_size": float(w.sum() ** 2 / (w.numel() * w.square().sum())),
        "rollout_corr/token_ratio_fraction_outside": float(
            ((lr > math.log(bound)) | (lr < -math.log(bound))).float().mean()
        ),
        "rollout_corr/token_mult_prob_error": float(lr.abs().clamp(max=SAFETY_BOUND).exp().mean()),
    }


def worst_tokens(
    rollout_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    k: int = 5,
) -> list[dict[str, float]]:
    """The ``k`` valid tokens with the largest |p_rollout - p_train|, largest first: row, position in
    the response, both probabilities, the log-prob difference and (when given) the trainer's entropy
    of the distribution at that position."""
    diff = (rollout_logprobs.float().exp() - old_logprobs.float().exp()).abs()
    diff = diff.masked_fill(~mask.bool(), -1.0)
    n = min(k, int(mask.bool().sum()))
    if n == 0:
        return []
    values, flat = diff.flatten().topk(n)
    out = []
    cols = diff.shape[1]
    for v, i in zip(values.tolist(), flat.tolist()):
        row, pos = divmod(i, cols)
        item = {
            "row": float(row),
            "position": float(pos),
            "prob_diff": v,
            "rollout_prob": float(rollout_logprobs[row, pos].float().exp()),
            "train_prob": float(old_logprobs[row, pos].float().exp()),
            "logprob_diff": float(rollout_logprobs[row, pos].float() - old_logprobs[row, pos].float()),
        }
        if entropy is not None:
            item["entropy"] = float(entropy[row, pos])
        out.append(item)
    return out


def mismatch_metrics(
    rollout_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ratio_bound: float = 2.0,
) -> dict[str, float]:
    """Every mismatch metric of one step, over the valid tokens of ``mask`` (see the module doc).
    ``ratio_bound`` is C of ``token_ratio_fraction_outside``; ``entropy`` (the trainer's, per token)
    is reported at the worst token. An empty mask gives ``training/rollout_probs_diff_valid: 0`` only."""
    if not bool(mask.bool().any()):
        return {"training/rollout_probs_diff_valid": 0.0}
    out = _probs_metrics(rollout_logprobs, old_logprobs, mask)
    out.update(_kl_ppl_metrics(rollout_logprobs, old_logprobs, mask))
    out.update(_ratio_metrics(rollout_logprobs, old_logprobs, mask, ratio_bound))
    absdiff = (_masked(rollout_logprobs, mask) - _masked(old_logprobs, mask)).abs()
    out["rollout_corr/abs_diff_mean"] = float(absdiff.mean())  # log-prob differences (our first names)
    out["rollout_corr/abs_diff_max"] = float(absdiff.max())
    (worst,) = worst_tokens(rollout_logprobs, old_logprobs, mask, entropy, k=1)
    out.update({f"rollout_corr/worst_token_{key}": value for key, value in worst.items()})
    return out


@dataclasses.dataclass(frozen=True)
class Correction:
    """What `rollout_correction` decided for one batch."""

    mask: torch.Tensor
    """The response mask with rejected tokens / sequences set to 0 (same dtype as the input mask)."""
    weights: torch.Tensor | None
    """Detached truncated importance weights [B, R] (0 on padding), or None without ``rollout_is``."""
    metrics: dict[str, float]
    """verl's ``rollout_corr/rollout_is_*`` and ``rollout_corr/rollout_rs_*`` metrics."""


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
    *,
    lower: float | None = None,
    truncated_metrics: bool = False,
    raw_seq_fractions: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's importance weights: per token exp(r_t), or per sequence exp(sum_t r_t) on each of its tokens
    (r clamped to +-20 first), zero on padding, then truncated at ``threshold`` (TIS), or with ``lower``
    (IcePop, verl 0.8 on) set to 0 outside [``lower``, ``threshold``]; optionally divided by their batch
    mean (over tokens, or over sequences).

    Metrics: before verl 0.8 of the raw weights, std and effective sample size of them clamped to
    [1/C, C]. With ``truncated_metrics`` (verl 0.8 on, d2916f5a0) of the weights the loss uses, std and
    ESS of them clamped to [0, C], while the fractions above / below the bounds and a sequence weight's
    max / min stay of the raw ones; the per-sequence fractions of the raw per-sequence means with
    ``raw_seq_fractions`` (verl 0.9 on, bdfedd461), else of the used ones. IcePop adds
    ``rollout_is_oob_ratio``, the fraction of tokens outside the bounds."""
    m = mask.float()
    if level == "token":
        log_w = log_ratio.float()
        raw = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * m
    elif level == "sequence":
        log_w = _seq_sum(log_ratio, mask)[:, None]
        raw = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(m) * m
    else:
        raise ValueError(f"rollout_correction.rollout_is: {level!r}; expected token or sequence")
    if lower is None:
        w = raw.clamp(max=threshold)
    else:
        w = torch.where((raw >= lower) & (raw <= threshold), raw, torch.zeros_like(raw))
    if truncated_metrics:
        metrics = _is_metrics(w, raw, log_w, mask, level, threshold, lower, 0.0, raw_seq_fractions)
    else:
        metrics = _is_metrics(raw, raw, log_w, mask, level, threshold, lower, 1.0 / threshold, True)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(
            _masked(((raw < lower) | (raw > threshold)).float(), mask).mean()
        )
    w = w.detach()
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / m.sum().clamp(min=1.0)
        else:
            rows = (m.sum(-1) > 0).float()
            mean = (_seq_mean(w, mask) * rows).sum() / rows.sum().clamp(min=1e-8)
        metrics["rollout_is_batch_norm_factor"] = float(mean) if float(mean) > 1e-8 else 1.0
        if float(mean) > 1e-8:
            w = w / mean
    return w, metrics


def _is_metrics(w, raw, log_w, mask, level, upper, lower, floor, raw_seq_fractions) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (names without the ``rollout_corr/`` prefix): ``w`` the weights the
    statistics are of, ``raw`` / ``log_w`` the raw weights and log-weights the fractions are of, ``floor``
    the lower clamp of the std and ESS."""
    m, valid = mask.float(), mask.bool()
    lower = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {"rollout_is_mean": float((w * m).sum() / m.sum())}
    if level == "sequence":
        out["rollout_is_max"] = float(log_w.max().clamp(max=SAFETY_BOUND).exp())
        out["rollout_is_min"] = float(log_w.min().exp())
        out["rollout_is_ratio_fraction_high"] = float((log_w > math.log(upper)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((log_w < math.log(lower)).float().mean())
    else:
        out["rollout_is_max"] = float(w.masked_fill(~valid, float("-inf")).max())
        out["rollout_is_min"] = float(w.masked_fill(~valid, float("inf")).min())
        out["rollout_is_ratio_fraction_high"] = float(_masked((raw > upper).float(), mask).mean())
        out["rollout_is_ratio_fraction_low"] = float(_masked((raw < lower).float(), mask).mean())
    clamped = w.clamp(min=floor, max=upper)
    cmean = _masked(clamped, mask).mean()
    out["rollout_is_std"] = (
        float((_masked(clamped.square(), mask).mean() - cmean.square()).clamp(min=0).sqrt())
        if int(valid.sum()) > 1
        else 0.0
    )
    out["rollout_is_eff_sample_size"] = float(1.0 / _masked((clamped / (cmean + 1e-8)).square(), mask).mean())
    seq = _seq_mean(w, mask)
    seq_for_fractions = _seq_mean(raw, mask) if raw_seq_fractions else seq
    out.update(
        {
            "rollout_is_seq_mean": float(seq.mean()),
            "rollout_is_seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
            "rollout_is_seq_max": float(seq.max()),
            "rollout_is_seq_min": float(seq.min()),
            "rollout_is_seq_max_deviation": float((seq - 1.0).abs().max()),
            "rollout_is_seq_fraction_high": float((seq_for_fractions > upper).float().mean()),
            "rollout_is_seq_fraction_low": float((seq_for_fractions < lower).float().mean()),
        }
    )
    return out


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, thresholds: dict[str, tuple[float | None, float]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``rollout_rs``: every option's statistic (k1 = log mu/pi, k2, k3 per token, or their
    sum / mean / max over each sequence) must lie within its bounds -- [log lower, log upper] for k1
    (ratio bounds), <= upper for k2 / k3 -- or the token (token options) or the whole sequence
    (sequence options) leaves the mask. ``thresholds`` is `RolloutCorrectionConfig.rs_thresholds`."""
    valid = mask.bool()
    m = mask.float()
    rows = valid.any(-1)
    est = kl_estimators(log_ratio)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for opt, (lower, upper) in thresholds.items():
        level, kind = opt.rsplit("_", 1)
        token = est[kind]
        if level == "token":
            stat = token
        elif level == "seq_sum":
            stat = _seq_sum(token, mask)[:, None].expand_as(m)
        elif level == "seq_mean":
            stat = _seq_mean(token, mask)[:, None].expand_as(m)
        else:  # seq_max
            stat = token.masked_fill(~valid, float("-inf")).max(-1).values[:, None].expand_as(m)
        if kind == "k1":
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        keep &= ok | ~valid
        metrics[f"rollout_rs_{opt}_mean"] = float(_masked(stat, mask).mean())
        metrics[f"rollout_rs_{opt}_masked_fraction"] = float(_masked((~ok).float(), mask).mean())
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = float(((~ok) & valid).any(-1)[rows].float().mean())
    new_mask = (mask * keep.to(mask.dtype)).to(mask.dtype)
    metrics["rollout_rs_masked_fraction"] = float(_masked((~keep).float(), mask).mean())
    metrics["rollout_rs_seq_masked_fraction"] = float(((~keep) & valid).any(-1).float().mean())
    return new_mask, metrics


def rollout_correction(
    rollout_logprobs, old_logprobs, mask, config, *, truncated_metrics: bool = False, raw_seq_fractions=True
) -> Correction:
    """verl's ``compute_rollout_correction_and_rejection_mask`` under ``config``
    (`trainer.config.RolloutCorrectionConfig`): IS weights over the whole response mask, rejection on
    it, metrics prefixed ``rollout_corr/`` (``truncated_metrics``, ``raw_seq_fractions``: `is_weights`). With neither
    ``rollout_is`` nor ``rollout_rs`` the mask comes back unchanged, no weights, no metrics."""
    if (config.rollout_is is None and config.rollout_rs is None) or not bool(mask.bool().any()):
        return Correction(mask=mask, weights=None, metrics={})
    log_ratio = old_logprobs.float() - rollout_logprobs.float()
    metrics: dict[str, float] = {}
    weights = None
    if config.rollout_is is not None:
        lower, upper = config.is_bounds()
        weights, is_m = is_weights(
            log_ratio,
            mask,
            config.rollout_is,
            upper,
            config.rollout_is_batch_normalize,
            lower=lower,
            truncated_metrics=truncated_metrics,
            raw_seq_fractions=raw_seq_fractions,
        )
        metrics.update(is_m)
    new_mask = mask
    if config.rollout_rs is not None:
        new_mask, rs_m = rejection_mask(log_ratio, mask, config.rs_thresholds())
        metrics.update(rs_m)
    return Correction(
        mask=new_mask, weights=weights, metrics={f"rollout_corr/{k}": v for k, v in metrics.items()}
    )


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The advantages the policy loss sees under IS weights. verl multiplies each token's policy loss
    by its (non-negative, detached) weight; every policy loss here is positively homogeneous in the
    advantage per token (PPO: max(-A r, -A clip(r)) * w = max(-(A w) r, -(A w) clip(r)) for w >= 0),
    so scaling the advantage by w is the same loss and gradient, and leaves entropy and KL terms
    unweighted as verl does. Not so for ``clip_cov`` / ``kl_cov``, which pick tokens by the advantages'
    covariance: `trainer.config.TrainConfig` refuses IS weights with those."""
    return advantages if weights is None else advantages * weights
