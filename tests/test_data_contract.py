"""The data contract (verlaudit/audit/data_contract.py, special_content.py): what the model is shown and scored
against is what the dataset says. Each invariant with several members of its family, written here with the
project's character tokenizer (no bench item): a collator that strips the cue, lower-cases, cuts the question's
number or moves the cue; a pad that is a digit, a space or a newline; a collator and a tokenizer that drop bos;
conflicting duplicates that disagree or differ only in a unit, contradicting preference pairs; answers in another
case or in full-width digits; answers the vocabulary cannot write. Each with its clean twin, which stays quiet."""

from __future__ import annotations

import random
import string

import pytest
import torch

from trainer.tokenizer import build_tokenizer
from verlaudit import kinds as K
from verlaudit.audit import data_contract as C
from verlaudit.audit import special_content as S
from verlaudit.audit.invariants_examples import ExampleWatch

SRC = "my_collators.py:clean"
DATA = {"dataset": "my_data.py:rows", "prompt_length": 16}


def info(tok):
    return {"tokenizer": tok, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok), "padding_side": "left"}  # fmt: skip


def digits_examples(n=8, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = [rng.choice(string.digits) for _ in range(rng.randint(2, 4))]
        out.append({"prompt": " ".join(d) + ":", "answer": d[0] * 4})
    return out


def collate(tok, texts, width=16, mask_from_pad=False, special=True):
    rows = [tok(t, add_special_tokens=special)["input_ids"][-width:] for t in texts]
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    if mask_from_pad:
        mask = (ids != tok.pad_token_id).long()
    return {"input_ids": ids, "attention_mask": mask}


def trip(tok, examples, texts, **kw):
    b = collate(tok, texts, **kw)
    return C.round_trip_findings(b, examples, tokenizer_info=info(tok), data=DATA, source=SRC,
                                 where=f"collator:{SRC}", ctx={"role": "actor"})  # fmt: skip


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "rewrite,how",
    [
        (lambda p: p.rstrip(" :>|.?"), "end"),  # a cleaner that strips the trailing cue
        (lambda p: ":" + p[:-1], "end"),  # a template that puts the answer cue before the question
        (lambda p: p[2:], "start"),  # a collator that drops the question's first number
        (lambda p: p.replace(" ", ""), "whitespace"),  # a cleaner that removes the spaces
    ],
)
def test_a_collator_that_rewrites_the_prompt_is_named(rewrite, how):
    tok = build_tokenizer()
    ex = digits_examples()
    fs = trip(tok, ex, [rewrite(e["prompt"]) for e in ex])
    assert [f.kind for f in fs] == [K.PROMPT_REWRITTEN], fs
    f = fs[0]
    assert f.where == f"collator:{SRC}" and how in f.observed["how"], f.observed
    assert "rstrip" in f.fix and SRC in f.fix


