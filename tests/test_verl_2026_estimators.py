"""verl's 2026 advantage estimators that from-verl refused before: ``optimal_token_baseline``,
``tir_optimal_token_baseline`` (with the old policy's sum_v pi_v^2, verl's ``calculate_sum_pi_squared``)
and ``gdpo`` (reward components ``gdpo_reward_keys`` / ``gdpo_reward_weights``); each against hand-worked
values (in the comments) and a plain reference loop, with verl's defaults, GDPO's group statistics exact
at group size 1024, the reward parts they read, and from-verl mapping the keys.

Run: PYTHONPATH=. pytest -q tests/test_verl_2026_estimators.py
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainer import advantages as A
from trainer import logprobs as LP
from trainer.common import reward_parts, split_reward_parts
from trainer.config import AlgoConfig
from trainer.data import digits_parts
from verlaudit import verl_keys as V

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def flat(x):
    """A nested list or tensor as one flat list (pytest.approx compares flat sequences)."""
    return torch.as_tensor(x, dtype=D).flatten().tolist()


# ---------------------------------------------------------------- optimal token baseline


def _policy(pi_token: float, pi_sq: float, shape):
    """old log-probs log(pi_token) and sum_v pi_v^2 = pi_sq everywhere: w = 1 - 2 pi_token + pi_sq."""
    return torch.full(shape, math.log(pi_token), dtype=D), torch.full(shape, pi_sq, dtype=D)


def test_optimal_token_baseline_hand_values():
    # a two-token vocabulary with pi = (0.9, 0.1): sum pi^2 = 0.82. Row 0 took the 0.9 token everywhere:
    # w = 1 - 1.8 + 0.82 = 0.02; row 1 the 0.1 token: w = 1 - 0.2 + 0.82 = 1.62. W_t = cumsum(w).
    # Scores 1 (row 0) and 0 (row 1) on the last token, both of length 2: G0 = (1, 1), G1 = (0, 0).
    # B_t = (1 W0_t + 0 W1_t) / (W0_t + W1_t) = 0.02 / 1.64 = 1/82 at both t (W grows by the same factor).
    # advantages: row 0 1 - 1/82 = 81/82, row 1 -1/82; returns G.
    old = t([[math.log(0.9)] * 2, [math.log(0.1)] * 2])
    spp = torch.full((2, 2), 0.82, dtype=D)
    r, m = t([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2, dtype=D)
    adv, ret = A.optimal_token_baseline(r, m, torch.tensor([0, 0]), old, spp)
    assert flat(adv) == pytest.approx(flat([[81 / 82] * 2, [-1 / 82] * 2]), rel=1e-7)
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    # row 0 one token longer (reward on it): at t = 2 it is alone. verl's handle_zero_tail (on by default):
    # its baseline there is 0, so its advantage is its return 1 (without: B = G W / (W + 1e-8) ~ 1, adv ~ 0)
    r3, m3 = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 1, 0]])
    old3 = t([[math.log(0.9)] * 3, [math.log(0.1)] * 3])
    adv, _ = A.optimal_token_baseline(r3, m3, torch.tensor([0, 0]), old3, torch.full((2, 3), 0.82, dtype=D))
    assert flat(adv) == pytest.approx(flat([[81 / 82, 81 / 82, 1.0], [-1 / 82, -1 / 82, 0.0]]), rel=1e-7)
    # a group of one has no baseline: advantage = return
    adv, ret = A.optimal_token_baseline(r[:1], m[:1], torch.tensor([5]), old[:1], spp[:1])
    assert torch.equal(adv, ret) and adv.tolist() == [[1.0, 1.0]]


def test_rollout_is_weights_scale_the_path_variance_by_their_square():
    # the hand case above with IS weight 3 on row 1: W1 scaled by 9: B = 0.02 / (0.02 + 14.58) = 1/730
    old = t([[math.log(0.9)] * 2, [math.log(0.1)] * 2])
    spp = torch.full((2, 2), 0.82, dtype=D)
    r, m = t([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2, dtype=D)
    isw = t([[1.0, 1.0], [3.0, 3.0]])
    adv, _ = A.optimal_token_baseline(r, m, torch.tensor([0, 0]), old, spp, isw)
    assert adv[0].tolist() == pytest.approx([729 / 730] * 2, rel=1e-7)


def test_tir_packs_the_valid_tokens_before_the_baseline():
    # w = 1 - 2 (0.5) + 0.5 = 0.5 everywhere. Row 0: mask (1, 0, 1) (a tool output in the middle), score 1;
    # row 1: mask (1, 1, 0), score 0. Packed, both have 2 tokens: W = (0.5, 1.0) each, G0 = (1, 1), G1 = 0,
    # so B_k = 0.5 at both k: row 0 gets 0.5 on positions 0 and 2, row 1 gets -0.5 on 0 and 1.
    old, spp = _policy(0.5, 0.5, (2, 3))
    r, m = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), t([[1, 0, 1], [1, 1, 0]])
    adv, ret = A.tir_optimal_token_baseline(r, m, torch.tensor([0, 0]), old, spp)
    assert flat(adv) == pytest.approx(flat([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]), rel=1e-7)
    assert ret.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # the reward-to-go over padded positions
    # the padded-position form lines up position 2 of row 0 with nobody (row 1 ended): there row 0 sets its
    # own baseline (equal lengths: no zero tail) and its advantage is ~0
    adv, _ = A.optimal_token_baseline(r, m, torch.tensor([0, 0]), old, spp)
    assert flat(adv) == pytest.approx(flat([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), abs=1e-7)


def _otb_loop(r, m, index, old, spp, isw, packed):
    """verl's optimal token baseline written out per group, row and position (python floats)."""
    b, n_pos = len(r), len(r[0])
    g_ret = [[sum(r[i][u] * m[i][u] for u in range(s, n_pos)) for s in range(n_pos)] for i in range(b)]
    w = [
        [(1 - 2 * math.exp(old[i][s]) + spp[i][s]) * (isw[i][s] ** 2 if isw else 1.0) for s in range(n_pos)]
        for i in range(b)
    ]
    cum = [[sum(w[i][u] * m[i][u] for u in range(s + 1)) for s in range(n_pos)] for i in range(b)]
    pos = [[s for s in range(n_pos) if m[i][s]] if packed else list(range(n_pos)) for i in range(b)]
    length = [sum(1 for s in range(n_pos) if m[i][s]) for i in range(b)]
    adv = [[0.0] * n_pos for _ in range(b)]
    for grp in set(index):
        rows = [i for i in range(b) if index[i] == grp and (length[i] > 0 or not packed)]
        lens = sorted(length[i] for i in rows)
        for i in rows:
            for k, s in enumerate(pos[i]):
                if not m[i][s]:
                    continue
                if len(rows) == 1:
                    base = 0.0
                elif length[i] == lens[-1] > lens[-2] and k >= lens[-2]:
                    base = 0.0  # the zero tail of the single longest
                else:  # the k-th (packed) or s-th position of every row in the group
                    at = [(j, pos[j][k] if packed else s) for j in rows if k < len(pos[j])]
                    live = [(j, u) for j, u in at if m[j][u]]
                    num = sum(g_ret[j][u] * cum[j][u] for j, u in live)
                    base = num / (sum(cum[j][u] for j, u in live) + 1e-8)
                adv[i][s] = g_ret[i][s] - base
    return adv


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.booleans(), st.booleans(), st.data())
def test_optimal_token_baselines_match_a_plain_loop(groups, n, length, holes, weighted, data):
    b = groups * n
    index = data.draw(st.permutations([g for g in range(groups) for _ in range(n)]))
    lengths = data.draw(st.lists(st.integers(0, length), min_size=b, max_size=b))
    m = [[1.0 if s < lengths[i] else 0.0 for s in range(length)] for i in range(b)]
    if holes:
        m = [[v * data.draw(st.sampled_from([0.0, 1.0, 1.0])) for v in row] for row in m]
    r = [[0.0] * length for _ in range(b)]
    for i in range(b):
        valid = [s for s in range(length) if m[i][s]]
        if valid:
            r[i][valid[-1]] = data.draw(st.sampled_from([0.0, 0.7, 1.0, -0.3]))
    logits = torch.randn(b, length, 5, dtype=D, generator=torch.Generator().manual_seed(len(index)))
    p = logits.softmax(-1)
    old, spp = p[..., 0].log(), (p**2).sum(-1)  # the token taken is vocabulary entry 0
    isw = torch.rand(b, length, dtype=D, generator=torch.Generator().manual_seed(1)) * 2 if weighted else None
    idx = torch.tensor(index)
    for fn, packed in ((A.optimal_token_baseline, False), (A.tir_optimal_token_baseline, True)):
        adv, _ = fn(t(r), t(m), idx, old, spp, isw)
        want = _otb_loop(r, m, index, old.tolist(), spp.tolist(), isw.tolist() if weighted else None, packed)
        assert flat(adv) == pytest.approx(flat(want), rel=1e-9, abs=1e-9), fn.__name__


