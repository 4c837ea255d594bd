"""Version-aware semantics (`trainer.verl_versions`): ``algo.verl_version`` picks, for every key whose meaning
changed between verl's release lines, the form of that line -- REINFORCE++ through masked tokens,
``seq-mean-token-sum-norm``'s divisor, the IS metrics -- each against hand-worked values and a plain loop;
the README lists every change with its version; from-verl writes ``--verl-version``.

Run: PYTHONPATH=. pytest -q tests/test_verl_versions.py
"""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import advantages as A
from trainer import losses as L
from trainer import verl_versions as VV
from trainer.config import AlgoConfig, TrainConfig
from trainer.mismatch import is_weights

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_key_defaults_to_the_latest_release_and_refuses_unknown_lines():
    assert AlgoConfig().verl_version == VV.LATEST_RELEASE == "0.9"
    assert AlgoConfig().follows("reinforce_carries_holes")  # verl 0.9.0 has #7300 (commit 8a1bf6d5b)
    assert not AlgoConfig(verl_version="0.8").follows("reinforce_carries_holes")
    # b8d91ef8d (2026-02-26) shipped first in v0.7.1, a branch off main; v0.7.0 has the older form
    assert not AlgoConfig(verl_version="0.7").follows("sum_norm_per_sequence")
    assert AlgoConfig(verl_version="0.7.1").follows("sum_norm_per_sequence")
    assert AlgoConfig(verl_version="0.8").follows("sum_norm_per_sequence")
    assert AlgoConfig(verl_version="0.8").follows("is_metrics_truncated")
    assert not AlgoConfig(verl_version="0.8").follows("is_seq_fractions_raw")
    assert AlgoConfig(verl_version="0.9.1").follows("is_seq_fractions_raw")
    with pytest.raises(ValueError, match=r"^algo.verl_version: '1.5': no verl line we know"):
        TrainConfig.from_dict({"algo": {"verl_version": "1.5"}})
    with pytest.raises(ValueError, match="algo.verl_version: 'main' is not a verl version"):
        TrainConfig.from_dict({"algo": {"verl_version": "main"}})
    assert TrainConfig.from_dict({"algo": {"verl_version": "0.8"}}).to_dict()["algo"]["verl_version"] == "0.8"


# ---------------------------------------------------------------- REINFORCE++ through masked tokens


