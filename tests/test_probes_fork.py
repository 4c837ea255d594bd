"""The reward function's contract probed in forked children (verlaudit/audit/probes_fork.py, probes_answer.py,
probes_run.py, analysis/diagnose/answer_probe.py). Tiny reward functions of our own that break each invariant
(none of them a blind bench's item), and correct ones that must stay quiet: an exact match, a math-verify-like
normaliser, a stateful counter that scores correctly, a correct group-relative bonus."""

from __future__ import annotations

import copy
import functools
import random
import time

import numpy as np
import pytest

from verlaudit import kinds as K
from verlaudit.audit import probes_answer, probes_fork, probes_run
from verlaudit.audit.settings import AuditSettings

pytestmark = pytest.mark.skipif(not probes_fork.can_fork(), reason="needs os.fork")

G = 4
ANSWERS = ["31", "7", "12", "45"]


def _examples(answers=ANSWERS, group=G, field="answer"):
    out = []
    for a in answers:
        ex = {"prompt": f"q{a}"}
        if field == "answer":
            ex["answer"] = a
        else:
            ex.update(data_source="s", reward_model={"ground_truth": a}, extra_info={})
        out += [ex] * group  # GRPO: one dict for the group's responses, as the trainer repeats it
    return out


def _responses(examples):
    rng = random.Random(3)
    out = []
    for ex in examples:
        a = str(ex.get("answer", ex.get("reward_model", {}).get("ground_truth")))
        out.append(rng.choice([a, a + "9", "0", f"#### {a}", "x"]))
    return out


def _last(text):
    import re

    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


def _truth(ex):
    return ex["answer"] if "answer" in ex else ex["reward_model"]["ground_truth"]


def exact(prompts, responses, examples):
    return [float(_last(r) == str(_truth(e))) for r, e in zip(responses, examples)]


def verify_like(prompts, responses, examples):
    """A correct normaliser: \\boxed{} or the last number, compared as numbers with a tolerance."""
    import math
    import re

    out = []
    for r, e in zip(responses, examples):
        m = re.search(r"\\boxed\{([^}]*)\}", r)
        got = m.group(1) if m else _last(r)
        try:
            out.append(float(math.isclose(float(got), float(_truth(e)), rel_tol=1e-9)))
        except (TypeError, ValueError):
            out.append(0.0)
    return out


_CALLS = {"n": 0}


def counting(prompts, responses, examples):
    """Correct, and it counts its calls (state that does not change a score)."""
    _CALLS["n"] += 1
    return exact(prompts, responses, examples)


def group_bonus_right(prompts, responses, examples):
    c = np.array(exact(prompts, responses, examples))
    g = c.reshape(-1, G)
    return (c + (g - g.mean(axis=1, keepdims=True)).reshape(-1)).tolist()


def group_bonus_transposed(prompts, responses, examples):
    c = np.array(exact(prompts, responses, examples))
    g = c.reshape(G, -1).T  # [group, prompts] read as [prompts, group]
    return (c + (g - g.mean(axis=1, keepdims=True)).T.reshape(-1)).tolist()


def batch_zscore(prompts, responses, examples):
    c = np.array([len(r) for r in responses], dtype=float)
    return ((c - c.mean()) / (c.std() + 1e-6)).tolist()


_BEST = {"v": 0.0}


def best_so_far(prompts, responses, examples):
    raw = [float(len(r)) for r in responses]
    _BEST["v"] = max(_BEST["v"], *raw)
    return [x / _BEST["v"] for x in raw]


def first_rows_only(prompts, responses, examples):
    got = exact(prompts, responses, examples)
    return got[:6] + [0.0] * (len(got) - 6)


def noisy(prompts, responses, examples):
    return [x + random.random() * 0.1 for x in exact(prompts, responses, examples)]


def rewrites_answer(prompts, responses, examples):
    out = exact(prompts, responses, examples)
    for e in examples:
        e["answer"] = str(e["answer"]).strip() + "!"
    return out


def caches(prompts, responses, examples):
    for e in examples:
        e.setdefault("_seen", True)  # a key added: what the others read is unchanged
    return exact(prompts, responses, examples)


def text_vs_any(prompts, responses, examples):
    return [float(_last(r) == _truth(e)) for r, e in zip(responses, examples)]  # str == int: never