def test_otb_needs_the_old_policy_and_rounds_once():
    r, m = t([[0.0, 1.0], [0.0, 0.0]]).float(), torch.ones(2, 2)
    with pytest.raises(ValueError, match="optimal_token_baseline: needs the old policy's log-probs"):
        A.compute_advantages("optimal_token_baseline", r, m, index=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="needs the old policy's sum of squared token probabilities"):
        A.compute_advantages(
            "tir_optimal_token_baseline", r, m, index=torch.tensor([0, 0]), old_logprobs=torch.zeros(2, 2)
        )
    old, spp = _policy(0.5, 0.5, (2, 2))
    adv, ret = A.compute_advantages(
        "optimal_token_baseline",
        r,
        m,
        index=torch.tensor([0, 0]),
        old_logprobs=old.float(),
        sum_pi_squared=spp.float(),
    )
    assert adv.dtype == ret.dtype == torch.float32
    assert flat(adv) == pytest.approx(flat([[0.5, 0.5], [-0.5, -0.5]]), rel=1e-6)


def test_sum_pi_squared_from_logits():
    # logits (0, ln 3): pi = (1/4, 3/4), sum pi^2 = 10/16. Temperature 2: pi = (1, sqrt 3) / (1 + sqrt 3),
    # sum pi^2 = 4 / (1 + sqrt 3)^2
    x = torch.tensor([[[0.0, math.log(3.0)]]])
    assert LP.sum_pi_squared_from_logits(x).item() == pytest.approx(0.625, rel=1e-6)
    assert LP.sum_pi_squared_from_logits(x, temperature=2.0).item() == pytest.approx(4 / (1 + 3**0.5) ** 2)
    big = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)).bfloat16()
    whole = LP.sum_pi_squared_from_logits(big)
    assert whole.dtype == torch.float32
    assert torch.equal(
        whole, LP.sum_pi_squared_from_logits(big, chunk_elements=11)
    )  # chunking changes nothing
    assert torch.allclose(whole, (big.float().softmax(-1) ** 2).sum(-1), rtol=1e-6)


