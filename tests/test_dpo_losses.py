"""Tests for the DPO-family losses in trainer/losses.py (TRL's ``loss_type`` values): one hand-worked pair
for every loss, and each loss's defining invariant. fp64 throughout.

Run: PYTHONPATH=. pytest -q tests/test_dpo_losses.py
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import losses as L

D = torch.float64
finite = st.floats(-5, 5)


def t(x):
    return torch.tensor([x], dtype=D)


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x))


# The pair: policy chosen -1, rejected -3; reference chosen -2, rejected -2.5; beta 0.5.
# c = -1 - -2 = 1, r = -3 - -2.5 = -0.5, h = c - r = 1.5; beta h = 0.75, beta c = 0.5, beta r = -0.25.
PAIR = (t(-1.0), t(-3.0), t(-2.0), t(-2.5))
BETA = 0.5
EXPECTED = {
    # -log s(0.75) = 0.386871
    "sigmoid": -logsig(0.75),
    # relu(1 - 0.75)
    "hinge": 0.25,
    # per-token log-ratios with lengths 2 and 4: 1/2 - (-0.5)/4 = 0.625; (0.625 - 1/(2*0.5))^2 = 0.140625
    "ipo": 0.140625,
    # ls 0.1: (0.9 * 0.386871 - 0.1 * 1.136871) / 0.8 = 0.293121
    "robust": (-(0.9) * logsig(0.75) + 0.1 * logsig(-0.75)) / 0.8,
    # ls 0.1: 0.679179 (-0.386871 - log 0.9) + 0.320821 (-1.136871 - log 0.1) = 0.182790
    "exo_pair": sig(0.75) * (logsig(0.75) - math.log(0.9)) + sig(-0.75) * (logsig(-0.75) - math.log(0.1)),
    # -log s(0.5) - log s(0.25) = 0.474077 + 0.575939 = 1.050016
    "bco_pair": -logsig(0.5) - logsig(0.25),
    # (1 - 1/(2*0.5))^2 + (-0.5 + 1)^2 = 0 + 0.25
    "sppo_hard": 0.25,
    # -log s(0.5) - 0.5 log s(-0.5) - 0.5 log s(0.25) = 0.474077 + 0.487038 + 0.287970 = 1.249085
    "nca_pair": -logsig(0.5) - 0.5 * logsig(-0.5) - 0.5 * logsig(0.25),
    # 1 - s(0.5) + s(-0.25) = 1 - 0.622459 + 0.437823 = 0.815364
    "apo_zero": 1 - sig(0.5) + sig(-0.25),
    # s(0.5) + 1 - s(0.75) = 0.622459 + 0.320821 = 0.943281
    "apo_down": sig(0.5) + 1 - sig(0.75),
    # w = s(0.75 / 0.05) = 0.9999997: (1 - w) 0.386871 + w e^-0.75 = 0.4723665
    "discopop": (1 - sig(15.0)) * -logsig(0.75) + sig(15.0) * math.exp(-0.75),
}


# the same, as rounded numbers worked by hand (the dict above only restates the formulas)
ROUNDED = {"sigmoid": 0.386871, "hinge": 0.25, "ipo": 0.140625, "robust": 0.293121, "exo_pair": 0.182790,
           "bco_pair": 1.050016, "sppo_hard": 0.25, "nca_pair": 1.249085, "apo_zero": 0.815364,
           "apo_down": 0.943281, "discopop": 0.472367}  # fmt: skip


def loss(kind, pair=PAIR, beta=BETA, **kw):
    kw.setdefault("label_smoothing", 0.1 if kind in ("robust", "exo_pair") else 0.0)
    return L.dpo_loss(*pair, beta, kind, chosen_lengths=t(2.0), rejected_lengths=t(4.0), **kw)


@pytest.mark.parametrize("kind", L.DPO_LOSSES)
def test_each_loss_type_hand_value(kind):
    losses, chosen, rejected = loss(kind)
    assert losses.item() == pytest.approx(EXPECTED[kind], rel=1e-12)
    assert losses.item() == pytest.approx(ROUNDED[kind], abs=1e-6)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.25))  # beta c, beta r


def test_ipo_is_length_normalised_and_cdpo_smooths_sigmoid():
    # TRL's IPO averages each log-ratio over its completion: the summed form (1.5 - 1)^2 = 0.25 is not it
    assert loss("ipo")[0].item() != pytest.approx(0.25)
    # cDPO: label smoothing 0.1 on sigmoid: 0.9 * 0.386871 + 0.1 * 1.136871 = 0.461871
    assert loss("sigmoid", label_smoothing=0.1)[0].item() == pytest.approx(
        0.9 * 0.386871 + 0.1 * 1.136871, abs=1e-6
    )


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="ipo needs chosen_lengths"):
        L.dpo_loss(*PAIR, BETA, "ipo")
    with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing"):
        loss("exo_pair", label_smoothing=0.0)
    with pytest.raises(ValueError, match="dpo_loss: unknown loss 'aot'"):
        loss("aot")


pairs = st.tuples(finite, finite, finite, finite)


@settings(max_examples=60, deadline=None)
@given(pairs, st.floats(0.01, 2.0))
def test_sigmoid_swap_symmetry(p, beta):
    """Swapping chosen and rejected flips h; log s(x) - log s(-x) = x, so loss(swapped) - loss = beta h."""
    pc, pr, rc, rr = (t(x) for x in p)
    a, c, r = L.dpo_loss(pc, pr, rc, rr, beta)
    b, sc, sr = L.dpo_loss(pr, pc, rr, rc, beta)
    h = (p[0] - p[2]) - (p[1] - p[3])
    assert (b - a).item() == pytest.approx(beta * h, abs=1e-9)
    assert torch.equal(sc, r) and torch.equal(sr, c)


@settings(max_examples=60, deadline=None)
@given(pairs, st.floats(0.01, 2.0), st.floats(0.0, 0.45))
def test_robust_is_unbiased_under_label_flips(p, beta, ls):
    """robust's defining property (Chowdhury et al.): if a fraction ls of labels is flipped, its expectation
    (1 - ls) robust(h) + ls robust(-h) is the clean DPO loss -log s(beta h)."""
    pc, pr, rc, rr = (t(x) for x in p)
    fwd = L.dpo_loss(pc, pr, rc, rr, beta, "robust", label_smoothing=ls)[0].item()
    flipped = L.dpo_loss(pr, pc, rr, rc, beta, "robust", label_smoothing=ls)[0].item()
    clean = L.dpo_loss(pc, pr, rc, rr, beta)[0].item()
    assert (1 - ls) * fwd + ls * flipped == pytest.approx(clean, abs=1e-8)


@settings(max_examples=60, deadline=None)
@given(pairs, st.floats(0.01, 2.0), st.floats(1e-3, 0.45))
def test_bounded_losses(p, beta, ls):
    pc, pr, rc, rr = (t(x) for x in p)
    h = (p[0] - p[2]) - (p[1] - p[3])

    def value(kind, **kw):
        return L.dpo_loss(pc, pr, rc, rr, beta, kind, **kw)[0].item()

    assert value("hinge") >= 0 and (value("hinge") == 0) == (beta * h >= 1)
    assert value("exo_pair", label_smoothing=ls) >= -1e-12  # a KL divergence
    for kind in ("apo_zero", "apo_down"):  # sums of two sigmoids
        assert 0 <= value(kind) <= 2
    assert value("sppo_hard") >= 0


@settings(max_examples=40, deadline=None)
@given(st.floats(-2, 2), st.floats(-2, 2), st.integers(1, 8), st.integers(1, 8), st.integers(2, 4))
def test_ipo_depends_on_per_token_log_ratios(c, r, nc, nr, k):
    """Repeating every token k times (k x the summed log-ratio, k x the length) leaves IPO unchanged."""
    zero = t(0.0)

    def ipo(scale):
        return L.dpo_loss(
            t(c * scale),
            t(r * scale),
            zero,
            zero,
            0.1,
            "ipo",
            chosen_lengths=t(nc * scale),
            rejected_lengths=t(nr * scale),
        )[0].item()

    assert ipo(k) == pytest.approx(ipo(1), rel=1e-9, abs=1e-12)
