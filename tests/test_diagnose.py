"""`verlaudit diagnose` on run directories with planted faults (written the way the worker writes
them) (foreign logs: test_diagnose_logs.py); clean runs report no error. Real-run checks live in test_ci_baseline.py."""

import dataclasses
import json
import math

import pytest

from tests.diagnose_runs import _healthy, causes, make_run, run_cli  # noqa: F401  (re-exported for older imports)
from trainer.config import TrainConfig
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.analysis.diagnose.failure import memory_at_failure
from verlaudit.rundir import Finding, read_run


def test_clean_run_has_no_error(tmp_path):
    d = causes(make_run(tmp_path / "fp32"))
    assert d.verdict == "clean" and d.causes == [] and d.state == "completed"
    assert run_cli([str(tmp_path / "fp32")]) == 0


def test_completed_with_warning_finding(tmp_path):
    f = Finding(
        severity="warning",
        kind="rollout/precision_mismatch",
        role="rollout",
        where="engine",
        step=0,
        observed="bf16",
        expected="fp32",
        message="rollout/train precision mismatch",
        fix="set precision.overrides.rollout.compute_dtype: fp32 (verl actor_rollout_ref.rollout.dtype)",
    )
    d = causes(make_run(tmp_path / "bf16", preset="bf16", findings=[f]))
    assert d.verdict == "warning" and d.state == "completed with warnings"
    (c,) = d.causes
    assert c.kind == "finding:rollout/precision_mismatch" and c.where == "engine"
    assert "actor_rollout_ref.rollout.dtype" in c.fixes[0].why


def test_nan_names_first_step_and_producer_module(tmp_path):
    metrics = [_healthy(s) for s in range(4)]
    metrics[2]["actor/loss"] = float("nan")
    metrics[3]["actor/loss"] = float("nan")
    findings = [
        # the propagating module comes later in execution order; the producer must win
        Finding(
            severity="error",
            kind="numerics/nonfinite_forward",
            role="actor",
            where="model.layers.1.mlp",
            step=2,
            phase="actor_update",
            message="first non-finite output (inputs finite)",
            rank=0,
        ),
        Finding(
            severity="warning",
            kind="numerics/nonfinite_propagated",
            role="actor",
            where="model.norm",
            step=2,
            message="propagated NaN",
            rank=1,
        ),
    ]
    run = make_run(
        tmp_path / "nan",
        steps=4,
        metrics=metrics,
        findings=findings,
        status=(
            "failed",
            {
                "reason": "nonfinite",
                "step": 3,
                "phase": "actor_update",
                "error": "non-finite loss for 2 consecutive steps",
            },
        ),
    )
    d = causes(run)
    top = d.causes[0]
    assert d.verdict == "error" and top.kind == "nonfinite"
    assert top.step == 2 and top.where == "model.layers.1.mlp"
    assert any("actor/loss = nan at step 2" in e for e in top.evidence)
    assert run_cli([str(run)]) == 1


def test_fp16_overflow_loss_scale_history_before_nan(tmp_path):
    # scale halves on every overflow: 65536 -> 32768 -> ... then NaN at step 5
    metrics = []
    for s in range(6):
        m = _healthy(s)
        m["actor/loss_scale"] = 65536.0 / 2**s
        m["actor/skipped"] = 1.0 if s >= 1 else 0.0
        metrics.append(m)
    metrics[5]["actor/loss"] = float("inf")
    d = causes(make_run(tmp_path / "fp16", preset="fp16", steps=6, metrics=metrics))
    nf = next(c for c in d.causes if c.kind == "nonfinite")
    assert nf.step == 5
    hist = next(e for e in nf.evidence if e.startswith("loss scale before it"))
    assert "0:6.554e+04" in hist and "5:2048" in hist
    # the overflow skips from step 1 explain the inf at step 5: they are the root, and carry the fix
    root = d.causes[0]
    assert root.kind == "loss_scale_collapse" and nf.consequence_of == root.title and not nf.fixes
    assert any(f.suite == "precision.preset: bf16" for f in root.fixes)
    # 5 consecutive skips: the scaler is no longer recovering
    assert any(c.kind == "loss_scale_collapse" and c.severity == "error" for c in d.causes)