def test_the_old_policy_forward_hands_back_sum_pi_squared_of_its_logits():
    # a "model" whose logits are a fixed table: the list gets sum pi^2 of the response positions' logits
    # (the logit at position i predicts token i + 1), at the sampling temperature
    table = torch.randn(1, 6, 7, generator=torch.Generator().manual_seed(3))

    class Table(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids):
            return table

    ids, attn = torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)
    got: list[torch.Tensor] = []
    lp, _ = LP.sequence_logprobs(Table(), ids, attn, 3, temperature=0.7, sum_pi_squared=got)
    (spp,) = got
    assert spp.shape == lp.shape == (1, 3)
    assert torch.allclose(spp, ((table[:, 2:5] / 0.7).softmax(-1) ** 2).sum(-1), rtol=1e-6)


# ---------------------------------------------------------------- gdpo


def test_gdpo_hand_values():
    # groups {0, 1} and {2, 3}, one token each. Component a = (1, 0 | 1, 1), b = (0, 1 | 1, 0), weights 1, 0.5.
    # a: group 0 mean 0.5, std sqrt(0.5): (+-0.5 / 0.70711) = +-0.70711; group 1 constant: 0, 0.
    # b: -+0.70711 in group 0, +-0.70711 in group 1. a + 0.5 b = (0.35355, -0.35355, 0.35355, -0.35355):
    # mean 0, unbiased var 4 (0.125) / 3 = 1/6; whitened +-0.35355 sqrt 6 = +-sqrt(3)/2 (eps aside)
    comps = t([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    r, m = torch.zeros(4, 1, dtype=D), torch.ones(4, 1, dtype=D)
    adv, ret = A.gdpo(r, m, torch.tensor([0, 0, 1, 1]), comps, (1.0, 0.5))
    assert adv[:, 0].tolist() == pytest.approx([3**0.5 / 2, -(3**0.5) / 2] * 2, rel=1e-5)
    assert torch.equal(adv, ret)
    # without components the summed score is the one component (verl's fallback): GRPO, then whitened
    r2 = t([[1.0], [0.0], [0.5], [0.5]])
    adv, _ = A.gdpo(r2, m, torch.tensor([0, 0, 1, 1]))
    # GRPO: (0.70711, -0.70711, 0, 0): mean 0, var 1/3: whitened +-0.70711 sqrt 3 = +-1.22474
    assert adv[:, 0].tolist() == pytest.approx([1.5**0.5, -(1.5**0.5), 0.0, 0.0], rel=1e-5)
    with pytest.raises(ValueError, match="gdpo: 1 weights for 2 reward components"):
        A.gdpo(r, m, torch.tensor([0, 0, 1, 1]), comps, (1.0,))


def _gdpo_loop(comps, weights, index, lengths, norm_by_std, eps=1e-6):
    """GDPO per component and group in python floats (math.fsum), then whitened over the valid tokens."""
    total = [0.0] * len(index)
    for c, w in zip(comps, weights):
        for i, g in enumerate(index):
            members = [c[j] for j in range(len(index)) if index[j] == g]
            if len(members) == 1:
                mean, std = 0.0, 1.0
            else:
                mean = math.fsum(members) / len(members)
                std = math.sqrt(math.fsum((v - mean) ** 2 for v in members) / (len(members) - 1))
            total[i] += float(np.float32(w)) * ((c[i] - mean) / (std + eps) if norm_by_std else c[i] - mean)
    tokens = [v for v, n in zip(total, lengths) for _ in range(n)]
    mean = math.fsum(tokens) / len(tokens)
    var = math.fsum((v - mean) ** 2 for v in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in total]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(-3, 3), st.floats(-3, 3), st.integers(1, 3)),
        min_size=2,
        max_size=20,
    ),
    st.booleans(),
)
def test_gdpo_matches_a_plain_loop(rows, norm_by_std):
    index = [g for g, *_ in rows]
    comps = [[float(np.float32(a)) for _, a, _, _ in rows], [float(np.float32(b)) for _, _, b, _ in rows]]
    lengths = [n for *_, n in rows]
    m = t([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    adv, _ = A.gdpo(
        torch.zeros_like(m), m, torch.tensor(index), t(comps), (1.0, 0.3), norm_by_std=norm_by_std
    )
    want = _gdpo_loop(comps, (1.0, 0.3), index, lengths, norm_by_std)
    for i, n in enumerate(lengths):
        assert adv[i, :n].tolist() == pytest.approx([want[i]] * n, rel=1e-7, abs=1e-7)
        assert adv[i, n:].abs().sum() == 0


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 1024),
    st.sampled_from([0.7, 7.3, 0.1, -2.9, 1 / 3, 123.456]),
    st.floats(-1e3, 1e3, allow_nan=False, width=32),
)
@example(1024, 0.7, 7.3)
@example(64, 7.3, 0.1)
def test_gdpo_constant_groups_have_exactly_zero_advantage(n, a, b):
    # two groups of n responses, each component constant within a group (non-dyadic values: fp32 sums of
    # them round at every step): every component's advantage is exactly 0, so the whitened sum is too
    comps = torch.tensor([[a] * n + [b] * n, [b] * n + [-a] * n], dtype=torch.float32)
    m = torch.ones(2 * n, 2)
    adv, _ = A.gdpo(torch.zeros(2 * n, 2), m, A.group_index(2 * n, n), comps, (1.0, 0.5))
    assert adv.dtype == torch.float32 and torch.count_nonzero(adv) == 0, adv.abs().max()