def test_lower_casing_is_named_and_a_right_cut_that_loses_the_number_is_the_truncation_checks():
    tok = build_tokenizer()
    ex = [{"prompt": f"Copy {w.upper()}>", "answer": w.upper()} for w in ("ab", "cde", "fgh", "bad")]
    fs = trip(tok, ex, [e["prompt"].lower() for e in ex])
    assert [f.kind for f in fs] == [K.PROMPT_REWRITTEN] and "case" in fs[0].observed["how"]
    long = [
        {"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}
        for a, b in ((12, 34), (5, 61), (70, 8), (9, 9))
    ]
    rows = [tok(e["prompt"])["input_ids"][:12] for e in long]  # keeps the start: the numbers are cut off
    ids = torch.tensor([r + [tok.pad_token_id] * (12 - len(r)) for r in rows])
    b = {"input_ids": ids, "attention_mask": (ids != tok.pad_token_id).long()}
    fs = C.round_trip_findings(b, long, tokenizer_info=info(tok), data={"prompt_length": 12}, source=SRC,
                               where="collator:x", ctx={})  # fmt: skip
    assert fs == []  # a cut at a length limit is the truncation check's, which names the limit and what went
    from verlaudit.audit.truncation import prompt_cut_findings

    fs = prompt_cut_findings(
        b, long, tokenizer_info=info(tok), data={"prompt_length": 12}, source=SRC, ctx={}
    )
    assert [f.kind for f in fs] == [K.PROMPT_TRUNCATION] and fs[0].observed["side_kept"] == ["start"], fs
    assert fs[0].observed["answer_content_lost"] >= 2 and fs[0].severity == "error"


def test_the_prompt_itself_a_template_around_it_and_the_builtin_cut_stay_quiet():
    tok = build_tokenizer()
    ex = digits_examples()
    assert trip(tok, ex, [e["prompt"] for e in ex]) == []
    assert trip(tok, ex, [f"Q: {e['prompt']}" for e in ex]) == []  # a template holds the whole prompt
    long = [{"prompt": "7 " * 12 + str(i) + ":", "answer": "7777"} for i in range(4)]
    assert trip(tok, long, [e["prompt"] for e in long], width=8) == []  # the end kept at prompt_length


def test_a_collator_without_the_bos_the_tokenizer_adds_is_named():
    tok = build_tokenizer()
    ex = digits_examples()
    fs = trip(tok, ex, [e["prompt"] for e in ex], special=False)
    assert [f.kind for f in fs] == [K.BOS_MISSING] and "add_special_tokens=True" in fs[0].fix


def test_a_mask_that_drops_a_pad_that_is_a_digit_names_the_pad():
    tok = build_tokenizer()
    tok.pad_token = "0"
    ex = [{"prompt": p, "answer": "0000"} for p in ("1 0 2:", "0 3:", "4 0:", "0 0 7:")]
    fs = trip(tok, ex, [e["prompt"] for e in ex], mask_from_pad=True)
    assert [f.kind for f in fs] == [K.SPECIAL_TOKEN_CONTENT], fs
    assert "pad_token" in fs[0].fix and fs[0].observed["literal"] == "0"


# ---------------------------------------------------------------- special tokens are not content


@pytest.mark.parametrize("pad", ["0", " ", "\n"])
def test_a_pad_token_that_is_a_character_of_the_text_is_an_error(pad):
    tok = build_tokenizer()
    tok.pad_token = pad
    ex = [{"prompt": "1 0 2:\n", "answer": "1111"}, {"prompt": "0 3:\n", "answer": "0000"}] * 2
    fs = C.special_content_findings(ex, tokenizer_info=info(tok), ctx={})
    assert [f.kind for f in fs] == [K.SPECIAL_TOKEN_CONTENT] and fs[0].observed["literal"] == pad
    pairs = [(e["prompt"], e["answer"]) for e in ex]
    setup = S.content_findings("model.tokenizer (/tmp/tok)", tok, pairs)
    assert [(f.kind, f.severity) for f in setup] == [(K.SPECIAL_TOKEN_CONTENT, "error")], setup
    assert setup[0].where == "model.tokenizer (/tmp/tok)" and "pad_token" in setup[0].fix


def test_the_projects_pad_and_pad_equal_to_eos_stay_quiet():
    tok = build_tokenizer()
    ex = digits_examples()
    assert C.special_content_findings(ex, tokenizer_info=info(tok), ctx={}) == []
    assert S.content_findings("t", tok, [(e["prompt"], e["answer"]) for e in ex]) == []
    tok.pad_token = tok.eos_token
    assert S.content_findings("t", tok, [(e["prompt"], e["answer"]) for e in ex]) == []


def test_a_one_character_pad_absent_from_the_text_is_a_warning():
    tok = build_tokenizer()
    tok.pad_token = "~"
    fs = S.content_findings("t", tok, [("1 2:", "1111")])
    assert [(f.kind, f.severity) for f in fs] == [(K.SPECIAL_TOKEN_CONTENT, "warning")]


def _no_bos_tokenizer(path):
    from tokenizers import processors

    tok = build_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B", special_tokens=[]
    )
    tok.save_pretrained(path)
    return tok


def test_a_tokenizer_that_lost_the_checkpoints_bos_is_named(tmp_path):
    ckpt, other = tmp_path / "ckpt", tmp_path / "tok"
    build_tokenizer().save_pretrained(ckpt)
    tok = _no_bos_tokenizer(other)
    config = {"model": {"path": str(ckpt), "tokenizer": str(other)}}
    fs = S.bos_findings(config, tok)
    assert [f.kind for f in fs] == [K.BOS_MISSING] and str(other) in fs[0].where
    assert "post_processor" in fs[0].fix and "add_bos_token" in fs[0].fix
    # the checkpoint's own tokenizer re-saved elsewhere: the same bos, quiet
    build_tokenizer().save_pretrained(tmp_path / "same")
    same = {"model": {"path": str(ckpt), "tokenizer": str(tmp_path / "same")}}
    assert S.bos_findings(same, build_tokenizer()) == []
    # a checkpoint saved without bos and a tokenizer that adds one: named too (a bos it never saw)
    fs = S.bos_findings({"model": {"path": str(other), "tokenizer": str(ckpt)}}, build_tokenizer())
    assert [f.kind for f in fs] == [K.BOS_MISSING]


