"""What a length limit removed from the tokens the model conditions on and the loss weights.

Every token the objective weights, and every token the policy conditions on, must be the tokens the dataset's
prompt and completion say, in full. A length limit that cuts them is read from the rows themselves, whoever
cut (a builtin collator at ``data.prompt_length``, verl's ``data.truncation``, a user's collator that
tokenises with ``truncation=True`` up to a tokenizer's ``model_max_length``):

- prompts (`prompt_cut_findings`): each prompt row's attended ids against the tokenizer's encoding of its
  example's prompt. A row that is a strict suffix (the end kept), prefix (the start kept) or both ends of
  that encoding was cut; what was cut is said: the bos / special tokens lost, the characters of the
  example's answer no prompt token carries any more (the digit the answer repeats), distinct prompts
  before and after. The limit is named by what set it: the tokenizer file's ``model_max_length`` when the
  kept length is that, verl's ``data.truncation`` with ``data.prompt_length`` for verl rows, else
  ``data.prompt_length`` (`boundary/prompt_truncation`; an error when most rows lost their bos or the
  answer's content, or distinct prompts merged).
- preference pairs (`pair_eos_findings`): a DPO side whose response rows end without the eos the collator
  appends (cut at ``data.response_length``) in most pairs while the other side keeps it in most: the
  pairs teach when to stop as much as which answer (`data/pair_eos_cut`).

Exercised by `pytest tests/test_truncation.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit import guard
from verlaudit.audit.invariants_data import _prompt_part, _rows
from verlaudit.rundir import Finding

MIN_ROWS = 4
"""Rows a batch needs before a share of it is judged."""
SHARE = 0.5
"""Share of the rows past which a cut is the batch's, not one long example's."""
QUARTER = 0.25
"""Share of the rows from which a cut that loses the bos or the answer's content is a warning."""


def _guarded(fn: Callable[..., list[Finding]]) -> Callable[..., list[Finding]]:
    """A check's own bug goes to the audit's guard (`verlaudit.audit.guard`: stderr and an
    ``audit_check_failed`` event, once) and the check gives nothing: never the run's end."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> list[Finding]:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            guard.report(f"truncation.{fn.__name__}", exc, what="check")
            return []

    return run


def _enc(tok: Any, text: str, special: bool) -> list[int] | None:
    try:
        return [int(t) for t in tok(text, add_special_tokens=special)["input_ids"]]
    except Exception:  # a tokenizer of another call signature: nothing to compare with
        return None


def _dec(tok: Any, ids: Sequence[int]) -> str:
    try:
        return str(tok.decode(list(ids), skip_special_tokens=True))
    except Exception:
        return ""


def _cut(row: list[int], enc: list[int]) -> tuple[str, list[int]] | None:
    """(side kept, the ids cut) when ``row`` is ``enc`` with some of its ids cut, else None."""
    n, m = len(row), len(enc)
    if not n or n >= m:
        return None
    if row == enc[m - n :]:
        return "end", enc[: m - n]
    if row == enc[:n]:
        return "start", enc[n:]
    for k in range(1, n):  # both ends kept, the middle cut (verl's truncation: middle)
        if row[:k] == enc[:k] and row[k:] == enc[m - (n - k) :]:
            return "both ends", enc[k : m - (n - k)]
    return None


def limits(tok: Any, data: Mapping[str, Any] | None, width: int) -> set[int]:
    """The lengths a length limit may have cut a prompt row to: the batch's width, data.prompt_length, the
    tokenizer's model_max_length."""
    out = {width}
    for v in ((data or {}).get("prompt_length"), getattr(tok, "model_max_length", None)):
        if isinstance(v, int):
            out.add(v)
    return out


def _specials(tok: Any, info: Mapping[str, Any]) -> set[int]:
    ids = set(getattr(tok, "all_special_ids", None) or [])
    for t in (info.get("pad_token_id"), info.get("eos_token_id"), getattr(tok, "bos_token_id", None)):
        if isinstance(t, int):
            ids.add(t)
    return ids


