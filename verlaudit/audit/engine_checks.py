"""The rollout engine at the rollout boundary: what sets the probabilities it records, against the
trainer's recomputation of the same tokens -- pure functions over ``on_rollout``'s facts.

``engine_facts`` and ``trainer_facts`` are `trainer.events.Observer.on_rollout`'s: the engine's
model, KV-cache and log-softmax dtypes, its temperature, top-k, top-p and logprobs mode, and how the
trainer recomputes the log-probs (temperature, whole vocabulary, fp32). Each disagreement that
changes probabilities is a finding at ``rollout:<engine>.<part>``:

- ``boundary/rollout_engine_dtype`` (error): the engine computes in another dtype than it was asked
  for (vLLM read back: ``model_config.dtype``);
- ``boundary/rollout_kv_cache`` (warning): K/V cached below the engine's compute dtype (fp8, or
  fp16 / bf16 under fp32);
- ``boundary/rollout_logprobs`` (warning): a log-softmax below fp32, on either side;
- ``boundary/rollout_sampling``: a temperature other than the trainer's, raw log-probs of a processed
  sampling distribution, logits instead of log-probs (errors: the ratios are wrong on every token),
  and top-k / top-p log-probs renormalised over the kept tokens against the trainer's whole-vocabulary
  ones (warning: every ratio pi/mu is the kept mass, below 1).

The engine dtype against the actor's compute dtype stays in `verlaudit.audit.boundaries.check_rollout`,
which calls `check_engine`. A rollout whose log-probs no loss reads (``trainer_facts["used"]`` False:
ReMax's greedy baseline, top-k 1) is not checked for sampling. Exercised by
`pytest tests/test_mismatch_audit.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainer.precision import dtype_name
from verlaudit import kinds as K
from verlaudit import verl_keys as V
from verlaudit.rundir import Finding

FULL = (torch.float32, torch.float64)


def _name(dtype: Any) -> str:
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)


def _verl_dtype(dtype: Any) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(
        dtype, _name(dtype)
    )


def check_engine(
    *,
    engine: str,
    engine_dtype: torch.dtype,
    engine_facts: Mapping[str, Any] | None,
    trainer_facts: Mapping[str, Any] | None,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """Findings for the engine's facts (see the module docstring); none when it reports none."""
    if not engine_facts:
        return []
    out: list[Finding] = []
    where = f"rollout:{engine}"

    def add(severity: str, kind: str, at: str, message: str, observed: Any, expected: Any, fix: str) -> None:
        out.append(
            Finding(
                severity=severity,
                kind=kind,
                message=message,
                role="rollout",
                where=f"{where}.{at}",
                step=step,
                phase=phase,
                observed=observed,
                expected=expected,
                fix=fix,
            )
        )

    compute = engine_facts.get("compute_dtype", engine_dtype)
    if compute != engine_dtype:
        want = _verl_dtype(engine_dtype)
        add(
            "error",
            K.ROLLOUT_ENGINE_DTYPE,
            "model_dtype",
            f"{engine} computes in {_name(compute)}, not the {_name(engine_dtype)} the rollout role "
            "asked for",
            _name(compute),
            _name(engine_dtype),
            f"build the engine with dtype {want} (verl: {V.ROLLOUT_DTYPE}={want}); if it cannot run that, "
            "set precision.overrides.rollout.compute_dtype to what it runs",
        )
    kv = engine_facts.get("kv_cache_dtype", compute)
    if kv != compute and kv not in FULL:
        add(
            "warning",
            K.ROLLOUT_KV_CACHE,
            "kv_cache",
            f"{engine} caches keys and values in {_name(kv)} while it computes in {_name(compute)}: "
            "attention reads rounded K/V, which the trainer's forward does not",
            _name(kv),
            _name(compute),
            "keep the KV cache in the model dtype (vLLM: kv_cache_dtype='auto')",
        )
    for side, facts in (("engine", engine_facts), ("trainer", trainer_facts or {})):
        lp = facts.get("logprob_dtype")
        if lp is not None and lp not in FULL:
            add(
                "warning",
                K.ROLLOUT_LOGPROBS,
                f"logprobs.{side}",
                f"the {side}'s log-softmax runs in {_name(lp)}: log-probs near 0 lose their last digits, and "
                "every ratio with them",
                _name(lp),
                "fp32",
                "take log_softmax of .float() logits",
            )
    if trainer_facts is not None and trainer_facts.get("used", True):
        for severity, at, message, observed, expected, fix in _sampling(engine, engine_facts, trainer_facts):
            add(severity, K.ROLLOUT_SAMPLING, at, message, observed, expected, fix)
    return out