def through_float32(prompts, responses, examples):
    out = []
    for r, e in zip(responses, examples):
        got = _last(r)
        out.append(0.0 if got is None else float(float(got) == float(np.float32(float(_truth(e))))))
    return out


def positional(prompts, responses, examples):
    """Credit for each position of the answer matched (a rule reward that is right for clean data)."""
    out = []
    for r, e in zip(responses, examples):
        a = str(_truth(e))
        out.append(sum(x == y for x, y in zip(r, a)) / max(len(a), 1))
    return out


def length_only(prompts, responses, examples):
    return [min(len(r), 8) / 8 for r in responses]


def probe(fn, examples=None, group=G, responses=None):
    examples = examples if examples is not None else _examples()
    responses = responses if responses is not None else _responses(examples)
    prompts = [e["prompt"] for e in examples]
    call = functools.partial(fn, prompts, responses, examples)
    p = probes_run.RewardProbe()
    after = p.before(
        call,
        source=f"function:t.py:{fn.__name__}",
        data={"reward_fn": "t.py:f"},
        group_size=group,
        ctx={"step": 0},
    )
    assert after is not None
    found = after(call())
    return {f.kind: f for f in found}, p


def test_in_fork_keeps_the_parent_state_and_skips_failures():
    box = {"n": 0}

    def bump():
        box["n"] += 1
        return box["n"]

    assert probes_fork.in_fork(bump) == (True, 1) and box["n"] == 0
    ok, why = probes_fork.in_fork(lambda: 1 / 0)
    assert not ok and "ZeroDivisionError" in why
    ok, why = probes_fork.in_fork(lambda: time.sleep(5), timeout=0.3)
    assert not ok and "longer" in why
    assert probes_fork.in_fork(lambda: 1)[0] is False  # after a hang, no more children for this process
    probes_fork._STOPPED.clear()
    assert probes_fork.in_fork(lambda: 1) == (True, 1)


@pytest.mark.parametrize("fn", [exact, verify_like, counting, group_bonus_right, caches, positional])
def test_correct_rewards_are_quiet_and_can_fire(fn):
    found, p = probe(fn)
    assert set(found) == {K.REWARD_ANSWER_SCORES}, {k: f.message for k, f in found.items()}
    assert found[K.REWARD_ANSWER_SCORES].severity == "info"
    assert p.events and p.events[0][0] == "reward_probe"


def test_the_counter_the_run_sees_counts_only_the_real_call():
    before = _CALLS["n"]
    probe(counting)
    assert _CALLS["n"] == before + 1


def test_a_transposed_group_reshape_follows_the_position():
    found, _ = probe(group_bonus_transposed)
    assert K.REWARD_FOLLOWS_POSITION in found and "reshape" in found[K.REWARD_FOLLOWS_POSITION].fix


@pytest.mark.parametrize("fn", [batch_zscore, best_so_far])
def test_a_normaliser_over_the_batch_or_the_history_depends_on_the_batch(fn):
    _BEST["v"] = 0.0
    found, _ = probe(fn, group=1)
    assert set(found) & {K.REWARD_BATCH_SIZE, K.REWARD_FOLLOWS_POSITION}, found
    if fn is best_so_far:  # the run's state is the real call's only: the probes' calls left no trace
        assert _BEST["v"] == max(len(r) for r in _responses(_examples()))


def test_a_limit_on_the_rows_scored_is_found():
    found, _ = probe(first_rows_only)
    f = found.get(K.REWARD_FOLLOWS_POSITION) or found.get(K.REWARD_BATCH_SIZE)
    assert f is not None and f.severity == "error"


def test_random_noise_is_not_repeatable_and_said_to_be_random():
    found, _ = probe(noisy)
    f = found[K.REWARD_NOT_REPEATABLE]
    assert f.observed["random_state_moved"] and "random" in f.message


def test_a_rewritten_answer_is_a_mutation_and_an_added_key_is_not():
    found, _ = probe(rewrites_answer)
    assert K.REWARD_MUTATES_EXAMPLES in found and "'answer'" in found[K.REWARD_MUTATES_EXAMPLES].message
    assert K.REWARD_MUTATES_EXAMPLES not in probe(caches)[0]


