"""The run's invariants: what must hold at the boundaries for the numbers to mean what they say.

Batch invariants (every collated batch, at every level but ``off``; a few integer reductions):

- the attention mask is 0 on the padding: a pad token at a row's padded end with mask 1 is attended
  to (`mask_findings`). When pad == eos (or bos) one such token next to the content is legitimate (the
  eos that ends a response, a bos that starts a prompt), so the innermost token of each run is not
  counted then;
- a DPO pair's chosen and rejected responses differ: two sides with the same tokens (ignoring pad,
  eos and the mask's zeros) carry no preference and give no gradient (`pair_findings`), named on
  who made them the same: the dataset (its texts are equal), ``data.response_length`` (the texts
  differ only past the builtin collator's cut) or the collator; and neither side is empty (eos
  only) in half the pairs, the dataset named when its text is empty;
- truncation did not collapse prompts: the builtin collators report what ``data.prompt_length`` cut
  under the batch key `TRUNCATION_KEY` (``trainer/data.py``: per row its length before the cut and
  which row it equals before and after it), and `truncation_findings` turns it into an info (prompts cut) or a warning (distinct
  prompts became the same text).

Setup invariants (`setup_findings`, once, after the user's ``model.setup`` ran):

- the reference is the actor's starting point: before any update every shared parameter is equal
  up to the rounding of the coarser of the two dtypes (the reference is a cast copy of the actor); a
  reference that differs names the ``model.setup`` plug-in that ran on one and not (or otherwise on)
  the other, and says whether it targeted the reference on purpose;
- no trainable role trains with dropout (Dropout modules with p > 0 in training mode, or a config's
  attention / hidden dropout above 0): the rollout samples without dropout, the update recomputes
  with it, so old log-probs and ratios see another policy than the one that sampled; and the reward
  model does not score in training mode with dropout (the same response would get another score);
- two forwards of the same tokens through a trainable role (in training mode) or the reward model
  agree: a random forward the dropout check cannot name (a noise layer, a hook) is a
  ``model/nondeterministic_forward`` warning (`forward_spread`: one 8-token row twice, the random
  state restored after, so the run draws what it would have);
- the embeddings the config ties (``tie_word_embeddings``) are one tensor.

The data's invariants (rows in the examples' order, eos in prompts and response masks, frozen roles
that share a trained role's tensors) live in `verlaudit.audit.invariants_data`; both run from here.

Exercised by `pytest tests/test_invariants.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import invariants_data, rounding, special_tokens, truncation
from verlaudit.rundir import Finding

TRUNCATION_KEY = "prompt_truncation"
"""The batch key under which trainer/data.py's collators report their truncation (a dict of ints)."""

DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
    "activation_dropout",
)
"""Config fields of Hugging Face architectures that turn dropout on in a training forward."""


