"""What a length limit removed from the prompts and completions (`verlaudit.audit.truncation`): a builtin
collator at data.prompt_length, a user's collator under a tokenizer's model_max_length, verl rows cut in the
middle until they merge, and DPO pairs one side of which lost its eos, each beside a correct neighbour that
stays clean. Run: `pytest tests/test_truncation.py`."""

from __future__ import annotations

import random

import torch

from trainer.data import TRUNCATION_KEY, PairCollator, PromptCollator
from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.audit import invariants as I
from verlaudit.audit import truncation as T

TOK = build_tokenizer()
INFO = {
    "tokenizer": TOK,
    "pad_token_id": TOK.pad_token_id,
    "eos_token_id": TOK.eos_token_id,
    "vocab_size": 100,
}


def _digit_examples(n, lo, hi, seed=0):
    """Prompts 'd d d ... :' whose answer repeats the first digit four times (the digits task's shape)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ds = [rng.choice("123456789") for _ in range(rng.randint(lo, hi))]
        out.append({"prompt": " ".join(ds) + ":", "answer": ds[0] * 4})
    return out


def _findings(batch, examples, data, source="builtin:prompt"):
    return I.batch_findings(
        batch, role="actor", source=source, tokenizer_info=INFO, examples=examples, data=data
    )


def _of(found, kind):
    return [f for f in found if f.kind == kind]


def test_prompt_length_keeping_the_end_loses_bos_and_the_answers_digit():
    ex = _digit_examples(16, 8, 10)
    batch = PromptCollator(TOK, 12)(ex)
    found = _of(_findings(batch, ex, {"prompt_length": 12}), K.PROMPT_TRUNCATION)
    assert len(found) == 1 and found[0].severity == "error"
    f = found[0]
    assert f.where.startswith("data.prompt_length") and "prompt_length" in f.fix
    assert f.observed["lost_special"] == f.observed["cut"] == 16 and f.observed["answer_content_lost"] >= 1
    assert "bos" in f.message and "answer" in f.message


def test_prompts_that_fit_or_lose_only_filler_stay_below_a_warning():
    ex = _digit_examples(16, 3, 5)
    assert not _of(_findings(PromptCollator(TOK, 12)(ex), ex, {"prompt_length": 12}), K.PROMPT_TRUNCATION)
    # cut, but only a neutral lead-in the model need not read; bos kept by a collator that re-adds it
    ex = [{"prompt": "Q" * 6 + e["prompt"], "answer": e["answer"]} for e in _digit_examples(8, 3, 4, seed=2)]

    def keep_bos_collator(examples):
        rows = [
            [TOK.bos_token_id] + TOK(e["prompt"], add_special_tokens=False)["input_ids"][-10:]
            for e in examples
        ]
        ids = torch.tensor(rows)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    found = _of(
        _findings(keep_bos_collator(ex), ex, {"prompt_length": 16}, "c.keep_bos"), K.PROMPT_TRUNCATION
    )
    assert all(f.severity != "error" for f in found)


def test_a_tokenizers_model_max_length_named_as_the_limit():
    tok = build_tokenizer()
    tok.model_max_length, tok.truncation_side = 5, "right"
    tok.name_or_path = "/models/exported-tok"
    info = {**INFO, "tokenizer": tok}
    ex = _digit_examples(8, 4, 6, seed=3)

    def collator(examples):  # a user's collator: tokenises with truncation=True, pads to 16
        enc = tok([e["prompt"] for e in examples], truncation=True, padding="max_length", max_length=None)
        ids = torch.tensor(enc["input_ids"])
        return {"input_ids": ids, "attention_mask": torch.tensor(enc["attention_mask"])}

    batch = collator(ex)
    found = I.batch_findings(
        batch, role="actor", source="my.collate", tokenizer_info=info, examples=ex, data={"prompt_length": 16}
    )
    trunc = _of(found, K.PROMPT_TRUNCATION)
    assert len(trunc) == 1 and "model_max_length" in trunc[0].where and "model_max_length" in trunc[0].fix
    assert "tokenizer_config.json" in trunc[0].fix
    assert trunc[0].observed["side_kept"] == ["start"]
    assert not _of(found, K.PROMPT_REWRITTEN)  # the cut is the truncation check's, not a rewrite


def test_verl_rows_cut_in_the_middle_until_they_merge():
    header = "You are a careful assistant. "
    ex = [
        {"prompt": header + e["prompt"] + " answer", "answer": e["answer"]} for e in _digit_examples(8, 4, 6)
    ]
    rows = []
    for e in ex:  # verl's truncation 'middle': the first and the last 8 tokens of each prompt
        ids = TOK(e["prompt"])["input_ids"]
        rows.append(ids[:8] + ids[-8:])
    ids = torch.tensor(rows)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    data = {"train_files": "rows.parquet", "truncation": "middle", "prompt_length": 16}
    found = _of(_findings(batch, ex, data, "builtin:verl"), K.PROMPT_TRUNCATION)
    assert len(found) == 1 and found[0].severity == "error"
    assert found[0].observed["distinct_after"] == 1 < found[0].observed["distinct_before"]
    assert "data.truncation" in found[0].where and "truncation: left" in found[0].fix


def _pairs(chosen, rejected, response_length=6, prompt="3 4:"):
    ex = [{"prompt": prompt, "chosen": c, "rejected": r} for c, r in zip(chosen, rejected)]
    return ex, PairCollator(TOK, 8, response_length)(ex)


def test_dpo_rejected_side_cut_before_its_eos():
    ex, batch = _pairs(["3333"] * 6, ["4444 because it says so"] * 6)
    found = _of(_findings(batch, ex, {"response_length": 6, "dataset": "my.pairs"}), K.PAIR_EOS_CUT)
    assert len(found) == 1 and found[0].observed["rejected_without_eos"] == 6
    assert "data.response_length" in found[0].where and "response_length to 24" in found[0].fix


def test_dpo_chosen_side_cut_in_a_grpo_like_long_batch():
    ex, batch = _pairs(["3333 as the first digit is 3"] * 4 + ["3333"], ["44"] * 5, response_length=8)
    found = _of(_findings(batch, ex, {"response_length": 8}), K.PAIR_EOS_CUT)
    assert len(found) == 1 and found[0].observed["chosen_without_eos"] == 4


def test_dpo_pairs_both_ending_or_both_cut_stay_clean():
    for chosen, rejected in ((["3333"] * 6, ["44"] * 6), (["3333 because"] * 6, ["4444 because"] * 6)):
        ex, batch = _pairs(chosen, rejected)
        assert not _of(_findings(batch, ex, {"response_length": 6}), K.PAIR_EOS_CUT)


def test_cut_helper_sides():
    assert T._cut([3, 4], [1, 2, 3, 4]) == ("end", [1, 2])
    assert T._cut([1, 2], [1, 2, 3, 4]) == ("start", [3, 4])
    assert T._cut([1, 4], [1, 2, 3, 4]) == ("both ends", [2, 3])
    assert T._cut([1, 9], [1, 2, 3, 4]) is None and T._cut([1, 2, 3, 4], [1, 2, 3, 4]) is None
    assert TRUNCATION_KEY  # the builtin collators' report stays the fallback without examples
