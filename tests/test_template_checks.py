"""The chat template against generation (verlaudit/audit/template_checks.py): a template that marks
turns but never opens the assistant's for add_generation_prompt is named with the header to add; a
template that opens it, a plain-text one and a run without chat prompts stay quiet."""

from __future__ import annotations

import pytest

from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.audit import tokenizer_checks

VERL = {"data": {"train_files": "x.parquet"}}
TURNS = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"


def tok(template):
    t = build_tokenizer()
    t.chat_template = template
    return t


def test_a_template_without_the_generation_prompt_is_named_with_the_header_to_add():
    fs = [
        f for f in tokenizer_checks.findings(VERL, tok(TURNS), None) if f.kind == K.CHAT_TEMPLATE_GENERATION
    ]
    assert len(fs) == 1 and fs[0].severity == "error", fs
    assert "add_generation_prompt" in fs[0].message and "'<|assistant|>'" in fs[0].message
    assert "add_generation_prompt" in fs[0].fix and "<|assistant|>" in fs[0].fix


@pytest.mark.parametrize(
    "template, config",
    [
        (TURNS + "{% if add_generation_prompt %}<|assistant|>{% endif %}", VERL),  # opens the turn
        ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", VERL),  # plain text: no turns
        (TURNS, {"data": {"task": "digits"}}),  # no chat prompts in this run
        (
            TURNS,
            {
                "data": {
                    "train_files": "x.parquet",
                    "apply_chat_template_kwargs": {"add_generation_prompt": False},
                }
            },
        ),
    ],
)
def test_templates_that_open_the_turn_or_runs_that_do_not_use_one_stay_quiet(template, config):
    fs = [
        f
        for f in tokenizer_checks.findings(config, tok(template), None)
        if f.kind == K.CHAT_TEMPLATE_GENERATION
    ]
    assert fs == []
