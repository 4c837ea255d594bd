"""Prompts that start with a special token twice (verlaudit/audit/special_tokens.py): a collator that
prepends bos to what the tokenizer already starts with bos is named; one bos, as the tokenizer puts it,
stays quiet; and diagnose ranks it above the no-signal it explains."""

from __future__ import annotations

import torch

from tests.test_setup_cause import run_dir
from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit.invariants import batch_findings
from verlaudit.rundir import Finding

PROMPTS = ["12 34", "5 6 7", "8 9", "41 2"]


def batch(extra_bos: bool):
    tok = build_tokenizer()
    rows = [([tok.bos_token_id] if extra_bos else []) + tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, rows)) + 2
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    info = {"tokenizer": tok, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "vocab_size": len(tok), "padding_side": "left"}  # fmt: skip
    b = {"input_ids": ids, "attention_mask": (ids != tok.pad_token_id).long()}
    examples = [{"prompt": p, "answer": "1"} for p in PROMPTS]
    return batch_findings(b, role="actor", source="my_collators.py:with_bos", tokenizer_info=info,
                          examples=examples, step=0, phase="rollout")  # fmt: skip


def test_a_collator_that_prepends_bos_again_is_named():
    fs = [f for f in batch(True) if f.kind == K.SPECIAL_TOKEN_DOUBLED]
    assert len(fs) == 1 and fs[0].severity == "warning", fs
    assert "4 of 4" in fs[0].message and "twice" in fs[0].message and "already adds" in fs[0].message
    assert "add_special_tokens=False" in fs[0].fix and fs[0].where == "collator:my_collators.py:with_bos"


def test_one_bos_as_the_tokenizer_puts_it_stays_quiet():
    assert [f for f in batch(False) if f.kind == K.SPECIAL_TOKEN_DOUBLED] == []


def test_diagnose_puts_the_doubled_bos_above_the_no_signal_it_explains():
    doubled = [f for f in batch(True) if f.kind == K.SPECIAL_TOKEN_DOUBLED]
    no_signal = Finding(severity="warning", kind=K.NO_SIGNAL, message="rewards identical within every group",
                        role="reward", where="reward:function:task:digits", step=1, phase="reward")  # fmt: skip
    d = diagnose_run(run_dir(doubled + [no_signal], algo="grpo"))
    assert d.causes[0].kind == f"finding:{K.SPECIAL_TOKEN_DOUBLED}", [
        (c.kind, c.title[:60]) for c in d.causes
    ]
    assert d.causes[0].fixes and "add_special_tokens" in d.causes[0].fixes[0].why