def _edge_runs(is_pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the length of the leading and of the trailing run of pad ids."""
    p = is_pad.long()
    lead = p.cumprod(dim=1).sum(dim=1)
    trail = p.flip(1).cumprod(dim=1).sum(dim=1)
    return lead, trail


def _covered(ids: torch.Tensor, mask: torch.Tensor, pad: int, special: bool) -> torch.Tensor:
    """Bool [B, L]: pad ids of a row's leading or trailing run that the mask lets through; ``special``
    (pad is also eos/bos) leaves out the innermost id of each run."""
    is_pad = ids == pad
    lead, trail = _edge_runs(is_pad)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    inner = 1 if special else 0
    in_lead = pos < (lead - inner).clamp(min=0).unsqueeze(1)
    in_trail = pos >= (ids.shape[1] - (trail - inner).clamp(min=0)).unsqueeze(1)
    full = lead == ids.shape[1]  # an all-pad row: its mask must be 0 everywhere
    edge = in_lead | in_trail | (full.unsqueeze(1) & is_pad)
    return edge & mask.bool()


def _not_binary(mask: torch.Tensor) -> str:
    """The values of an integer mask other than 0 and 1, as text ('' when it is 0/1 or bool)."""
    if mask.dtype == torch.bool or not mask.numel():
        return ""
    vals = [int(v) for v in torch.unique(mask).tolist() if int(v) not in (0, 1)]
    return ", ".join(str(v) for v in vals[:4]) if vals else ""


def mask_findings(
    batch: Mapping[str, Any], *, tokenizer_info: Mapping[str, Any], where: str, ctx: Mapping[str, Any]
) -> list[Finding]:
    """A mask of 1 on the padding of any ``*input_ids`` / ``*attention_mask`` pair."""
    pad, eos = tokenizer_info.get("pad_token_id"), tokenizer_info.get("eos_token_id")
    if not isinstance(pad, int):
        return []
    special = pad == eos or pad == tokenizer_info.get("bos_token_id")
    out: list[Finding] = []
    for k, ids in batch.items():
        if not (k.endswith("input_ids") and isinstance(ids, torch.Tensor)):
            continue
        mk = k[: -len("input_ids")] + "attention_mask"
        mask = batch.get(mk)
        ok = isinstance(mask, torch.Tensor) and mask.shape == ids.shape and ids.dim() == 2
        if not ok or ids.is_floating_point() or mask.is_floating_point() or not ids.numel():
            continue
        covered = _covered(ids, mask, pad, special)
        n = int(covered.sum())
        if not n:
            continue
        rows = int(covered.any(dim=1).sum())
        note = " (pad == eos: the eos next to each row's content is not counted)" if special else ""
        fix = (
            f"set {mk} to 0 on padding: build it from each row's unpadded length "
            "(1 on the tokens, 0 on the pad ids added to reach the batch's length)"
        )
        odd = _not_binary(mask)  # data24: a mask inverted with ~ on an integer dtype is bitwise, not logical
        if odd:
            note += (
                f"; {mk} is {str(mask.dtype).removeprefix('torch.')} holding {odd} (not 0 or 1): ~ on an integer "
                "mask is bitwise (~0 = 255, ~1 = 254 on uint8), so every position is non-zero and nothing is masked"
            )
            fix = (
                f"build {mk} as a 0/1 mask: (input_ids != pad_token_id).long(), or invert a bool mask with "
                "logical_not / 1 - mask, not ~ on uint8 / int"
            )
        out.append(
            Finding(
                severity="error",
                kind=K.MASK_COVERS_PADDING,
                where=f"{where}.{mk}",
                message=f"{mk} is 1 on {n} pad token(s) at the padded end of {rows} of {ids.shape[0]} "
                f"rows{note}: the model attends to padding, so its log-probs depend on the padded length",
                observed={"pad_tokens_attended": n, "rows": rows, "batch": int(ids.shape[0])},
                expected=0,
                fix=fix,
                **ctx,
            )
        )
    return out


def _content(ids: torch.Tensor, mask: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """[B, L]: each row's attended tokens other than pad / eos, moved to the front, -1 after them."""
    keep = mask.bool() & ~torch.isin(ids, special)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    return torch.where(keep, ids, torch.full_like(ids, -1)).gather(1, order)


def pair_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    where: str,
    ctx: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]] = (),
    data: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """DPO rows whose chosen and rejected responses hold the same tokens (ignoring pad and eos), and a
    side that is empty (eos only) in half the pairs or more. ``examples`` (the pairs collated, one per
    row) and ``data`` (the run's data config) name who made them: the dataset when its texts are
    already equal (or empty), ``data.response_length`` when the texts differ only past the cut of the
    builtin collator, else the collator."""
    keys = [f"{s}_{f}" for s in ("chosen", "rejected") for f in ("input_ids", "response_mask")]
    if not all(isinstance(batch.get(k), torch.Tensor) for k in keys):
        return []
    c_ids, c_resp, r_ids, r_resp = (batch[k] for k in keys)
    if c_ids.shape != r_ids.shape or c_resp.shape != r_resp.shape or c_ids.dim() != 2 or not c_ids.numel():
        return []
    if c_ids.is_floating_point() or r_ids.is_floating_point() or c_resp.shape[1] > c_ids.shape[1]:
        return []
    specials = [
        t for t in (tokenizer_info.get("pad_token_id"), tokenizer_info.get("eos_token_id")) if t is not None
    ]
    special = torch.tensor(specials or [-2], dtype=c_ids.dtype, device=c_ids.device)
    r_len = c_resp.shape[1]
    chosen = _content(c_ids[:, -r_len:], c_resp, special)
    rejected = _content(r_ids[:, -r_len:], r_resp.to(r_ids.device), special)
    b = int(chosen.shape[0])
    texts = _pair_texts(examples, b)
    data = data or {}
    out = [
        f
        for side, content, resp in (("chosen", chosen, c_resp), ("rejected", rejected, r_resp))
        for f in _empty_side(side, content, _outside(batch, side, resp), texts, data, where, ctx)
    ]
    same = (chosen == rejected).all(dim=1)
    rows = same.nonzero().flatten().tolist()
    if not rows:
        return out
    n = len(rows)
    full = ((c_resp.sum(dim=1) == r_len) & (r_resp.to(c_resp.device).sum(dim=1) == r_len)).tolist()
    msg = f"{n} of {b} preference pairs have the same response on both sides (ignoring pad and eos)"
    fix = (
        "check where the pairs are built: chosen and rejected must be two different responses "
        "(the same field read twice in the dataset or the collator?)"
    )
    at = f"{where}.chosen_input_ids"
    if texts and all(texts[i][0] == texts[i][1] for i in rows):
        key, at = _data_source(data)
        msg += f": the dataset gives them one text (chosen == rejected in {n} of its {b} examples)"
        fix = (
            f"{at}: build rejected from another response than chosen (a list aliased to the answers, "
            "shuffled in place, or one field read twice makes both sides the same text)"
        )
    elif texts and where.startswith("collator:builtin:") and all(full[i] for i in rows):
        at = "data.response_length"
        msg = (
            f"{n} of {b} preference pairs are identical after data.response_length {r_len} cut them: "
            f"their texts differ, but only after the first {r_len} tokens, which both sides keep"
        )
        fix = (
            f"raise data.response_length above {r_len} until chosen and rejected differ within it "
            "(or put what differs first in the responses)"
        )
    out.append(
        Finding(
            severity="error" if 2 * n >= b else "warning",
            kind=K.IDENTICAL_PAIRS,
            where=at,
            message=msg + ": DPO's loss is log 2 on them whatever the policy does, and their gradient is 0",
            observed={"identical_pairs": n, "batch": b},
            expected=0,
            fix=fix,
            **ctx,
        )
    )
    return out


