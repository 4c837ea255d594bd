"""Tests for trainer/advantages.py: every adv_estimator against hand-worked values (verl's math), plain
per-group reference loops, and invariants (zero-sum groups, row-order invariance, whitening).
All in fp64, so no result depends on the CPU's kernels.

Run: PYTHONPATH=. pytest -q tests/test_advantages.py
"""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import advantages as A
from trainer import losses as L

D = torch.float64
EPS = 1e-6


def t(x):
    return torch.tensor(x, dtype=D)


def outcome(scores, lengths=None, width=3):
    """Token rewards with each score on the last valid token, and the mask."""
    lengths = lengths or [width] * len(scores)
    mask = torch.tensor([[1 if i < n else 0 for i in range(width)] for n in lengths])
    return L.token_level_rewards(t(scores), mask, None, 0.0), mask


def seq(adv, mask):
    """The per-sequence value of an outcome advantage (it is constant over the valid tokens)."""
    return [row[m.bool()][0].item() if m.any() else 0.0 for row, m in zip(adv, mask)]


def test_grpo_hand_values_groups_by_uid_in_any_order_and_of_any_size():
    # uid 7: scores 1, 0 -> mean 0.5, Bessel std sqrt(0.5) -> +-0.5 / (0.70711 + 1e-6)
    # uid 3: scores 2, 2 -> 0 / (0 + 1e-6) = 0;  uid 9: a single response -> 5 / (1 + 1e-6) (verl's mean 0, std 1)
    r, m = outcome([1.0, 2.0, 0.0, 2.0, 5.0])
    index = torch.tensor([7, 3, 7, 3, 9])
    adv, ret = A.grpo(r, m, index)
    s = 0.5 / (math.sqrt(0.5) + EPS)
    assert seq(adv, m) == pytest.approx([s, 0.0, -s, 0.0, 5 / (1 + EPS)], rel=1e-12)
    assert torch.equal(adv, ret) and torch.equal(adv, adv * m)
    # Dr.GRPO (norm_adv_by_std_in_grpo: false): s - group mean; the single response keeps 5
    dr, _ = A.grpo(r, m, index, norm_by_std=False)
    assert seq(dr, m) == pytest.approx([0.5, 0.0, -0.5, 0.0, 5.0], rel=1e-12)


def test_rloo_opo_gpg_passk_hand_values():
    # RLOO, group [1, 0, 2]: s minus the mean of the other two: 1 - 1 = 0, 0 - 1.5, 2 - 0.5; a single 4 stays 4
    r, m = outcome([1.0, 0.0, 2.0, 4.0])
    adv, _ = A.rloo(r, m, torch.tensor([0, 0, 0, 1]))
    assert seq(adv, m) == pytest.approx([0.0, -1.5, 1.5, 4.0], rel=1e-12)
    # OPO, group [1, 0] with lengths [1, 3]: baseline (1*1 + 3*0) / 4 = 0.25 -> 0.75, -0.25
    r, m = outcome([1.0, 0.0], lengths=[1, 3])
    adv, _ = A.opo(r, m, torch.tensor([0, 0]))
    assert seq(adv, m) == pytest.approx([0.75, -0.25], rel=1e-12)
    # GPG, groups [1, 0] and [0.5, 0.5]: alpha = 4 rows / 3 non-zero scores; alpha (s - mean) = +-2/3, 0, 0
    r, m = outcome([1.0, 0.0, 0.5, 0.5])
    adv, _ = A.gpg(r, m, torch.tensor([0, 0, 1, 1]))
    assert seq(adv, m) == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0], rel=1e-12)
    # pass@k, group [1, 3, 2]: only the best gets best - second = 1, over std([1, 3, 2]) = 1 (+ eps)
    r, m = outcome([1.0, 3.0, 2.0])
    adv, _ = A.grpo_passk(r, m, torch.tensor([0, 0, 0]))
    assert seq(adv, m) == pytest.approx([0.0, 1 / (1 + EPS), 0.0], rel=1e-12)
    assert seq(A.grpo_passk(r, m, torch.tensor([0, 0, 0]), norm_by_std=False)[0], m) == pytest.approx(
        [0, 1, 0]
    )
    with pytest.raises(ValueError, match="grpo_passk: needs at least 2"):
        A.grpo_passk(r, m, torch.tensor([0, 0, 1]))


