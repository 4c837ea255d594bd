"""A comparison lenient by precision (prec13): a reward that rounds both sides before == scores the probe's
near misses (an answer a digit off) as right, the probe names the line that rounds, and the settle never calls
such a reward sparse; an exact comparison in the same module stays clean. Also: a decimal context the user's
module narrowed for this thread does not leak into the probe's own arithmetic (its near misses stay numbers).
Run: `pytest tests/test_lenient_precision.py`."""

from __future__ import annotations

import decimal

import pytest

from tests import lenient_plugins as lp
from tests.test_probes_fork import _examples, probe
from verlaudit import kinds as K
from verlaudit.audit import probes_answer, probes_fork

pytestmark = pytest.mark.skipif(not probes_fork.can_fork(), reason="needs os.fork")

WIDE = ["1234", "918", "5067", "3310"]
"""Three- and four-digit answers: two significant digits do not tell a near miss from them."""


@pytest.mark.parametrize(
    "fn, line_has",
    [
        (lp.through_report_context, "decimal context of 2"),
        (lp.rounded_to_tens, "round(x, -1)"),
        (lp.quantized_to_tens, "quantize"),
    ],
)
def test_a_comparison_at_limited_precision_is_lenient_and_named(fn, line_has):
    found, _ = probe(fn, examples=_examples(WIDE))
    f = found.get(K.REWARD_ANSWER_LENIENT)
    assert f is not None, sorted(found)
    assert (
        f.observed["precision_at"].startswith("lenient_plugins.py:") and line_has in f.observed["precision"]
    )
    assert "localcontext" in f.fix and "==" in f.fix
    scores = found[K.REWARD_ANSWER_SCORES].observed
    assert scores["near_miss_scored"] > 0  # the settle reads this: never a sparse reward


def test_an_exact_comparison_beside_a_narrow_context_is_clean():
    found, _ = probe(lp.exact_beside_the_context, examples=_examples(WIDE))
    assert K.REWARD_ANSWER_LENIENT not in found
    assert found[K.REWARD_ANSWER_SCORES].observed["near_miss_scored"] == 0


@pytest.fixture
def two_digit_thread():
    ctx = decimal.getcontext()
    was = ctx.prec
    ctx.prec = 2  # what a module that sets decimal.getcontext().prec at import leaves in this thread
    yield
    ctx.prec = was


def test_a_narrowed_thread_context_does_not_reach_the_probes_near_misses(two_digit_thread):
    assert probes_answer.near_misses("1234") == ["1235", "1233"]
    found, _ = probe(lp.thread_context, examples=_examples(WIDE))
    assert K.REWARD_ANSWER_LENIENT in found, sorted(found)