def _limit(tok: Any, kept: int, data: Mapping[str, Any], source: str) -> tuple[str, str, str]:
    """(where, what set the limit, the fix) for prompts cut to ``kept`` tokens."""
    plen = data.get("prompt_length")
    mml = getattr(tok, "model_max_length", None)
    path = getattr(tok, "name_or_path", None) or "the tokenizer's directory"
    side = getattr(tok, "truncation_side", None)
    if isinstance(mml, int) and mml == kept and (not isinstance(plen, int) or mml < plen):
        file = f"{path}/tokenizer_config.json"
        return (
            f"model.tokenizer ({path}): model_max_length {mml}",
            f"the tokenizer's model_max_length {mml} (truncation_side {side!r}, set in {file}), which the "
            f"collator {source} applies by tokenising with truncation=True",
            f"{file}: set model_max_length to at least the longest prompt (or remove it), or make the collator "
            f"{source} tokenise without truncation=True (or with max_length=data.prompt_length)",
        )
    if data.get("train_files"):
        mode = data.get("truncation") or "error"
        return (
            f"data.truncation ({mode}) at data.prompt_length {plen}",
            f"verl's data.truncation: {mode} at data.prompt_length {plen}",
            "data.truncation: left (keep each prompt's end, the question next to the response), or raise "
            "data.prompt_length, or data.filter_overlong_prompts: true to drop the prompts that do not fit",
        )
    if isinstance(plen, int) and kept == plen:
        return (
            f"data.prompt_length ({plen})",
            f"data.prompt_length {plen}",
            "",
        )
    return (
        f"collator:{source}",
        f"the collator {source}, which cuts prompts to {kept} tokens",
        f"{source}: do not cut prompts (no max_length / truncation below data.prompt_length {plen})",
    )


def _cut_rows(tok: Any, rows: list[list[int]], prompts: list[str], allowed: set[int]) -> list[tuple] | None:
    """(row index, side kept, ids cut, the full encoding) of each row cut by one length limit, or None
    when no row was, or the rows' lengths are not one limit's (a collator that strips or rewrites: the
    round-trip check's)."""
    b = len(rows)
    cuts = []
    for i, (row, text) in enumerate(zip(rows, prompts)):
        for special in (True, False):
            enc = _enc(tok, text, special)
            if enc is None:
                return None
            if row == enc:
                break
            cut = _cut(row, enc)
            if cut is not None:
                cuts.append((i, *cut, enc))
                break
    if not cuts or (len(cuts) < SHARE * b and b >= MIN_ROWS and len(cuts) < 2):
        return None
    lengths = {len(rows[i]) for i, *_ in cuts}
    if len(lengths) != 1 or (len(cuts) < 2 and not lengths <= allowed):
        return None
    return cuts


