"""The run's invariants (verlaudit/audit/invariants.py): each planted fault is found, its clean control is not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.data import TRUNCATION_KEY, truncation_report
from verlaudit import kinds as K
from verlaudit.audit import invariants as I

PAD, EOS = 0, 2
INFO = {"pad_token_id": PAD, "eos_token_id": EOS, "vocab_size": 50, "padding_side": "left"}


def _left(rows, length, pad=PAD):
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = torch.tensor(r)
        mask[i, length - len(r) :] = 1
    return ids, mask


def _kinds(found):
    return [f.kind for f in found]


# ---------------------------------------------------------------- mask vs padding


def test_mask_covering_left_padding_is_an_error():
    ids, mask = _left([[5, 6, 7], [8, 9]], 6)
    assert (
        I.batch_findings(
            {"input_ids": ids, "attention_mask": mask}, role="actor", source="s", tokenizer_info=INFO
        )
        == []
    )
    found = I.batch_findings(
        {"input_ids": ids, "attention_mask": torch.ones_like(mask)},
        role="actor",
        source="s",
        tokenizer_info=INFO,
    )
    assert _kinds(found) == [K.MASK_COVERS_PADDING]
    assert found[0].severity == "error" and found[0].observed["pad_tokens_attended"] == 3 + 4


def test_pad_equal_eos_keeps_the_eos_that_ends_a_response():
    info = dict(INFO, eos_token_id=PAD)
    # right-padded responses ending in eos (== pad) with mask 1 on that one eos: clean
    ids = torch.tensor([[5, 6, PAD, PAD, PAD], [5, 6, 7, 8, PAD]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert (
        I.mask_findings({"input_ids": ids, "attention_mask": mask}, tokenizer_info=info, where="c", ctx={})
        == []
    )
    found = I.mask_findings(
        {"input_ids": ids, "attention_mask": torch.ones_like(mask)}, tokenizer_info=info, where="c", ctx={}
    )
    assert _kinds(found) == [K.MASK_COVERS_PADDING] and found[0].observed["pad_tokens_attended"] == 2


# ---------------------------------------------------------------- preference pairs


def _pairs(chosen, rejected, r_len=4):
    p_ids, p_mask = _left([[5, 6]] * len(chosen), 3)
    out = {}
    for side, rows in (("chosen", chosen), ("rejected", rejected)):
        r = torch.full((len(rows), r_len), PAD, dtype=torch.long)
        m = torch.zeros_like(r)
        for i, row in enumerate(rows):
            r[i, : len(row)] = torch.tensor(row)
            m[i, : len(row)] = 1
        out[f"{side}_input_ids"] = torch.cat([p_ids, r], 1)
        out[f"{side}_attention_mask"] = torch.cat([p_mask, m], 1)
        out[f"{side}_response_mask"] = m
    return out


def test_identical_pairs_found_and_distinct_pairs_clean():
    clean = _pairs([[7, 8, EOS], [9, EOS]], [[7, 9, EOS], [10, EOS]])
    assert I.pair_findings(clean, tokenizer_info=INFO, where="c", ctx={}) == []
    # the second pair differs only by an eos the other side lost to the cut: still the same response
    same = _pairs([[7, 8, EOS], [9, 10, 11, 12]], [[7, 9, EOS], [9, 10, 11, 12]])
    found = I.pair_findings(same, tokenizer_info=INFO, where="c", ctx={})
    assert _kinds(found) == [K.IDENTICAL_PAIRS] and found[0].observed["identical_pairs"] == 1
    assert found[0].severity == "error"  # half the batch
    all_same = _pairs([[7, 8, EOS]] * 4, [[7, 8, EOS]] * 3 + [[7, EOS]])
    assert (
        I.pair_findings(all_same, tokenizer_info=INFO, where="c", ctx={})[0].observed["identical_pairs"] == 3
    )


# ---------------------------------------------------------------- truncation


def test_truncation_report_and_findings():
    rows = [[1, 2, 3, 9, 9], [4, 5, 6, 9, 9], [7, 9]]
    rep = truncation_report(rows, 2)
    summary = {
        "rows": 3,
        "cut": 2,
        "distinct_before": 3,
        "distinct_after": 2,
        "longest": 5,
        "prompt_length": 2,
    }
    assert I.truncation_summary(rep) == summary
    assert I.truncation_summary(rep.float()) == summary  # a user's collator that casts every field
    found = I.truncation_findings({TRUNCATION_KEY: rep}, where="c", ctx={})
    assert _kinds(found) == [K.PROMPT_TRUNCATION] and found[0].severity == "warning"
    assert "data.prompt_length to 5" in found[0].fix
    rep_ok = truncation_report(rows, 4)  # cut, but all still distinct: an info only
    assert [f.severity for f in I.truncation_findings({TRUNCATION_KEY: rep_ok}, where="c", ctx={})] == [
        "info"
    ]
    assert I.truncation_findings({TRUNCATION_KEY: truncation_report(rows, 5)}, where="c", ctx={}) == []


def test_builtin_collator_reports_its_cut():
    from trainer.data import PromptCollator

    class Tok:
        pad_token_id = PAD

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(c) + 3 for c in text]}

    batch = PromptCollator(Tok(), 2)([{"prompt": "1234"}, {"prompt": "5634"}, {"prompt": "9"}])
    assert batch[TRUNCATION_KEY][:, 2].tolist() == [0, 0, 2] and batch[TRUNCATION_KEY][:, 0].tolist() == [
        4,
        4,
        1,
    ]
    found = I.batch_findings(batch, role="actor", source="builtin:prompt", tokenizer_info=INFO)
    assert _kinds(found) == [K.PROMPT_TRUNCATION]


# ---------------------------------------------------------------- setup invariants


def _llama(**kw):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return LlamaForCausalLM(LlamaConfig(**(cfg | kw)))


def _roles(actor, ref_dtype=torch.float32):
    actor.train()
    ref = copy.deepcopy(actor).to(ref_dtype).eval()
    return {"actor": actor, "reference": ref}


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clean_models_have_no_setup_finding(ref_dtype):
    assert I.setup_findings({}, _roles(_llama(), ref_dtype), ("actor", "critic")) == []
    tied = _llama(tie_word_embeddings=True)
    assert I.setup_findings({}, _roles(tied, ref_dtype), ("actor",)) == []


def test_reference_changed_by_an_actor_only_setup_names_the_plugin():
    models = _roles(_llama(), torch.bfloat16)
    with torch.no_grad():
        models["actor"].model.layers[0].mlp.down_proj.weight.mul_(1.5)
    config = {"model": {"setup": {"actor": "mine.py:scale"}}}
    (f,) = I.setup_findings(config, models, ("actor",))
    assert f.kind == K.REFERENCE_NOT_ACTOR and f.severity == "error"
    assert "model.setup.actor" in f.message and f.where == "model.layers.0.mlp.down_proj.weight"
    (g,) = I.setup_findings({"model": {"setup": {"reference": "other.py:load"}}}, models, ("actor",))
    assert g.severity == "warning" and "on purpose" in g.message


def test_dropout_in_a_training_role():
    cfg_drop = _llama(attention_dropout=0.1)
    (f,) = I.setup_findings({}, _roles(cfg_drop), ("actor",))
    assert f.kind == K.DROPOUT_ACTIVE and "attention_dropout: 0.0" in f.fix
    actor = _llama()
    actor.model.layers[0].mlp.act_fn = nn.Sequential(nn.SiLU(), nn.Dropout(0.2))
    models = _roles(actor)
    found = I.dropout_findings({"model": {"setup": "mine.py:add"}}, models, ("actor",))
    assert _kinds(found) == [K.DROPOUT_ACTIVE] and "model.setup" in found[0].fix
    actor.eval()  # not training: no dropout in its forward
    assert I.dropout_findings({}, models, ("actor",)) == []


def test_dropout_set_on_the_attention_modules_is_seen():
    # Hugging Face attention applies self.attention_dropout functionally when training: no Dropout module
    actor = _llama()
    for m in actor.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    (f,) = I.dropout_findings({}, _roles(actor), ("actor",))
    assert f.where == "model.layers.0.self_attn.attention_dropout" and "p=0.3" in f.message


def test_a_reward_model_that_scores_with_dropout():
    rm = _llama()
    for m in rm.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    config = {"model": {"setup": {"reward": "setup.py:mc_dropout"}}}
    rm.train()
    (f,) = I.dropout_findings(config, {**_roles(_llama()), "reward": rm}, ("actor",))
    assert f.kind == K.DROPOUT_ACTIVE and f.role == "reward" and "model.setup.reward" in f.message
    assert "eval" in f.fix and "different score" in f.message
    rm.eval()  # eval mode: the dropout attributes are not applied, the config's fields neither
    assert I.dropout_findings(config, {**_roles(_llama()), "reward": rm}, ("actor",)) == []
    scored = _llama(attention_dropout=0.1).eval()  # a config with dropout, scoring in eval mode: clean
    assert I.dropout_findings({}, {**_roles(_llama()), "reward": scored}, ("actor",)) == []


class _Noise(nn.Module):
    def forward(self, x):
        return x + 0.5 * torch.randn_like(x)


def test_a_random_forward_no_dropout_names_is_found():
    actor = _llama()
    actor.model.layers[0].mlp.act_fn = nn.Sequential(nn.SiLU(), _Noise())
    models = _roles(actor)
    state = torch.random.get_rng_state()
    (f,) = I.setup_findings({"model": {"setup": {"actor": "mine.py:noise"}}}, models, ("actor",))
    assert torch.equal(state, torch.random.get_rng_state())  # the probe restored the random state
    assert f.kind == K.NONDETERMINISTIC_FORWARD and f.role == "actor" and "model.setup.actor" in f.message
    assert f.observed["relative_max_diff"] > I.NONDETERMINISTIC
    # a deterministic forward repeats bit for bit; a dropout the check names is not reported twice
    assert I.forward_spread(_llama().train()) == 0.0
    drop = _roles(_llama(attention_dropout=0.1))
    assert _kinds(I.setup_findings({}, drop, ("actor",))) == [K.DROPOUT_ACTIVE]


def test_tie_broken_by_a_setup():
    model = _llama(tie_word_embeddings=True)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    found = I.tied_findings({"model": {"setup": "mine.py:grow"}}, {"actor": model})
    assert _kinds(found) == [K.TIED_WEIGHTS_BROKEN] and "model.setup" in found[0].message
    model.tie_weights()
    assert I.tied_findings({}, {"actor": model}) == []


# ---------------------------------------------------------------- whole runs: planted faults, clean controls

NEW_KINDS = {
    K.MASK_COVERS_PADDING,
    K.NONDETERMINISTIC_FORWARD,
    K.CLIP_SATURATED,
    K.STALE_UPDATES,
    K.KL_DOMINATES,
    K.NO_GROUP_BASELINE,
    K.IDENTICAL_PAIRS,
    K.PROMPT_TRUNCATION,
    K.REFERENCE_NOT_ACTOR,
    K.DROPOUT_ACTIVE,
    K.TIED_WEIGHTS_BROKEN,
    K.WEIGHT_GROWTH,
}


def full_mask_collator(examples, tokenizer):
    """Planted: the builtin prompt batch with a mask of ones (it covers the left padding)."""
    from trainer.data import PromptCollator

    batch = PromptCollator(tokenizer, 8)(examples)
    return {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["attention_mask"])}


def same_pairs_collator(examples, tokenizer):
    """Planted: the rejected side read from the chosen field."""
    from trainer.data import PairCollator

    return PairCollator(tokenizer, 8, 4)([dict(ex, rejected=ex["chosen"]) for ex in examples])


def scale_actor(model, role, tokenizer):
    """Planted: a setup that changes the actor's weights after the reference was copied from it."""
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)


