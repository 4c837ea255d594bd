"""What a dataset says (verlaudit/audit/data_information.py): the data reaches the trainer intact but carries
less information than it looks. Each invariant with members of its family written here (no bench item): targets
that are one value (a per-example reseed, a label column, verl ground truths, DPO pairs), fewer prompts than a
batch (the builtin task's num_examples, a user dataset, pooled batches), pairs that differ only in format (a
space, the case, full-width forms, a collator that appends a space), pairs whose sides follow different prompts
(rotations both ways, a separate shuffle), and prompts in a form the policy does not know, measured on a hand-made
policy (a trailing space, a newline, a leading space, doubled spaces; a pair's chosen side as the target). Each
with a correct neighbour that stays quiet. The models here are hand-made tables of logits (margins of 10 nats
against thresholds of 2), so no result depends on the host's float kernels."""

from __future__ import annotations

import json
import random
import string

import pytest
import torch
from torch import nn

from trainer.data import TASKS, PairCollator, PromptCollator
from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.rules import explains
from verlaudit.audit import data_information as D
from verlaudit.audit.invariants_examples import ExampleWatch

CTX = {"role": "actor"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def info(tok):
    return {"tokenizer": tok, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok), "padding_side": "left"}  # fmt: skip


def digits(n, seed=0, label=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = [rng.choice(string.digits) for _ in range(rng.randint(3, 4))]
        if label is not None:
            d[0] = label(rng)
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out


def kinds(found):
    return {f.kind for f in found}


def watch_run(examples, data, batches=3, b=4, tok=None, batch_fn=None, reload=True):
    """Feed ``batches`` batches of ``b`` examples (cycling) through one ExampleWatch."""
    w = ExampleWatch(reload=reload)
    out = []
    for k in range(batches):
        rows = [examples[(k * b + i) % len(examples)] for i in range(b)]
        batch = batch_fn(rows) if batch_fn else {}
        out += w.findings(batch, examples=rows, tokenizer_info=info(tok) if tok else {}, data=data,
                          source="builtin:prompt", ctx=CTX)  # fmt: skip
    return out


def write_dataset(tmp_path, name, examples):
    path = tmp_path / f"{name}.py"
    path.write_text(
        f"import json\nROWS = json.loads({json.dumps(json.dumps(examples))})\n\ndef rows():\n    return ROWS\n"
    )
    return f"{path}:rows"


# ---------------------------------------------------------------- 1. information in the targets


def test_a_per_example_reseed_gives_one_answer_and_is_named_on_the_dataset(tmp_path):
    # GRPO-style examples: each example's first digit from random.Random(5) made anew (the same digit each time)
    ex = digits(64, label=lambda rng: random.Random(5).choice(string.digits))
    spec = write_dataset(tmp_path, "reseeded", ex)
    found = [f for f in watch_run(ex, {"dataset": spec}) if f.kind == K.CONSTANT_TARGETS]
    assert found and found[0].severity == "error"
    f = found[0]
    assert "reseeded" in f.where and f.observed["whole"] and f.observed["distinct_prompts"] > 8
    assert "same value" in f.message and "seed + i" in f.fix


def test_a_constant_label_column_and_constant_pairs_are_named():
    labels = [{"prompt": f"review {i}: {'good' if i % 2 else 'bad'}", "label": 1} for i in range(40)]
    assert K.CONSTANT_TARGETS in kinds(watch_run(labels, {"dataset": "x.py:rows"}, reload=False, b=8))
    pairs = [{"prompt": f"{i} {i + 1}:", "chosen": "yes", "rejected": "no"} for i in range(40)]
    assert K.CONSTANT_TARGETS in kinds(watch_run(pairs, {"dataset": "x.py:pairs"}, reload=False, b=8))


def test_verl_rows_with_one_ground_truth_are_named_on_the_files(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"what is {i} + {i}?"}], "data_source": "x",
             "reward_model": {"style": "rule", "ground_truth": "42"}} for i in range(32)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = {"train_files": str(path), "prompt_key": "prompt"}
    batch_ex = [{**r, "prompt": "rendered", "messages": r["prompt"]} for r in rows[:4]]
    w = ExampleWatch()
    found = w.findings({}, examples=batch_ex, tokenizer_info={}, data=data, source="builtin:verl", ctx=CTX)
    assert K.CONSTANT_TARGETS in kinds(found)
    assert next(f for f in found if f.kind == K.CONSTANT_TARGETS).where.startswith("data.train_files")