def _sampling(
    engine: str, e: Mapping[str, Any], t: Mapping[str, Any]
) -> list[tuple[str, str, str, Any, Any, str]]:
    """(severity, where, message, observed, expected, fix) for the sampling parameters that change
    probabilities, the engine's against the trainer's."""
    out = []
    mode = str(e.get("logprobs_mode", "processed"))
    temp, top_k, top_p = float(e.get("temperature", 1.0)), int(e.get("top_k", 0)), float(e.get("top_p", 1.0))
    t_temp, t_k, t_p = float(t.get("temperature", 1.0)), int(t.get("top_k", 0)), float(t.get("top_p", 1.0))
    processed = temp != 1.0 or top_k > 0 or top_p < 1.0
    mode_fix = (
        "record the log-probs of the distribution sampled from (vLLM: logprobs_mode='processed_logprobs'; "
        f"verl: {V.LOGPROBS_MODE}=processed_logprobs)"
    )
    if mode not in ("processed", "raw"):
        out.append(
            (
                "error",
                "sampling.logprobs_mode",
                f"{engine} records {mode}, not log-probs: the importance ratios are computed from logits",
                mode,
                "processed",
                mode_fix,
            )
        )
    elif mode == "raw" and processed:
        out.append(
            (
                "error",
                "sampling.logprobs_mode",
                f"{engine} samples after temperature {temp:g}, top-k {top_k}, top-p {top_p:g} but records "
                "the raw log-probs (before them): not the probabilities the tokens were drawn with",
                f"raw, temperature {temp:g}, top_k {top_k}, top_p {top_p:g}",
                "processed",
                mode_fix,
            )
        )
    if temp != t_temp:
        out.append(
            (
                "error",
                "sampling.temperature",
                f"{engine} samples at temperature {temp:g}, the trainer recomputes at {t_temp:g}: every "
                "token's ratio carries the difference",
                temp,
                t_temp,
                f"one temperature for both (algo.temperature; verl: {V.TEMPERATURE})",
            )
        )
    if mode == "processed" and ((top_k > 0 and top_k != t_k) or (top_p < 1.0 and top_p != t_p)):
        kept = " and ".join(  # the suite keys that set them, so the finding names its culprit
            x
            for x in (f"algo.top_k {top_k}" if top_k else "", f"rollout.top_p {top_p:g}" if top_p < 1 else "")
            if x
        )
        trainer = "the whole vocabulary" if t_k == 0 and t_p == 1.0 else f"top-k {t_k} / top-p {t_p:g}"
        out.append(
            (
                "warning",
                "sampling.truncation",
                f"{engine} samples only from the tokens {kept} keeps (top-k / top-p sampling) and records "
                f"log-probs renormalised over them; the trainer recomputes over {trainer}, so the rollout is "
                "off-policy: every ratio pi/mu is the kept probability mass, below 1",
                f"top_k {top_k}, top_p {top_p:g}",
                f"top_k {t_k}, top_p {t_p:g}",
                "sample from the whole distribution for RL (algo.top_k: 0, rollout.top_p: 1.0; verl: "
                f"{V.ROLLOUT_TOP_K}=-1 {V.ROLLOUT_TOP_P}=1.0), or correct for it "
                f"({V.correction_override('rollout_is', 'token')})",
            )
        )
    return out