# ---------------------------------------------------------------- ground truths


def test_unreachable_answers_are_named():
    tok = build_tokenizer()
    ex = [{"prompt": f"{d} {d}:", "answer": chr(0xFF10 + d) * 4} for d in range(8)]  # full-width digits
    fs = C.unreachable_findings(ex, tokenizer_info=info(tok), data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.ANSWER_UNREACHABLE] and "NFKC" in fs[0].fix
    ex = [{"prompt": f"say {w}:", "answer": w} for w in ("é", "ü", "ñ", "ç")]  # letters the vocabulary lacks
    assert [f.kind for f in C.unreachable_findings(ex, tokenizer_info=info(tok), data=DATA, ctx={})] == [
        K.ANSWER_UNREACHABLE
    ]
    assert C.unreachable_findings(digits_examples(), tokenizer_info=info(tok), data=DATA, ctx={}) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda w: {"prompt": w.upper() + ">", "answer": w},  # prompts from a display column in capitals
        lambda w: {"prompt": "copy " + w + ">", "answer": w.upper()},  # answers upper-cased
        lambda w: {"prompt": "copy " + w + ">", "answer": w.upper() + w.upper()},  # and not in the prompt
    ],
)
def test_answers_in_another_case_than_the_prompts_are_named(make):
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(8)]
    fs = C.notation_findings([make(w) for w in words], data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.ANSWER_NOTATION] and "case" in fs[0].message, fs
    assert "my_data.py:rows" in fs[0].where and "lower()" in fs[0].fix


def test_full_width_answers_are_a_notation_finding_and_clean_tasks_stay_quiet():
    ex = [{"prompt": f"{d} 5:", "answer": chr(0xFF10 + d) * 4} for d in range(8)]
    fs = C.notation_findings(ex, data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.ANSWER_NOTATION] and "NFKC" in fs[0].message
    assert C.notation_findings(digits_examples(), data=DATA, ctx={}) == []
    copy = [{"prompt": w + ">", "answer": w} for w in ("ab", "cab", "hgf", "dd")]
    assert C.notation_findings(copy, data=DATA, ctx={}) == []
    mcq = [{"prompt": f"Pick one: (A) {x} (B) {y}", "answer": "B"} for x, y in (("1", "2"), ("3", "4"))] * 2
    assert C.notation_findings(mcq, data=DATA, ctx={}) == []


@pytest.mark.parametrize(
    "second,form",
    [
        (lambda d: d[-1] * 4, False),  # a second batch labelled with an old guideline
        (lambda d: d[0] * 4 + " kg", True),  # the same answer with a unit
        (lambda d: " " + d[0] * 4, True),  # the same answer with a space
    ],
)
def test_the_same_prompt_with_two_ground_truths_is_named(second, form):
    rng = random.Random(5)
    rows = []
    for _ in range(40):
        d = [rng.choice("123456789") for _ in range(3)]
        while d[-1] == d[0]:
            d[-1] = rng.choice("123456789")
        p = " ".join(d) + ":"
        rows += [{"prompt": p, "answer": d[0] * 4}, {"prompt": p, "answer": second(d)}]
    w = C.ConflictWatch()
    w.add(rows)
    fs = w.findings(data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.CONFLICTING_ANSWERS] and "de-duplicate" in fs[0].fix
    assert fs[0].observed["differ_in_form_only"] is form


def test_duplicates_with_one_answer_stay_quiet_and_flipped_pairs_are_named():
    w = C.ConflictWatch()
    w.add(digits_examples(64) * 2)
    assert w.findings(data=DATA, ctx={}) == []
    pairs = [{"prompt": f"{i}:", "chosen": str(i) * 4, "rejected": str(i + 1) * 4} for i in range(6)]
    w = C.ConflictWatch()
    w.add(pairs + [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} for p in pairs])
    fs = w.findings(data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.CONFLICTING_PREFERENCES]
    w = C.ConflictWatch()
    w.add(pairs + [{**p, "rejected": "9999"} for p in pairs])  # many pairs per prompt, none reversed
    assert w.findings(data=DATA, ctx={}) == []


