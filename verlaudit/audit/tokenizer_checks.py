"""The tokenizer against the model it feeds and the text it carries, checked once at setup:

- ``model/tokenizer_vocab``: ``model.tokenizer`` names a tokenizer that gives tokens other ids than the
  tokenizer saved with the checkpoint (``model.path``): every prompt reaches the model as ids it was not
  trained on, and its answers decode to other text.
- ``model/tokenizer_round_trip``: ``decode(encode(text))`` is not the text for the task's own prompts and
  answers (a missing or wrong decoder joins characters with spaces, drops bytes): the reward reads other
  text than the model produced.
- ``model/chat_template_content``: the chat template renders a message without its content (it reads a
  field verl's messages do not carry): every prompt is the template's frame alone.

Each names the directory the tokenizer came from. `texts` (the builtin task's own prompts and answers)
is shared with `verlaudit.audit.model_checks`. Exercised by `pytest tests/test_model_checks.py`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.rundir import Finding

SAMPLES = 16
"""Examples of the builtin task the checks read."""
ROUND_TRIP_SHARE = 0.5
"""A round trip that fails on at least this share of the texts is the tokenizer's, not one odd string."""
_PROBE = "Which number follows 41?"
"""The message content a chat template must render."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def texts(config: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """(prompt, answer) of the builtin task's examples; None for verl files (no task the audit knows)."""
    from verlaudit.audit.invariants_data import builtin_task

    task = builtin_task(config.get("data") or {})
    if task is None:
        return None
    return [(ex["prompt"], ex["answer"]) for ex in task.make_examples(SAMPLES, seed=0)]