def _pair_texts(examples: Sequence[Mapping[str, Any]], b: int) -> list[tuple[Any, Any]]:
    """(chosen, rejected) text of each collated pair, when the examples are the batch's rows."""
    if len(examples) != b or not all(isinstance(ex, Mapping) for ex in examples):
        return []
    return [(ex.get("chosen"), ex.get("rejected")) for ex in examples]


def _data_source(data: Mapping[str, Any]) -> tuple[str, str]:
    """(key, key with its spec) of where the examples come from: the user's dataset or the task."""
    if data.get("dataset"):
        return "data.dataset", f"data.dataset ({data['dataset']})"
    return "data.task", f"data.task ({data.get('task')})"


def _outside(batch: Mapping[str, Any], side: str, resp: torch.Tensor) -> torch.Tensor | None:
    """Bool [B]: rows whose response mask marks a position of the last R columns that the attention mask
    does not (the response is not where the mask says: a row packed and padded at its end)."""
    attn = batch.get(f"{side}_attention_mask")
    if not isinstance(attn, torch.Tensor) or attn.dim() != 2 or attn.shape[1] < resp.shape[1]:
        return None
    window = attn[:, -resp.shape[1] :].to(resp.device).bool()
    return (resp.bool() & ~window).any(dim=1)


def _empty_side(
    side: str,
    content: torch.Tensor,
    outside: torch.Tensor | None,
    texts: list[tuple[Any, Any]],
    data: Mapping[str, Any],
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """A DPO side with no token but pad / eos in half the pairs or more."""
    empty = (content == -1).all(dim=1)
    rows = empty.nonzero().flatten().tolist()
    b = int(empty.numel())
    if not rows or 2 * len(rows) < b:
        return []
    i = 0 if side == "chosen" else 1
    blank = bool(texts) and all(not str(texts[r][i] or "").strip() for r in rows)
    if blank:
        _, at = _data_source(data)
        why = f"the dataset's '{side}' text is empty in those examples"
        fix = (
            f"{at}: fill '{side}' with the response text (a record field read with .get(name, '') under a "
            "name the records do not have gives '')"
        )
    elif outside is not None and all(bool(outside[r]) for r in rows):
        at = f"{where}.{side}_input_ids"
        r_len = content.shape[1]
        why = (
            f"its {side}_response_mask marks positions of the last {r_len} columns that the attention mask "
            "leaves out: the completion is not in the last columns, which hold padding (the row was packed "
            "prompt + completion and padded at its end?), so the log-probs are taken over pad tokens"
        )
        fix = (
            f"align each completion with {side}_response_mask: left-pad the prompt to its width and right-pad "
            f"the completion to the last {r_len} columns (the layout the response mask describes)"
        )
    else:
        at = f"{where}.{side}_input_ids"
        why = "the collator kept none of its tokens"
        fix = f"check the collator: {side}_input_ids / {side}_response_mask must cover the response's tokens"
    return [
        Finding(
            severity="error",
            kind=K.EMPTY_RESPONSES,
            where=at,
            message=f"the {side} response is empty (no token but eos) in {len(rows)} of {b} pairs: {why}; "
            f"DPO then learns to {'prefer' if side == 'chosen' else 'avoid'} ending at once, not the answer",
            observed={"empty": len(rows), "batch": b, "side": side},
            expected=0,
            fix=fix,
            **ctx,
        )
    ]


def truncation_summary(report: Any) -> dict[str, int] | None:
    """trainer/data.py's Long[B, 4] report -> rows, cut, distinct before and after, longest, prompt length."""
    if (
        not isinstance(report, torch.Tensor)
        or report.dim() != 2
        or report.shape[1] != 4
        or not report.numel()
    ):
        return None
    if report.is_floating_point():  # a user's collator cast every field: the values are small integers
        report = report.round()
    r = report.long()
    length = int(r[0, 3])
    return {
        "rows": int(r.shape[0]),
        "cut": int((r[:, 0] > length).sum()),
        "distinct_before": int(torch.unique(r[:, 1]).numel()),
        "distinct_after": int(torch.unique(r[:, 2]).numel()),
        "longest": int(r[:, 0].max()),
        "prompt_length": length,
    }


def truncation_findings(batch: Mapping[str, Any], *, where: str, ctx: Mapping[str, Any]) -> list[Finding]:
    """The collator's truncation report: an info for prompts cut, a warning (an error when half or more
    of the distinct prompts were lost) for distinct prompts that became the same text."""
    rep = truncation_summary(batch.get(TRUNCATION_KEY))
    if rep is None or not rep["cut"]:
        return []
    cut, rows = rep["cut"], rep["rows"]
    before, after = rep["distinct_before"], rep["distinct_after"]
    length, longest = rep["prompt_length"], rep["longest"]
    collapsed = after < before
    severity = "info" if not collapsed else ("error" if 2 * after <= before else "warning")
    lost = (
        f": {before} distinct prompts became {after}, identical once cut (the cut keeps each prompt's end, "
        "so what told them apart at the start is lost)"
        if collapsed
        else f" ({before} distinct, none merged)"
    )
    return [
        Finding(
            severity=severity,
            kind=K.PROMPT_TRUNCATION,
            where=f"{where}.input_ids",
            message=f"{cut} of {rows} prompts are longer than data.prompt_length {length} and were cut "
            f"(the longest is {longest} tokens){lost}"
            + (": the policy cannot tell them apart, and their rewards disagree" if collapsed else ""),
            observed={"cut": cut, "rows": rows, "distinct_before": before, "distinct_after": after},
            expected={"distinct_after": before},
            fix=f"raise data.prompt_length to {longest} (the longest prompt), or shorten the prompts"
            + (" and put what differs between them last, next to the response" if collapsed else ""),
            **ctx,
        )
    ]


def batch_findings(
    batch: Mapping[str, Any],
    *,
    role: str,
    source: str,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]] = (),
    data: Mapping[str, Any] | None = None,
    step: int | None = None,
    phase: str | None = None,
) -> list[Finding]:
    """All batch invariants of one collated batch (``examples``: the pairs or prompts it collated;
    ``data``: the run's data config, whose plug-in specs a finding names)."""
    ctx = {"role": role, "step": step, "phase": phase}
    where = f"collator:{source}"
    return [
        *mask_findings(batch, tokenizer_info=tokenizer_info, where=where, ctx=ctx),
        *pair_findings(
            batch, tokenizer_info=tokenizer_info, where=where, ctx=ctx, examples=examples, data=data
        ),
        *(
            truncation.prompt_cut_findings(
                batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, ctx=ctx
            )
            or truncation_findings(batch, where=where, ctx=ctx)
        ),
        *truncation.pair_eos_findings(
            batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, ctx=ctx
        ),
        *special_tokens.doubled_findings(  # setupg
            batch, tokenizer_info=tokenizer_info, examples=examples, where=where, ctx=ctx
        ),
        *invariants_data.data_batch_findings(
            batch,
            tokenizer_info=tokenizer_info,
            examples=examples,
            data=data,
            source=source,
            where=where,
            ctx=ctx,
        ),
    ]