def test_loss_scale_collapse_names_overflowing_module(tmp_path):
    metrics = []
    for s in range(12):
        m = _healthy(s)
        m["actor/loss_scale"] = max(65536.0 / 4**s, 0.5)  # 2^16 / 4^s: 1.0 at step 8, clamped to 0.5 after
        m["actor/skipped"] = 1.0
        metrics.append(m)
    f = Finding(
        severity="warning",
        kind="numerics/overflow",
        role="actor",
        where="model.layers.0.mlp.down_proj",
        step=0,
        message="absmax 7e4 exceeds fp16 max",
        observed=7e4,
        expected=65504,
    )
    d = causes(make_run(tmp_path / "fp16", preset="fp16", steps=12, metrics=metrics, findings=[f]))
    c = next(c for c in d.causes if c.kind == "loss_scale_collapse")
    assert c.severity == "error" and c.where == "model.layers.0.mlp.down_proj"
    assert c.data["skipped"] == 12 and c.data["final_scale"] == 0.5


def test_a_few_early_skips_are_info_only(tmp_path):
    metrics = [_healthy(s) for s in range(20)]
    metrics[0]["actor/skipped"] = 1.0  # 1 of 20 = 5%: calibration
    d = causes(make_run(tmp_path / "fp16", preset="fp16", steps=20, metrics=metrics))
    assert d.verdict == "clean" and [c.severity for c in d.causes] == ["info"]


def test_dtype_error_boundary_observed_expected(tmp_path):
    f = Finding(
        severity="error",
        kind="runtime/dtype_error",
        role="actor",
        where="model.layers.0.self_attn.q_proj",
        step=0,
        phase="rollout",
        observed="fp32",
        expected="bf16",
        message="mat1 and mat2 must have the same dtype, but got Float and BFloat16",
    )
    run = make_run(
        tmp_path / "bf16-pure",
        preset="bf16-pure",
        steps=3,
        metrics=[],
        findings=[f],
        status=(
            "failed",
            {
                "reason": "dtype_error",
                "step": 0,
                "phase": "rollout",
                "error": "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16",
            },
        ),
    )
    top = causes(run).causes[0]
    assert top.kind == "dtype_error" and top.where == "model.layers.0.self_attn.q_proj"
    assert top.data == {"observed": "fp32", "expected": "bf16"}


def test_dtype_error_without_finding_parses_status_message(tmp_path):
    run = make_run(
        tmp_path / "x",
        steps=3,
        metrics=[],
        status=(
            "failed",
            {
                "reason": "dtype_error",
                "step": 1,
                "phase": "reward",
                "error": "RuntimeError: expected scalar type BFloat16 but found Float",
            },
        ),
    )
    top = causes(run).causes[0]
    assert top.kind == "dtype_error" and top.data == {"observed": "fp32", "expected": "bf16"}


def test_oom_phase_allocator_view_and_dominant_class(tmp_path):
    # llama2-7b, fp32 everything, PPO (actor + critic + reference): model state is ~ 7e9 x (4+4+4+8) bytes
    # for the actor alone, far above activations of micro-batch 1 x 24 tokens -> model state dominates.
    mem = {"allocated_gb": 78.1, "reserved_gb": 79.0, "total_gb": 79.6, "device_used_gb": 79.5}
    run = make_run(
        tmp_path / "fp32",
        steps=5,
        metrics=[],
        model={"preset": "llama2-7b"},
        algo="ppo",
        status=(
            "failed",
            {
                "reason": "oom",
                "step": 0,
                "phase": "actor_update",
                "error": "CUDA out of memory. Tried to allocate 1.00 GiB",
                "memory": mem,
            },
        ),
    )
    top = causes(run).causes[0]
    assert top.kind == "oom" and top.where == "actor_update" and top.step == 0
    assert top.data["dominant"] in ("optimizer state", "parameters")
    assert any("allocated_gb=78.1" in e for e in top.evidence)
    assert any(
        f.suite == "precision.preset: bf16-pure" and "model_dtype=bfloat16" in f.verl for f in top.fixes
    )


