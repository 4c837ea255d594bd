"""The data contract: what the model is shown and scored against is what the dataset says.

Read from the first audited batches (the collated rows and the examples ``on_batch`` receives), each
kind found once per run:

- round trip (`round_trip_findings`): the attended ids of each prompt row, decoded, give back the
  example's prompt text (a template around it is allowed: the text must be inside the decoded row).
  A collator that strips, cuts, re-cases or re-orders part of the prompt (the trailing answer cue, the
  question's number, its instruction) is ``data/prompt_rewritten`` naming the collator and what was
  lost; a collator whose rows lack the bos the tokenizer puts first is ``data/bos_missing``; rows that
  lost exactly the pad token's character (a mask built as ``ids != pad`` where pad is a digit) are
  ``model/special_token_content``. Both sides go through the same decoder, so a lossy decoder (its own
  check, `tokenizer_checks.round_trip`) does not make a difference here;
- special tokens are not content (`special_content_findings`): the pad / eos / bos id never occurs in
  the tokenizer's encoding of the examples' own text (a pad token that is '0', ' ' or '\\n');
- ground truths are reachable (`unreachable_findings`): an answer that encodes to ``<unk>`` can never
  be produced by the policy (a character the vocabulary lacks);
- ground truths use the prompts' notation (`notation_findings`): answers whose characters never occur
  in any prompt, but whose other case (or NFKC form: full-width digits) does, are written in another
  notation than the task shows (an answer column lower-cased, the prompt column from a display copy);
- ground truths are consistent (`ConflictWatch`): the same prompt with different answers, or a
  preference pair and its reverse. Pooled over the batches and, once, over the whole dataset: for
  ``data.dataset`` the audit calls the user's dataset function a second time at the first batch (it
  takes no arguments; ``audit.probe_plugins: false`` turns that off, and a call that raises or returns
  something else than a list of dicts is ignored).

Exercised by `pytest tests/test_data_contract.py`.
"""

from __future__ import annotations

import difflib
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit.invariants_data import _data_source, _prompt_part, _rows
from verlaudit.audit.truncation import _cut, limits
from verlaudit.rundir import Finding

MIN_ROWS = 4
"""Rows a batch needs before shares of it are judged."""
SHARE = 0.5
"""Share of rows (answers) past which a batch's difference is the collator's (dataset's), not one odd row."""
CONFLICT_MIN = 3
"""Prompts with two ground truths from which the dataset is conflicting (one could be a typo)."""
CONFLICT_SHARE = 0.05
"""...and their share of the distinct prompts seen (a dataset whose every prompt appears once has none)."""
RELOAD_MAX = 200_000
"""Examples above which the whole-dataset pass reads only the first ones."""