def test_a_text_comparison_with_an_int_ground_truth_cannot_fire():
    exs = _examples([31, 7, 12, 45], field="ground_truth")
    found, _ = probe(text_vs_any, exs, responses=["0"] * len(exs))
    f = found[K.REWARD_ANSWER_UNSCORED]
    assert "int" in f.message and "str(ground_truth)" in f.fix
    assert K.REWARD_ANSWER_SCORES in probe(exact, copy.deepcopy(exs), responses=["0"] * len(exs))[0]


def test_an_exact_float32_comparison_is_named():
    exs = _examples(["0.3", "1.1", "2.7", "0.9"])
    found, _ = probe(through_float32, exs, responses=["0"] * len(exs))
    f = found[K.REWARD_ANSWER_UNSCORED]
    assert "float32" in f.message and "isclose" in f.fix


def test_a_reward_that_reads_something_else_gets_no_claim():
    found, _ = probe(length_only, responses=["a" * (i % 7) for i in range(16)])
    assert K.REWARD_ANSWER_UNSCORED not in found


@pytest.mark.parametrize(
    ("answers", "word"),
    [
        ([" 31", " 7", " 12", " 45"], "strip"),
        (["31.0", "7.0", "12.0", "45.0"], "Int64"),
        (["３１", "７", "１２", "４５"], "NFKC"),
        (["3.1e+06", "7e+06", "1.2e+07", "4.5e+06"], "str(int(x))"),
    ],
)
def test_answers_in_a_form_a_response_does_not_write_are_a_data_finding(answers, word):
    found, _ = probe(positional, _examples(answers), responses=["0"] * 16)
    f = found[K.ANSWER_FORM]
    assert f.where == "data.task (None)" and word in f.fix
    assert K.ANSWER_FORM not in probe(positional, _examples(), responses=["0"] * 16)[0]


def test_probes_run_on_the_first_calls_only_and_can_be_turned_off():
    p = probes_run.RewardProbe(calls=1)
    exs = _examples()
    call = functools.partial(exact, [e["prompt"] for e in exs], _responses(exs), exs)
    for i, expect in ((0, True), (1, False)):
        after = p.before(call, source="function:f", data={}, group_size=G, ctx={"step": i})
        assert bool(after(call())) is expect  # the snapshot stays; the forks only on the first call
    assert (
        probes_run.RewardProbe(enabled=False).before(call, source="f", data={}, group_size=G, ctx={}) is None
    )
    assert probes_fork.bound_inputs(lambda: 1) is None
    with pytest.raises(ValueError, match="audit.probe_plugins"):
        AuditSettings(probe_plugins="yes")


def test_answer_helpers():
    assert probes_answer.canonical(" ４２.0 ") == "42"
    assert probes_answer.reference({"reward_model": {"ground_truth": 7}}) == ("reward_model.ground_truth", 7)
    assert probes_answer._narrow("0.7")["float32"].startswith("0.69999")
    assert probes_answer._narrow("0.5") == {}


# ---------------------------------------------------------------- diagnosis: the probe settles no-signal


def _silent_run(tmp_path, findings):
    from tests.diagnose_runs import causes, make_run
    from verlaudit.rundir import Finding

    fs = [Finding(severity=s, kind=k, message=m, role="reward", where="reward:function:f", step=0, observed=o)
          for s, k, m, o in findings]  # fmt: skip
    metrics = [{"reward/mean": 0.0, "reward/std": 0.0, "reward/identical_group_frac": 1.0} for _ in range(3)]
    return causes(make_run(tmp_path / "run", algo="grpo", steps=3, metrics=metrics, findings=fs))


def test_settle_a_sparse_reward_that_can_fire_is_info(tmp_path):
    fires = ("info", K.REWARD_ANSWER_SCORES, "the reward can fire",
             {"right_mean": 1.0, "wrong_mean": 0.0, "near_miss_rows": 4, "near_miss_scored": 0})  # fmt: skip
    d = _silent_run(tmp_path, [fires])
    assert d.verdict == "clean", [(c.severity, c.title) for c in d.causes]
    assert any("No correct answer sampled yet" in c.title for c in d.causes)