# ---------------------------------------------------------------- setup invariants


def setup_plugin(config: Mapping[str, Any], role: str) -> tuple[str, str] | None:
    """``(config key, spec)`` of the ``model.setup`` plug-in that ran on ``role``, or None."""
    setup = ((config or {}).get("model") or {}).get("setup")
    if isinstance(setup, str):
        return "model.setup", setup
    if isinstance(setup, Mapping):
        spec = setup.get(role, setup.get("*"))
        if spec is not None:
            return (f"model.setup.{role}" if role in setup else "model.setup.*"), str(spec)
    return None


def _u(dtype: torch.dtype) -> float:
    try:
        return rounding.unit_roundoff(dtype)
    except (ValueError, KeyError):
        return 2.0**-8


def reference_divergence(actor: nn.Module, reference: nn.Module) -> dict[str, Any]:
    """How the reference's parameters differ from the actor's: the names of those that differ in
    shape or are missing, and the largest relative RMS difference over shared ones beyond the coarser
    dtype's rounding (``worst``, ``worst_rel``, ``differ``: how many)."""
    ref = dict(reference.named_parameters())
    shape, missing, differ, worst, worst_rel = [], [], 0, None, 0.0
    with torch.no_grad():
        for name, p in actor.named_parameters():
            r = ref.pop(name, None)
            if r is None:
                missing.append(name)
                continue
            a, b = invariants_data.local_shard(p.detach()), invariants_data.local_shard(r.detach())
            if a.shape != b.shape:
                shape.append(name)
                continue
            if not a.numel():
                continue
            coarse = a.dtype if _u(a.dtype) >= _u(b.dtype) else b.dtype
            a32, b32 = a.to(coarse).float(), b.to(device=a.device, dtype=coarse).float()
            norm = float(a32.pow(2).mean().sqrt())
            rel = float((a32 - b32).pow(2).mean().sqrt()) / max(norm, 1e-30)
            if rel > 2 * _u(coarse) or rel != rel:
                differ += 1
                if rel > worst_rel or rel != rel:
                    worst, worst_rel = name, rel
    return {
        "shape": shape,
        "missing": missing,
        "extra": sorted(ref),
        "differ": differ,
        "worst": worst,
        "worst_rel": worst_rel,
    }