def test_oom_activations_dominate_suggests_checkpointing(tmp_path):
    # tiny model, long sequences and a big micro-batch: activations >> the ~0.1M-parameter model state
    run = make_run(
        tmp_path / "bf16",
        preset="bf16",
        steps=5,
        metrics=[],
        data={"prompt_length": 512, "response_length": 512},
        status=("failed", {"reason": "oom", "step": 2, "phase": "actor_update", "memory": {}}),
    )
    top = causes(run).causes[0]
    assert top.data["dominant"] == "activations"
    assert top.fixes[0].suite == "precision.grad_checkpointing: true"
    assert top.fixes[0].verl == "actor_rollout_ref.model.enable_gradient_checkpointing=True"


def test_memory_at_failure_is_the_planners_phase(tmp_path):
    # tiny-llama fp32 GRPO (actor + reference), OOM at step 0 in actor_update with one optimizer step
    # per training step: the candidates are the planner's old-log-prob forward and the four
    # actor_update moments; without a device capacity the largest is chosen. AdamW moments do not
    # exist before the first optimizer step, so only the "optimizer step" moment may carry them.
    from verlaudit.plan.planner import plan_config

    algo = {"name": "grpo", "batch_size": 2, "group_size": 2, "mini_batch_size": 4, "micro_batch_size": 2}
    run = read_run(
        make_run(
            tmp_path / "g",
            algo=algo,
            steps=2,
            metrics=[],
            status=("failed", {"reason": "oom", "step": 0, "phase": "actor_update"}),
        )
    )
    est = memory_at_failure(run, "actor_update", 0)
    full, _ = plan_config(TrainConfig.from_dict(run.manifest["config"]), optimizer="foreach")
    by_name = {p.name: p for p in full.phases}
    assert est.phase.startswith(("actor_update:", "old log-probs:")) and est.phase in by_name
    moments = by_name[est.phase].components.get("actor optimizer moments", 0) / 1024**3
    expected = by_name[est.phase].total / 1024**3 - (0 if est.phase.endswith("optimizer step") else moments)
    assert math.isclose(est.allocated, expected)
    assert math.isclose(sum(est.classes.values()), est.allocated)
    assert math.isclose(sum(est.components.values()), est.allocated)
    # the actor's fp32 parameters are in the chosen moment: 4 bytes x the planner's parameter count
    assert est.components["actor params"] > 0 and est.classes["parameters"] >= est.components["actor params"]
    assert any("first step" in n for n in est.notes)