def test_settle_without_the_probe_or_when_it_cannot_fire_stays_a_fault(tmp_path):
    assert _silent_run(tmp_path / "a", []).verdict == "error"
    unscored = ("error", K.REWARD_ANSWER_UNSCORED, "the reward function f cannot fire", {})
    d = _silent_run(tmp_path / "b", [unscored])
    assert d.causes[0].kind == f"finding:{K.REWARD_ANSWER_UNSCORED}", [c.kind for c in d.causes]


# ---------------------------------------------------------------- end to end: clean tiny runs stay quiet


PROBE_KINDS = {
    K.REWARD_NOT_REPEATABLE,
    K.REWARD_FOLLOWS_POSITION,
    K.REWARD_BATCH_SIZE,
    K.REWARD_MUTATES_EXAMPLES,
    K.REWARD_ANSWER_UNSCORED,
    K.ANSWER_FORM,
    K.REWARD_ANSWER_LENIENT,
}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
@pytest.mark.parametrize("preset", ["fp32", "fp16", "bf16", "bf16-pure"])
def test_clean_tiny_runs_have_no_probe_finding(algo, preset):
    from tests.test_root_cause import TINY
    from trainer.config import TrainConfig
    from trainer.train import train
    from verlaudit.audit.auditor import Auditor

    data = copy.deepcopy(TINY)
    data["precision"] = {"preset": preset}
    if algo == "grpo":
        data["algo"] = {
            "name": "grpo",
            "batch_size": 2,
            "mini_batch_size": 4,
            "micro_batch_size": 4,
            "group_size": 2,
        }
    a = Auditor(settings=AuditSettings(level="full", full_steps=1, every=0))
    with a:
        train(TrainConfig.from_dict(data), a)
    found = {f.kind for f in a.findings.all()}
    assert not found & PROBE_KINDS, found
    assert K.REWARD_ANSWER_SCORES in found  # the probe ran on the builtin task's reward


def constant(prompts, responses, examples):
    return [0.5] * len(responses)


def test_a_reward_of_one_value_for_everything_is_left_to_the_constant_checks():
    found, _ = probe(constant)
    assert K.REWARD_ANSWER_UNSCORED not in found and K.REWARD_ANSWER_SCORES not in found


@pytest.mark.parametrize(
    "root",
    ["reward_batch", "reward_stateful", "reward_mutates", "reward_unscored", "answer_form", "reward_lenient"],
)
def test_a_probe_finding_explains_the_reward_symptoms(root):
    from verlaudit.analysis.diagnose.rules import explains

    for symptom in ("no_signal", "reward_constant", "reward_trend"):
        assert explains(root, symptom) is not None, (root, symptom)
    assert explains("no_signal", root) is None


def clipped_but_sorted(prompts, responses, examples):
    return np.sort(np.clip(np.array(positional(prompts, responses, examples)), 0.1, 0.9)).tolist()


_MEMO: dict = {}


def memo_by_prompt(prompts, responses, examples):
    out = []
    for p, r, e in zip(prompts, responses, examples):
        if p not in _MEMO:
            _MEMO[p] = positional([p], [r], [e])[0]
        out.append(_MEMO[p])
    return out


def test_sorted_scores_and_a_cache_by_prompt_are_told_apart():
    found, _ = probe(clipped_but_sorted, group=1, responses=[str(i) * 2 for i in range(16)])
    f = found[K.REWARD_FOLLOWS_POSITION]
    assert "sorted" in f.message and "np.sort" in f.fix
    _MEMO.clear()
    rs = [["31", "3", "0", "x"][i % 4] if i // 4 == 0 else ["x", "7", "0", "x"][i % 4] for i in range(8)]
    exs = _examples(["31", "7"])
    found, _ = probe(memo_by_prompt, exs, responses=rs)
    f = found[K.REWARD_FOLLOWS_POSITION]
    assert "cache" in f.message and "prompt" in f.fix


def bf16_features(prompts, responses, examples):
    """A correct learned-style score computed batched in bf16: its rows must not move with the batch size."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, generator=g).bfloat16()
    feats = torch.stack([torch.tensor([float((hash(r) >> k) & 1) for k in range(64)]) for r in responses])
    return (feats.bfloat16() @ w).float().tolist()


def test_a_batched_bf16_score_is_not_batch_dependent():
    found, _ = probe(bf16_features)
    assert not set(found) & {K.REWARD_BATCH_SIZE, K.REWARD_FOLLOWS_POSITION, K.REWARD_NOT_REPEATABLE}, found