def reference_findings(config: Mapping[str, Any], models: Mapping[str, nn.Module]) -> list[Finding]:
    """``model/reference_not_actor`` when the reference is not the actor's starting point."""
    actor, reference = models.get("actor"), models.get("reference")
    if actor is None or reference is None:
        return []
    d = reference_divergence(actor, reference)
    if not (d["shape"] or d["missing"] or d["extra"] or d["differ"]):
        return []
    on_actor, on_ref = setup_plugin(config, "actor"), setup_plugin(config, "reference")
    deliberate = on_ref is not None and on_ref != on_actor and on_ref[0] == "model.setup.reference"
    parts = []
    if d["shape"]:
        parts.append(f"{len(d['shape'])} parameter(s) of another shape ({', '.join(d['shape'][:3])})")
    if d["missing"] or d["extra"]:
        parts.append(f"{len(d['missing']) + len(d['extra'])} parameter(s) only one of them has")
    if d["differ"]:
        parts.append(
            f"{d['differ']} parameter(s) with other values (worst {d['worst']}: {d['worst_rel']:.3g} relative)"
        )
    if deliberate:
        who = f"{on_ref[0]} ({on_ref[1]}) changed the reference on purpose, it seems"
        severity, fix = (
            "warning",
            (
                "if the reference is meant to be another model, expect KL(actor || reference) far from 0 at "
                f"step 0; if not, remove {on_ref[0]}"
            ),
        )
    elif on_actor is not None or on_ref is not None:
        culprit = on_actor if on_actor is not None and on_actor != on_ref else on_ref
        who = f"{culprit[0]} ({culprit[1]}) changed one of them after the reference was copied from the actor"
        severity = "error"
        fix = f"run {culprit[0]} on the reference too (model.setup: one plug-in for every role) or copy the change"
    else:
        who = "no model.setup ran: the models were built apart"
        severity, fix = "error", "build the reference as a copy of the actor's initial weights"
    return [
        Finding(
            severity=severity,
            kind=K.REFERENCE_NOT_ACTOR,
            role="reference",
            where=d["worst"] or (d["shape"] or d["missing"] or d["extra"])[0],
            message="before any update the reference is not the actor's starting point: "
            + "; ".join(parts)
            + f" ({who}); KL to the reference is not 0 at step 0",
            observed={k: d[k] for k in ("differ", "worst_rel")} | {"shape": d["shape"][:10]},
            expected="the actor's weights in the reference's dtype",
            fix=fix,
        )
    ]