def verl_texts(config: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """(the messages' content, the ground truth) of the first rows of verl files, for the round trip
    only (a ground truth is not text a checkpoint must predict); None when they cannot be read."""
    data = config.get("data") or {}
    files = data.get("train_files")
    if not files:
        return None
    try:
        from trainer.verl_data import load_rows

        rows = load_rows([files] if isinstance(files, str) else list(files))[:SAMPLES]
        key = data.get("prompt_key") or "prompt"
        out = []
        for row in rows:
            msgs = row.get(key)
            msgs = msgs.tolist() if hasattr(msgs, "tolist") else msgs
            text = "\n".join(str(m.get("content", "")) for m in msgs or [] if isinstance(m, Mapping))
            truth = (
                (row.get("reward_model") or {}).get("ground_truth")
                if isinstance(row.get("reward_model"), Mapping)
                else None
            )
            out.append((text, truth if isinstance(truth, str) else ""))
        return [(t, a) for t, a in out if t] or None
    except Exception:  # the trainer reports unreadable files itself
        return None


def source(config: Mapping[str, Any]) -> str:
    """Where the run's tokenizer came from, as the suite key and directory (`trainer.models.load_tokenizer`'s
    order: model.tokenizer, else model.path when it holds one, else the project's)."""
    model = config.get("model") or {}
    if model.get("tokenizer"):
        return f"model.tokenizer ({model['tokenizer']})"
    path = model.get("path")
    if path and _has_tokenizer(path):
        return f"model.path ({path})"
    return "the project's tokenizer (trainer.tokenizer)"


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def _finding(kind: str, severity: str, where: str, message: str, fix: str, observed: Any) -> Finding:
    return Finding(
        severity=severity, kind=kind, role="actor", where=where, message=message, observed=observed,
        expected="the tokenizer the model was trained with, decoding what it encodes", fix=fix,
    )  # fmt: skip


def vocab_mismatch(config: Mapping[str, Any], tokenizer: Any) -> Finding | None:
    """``model/tokenizer_vocab`` when ``model.tokenizer`` and the tokenizer saved in ``model.path`` give
    the tokens they share other ids."""
    model = config.get("model") or {}
    path, tok_dir = model.get("path"), model.get("tokenizer")
    if (
        not path
        or not tok_dir
        or os.path.abspath(path) == os.path.abspath(tok_dir)
        or not _has_tokenizer(path)
    ):
        return None
    try:
        from transformers import AutoTokenizer

        saved = AutoTokenizer.from_pretrained(path)
        ours, theirs = tokenizer.get_vocab(), saved.get_vocab()
    except Exception:  # a checkpoint's tokenizer we cannot read: nothing to compare
        return None
    shared = sorted(set(ours) & set(theirs))
    differ = [t for t in shared if ours[t] != theirs[t]]
    if not shared or not differ:
        return None
    shown = ", ".join(f"{t!r}: {theirs[t]} -> {ours[t]}" for t in differ[:4])
    msg = (
        f"model.tokenizer ({tok_dir}) numbers {len(differ)} of the {len(shared)} tokens it shares with the "
        f"tokenizer saved with the model in model.path ({path}) otherwise ({shown}; sizes {len(ours)} and "
        f"{len(theirs)}): the vocab ids differ, so every prompt reaches the model as other ids than it was "
        "trained on and its answers decode to other text"
    )
    fix = (
        f"use the tokenizer the model was trained with: unset model.tokenizer (model.path {path} holds it) or "
        "point model.tokenizer at the same tokenizer directory"
    )
    obs = {
        "differ": len(differ),
        "shared": len(shared),
        "examples": [[t, theirs[t], ours[t]] for t in differ[:6]],
    }
    return _finding(K.TOKENIZER_VOCAB, "error", f"model.tokenizer ({tok_dir})", msg, fix, obs)


def round_trip(
    config: Mapping[str, Any], tokenizer: Any, pairs: Sequence[tuple[str, str]] | None
) -> Finding | None:
    """``model/tokenizer_round_trip`` when decode(encode(text)) is not the text (ends stripped) for at
    least `ROUND_TRIP_SHARE` of the task's prompts and answers."""
    if not pairs:
        return None
    bad: list[tuple[str, str]] = []
    checked = 0
    for text in [t for pair in pairs for t in pair if t]:
        try:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            back = tokenizer.decode(ids, skip_special_tokens=True)
        except Exception:
            return None
        checked += 1
        if back.strip() != text.strip():
            bad.append((text, back))
    if not checked or len(bad) < ROUND_TRIP_SHARE * checked:
        return None
    where = source(config)
    spaced = all(b.replace(" ", "") == t.replace(" ", "") for t, b in bad)
    how = (
        "decoding joins the tokens with spaces (no decoder that fuses them)"
        if spaced
        else "the decoded text differs from the encoded one"
    )
    shown = "; ".join(f"{t!r} -> {b!r}" for t, b in bad[:3])
    msg = (
        f"the tokenizer of {where} does not decode the text it encodes: {len(bad)} of {checked} of the task's "
        f"prompts and answers come back changed ({shown}): {how}, so the responses reach the reward as other "
        "text than the model produced"
    )
    fix = (
        f"fix the decoder of the tokenizer in {where} so that decode(encode(text)) == text: in tokenizer.json "
        "a character / WordLevel tokenizer needs decoders.Fuse, a byte-level BPE decoders.ByteLevel, a "
        "SentencePiece one its Metaspace decoder"
    )
    return _finding(K.TOKENIZER_DECODE, "error", where, msg, fix, {"changed": len(bad), "checked": checked,
                                                                   "examples": [list(x) for x in bad[:4]]})  # fmt: skip


_FIELD = re.compile(r"""(?:message|m|msg)\s*(?:\[\s*['"](\w+)['"]\s*\]|\.(\w+))""")


def chat_template(config: Mapping[str, Any], tokenizer: Any) -> Finding | None:
    """``model/chat_template_content`` when the run's prompts go through the tokenizer's chat template
    (verl files) and it renders a user message without its content."""
    data = config.get("data") or {}
    template = getattr(tokenizer, "chat_template", None)
    if not data.get("train_files") or not isinstance(template, str) or not template:
        return None
    from trainer.verl_data import render_prompt

    kwargs = data.get("apply_chat_template_kwargs") or {}
    try:
        text, _ = render_prompt(tokenizer, [{"role": "user", "content": _PROBE}], kwargs)
    except Exception:  # a template that raises fails the run itself, with its own message
        return None
    if _PROBE in text:
        return None
    fields = sorted({a or b for a, b in _FIELD.findall(template)} - {"role", "content"})
    reads = f" (it reads {', '.join(repr(f) for f in fields)})" if fields else ""
    where = source(config)
    msg = (
        f"the chat template of {where} renders a message without its content{reads}: "
        f"[{{'role': 'user', 'content': {_PROBE!r}}}] becomes {text!r}, so every prompt is the template's "
        "frame with the question missing (the prompts are identical)"
    )
    fix = (
        f"make the chat_template of {where} (tokenizer_config.json) render message['content']"
        + (f" instead of {', '.join(repr(f) for f in fields)}" if fields else "")
        + ": verl's messages carry 'role' and 'content'"
    )
    return _finding(K.CHAT_TEMPLATE_CONTENT, "error", where, msg, fix, {"rendered": text, "fields": fields})


def findings(
    config: Mapping[str, Any], tokenizer: Any, pairs: Sequence[tuple[str, str]] | None
) -> list[Finding]:
    """The tokenizer's findings at setup (`vocab_mismatch`, `round_trip`, `chat_template`)."""
    from verlaudit.audit.template_checks import generation_prompt

    if tokenizer is None:
        return []
    pairs = pairs if pairs else verl_texts(config)
    found = [
        vocab_mismatch(config, tokenizer),
        round_trip(config, tokenizer, pairs),
        chat_template(config, tokenizer),
        generation_prompt(config, tokenizer, source(config)),  # setupg
    ]
    from verlaudit.audit import (
        special_content,  # data12: special tokens that are text, a bos the checkpoint expects
    )

    found += special_content.content_findings(source(config), tokenizer, pairs)
    found += special_content.bos_findings(config, tokenizer)
    return [f for f in found if f is not None]