def test_gdpo_group_statistics_are_those_of_exact_arithmetic_at_group_size_1024():
    # one group of 1024 non-dyadic values and one of a single response: each row's component advantage
    # against the fp64 loop (math.fsum: correctly rounded sums), rounded to fp32 once
    rng = np.random.default_rng(0)
    c = np.float32(rng.choice([0.7, 7.3, 0.1], 1024)).tolist() + [0.3]
    index = [0] * 1024 + [1]
    m = torch.ones(1025, 1)
    adv, _ = A.gdpo(torch.zeros(1025, 1), m, torch.tensor(index), torch.tensor([c], dtype=torch.float32))
    want = _gdpo_loop([c], (1.0,), index, [1] * 1025, True)
    assert adv.dtype == torch.float32
    assert adv[:, 0].tolist() == pytest.approx(want, rel=2**-23, abs=1e-7)


# ---------------------------------------------------------------- the reward parts GDPO reads


def test_reward_parts_from_dicts_and_their_errors():
    raw = [{"score": 1.0, "acc": True, "fmt": 0.5}, {"score": 0.0, "acc": False, "fmt": 1}]
    scores, parts = split_reward_parts(raw, "data.reward_fn")
    assert scores == [1.0, 0.0] and parts == {"acc": [True, False], "fmt": [0.5, 1]}
    assert reward_parts(parts, ("fmt", "acc"), 2, "cpu", "data.reward_fn").tolist() == [
        [0.5, 1.0],
        [1.0, 0.0],
    ]
    assert split_reward_parts([0.5, 1.0], "w") == ([0.5, 1.0], {})  # plain numbers: no parts
    with pytest.raises(ValueError, match="response 1's dict has no 'score'"):
        split_reward_parts([{"score": 1.0}, {"acc": 1.0}], "data.reward_fn")
    with pytest.raises(
        ValueError, match=r"'len' is not among the parts data.reward_fn returned \(acc, fmt\)"
    ):
        reward_parts(parts, ("len",), 2, "cpu", "data.reward_fn")
    with pytest.raises(ValueError, match="returned .none: it returned plain numbers"):
        reward_parts({}, ("acc",), 2, "cpu", "data.task")
    with pytest.raises(ValueError, match="'acc' is None for response 1"):
        reward_parts({"acc": [1.0, None]}, ("acc",), 2, "cpu", "data.reward_fn")