_ROWS: list[dict] = []


def rows():
    return list(_ROWS)


def test_the_whole_dataset_is_read_once_for_conflicts_a_batch_cannot_show(monkeypatch):
    rng = random.Random(2)
    _ROWS.clear()
    for _ in range(100):
        d = [rng.choice("12345678") for _ in range(3)]
        d[-1] = "9"
        p = " ".join(d) + ":"
        _ROWS.extend([{"prompt": p, "answer": d[0] * 4}, {"prompt": p, "answer": "9999"}])
    tok = build_tokenizer()
    batch_rows = _ROWS[::25][:8]  # one batch: no prompt twice in it
    b = collate(tok, [e["prompt"] for e in batch_rows])
    data = {"dataset": f"{__name__}:rows", "prompt_length": 16}
    fs = ExampleWatch().findings(
        b, examples=batch_rows, tokenizer_info=info(tok), data=data, source=SRC, ctx={}
    )
    assert K.CONFLICTING_ANSWERS in [f.kind for f in fs], fs
    off = ExampleWatch(reload=False).findings(
        b, examples=batch_rows, tokenizer_info=info(tok), data=data, source=SRC, ctx={}
    )
    assert K.CONFLICTING_ANSWERS not in [f.kind for f in off]


def test_unknown_characters_are_the_datasets_when_normalising_fixes_them_else_the_tokenizers():
    tok = build_tokenizer()
    ex = [{"prompt": f"{chr(0xFF10 + d)} {chr(0xFF10 + d)}:", "answer": str(d) * 4} for d in range(8)]
    fs = C.unreachable_findings(ex, tokenizer_info=info(tok), data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.ANSWER_UNREACHABLE] and "my_data.py:rows" in fs[0].where
    assert "NFKC" in fs[0].fix and fs[0].observed["field"] == "prompt"
    # a tokenizer that maps every digit to <unk> (a vocabulary saved without them): the tokenizer is named
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainer.tokenizer import CHARACTERS, SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        if not ch.isdigit():
            vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    bad = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>", name_or_path="/tmp/nodigits")  # fmt: skip
    fs = C.unreachable_findings(digits_examples(), tokenizer_info=info(bad), data=DATA, ctx={})
    assert [f.kind for f in fs] == [K.ANSWER_UNREACHABLE] and "model.tokenizer" in fs[0].where, fs


def test_verl_rows_with_two_ground_truths_for_one_question_are_named(tmp_path):
    import json

    path = tmp_path / "rows.jsonl"
    lines = []
    for i in range(30):
        msgs = [{"role": "user", "content": f"What is {i} + {i}?"}]
        for truth in (str(2 * i), str(2 * i + 1)):  # two labelling passes that disagree
            lines.append({"prompt": msgs, "reward_model": {"ground_truth": truth}, "data_source": "x"})
    path.write_text("\n".join(json.dumps(r) for r in lines))
    data = {"train_files": str(path), "prompt_key": "prompt"}
    batch = [{**lines[0], "messages": lines[0]["prompt"], "prompt": "rendered"}]
    fs = ExampleWatch().findings(
        {}, examples=batch, tokenizer_info={}, data=data, source="builtin:verl", ctx={}
    )
    assert [f.kind for f in fs] == [K.CONFLICTING_ANSWERS] and str(path) in fs[0].where, fs
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps(r) for r in lines[::2]))
    data = {"train_files": str(clean), "prompt_key": "prompt"}
    assert ExampleWatch().findings({}, examples=batch, tokenizer_info={}, data=data, source="v", ctx={}) == []


def test_a_collator_that_only_strips_whitespace_at_the_ends_is_a_warning():
    tok = build_tokenizer()
    ex = [{**e, "prompt": e["prompt"] + "\n"} for e in digits_examples()]
    fs = trip(tok, ex, [e["prompt"].strip() for e in ex])
    assert [(f.kind, f.severity) for f in fs] == [(K.PROMPT_REWRITTEN, "warning")], fs


