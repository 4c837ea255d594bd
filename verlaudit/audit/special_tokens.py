"""A collated batch's prompts against the tokenizer's own special tokens (checked on every audited
batch): ``data/special_token_doubled``: most prompt rows start with the same special token (bos, a
turn marker) two or more times where the tokenizer's own encoding of the example's prompt starts with
it once (or not at all): the collator prepends a token the tokenizer already adds, so every prompt
begins ``<bos><bos>``, a format the model was never trained on. Exercised by `pytest
tests/test_special_tokens.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit.invariants_data import _encode, _prompt_part, _rows
from verlaudit.rundir import Finding

SHARE = 0.5
"""Rows with the doubled token past which it is the collator's doing, not one odd prompt."""


def _lead(row: Sequence[int], token: int) -> int:
    n = 0
    while n < len(row) and row[n] == token:
        n += 1
    return n


def doubled_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/special_token_doubled`` for one collated batch (module docstring), or nothing."""
    part = _prompt_part(batch)
    tok = tokenizer_info.get("tokenizer")
    if part is None:
        return []
    rows = [r for r in _rows(*part) if r]
    specials = set(getattr(tok, "all_special_ids", None) or [])
    specials |= {tokenizer_info.get(k) for k in ("bos_token_id", "eos_token_id")} - {None}
    specials.discard(tokenizer_info.get("pad_token_id"))  # padding is masked: never a row's real start
    if not rows or not specials:
        return []
    first = rows[0][0]
    if first not in specials:
        return []
    doubled = [r for r in rows if _lead(r, first) >= 2]
    if len(doubled) < SHARE * len(rows) or len(rows) < 2:
        return []
    prompts = [
        e.get("prompt") for e in examples if isinstance(e, Mapping) and isinstance(e.get("prompt"), str)
    ]
    own = [_encode(tok, p, True) for p in prompts[:8]] if tok is not None else []
    own_lead = max((_lead(e, first) for e in own if e), default=None)
    if own_lead is not None and own_lead >= 2:
        return []  # the tokenizer itself starts its encodings so: its format, not the collator's
    name = None
    try:
        name = tok.convert_ids_to_tokens(first) if tok is not None else None
    except Exception:
        name = None
    label = f"{name!r} (id {first})" if name else f"id {first}"
    adds = own_lead == 1
    msg = (
        f"{len(doubled)} of {len(rows)} prompt rows start with the special token {label} "
        f"{_lead(doubled[0], first)} times (doubled bos)"
        + (
            ": the tokenizer already adds it (tokenizer(prompt) starts with it once) and the collator prepends "
            "it again"
            if adds
            else ""
        )
        + ", so every prompt begins with it twice, a format the model was never trained on"
    )
    fix = (
        f"remove the {label} the collator prepends, or tokenize with add_special_tokens=False before adding it "
        "yourself: one bos at the start of each prompt"
    )
    return [
        Finding(
            severity="warning",
            kind=K.SPECIAL_TOKEN_DOUBLED,
            where=where,
            message=msg,
            observed={"rows": len(doubled), "of": len(rows), "token": first, "tokenizer_adds": own_lead},
            expected="each special token at the start of a prompt once, as the tokenizer encodes it",
            fix=fix,
            **ctx,
        )
    ]
