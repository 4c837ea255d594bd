"""The reward probe's near misses and answer forms, and the settle of "no learning signal" they decide
(verlaudit/audit/probes_answer.py, analysis/diagnose/answer_probe.py). A silent GRPO run is called a sparse
reward (info) only where the probe showed the reward scores the reference answer as correct and its near misses
(an integer +-1, a decimal's last place, a changed last letter) as wrong, and the answers' canonical form as
their raw one; otherwise the probe's finding is the root. Tiny reward functions of our own: exact matches, a
boxed-only scorer and a truly sparse reward that must stay info; isclose with loose relative and absolute
tolerances, a match of all but the last letter, and float-repr ground truths that must not."""

from __future__ import annotations

import math
import re

import pytest

from tests.test_probes_fork import G, _examples, _last, _truth, exact, probe
from verlaudit import kinds as K
from verlaudit.audit import probes_answer, probes_fork

pytestmark = pytest.mark.skipif(not probes_fork.can_fork(), reason="needs os.fork")


def _num(text):
    got = _last(text)
    return None if got is None else float(got)


def isclose_rel(prompts, responses, examples, rel=0.1):
    out = []
    for r, e in zip(responses, examples):
        got = _num(r)
        out.append(0.0 if got is None else float(math.isclose(got, float(_truth(e)), rel_tol=rel)))
    return out


def isclose_abs(prompts, responses, examples):
    return [
        0.0 if _num(r) is None else float(abs(_num(r) - float(_truth(e))) <= 1.0)
        for r, e in zip(responses, examples)
    ]


def isclose_abs_half(prompts, responses, examples):
    return [
        0.0 if _num(r) is None else float(math.isclose(_num(r), float(_truth(e)), abs_tol=0.5))
        for r, e in zip(responses, examples)
    ]


def isclose_tight(prompts, responses, examples):
    return isclose_rel(prompts, responses, examples, rel=1e-9)


def shaped(prompts, responses, examples):
    """Partial credit that falls with the distance: a near miss scores less than the answer (correct)."""
    return [
        0.0 if _num(r) is None else math.exp(-abs(_num(r) - float(_truth(e))))
        for r, e in zip(responses, examples)
    ]


def all_but_last_letter(prompts, responses, examples):
    out = []
    for r, e in zip(responses, examples):
        a = str(_truth(e))
        out.append(float(r.strip()[: len(a) - 1] == a[:-1] and len(r.strip()) == len(a)))
    return out


def boxed_only(prompts, responses, examples):
    out = []
    for r, e in zip(responses, examples):
        m = re.search(r"\\boxed\{([^}]*)\}", r)
        out.append(float(m is not None and m.group(1).strip() == str(_truth(e))))
    return out


def text_exact(prompts, responses, examples):
    return [
        float(r.strip().split()[-1:] == [str(_truth(e))]) if r.strip() else 0.0
        for r, e in zip(responses, examples)
    ]


SILENT = ["0"] * (4 * G)  # the run's own responses: nothing right, every reward one value


@pytest.mark.parametrize("fn", [exact, isclose_tight, shaped, boxed_only])
def test_a_reward_that_tells_near_misses_apart_can_be_sparse(fn):
    found, _ = probe(fn, responses=SILENT)
    assert set(found) == {K.REWARD_ANSWER_SCORES}, {k: f.message for k, f in found.items()}
    obs = found[K.REWARD_ANSWER_SCORES].observed
    assert obs["near_miss_rows"] == 16 and obs["near_miss_scored"] == 0, obs
    if fn is boxed_only:
        assert obs["format"] == "\\boxed{a}"


@pytest.mark.parametrize(
    ("fn", "answers"),
    [
        (isclose_rel, ["31", "7", "12", "45"]),  # rel_tol 0.1: 30 and 32 count for 31
        (isclose_abs, ["31", "7", "12", "45"]),  # |pred - truth| <= 1
        (isclose_abs_half, ["0.3", "1.1", "2.7", "0.9"]),  # 0.4 is 'close' to 0.3 at abs_tol 0.5
    ],
)
def test_a_loose_numeric_tolerance_is_lenient(fn, answers):
    found, _ = probe(fn, _examples(answers), responses=SILENT)
    f = found[K.REWARD_ANSWER_LENIENT]
    assert f.severity == "error" and "near-miss" in f.message and "tolerance" in f.message
    assert "abs_tol" in f.fix and "==" in f.fix and f.where == f"reward:function:t.py:{fn.__name__}"
    assert found[K.REWARD_ANSWER_SCORES].observed["near_miss_scored"] >= 2


def test_a_match_of_part_of_a_word_is_lenient():
    found, _ = probe(all_but_last_letter, _examples(["cab", "hed", "abcd", "fg"]), responses=SILENT)
    f = found[K.REWARD_ANSWER_LENIENT]
    assert "part of the answer" in f.message and "==" in f.fix