def _train(extra):
    from tests.test_audit_faults import run

    a = run(extra)
    assert a.failure is None
    return a


def _problems(a):
    return sorted({f.kind for f in a.findings.all() if f.severity != "info" and f.kind in NEW_KINDS})


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dpo"])
def test_clean_runs_have_no_invariant_warning(algo):
    a = _train({"steps": 2, "algo": {"name": algo, "use_kl_in_reward": algo != "dpo"}})
    assert _problems(a) == []


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"data": {"collator": "tests.test_invariants:full_mask_collator"}}, K.MASK_COVERS_PADDING),
        ({"data": {"prompt_length": 1}, "algo": {"batch_size": 4}}, K.PROMPT_TRUNCATION),
        ({"model": {"overrides": {"attention_dropout": 0.1}}}, K.DROPOUT_ACTIVE),
        ({"model": {"setup": {"actor": "tests.test_invariants:scale_actor"}}}, K.REFERENCE_NOT_ACTOR),
        (
            {
                "algo": {"name": "dpo", "use_kl_in_reward": False},
                "data": {"collator": "tests.test_invariants:same_pairs_collator"},
            },
            K.IDENTICAL_PAIRS,
        ),
    ],
    ids=["mask", "truncation", "dropout", "reference", "pairs"],
)
def test_planted_faults_in_a_run(extra, kind):
    a = _train({"steps": 1, **extra})
    assert kind in _problems(a), [(f.kind, f.severity) for f in a.findings.all()]