def _reference_returns(rewards, mask, gamma, carry):
    """A plain loop over one row: the reward-to-go; a masked token either passes the later return on
    (carry) or restarts it (reset)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        if carry:
            if mask[t]:
                running = rewards[t] + gamma * running
            out[t] = running if mask[t] else 0.0
        else:
            running = rewards[t] + gamma * running
            out[t] = running
            running = running * mask[t]
    return out


def test_reinforce_returns_through_a_hole_hand_worked():
    # [action, action, observation, observation, action, action], outcome 1 on the last token
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    m = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    _, carried = A.reinforce_plus_plus(r, m, gamma=1.0, carry_holes=True)
    _, reset = A.reinforce_plus_plus(r, m, gamma=1.0, carry_holes=False)
    assert carried.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]  # every action sees the outcome
    assert reset.tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]]  # verl before 0.9: lost before the hole
    # gamma 0.5: the hole neither adds nor discounts; t4 = 0.5, t1 = 0.25, t0 = 0.125
    _, carried = A.reinforce_plus_plus(r, m, gamma=0.5, carry_holes=True)
    assert carried.tolist() == [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.floats(0.0, 1.0), st.booleans(), st.data())
def test_reinforce_returns_match_a_plain_loop(b, r_len, gamma, carry, data):
    rewards = data.draw(
        st.lists(st.lists(st.floats(-3, 3), min_size=r_len, max_size=r_len), min_size=b, max_size=b)
    )
    mask = data.draw(
        st.lists(st.lists(st.booleans(), min_size=r_len, max_size=r_len), min_size=b, max_size=b)
    )
    r = torch.tensor(rewards, dtype=torch.float64)
    m = torch.tensor(mask, dtype=torch.float64)
    _, returns = A.reinforce_plus_plus(r, m, gamma=gamma, carry_holes=carry)
    for i in range(b):
        ref = _reference_returns(rewards[i], [float(x) for x in mask[i]], gamma, carry)
        got = returns[i].tolist()
        for t in range(r_len):
            if mask[i][t] or carry:
                assert math.isclose(got[t], ref[t], rel_tol=1e-12, abs_tol=1e-12), (i, t, got, ref)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 8), st.floats(0.1, 1.0), st.data())
def test_carried_reinforce_returns_equal_our_gae_with_no_critic(b, r_len, gamma, data):
    # GAE with zero values and lambda 1 is the reward-to-go and carries through holes: with the carry the
    # two estimators agree on every valid token (they did not, before)
    rewards = torch.tensor(
        data.draw(
            st.lists(st.lists(st.floats(-3, 3), min_size=r_len, max_size=r_len), min_size=b, max_size=b)
        ),
        dtype=torch.float64,
    )
    mask = torch.tensor(
        data.draw(st.lists(st.lists(st.booleans(), min_size=r_len, max_size=r_len), min_size=b, max_size=b)),
        dtype=torch.float64,
    )
    rewards = rewards * mask  # rewards sit on valid tokens (the score on the last, the KL on each)
    gae_adv, _ = L.compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    _, returns = A.reinforce_plus_plus(rewards, mask, gamma=gamma, carry_holes=True)
    assert torch.allclose(gae_adv * mask, returns * mask, atol=1e-12)


def test_the_recipe_passes_the_version_to_the_estimator():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    for version, first in (("0.8", 0.0), ("0.9", 1.0)):
        carry = AlgoConfig(name="grpo", verl_version=version).follows("reinforce_carries_holes")
        _, returns = A.compute_advantages("reinforce_plus_plus", r, m, carry_holes=carry)
        assert float(returns[0, 0]) == first, version


# ---------------------------------------------------------------- seq-mean-token-sum-norm's divisor


def test_sum_norm_divides_by_the_sequences_from_verl_0_7_1():
    # two sequences, token losses [1, 2, 3] and [4, 0, 0] (one valid token), horizon 3:
    # verl 0.7.1 on: (6 + 4) / 2 / 3 = 5/3; before: (6 + 4) / 3 = 10/3, larger by the sequence count
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    new = L.agg_loss(loss, mask, "seq-mean-token-sum-norm", L.AggNorm.of(mask))
    old = L.agg_loss(loss, mask, "seq-mean-token-sum-norm", L.AggNorm.of(mask, per_sequence=False))
    assert math.isclose(float(new), 5 / 3) and math.isclose(float(old), 10 / 3)
    # the other modes do not depend on it
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert float(L.agg_loss(loss, mask, mode, L.AggNorm.of(mask, per_sequence=False))) == float(
            L.agg_loss(loss, mask, mode, L.AggNorm.of(mask))
        )


# ---------------------------------------------------------------- the IS metrics


def test_is_metrics_are_of_the_truncated_weights_from_verl_0_8():
    # token ratios 4, 1, 0.25 (log-ratios ln 4, 0, -ln 4), threshold 2: truncated 2, 1, 0.25
    log_ratio = torch.tensor([[math.log(4.0), 0.0, -math.log(4.0)]])
    mask = torch.ones(1, 3)
    w_old, old = is_weights(log_ratio, mask, "token", 2.0)
    w_new, new = is_weights(log_ratio, mask, "token", 2.0, truncated_metrics=True)
    assert torch.equal(w_old, w_new)  # the weights the loss uses do not change
    assert math.isclose(old["rollout_is_mean"], 5.25 / 3, rel_tol=1e-6)
    assert math.isclose(new["rollout_is_mean"], 3.25 / 3, rel_tol=1e-6)
    assert math.isclose(old["rollout_is_max"], 4.0, rel_tol=1e-6) and math.isclose(new["rollout_is_max"], 2.0)
    # the fractions outside [1/C, C] stay of the raw weights: one high, one low
    for m in (old, new):
        assert math.isclose(m["rollout_is_ratio_fraction_high"], 1 / 3, rel_tol=1e-6)
        assert math.isclose(m["rollout_is_ratio_fraction_low"], 1 / 3, rel_tol=1e-6)


# ---------------------------------------------------------------- documented where users look


def test_the_readme_lists_every_changed_key_with_its_version():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Compatibility with verl and TRL", 1)[1].split("\n## ", 1)[0]
    assert "`verl_version`" in section
    for change in VV.CHANGES.values():
        rows = [
            line for line in section.splitlines() if line.startswith("|") and change.key.split(" ")[0] in line
        ]
        assert any(f"verl {change.since}" in r for r in rows), change.key


def test_from_verl_writes_the_version_it_was_given(tmp_path):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    script = tmp_path / "job.sh"
    script.write_text("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo\n")
    launch = read_launch(str(script))
    assert map_launch(launch, target="cpu", verl_version="0.8").train["algo"]["verl_version"] == "0.8"
    assert "verl_version" not in map_launch(launch, target="cpu").train.get("algo", {})
    with pytest.raises(ValueError, match="--verl-version: '2.0'"):
        map_launch(launch, target="cpu", verl_version="2.0")