@_guarded
def prompt_cut_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any] | None,
    source: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``boundary/prompt_truncation`` from the rows themselves (module docstring); [] when no row was cut or
    the rows are not the examples' prompts (the round-trip check's)."""
    tok = tokenizer_info.get("tokenizer")
    part = _prompt_part(batch)
    b = len(examples)
    if tok is None or part is None or b < 2 or part[0].shape[0] != b:
        return []
    prompts = [ex.get("prompt") if isinstance(ex, Mapping) else None for ex in examples]
    if any(not isinstance(p, str) for p in prompts):
        return []
    data = dict(data or {})
    rows = [list(r) for r in _rows(*part)]
    cuts = _cut_rows(tok, rows, prompts, limits(tok, data, int(part[0].shape[1])))
    if cuts is None:
        return []
    specials = _specials(tok, tokenizer_info)
    n = len(cuts)
    kept = max(len(rows[i]) for i, *_ in cuts)
    longest = max(len(e) for *_, e in cuts)
    sides = sorted({s for _, s, _, _ in cuts})
    lost_special = sum(any(t in specials for t in c) for _, _, c, _ in cuts)
    answer_lost = []
    for i, _, _c, enc in cuts:
        answer = examples[i].get("answer") if isinstance(examples[i], Mapping) else None
        if not isinstance(answer, str) or not answer.strip():
            continue
        full, kept_text = _dec(tok, enc), _dec(tok, rows[i])
        gone = sorted({ch for ch in answer if not ch.isspace() and ch in full and ch not in kept_text})
        if gone:
            answer_lost.append((i, gone))
    before = len({p for p in prompts})
    after = len({tuple(r) for r in rows})
    collapsed = after < before
    where, what_set, fix = _limit(tok, kept, data, source)
    if not fix:
        fix = f"raise data.prompt_length to {longest} (the longest prompt), or shorten the prompts"
        if data.get("train_files") is None and "end" in sides:
            fix += " so that nothing before the question (the bos, the first tokens) is cut"
    share_special, share_answer = lost_special / n, len(answer_lost) / n
    many = b >= MIN_ROWS and n >= SHARE * b  # most of a batch large enough to judge
    bad = (collapsed and 2 * after <= before) or (many and (share_special >= SHARE or share_answer >= SHARE))
    lossy = b >= MIN_ROWS and n >= QUARTER * b and bool(answer_lost or lost_special)
    severity = "error" if bad else ("warning" if collapsed or lossy else "info")
    i0, _, cut0, _ = cuts[0]
    parts = _parts(n, b, kept, longest, what_set, sides, lost_special, answer_lost, before, after)
    shown = _dec(tok, cut0)
    return [
        Finding(
            severity=severity,
            kind=K.PROMPT_TRUNCATION,
            where=where,
            message="; ".join(parts)
            + f" (example {i0}: cut {shown!r}): the policy answers prompts without what the dataset put there",
            observed={
                "cut": n,
                "rows": b,
                "kept_tokens": kept,
                "longest": longest,
                "side_kept": sides,
                "lost_special": lost_special,
                "answer_content_lost": len(answer_lost),
                "distinct_before": before,
                "distinct_after": after,
            },
            expected="every prompt row holds its example's whole prompt (bos included)",
            fix=fix,
            **ctx,
        )
    ]


def _parts(n, b, kept, longest, what_set, sides, lost_special, answer_lost, before, after) -> list[str]:
    """The clauses of a prompt-truncation message: how many were cut by what, which side was kept, what
    was lost."""
    kept_side = {"end": "keeps each prompt's end", "start": "keeps each prompt's start",
                 "both ends": "keeps each prompt's two ends"}  # fmt: skip
    parts = [
        f"{n} of {b} prompts are longer than {kept} tokens (the longest {longest}) and were cut by {what_set}"
    ]
    parts.append(f"the cut {' / '.join(kept_side[s] for s in sides)}")
    if lost_special:
        parts.append(f"{lost_special} of them lost special tokens (the bos the model reads first)")
    if answer_lost:
        j, gone = answer_lost[0]
        parts.append(
            f"in {len(answer_lost)} of them the kept prompt no longer holds {''.join(gone)!r}, content of the "
            f"answer the reward compares (example {j})"
        )
    if before > after:
        parts.append(
            f"{before} distinct prompts became {after}: identical once cut (the question never reaches the policy)"
        )
    else:
        parts.append(f"{before} distinct, none merged")
    return parts


@_guarded
def pair_eos_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any] | None,
    source: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/pair_eos_cut``: one DPO side cut before its eos in most pairs, the other side ending with it."""
    eos = tokenizer_info.get("eos_token_id")
    tok = tokenizer_info.get("tokenizer")
    if not isinstance(eos, int):
        return []
    ended: dict[str, list[bool]] = {}
    for side in ("chosen", "rejected"):
        ids, resp = batch.get(f"{side}_input_ids"), batch.get(f"{side}_response_mask")
        if not isinstance(ids, torch.Tensor) or not isinstance(resp, torch.Tensor):
            return []
        if ids.dim() != 2 or resp.dim() != 2 or resp.shape[1] > ids.shape[1] or ids.is_floating_point():
            return []
        rows = _rows(ids[:, -resp.shape[1] :], resp.round().long() if resp.is_floating_point() else resp)
        ended[side] = [eos in r for r in rows]
    b = len(ended["chosen"])
    if b < MIN_ROWS or len(ended["rejected"]) != b:
        return []
    width = int(batch["chosen_response_mask"].shape[1])
    share = {s: sum(not e for e in v) / b for s, v in ended.items()}
    cut = [s for s in share if share[s] >= SHARE]
    if len(cut) != 1 or share[{"chosen": "rejected", "rejected": "chosen"}[cut[0]]] > 1 - SHARE:
        return []
    side = cut[0]
    other = "rejected" if side == "chosen" else "chosen"
    longest = None
    if tok is not None and examples:
        lens = [
            len(e) + 1
            for ex in examples
            if isinstance(ex.get(side), str) and (e := _enc(tok, ex[side], False))
        ]
        longest = max(lens) if lens else None
    data = dict(data or {})
    rlen = data.get("response_length", width)
    n_cut = sum(not e for e in ended[side])
    n_other = sum(not e for e in ended[other])
    return [
        Finding(
            severity="warning",
            kind=K.PAIR_EOS_CUT,
            where=f"data.response_length ({rlen}) on the {side} side of the pairs of {_source(data, source)}",
            message=f"{n_cut} of {b} {side} responses are cut at data.response_length {rlen} before their eos, while "
            f"{b - n_other} of {b} {other} responses end with eos"
            + (f" (the longest {side} completion is {longest} tokens with its eos)" if longest else "")
            + f": every pair also prefers 'do not stop' ({side} without eos) against 'stop', so DPO learns the "
            "length as much as the answer",
            observed={
                f"{side}_without_eos": n_cut,
                f"{other}_without_eos": n_other,
                "pairs": b,
                "response_length": rlen,
                "longest": longest,
            },  # fmt: skip
            expected="both sides of each pair end with eos within data.response_length (or both are cut)",
            fix=f"raise data.response_length to {longest or 'the longest completion + eos'}, or shorten the "
            f"{side} completions (strip what follows the answer) so both sides of a pair end with eos",
            **ctx,
        )
    ]


def _source(data: Mapping[str, Any], source: str) -> str:
    if data.get("dataset"):
        return f"data.dataset ({data['dataset']})"
    return f"collator:{source}"
