"""The examples' invariants (verlaudit/audit/invariants_examples.py) and the reward's intervention probes
(verlaudit/audit/probes_reward.py): empty prompts, one example in every row, completions that repeat the
prompt, answers leaked into the prompt, a response length below the answers, answers rounded to a
low-precision grid, a reward model that normalises over the batch, rewards sorted by row, a uint8 mask
inverted with ~. Each planted variant is found with its culprit; its clean control is not. The variants
are not the blind benches' items (other texts, sizes, dtypes and tasks)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from trainer.data import TASKS
from verlaudit import kinds as K
from verlaudit.audit import invariants as I
from verlaudit.audit import invariants_examples as E
from verlaudit.audit import probes_reward as P

PAD, EOS = 0, 2


class CharTok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [10 + ord(c) - 32 for c in text]}


def info(tok=None):
    return {
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "vocab_size": 200,
        "padding_side": "left",
        "tokenizer": tok,
    }


def left(rows, length):
    ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        r = r[-length:]
        ids[i, length - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, length - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def run(batch, examples, data=None, tok=None):
    w = E.ExampleWatch()
    data = {"task": "sort", "response_length": 8, **(data or {})}
    return w.findings(
        batch, examples=examples, tokenizer_info=info(tok), data=data, source="my.py:coll", ctx={}
    )


def kinds(fs):
    return [f.kind for f in fs]


def sort_examples(n=8, seed=3):
    return TASKS["sort"].make_examples(n, seed)


def prompt_batch(examples, text=lambda ex: ex["prompt"], length=24):
    tok = CharTok()
    return left([tok(text(ex))["input_ids"] for ex in examples], length)


def test_clean_examples_of_every_task_are_quiet():
    tok = CharTok()
    for name, task in TASKS.items():
        ex = task.make_examples(16, 5)
        assert run(prompt_batch(ex), ex, data={"task": name}, tok=tok) == [], name
        pairs = task.make_pairs(ex, 5)
        assert run({}, pairs, data={"task": name}, tok=tok) == [], name


def test_blank_prompts_name_the_dataset():
    ex = sort_examples()
    for i in (1, 5):
        ex[i] = {**ex[i], "prompt": "  "}
    fs = run(prompt_batch(ex), ex, data={"dataset": "mine.py:load"}, tok=CharTok())
    assert kinds(fs) == [K.EMPTY_PROMPTS]
    assert "mine.py:load" in fs[0].where and fs[0].observed["empty_prompts"] == 2


def test_one_dict_aliased_in_every_row_and_copied_rows_are_duplicates():
    row = {"prompt": "7 1|", "answer": "17"}
    aliased = [row] * 8
    fs = run({}, aliased, data={"dataset": "mine.py:rows"})
    assert kinds(fs) == [K.DUPLICATE_ROWS] and "[{} for _ in range(n)]" in fs[0].fix
    copies = [dict(row) for _ in range(6)] + [{"prompt": "3 2|", "answer": "23"}] * 2
    fs = run({}, copies)
    assert kinds(fs) == [K.DUPLICATE_ROWS] and fs[0].observed["distinct_examples"] == 2
    # a few repeats (a batch spanning two epochs of a small dataset) are not a finding
    ex = sort_examples(6)
    assert run({}, ex + ex[:2]) == []


def test_completions_that_start_with_the_prompt_are_found():
    ex = sort_examples()
    pairs = [{**e, "chosen": e["prompt"] + " " + e["answer"], "rejected": e["prompt"] + " " + e["answer"][::-1]}
             for e in ex]  # fmt: skip
    fs = run({}, pairs, data={"dataset": "chat.py:export"})
    assert K.COMPLETION_REPEATS_PROMPT in kinds(fs)
    f = next(f for f in fs if f.kind == K.COMPLETION_REPEATS_PROMPT)
    assert "chat.py:export" in f.where and "strip" in f.fix
    plain = TASKS["sort"].make_pairs(ex, 1)
    assert K.COMPLETION_REPEATS_PROMPT not in kinds(run({}, plain))


def test_answers_written_into_the_prompt_rows_name_the_collator():
    ex = sort_examples()
    batch = prompt_batch(ex, text=lambda e: e["prompt"] + " " + e["answer"])
    fs = run(batch, ex, tok=CharTok())
    assert kinds(fs) == [K.PROMPT_HAS_ANSWER]
    assert fs[0].where == "collator:my.py:coll" and "my.py:coll" in fs[0].fix


def test_answers_inside_the_prompt_texts_name_the_dataset_unless_the_task_copies():
    ex = [{**e, "prompt": f"{e['prompt']} (answer {e['answer']})"} for e in sort_examples()]
    fs = run(prompt_batch(ex, length=40), ex, data={"dataset": "leaky.py:rows"}, tok=CharTok())
    assert kinds(fs) == [K.PROMPT_HAS_ANSWER] and "leaky.py:rows" in fs[0].where
    copy = TASKS["copy"].make_examples(8, 2)  # the copy task's prompts hold their answer by design
    assert run(prompt_batch(copy), copy, data={"task": "copy"}, tok=CharTok()) == []


def test_a_response_length_below_the_answers_names_the_key_and_a_value_that_fits():
    ex = [{"prompt": f"{i} {i + 1}|", "answer": str(10000 + i)} for i in range(8)]  # 5 chars + eos = 6
    fs = run({}, ex, data={"response_length": 4}, tok=CharTok())
    assert kinds(fs) == [K.RESPONSE_SHORTER_THAN_ANSWER]
    assert "data.response_length" in fs[0].where and "at least 6" in fs[0].fix
    assert run({}, ex, data={"response_length": 6}, tok=CharTok()) == []


def _grid_examples(dtype, n=24, seed=0):
    rng = random.Random(seed)
    values = [rng.randrange(3000, 60000) for _ in range(n)]
    col = np.array(values, dtype=dtype)
    return [{"prompt": f"{v}?", "answer": str(int(a))} for v, a in zip(values, col)]


def test_integer_answers_rounded_through_fp16_or_bf16_are_found_pooled_over_batches():
    for dtype, name in ((np.float16, "fp16"), (np.float32, None)):
        w = E.ExampleWatch()
        ex = _grid_examples(dtype)
        fs = []
        for i in range(0, len(ex), 4):
            fs += w.findings({}, examples=ex[i : i + 4], tokenizer_info=info(), data={"dataset": "t.py:f"},
                             source="c", ctx={})  # fmt: skip
        got = [f for f in fs if f.kind == K.ANSWERS_LOW_PRECISION]
        if name is None:
            assert got == []
        else:
            assert len(got) == 1 and got[0].observed["grid"] in ("fp16", "bf16") and "t.py:f" in got[0].where
    bf = torch.tensor([float(v) for v in range(300, 4000, 37)]).to(torch.bfloat16).tolist()
    ex = [{"prompt": "x", "answer": str(int(v))} for v in bf]
    fs = run({}, ex[:4]) + E.ExampleWatch().findings(
        {}, examples=ex, tokenizer_info=info(), data={}, source="c", ctx={}
    )
    assert [f.observed["grid"] for f in fs if f.kind == K.ANSWERS_LOW_PRECISION] == ["bf16"]


class Classifier(nn.Module):
    def __init__(self, over_batch: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 2)
        self.over_batch = over_batch

    def forward(self, ids, mask):
        m = mask.float().unsqueeze(-1)
        logits = self.head((self.embed(ids) * m).sum(1) / m.sum(1).clamp_min(1.0))
        return logits.softmax(dim=0 if self.over_batch else -1)[:, 1]


def test_a_reward_model_normalised_over_the_batch_changes_when_its_neighbours_change():
    ids = torch.randint(3, 64, (8, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for over, expect in ((True, [K.REWARD_BATCH_DEPENDENT]), (False, [])):
        rm = Classifier(over)
        with torch.no_grad():
            scores = rm(ids, mask)
        fs = P.batch_findings(scores, input_ids=ids, attention_mask=mask,
                              rescore=lambda i, m, rm=rm: rm(i, m).detach(), source="model:rm.py:load", ctx={})  # fmt: skip
        assert kinds(fs) == expect
        if expect:
            assert "rm.py:load" in fs[0].where and "dim=-1" in fs[0].fix and "sum to 1" in fs[0].message


def test_rewards_sorted_by_row_at_consecutive_steps_follow_the_row():
    rng = random.Random(0)
    w, fs = P.RowOrder(), []
    for step in range(4):
        r = torch.tensor(sorted(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(16)))
        fs += w.observe(r, where="data.reward_fn (r.py:win)", ctx={"step": step})
    assert (
        kinds(fs) == [K.REWARD_FOLLOWS_ROW] and "sort" in fs[0].fix and fs[0].fix.startswith("data.reward_fn")
    )
    w, fs = P.RowOrder(), []
    for step in range(3):  # sparse: two values a step, the task's scores of the responses in another order
        r = torch.tensor([0.0] * 5 + [0.0625] * 3)
        fs += w.observe(r, where="data.reward_fn (r.py:win)", ctx={"step": step}, truth=r.flip(0))
    assert kinds(fs) == [K.REWARD_FOLLOWS_ROW] and "task's own scores" in fs[0].message
    w, fs = P.RowOrder(), []
    for step in range(40):  # sorted because the responses' own scores are (a reward that follows them)
        r = torch.tensor([0.0] * 5 + [0.0625] * 3)
        fs += w.observe(r, where="data.reward_fn (r.py:ok)", ctx={"step": step}, truth=r * 2)
    assert fs == []
    w, fs = P.RowOrder(), []
    for step in range(20):  # the same scores in the responses' order
        r = torch.tensor([rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(16)])
        fs += w.observe(r, where="data.reward_fn (r.py:ok)", ctx={"step": step})
    assert fs == []


def test_a_uint8_mask_inverted_with_tilde_says_bitwise_and_how_to_build_the_mask():
    b = left([[20, 21, 22], [23, 24]], 5)
    is_pad = (b["input_ids"] == PAD).to(torch.uint8)
    fs = I.mask_findings({"input_ids": b["input_ids"], "attention_mask": ~is_pad}, tokenizer_info=info(),
                         where="collator:c", ctx={})  # fmt: skip
    assert (
        kinds(fs) == [K.MASK_COVERS_PADDING] and "bitwise" in fs[0].message and "!= pad_token_id" in fs[0].fix
    )
    fs = I.mask_findings({"input_ids": b["input_ids"], "attention_mask": torch.ones_like(is_pad)},
                         tokenizer_info=info(), where="collator:c", ctx={})  # fmt: skip
    assert kinds(fs) == [K.MASK_COVERS_PADDING] and "bitwise" not in fs[0].message


def test_rewards_normalised_over_the_batch_carry_a_signature_step_after_step():
    g = torch.Generator().manual_seed(4)
    for make, sig in (
        (lambda x: x.softmax(0), "softmax"),
        (lambda x: (x - x.mean()) / x.std(), "zscore"),
        (lambda x: x.argsort().argsort().double() / (x.numel() - 1), "rank"),
    ):
        w, fs = P.BatchNormalised(), []
        for step in range(2):
            fs += w.observe(make(torch.randn(12, generator=g, dtype=torch.float64)), where="data.reward_fn (n.py:f)",
                            ctx={"step": step})  # fmt: skip
        assert kinds(fs) == [K.REWARD_BATCH_DEPENDENT] and fs[0].observed["signature"] == sig, sig
    w, fs = P.BatchNormalised(), []
    rng = random.Random(2)
    for step in range(30):  # partial credit, sparse binary with one success, raw scores
        fs += w.observe(torch.tensor([rng.choice([0.0, 0.0625, 0.25, 0.5, 1.0]) for _ in range(16)]), where="r",
                        ctx={"step": step})  # fmt: skip
        one = torch.zeros(8)
        one[rng.randrange(8)] = 1.0
        fs += w.observe(one, where="r", ctx={"step": step})
        fs += w.observe(torch.randn(8, generator=g), where="r", ctx={"step": step})
    assert fs == []


def test_prompt_rows_the_collator_left_without_their_text_name_the_collator():
    ex = sort_examples()
    batch = prompt_batch(ex)
    batch["input_ids"][2:4] = PAD  # two rows hold only padding (and are attended: the collator's mask)
    fs = run(batch, ex, tok=CharTok())
    assert kinds(fs) == [K.EMPTY_PROMPTS] and fs[0].where == "collator:my.py:coll"
    assert fs[0].observed["empty_rows"] == 2


def test_a_preference_prompt_that_holds_its_chosen_completion_is_a_leak():
    ex = TASKS["sort"].make_pairs(sort_examples(), 1)
    leaky = [{**e, "prompt": f"{e['prompt']} ({e['chosen']})"} for e in ex]
    fs = run({}, leaky, data={"dataset": "pairs.py:leaky"})
    assert kinds(fs) == [K.PROMPT_HAS_ANSWER] and "pairs.py:leaky" in fs[0].where
    copy = TASKS["copy"].make_pairs(TASKS["copy"].make_examples(8, 1), 1)  # the copy task's prompts hold it
    assert run({}, copy, data={"task": "copy"}) == []