def guarded(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``[]`` when it raises: a check's own bug is named on stderr once, never the run's end."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (any exception of a check: the run must not die of it)
        print(
            f"verlaudit: a data-contract check failed ({type(exc).__name__}: {exc}); skipped", file=sys.stderr
        )
        return []


def _text(ex: Any, key: str) -> str | None:
    v = ex.get(key) if isinstance(ex, Mapping) else None
    return v if isinstance(v, str) else None


def _encode(tok: Any, text: str, special: bool) -> list[int] | None:
    try:
        return list(tok(text, add_special_tokens=special)["input_ids"])
    except Exception:  # a tokenizer of another call signature: nothing to compare with
        return None


def _decode(tok: Any, ids: Sequence[int]) -> str | None:
    try:
        return str(tok.decode(list(ids), skip_special_tokens=False))
    except Exception:  # a tokenizer that cannot decode: nothing to compare
        return None


def _literal(tok: Any, token_id: int | None) -> str | None:
    if tok is None or not isinstance(token_id, int):
        return None
    try:
        text = tok.convert_ids_to_tokens(token_id)
    except Exception:
        return None
    return text if isinstance(text, str) else None


def tokenizer_where(tok: Any, data_default: str = "model.tokenizer") -> str:
    path = getattr(tok, "name_or_path", None)
    return f"model.tokenizer ({path})" if isinstance(path, str) and path else data_default


def _strip_specials(ids: Sequence[int], specials: set[int]) -> tuple[list[int], int]:
    """``ids`` without its leading and trailing special ids, and how many bos-like leading ones it had."""
    ids = list(ids)
    lead = 0
    while ids and ids[0] in specials:
        ids.pop(0)
        lead += 1
    while ids and ids[-1] in specials:
        ids.pop()
    return ids, lead


def _show(s: str) -> str:
    return repr(s if len(s) <= 40 else s[:37] + "...")


def _describe(text: str, row: str) -> tuple[str, str]:
    """(what the row did to the text, a short tag) for a decoded row that does not hold its text."""
    if text.lower() == row.lower() or text.lower() in row.lower():
        return "changed its case", "case"
    if text.split() == row.split() or "".join(text.split()) in "".join(row.split()):
        return "changed its whitespace", "whitespace"
    ops = difflib.SequenceMatcher(None, text, row, autojunk=False).get_opcodes()
    lost = [(i1, i2) for tag, i1, i2, _, _ in ops if tag in ("delete", "replace")]
    added = [row[j1:j2] for tag, _, _, j1, j2 in ops if tag in ("insert", "replace")]
    if not lost:
        return "rewrote it", "rewritten"
    parts = []
    for i1, i2 in lost[:3]:
        seg = text[i1:i2]
        at = "its end" if i2 == len(text) else "its start" if i1 == 0 else f"position {i1}"
        moved = (
            " (moved elsewhere in the row)" if any(seg.strip() and seg.strip() in a for a in added) else ""
        )
        parts.append(f"{_show(seg)} at {at}{moved}")
    tag = "end" if lost[-1][1] == len(text) else "start" if lost[0][0] == 0 else "middle"
    return "dropped " + ", ".join(parts), tag


def round_trip_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/prompt_rewritten``, ``data/bos_missing`` or ``model/special_token_content`` when most prompt rows
    do not decode to their example's prompt (module docstring)."""
    tok = tokenizer_info.get("tokenizer")
    part = _prompt_part(batch)
    prompts = [_text(ex, "prompt") for ex in examples]
    b = len(examples)
    if tok is None or part is None or b < 2 or part[0].shape[0] != b or any(p is None for p in prompts):
        return []
    ids, _ = part
    width = int(ids.shape[1])
    vocab = tokenizer_info.get("vocab_size")
    if ids.numel() and (int(ids.min()) < 0 or (isinstance(vocab, int) and int(ids.max()) >= vocab)):
        return []  # ids outside the vocabulary decode to nothing: the id-range check names them
    rows = _rows(*part)
    pad = tokenizer_info.get("pad_token_id")
    bos = getattr(tok, "bos_token_id", None)
    specials = set(getattr(tok, "all_special_ids", None) or []) | {
        t for t in (pad, bos, tokenizer_info.get("eos_token_id")) if isinstance(t, int)
    }
    pad_text = _literal(tok, pad)
    if isinstance(pad, int) and pad_text and len(pad_text) > 1 and any(pad in r for r in rows):
        return []  # padding attended: the mask-covers-padding check's (the rows' text is not the question)
    plen = (data or {}).get("prompt_length")
    cores = [_strip_specials(e, specials)[0] if (e := _encode(tok, t, True)) else None for t in prompts]
    changed: list[tuple[int, str, str, str, str]] = []  # (row, text, decoded row, what, tag)
    no_bos = 0
    bos_rows = 0
    for i, (row, text) in enumerate(zip(rows, prompts)):
        if not text.strip():
            continue  # an empty prompt is the empty-prompt check's
        enc = _encode(tok, text, True)
        if enc is None:
            return []
        row = list(row)
        cut = _cut(row, enc) or _cut(row, _encode(tok, text, False) or [])
        if row == enc or (cut is not None and len(row) in limits(tok, data, width)):
            continue  # the prompt itself, or a cut by a length limit (the truncation check's, `truncation`)
        e_core, e_lead = _strip_specials(enc, specials)
        r_core, r_lead = _strip_specials(row, specials)
        if e_lead and bos is not None and enc[0] == bos:
            bos_rows += 1
            no_bos += int(not row or row[0] != bos)
        if r_core == e_core:
            continue  # the same text; only special tokens around it differ
        if any(r_core == c for j, c in enumerate(cores) if j != i and c):
            continue  # another example's prompt: the row-order check's
        d_text, d_row = _decode(tok, e_core), _decode(tok, r_core)
        if d_text is None or d_row is None:
            return []
        if d_text and d_text in d_row:
            continue  # a template around the prompt: it holds the text whole
        if len(row) == width and len(enc) > width and r_core == e_core[: len(r_core)] and r_core:
            what, tag = (
                f"kept its first {len(row)} tokens and dropped the end {_show(d_text[len(d_row) :])}",
                "cut",
            )
        elif isinstance(plen, int) and len(enc) > plen and d_text.endswith(d_row):
            continue  # the prompt is longer than data.prompt_length: its cut is the truncation check's
        else:
            what, tag = _describe(d_text, d_row)
        changed.append((i, d_text, d_row, what, tag))
    out: list[Finding] = []
    if len(changed) >= SHARE * b and (b >= MIN_ROWS or len(changed) == b):  # a small batch: every row
        out += _rewritten(changed, b, tok=tok, pad=pad, source=source, where=where, ctx=ctx)
    if bos_rows >= 2 and no_bos >= SHARE * bos_rows and (bos_rows >= MIN_ROWS or no_bos == bos_rows):
        out.append(_bos_finding(tok, bos, no_bos, bos_rows, source=source, where=where, ctx=ctx))
    return out


def completion_round_trip_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/completion_rewritten`` when most rows of a DPO side's response part do not decode to the
    pair's text for that side (cut at the response length is allowed; a row holding another text of the
    batch, a swap or a shift, is the pair checks')."""
    import torch

    tok = tokenizer_info.get("tokenizer")
    b = len(examples)
    if tok is None or b < MIN_ROWS:
        return []
    specials = {
        t
        for t in (tokenizer_info.get("pad_token_id"), tokenizer_info.get("eos_token_id"))
        if isinstance(t, int)
    }
    for side in ("chosen", "rejected"):
        ids, resp = batch.get(f"{side}_input_ids"), batch.get(f"{side}_response_mask")
        texts = [_text(ex, side) for ex in examples]
        if (
            not isinstance(ids, torch.Tensor)
            or not isinstance(resp, torch.Tensor)
            or any(t is None for t in texts)
        ):
            return []
        if ids.dim() != 2 or resp.dim() != 2 or ids.shape[0] != b or resp.shape[1] > ids.shape[1]:
            return []
        if ids.is_floating_point() or resp.is_floating_point():
            return []
        width = int(resp.shape[1])
        others = {t for ex in examples for k in ("chosen", "rejected") if (t := _text(ex, k))}
        changed = []
        for i, (row, text) in enumerate(zip(_rows(ids[:, -width:], resp), texts)):
            enc = _encode(tok, text, False)
            if enc is None:
                return []
            core, _ = _strip_specials(row, specials)
            if (
                not text.strip()
                or not core
                or core == enc
                or (len(row) >= width - 1 and enc[: len(core)] == core)
            ):
                continue
            d_row, d_text = _decode(tok, core), _decode(tok, enc)
            if d_row is None or d_text is None or d_text in d_row:
                continue
            if any(
                d_row.strip() == o.strip() or (o.startswith(d_row) and len(row) >= width - 1) for o in others
            ):
                continue  # another text of the batch: a swap or a shift, the pair checks' to name
            changed.append((i, d_text, d_row, *_describe(d_text, d_row)))
        if len(changed) < SHARE * b:
            continue
        i, text, row, what, tag = changed[0]
        return [
            Finding(
                severity="error",
                kind=K.COMPLETION_REWRITTEN,
                where=f"{where}.{side}_input_ids",
                message=f"{len(changed)} of {b} {side} responses the collator {source} returned decode to another "
                f"text than the pair's {side} completion: the collator {what} (pair {i}: {side} {_show(text)}, the "
                f"row decodes to {_show(row)}): the preference is learnt on other completions than the dataset's",
                observed={"rows_changed": len(changed), "batch": b, "side": side, "how": tag},
                expected=f"each {side} response row decodes to its pair's {side} text (cut at the response length)",
                fix=f"{source}: encode ex['{side}'] as it is (no strip / lower / cut of the text before tokenizing), "
                "followed by eos",
                **ctx,
            )
        ]
    return []


def _bos_finding(tok, bos, no_bos, bos_rows, *, source, where, ctx) -> Finding:
    label = _literal(tok, bos) or f"id {bos}"
    return Finding(
        severity="error",
        kind=K.BOS_MISSING,
        where=where,
        message=f"{no_bos} of {bos_rows} prompt rows the collator {source} returned do not start with the "
        f"bos token {label!r} (id {bos}) that the tokenizer puts first (tokenizer(prompt) starts with it): "
        "the collator encodes without special tokens (add_special_tokens=False) or cuts them off, so the "
        "model reads every prompt without the start-of-sequence it was trained after",
        observed={"rows_without_bos": no_bos, "rows": bos_rows, "bos_token_id": bos},
        expected="each prompt row starts with the tokenizer's bos",
        fix=f"{source}: encode each prompt with the tokenizer's special tokens (tokenizer(prompt), "
        "add_special_tokens=True) so its bos is the row's first token",
        **ctx,
    )


def _rewritten(changed, b, *, tok, pad, source, where, ctx) -> list[Finding]:
    i, text, row, what, tag = changed[0]
    pad_text = _literal(tok, pad)
    if pad_text and all(
        len(t) > len(r) and t.replace(pad_text, "") == r.replace(pad_text, "") for _, t, r, _, _ in changed
    ):  # every row lost exactly the pad's character: a mask (or a filter) of ids != pad drops real text
        return [_content_finding(tok, "pad", pad, pad_text, len(changed), b, example=(i, text, row), ctx=ctx)]
    tags = sorted({c[4] for c in changed})
    spaces = all(t.split() == r.split() for _, t, r, _, _ in changed)  # only whitespace differs: often benign
    return [
        Finding(
            severity="warning" if spaces else "error",
            kind=K.PROMPT_REWRITTEN,
            where=where,
            message=f"{len(changed)} of {b} prompt rows the collator {source} returned decode to another text than "
            f"the example's prompt: the collator (its template or cleaning) {what} (example {i}: prompt "
            f"{_show(text)}, the row decodes to {_show(row)}): the model is shown prompts without what the task "
            "put there (the cue it answers after, the question's numbers, the instruction), so it answers another "
            "prompt than the one the reward checks",
            observed={
                "rows_changed": len(changed),
                "batch": b,
                "how": tags,
                "example": i,
                "prompt": text,
                "decoded_row": row,
            },  # fmt: skip
            expected="each prompt row decodes to its example's prompt (inside any template)",
            fix=f"{source}: encode ex['prompt'] as it is (no rstrip / strip / lower / cut of the text before "
            "tokenizing), or keep what the cleaning removes (the trailing cue such as ':' the model answers "
            "after); a template must hold the whole prompt",
            **ctx,
        )
    ]


def _content_finding(tok, name, token_id, literal, n, of, *, example=None, ctx) -> Finding:
    where = tokenizer_where(tok)
    ex = ""
    if example is not None:
        i, text, row = example
        ex = f" (example {i}: {_show(text)} is attended as {_show(row)})"
    return Finding(
        severity="error",
        kind=K.SPECIAL_TOKEN_CONTENT,
        where=where,
        message=f"the tokenizer's {name} token is {literal!r} (id {token_id}), a character of the text: {n} of {of} "
        f"prompts hold it as content{ex}; a mask built as ids != {token_id} drops those characters, and "
        "decoding with skip_special_tokens deletes them from every response, so answers holding it can never "
        "be matched",
        observed={"token": name, "token_id": token_id, "literal": literal, "rows": n, "of": of},
        expected=f"a {name} token that no text encodes to (a dedicated special token)",
        fix=f"{where}: {_name_fix(name)} that is not a character of the text "
        "(tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the embeddings, or pad with eos and "
        "build masks from lengths) in tokenizer_config.json / special_tokens_map.json",
        **ctx,
    )


def special_ids(tok: Any, pad: int | None, eos: int | None) -> dict[str, int | None]:
    """The special tokens a text must never encode to, by name: pad, eos, bos and the tokenizer's added
    special tokens (``additional_special_tokens``; unk is the reachability check's)."""
    ids: dict[str, int | None] = {"pad": pad, "eos": eos, "bos": getattr(tok, "bos_token_id", None)}
    unk = getattr(tok, "unk_token_id", None)
    for t in getattr(tok, "all_special_ids", None) or []:
        if t not in ids.values() and t != unk:
            ids[f"additional special ({_literal(tok, t)!r})"] = t
    return ids


def _name_fix(name: str) -> str:
    """What to change for a special token that is text: a named token's setting, or the added list."""
    if name in ("pad", "eos", "bos"):
        return f"set {name}_token to a dedicated special token"
    return "remove it from additional_special_tokens (it is text, not a control token)"


def content_hits(tok: Any, texts: Sequence[str], ids: Mapping[str, int | None]) -> dict[str, int]:
    """Special token name -> how many of ``texts`` encode (without special tokens) to a sequence holding
    its id."""
    hits = {n: 0 for n, t in ids.items() if isinstance(t, int)}
    for text in texts:
        enc = _encode(tok, text, False)
        if enc is None:
            return {}
        for n in hits:
            hits[n] += int(ids[n] in enc)
    return {n: c for n, c in hits.items() if c}


def special_content_findings(
    examples: Sequence[Mapping[str, Any]], *, tokenizer_info: Mapping[str, Any], ctx: Mapping[str, Any]
) -> list[Finding]:
    """``model/special_token_content`` when the examples' prompts or answers encode to the pad / eos / bos id."""
    tok = tokenizer_info.get("tokenizer")
    if tok is None:
        return []
    texts = [t for ex in examples for k in ("prompt", "answer", "chosen", "rejected") if (t := _text(ex, k))]
    ids = special_ids(tok, tokenizer_info.get("pad_token_id"), tokenizer_info.get("eos_token_id"))
    for name, token_id in ids.items():
        literal = _literal(tok, token_id)
        if literal is None or any(literal in t for t in texts if len(literal) > 1):
            ids[name] = (
                None  # the token's own literal in the text ('<eos>' written out): the prompt_eos check's
            )
    hits = content_hits(tok, texts, ids)
    if not hits:
        return []
    name = next(iter(hits))
    return [_content_finding(tok, name, ids[name], _literal(tok, ids[name]), hits[name], len(texts), ctx=ctx)]


def unreachable_findings(
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/answer_unreachable`` when answers (or prompts) encode to the tokenizer's unk id."""
    tok = tokenizer_info.get("tokenizer")
    unk = getattr(tok, "unk_token_id", None) if tok is not None else None
    if not isinstance(unk, int):
        return []
    for field in ("answer", "chosen", "prompt"):
        texts = [t for ex in examples if (t := _text(ex, field)) and t.strip()]
        if len(texts) < MIN_ROWS:
            continue
        bad = []
        for t in texts:
            enc = _encode(tok, t, False)
            if enc is None:
                return []
            if unk in enc:
                bad.append(t)
        if len(bad) < SHARE * len(texts) and not (field != "prompt" and len(bad) >= MIN_ROWS):
            continue
        chars = sorted({c for t in bad for c in t if unk in (_encode(tok, c, False) or [])})
        shown = "".join(chars[:12])
        basic = bool(chars) and all(
            c.isascii() for c in chars
        )  # the vocabulary lacks plain ASCII: the tokenizer's
        at = tokenizer_where(tok) if basic else _data_source(data)
        target = "ground truths" if field != "prompt" else "prompts"
        return [
            Finding(
                severity="error",
                kind=K.ANSWER_UNREACHABLE,
                where=at,
                message=f"{len(bad)} of {len(texts)} {target} ({field!r}, e.g. {_show(bad[0])}) hold characters the "
                f"tokenizer's vocabulary lacks ({shown!r} encode to {_literal(tok, unk) or 'unk'}, id {unk}): "
                + (
                    "no response can write them, so the reward never matches"
                    if field != "prompt"
                    else "the model reads <unk> where the prompt has them"
                ),
                observed={
                    "field": field,
                    "texts_with_unk": len(bad),
                    "texts": len(texts),
                    "characters": chars,
                },
                expected=f"{target} the tokenizer can encode",
                fix=(
                    f"{at}: use a tokenizer whose vocabulary holds {shown!r} (the checkpoint's own), or write the "
                    f"{field}s in characters it has"
                    if basic
                    else f"{at}: write the {field}s in characters the tokenizer has (normalise them: "
                    "unicodedata.normalize('NFKC', text) for full-width digits, the vocabulary's case)"
                ),
                **ctx,
            )
        ]
    return []


def _other_forms(c: str) -> list[tuple[str, str]]:
    out = []
    if c.swapcase() != c:
        out.append((c.swapcase(), "lower case" if c.islower() else "upper case"))
    n = unicodedata.normalize("NFKC", c)
    if n != c:
        out.append((n, "a full-width / compatibility form (NFKC changes it)"))
    return out


def notation_findings(
    examples: Sequence[Mapping[str, Any]], *, data: Mapping[str, Any], ctx: Mapping[str, Any]
) -> list[Finding]:
    """``data/answer_notation`` when most answer characters never occur in any prompt of the batch, and their
    other case (or NFKC form) does."""
    pairs = [
        (p, a) for ex in examples if (p := _text(ex, "prompt")) is not None and (a := _text(ex, "answer"))
    ]
    if len(pairs) < MIN_ROWS:
        return []
    seen = {c for p, _ in pairs for c in p}
    chars = [c for _, a in pairs for c in a if not c.isspace()]
    foreign = [c for c in chars if c not in seen]
    if not chars or len(foreign) < SHARE * len(chars):
        return []
    mapped = [(c, f, how) for c in foreign for f, how in _other_forms(c) if all(x in seen for x in f)]
    if len({c for c, _, _ in mapped}) < 0.9 * len(set(foreign)):
        return []  # answers in another alphabet than the prompts (a translation): no notation of the prompts'
    how = sorted({h for _, _, h in mapped})
    fold = [(p, a) for p, a in pairs if a not in p and _fold(a) in _fold(p)]
    at = _data_source(data)
    p, a = fold[0] if fold else pairs[0]
    copy = (
        f"; in {len(fold)} of {len(pairs)} examples the prompt shows the answer itself in the other notation "
        f"(prompt {_show(p)}, answer {_show(a)})"
        if fold
        else f" (e.g. prompt {_show(p)}, answer {_show(a)})"
    )
    return [
        Finding(
            severity="error" if len(fold) >= SHARE * len(pairs) else "warning",
            kind=K.ANSWER_NOTATION,
            where=at,
            message=f"{len(foreign)} of the answers' {len(chars)} characters never occur in any prompt of the batch, "
            f"while their other form does: the answers are written in {' / '.join(how)} where the prompts write "
            f"the same characters otherwise{copy}; a response in the prompts' notation never matches its answer "
            "(the answers and the prompts come from different columns or normalisations)",
            observed={
                "foreign_chars": len(foreign),
                "answer_chars": len(chars),
                "how": how,
                "examples_folded": len(fold),
            },  # fmt: skip
            expected="answers written in the notation the prompts use",
            fix=f"{at}: build the answers and the prompts from the same column / normalisation (convert the case "
            "of one to the other's: lower() / upper(), or NFKC both)",
            **ctx,
        )
    ]


def _fold(s: str) -> str:
    return unicodedata.normalize("NFKC", s).casefold()


class ConflictWatch:
    """Prompt -> its ground truths (and its preference pairs) pooled over the batches and, once, the dataset."""

    def __init__(self) -> None:
        self.answers: dict[str, set[str]] = {}
        self.prefs: dict[str, set[tuple[str, str]]] = {}
        self.reloaded = False
        self.version = 0
        """Bumped by every new (prompt, answer) or pair: `findings` reads the pool again only when it grew."""
        self._read = -1
        self.ordered: list[tuple[str, str]] = []
        """The reloaded dataset's (prompt, answer) in its order: whether the answers are offset by rows."""
        self.dataset: list[Mapping[str, Any]] = []
        """The reloaded dataset's examples (verl rows as `verl_plain`), for data13's information checks."""

    def add(self, examples: Sequence[Mapping[str, Any]]) -> None:
        for ex in examples:
            p = _text(ex, "prompt")
            if p is None:
                continue
            c, r = _text(ex, "chosen"), _text(ex, "rejected")
            if c is not None and r is not None:
                if c != r and (c, r) not in self.prefs.setdefault(p, set()):
                    self.prefs[p].add((c, r))
                    self.version += 1
                continue
            a = _text(ex, "answer")
            if a is None:
                gt = ex.get("ground_truth") if isinstance(ex, Mapping) else None
                a = gt if isinstance(gt, str) else None
            if a is not None and a not in self.answers.setdefault(p, set()):
                self.answers[p].add(a)
                self.version += 1

    def reload(self, data: Mapping[str, Any], *, allowed: bool) -> None:
        """Reads the whole dataset once: ``data.dataset`` called again (module docstring)."""
        if self.reloaded:
            return
        self.reloaded = True
        spec = (data or {}).get("dataset")
        files = (data or {}).get("train_files")
        if files:  # verl's files: read again by the trainer's reader, no user code
            try:
                from trainer.verl_data import load_rows

                rows = load_rows([files] if isinstance(files, str) else list(files))[:RELOAD_MAX]
            except Exception:  # noqa: BLE001  (unreadable files fail the run itself)
                return
            key = (data or {}).get("prompt_key") or "prompt"
            self.dataset = [verl_plain(r, key) for r in rows]
            self.add(self.dataset)
            return
        if not allowed or not spec:
            return
        try:
            from trainer.plugins import resolve_callable

            examples = resolve_callable(spec, "data.dataset")()
        except Exception:  # noqa: BLE001  (the user's dataset fails the run itself, where it matters)
            return
        if isinstance(examples, (list, tuple)):
            rows = [ex for ex in list(examples)[:RELOAD_MAX] if isinstance(ex, Mapping)]
            self.dataset = rows
            self.add(rows)
            self.ordered = [
                (p, a) for ex in rows if (p := _text(ex, "prompt")) is not None and (a := _text(ex, "answer"))
            ]

    def findings(self, *, data: Mapping[str, Any], ctx: Mapping[str, Any]) -> list[Finding]:
        if self.version == self._read:
            return []  # nothing new since the last batch: the same answer
        self._read = self.version
        at = _data_source(data)
        conflicting = {p: a for p, a in self.answers.items() if len(a) >= 2}
        n = len(self.answers)
        if len(conflicting) >= CONFLICT_MIN and len(conflicting) >= CONFLICT_SHARE * n:
            p, ans = next(iter(conflicting.items()))
            shown = sorted(ans)[:3]
            form = all(_canon(x) == _canon(shown[0]) for x in ans)
            k = _offset(self.ordered, len(conflicting))
            if k:
                return [_offset_finding(k, len(conflicting), n, self.ordered, at=at, ctx=ctx)]
            how = (
                " that differ only in their form (case, spacing, a unit or punctuation)"
                if form
                else " that disagree"
            )
            return [
                Finding(
                    severity="error",
                    kind=K.CONFLICTING_ANSWERS,
                    where=at,
                    message=f"{len(conflicting)} of the {n} distinct prompts appear with two or more different "
                    f"ground truths{how} (prompt {_show(p)}: {', '.join(_show(x) for x in shown)}): duplicate "
                    "examples from merged sources or two labelling guidelines, so the same response is rewarded "
                    "for one target and penalised for the other, and no policy can earn the reward on them",
                    observed={
                        "conflicting_prompts": len(conflicting),
                        "distinct_prompts": n,
                        "example": [p, shown],
                        "differ_in_form_only": form,
                    },  # fmt: skip
                    expected="one ground truth per prompt",
                    fix=f"{at}: de-duplicate the prompts and keep one ground truth per prompt (drop the examples "
                    "labelled under the other guideline / source, or resolve the conflict)",
                    **ctx,
                )
            ]
        flipped = [(p, c, r) for p, s in self.prefs.items() for c, r in s if (r, c) in s and c < r]
        pn = len(self.prefs)
        if len(flipped) >= CONFLICT_MIN and len({p for p, _, _ in flipped}) >= CONFLICT_SHARE * pn:
            p, c, r = flipped[0]
            return [
                Finding(
                    severity="error",
                    kind=K.CONFLICTING_PREFERENCES,
                    where=at,
                    message=f"{len(flipped)} preference pairs appear both ways round for the same prompt (prompt "
                    f"{_show(p)}: {_show(c)} over {_show(r)} and {_show(r)} over {_show(c)}): contradicting duplicates "
                    "(merged rater batches, a sign flipped in one source), so DPO's gradients on them cancel",
                    observed={"contradicting_pairs": len(flipped), "prompts_with_pairs": pn},
                    expected="each pair preferred one way",
                    fix=f"{at}: de-duplicate the pairs and resolve the contradictions (keep one rater's / source's "
                    "preference per pair, or drop the conflicting ones)",
                    **ctx,
                )
            ]
        return []


def _canon(s: str) -> str:
    return "".join(c for c in _fold(s) if c.isalnum() and not c.isalpha()) or _fold(s).strip()


def verl_plain(ex: Mapping[str, Any], prompt_key: str = "messages") -> dict[str, str]:
    """A verl example (or file row) as ``prompt`` (its messages' contents) and ``answer`` (the ground truth)."""
    msgs = ex.get(prompt_key) if prompt_key in ex else ex.get("messages")
    msgs = msgs.tolist() if hasattr(msgs, "tolist") else msgs
    text = "\n".join(str(m.get("content", "")) for m in msgs or [] if isinstance(m, Mapping))
    rm = ex.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, Mapping) else None
    out = {"prompt": text}
    if isinstance(truth, str):
        out["answer"] = truth
    return out


OFFSETS = 3
"""Row offsets between the prompts and the answers the shift test tries (a header skipped, an index off by one)."""


def _conflicts(pairs: Sequence[tuple[str, str]]) -> int:
    seen: dict[str, set[str]] = {}
    for p, a in pairs:
        seen.setdefault(p, set()).add(a)
    return sum(len(a) >= 2 for a in seen.values())


def _offset(ordered: Sequence[tuple[str, str]], conflicts: int) -> int:
    """The row offset k (|k| <= `OFFSETS`) at which pairing prompt i with answer i - k leaves at most a fifth
    of the conflicts, or 0: the answers are the prompts' own, shifted by k rows."""
    if len(ordered) < 2 * OFFSETS or conflicts < CONFLICT_MIN:
        return 0
    prompts, answers = [p for p, _ in ordered], [a for _, a in ordered]
    best = (conflicts, 0)
    for k in [j for j in range(-OFFSETS, OFFSETS + 1) if j]:
        pairs = list(zip(prompts[max(k, 0) :], answers[max(-k, 0) :]))
        best = min(best, (_conflicts(pairs), k))
    return best[1] if best[0] <= 0.2 * conflicts else 0


def _offset_finding(k, conflicting, n, ordered, *, at, ctx) -> Finding:
    i = max(k, 0)
    (p, a), right = ordered[i], ordered[i - k][1]
    return Finding(
        severity="error",
        kind=K.CONFLICTING_ANSWERS,
        where=at,
        message=f"the answers are misaligned with their prompts, offset by {abs(k)} row{'s' if abs(k) > 1 else ''}: "
        f"{conflicting} of the {n} distinct prompts appear with different answers, and pairing prompt i with "
        f"answer {'i - ' + str(k) if k > 0 else 'i + ' + str(-k)} instead leaves (nearly) none (prompt {_show(p)} has "
        f"answer {_show(a)}, its own is {_show(right)}): every example is scored against another prompt's "
        "target, so the reward is wrong for every response",
        observed={"offset": k, "conflicting_prompts": conflicting, "distinct_prompts": n},
        expected="row i's answer is row i's prompt's",
        fix=f"{at}: align the answers with the prompts (an off-by-one shift of {abs(k)} row(s) between the two "
        "columns or files: a header line skipped twice, an index that starts at 1)",
        **ctx,
    )