def test_varied_few_valued_and_refusal_targets_stay_quiet():
    assert not kinds(watch_run(digits(64), {"dataset": "x.py:rows"}, reload=False, b=8)) & {
        K.CONSTANT_TARGETS
    }
    mcq = [{"prompt": f"question {i}? A B C D", "answer": "ABCD"[i % 4]} for i in range(64)]
    binary = [{"prompt": f"review {i}", "label": i % 2} for i in range(64)]
    refusals = [{"prompt": f"how to {i}?", "chosen": "I can't help with that.", "rejected": f"step {i}"}
                for i in range(64)]  # fmt: skip
    for ex in (mcq, binary, refusals):
        assert K.CONSTANT_TARGETS not in kinds(watch_run(ex, {"dataset": "x.py:rows"}, reload=False, b=8))
    few = [{"prompt": f"{i}:", "answer": "7"} for i in range(5)]  # five prompts: too few to call it
    assert K.CONSTANT_TARGETS not in kinds(watch_run(few, {"dataset": "x.py:rows"}, reload=False, b=4))


@pytest.mark.parametrize("num,b", [(2, 4), (3, 8), (1, 2)])
def test_a_builtin_task_smaller_than_a_batch_names_num_examples(num, b):
    ex = TASKS["digits"].make_examples(num, 0)
    found = [f for f in watch_run(ex, {"task": "digits", "num_examples": num}, batches=1, b=b)
             if f.kind == K.FEW_PROMPTS]  # fmt: skip
    assert found and found[0].where.startswith("data.num_examples") and "num_examples" in found[0].fix


