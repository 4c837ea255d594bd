"""Numpy bools added inside a plug-in (verlaudit/audit/probes_numpy.py): the sum of np.bool_ checks is a
logical or. A reward that adds numpy bools is found with its line; the same reward on Python ints, and one
whose checks are never true together, are not. The rewards are not the blind benches' items."""

from __future__ import annotations

import numpy as np

from verlaudit import kinds as K
from verlaudit.audit import probes_numpy as N


def graded(response: str, answer: str) -> float:
    starts = np.bool_(response[:1] == answer[:1])
    ends = np.bool_(response[-1:] == answer[-1:])
    sized = np.bool_(len(response) == len(answer))
    return float(starts + ends + sized) / 3


def graded_ints(response: str, answer: str) -> float:
    starts = int(np.bool_(response[:1] == answer[:1]))
    ends = int(np.bool_(response[-1:] == answer[-1:]))
    sized = int(np.bool_(len(response) == len(answer)))
    return (starts + ends + sized) / 3


def reward(fn, pairs):
    return [fn(r, a) for r, a in pairs]


PAIRS = [("1231", "1221"), ("98", "1234"), ("4444", "4444"), ("x", "y")]


def test_numpy_bools_added_in_a_reward_are_found_with_their_line():
    with N.BoolAdd() as t:
        got = reward(graded, PAIRS)
    assert got[2] == 1 / 3  # three checks true, counted once: the bug the probe names
    fs = t.findings(where="data.reward_fn (r.py:graded)", ctx={"step": 0})
    assert [f.kind for f in fs] == [K.PLUGIN_NUMPY_BOOL_ADD]
    assert "test_probes_numpy.py:" in fs[0].where and "int(starts)" in fs[0].fix
    assert fs[0].observed["calls_undercounted"] == 2


def test_python_ints_and_checks_never_true_together_are_quiet():
    with N.BoolAdd() as t:
        reward(graded_ints, PAIRS)
    assert t.findings(where="r", ctx={}) == []
    with N.BoolAdd() as t:
        reward(graded, [("98", "1234"), ("x", "yz")])
    assert t.findings(where="r", ctx={}) == []
