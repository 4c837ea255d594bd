"""The reward's invariants (verlaudit/audit/invariants_reward.py, reward_signal.ConstantWatch): a reward ranked
against the task, a reward model read at a position, a reward that is one value for every response. Planted
variants (not the blind benches' items) are found, their clean controls are not."""

from __future__ import annotations

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import invariants_reward as R
from verlaudit.audit import reward_signal

PAD = 0
RESPONSES = ["1111", "1112", "1122", "1222", "2222", "12", "1", "1111", "x111", "1x1x"]
EXAMPLES = [{"prompt": "1 2:", "answer": "1111"}] * len(RESPONSES)
DATA = {"reward_fn": "r.py:score", "task": "digits"}


def _digits(r):
    return sum(1.0 if a == b else 0.25 for a, b in zip(r, "1111")) / 4


def _agree(rewards):
    """Two steps of the same batch through one pooled `TaskAgreement` (20 responses)."""
    t = R.TaskAgreement()
    out = []
    for step in (0, 1):
        out += t.observe(
            torch.tensor(rewards), responses=RESPONSES, examples=EXAMPLES, data=DATA, ctx={"step": step}
        )
    return out


def test_a_reward_ranked_against_the_task_is_inverted_and_a_shaped_or_unrelated_one_is_not():
    wrong = [
        sum(a != b for a, b in zip(r.ljust(4), "1111")) for r in RESPONSES
    ]  # a distance: lower is better
    fs = _agree([float(w) for w in wrong])
    assert [f.kind for f in fs] == [K.REWARD_INVERTED] and fs[0].where == "data.reward_fn (r.py:score)"
    assert "negate" in fs[0].fix
    assert [f.kind for f in _agree([-_digits(r) + 0.1 * len(r) for r in RESPONSES])] == [K.REWARD_INVERTED]
    assert _agree([_digits(r) - 0.05 * len(r) for r in RESPONSES]) == []  # shaped: still the task's order
    assert _agree([0.3, 0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.4, 0.6, 0.0]) == []  # unrelated: near 0
    assert (
        R.task_agreement_findings(
            torch.tensor([float(w) for w in wrong] * 2),
            responses=RESPONSES * 2,
            examples=EXAMPLES * 2,
            data={"task": "digits"},
            ctx={},
        )
        == []
    )  # the task's own reward: nothing to compare with


def test_an_unrelated_reward_over_many_steps_and_one_small_batch_are_not_inverted():
    g = torch.Generator().manual_seed(0)
    t = R.TaskAgreement()
    for step in range(40):  # 320 responses of a reward that ignores the answer
        found = t.observe(torch.rand(8, generator=g), responses=RESPONSES[:8], examples=EXAMPLES[:8], data=DATA,
                          ctx={"step": step})  # fmt: skip
        assert found == [], step
    wrong = [float(sum(a != b for a, b in zip(r.ljust(4), "1111"))) for r in RESPONSES]
    assert (
        R.task_agreement_findings(
            torch.tensor(wrong), responses=RESPONSES, examples=EXAMPLES, data=DATA, ctx={}
        )
        == []
    )


