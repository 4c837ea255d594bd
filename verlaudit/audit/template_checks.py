"""The chat template a tokenizer load brought, against what generation needs (checked once at setup,
when the run's prompts go through the template: verl files):

- ``model/chat_template_generation_prompt``: the template marks whose turn a message is (a user and
  an assistant message render differently) but renders a conversation the same with and without
  ``add_generation_prompt``: it never opens the assistant's turn, so every prompt ends after the user's
  message and the policy continues the conversation as the user instead of answering (a template
  written for SFT data, where every conversation ends with the assistant's message).

Names the directory the tokenizer came from (given by `verlaudit.audit.tokenizer_checks.findings`). Exercised by
`pytest tests/test_template_checks.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verlaudit import kinds as K
from verlaudit.rundir import Finding

_PROBE = "What is 3 + 4?"
"""The message content of the probe conversation."""


def _render(tokenizer: Any, messages: list[dict], gen: bool, kwargs: Mapping[str, Any]) -> str | None:
    try:
        return str(
            tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **dict(kwargs))
        )
    except Exception:  # a template that raises fails the run itself, with its own message
        return None


def generation_prompt(config: Mapping[str, Any], tokenizer: Any, where: str) -> Finding | None:
    """``model/chat_template_generation_prompt`` (module docstring), or None; ``where``: the directory
    the tokenizer came from."""
    data = config.get("data") or {}
    template = getattr(tokenizer, "chat_template", None)
    kwargs = dict(data.get("apply_chat_template_kwargs") or {})
    if not data.get("train_files") or not isinstance(template, str) or not template:
        return None
    if "add_generation_prompt" in kwargs:
        return None  # the user sets it: a choice, not the template's
    user = [{"role": "user", "content": _PROBE}]
    with_gen, without = _render(tokenizer, user, True, kwargs), _render(tokenizer, user, False, kwargs)
    as_assistant = _render(tokenizer, [{"role": "assistant", "content": _PROBE}], False, kwargs)
    if with_gen is None or without is None or as_assistant is None or _PROBE not in with_gen:
        return None  # a template without the content is `tokenizer_checks.chat_template`'s
    marks_turns = as_assistant != without
    if with_gen != without or not marks_turns:
        return None  # it opens the assistant's turn, or it marks no turns at all (plain text)
    answered = _render(tokenizer, [*user, {"role": "assistant", "content": "7"}], False, kwargs) or ""
    header = answered[len(without) :].split("7", 1)[0] if answered.startswith(without) else ""
    reads = "add_generation_prompt" in template
    msg = (
        f"the chat template of {where} renders the same prompt with and without add_generation_prompt "
        f"({with_gen!r}): it never opens the assistant's turn"
        + (f" (an assistant message starts with {header!r})" if header.strip() else "")
        + (", it does not read add_generation_prompt at all" if not reads else "")
        + ": every prompt ends after the user's message, so the policy generates the next user turn (or "
        "continues the question) instead of an answer"
    )
    fix = (
        f"add the generation prompt to the chat_template of {where} (tokenizer_config.json): "
        "{% if add_generation_prompt %}"
        + (repr(header.strip()) if header.strip() else "<the assistant header>")
        + "{% endif %} at its end, the header an assistant turn starts with"
    )
    return Finding(
        severity="error",
        kind=K.CHAT_TEMPLATE_GENERATION,
        role="actor",
        where=where,
        message=msg,
        observed={"rendered": with_gen, "assistant_header": header, "reads_flag": reads},
        expected="add_generation_prompt=True appends the assistant's turn header",
        fix=fix,
    )
