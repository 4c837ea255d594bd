"""The data's invariants (verlaudit/audit/invariants_data.py): rows in the examples' order, eos in prompts and
response masks, DPO pairs the right way round, frozen roles that share a trained role's tensors. Each planted
variant is found with its culprit; its clean control is not. The variants are not the blind benches' items."""

from __future__ import annotations

import copy

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import boundaries
from verlaudit.audit import invariants as I
from verlaudit.audit import invariants_data as D

PAD, EOS = 0, 2
LITERAL = "</s>"


class CharTok:
    """A character tokenizer: id 10 + ord(c) - 32, the literal '</s>' -> EOS; ``append_eos`` as a
    post-processor that ends every encoding with eos."""

    def __init__(self, append_eos: bool = False) -> None:
        self.append_eos = append_eos

    def __call__(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            if text.startswith(LITERAL, i):
                ids.append(EOS)
                i += len(LITERAL)
            else:
                ids.append(10 + ord(text[i]) - 32)
                i += 1
        if add_special_tokens and self.append_eos:
            ids.append(EOS)
        return {"input_ids": ids}

    def convert_ids_to_tokens(self, i):
        return LITERAL if i == EOS else chr(i - 10 + 32)


def info(tok=None, pad=PAD):
    return {
        "pad_token_id": pad,
        "eos_token_id": EOS,
        "vocab_size": 200,
        "padding_side": "left",
        "tokenizer": tok,
    }


def left(rows, length, pad=PAD):
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        r = r[-length:]
        ids[i, length - len(r) :] = torch.tensor(r)
        mask[i, length - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def found(batch, tok, examples, data=None, pad=PAD, source="c.py:collate"):
    return I.batch_findings(
        batch, role="actor", source=source, tokenizer_info=info(tok, pad), examples=examples, data=data or {}
    )


def kinds(fs):
    return [f.kind for f in fs]


EXAMPLES = [{"prompt": p, "answer": "x"} for p in ("ab:", "cdef:", "g:", "hij:")]


# ---------------------------------------------------------------- row order


def test_rows_in_the_examples_order_are_clean_and_any_reordering_is_named():
    tok = CharTok()
    enc = [tok(e["prompt"])["input_ids"] for e in EXAMPLES]
    assert found(left(enc, 8), tok, EXAMPLES) == []
    for order in (
        sorted(range(4), key=lambda i: -len(enc[i])),
        [3, 2, 1, 0],
        [1, 0, 2, 3],
    ):  # sort, reverse, swap
        fs = found(left([enc[i] for i in order], 8), tok, EXAMPLES)
        assert kinds(fs) == [K.ROWS_REORDERED], order
        assert fs[0].where == "collator:c.py:collate.input_ids" and "order" in fs[0].fix


def test_row_order_reads_truncated_prompts_and_skips_rows_the_collator_formats():
    tok = CharTok()
    enc = [tok(e["prompt"])["input_ids"] for e in EXAMPLES]
    # cut to 3, each row still its example's end (the cut itself is audit/truncation.py's to report)
    assert K.ROWS_REORDERED not in kinds(found(left(enc, 3), tok, EXAMPLES))
    assert kinds(found(left(enc[::-1], 3), tok, EXAMPLES)) == [K.ROWS_REORDERED]
    templated = [[99, *e] for e in enc[::-1]]  # a template around each prompt: no row is an example's text
    assert K.ROWS_REORDERED not in kinds(found(left(templated, 8), tok, EXAMPLES))
    assert found(left(enc[::-1], 8), None, EXAMPLES) == []  # no tokenizer handed over: nothing to compare


def test_row_order_of_a_dpo_batch_reads_its_prompt_columns():
    tok = CharTok()
    pairs = [dict(e, chosen="x", rejected="y") for e in EXAMPLES]
    enc = [tok(e["prompt"])["input_ids"] for e in pairs]
    for rows, bad in ((enc, False), (enc[::-1], True)):
        p = left(rows, 6)
        r = torch.tensor([[tok("x")["input_ids"][0], EOS]] * 4)
        batch = {
            "chosen_input_ids": torch.cat([p["input_ids"], r], 1),
            "chosen_attention_mask": torch.cat([p["attention_mask"], torch.ones_like(r)], 1),
            "chosen_response_mask": torch.ones_like(r),
        }
        assert (K.ROWS_REORDERED in kinds(found(batch, tok, pairs))) == bad
    # a row packed prompt + completion + eos and padded at its end: its first columns are no prompt
    packed = torch.tensor([[*e, 40, EOS] + [PAD] * (8 - len(e)) for e in enc])
    batch = {
        "chosen_input_ids": packed,
        "chosen_attention_mask": (packed != PAD).long(),
        "chosen_response_mask": torch.ones(4, 2, dtype=torch.long),
    }
    assert D._prompt_part(batch) is None
    assert K.PROMPT_EOS not in kinds(found(batch, tok, pairs))


# ---------------------------------------------------------------- eos in prompts


def test_prompt_ending_in_eos_names_the_tokenizer_that_appends_it():
    tok = CharTok(append_eos=True)
    enc = [tok(e["prompt"])["input_ids"] for e in EXAMPLES]
    fs = found(left(enc, 8), tok, EXAMPLES)
    assert kinds(fs) == [K.PROMPT_EOS] and fs[0].severity == "error"
    assert fs[0].where.startswith("model.tokenizer") and "add_eos_token" in fs[0].fix
    assert found(left([e[:-1] for e in enc], 8), tok, EXAMPLES) == []  # the same prompts without it


def test_prompt_ending_in_eos_from_a_collator_names_the_collator():
    tok = CharTok()
    enc = [tok(e["prompt"])["input_ids"] + [EOS] for e in EXAMPLES]
    fs = [f for f in found(left(enc, 8), tok, EXAMPLES) if f.kind == K.PROMPT_EOS]
    assert len(fs) == 1 and "c.py:collate" in fs[0].where


def test_literal_eos_text_inside_prompts_names_the_dataset():
    tok = CharTok()
    shots = [{"prompt": f"a:aa{LITERAL}{q}:", "answer": q} for q in ("b", "c", "d", "e")]
    fs = found(
        left([tok(e["prompt"])["input_ids"] for e in shots], 12), tok, shots, data={"dataset": "ds.py:few"}
    )
    assert kinds(fs) == [K.PROMPT_EOS] and fs[0].where == "data.dataset (ds.py:few)"
    assert repr(LITERAL) in fs[0].message and "separator" in fs[0].fix


def test_an_eos_the_chat_template_writes_between_turns_is_not_a_finding_inside_a_prompt():
    tok = CharTok()
    tok.chat_template = "{% for m in messages %}{{ m.content }}" + LITERAL + "{% endfor %}"
    turns = [{"prompt": f"hi{LITERAL}q{i}:", "answer": "x"} for i in range(4)]
    assert found(left([tok(e["prompt"])["input_ids"] for e in turns], 12), tok, turns) == []


def test_whole_sequences_with_a_completion_mask_are_not_prompts():
    tok = CharTok()
    seqs = [
        tok(e["prompt"])["input_ids"] + [40, EOS] for e in EXAMPLES
    ]  # prompt + completion + eos (TRL's layout)
    batch = left(seqs, 8)
    assert kinds(found(batch, tok, EXAMPLES)) == [K.PROMPT_EOS]  # read as prompts, they end in eos
    batch["completion_mask"] = torch.zeros_like(batch["input_ids"])
    assert found(batch, tok, EXAMPLES) == []


def test_pad_equal_eos_padding_is_not_an_eos_in_the_prompt():
    tok = CharTok()
    enc = [tok(e["prompt"])["input_ids"] for e in EXAMPLES]
    assert found(left(enc, 8, pad=EOS), tok, EXAMPLES, pad=EOS) == []


# ---------------------------------------------------------------- eos in response masks


def _pairs_batch(mask_fn, pad=EOS):
    r = torch.tensor([[20, 21, EOS, pad, pad], [22, EOS, pad, pad, pad], [23, 24, 25, 26, EOS]])
    p = torch.tensor([[pad, 30, 31]] * 3)
    pm = torch.tensor([[0, 1, 1]] * 3)
    out = {}
    for side in ("chosen", "rejected"):
        rm = mask_fn(r)
        out[f"{side}_input_ids"] = torch.cat([p, r], 1)
        out[f"{side}_attention_mask"] = torch.cat([pm, rm], 1)
        out[f"{side}_response_mask"] = rm
    return out


def _through_eos(r):
    first = (r == EOS).int().argmax(1, keepdim=True)
    return (torch.arange(r.shape[1]).unsqueeze(0) <= first).long()


def test_response_mask_without_the_ending_eos_is_an_error_with_or_without_pad_equal_eos():
    ok = _pairs_batch(_through_eos)
    assert D.response_eos_findings(ok, tokenizer_info=info(pad=EOS), source="s", where="w", ctx={}) == []
    not_pad = _pairs_batch(lambda r: (r != EOS).long())  # ids != pad with pad == eos
    fs = D.response_eos_findings(not_pad, tokenizer_info=info(pad=EOS), source="s", where="w", ctx={})
    assert kinds(fs) == [K.RESPONSE_EOS_MASKED] * 2 and "pad == eos" in fs[0].message
    labels = _pairs_batch(
        lambda r: (_through_eos(r).bool() & (r != EOS)).long(), pad=PAD
    )  # eos cut from labels
    fs = D.response_eos_findings(labels, tokenizer_info=info(pad=PAD), source="s", where="w", ctx={})
    assert kinds(fs) == [K.RESPONSE_EOS_MASKED] * 2 and "pad == eos" not in fs[0].message


# ---------------------------------------------------------------- DPO pairs the right way round


def _pairs(invert):
    out = []
    for d in "1234567":
        good, bad = d * 4, str((int(d) + 1) % 10) * 4
        c, r = (bad, good) if invert else (good, bad)
        out.append({"prompt": f"{d} 5:", "answer": good, "chosen": c, "rejected": r})
    return out


def test_pairs_the_task_scores_the_wrong_way_round_name_the_dataset():
    data = {"dataset": "ds.py:pairs", "task": "digits"}
    ok = D.pair_order_findings(
        {}, tokenizer_info=info(), examples=_pairs(False), data=data, source="s", where="w", ctx={}
    )
    assert ok == []
    fs = D.pair_order_findings(
        {}, tokenizer_info=info(), examples=_pairs(True), data=data, source="s", where="w", ctx={}
    )
    assert kinds(fs) == [K.REWARD_INVERTED] and fs[0].where == "data.dataset (ds.py:pairs)"
    half = _pairs(False)[:4] + _pairs(True)[4:]  # a dataset the task does not grade: orders at chance
    assert (
        D.pair_order_findings(
            {}, tokenizer_info=info(), examples=half, data=data, source="s", where="w", ctx={}
        )
        == []
    )


def test_a_collator_that_swaps_the_sides_is_named_instead_of_the_dataset():
    tok = CharTok()
    pairs = _pairs(False)
    width = 5
    resp = [(tok(e["rejected"], add_special_tokens=False)["input_ids"] + [EOS])[:width] for e in pairs]
    ids = torch.tensor(resp)
    batch = {
        "chosen_input_ids": torch.cat([torch.full((7, 2), 40), ids], 1),
        "chosen_response_mask": torch.ones_like(ids),
    }
    fs = D.pair_order_findings(
        batch,
        tokenizer_info=info(tok),
        examples=pairs,
        data={},
        source="c.py:pairs",
        where="collator:c.py:pairs",
        ctx={},
    )
    assert kinds(fs) == [K.REWARD_INVERTED] and "c.py:pairs" in fs[0].where and "swapped" in fs[0].fix


# ---------------------------------------------------------------- frozen roles sharing a trained role's tensors


def _models():
    actor = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return {"actor": actor, "reference": copy.deepcopy(actor), "critic": copy.deepcopy(actor)}


def test_a_reference_that_is_or_shares_the_actor_is_an_error_naming_the_setup():
    cfg = {"model": {"setup": {"reference": "s.py:share"}}}
    clean = _models()
    assert D.shared_role_findings(cfg, clean, I.setup_plugin) == []
    same = dict(clean, reference=clean["actor"])
    fs = D.shared_role_findings(cfg, same, I.setup_plugin)
    assert kinds(fs) == [K.FROZEN_ROLE_SHARED] and fs[0].where == "model.setup.reference (s.py:share)"
    assert "deepcopy" in fs[0].fix and "exactly 0" in fs[0].message
    part = copy.deepcopy(clean["actor"])
    part[0] = clean["actor"][0]  # one layer handed over, the rest copied
    fs = D.shared_role_findings({}, dict(clean, reference=part), I.setup_plugin)
    assert kinds(fs) == [K.FROZEN_ROLE_SHARED] and fs[0].observed["shared_tensors"] == 2
    rm = dict(clean, reward=clean["critic"])  # a reward model that is the trained critic
    assert kinds(D.shared_role_findings({}, rm, I.setup_plugin)) == [K.FROZEN_ROLE_SHARED]


# ---------------------------------------------------------------- ids with an extra dimension


def test_ids_with_an_extra_dimension_are_a_shape_error_naming_the_squeeze():
    ids = torch.ones(4, 1, 6, dtype=torch.long)
    fs = boundaries.check_batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        role="actor",
        source="c",
        tokenizer_info=info(),
        rows=4,
    )
    assert kinds(fs) == [K.COLLATOR_SHAPE] and "squeeze(1)" in fs[0].fix
    flat = boundaries.check_batch(
        {
            "input_ids": torch.ones(4, 6, dtype=torch.long),
            "attention_mask": torch.ones(4, 6, dtype=torch.long),
        },
        role="actor",
        source="c",
        tokenizer_info=info(),
        rows=4,
    )
    assert flat == []