def test_digits_parts_add_up_to_the_task_reward():
    # answer "4444": "44a9" has 2 right digits and 3 digits: correct 0.5, digits 0.75, score 0.75 (0.5) + 0.25
    # (0.75) = 0.5625 (the task's 1 + 1 + 0 + 0.25 over 4)
    (out,) = digits_parts(["4 1:"], ["44a9"], [{"answer": "4444"}])
    assert out == {"score": 0.5625, "correct": 0.5, "digits": 0.75}


def test_gdpo_config_needs_its_keys_and_matching_weights():
    with pytest.raises(ValueError, match="gdpo_reward_keys: adv_estimator gdpo needs the reward components"):
        AlgoConfig(name="grpo", adv_estimator="gdpo")
    with pytest.raises(ValueError, match="gdpo_reward_weights: 1 weights for 2 gdpo_reward_keys"):
        AlgoConfig(name="grpo", adv_estimator="gdpo", gdpo_reward_keys=("a", "b"), gdpo_reward_weights=(1.0,))
    with pytest.raises(
        ValueError, match="gdpo_reward_keys: set to .* but nothing reads it: needs adv_estimator"
    ):
        AlgoConfig(name="grpo", gdpo_reward_keys=("a",))
    cfg = AlgoConfig(
        name="grpo", adv_estimator="gdpo", gdpo_reward_keys=("a", "b"), gdpo_reward_weights=(1, 2)
    )
    assert cfg.gdpo_reward_keys == ("a", "b") and cfg.norm_adv_by_std_in_grpo  # read per component