def test_oom_fixture_from_the_h200_suite(capsys):
    # Real run directory (tests/fixtures/h200_dpo_suite, copied from the H200 suite run): Llama-2-7B DPO,
    # bf16 autocast without checkpointing, 8 pairs x 1024 tokens, OOM at step 0 in the actor's forward
    # (model.layers.25.mlp) with 138.4 GiB allocated of 139.8 GiB. The planner at the end of the forward,
    # before any AdamW moments exist: activations 112 GiB (32 layers x 16 seqs x 1024 tokens x 30h+8I
    # bytes = 30*4096+8*11008 = 210,944 B/token/layer -> 103 GiB, plus the fp32 residual inputs
    # 4h = 16 KiB -> 8 GiB), fp32 actor 25.1, bf16 reference 12.6, autocast copies 12.3 -> activations dominate.
    from pathlib import Path

    suite = Path(__file__).parent / "fixtures" / "h200_dpo_suite"
    d = causes(suite / "bf16-no-ckpt")
    top = d.causes[0]
    assert d.state == "failed at step 0 (actor_update): oom"
    assert top.kind == "oom" and top.step == 0 and top.where == "actor_update"
    est = top.data["estimate"]
    assert top.data["dominant"] == "activations" and est["phase"] == "actor_update: end of forward"
    assert 110 < est["components"]["actor activations"] < 114
    assert "actor optimizer moments" not in est["components"]  # step 0: not allocated yet
    assert est["capacity"] == pytest.approx(139.8, abs=0.01) and est["device"] > est["capacity"]
    assert any("max_allocated_gb=138.4" in e for e in top.evidence)
    assert any("model.layers.25.mlp" in e for e in top.evidence)
    ckpt = top.fixes[0]
    assert ckpt.suite == "precision.grad_checkpointing: true"
    assert ckpt.verl == "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    # the bf16 variant with checkpointing completed at 116.7 GiB allocated: the planner agrees it fits
    assert "fits" in ckpt.why and "NOT" not in ckpt.why
    # the real CLI on the suite directory: summary first, the OOM is an error -> exit 1
    assert run_cli([str(suite)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("summary (2 runs):") and "activations dominate" in out


def test_killed_run_without_status_and_truncated_line(tmp_path):
    run = make_run(tmp_path / "k", steps=5, metrics=[_healthy(s) for s in range(3)], status=None)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "actor/lo')  # the writer died mid-line
    d = causes(run)
    assert d.state.startswith("killed") and d.causes[0].kind == "killed"
    assert "step 2" in d.causes[0].evidence[0]


def test_exception_failure_is_reported_with_innermost_frame(tmp_path):
    run = make_run(
        tmp_path / "e",
        steps=2,
        metrics=[],
        status=(
            "failed",
            {
                "reason": "exception",
                "step": 0,
                "phase": "reward",
                "error": "KeyError: 'answer'",
                "traceback": "Traceback (most recent call last):\n  File \"my_reward.py\", line 3, in reward\nKeyError: 'answer'",
            },
        ),
    )
    top = causes(run).causes[0]
    assert top.kind == "exception" and "my_reward.py" in top.evidence[0]


def test_reward_variance_collapse(tmp_path):
    metrics = [_healthy(s) for s in range(12)]
    for m in metrics[6:]:
        m["critic/score/std"] = 0.0
    d = causes(make_run(tmp_path / "r", algo="grpo", steps=12, metrics=metrics))
    assert any(c.kind == "reward_collapse" and "variance" in c.title for c in d.causes)


def test_reward_mean_collapse(tmp_path):
    scores = [0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.6, 0.3, 0.1, 0.05, 0.0, 0.0]
    metrics = [dict(_healthy(s), **{"critic/score/mean": v}) for s, v in enumerate(scores)]
    d = causes(make_run(tmp_path / "r", steps=12, metrics=metrics))
    c = next(c for c in d.causes if c.kind == "reward_collapse")
    assert c.severity == "warning" and "0.6667" in c.title  # best 3-step window (0.6+0.7+0.7)/3


def test_exploding_reward_variance(tmp_path):
    metrics = [dict(_healthy(s), **{"critic/score/std": 0.1 * 4**s}) for s in range(8)]
    d = causes(make_run(tmp_path / "r", steps=8, metrics=metrics))
    assert any(c.kind == "reward_variance" for c in d.causes)


def test_suite_dir_summary_first_and_json(tmp_path, capsys):
    make_run(tmp_path / "fp32")
    metrics = [_healthy(s) for s in range(3)]
    metrics[1]["actor/loss"] = float("nan")
    make_run(tmp_path / "fp16", preset="fp16", steps=3, metrics=metrics)
    (tmp_path / "report.md").write_text("not a run")
    assert run_cli([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("summary (2 runs):")
    assert run_cli([str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    by = {d["name"]: d for d in data["diagnoses"]}
    assert by["fp32"]["verdict"] == "clean" and by["fp16"]["causes"][0]["kind"] == "nonfinite"


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "nope: no such file or directory"),
        ("not_a_run", "neither a run directory"),
        ("damaged_manifest", "manifest.json: not valid JSON"),
        ("damaged_status", "status.json: not valid JSON"),
        ("list_manifest", r"manifest.json: expected a JSON object \{\.\.\.\}, got a list"),
        # neither a log nor a run directory: never "clean" with exit 0
        ("dev_null", "/dev/null: a device or a pipe, not a file: neither a log nor a run directory"),
        ("empty_file", "empty.log: empty file: neither a log nor a run directory"),
        ("blank_file", "blank.log: empty file: neither a log nor a run directory"),
        ("binary_file", "model.bin: a binary file: neither a log nor a run directory"),
        ("gzip_file", "train.log.gz: a binary file: neither a log nor a run directory"),
    ],
)
def test_bad_paths_are_one_paragraph_exit_2(tmp_path, capsys, case, match):
    import gzip
    import re

    (tmp_path / "empty").mkdir()
    path = tmp_path / ("nope" if case == "missing" else "empty")
    files = {"empty_file": ("empty.log", b""), "blank_file": ("blank.log", b"\n  \n\t\n"),
             "binary_file": ("model.bin", bytes(range(256)) * 64),
             "gzip_file": ("train.log.gz", gzip.compress(b"step:1 - actor/pg_loss:nan\n" * 200))}  # fmt: skip
    if case in files:
        path = tmp_path / files[case][0]
        path.write_bytes(files[case][1])
    if case == "dev_null":
        path = "/dev/null"
    if case == "list_manifest":
        path = make_run(tmp_path / "d", steps=2)
        (path / "manifest.json").write_text("[1, 2]")
    if case.startswith("damaged"):
        path = make_run(tmp_path / "d", steps=2)
        (path / f"{case.removeprefix('damaged_')}.json").write_text('{"state": "comp')  # cut mid-write
    assert run_cli([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verlaudit diagnose: error: ") and "Traceback" not in err
    assert err.strip().count("\n") == 0 and re.search(match, err), err


# ---- real runs: the worker with planted faults (tiny shapes, 2 steps, in-process) -----------------


def run_worker(tmp_path, name, inject, *, preset="fp32", steps=2, **train):
    from trainer.precision import resolve_policy
    from verlaudit.run import worker

    cfg = {
        "model": {"preset": "tiny-llama"},
        "data": {"task": "digits", "prompt_length": 8, "response_length": 4, "num_examples": 64},
        "algo": {"name": "ppo", "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 4},
        "precision": {"preset": preset},
        "steps": steps,
        "device": "cpu",
        "threads": 1,
        **train,
    }
    spec = {
        "variant": name,
        "suite": "faults",
        "seed": 0,
        "run_dir": str(tmp_path / name),
        "train": cfg,
        "audit": {"level": "full", "full_steps": steps, "every": 1},
        "emulation": {"target": None, "memory_cap_gb": None, "reason": None},
        "inject": inject,
        # what the runner decides for a spec: the device type and the policy
        "device": "cpu",
        "policy": resolve_policy(preset).to_dict(),
    }
    (tmp_path / f"{name}.json").write_text(json.dumps(spec))
    rc = worker.main([str(tmp_path / f"{name}.json")])
    return rc, tmp_path / name


def test_real_nan_in_module_names_producer(tmp_path):
    rc, run = run_worker(
        tmp_path,
        "nan",
        {"nan_in_module": "model.layers.1.mlp", "at_step": 1, "phase": "actor_update", "role": "actor"},
        abort_on_nonfinite_loss=1,
    )
    top = causes(run).causes[0]  # the injected NaN may leave the loss finite: the grads are NaN
    assert top.kind == "nonfinite" and top.step == 1 and top.severity == "error", top
    assert top.where and top.where.startswith("model.layers.1.mlp"), top.evidence


def test_real_fp16_overflow_recovered_by_scaler_names_module(tmp_path):
    # a one-off x1e6 at step 0: backward overflows, the scaler skips and backs off, then recovers
    rc, run = run_worker(
        tmp_path,
        "ovf",
        {"scale_module_output": {"module": "model.layers.0.mlp.down_proj", "factor": 1e6, "at_step": 0}},
        preset="fp16",
        steps=4,
    )
    assert rc == 0
    c = next(c for c in causes(run).causes if c.kind in ("overflow_skips", "loss_scale_collapse"))
    assert c.where == "model.layers.0.mlp.down_proj" and c.step == 0
    assert any("loss scale: 0:3.277e+04" in e for e in c.evidence)  # 65536 backed off to 32768


def test_real_fp16_forward_overflow_kills_rollout(tmp_path):
    # x1e9 on every call: inf in the forward, sampling then fails on NaN probabilities
    rc, run = run_worker(
        tmp_path,
        "inf",
        {"scale_module_output": {"module": "model.layers.0.mlp.down_proj", "factor": 1e9}},
        preset="fp16",
    )
    assert rc == 1
    top = causes(run).causes[0]
    assert top.kind == "nonfinite" and top.where == "model.layers.0.mlp.down_proj", top
    assert any(f.suite == "precision.preset: bf16" for f in top.fixes)


def test_real_dtype_error_names_module_and_dtypes(tmp_path):
    rc, run = run_worker(tmp_path, "dt", {"cast_module": {"module": "model.layers.0.mlp", "dtype": "bf16"}})
    assert rc == 1
    d = causes(run)
    # the root: the module stored in bf16 (seen at setup); the dtype error is its consequence
    root = d.causes[0]
    assert root.kind == "finding:dtype/param_storage" and root.where.startswith("model.layers.0.mlp"), root
    assert root.chain[-1].startswith("dtype_error in model.layers.0.mlp"), root.chain
    err = next(c for c in d.causes if c.kind == "dtype_error")
    assert err.where.startswith("model.layers.0.mlp") and err.consequence_of == root.title and not err.fixes
    assert {err.data["observed"], err.data["expected"]} == {"fp32", "bf16"}


def test_real_oom_names_phase(tmp_path):
    rc, run = run_worker(
        tmp_path, "oom", {"raise_in_phase": {"phase": "actor_update", "at_step": 1, "error": "oom"}}
    )
    assert rc == 1
    top = causes(run).causes[0]
    assert top.kind == "oom" and top.where == "actor_update" and top.step == 1
    assert top.data["estimate"]["classes"]  # tiny-llama resolves from the preset
    assert any("phase_peak_gb_so_far" in e for e in top.evidence)


TRAINING_FORWARD_TB = (
    'Traceback (most recent call last):\n  File "trainer/ppo.py", line 412, in run\n'
    '  File "trainer/ppo.py", line 178, in update_actor\n  File "trainer/ppo.py", line 121, in actor_logprobs\n'
    "torch.OutOfMemoryError: CUDA out of memory."
)
"""A traceback of an OOM in the actor's training forward (update_actor), as status.json keeps it."""


def test_oom_with_selective_checkpointing_suggests_checkpointing_all_layers(tmp_path):
    # tiny-llama has 2 decoder layers; only the first was checkpointed. The traceback shows the training
    # forward, where the kept activations live (the old-log-prob forward keeps none)
    precision = {"preset": "bf16", "grad_checkpointing": True, "checkpoint_layers": 1}
    oom = {
        "reason": "oom",
        "step": 0,
        "phase": "actor_update",
        "memory": {},
        "traceback": TRAINING_FORWARD_TB,
    }
    run = make_run(
        tmp_path / "sel",
        preset="bf16",
        steps=5,
        metrics=[],
        precision=precision,
        data={"prompt_length": 512, "response_length": 512},
        status=("failed", oom),
    )
    top = causes(run).causes[0]
    assert top.data["dominant"] == "activations"
    assert top.data["estimate"]["phase"].startswith("actor_update:")  # not the old-log-prob forward
    assert top.fixes[0].suite.startswith("precision.checkpoint_layers: auto")
    assert "only the first 1 decoder layers were checkpointed" in top.fixes[0].why
    assert "planner:" in top.fixes[0].why
    # already checkpointing every layer: no advice to turn it on
    full = make_run(
        tmp_path / "full",
        preset="bf16",
        steps=5,
        metrics=[],
        precision={"preset": "bf16", "grad_checkpointing": True},
        data={"prompt_length": 512, "response_length": 512},
        status=("failed", oom),
    )
    assert all("grad_checkpointing" not in (f.suite or "") for f in causes(full).causes[0].fixes)


def test_torch_compile_failure_names_the_compiled_path(tmp_path):
    # the error and traceback of a real failure on the H200 (this project, rollout.compile under
    # checkpointing, 2026-11-29), trimmed
    import json
    from pathlib import Path

    rec = json.loads((Path(__file__).parent / "data" / "dynamo_failure_h200.json").read_text())
    run = make_run(
        tmp_path / "fast",
        preset="bf16",
        steps=3,
        metrics=[],
        rollout={"engine": "fused", "compile": True},  # the failed run compiled its decode step
        model={"compile": True},  # and its layers (a fix that sets a key to its value is dropped)
        status=(
            "failed",
            {
                "reason": "exception",
                "step": rec["step"],
                "phase": rec["phase"],
                "error": rec["error"],
                "traceback": rec["traceback"],
            },
        ),
    )
    top = causes(run).causes[0]
    assert top.kind == "compile_error" and "rollout's decode step" in top.title
    assert top.fixes[0].suite == "rollout.compile: false"
    assert any("Unsupported Tensor.requires_grad_()" in e for e in top.evidence)
    assert any(f.verl == "actor_rollout_ref.actor.use_torch_compile=False" for f in top.fixes)


DEVICE_TB = (
    "Traceback (most recent call last):\n"
    '  File "/app/trainer/ppo.py", line 452, in run\n    scores = score_responses(setup, rollout)\n'
    '  File "/app/my_reward.py", line 9, in reward\n    return torch.stack(scores) * mask\n'
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
)


def _failed_with(tmp_path, name, error, traceback, phase="reward"):
    status = {"reason": "exception", "step": 1, "phase": phase, "error": error, "traceback": traceback}
    return make_run(tmp_path / name, steps=3, metrics=[], status=("failed", status))


def test_a_runs_traceback_goes_through_the_log_rules_families(tmp_path):
    # one implementation of each cause: the run's recorded traceback and the same text as a log give
    # the same cause (kind, title, what, fixes); the run's step, phase and role are the run's own
    run = _failed_with(tmp_path, "dev", DEVICE_TB.splitlines()[-1], DEVICE_TB)
    top = causes(run).causes[0]
    (log,) = diagnose_path(_write(tmp_path / "dev.log", DEVICE_TB))
    same = log.causes[0]
    assert (
        (top.kind, top.title, top.what)
        == (same.kind, same.title, same.what)
        == ("device_mismatch", same.title, same.what)
    )
    assert top.fixes == same.fixes and top.fixes[0].verl is not None  # our trainer: suite and verl keys
    assert (top.step, top.phase, top.line, top.cls) == (1, "reward", None, "exception")
    assert any("my_reward.py:9 in reward" in e for e in top.evidence)
    # a rule the log families have is the run's too: a missing module, a native extension's symbol
    imp = "ModuleNotFoundError: No module named 'flash_attn'"
    tb = f'Traceback (most recent call last):\n  File "/app/trainer/models.py", line 40, in load\n{imp}'
    top = causes(_failed_with(tmp_path, "imp", imp, tb, phase=None)).causes[0]
    assert (
        top.kind == "import_error"
        and top.where == "flash_attn"
        and "pip install flash-attn" in top.fixes[0].why
    )


def test_a_runs_traceback_without_a_recorded_phase_takes_the_trainer_phase_its_frames_show(tmp_path):
    oom = "torch.OutOfMemoryError: CUDA error: out of memory"
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/app/trainer/ppo.py", line 470, in run\n    stats = update_critic(setup, observer, rollout)\n'
        '  File "/app/trainer/ppo.py", line 230, in update_critic\n    backward(loss)\n'
        f"{oom}"
    )
    status = {"reason": "exception", "step": 2, "phase": None, "error": oom, "traceback": tb}
    run = make_run(tmp_path / "oom", steps=3, metrics=[], status=("failed", status))
    top = causes(run).causes[0]
    assert top.kind == "oom" and top.phase == "critic_update" and top.step == 2


def _write(path, text):
    path.write_text(text)
    return path


def test_nan_gradients_from_the_first_step_with_a_finite_loss_point_at_the_backward(tmp_path):
    # The pattern of the first 7B GRPO run on the H200 (2026-11-29): finite losses, every parameter's
    # gradient NaN from step 0, every step skipped, bf16 without loss scaling. The grads finding names
    # parameters in registration order (embed_tokens first): it must not be called the producer.
    grads = Finding(
        severity="error",
        kind="numerics/nonfinite_grads",
        role="actor",
        where="model.embed_tokens",
        step=0,
        phase="actor_update",
        message="6319984640 non-finite actor gradient elements (first: model.embed_tokens.weight)",
        observed={"elements": 6319984640, "first_params": ["model.embed_tokens.weight"]},
        expected="finite",
    )
    metrics = [
        {
            **_healthy(s),
            "actor/skipped": 1.0,
            "actor/grad_norm": float("nan"),
            "numerics/actor/nonfinite_grads": 6.3e9,
        }
        for s in range(3)
    ]
    run = make_run(
        tmp_path / "grpo-bf16", preset="bf16", algo="grpo", steps=3, metrics=metrics, findings=[grads]
    )
    top = causes(run).causes[0]
    assert top.kind == "nonfinite" and "NaN made in the backward pass" in top.title
    assert "embed_tokens" not in top.title and "left padding" in top.what
    assert top.fixes[0].verl == "actor_rollout_ref.model.use_remove_padding=True"
    # the same NaN after some healthy steps is divergence-shaped: the generic causes stay
    late = [*(_healthy(s) for s in range(3)), *metrics]
    for i, m in enumerate(late):
        m["step"] = i
    run2 = make_run(
        tmp_path / "late",
        preset="bf16",
        algo="grpo",
        steps=6,
        metrics=late,
        findings=[dataclasses.replace(grads, step=3)],
    )
    assert "backward pass" not in causes(run2).causes[0].title


def test_a_preflight_refusal_names_the_key_and_what_to_do(tmp_path):
    error = (
        "/s.yaml:6: train.model.critic_path: '/m/critic' embeds 64 ids but the tokenizer has 100; use the "
        "tokenizer the model was trained with (model.tokenizer), or a checkpoint with that vocabulary"
    )
    run = make_run(tmp_path / "r", status=("failed", {"reason": "preflight", "error": error, "step": None}))
    d = causes(run)
    first = d.causes[0]
    assert d.verdict == "error" and first.kind == "preflight" and first.where == "model.critic_path"
    assert d.state == "failed at setup: preflight"
    assert "embeds 64 ids" in first.title and first.fixes[0].suite == "model.critic_path"
    assert first.fixes[0].why.startswith("use the tokenizer the model was trained with")


def test_a_user_error_naming_a_plugin_key_names_its_spec(tmp_path):
    error = "ValueError: data.dataset: example 0 has no 'answer' (its fields: 'prompt', 'target'), which ..."
    run = make_run(
        tmp_path / "r",
        status=("failed", {"reason": "exception", "error": error, "step": 0, "phase": "reward"}),
        data={"dataset": "plugins/ds.py:graded"},
    )
    first = causes(run).causes[0]
    assert first.where == "data.dataset (plugins/ds.py:graded)" and "data.dataset" in first.title
    assert first.fixes[0].suite == "data.dataset (plugins/ds.py:graded)" and "'answer'" in first.fixes[0].why


def test_an_exception_raised_in_a_plugin_names_the_plugin_key(tmp_path):
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/work/trainer/rl_steps.py", line 65, in score_responses\n'
        "    raw = observer.plugin_call(...)\n"
        '  File "/home/u/plugins/rewards.py", line 12, in my_reward\n'
        "    return [1 / 0]\n"
        "ZeroDivisionError: division by zero\n"
    )
    run = make_run(
        tmp_path / "r",
        status=("failed", {"reason": "exception", "error": "ZeroDivisionError: division by zero",
                           "traceback": tb, "step": 0, "phase": "reward"}),
        data={"reward_fn": "/home/u/plugins/rewards.py:my_reward", "collator": "/home/u/plugins/col.py:c"},
    )  # fmt: skip
    first = causes(run).causes[0]
    assert (
        first.where == "data.reward_fn (/home/u/plugins/rewards.py:my_reward) at rewards.py:12 in my_reward"
    )
    assert first.fixes[0].suite == "data.reward_fn (/home/u/plugins/rewards.py:my_reward)"
    assert "your own code" in first.fixes[0].why
    module = make_run(
        tmp_path / "m",
        status=("failed", {"reason": "exception", "error": "ZeroDivisionError: division by zero",
                           "traceback": tb, "step": 0, "phase": "reward"}),
        data={"reward_fn": "plugins.rewards:my_reward"},
    )  # fmt: skip
    assert (
        causes(module)
        .causes[0]
        .where.startswith("data.reward_fn (plugins.rewards:my_reward) at rewards.py:12")
    )