def _dropout_seen(model: nn.Module) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """(dropout a training-mode forward applies: Dropout modules with p > 0, and modules' float
    dropout attributes above 0 -- Hugging Face attention applies ``self.attention_dropout`` functionally
    when training --, the config's dropout fields above 0) of a model."""
    mods: list[tuple[str, float]] = []
    for n, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.training and float(m.p) > 0:
                mods.append((n, float(m.p)))
            continue
        for f in DROPOUT_FIELDS:
            v = getattr(m, f, None) if m.training else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                mods.append((f"{n}.{f}" if n else f, float(v)))
    cfg = getattr(model, "config", None)
    fields = {
        f: float(getattr(cfg, f)) for f in DROPOUT_FIELDS if isinstance(getattr(cfg, f, None), (int, float))
    }
    return mods, {f: v for f, v in fields.items() if v > 0}


def dropout_findings(config: Mapping[str, Any], models: Mapping[str, nn.Module], trainable) -> list[Finding]:
    """``model/dropout_active`` per trainable role that trains with dropout, and for a reward model that
    scores in training mode with dropout (its forward must be deterministic: the same response must get
    the same score; a config's dropout fields act only in training mode, so an eval-mode reward model
    with them is fine)."""
    out: list[Finding] = []
    for role in (*trainable, "reward"):
        model = models.get(role)
        if model is None or not model.training:
            continue
        mods, fields = _dropout_seen(model)
        if not (mods or fields):
            continue
        plugin = setup_plugin(config, role)
        seen = [f"{n or '<root>'} p={p:g}" for n, p in mods[:3]] + [
            f"config.{f}={v:g}" for f, v in fields.items()
        ]
        counted = f"{len(mods)} module(s) that apply dropout: " if mods else ""
        ran = f" ({plugin[0]}: {plugin[1]} ran on it)" if plugin else ""
        zero = (
            "set dropout to 0: model.overrides {"
            + ", ".join(f"{f}: 0.0" for f in (fields or {"attention_dropout": 0}))
            + "}"
        )
        if role == "reward":
            message = (
                f"the reward model scores in training mode with dropout ({counted}{', '.join(seen)}){ran}: "
                "its forward is not deterministic, so the same response gets a different score from call to "
                "call and the rewards carry dropout noise"
            )
            fix = (
                "put the reward model in eval mode for scoring (model.eval()"
                + (f" at the end of {plugin[0]}; do not call .train() there)" if plugin else ")")
                + f", or {zero}"
            )
        else:
            message = (
                f"the {role} trains with dropout ({counted}{', '.join(seen)}): the rollout samples without "
                "it, the update recomputes log-probs with it, so the ratios and the KL see another policy than "
                f"the one that sampled{ran}"
            )
            fix = zero + (f", or set p = 0 on the Dropout modules in {plugin[0]}" if plugin else "")
        out.append(
            Finding(
                severity="warning",
                kind=K.DROPOUT_ACTIVE,
                role=role,
                where=mods[0][0] if mods else "config",
                message=message,
                observed={"modules": len(mods), "config": fields, "training": True},
                expected="no dropout in a forward that must be deterministic (eval mode, or dropout 0)",
                fix=fix,
            )
        )
    return out