@pytest.mark.parametrize("kind", ["rewritten", "notation", "conflict", "content"])
def test_diagnose_puts_the_data_contract_above_the_no_signal_and_constant_reward_it_causes(kind):
    from tests.test_setup_cause import run_dir
    from verlaudit.analysis.diagnose.diagnosis import diagnose_run
    from verlaudit.rundir import Finding

    tok = build_tokenizer()
    ex = digits_examples()
    if kind == "rewritten":
        f = trip(tok, ex, [e["prompt"].rstrip(":") for e in ex])
    elif kind == "notation":
        f = C.notation_findings([{"prompt": w.upper() + ">", "answer": w} for w in ("ab", "cd", "ef", "gh")],
                                data=DATA, ctx={})  # fmt: skip
    elif kind == "conflict":
        w = C.ConflictWatch()
        w.add([{"prompt": f"{i}:", "answer": a} for i in range(8) for a in ("1111", "2222")])
        f = w.findings(data=DATA, ctx={})
    else:
        tok.pad_token = "0"
        f = S.content_findings("model.tokenizer (/tmp/t)", tok, [("1 0:", "1111"), ("0 2:", "0000")])
    assert len(f) == 1
    first = [Finding(**{**f[0].__dict__, "step": 0, "phase": "rollout"})] if f[0].step is None else f
    symptoms = [
        Finding(severity="warning", kind=K.NO_SIGNAL, message="rewards identical within every group",
                role="reward", where="reward:function:task:digits", step=1, phase="reward"),
        Finding(severity="warning", kind=K.REWARD_CONSTANT, message="every response got the same reward",
                role="reward", where="reward:function:task:digits", step=1, phase="reward"),
    ]  # fmt: skip
    d = diagnose_run(run_dir(first + symptoms, algo="grpo"))
    assert d.causes[0].kind == f"finding:{f[0].kind}", [(c.kind, c.title[:60]) for c in d.causes]
    assert d.causes[0].fixes and d.causes[0].fixes[0].why


def test_an_eos_that_is_a_newline_and_a_template_that_doubles_bos_are_named(tmp_path):
    from tokenizers import processors

    tok = build_tokenizer()
    tok.eos_token = "\n"  # generation stops at the first line break; masks of ids != eos drop every newline
    fs = S.content_findings("model.tokenizer (/tmp/t)", tok, [("1 2:\n3 4:", "1111")])
    assert [(f.kind, f.severity, f.observed["token"]) for f in fs] == [
        (K.SPECIAL_TOKEN_CONTENT, "error", "eos")
    ]
    ckpt, other = tmp_path / "ckpt", tmp_path / "tok"
    build_tokenizer().save_pretrained(ckpt)
    doubled = build_tokenizer()
    bos = doubled.bos_token_id
    doubled.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> <bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    fs = S.bos_findings({"model": {"path": str(ckpt), "tokenizer": str(other)}}, doubled)
    assert [f.kind for f in fs] == [K.BOS_MISSING] and fs[0].observed["run_bos"] == 2


def test_a_check_that_raises_is_skipped_not_the_runs_end(capsys):
    class Broken:
        bos_token_id = 1
        all_special_ids = [0, 1, 2]
        pad_token_id = 0

        def __call__(self, *a, **k):
            raise RuntimeError("boom")

        def convert_ids_to_tokens(self, i):
            raise RuntimeError("boom")

    ex = digits_examples()
    b = collate(build_tokenizer(), [e["prompt"] for e in ex])
    fs = ExampleWatch().findings(b, examples=ex, tokenizer_info={"tokenizer": Broken(), "pad_token_id": 0},
                                 data=DATA, source=SRC, ctx={})  # fmt: skip
    assert isinstance(fs, list)
    assert C.guarded(lambda: 1 / 0) == [] and "ZeroDivisionError" in capsys.readouterr().err


def test_an_added_special_token_that_is_a_character_of_the_text_is_named():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["7"]})  # skip_special_tokens now deletes every 7
    ex = [{"prompt": "7 1:", "answer": "7777"}, {"prompt": "2 7:", "answer": "2222"}] * 2
    fs = C.special_content_findings(ex, tokenizer_info=info(tok), ctx={})
    assert [f.kind for f in fs] == [K.SPECIAL_TOKEN_CONTENT] and "additional_special_tokens" in fs[0].fix
    setup = S.content_findings("t", tok, [(e["prompt"], e["answer"]) for e in ex])
    assert [(f.kind, f.severity) for f in setup] == [(K.SPECIAL_TOKEN_CONTENT, "error")]


