"""The run's tokenizer's special tokens against the text and the checkpoint, checked once at setup (called by
`verlaudit.audit.tokenizer_checks.findings`):

- ``model/special_token_content``: the pad / eos / bos token is a character of the text: the task's own
  prompts and answers (or verl files' first rows) encode to its id, or its literal is one printable
  character or whitespace ('0', ' ', '\\n', '!'). A mask built as ``ids != pad_token_id`` drops that
  character wherever the text has it, and decoding with ``skip_special_tokens`` deletes it from every
  response. An error when the text holds it, a warning when only its literal says so.
- ``data/bos_missing``: ``model.tokenizer`` starts its encodings with another number of bos tokens than
  the tokenizer saved with the checkpoint (``model.path``): a re-export that lost the post-processor's
  bos template, ``add_bos_token`` turned off (or on): every prompt reaches the model without the
  start-of-sequence it was trained after (or with one it never saw).

Exercised by `pytest tests/test_data_contract.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit.data_contract import _literal, _name_fix, content_hits, special_ids
from verlaudit.rundir import Finding

_PROBE = "Which number follows 41?"
"""A text whose encoding shows what the tokenizer puts around it."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Files of a saved tokenizer (as `verlaudit.audit.tokenizer_checks` reads them)."""


def _ids(tok: Any) -> dict[str, int | None]:
    ids = special_ids(tok, getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None))
    if ids["pad"] is not None and ids["pad"] in (ids["eos"], ids["bos"]):
        ids["pad"] = None  # pad is eos (or bos): that token's own check, not a character
    return ids


def content_findings(where: str, tok: Any, pairs: Sequence[tuple[str, str]] | None) -> list[Finding]:
    """``model/special_token_content`` for the run's tokenizer (module docstring)."""
    ids = _ids(tok)
    texts = [t for pair in (pairs or []) for t in pair if t]
    for name, token_id in ids.items():
        literal = _literal(tok, token_id)
        if literal is None or (len(literal) > 1 and any(literal in t for t in texts)):
            ids[name] = None  # '<eos>' written out in the text: the prompt_eos check's
    hits = content_hits(tok, texts, ids) if texts else {}
    out = []
    for name, token_id in ids.items():
        literal = _literal(tok, token_id)
        if literal is None:
            continue
        n = hits.get(name, 0)
        bare = literal.strip() == "" or (len(literal) == 1 and literal.isprintable())
        if not n and not bare:
            continue
        shown = (
            f"{n} of the {len(texts)} prompts and answers of the task encode to it"
            if n
            else "its text is one character"
        )
        out.append(
            Finding(
                severity="error" if n else "warning",
                kind=K.SPECIAL_TOKEN_CONTENT,
                role="actor",
                where=where,
                message=f"the {name} token of the tokenizer in {where} is {literal!r} (id {token_id}), a character "
                f"of ordinary text ({shown}): a mask built as ids != {token_id} drops that character wherever "
                "a prompt or response has it, and decoding with skip_special_tokens deletes it from every "
                "response, so an answer holding it decodes without it and never matches",
                observed={"token": name, "token_id": token_id, "literal": literal, "texts_holding_it": n},
                expected=f"a {name} token that is not a character of the text (a dedicated special token)",
                fix=f"{where}: {_name_fix(name)} (e.g. '<pad>': "
                "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the embeddings, or pad with eos and "
                "build masks from lengths) in tokenizer_config.json / special_tokens_map.json, not a character "
                "of the vocabulary",
            )
        )
        break
    return out


def _lead(tok: Any, token_id: int | None) -> int | None:
    try:
        ids = list(tok(_PROBE, add_special_tokens=True)["input_ids"])
    except Exception:  # a tokenizer of another call signature
        return None
    n = 0
    while n < len(ids) and token_id is not None and ids[n] == token_id:
        n += 1
    return n


def bos_findings(config: Mapping[str, Any], tok: Any) -> list[Finding]:
    """``data/bos_missing`` when model.tokenizer puts another number of bos tokens first than the
    checkpoint's own tokenizer (module docstring)."""
    model = config.get("model") or {}
    path, tok_dir = model.get("path"), model.get("tokenizer")
    if not path or not tok_dir or os.path.abspath(str(path)) == os.path.abspath(str(tok_dir)):
        return []
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return []
    try:
        from transformers import AutoTokenizer

        saved = AutoTokenizer.from_pretrained(path)
    except Exception:  # a checkpoint's tokenizer we cannot read: nothing to compare
        return []
    bos = getattr(saved, "bos_token_id", None)
    if bos is None:
        return []
    theirs, ours = _lead(saved, bos), _lead(tok, getattr(tok, "bos_token_id", None) or bos)
    if theirs is None or ours is None or theirs == ours:
        return []
    label = _literal(saved, bos) or f"id {bos}"
    where = f"model.tokenizer ({tok_dir})"
    how = (
        f"adds no {label!r} at the start of an encoding (its post-processor / add_bos_token does not put it "
        "there)"
        if ours < theirs
        else f"starts each encoding with {label!r} {ours} times"
    )
    return [
        Finding(
            severity="error",
            kind=K.BOS_MISSING,
            role="actor",
            where=where,
            message=f"the tokenizer saved with the checkpoint (model.path {path}) starts every encoding with "
            f"{theirs} bos token {label!r} (id {bos}), but model.tokenizer {how}: every prompt reaches the model "
            "without the start-of-sequence it was trained after, a format it has never seen",
            observed={"checkpoint_bos": theirs, "run_bos": ours, "bos_token_id": bos},
            expected=f"{theirs} bos at the start of each prompt, as the checkpoint's tokenizer encodes it",
            fix=f"{where}: restore the bos in the tokenizer's post_processor (TemplateProcessing single='<bos> $A' "
            "in tokenizer.json) or set add_bos_token=True / add_special_tokens=True; or unset model.tokenizer to use "
            f"the tokenizer saved in {path}",
        )
    ]
