"""A reward on a grid coarser than its inputs (prec13, `verlaudit.audit.reward_grid`): three planted
roundings through a reward function and a verl compute_score fire with the line that rounds; designed
levels, a partial credit's exact steps and a fine rounding stay clean. Run: `pytest tests/test_reward_grid.py`."""

from __future__ import annotations

import functools

import pytest

from tests import grid_plugins as gp
from tests import grid_plugins_decimal as gd
from trainer.verl_data import VerlReward
from verlaudit import kinds as K
from verlaudit.audit import reward_grid
from verlaudit.audit.probes_fork import bound_inputs, scores

ANSWERS = ["1234", "5678", "9012", "3456"]


def _batches(n=3, size=8):
    out = []
    for b in range(n):
        responses = [f"{(b * 37 + i * 1111) % 10000:04d}"[: 1 + (i % 4)] for i in range(size)]
        examples = [{"answer": ANSWERS[i % 4]} for i in range(size)]
        out.append((["p"] * size, responses, examples))
    return out


def _watch(fn):
    w, found = reward_grid.GridWatch(), []
    for prompts, responses, examples in _batches():
        call = functools.partial(fn, prompts, responses, examples)
        f, _, rs, _ = bound_inputs(call)
        found += w.observe(f, rs, scores(call(), len(rs)), where="data.reward_fn (x)", ctx={"step": 0})
    return found


def _verl(fn):
    """``fn`` behind the trainer's own adapter object, as the real call binds it."""
    reward = VerlReward(fn, "compute_score", reward_fn_key="data_source", kwargs={})
    w, found = reward_grid.GridWatch(), []
    for prompts, responses, examples in _batches():
        exs = [{"data_source": "t", "reward_model": {"ground_truth": e["answer"]}} for e in examples]
        found += w.observe(reward, responses, scores(reward(prompts, responses, exs), len(responses)),
                           where="data.compute_score (x)", ctx={"step": 1})  # fmt: skip
    return found


@pytest.mark.parametrize(
    "fn, grid, line_has",
    [
        (gp.score_from_log_record, 0.01, "%.2f"),
        (gp.rounded_for_dashboard, 0.1, "round("),
        (gp.json_cached, 0.1, ":.1f"),
    ],
)
def test_a_reward_rounded_in_its_module_is_named_with_its_line(fn, grid, line_has):
    (f,) = _watch(fn)
    assert f.kind == K.REWARD_VALUE_GRID and f.observed["grid"] == pytest.approx(grid)
    assert f.observed["at"].startswith("grid_plugins.py:") and line_has in f.message
    assert len(f.observed["values"]) <= reward_grid.HANDFUL and "unrounded" in f.fix


def test_a_compute_score_through_a_decimal_context_is_named():
    (f,) = _verl(gd.compute_score)
    assert f.observed["at"].startswith("grid_plugins_decimal.py:") and "prec=2" in f.message
    assert "significant digits" in f.message and f.where == "data.compute_score (x)"


@pytest.mark.parametrize("fn", [gp.designed_levels, gp.quarter_credit, gp.continuous_rounded_to_four])
def test_levels_exact_steps_and_fine_roundings_are_clean(fn):
    assert _watch(fn) == []


def test_the_trainers_own_reward_is_not_the_users():
    from trainer.config import DataConfig
    from trainer.data import get_reward_fn

    _, fn = get_reward_fn(DataConfig())
    assert reward_grid.user_function(fn) is None
    assert reward_grid.user_function(functools.partial(gp.rounded_for_dashboard)) is gp.rounded_for_dashboard