def test_identical_pairs_name_who_made_them():
    same = _pairs([[7, 8, 9, 10]] * 2, [[7, 8, 9, 10]] * 2)
    data = {"dataset": "d.py:pairs", "response_length": 4}
    equal_text = [{"chosen": "abcd", "rejected": "abcd"}] * 2
    (f,) = I.pair_findings(same, tokenizer_info=INFO, where="collator:builtin:pairs", ctx={},
                           examples=equal_text, data=data)  # fmt: skip
    assert f.where == "data.dataset (d.py:pairs)" and "chosen == rejected" in f.message
    cut_text = [{"chosen": "abcdX", "rejected": "abcdY"}] * 2  # differ past the 4 tokens both keep
    (f,) = I.pair_findings(same, tokenizer_info=INFO, where="collator:builtin:pairs", ctx={},
                           examples=cut_text, data=data)  # fmt: skip
    assert f.where == "data.response_length" and "response_length 4" in f.message and "raise" in f.fix
    (f,) = I.pair_findings(same, tokenizer_info=INFO, where="collator:c.py:f", ctx={},
                           examples=cut_text, data=data)  # fmt: skip
    assert f.where == "collator:c.py:f.chosen_input_ids"  # a user's collator made them the same


def test_empty_chosen_side_names_the_dataset():
    empty = _pairs([[EOS], [EOS]], [[7, 8, EOS], [9, EOS]])
    data = {"dataset": "d.py:pairs"}
    blank = [{"chosen": "", "rejected": "77"}, {"chosen": "", "rejected": "9"}]
    (f,) = I.pair_findings(empty, tokenizer_info=INFO, where="collator:builtin:pairs", ctx={},
                           examples=blank, data=data)  # fmt: skip
    assert f.kind == K.EMPTY_RESPONSES and f.severity == "error" and f.where == "data.dataset (d.py:pairs)"
    assert "chosen response is empty" in f.message and "'chosen'" in f.fix
    one = _pairs([[EOS], [8, EOS], [9, EOS]], [[7, EOS], [9, EOS], [10, EOS]])  # one short answer: fine
    assert I.pair_findings(one, tokenizer_info=INFO, where="c", ctx={}) == []


def test_a_packed_pair_whose_response_mask_points_at_padding_is_misaligned():
    # prompt + completion packed at the row's start and padded at its end: the last R columns are padding
    b, width = 2, 7  # R = 3 response columns
    batch = {}
    for side, tok in (("chosen", 7), ("rejected", 8)):
        ids = torch.full((b, width), PAD, dtype=torch.long)
        ids[:, :4] = torch.tensor([5, 6, tok, EOS])
        attn = (ids != PAD).long()
        resp = torch.tensor([[1, 1, 0]] * b)
        batch.update(
            {f"{side}_input_ids": ids, f"{side}_attention_mask": attn, f"{side}_response_mask": resp}
        )
    found = [f for f in I.pair_findings(batch, tokenizer_info=INFO, where="collator:c.py:pack", ctx={})
             if f.kind == K.EMPTY_RESPONSES]  # fmt: skip
    assert len(found) == 2 and all("padding" in f.message and "right-pad" in f.fix for f in found)
    assert found[0].where == "collator:c.py:pack.chosen_input_ids"
