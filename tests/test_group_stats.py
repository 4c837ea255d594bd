"""Our own statistics in full precision: group means and stds (GRPO, RLOO, OPO, pass@k, GPG, REINFORCE++
baseline, GDPO), whitening and masked means. A group whose responses all get the same reward has advantage
exactly 0, and every mean and std is the correctly rounded fp32 value of the exact one (up to one ulp),
at every group size up to 1024 and for rewards that are not dyadic fractions (0.7, 7.3: an fp32 sum of
them rounds at every step, which is what the sequential fp32 accumulation lost).

Run: PYTHONPATH=. pytest -q tests/test_group_stats.py
"""

import math
from fractions import Fraction

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainer import advantages as A
from trainer import losses as L

SIZES = st.integers(1, 1024)
# non-dyadic rewards: decimals and arbitrary fp32 values, both signs, magnitudes up to 1e3
REWARDS = st.one_of(
    st.sampled_from([0.7, 7.3, 0.1, -2.9, 1 / 3, 123.456]),
    st.floats(-1e3, 1e3, allow_nan=False, width=32),
)
GROUPED = ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline", "gdpo")


def _ulp32(x: float) -> float:
    return float(np.spacing(np.float32(abs(x)))) if x != 0 else float(np.finfo(np.float32).tiny)


def _exact_mean_std(values: list[float]) -> tuple[Fraction, float]:
    """Exact mean (a fraction of the fp32 inputs) and the std from the exact variance."""
    xs = [Fraction(float(np.float32(v))) for v in values]
    mean = sum(xs, Fraction(0)) / len(xs)
    var = sum(((x - mean) ** 2 for x in xs), Fraction(0)) / max(len(xs) - 1, 1)
    return mean, math.sqrt(var)


@settings(max_examples=40, deadline=None)
@given(SIZES, REWARDS, st.sampled_from(GROUPED), st.integers(1, 5))
def test_a_constant_group_has_exactly_zero_advantage(n, reward, estimator, length):
    # two groups of n equal rewards each (the second the negated reward), one response of `length` tokens each
    scores = torch.tensor([reward] * n + [-reward] * n, dtype=torch.float32)
    mask = torch.ones(2 * n, length)
    token_rewards = L.token_level_rewards(scores, mask, None, 0.0)
    index = A.group_index(2 * n, n)
    if estimator == "grpo_passk" and n < 2:
        return
    adv, _ = A.compute_advantages(estimator, token_rewards, mask, index=index)
    assert adv.dtype == torch.float32
    if n > 1:
        assert torch.count_nonzero(adv) == 0, (estimator, n, reward, adv.abs().max())


@settings(max_examples=40, deadline=None)
@given(st.lists(REWARDS, min_size=2, max_size=1024))
def test_group_mean_and_std_are_correct_to_fp32_precision(values):
    scores = torch.tensor(values, dtype=torch.float32)
    _, mean, std = A.group_stats(torch.zeros(len(values), dtype=torch.long), scores)
    exact_mean, exact_std = _exact_mean_std(values)
    m32, s32 = float(mean[0].float()), float(std[0].float())
    assert abs(Fraction(m32) - exact_mean) <= Fraction(_ulp32(float(exact_mean))), (m32, float(exact_mean))
    assert abs(s32 - exact_std) <= _ulp32(exact_std) + 1e-12 * exact_std, (s32, exact_std)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(SIZES, REWARDS), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_grpo_matches_a_plain_reference_loop_in_exact_arithmetic(groups, rng):
    # several groups of several sizes, rows shuffled: each row's advantage against the exact (s - mean) / (std + eps)
    groups = [(min(n, 256), r) for n, r in groups]
    rows = [(g, float(np.float32(r + 0.37 * (i % 3)))) for g, (n, r) in enumerate(groups) for i in range(n)]
    rng.shuffle(rows)
    index = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([s for _, s in rows], dtype=torch.float32)
    mask = torch.ones(len(rows), 1)
    adv, _ = A.grpo(L.token_level_rewards(scores, mask, None, 0.0), mask, index)
    for i, (g, s) in enumerate(rows):
        members = [v for h, v in rows if h == g]
        if len(members) == 1:
            expected = s / (1 + 1e-6)
        else:
            mean, std = _exact_mean_std(members)
            expected = float(Fraction(s) - mean) / (std + 1e-6)
        # one rounding of the fp64 value to fp32 (plus the eps division's fp64 rounding)
        assert abs(float(adv[i, 0]) - expected) <= 2 * _ulp32(expected) + 1e-9, (
            i,
            float(adv[i, 0]),
            expected,
        )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4096), REWARDS)
@example(1000, 0.7)  # an fp32 sum of a thousand 0.7s is not 700 * (fp32 0.7): the old mean was off
def test_masked_mean_and_whitening_of_a_constant_are_exact(n, value):
    v = torch.full((n,), value, dtype=torch.float32)
    m = torch.ones(n)
    assert float(L.masked_mean(v, m)) == float(np.float32(value))
    assert torch.count_nonzero(L.masked_whiten(v, m)) == 0
    # a mask with holes: the same
    holes = torch.arange(n) % 3 != 1
    assert float(L.masked_mean(v, holes)) == float(np.float32(value)) or not holes.any()
    assert torch.count_nonzero(L.masked_whiten(v, holes)) == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(REWARDS, min_size=2, max_size=2048))
@example([0.1] * 1000)
def test_masked_mean_and_var_are_correct_to_fp32_precision(values):
    v = torch.tensor(values, dtype=torch.float32)
    mean, var = (
        float(L.masked_mean(v, torch.ones(len(values)))),
        float(L.masked_var(v, torch.ones(len(values)))),
    )
    exact_mean, exact_std = _exact_mean_std(values)
    assert abs(Fraction(mean) - exact_mean) <= Fraction(_ulp32(float(exact_mean)))
    assert abs(var - exact_std**2) <= _ulp32(exact_std**2) + 1e-12 * exact_std**2


def test_the_fp32_sequential_sum_this_replaces_does_lose_the_constant_group():
    # the case, so the tests above are known to fail on the old accumulation: a group of 64 rewards
    # of 7.3 summed sequentially in fp32 (index_add_) has a mean off by ulps, and GRPO divides that by a
    # std of ~1e-7 + eps
    s = torch.full((64,), 7.3)
    total = torch.zeros(1).index_add_(0, torch.zeros(64, dtype=torch.long), s)
    assert float(total / 64) != float(np.float32(7.3))
    adv, _ = A.grpo(s[:, None], torch.ones(64, 1), torch.zeros(64, dtype=torch.long))
    assert torch.count_nonzero(adv) == 0
