"""`verlaudit recommend`: candidates per algorithm, tolerances and their errors, the ranking and why
each loser lost (pure, on hand-made measurements), and the whole command on a tiny DPO suite where
bf16-pure is planted to lose its updates (lr 1e-6): bf16 is recommended, bf16-pure is out for the
lost updates. The planted loser is judged by its own run's gradient-health records; the ranking by
planned memory is the planner's arithmetic, so nothing depends on the CPU's speed or rounding.

Run: `pytest tests/test_recommend.py` (the end-to-end test: about a minute on 2 cores).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from verlaudit import cli
from verlaudit.run.recommend import Measured, Tolerance, candidates, rank, render, update_loss
from verlaudit.run.suite import load_suite

ROOT = Path(__file__).resolve().parents[1]
DPO = ROOT / "suites" / "dpo_tiny_cpu.yaml"
PPO = ROOT / "suites" / "tiny_cpu.yaml"


def test_candidates_follow_the_algorithm():
    recipes = ["fp32", "bf16", "bf16.fp32-critic", "fp32.bf16-ref"]
    dpo = candidates(load_suite(DPO), recipes, ["suite"])
    assert list(dpo) == ["fp32", "bf16", "fp32.bf16-ref"]  # DPO has a reference, no critic
    assert dpo["fp32.bf16-ref"]["precision"]["overrides"] == {
        "reference": {"param_dtype": "bf16", "compute_dtype": "bf16"}
    }
    ppo = candidates(load_suite(PPO), recipes, ["no-ckpt", "ckpt"])
    assert "bf16.fp32-critic-ckpt" in ppo and ppo["bf16-no-ckpt"]["precision"]["grad_checkpointing"] is False
    with pytest.raises(ValueError, match="--recipes: unknown recipe 'bf61'"):
        candidates(load_suite(DPO), ["bf61"], ["suite"])


def test_tolerance_parsing():
    assert Tolerance.parse("logprob=0.1, update_loss=0.5") == Tolerance(logprob=0.1, update_loss=0.5)
    for bad, msg in [
        ("logprob", "expected key=value"),
        ("colour=1", "expected key=value"),
        ("logprob=x", "is not a number"),
        ("ratio=0", "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Tolerance.parse(bad)


def test_update_loss_is_the_worst_role_weighted_by_size():
    recs = [
        {"measure": "update_loss", "role": "actor", "lost_frac": 1.0, "size": 100, "sampled": 100},
        {"measure": "update_loss", "role": "actor", "lost_frac": 0.0, "size": 300, "sampled": 300},
        {"measure": "update_loss", "role": "critic", "lost_frac": 0.5, "size": 10, "sampled": 10},
        {"measure": "fp16_underflow", "role": "actor"},
    ]
    assert update_loss(recs) == 0.5  # actor (100 x 1 + 300 x 0) / 400 = 0.25; critic 0.5
    assert math.isnan(update_loss([]))


def _m(name, planned, step, **kw):
    return Measured(
        name=name,
        planned_gib=planned,
        target_gib=80.0,
        state="completed",
        status="completed",
        step_s=step,
        logprob=0.01,
        ratio=1.0,
        update_loss=0.0,
        **kw,
    )


def test_rank_and_the_reasons_each_loser_lost():
    ms = [
        _m("fp32", 70.0, 9.0),
        _m("bf16", 60.0, 2.0),
        _m("bf16-pure", 30.0, 1.5, **{}),
        Measured(name="bf16-no-ckpt", planned_gib=120.0, target_gib=80.0),
        _m("fp16", 60.0, 1.9),
    ]
    ms[2].update_loss = 0.98
    ms[4].logprob = 0.2
    tol = Tolerance()
    by_time = rank(ms, tol, "time")
    assert [m.name for m in by_time] == ["bf16", "fp32", "bf16-pure", "bf16-no-ckpt", "fp16"]
    assert by_time[2].lost == ["98% of updates lost to rounding > 25%"]
    assert by_time[3].lost == ["does not fit: planned 120.0 GiB > target 80.0 GiB"]
    assert by_time[4].lost == ["log-prob error 0.2 nats/token > 0.05"]
    text = render(
        by_time, {m.name: {"precision": {"preset": m.name, "overrides": {}}} for m in ms}, tol, "time"
    )
    snippet = text.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(snippet) == {"variants": {"recommended-bf16": {"precision": {"preset": "bf16"}}}}
    assert "- fp32: within tolerance but costlier (9 s/step vs 2" in text
    assert "- bf16-pure: 98% of updates lost" in text
    by_memory = rank(ms, Tolerance(update_loss=0.99), "memory")
    assert by_memory[0].name == "bf16-pure"


def test_the_shadow_that_does_not_fit_is_said_so():
    # planned 70 GiB + 12 GiB of shadow > 80: not started, and the shadow named, not the recipe
    tight = _m("bf16", 70.0, 2.0, shadow_gib=12.0)
    tight.state, tight.status = "not run", "not run"
    # planned 60 + 5 fits, but the run ran out of memory on step 0 (the shadowed one): the shadow
    oom = _m("fp16", 60.0, math.nan, shadow_gib=5.0)
    oom.state, oom.status = "failed", "failed at step 0 (actor_update): oom"
    oom.failure = {"reason": "oom", "step": 0, "phase": "actor_update"}
    # out of memory on a later step is the recipe's own failure
    later = _m("fp32", 60.0, math.nan, shadow_gib=5.0)
    later.state, later.status = "failed", "failed at step 2 (actor_update): oom"
    later.failure = {"reason": "oom", "step": 2, "phase": "actor_update"}
    ranked = rank([tight, oom, later], Tolerance(), "time")
    assert not tight.fits and tight.lost == [
        "the shadow does not fit: planned 70.0 GiB + 12.0 GiB for the fp32 shadow > target 80.0 GiB "
        "(fewer --rows shrink the shadow)"
    ]
    assert oom.lost[0].startswith(
        "the shadow did not fit: out of memory on step 0, the shadowed one, in "
        "actor_update (planned 60.0 GiB + 5.0 GiB shadow)"
    )
    assert later.lost == ["run failed at step 2 (actor_update): oom"]
    text = render(ranked, {m.name: {"precision": {"preset": m.name}} for m in ranked}, Tolerance(), "time")
    assert "| 70 + 12 shadow (does not fit) |" in text.replace("  ", " ")


def test_recommend_picks_bf16_when_bf16_pure_loses_its_updates(tmp_path, capsys):
    suite = tmp_path / "dpo.yaml"
    text = DPO.read_text().replace("lr: 1.0e-3", "lr: 1.0e-6")  # bf16-pure's updates round away at this lr
    suite.write_text(text)
    out = tmp_path / "rec"
    rc = cli.main(
        [
            "recommend",
            str(suite),
            "--recipes",
            "fp32,bf16,bf16-pure",
            "--steps",
            "3",
            "--rank-by",
            "memory",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "Recommended: bf16." in printed
    assert "- bf16-pure: " in printed and "of updates lost to rounding > 25%" in printed
    assert "- fp32: within tolerance but costlier" in printed
    assert (out / "recommend.md").exists() and (out / "bf16-pure" / "gradhealth.jsonl").exists()
    assert (out / "bf16" / "shadow.jsonl").exists() and (out / "report.md").exists()


def test_recommend_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["recommend", str(DPO), "--steps", "1"]) == 2
    assert "--steps: 1; at least 2" in capsys.readouterr().err
    assert cli.main(["recommend", str(DPO), "--recipes", "bf16.fp32-critic"]) == 2
    assert "none of bf16.fp32-critic applies to dpo" in capsys.readouterr().err