def test_a_user_dataset_of_three_and_pooled_pairs_are_named(tmp_path):
    ex = digits(3, seed=3)
    spec = write_dataset(tmp_path, "smoke", ex)
    found = [f for f in watch_run(ex, {"dataset": spec}, batches=1, b=4) if f.kind == K.FEW_PROMPTS]
    assert found and "smoke" in found[0].where and found[0].observed["whole"]
    pairs = [{"prompt": f"{i}:", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(2)]
    pooled = watch_run(pairs, {"dataset": "x.py:pairs"}, batches=1, b=8, reload=False)
    assert K.FEW_PROMPTS not in kinds(pooled)  # one batch of pooled rows says nothing yet
    pooled = watch_run(pairs, {"dataset": "x.py:pairs"}, batches=2, b=8, reload=False)
    assert K.FEW_PROMPTS in kinds(pooled)


def test_a_dataset_of_a_batch_or_more_stays_quiet(tmp_path):
    ex = TASKS["digits"].make_examples(2048, 0)
    assert K.FEW_PROMPTS not in kinds(watch_run(ex, {"task": "digits", "num_examples": 2048}, batches=3, b=8))
    ex = digits(4, seed=1)
    spec = write_dataset(tmp_path, "four", ex)
    assert K.FEW_PROMPTS not in kinds(watch_run(ex, {"dataset": spec}, batches=3, b=4))


# ---------------------------------------------------------------- 2. pairs


def pair_batch(tok, examples, rejected_prompts=None, rejected_texts=None):
    coll = PairCollator(tok, 16, 8)
    batch = coll(examples)
    if rejected_prompts is not None or rejected_texts is not None:
        other = [
            {**ex, "prompt": p, "chosen": r}
            for ex, p, r in zip(
                examples,
                rejected_prompts or [e["prompt"] for e in examples],
                rejected_texts or [e["rejected"] for e in examples],
            )
        ]
        side = coll(other)
        for k in ("input_ids", "attention_mask", "response_mask"):
            batch[f"rejected_{k}"] = side[f"chosen_{k}"]
    return batch


def pairs(n=8, seed=0, rejected=lambda c: c[::-1]):
    ex = digits(n, seed=seed)
    return [
        {"prompt": e["prompt"], "chosen": e["answer"], "rejected": rejected(e["answer"] + "12")[:4]}
        for e in ex
    ]


def form(tok, examples, batch=None, source="builtin:pairs"):
    return D.pair_form_findings(batch or pair_batch(tok, examples), examples, tokenizer_info=info(tok),
                                data={"dataset": "mine.py:pairs"}, source=source, ctx=CTX)  # fmt: skip


@pytest.mark.parametrize(
    "noise,how",
    [
        (lambda c: c + " ", "leading / trailing whitespace"),
        (lambda c: c.upper().replace("4", "A") if False else " " + c, "leading / trailing whitespace"),
        (lambda c: c + ".", "punctuation"),
        (lambda c: "".join(chr(ord(x) + 0xFEE0) for x in c), "unicode form"),  # full-width digits
    ],
)
def test_pairs_that_differ_only_in_format_are_named_on_the_dataset(tok, noise, how):
    ex = [{"prompt": e["prompt"], "chosen": e["answer"], "rejected": noise(e["answer"])} for e in digits(8)]
    found = form(tok, ex)
    assert kinds(found) == {K.PAIRS_FORMAT_ONLY}
    assert found[0].where.startswith("data.dataset") and how in found[0].observed["how"]


def test_a_collator_that_makes_the_rejected_side_format_noise_is_named(tok):
    ex = pairs()
    batch = pair_batch(tok, ex, rejected_texts=[e["chosen"] + " " for e in ex])
    found = form(tok, ex, batch=batch, source="mine.py:collate")
    assert kinds(found) == {K.PAIRS_FORMAT_ONLY} and found[0].where == "collator:mine.py:collate"


def test_pairs_that_differ_in_content_stay_quiet(tok):
    one_digit = [
        {"prompt": e["prompt"], "chosen": e["answer"], "rejected": e["answer"][:3] + "0"} for e in digits(8)
    ]
    for ex in (pairs(), one_digit):
        assert not form(tok, ex)


def mismatch(tok, ex, prompts):
    return D.pair_prompt_findings(pair_batch(tok, ex, rejected_prompts=prompts), tokenizer_info=info(tok),
                                  source="mine.py:collate", ctx=CTX)  # fmt: skip


@pytest.mark.parametrize("k", [1, -1, 2])
def test_a_collator_that_rotates_one_side_is_named_with_its_shift(tok, k):
    ex = pairs(8, seed=4)
    prompts = [e["prompt"] for e in ex]
    rotated = prompts[-k:] + prompts[:-k]
    found = mismatch(tok, ex, rotated)
    assert kinds(found) == {K.PAIR_PROMPT_MISMATCH}
    assert found[0].observed["shift"] == k and found[0].where == "collator:mine.py:collate"


def test_a_separately_shuffled_side_is_named_and_a_shared_prompt_stays_quiet(tok):
    ex = pairs(8, seed=5)
    prompts = [e["prompt"] for e in ex]
    shuffled = prompts[:]
    random.Random(1).shuffle(shuffled)
    assert K.PAIR_PROMPT_MISMATCH in kinds(mismatch(tok, ex, shuffled))
    assert not mismatch(tok, ex, prompts)  # the same prompts on both sides
    assert not D.pair_prompt_findings(
        pair_batch(tok, ex), tokenizer_info=info(tok), source="builtin:pairs", ctx=CTX
    )


# ---------------------------------------------------------------- 3. the prompts' form, measured on a policy


class TablePolicy(nn.Module):
    """A hand-made 'SFT' policy for the digits task: after the cue it was trained on (``cue`` tokens) it puts
    10 nats on the prompt's first digit, inside its answer on that digit again; anywhere else it is uniform."""

    def __init__(self, tok, cue=":"):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.v = len(tok)
        self.cue = tok(cue, add_special_tokens=False)["input_ids"]
        self.digits = set(tok(string.digits, add_special_tokens=False)["input_ids"])

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        out = torch.zeros(b, t, self.v)
        n = len(self.cue)
        for i in range(b):
            row = input_ids[i].tolist()
            first = next((x for x in row if x in self.digits), None)
            after = None
            for j in range(t):
                if after is None and j + 1 >= n and row[j + 1 - n : j + 1] == self.cue:
                    after = j
                if first is not None and after is not None and (j == after or row[j] == first and j > after):
                    out[i, j, first] = 10.0
        return out + self.w


def probe(tok, model, examples):
    return D.prompt_form_findings(model, examples, tokenizer_info=info(tok), data={"dataset": "mine.py:rows"},
                                  ctx=CTX)  # fmt: skip


@pytest.mark.parametrize(
    "reform,name",
    [
        (lambda p: p + " ", "a trailing whitespace"),
        (lambda p: p + "\n", "a trailing whitespace"),
        (lambda p: " " + p, "a leading whitespace"),
    ],
)
def test_a_prompt_form_the_policy_does_not_know_is_named(tok, reform, name):
    model = LeadPolicy(tok) if name == "a leading whitespace" else TablePolicy(tok)
    ex = [{**e, "prompt": reform(e["prompt"])} for e in digits(8, seed=7)]
    found = probe(tok, model, ex)
    assert kinds(found) == {K.PROMPT_FORM}
    f = found[0]
    assert f.observed["form"] == name and f.observed["logprob_drop"] > D.FORM_DROP
    assert f.where.startswith("data.dataset") and f.severity == "error"


def test_a_form_the_policy_does_not_mind_stays_quiet(tok):
    doubled = [{**e, "prompt": e["prompt"].replace(" ", "  ")} for e in digits(8, seed=7)]
    assert not probe(tok, TablePolicy(tok), doubled)  # the cue ':' still comes right before the answer


class LeadPolicy(TablePolicy):
    """A policy that knows the task only when the prompt's first digit follows bos directly."""

    def forward(self, input_ids, attention_mask=None):
        out = super().forward(input_ids, attention_mask)
        bos = 1
        for i in range(input_ids.shape[0]):
            row = input_ids[i].tolist()
            k = row.index(bos) if bos in row else 0
            if k + 1 < len(row) and row[k + 1] not in self.digits:
                out[i] = self.w * 0  # a prompt that does not start with its digit: the policy knows nothing
        return out


def test_a_dpo_chosen_side_is_the_target_when_there_is_no_answer(tok):
    ex = [{"prompt": e["prompt"] + " ", "chosen": e["answer"], "rejected": "0000"} for e in digits(8, seed=8)]
    assert kinds(probe(tok, TablePolicy(tok), ex)) == {K.PROMPT_FORM}


def test_a_policy_trained_on_the_form_or_on_nothing_stays_quiet(tok):
    spaced = [{**e, "prompt": e["prompt"] + " "} for e in digits(8, seed=9)]
    assert not probe(tok, TablePolicy(tok, cue=": "), spaced)  # trained with the space: it knows this form
    flat = nn.Linear(1, 1)  # no forward of ids: nothing measured

    class Uniform(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None):
            return torch.zeros(*input_ids.shape, len(tok)) + self.w

    assert not probe(tok, Uniform(), spaced)  # a never-trained policy knows neither form
    assert not probe(tok, flat, spaced)
    assert not probe(tok, TablePolicy(tok), digits(8, seed=9))  # no form to measure


# ---------------------------------------------------------------- 4. causal order


@pytest.mark.parametrize(
    "cls", ["constant_targets", "few_prompts", "pairs_format_only", "pair_prompt", "prompt_form"]
)
def test_the_data_findings_explain_no_signal_and_a_constant_reward(cls):
    assert explains(cls, "no_signal") is not None
    assert explains(cls, "reward_constant") is not None


def test_prompt_collator_rows_feed_the_watch_without_a_finding(tok):
    ex = digits(16, seed=11)
    coll = PromptCollator(tok, 16)
    found = watch_run(ex, {"dataset": "x.py:rows"}, batches=3, b=4, tok=tok, batch_fn=coll, reload=False)
    assert not kinds(found) & {K.CONSTANT_TARGETS, K.FEW_PROMPTS, K.PAIRS_FORMAT_ONLY, K.PAIR_PROMPT_MISMATCH}


def test_verl_files_with_fewer_prompts_than_a_batch_are_named_on_the_files(tmp_path):
    path = tmp_path / "smoke.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"what is {i} + 1?"}], "data_source": "x",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(3)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = {"train_files": str(path), "prompt_key": "prompt"}
    batch_ex = [{**rows[i % 3], "prompt": "rendered", "messages": rows[i % 3]["prompt"]} for i in range(8)]
    found = ExampleWatch().findings(
        {}, examples=batch_ex, tokenizer_info={}, data=data, source="builtin:verl", ctx=CTX
    )
    few = [f for f in found if f.kind == K.FEW_PROMPTS]
    assert few and few[0].where.startswith("data.train_files") and few[0].observed["distinct_prompts"] == 3
    assert K.CONSTANT_TARGETS not in kinds(found)


def _findings_of(kind, tok):
    if kind == K.CONSTANT_TARGETS:
        return watch_run(digits(64, label=lambda rng: "7"), {"dataset": "x.py:rows"}, reload=False, b=8)
    if kind == K.FEW_PROMPTS:
        return watch_run(
            TASKS["digits"].make_examples(2, 0), {"task": "digits", "num_examples": 2}, batches=1
        )
    if kind == K.PAIRS_FORMAT_ONLY:
        return form(tok, [{**p, "rejected": p["chosen"] + " "} for p in pairs()])
    if kind == K.PAIR_PROMPT_MISMATCH:
        ex = pairs(8, seed=4)
        return mismatch(tok, ex, [e["prompt"] for e in ex[1:] + ex[:1]])
    return probe(tok, TablePolicy(tok), [{**e, "prompt": e["prompt"] + " "} for e in digits(8, seed=7)])


@pytest.mark.parametrize(
    "kind", [K.CONSTANT_TARGETS, K.FEW_PROMPTS, K.PAIRS_FORMAT_ONLY, K.PAIR_PROMPT_MISMATCH, K.PROMPT_FORM]
)
def test_diagnose_roots_the_data_finding_and_marks_the_no_signal_it_causes(tok, kind):
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run
    from verlaudit.rundir import Finding

    f = [x for x in _findings_of(kind, tok) if x.kind == kind]
    assert len(f) == 1
    first = [Finding(**{**f[0].__dict__, "step": 0, "phase": "rollout"})]
    symptoms = [
        Finding(severity="error", kind=K.NO_SIGNAL, message="rewards identical within every group",
                role="reward", where="reward:function:task:digits", step=1, phase="reward"),
        Finding(severity="warning", kind=K.REWARD_CONSTANT, message="every response got the same reward",
                role="reward", where="reward:function:task:digits", step=2, phase="reward"),
    ]  # fmt: skip
    d = diagnose_run(run_dir(first + symptoms, algo="grpo"))
    assert d.causes[0].kind == f"finding:{kind}", [(c.kind, c.title[:60]) for c in d.causes]
    assert d.causes[0].fixes and d.causes[0].fixes[0].why
    later = [c for c in d.causes[1:] if c.kind in (f"finding:{K.NO_SIGNAL}", f"finding:{K.REWARD_CONSTANT}")]
    assert later and all(c.consequence_of == d.causes[0].title for c in later), [
        (c.kind, c.consequence_of) for c in d.causes
    ]
