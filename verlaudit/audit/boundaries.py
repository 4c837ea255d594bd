"""Boundary checks: the collator's batch, the reward, the rollout — pure functions over payloads.

Each returns `Finding`s for what crossed a boundary in the wrong dtype, range, shape, device or
padding. They run at every audit level except ``off`` (they cost a few reductions per step).
Exercised by `pytest tests/test_audit_checks.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit.dtype_checks import INT_KEY, VERL_ROLLOUT_DTYPE
from verlaudit.audit.engine_checks import check_engine
from verlaudit.dtypes import dtype_name as dn
from verlaudit.rundir import Finding


def _f(severity: str, kind: str, where: str, message: str, **kw: Any) -> Finding:
    return Finding(severity=severity, kind=kind, where=where, message=message, **kw)


# long: a batch's checks (dtypes, id ranges, shapes, masks, padding side) share the tensors they read
def check_batch(
    batch: Mapping[str, Any],
    *,
    role: str,
    source: str,
    tokenizer_info: Mapping[str, Any],
    rows: int | None = None,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """Collator output: integer ids and masks, ids in [0, vocab), one batch size (``rows``: the examples
    collated, one row each), mask shapes, padding side."""
    out: list[Finding] = []
    ctx = {"role": role, "step": step, "phase": phase}
    where = f"collator:{source}"
    vocab = tokenizer_info.get("vocab_size")
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    for k, v in batch.items():
        if INT_KEY.search(k) and not isinstance(v, torch.Tensor):
            out.append(
                _f(
                    "error",
                    K.COLLATOR_NOT_TENSOR,
                    f"{where}.{k}",
                    f"{k} is a {type(v).__name__}, not a tensor",
                    observed=type(v).__name__,
                    expected="torch.long tensor",
                    fix="return torch tensors from the collator (torch.tensor(ids, dtype=torch.long))",
                    **ctx,
                )
            )
    for k, v in tensors.items():
        if not INT_KEY.search(k):
            continue
        is_mask = "mask" in k
        if v.is_floating_point():
            out.append(
                _f(
                    "error",
                    K.COLLATOR_FLOAT_IDS,
                    f"{where}.{k}",
                    f"{k} from collator {source} is {dn(v.dtype)}; token ids and masks must be integers",
                    observed=dn(v.dtype),
                    expected="int64",
                    fix=f"drop the cast in the collator: {k} must stay torch.long (cast only floating tensors)",
                    **ctx,
                )
            )
            continue
        if not is_mask and v.dtype != torch.int64:
            out.append(
                _f(
                    "warning",
                    K.COLLATOR_ID_WIDTH,
                    f"{where}.{k}",
                    f"{k} is {dn(v.dtype)}, not int64",
                    observed=dn(v.dtype),
                    expected="int64",
                    fix=f"build {k} with dtype=torch.long",
                    **ctx,
                )
            )
        if not is_mask and vocab and v.numel():
            lo, hi = int(v.min()), int(v.max())
            if lo < 0 or hi >= int(vocab):
                out.append(
                    _f(
                        "error",
                        K.COLLATOR_ID_RANGE,
                        f"{where}.{k}",
                        f"{k} holds ids in [{lo}, {hi}], outside the vocabulary [0, {int(vocab)})",
                        observed=[lo, hi],
                        expected=[0, int(vocab) - 1],
                        fix="tokenize with the run's tokenizer and pad with its pad_token_id",
                        **ctx,
                    )
                )
    out.extend(_extra_dims(tensors, where, rows, ctx))
    sizes = {k: v.shape[0] for k, v in tensors.items() if v.dim() >= 1}
    wrong = {k: tuple(tensors[k].shape) for k, n in sizes.items() if INT_KEY.search(k) and rows and n != rows}
    if wrong:
        k, shape = next(iter(wrong.items()))
        major = len(shape) == 2 and shape[1] == rows
        out.append(
            _f(
                "error",
                K.COLLATOR_SHAPE,
                f"{where}.{k}",
                f"{k} has shape {list(shape)} for {rows} examples: its first dimension must be the batch, "
                "one row per example"
                + (
                    f"; this is [length, batch] (time-major: its second dimension is the {rows} examples), "
                    "as torch's pad_sequence returns without batch_first=True"
                    if major
                    else ""
                ),
                observed={"shapes": {n: list(v) for n, v in wrong.items()}, "examples": rows},
                expected=f"[{rows}, length]",
                fix="return [batch, length] tensors: pad_sequence(..., batch_first=True), or transpose (.T) "
                "the [length, batch] result"
                if major
                else "return one row per example in every field (shape [batch, length])",
                **ctx,
            )
        )
    elif len(set(sizes.values())) > 1:
        out.append(
            _f(
                "error",
                K.COLLATOR_SHAPE,
                where,
                f"tensors disagree on batch size: {sizes}",
                observed=sizes,
                expected="one batch size",
                fix="return one row per example in every field",
                **ctx,
            )
        )
    for k, v in tensors.items():
        if k.endswith("input_ids"):
            mk = k[: -len("input_ids")] + "attention_mask"
            m = tensors.get(mk)
            if m is not None and m.shape != v.shape:
                out.append(
                    _f(
                        "error",
                        K.COLLATOR_SHAPE,
                        f"{where}.{mk}",
                        f"{mk} has shape {tuple(m.shape)} but {k} has {tuple(v.shape)}",
                        observed=list(m.shape),
                        expected=list(v.shape),
                        fix="build the mask from the padded ids",
                        **ctx,
                    )
                )
    mask = tensors.get("attention_mask")
    side = tokenizer_info.get("padding_side")
    laid_out = not wrong  # a batch whose rows are not the examples has no padding side to read
    if laid_out and mask is not None and side in ("left", "right") and mask.dim() == 2 and mask.shape[1] > 1:
        observed = padding_side(mask)
        if observed not in (None, side):
            out.append(
                _f(
                    "error" if side == "left" else "warning",
                    K.PADDING_SIDE,
                    f"{where}.attention_mask",
                    f"prompts are {observed}-padded but the tokenizer pads {side}"
                    + (": generation would continue from pad tokens" if side == "left" else ""),
                    observed=observed,
                    expected=side,
                    fix=f"pad prompts on the {side} (tokenizer.padding_side = '{side}')",
                    **ctx,
                )
            )
    return out


def _extra_dims(
    tensors: Mapping[str, torch.Tensor], where: str, rows: int | None, ctx: Mapping[str, Any]
) -> list[Finding]:
    """Token ids and masks that are not [batch, length]: a per-example ``return_tensors='pt'`` stacked
    into [B, 1, L] (or a 1-D row) fails later, in the model or the sampler, far from the collator."""
    bad = {k: tuple(v.shape) for k, v in tensors.items() if INT_KEY.search(k) and v.dim() != 2}
    if not bad:
        return []
    k, shape = next(iter(bad.items()))
    ones = [i for i, n in enumerate(shape) if n == 1 and i > 0]
    fix = (
        f"return [batch, length] tensors: drop the extra dimension (.squeeze({ones[0]})), or tokenize the "
        "batch in one call / torch.cat the per-example [1, L] encodings instead of torch.stack"
        if len(shape) > 2 and ones
        else "return every id and mask field as a [batch, length] tensor (one row per example)"
    )
    return [
        _f(
            "error",
            K.COLLATOR_SHAPE,
            f"{where}.{k}",
            f"{k} has {len(shape)} dimensions, shape {list(shape)}"
            + (f" for {rows} examples" if rows else "")
            + ": token ids and masks must be [batch, length] (2-D); the extra dimension breaks the model's "
            "forward and the sampler later, far from the collator",
            observed={"shapes": {n: list(v) for n, v in bad.items()}},
            expected="[batch, length]",
            fix=fix,
            **ctx,
        )
    ]


def padding_side(mask: torch.Tensor) -> str | None:
    """``left`` / ``right`` from where a 2-D mask has its zeros; None when no row is padded."""
    m = mask.bool()
    padded = ~m.all(dim=1)
    if not bool(padded.any()):
        return None
    rows = m[padded]
    if bool((~rows[:, -1]).any()) and bool(rows[:, 0].all()):
        return "right"
    if bool((~rows[:, 0]).any()) and bool(rows[:, -1].all()):
        return "left"
    return "mixed"


# long: a reward's checks read its raw value once: type, shape, dtype, device, finiteness, spread
def check_reward(
    raw: Any,
    rewards: torch.Tensor | None,
    *,
    source: str,
    expected_shape: tuple[int, ...],
    train_device: torch.device | str,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """What a reward function / model returned: type, dtype, device, shape, finiteness."""
    out: list[Finding] = []
    ctx = {"role": "reward", "step": step, "phase": phase}
    where = f"reward:{source}"
    dev = torch.device(train_device)
    shape: tuple[int, ...] | None = None
    values: list[float] | None = None
    if isinstance(raw, torch.Tensor):
        shape = tuple(raw.shape)
        if not raw.is_floating_point():
            out.append(
                _f(
                    "info",
                    K.REWARD_DTYPE,
                    where,
                    f"reward is an integer tensor ({dn(raw.dtype)})",
                    observed=dn(raw.dtype),
                    expected="fp32",
                    fix="return float rewards",
                    **ctx,
                )
            )
        elif raw.dtype == torch.float64:
            out.append(
                _f(
                    "warning",
                    K.REWARD_DTYPE,
                    where,
                    "reward is float64: anything computed from it before conversion runs in fp64",
                    observed="fp64",
                    expected="fp32",
                    fix="return torch.float32 (scores.float()); numpy: np.asarray(x, dtype=np.float32)",
                    **ctx,
                )
            )
        elif raw.dtype != torch.float32:
            out.append(
                _f(
                    "warning",
                    K.REWARD_DTYPE,
                    where,
                    f"reward is {dn(raw.dtype)}: rewards lose precision before advantages are computed",
                    observed=dn(raw.dtype),
                    expected="fp32",
                    fix="upcast the score head output with .float()",
                    **ctx,
                )
            )
        if raw.device.type != dev.type:
            out.append(
                _f(
                    "warning",
                    K.REWARD_DEVICE,
                    where,
                    f"reward tensor is on {raw.device} while training runs on {dev}: a host/device copy "
                    "and synchronisation every step",
                    observed=str(raw.device),
                    expected=str(dev),
                    fix=f"return the reward on the training device (.to('{dev}'))",
                    **ctx,
                )
            )
        if not raw.is_complex():
            values = raw.detach().float().flatten().cpu().tolist()
    else:
        arr_dtype = getattr(raw, "dtype", None)
        if arr_dtype is not None and hasattr(raw, "shape"):  # numpy array
            shape = tuple(raw.shape)
            if str(arr_dtype) == "float64":
                out.append(
                    _f(
                        "warning",
                        K.REWARD_DTYPE,
                        where,
                        "reward is a float64 numpy array",
                        observed="fp64 (numpy)",
                        expected="fp32 tensor",
                        fix="return torch.as_tensor(x, dtype=torch.float32)",
                        **ctx,
                    )
                )
            values = [float(x) for x in raw.reshape(-1).tolist()]
        elif isinstance(raw, (list, tuple)):
            shape = (len(raw),)
            out.append(
                _f(
                    "info",
                    K.REWARD_LIST,
                    where,
                    "reward is a Python list: converted to float32 on the host (fine for rule rewards)",
                    observed="list",
                    expected="fp32 tensor",
                    fix="return a float32 tensor on the training device to skip the conversion",
                    **ctx,
                )
            )
            try:
                values = [float(x) for x in raw]
            except (TypeError, ValueError):
                out.append(
                    _f(
                        "error",
                        K.REWARD_NOT_NUMBERS,
                        where,
                        "reward list holds non-numbers",
                        observed=repr(raw[:3]),
                        expected="numbers",
                        fix="return one float per sequence",
                        **ctx,
                    )
                )
    if shape is not None and tuple(expected_shape) and shape != tuple(expected_shape):
        out.append(
            _f(
                "error",
                K.REWARD_SHAPE,
                where,
                f"reward has shape {shape}, expected {tuple(expected_shape)}",
                observed=list(shape),
                expected=list(expected_shape),
                fix="return one scalar per sequence (squeeze the score head's last dim)",
                **ctx,
            )
        )
    if values is None and rewards is not None:
        values = rewards.detach().float().flatten().cpu().tolist()
    int_dtype = _integer_dtype(raw)
    if int_dtype is not None and values and len(set(values)) == 1:
        out.append(
            _f(
                "warning",
                K.REWARD_INTEGER,
                where,
                f"reward is an integer {'tensor' if isinstance(raw, torch.Tensor) else 'array'} ({int_dtype}) "
                f"and all {len(values)} scores are {values[0]:g}: a fractional score (partial credit, a "
                "probability) written into it is truncated to its whole part, so distinct rewards become one",
                observed={"dtype": int_dtype, "values": sorted(set(values)), "n": len(values)},
                expected="float scores",
                fix="build the scores as floats (np.zeros(n, dtype=np.float32), torch.zeros(n), a list of "
                "Python floats) instead of an integer array (dtype=int)",
                **ctx,
            )
        )
    bad = [v for v in (values or []) if not math.isfinite(v)]
    if bad:
        out.append(
            _f(
                "error",
                K.REWARD_NONFINITE,
                where,
                f"{len(bad)} of {len(values or [])} rewards are non-finite",
                observed=str(bad[0]),
                expected="finite",
                fix="guard the reward function against NaN/inf (e.g. division by zero, log(0))",
                **ctx,
            )
        )
    return out


def _integer_dtype(raw: Any) -> str | None:
    """The integer dtype of a reward tensor or numpy array (``int64``), None for floats, bools, lists."""
    if isinstance(raw, torch.Tensor):
        ok = not raw.is_floating_point() and not raw.is_complex() and raw.dtype != torch.bool
        return dn(raw.dtype) if ok else None
    kind = getattr(getattr(raw, "dtype", None), "kind", None)  # numpy: "i" signed, "u" unsigned
    return str(raw.dtype) if kind in ("i", "u") and hasattr(raw, "shape") else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def check_tokenizer_eos(
    config: Mapping[str, Any], model: Any, tokenizer_info: Mapping[str, Any]
) -> list[Finding]:
    """The tokenizer's eos id against the ones the actor's config (and the checkpoint's generation config,
    which the trainer replaced with the tokenizer's: ``model.overridden_settings``) end sequences
    with: generation stops at the tokenizer's eos, so one the model never emits lets every response run
    to data.response_length (and one it emits mid-answer cuts it short). Nothing when the model names
    no eos."""
    eos = tokenizer_info.get("eos_token_id")
    model_eos = _ids(getattr(getattr(model, "config", None), "eos_token_id", None))
    for rec in getattr(model, "overridden_settings", None) or ():  # the checkpoint's generation config,
        if str(rec.get("setting", "")).endswith("generation_config.eos_token_id"):  # before the tokenizer's
            model_eos |= _ids(rec.get("yours"))
    if not isinstance(eos, int) or not model_eos or eos in model_eos:
        return []
    m = (config or {}).get("model") or {}
    if m.get("tokenizer"):
        where = f"model.tokenizer ({m['tokenizer']})"
        fix = (
            f"use the tokenizer saved with the model (model.tokenizer: {m.get('path')})"
            if m.get("path")
            else "use the tokenizer the model was trained with (model.tokenizer)"
        ) + f", or set the tokenizer's eos_token to the model's (id {min(model_eos)})"
    else:
        where = f"model.path ({m.get('path') or m.get('preset')})"
        fix = f"save the model's tokenizer with eos_token id {min(model_eos)} (tokenizer_config.json)"
    ids = ", ".join(str(i) for i in sorted(model_eos))
    return [
        _f(
            "error",
            K.TOKENIZER_SPECIAL_IDS,
            where,
            f"the tokenizer's eos_token_id {eos} is not the model config's eos_token_id ({ids}): generation "
            "stops at the tokenizer's eos, which this model does not end its answers with, so responses "
            "run on to data.response_length (the tokenizer and the model mismatch)",
            observed={"tokenizer_eos": eos, "model_eos": sorted(model_eos)},
            expected=sorted(model_eos),
            fix=fix,
            role="actor",
        )
    ]


def model_vocab_size(model) -> int | None:
    """Rows of the model's input embedding (the ids it can read and emit), or None when unknown."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None


# long: a rollout's checks (tokens, log-probs, engine facts vs the trainer's) share one reading of the engine
def check_rollout(
    *,
    engine: str,
    engine_dtype: torch.dtype,
    actor_compute_dtype: torch.dtype,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    logprobs: torch.Tensor,
    vocab_size: int | None,
    model_vocab_size: int | None = None,
    engine_facts: Mapping[str, Any] | None = None,
    trainer_facts: Mapping[str, Any] | None = None,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """Engine dtype against the actor's compute dtype; token, mask and log-prob dtypes; the engine's
    facts against the trainer's (`verlaudit.audit.engine_checks.check_engine`)."""
    out: list[Finding] = check_engine(
        engine=engine,
        engine_dtype=engine_dtype,
        engine_facts=engine_facts,
        trainer_facts=trainer_facts,
        step=step,
        phase=phase,
    )
    ctx = {"role": "rollout", "step": step, "phase": phase}
    where = f"rollout:{engine}"
    if engine_dtype != actor_compute_dtype:
        out.append(
            _f(
                "warning",
                K.ROLLOUT_DTYPE,
                where,
                f"rollout/train precision mismatch: {engine} samples in {dn(engine_dtype)} while the actor "
                f"trains in {dn(actor_compute_dtype)}; PPO ratios start away from 1 (see rollout_corr/kl)",
                observed=dn(engine_dtype),
                expected=dn(actor_compute_dtype),
                fix=f"set precision.overrides.rollout.compute_dtype: {dn(actor_compute_dtype)} "
                f"(verl: {VERL_ROLLOUT_DTYPE}={_verl(actor_compute_dtype)}), or recompute old log-probs "
                "with the actor (importance-sampling correction)",
                **ctx,
            )
        )
    for name, t in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        if t.is_floating_point():
            out.append(
                _f(
                    "error",
                    K.INT_BECAME_FLOAT,
                    f"{where}.{name}",
                    f"{name} from {engine} are {dn(t.dtype)}",
                    observed=dn(t.dtype),
                    expected="int64",
                    fix="keep sampled token ids torch.long",
                    **ctx,
                )
            )
        elif t.numel() and (vocab_size or model_vocab_size):
            lo, hi = int(t.min()), int(t.max())
            limit = model_vocab_size or vocab_size
            if lo < 0 or hi >= limit:
                out.append(
                    _f(
                        "error",
                        K.ROLLOUT_TOKEN_RANGE,
                        f"{where}.{name}",
                        f"{name} outside the model's vocabulary [0, {limit})",
                        observed=[lo, hi],
                        expected=[0, limit - 1],
                        fix="check the engine's vocabulary / tokenizer",
                        **ctx,
                    )
                )
            elif vocab_size and hi >= vocab_size:
                # the model can emit ids its tokenizer cannot decode (e.g. a 32000-row preset with a
                # 100-token tokenizer): rewards are computed on <unk>-ridden text
                out.append(
                    _f(
                        "warning",
                        K.VOCAB_MISMATCH,
                        f"{where}.{name}",
                        f"{name} reach {hi}: the model's vocabulary ({limit}) is larger than the tokenizer's "
                        f"({vocab_size}), so sampled ids >= {vocab_size} decode to nothing the reward can read",
                        observed=[lo, hi],
                        expected=[0, vocab_size - 1],
                        fix="use the tokenizer the model was trained with, or "
                        "model.resize_token_embeddings(len(tokenizer))",
                        **ctx,
                    )
                )
    if response_mask.is_floating_point():
        out.append(
            _f(
                "error",
                K.INT_BECAME_FLOAT,
                f"{where}.response_mask",
                f"response_mask is {dn(response_mask.dtype)}",
                observed=dn(response_mask.dtype),
                expected="int64 or bool",
                fix="build masks as integer/bool tensors",
                **ctx,
            )
        )
    if tuple(response_mask.shape) != tuple(response_ids.shape) or tuple(logprobs.shape) != tuple(
        response_ids.shape
    ):
        out.append(
            _f(
                "error",
                K.ROLLOUT_SHAPE,
                where,
                f"shapes differ: response_ids {tuple(response_ids.shape)}, response_mask "
                f"{tuple(response_mask.shape)}, logprobs {tuple(logprobs.shape)}",
                observed=[list(response_mask.shape), list(logprobs.shape)],
                expected=list(response_ids.shape),
                fix="one log-prob and one mask value per response token",
                **ctx,
            )
        )
    if not logprobs.is_floating_point() or logprobs.dtype not in (torch.float32, torch.float64):
        out.append(
            _f(
                "error",
                K.ISLAND,
                f"{where}.logprobs",
                f"rollout log-probs are {dn(logprobs.dtype)}; the policy keeps log-probs in fp32",
                observed=dn(logprobs.dtype),
                expected="fp32",
                fix="take log_softmax of the sampling logits in fp32",
                **ctx,
            )
        )
    return out


def _verl(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(
        dtype, str(dtype)
    )