class Scorer(nn.Module):
    """A per-token score read at a position chosen by ``mode``."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mode = nn.Embedding(50, 1), mode

    def forward(self, input_ids, attention_mask):
        s = self.embed(input_ids)[..., 0]
        if self.mode == "dropout":  # the last attended token, through dropout in training mode
            s = nn.functional.dropout(s, 0.5, training=True)
        if self.mode == "last_column":
            return s[:, -1]
        if self.mode == "mask_sum":  # index = mask.sum() - 1: wrong under left padding
            return s.gather(1, (attention_mask.sum(1, keepdim=True) - 1)).squeeze(1)
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).int().argmax(1)
        return s.gather(1, last.unsqueeze(1)).squeeze(1)  # the last attended token: correct


def _rows():
    # left-padded prompt + right-padded response, as the rollout lays them out
    ids = torch.tensor(
        [[0, 5, 6, 7, 8, 0, 0], [5, 6, 9, 9, 9, 9, 9], [0, 0, 5, 11, 12, 13, 0], [0, 5, 6, 14, 0, 0, 0]]
    )
    mask = (ids != 0).long()
    return ids, mask


def _probe(mode):
    rm = Scorer(mode)
    ids, mask = _rows()
    with torch.no_grad():
        scores = rm(ids, mask)
    return R.position_findings(
        scores,
        input_ids=ids,
        attention_mask=mask,
        rescore=lambda i, m: rm(i, m).detach(),
        pad_token_id=PAD,
        source="model:rm.py:load",
        ctx={"step": 0, "phase": "reward"},
    )


def test_a_reward_model_read_at_a_position_changes_when_the_padding_moves():
    assert _probe("last_token") == []
    assert _probe("dropout") == []  # a random forward is not a position: the nondeterminism check's
    for mode in ("last_column", "mask_sum"):
        fs = _probe(mode)
        assert [f.kind for f in fs] == [K.REWARD_POSITION], mode
        assert fs[0].where == "model.reward_model (rm.py:load)" and "last non-pad" in fs[0].fix


def test_constant_rewards_two_steps_in_a_row_are_a_finding_naming_the_reward_key():
    w = reward_signal.ConstantWatch()
    verl = {"train_files": "t.parquet", "reward_fn_key": "ability", "compute_score": "s.py:f"}
    assert w.observe(torch.zeros(8), step=0, source="function:verl:f", data=verl, model_spec=None) is None
    f = w.observe(torch.zeros(8), step=1, source="function:verl:f", data=verl, model_spec=None)
    assert f is not None and f.kind == K.REWARD_CONSTANT and f.step == 0
    assert f.where == "data.reward_fn_key (ability)" and "data_source" in f.fix
    w = reward_signal.ConstantWatch()  # a reward model: named by its spec
    w.observe(torch.full((8,), 0.37), step=0, source="model:rm", data={}, model_spec="rm.py:load")
    f = w.observe(torch.full((8,), 0.37), step=1, source="model:rm", data={}, model_spec="rm.py:load")
    assert f is not None and f.where == "model.reward_model (rm.py:load)"
    w = reward_signal.ConstantWatch()  # one constant step, then scores that differ: clean
    w.observe(torch.zeros(8), step=0, source="model:rm", data={}, model_spec="rm.py:load")
    assert w.observe(torch.arange(8.0), step=1, source="model:rm", data={}, model_spec="rm.py:load") is None
    assert w.observe(torch.zeros(8), step=2, source="model:rm", data={}, model_spec="rm.py:load") is None
    w = (
        reward_signal.ConstantWatch()
    )  # a rule reward scoring every response 0 (sparse, nothing right yet): clean
    for step in range(4):
        assert w.observe(torch.zeros(8), step=step, source="function:task:copy", data={"task": "copy"},
                         model_spec=None) is None  # fmt: skip


def test_a_hugging_face_classifier_reads_the_last_non_pad_token_in_fp32_and_bf16():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainer.models import score_with_reward_model

    for dtype in (torch.float32, torch.bfloat16):
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=50, num_labels=1, pad_token_id=PAD)  # fmt: skip
        torch.manual_seed(0)
        rm = LlamaForSequenceClassification(cfg).to(dtype).eval()
        ids, mask = _rows()
        with torch.no_grad():
            scores = score_with_reward_model(rm, ids, mask)
        found = R.position_findings(
            scores.float(),
            input_ids=ids,
            attention_mask=mask,
            rescore=lambda i, m, rm=rm: score_with_reward_model(rm, i, m).detach(),
            pad_token_id=PAD,
            source="model:hf",
            ctx={},
        )
        assert found == [], dtype


def test_no_signal_on_verl_data_names_a_reward_fn_key_that_is_not_data_source():
    from pathlib import Path

    from verlaudit.analysis.diagnose.trajectory import no_signal_causes
    from verlaudit.rundir import Finding, RunDir

    def causes(data):
        manifest = {"config": {"algo": {"name": "grpo", "group_size": 4}, "data": data}}
        metrics = [{"step": s, "reward/identical_group_frac": 1.0} for s in range(3)]
        f = Finding(severity="warning", kind=K.NO_SIGNAL, where="reward:function:verl:f", message="m", step=0)
        run = RunDir(
            path=Path("/nonexistent"), manifest=manifest, metrics=metrics, findings=[f], events=[], status={}
        )
        return no_signal_causes(run)

    (c,) = causes({"train_files": "t.parquet", "reward_fn_key": "ability", "compute_score": "s.py:f"})
    assert c.where == "data.reward_fn_key (ability)" and c.fixes[0].suite == "data.reward_fn_key: data_source"
    (c,) = causes({"train_files": "t.parquet", "compute_score": "s.py:f"})  # verl's default key: the scorer
    assert c.where == "reward:function:verl:f" and "compute_score" in c.fixes[0].suite