# ---------------------------------------------------------------- the recipe runs them


@pytest.mark.parametrize(
    ("algo", "data"),
    [
        ({"adv_estimator": "optimal_token_baseline"}, {}),
        ({"adv_estimator": "tir_optimal_token_baseline"}, {}),
        (
            {
                "adv_estimator": "gdpo",
                "gdpo_reward_keys": ["correct", "digits"],
                "gdpo_reward_weights": [1, 0.5],
            },
            {"reward_fn": "trainer.data:digits_parts"},
        ),
    ],
)
def test_the_grpo_recipe_runs_the_new_estimators(algo, data):
    from trainer.config import TrainConfig
    from trainer.train import train

    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": "grpo", "batch_size": 2, **algo},
            "data": data,
            "steps": 1,
            "device": "cpu",
            "seed": 0,
            "threads": 1,
        }
    )
    (m,) = train(cfg).history
    assert all(math.isfinite(v) for v in m.values()), m
    if algo["adv_estimator"] == "gdpo":  # verl's per-component metrics
        assert {"gdpo/correct/mean", "gdpo/digits/std", "gdpo/digits/max", "gdpo/correct/min"} <= set(m)


def test_gdpo_on_plain_scores_names_what_is_missing():
    from trainer.config import TrainConfig
    from trainer.train import train

    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": "grpo", "batch_size": 2, "adv_estimator": "gdpo", "gdpo_reward_keys": ["acc"]},
            "steps": 1,
            "device": "cpu",
        }
    )
    with pytest.raises(ValueError, match=r"'acc' is not among the parts data.task returned \(none"):
        train(cfg)


# ---------------------------------------------------------------- from-verl maps them


def test_from_verl_maps_the_new_estimators(tmp_path):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    for est in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        script = tmp_path / "job.sh"
        script.write_text(
            f"python3 -m verl.trainer.main_ppo algorithm.adv_estimator={est} "
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True\n"
        )
        mapped = map_launch(read_launch(str(script)), target="cpu")
        assert mapped.train["algo"]["adv_estimator"] == est
        assert not [r for r in mapped.records if r.kind == "unmapped"], est
    script = tmp_path / "gdpo.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gdpo "
        "'algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]' 'algorithm.gdpo_reward_weights=[1.0,2.0]'\n"
    )
    mapped = map_launch(read_launch(str(script)), target="cpu")
    algo = mapped.train["algo"]
    assert (algo["adv_estimator"], algo["gdpo_reward_keys"], algo["gdpo_reward_weights"]) == (
        "gdpo",
        ["format_reward", "accuracy_reward"],
        [1.0, 2.0],
    )
    assert not [r for r in mapped.records if r.kind == "unmapped"]
    from trainer.config import TrainConfig

    assert TrainConfig.from_dict({"algo": algo}).algo.gdpo_reward_weights == (1.0, 2.0)  # the suite validates
    # and back: a diagnosis's fix writes the list in Hydra's form
    assert V.algo_override("gdpo_reward_keys", ("acc", "fmt")) == "algorithm.gdpo_reward_keys=[acc,fmt]"