PROBE_TOKENS = 8
"""Tokens of the fixed sequence `forward_spread` runs twice (one row: negligible next to a step)."""
NONDETERMINISTIC = 1e-3
"""Relative largest difference between two forwards of the same tokens from which the forward is random:
dropout at p = 0.1 moves outputs by ~10%; a deterministic forward repeats bit for bit on the CPU (0 on
every clean control) and within ~1e-6 where GPU reductions are not deterministic."""


def _vocab(model: nn.Module) -> int:
    for m in (model, getattr(model, "backbone", None)):
        v = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    return 2


def _out(result: Any) -> torch.Tensor | None:
    t = getattr(result, "logits", result)
    if isinstance(t, (tuple, list)) and t:
        t = t[0]
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def forward_spread(model: nn.Module) -> float | None:
    """The largest difference between two forwards of the same tokens in the model's current mode,
    relative to the output's largest magnitude; the random state is restored after them, so the run
    draws what it would have. None where it cannot be probed: no parameters, sharded or meta
    parameters (a forward on one rank would stall the others), forward hooks (user code that may change
    the model as it runs), training-mode batch norms (their statistics would move), or a forward that does not take
    ``input_ids`` / ``attention_mask`` or return a float tensor."""
    p = next(model.parameters(), None)
    if p is None or p.is_meta or callable(getattr(p, "to_local", None)):
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None  # a wrapped model's forward is a collective: one rank's probe would stall the others
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()):
        return None  # a training-mode forward would move its running statistics: the probe must not
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return None  # a user's hook may change the model when it runs (cast a buffer): the probe must not
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _vocab(model), (1, PROBE_TOKENS), generator=g).to(p.device)
    mask = torch.ones_like(ids)
    devices = [p.device.index or 0] if p.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            a, b = (_out(model(input_ids=ids, attention_mask=mask)) for _ in range(2))
    except Exception:  # the probe is best effort: a forward of another signature is not a finding
        return None
    if a is None or b is None or a.shape != b.shape:
        return None
    a, b = a.float(), b.float()
    scale = float(a.abs().max())
    diff = float((a - b).abs().max())
    if not math.isfinite(diff) or not math.isfinite(scale):
        return None
    return diff / max(scale, 1e-30)