def test_reinforce_plus_plus_hand_values():
    # one row, rewards [0, 0, 1, (pad) 0], gamma 0.5: reward-to-go [0.25, 0.5, 1, 0]
    # whitened over the 3 valid tokens: mean 0.58333, unbiased std 0.381881 -> [-0.872872, -0.218218, 1.091089, 0]
    r = t([[0.0, 0.0, 1.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    adv, ret = A.reinforce_plus_plus(r, m, gamma=0.5)
    assert ret.tolist()[0] == pytest.approx([0.25, 0.5, 1.0, 0.0], rel=1e-12)
    mu, sd = statistics.mean([0.25, 0.5, 1.0]), statistics.stdev([0.25, 0.5, 1.0])
    assert adv.tolist()[0] == pytest.approx(
        [(x - mu) / math.sqrt(sd**2 + 1e-8) for x in (0.25, 0.5, 1.0)] + [0.0]
    )
    assert adv.tolist()[0][:3] == pytest.approx([-0.872872, -0.218218, 1.091089], abs=1e-6)


def test_reinforce_plus_plus_baseline_hand_values():
    # group [1, 0] -> s - mean = 0.5, -0.5; single 3 -> 3 (mean 0). Lengths 1, 2, 1 put the values
    # 0.5 | -0.5 -0.5 | 3 on 4 tokens, whitened over them: mean 0.625, unbiased std 1.6520
    r, m = outcome([1.0, 0.0, 3.0], lengths=[1, 2, 1], width=2)
    adv, ret = A.reinforce_plus_plus_baseline(r, m, torch.tensor([0, 0, 1]))
    tokens = [0.5, -0.5, -0.5, 3.0]
    mu, sd = statistics.mean(tokens), statistics.stdev(tokens)
    w = [(x - mu) / math.sqrt(sd**2 + 1e-8) for x in tokens]
    assert adv.flatten().tolist() == pytest.approx([w[0], 0.0, w[1], w[2], w[3], 0.0], rel=1e-9)
    assert torch.equal(adv, ret)


def test_remax_hand_values():
    # rewards [0, 1, (pad) 0] (score 1 on the last valid token), greedy baseline 0.25:
    # reward-to-go [1, 1, 0]; advantages [0.75, 0.75, 0]; returns are the reward-to-go
    r, m = outcome([1.0], lengths=[2])
    adv, ret = A.remax(r, m, t([0.25]))
    assert adv[0].tolist() == pytest.approx([0.75, 0.75, 0.0]) and ret[0].tolist() == pytest.approx(
        [1.0, 1.0, 0.0]
    )


def test_gae_is_whitened_and_returns_are_not():
    r, v, m = t([[0.0, 1.0], [0.0, 0.5]]), t([[0.5, 0.25], [0.1, 0.2]]), torch.ones(2, 2)
    raw, returns = L.compute_gae(r, v, m, 1.0, 0.5)
    adv, ret = A.gae(r, v, m, 1.0, 0.5)
    assert torch.allclose(adv, L.masked_whiten(raw, m)) and torch.equal(ret, returns)
    assert L.masked_mean(adv, m).item() == pytest.approx(0.0, abs=1e-12)


def test_compute_advantages_dispatches_and_names_what_is_missing():
    r, m = outcome([1.0, 0.0])
    index = torch.tensor([0, 0])
    for name in A.ADV_ESTIMATORS:
        kwargs = {"index": index, "values": torch.zeros_like(r), "reward_baselines": t([0.0, 0.0])}
        kwargs.update(old_logprobs=torch.zeros_like(r), sum_pi_squared=torch.ones_like(r))
        adv, ret = A.compute_advantages(name, r, m, **kwargs)
        assert adv.shape == ret.shape == r.shape, name
    with pytest.raises(ValueError, match="remax: missing reward_baselines"):
        A.compute_advantages("remax", r, m)
    with pytest.raises(ValueError, match="rloo: needs the group index"):
        A.compute_advantages("rloo", r, m)
    with pytest.raises(ValueError, match="adv_estimator 'ppo'"):
        A.compute_advantages("ppo", r, m, index=index)


groups = st.lists(st.lists(st.floats(-3, 3), min_size=1, max_size=5), min_size=1, max_size=4)


def _flatten(gs):
    scores = [s for g in gs for s in g]
    index = torch.tensor([i for i, g in enumerate(gs) for _ in g])
    return scores, index


@settings(max_examples=80, deadline=None)
@given(groups)
def test_group_estimators_match_a_per_group_loop_and_sum_to_zero(gs):
    scores, index = _flatten(gs)
    r, m = outcome(scores)
    got = {
        "grpo": seq(A.grpo(r, m, index)[0], m),
        "drgrpo": seq(A.grpo(r, m, index, norm_by_std=False)[0], m),
        "rloo": seq(A.rloo(r, m, index)[0], m),
    }
    want = {"grpo": [], "drgrpo": [], "rloo": []}
    for g in gs:  # plain loop, verl's rules: a group of one has mean 0 and std 1
        n = len(g)
        mean = sum(g) / n if n > 1 else 0.0
        std = statistics.stdev(g) if n > 1 else 1.0
        want["grpo"] += [(s - mean) / (std + EPS) for s in g]
        want["drgrpo"] += [s - mean for s in g]
        want["rloo"] += [s - (sum(g) - s) / (n - 1) if n > 1 else s for s in g]
    for name in got:
        assert got[name] == pytest.approx(want[name], abs=1e-9), name
    start = 0
    for g in gs:
        if len(g) > 1:
            for name in got:
                assert sum(got[name][start : start + len(g)]) == pytest.approx(0.0, abs=1e-8), name
        start += len(g)


@settings(max_examples=40, deadline=None)
@given(groups, st.randoms(use_true_random=False))
def test_group_estimators_do_not_depend_on_row_order(gs, rnd):
    scores, index = _flatten(gs)
    perm = list(range(len(scores)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    r, m = outcome(scores)
    for fn in (A.grpo, A.rloo, A.opo, A.gpg, A.reinforce_plus_plus_baseline):
        adv, _ = fn(r, m, index)
        shuffled, _ = fn(r[p], m[p], index[p])
        assert torch.allclose(shuffled, adv[p], atol=1e-12), fn.__name__


def test_group_index_matches_the_rollouts_repeat_interleave():
    assert A.group_index(6, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_kl_controller_fixed_and_adaptive():
    fixed = A.KLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    # adaptive, target 0.1, horizon 100: kl 0.2 -> error clip(0.2/0.1 - 1, -0.2, 0.2) = 0.2 -> x (1 + 0.2 * 10/100)
    ada = A.KLController(0.1, "adaptive", target=0.1, horizon=100)
    ada.update(0.2, 10)
    assert ada.value == pytest.approx(0.102)
    ada.update(0.05, 10)  # error clip(-0.5) = -0.2 -> x 0.98
    assert ada.value == pytest.approx(0.102 * 0.98)


def test_reward_kl_is_the_batch_mean_of_sequence_means():
    # sequence means (1 + 2)/2 = 1.5 and 3/1 = 3 -> 2.25
    kl, m = t([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert A.reward_kl(kl, m) == pytest.approx(2.25)