def _pairs(n=6):
    rng = random.Random(4)
    out = []
    for _ in range(n):
        d = [rng.choice("12345678") for _ in range(3)]
        out.append(
            {"prompt": " ".join(d) + ":", "chosen": d[0] * 4 + ".", "rejected": "9999.", "answer": d[0] * 4}
        )
    return out


@pytest.mark.parametrize("rewrite", [lambda t: t.rstrip("."), lambda t: t[::-1], lambda t: "x" + t[1:]])
def test_a_pair_collator_that_rewrites_the_completions_is_named(rewrite):
    from trainer.data import PairCollator

    tok = build_tokenizer()
    ex = _pairs()
    batch = PairCollator(tok, 8, 8)([{**e, "chosen": rewrite(e["chosen"])} for e in ex])
    fs = C.completion_round_trip_findings(batch, ex, tokenizer_info=info(tok), source=SRC, where="c", ctx={})
    assert [f.kind for f in fs] == [K.COMPLETION_REWRITTEN] and fs[0].observed["side"] == "chosen", fs


def test_the_builtin_pairs_a_cut_at_the_response_length_and_swapped_sides_stay_quiet():
    from trainer.data import PairCollator

    tok = build_tokenizer()
    ex = _pairs()
    q = lambda batch: C.completion_round_trip_findings(  # noqa: E731
        batch, ex, tokenizer_info=info(tok), source=SRC, where="c", ctx={}
    )
    assert q(PairCollator(tok, 8, 8)(ex)) == []
    assert q(PairCollator(tok, 8, 3)(ex)) == []  # cut at data.response_length: the length checks'
    swapped = [{**e, "chosen": e["rejected"], "rejected": e["chosen"]} for e in ex]
    assert q(PairCollator(tok, 8, 8)(swapped)) == []  # the pair-order check names a swap


def test_rows_reordered_or_padding_attended_are_left_to_their_own_checks():
    tok = build_tokenizer()
    ex = digits_examples()
    texts = [e["prompt"] for e in ex]
    assert trip(tok, ex, texts[1:] + texts[:1]) == []  # reordered rows: boundary/rows_reordered names them
    b = collate(tok, texts)
    b["attention_mask"] = torch.ones_like(b["attention_mask"])  # a mask of 1 on the padding
    assert (
        C.round_trip_findings(b, ex, tokenizer_info=info(tok), data=DATA, source=SRC, where="c", ctx={}) == []
    )


def test_a_batch_of_two_prompts_is_named_only_when_both_rows_changed():
    tok = build_tokenizer()
    ex = digits_examples(2)
    assert [f.kind for f in trip(tok, ex, [e["prompt"].rstrip(":") for e in ex])] == [K.PROMPT_REWRITTEN]
    assert trip(tok, ex, [ex[0]["prompt"].rstrip(":"), ex[1]["prompt"]]) == []


_SHIFTED: list[dict] = []


def shifted():
    return list(_SHIFTED)


@pytest.mark.parametrize("k", [1, -2])
def test_answers_offset_by_rows_against_their_prompts_are_named_as_a_shift(k):
    rng = random.Random(7)
    qs = []
    for _ in range(300):
        d = [rng.choice("0123456789") for _ in range(2)]
        qs.append((" ".join(d) + ":", d[0] * 4))
    prompts, answers = [q for q, _ in qs], [a for _, a in qs]
    answers = answers[k:] + answers[:k]  # prompt i gets answer i + k (a header skipped twice: k = 1)
    _SHIFTED[:] = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    w = C.ConflictWatch()
    w.reload({"dataset": f"{__name__}:shifted"}, allowed=True)
    fs = w.findings(data={"dataset": "x.py:shifted"}, ctx={})
    assert [f.kind for f in fs] == [K.CONFLICTING_ANSWERS] and fs[0].observed["offset"] == k, fs
    assert "misaligned" in fs[0].message and "off-by-one" in fs[0].fix
    rng.shuffle(_SHIFTED)  # the same rows shuffled: no order to read, a conflict without an offset
    w = C.ConflictWatch()
    w.reload({"dataset": f"{__name__}:shifted"}, allowed=True)
    fs = w.findings(data={"dataset": "x.py:shifted"}, ctx={})
    assert [f.kind for f in fs] == [K.CONFLICTING_ANSWERS] and "offset" not in fs[0].observed