def nondeterminism_findings(
    config: Mapping[str, Any], models: Mapping[str, nn.Module], trainable, *, known: set[str]
) -> list[Finding]:
    """``model/nondeterministic_forward`` per trainable role in training mode and a reward model whose
    two forwards of the same tokens differ (`forward_spread` above `NONDETERMINISTIC`): randomness the
    dropout check did not name (a role in ``known`` already has its dropout finding)."""
    out: list[Finding] = []
    for role in (*trainable, "reward"):
        model = models.get(role)
        if model is None or role in known or (role != "reward" and not model.training):
            continue
        spread = forward_spread(model)
        if spread is None or spread <= NONDETERMINISTIC:
            continue
        plugin = setup_plugin(config, role)
        ran = f" ({plugin[0]}: {plugin[1]} ran on it)" if plugin else ""
        what = (
            "the same response gets a different score from call to call"
            if role == "reward"
            else "the log-probs the update recomputes are not the policy the rollout sampled"
        )
        out.append(
            Finding(
                severity="warning",
                kind=K.NONDETERMINISTIC_FORWARD,
                role=role,
                where="forward",
                message=f"two forwards of the same {PROBE_TOKENS} tokens through the {role} "
                f"({'training' if model.training else 'eval'} mode) differ by up to {spread:.3g} of the "
                f"output's magnitude{ran}: something random runs in its forward (dropout, a noise "
                f"layer or hook), so {what}",
                observed={"relative_max_diff": spread, "training": model.training},
                expected=f"<= {NONDETERMINISTIC:g} (a deterministic forward)",
                fix="find the random op in the forward and turn it off for RL (dropout p = 0, model.eval() for "
                "a model that is not trained)"
                + (f"; {plugin[0]} is the first place to look" if plugin else ""),
            )
        )
    return out


def tied_findings(config: Mapping[str, Any], models: Mapping[str, nn.Module]) -> list[Finding]:
    """``model/tied_weights_broken`` per role whose config ties embeddings that are two tensors."""
    out: list[Finding] = []
    for role, model in models.items():
        cfg = getattr(model, "config", None)
        get_in, get_out = (
            getattr(model, "get_input_embeddings", None),
            getattr(model, "get_output_embeddings", None),
        )
        if not (getattr(cfg, "tie_word_embeddings", False) and callable(get_in) and callable(get_out)):
            continue
        try:
            emb, head = get_in(), get_out()
        except (NotImplementedError, AttributeError):
            continue
        w_in, w_out = getattr(emb, "weight", None), getattr(head, "weight", None)
        if not isinstance(w_in, torch.Tensor) or not isinstance(w_out, torch.Tensor) or w_in is w_out:
            continue
        plugin = setup_plugin(config, role)
        out.append(
            Finding(
                severity="warning",
                kind=K.TIED_WEIGHTS_BROKEN,
                role=role,
                where=next((n for n, p in model.named_parameters() if p is w_out), "lm_head"),
                message=f"the {role}'s config ties its input and output embeddings but they are two "
                f"tensors ({tuple(w_in.shape)} and {tuple(w_out.shape)})"
                + (f" after {plugin[0]} ({plugin[1]})" if plugin else "")
                + ": they train apart, and the output layer is no longer the model that was loaded",
                observed="separate tensors",
                expected="one tensor (tie_word_embeddings)",
                fix=(f"in {plugin[0]}, " if plugin else "")
                + "call model.tie_weights() after replacing or resizing an embedding",
            )
        )
    return out


def setup_findings(config: Mapping[str, Any], models: Mapping[str, nn.Module], trainable) -> list[Finding]:
    """The setup invariants (module docstring), once the user's ``model.setup`` ran."""
    dropout = dropout_findings(config, models, trainable)
    known = {f.role for f in dropout if f.role}
    return [
        *invariants_data.shared_role_findings(config, models, setup_plugin),
        *reference_findings(config, models),
        *dropout,
        *nondeterminism_findings(config, models, trainable, known=known),
        *tied_findings(config, models),
    ]