@pytest.mark.parametrize("scorer", [text_exact, exact])
def test_float_repr_ground_truths_are_an_answer_form(scorer):
    # three in four answers short, one the repr of a float sum: no response writes 0.30000000000000004
    answers = ["0.5", str(0.1 + 0.2), "0.7", str(0.2 + 0.4)]
    found, _ = probe(scorer, _examples(answers), responses=SILENT)
    f = found[K.ANSWER_FORM]
    assert "floating-point" in f.message and "0.30000000000000004" in f.message
    assert "round(" in f.fix and "decimal" in f.fix.lower()


def test_the_canonical_form_of_a_float_repr():
    assert probes_answer.canonical("0.30000000000000004") == "0.3"
    assert probes_answer.canonical("0.6000000000000001") == "0.6"
    assert probes_answer.canonical(str(math.pi)) == str(math.pi)  # a long decimal that is no float's noise
    assert probes_answer.near_misses("17") == ["18", "16"] and probes_answer.near_misses("12.0") == [
        "13.0",
        "11.0",
    ]
    assert probes_answer.near_misses("0.3") == ["0.4", "0.2"] and probes_answer.near_misses("3.14159") == []
    assert probes_answer.near_misses("cab") == ["caa"]


# ---------------------------------------------------------------- the settle, on the probe's own findings


def _silent(tmp_path, found):
    from tests.diagnose_runs import causes, make_run

    metrics = [{"reward/mean": 0.0, "reward/std": 0.0, "reward/identical_group_frac": 1.0} for _ in range(3)]
    run = make_run(tmp_path / "run", algo="grpo", steps=3, metrics=metrics, findings=list(found.values()))
    return causes(run)


@pytest.mark.parametrize("fn", [exact, boxed_only, shaped])
def test_a_truly_sparse_reward_stays_info(tmp_path, fn):
    d = _silent(tmp_path, probe(fn, responses=SILENT)[0])
    assert d.verdict == "clean", [(c.severity, c.title) for c in d.causes]
    assert "No correct answer sampled yet" in d.causes[0].title


@pytest.mark.parametrize(
    ("fn", "answers", "kind"),
    [
        (isclose_rel, ["31", "7", "12", "45"], K.REWARD_ANSWER_LENIENT),
        (isclose_abs_half, ["0.3", "1.1", "2.7", "0.9"], K.REWARD_ANSWER_LENIENT),
        (all_but_last_letter, ["cab", "hed", "abcd", "fg"], K.REWARD_ANSWER_LENIENT),
        (exact, ["0.5", str(0.1 + 0.2), "0.7", str(0.2 + 0.4)], K.ANSWER_FORM),
    ],
)
def test_a_reward_that_misjudges_answers_is_the_root_not_a_sparse_reward(tmp_path, fn, answers, kind):
    d = _silent(tmp_path, probe(fn, _examples(answers), responses=SILENT)[0])
    assert d.verdict == "error", [(c.severity, c.title) for c in d.causes]
    assert d.causes[0].kind == f"finding:{kind}", [c.kind for c in d.causes]
    assert not any("No correct answer sampled yet" in c.title for c in d.causes)
    assert d.causes[0].fixes and d.causes[0].fixes[0].why


def test_a_probe_that_did_not_show_its_near_misses_claims_no_sparse_reward(tmp_path):
    from verlaudit.rundir import Finding

    old = Finding(severity="info", kind=K.REWARD_ANSWER_SCORES, message="the reward can fire", role="reward",
                  where="reward:function:f", step=0, observed={"right_mean": 1.0, "wrong_mean": 0.0})  # fmt: skip
    d = _silent(tmp_path, {"a": old})
    assert d.verdict != "clean" and not any("No correct answer" in c.title for c in d.causes)


def test_a_failing_judge_never_ends_the_run(capsys):
    got = probes_answer.judge_answers({"rows": None}, [0.0], source="s", fn_name="f", data_key="d", ctx={})
    assert got[0] == [] and "answer_probe_error" in got[1]
    assert "audit bug" in capsys.readouterr().err


def almost_full_credit(prompts, responses, examples):
    """A near miss scores 1 - 1e-8: as much as the answer within the probe's tolerance (no crash on the tie)."""
    out = []
    for r, e in zip(responses, examples):
        got = _num(r)
        out.append(
            0.0
            if got is None
            else 1.0
            if got == float(_truth(e))
            else 1.0 - 1e-8
            if abs(got - float(_truth(e))) <= 1
            else 0.0
        )
    return out


def test_a_near_miss_within_the_tolerance_of_the_answer_is_lenient():
    found, _ = probe(almost_full_credit, responses=SILENT)
    assert K.REWARD_ANSWER_LENIENT in found, {k: f.message for k, f in found.items()}
