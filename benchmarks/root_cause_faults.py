"""Planted faults through the suite's plug-in points, run with ``verlaudit run`` and diagnosed with
``verlaudit diagnose``: does the first cause name the root, and does its first fix address it?

Each `Fault` is a variant of a tiny CPU suite that plugs wrong user code in where a user would: a
collator, a reward function, a reward-model loader, a model directory, a precision override, a
``model.setup`` hook, a process killed mid-step (and, with ``--device cuda``, a memory cap). The
code lives in tests/fault_plugins.py; the model directories are written here with ``save_pretrained``
and then corrupted. Every precision preset of PPO, GRPO and DPO runs clean beside them as a control.

Scoring, per fault: *root right* when the first cause's kind is one of the fault's accepted kinds and
its ``where`` or title names the culprit; *fix right* when its first fix's text (suite key, verl key,
why) contains one of the fault's fix words. A control is right when diagnose finds no error-level
cause. The expectations name what the fault is, in words a user would look for; the diagnosis knows
nothing of them (general rules over records: verlaudit/analysis/diagnose/rules.py).

Run: ``PYTHONPATH=$PWD python benchmarks/root_cause_faults.py --out reports/root_cause_faults.md``
(about 6 minutes on 2 CPU cores; ``--only NAME,...`` for a subset, ``--keep DIR`` keeps the runs).
A few of the faults run in CI: `pytest tests/test_root_cause.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = "tests.fault_plugins"
PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")

BASE: dict[str, dict[str, Any]] = {
    "ppo": {"algo": {"name": "ppo", "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 2,
                     "use_kl_in_reward": True}},
    "grpo": {"algo": {"name": "grpo", "batch_size": 2, "group_size": 4, "mini_batch_size": 8,
                      "micro_batch_size": 4, "use_kl_loss": True}},
    "dpo": {"algo": {"name": "dpo", "batch_size": 2, "mini_batch_size": 2, "micro_batch_size": 2}},
}  # fmt: skip
"""Each algorithm's tiny train section (the reference runs in all three: a KL term in PPO and GRPO)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planted fault: where it goes in, what it is, and what a right diagnosis names."""

    name: str
    point: str
    """The plug-in point it goes through (``data.collator``, ``model.setup`` ...)."""
    algo: str
    train: Mapping[str, Any]
    """The variant's overrides; ``{dirs}`` in a string is the model-directory root."""
    kinds: tuple[str, ...]
    """First-cause kinds that name the root (``finding:<kind>`` for an audit finding)."""
    culprit: tuple[str, ...]
    """Any of these in the first cause's where or title names the culprit."""
    fix: tuple[str, ...]
    """Any of these (lower case) in the first fix's text addresses the root."""
    preset: str = "fp32"
    steps: int = 2
    device: str = "cpu"


def _p(name: str) -> str:
    return f"{PLUGINS}:{name}"


def _setup(role: str, fn: str) -> dict[str, Any]:
    return {"model": {"setup": {role: _p(fn)}}}


FAULTS: tuple[Fault, ...] = (
    # collators (examples, tokenizer)
    Fault("collator-float-ids", "data.collator", "ppo", {"data": {"collator": _p("float_ids_collator")}},
          ("finding:boundary/collator_float_ids",), ("float_ids_collator",), ("torch.long",)),
    Fault("collator-out-of-vocab", "data.collator", "ppo", {"data": {"collator": _p("out_of_vocab_collator")}},
          ("finding:boundary/collator_id_range",), ("out_of_vocab_collator",), ("tokenize",)),
    Fault("collator-short-mask", "data.collator", "grpo", {"data": {"collator": _p("short_mask_collator")}},
          ("finding:boundary/collator_shape",), ("short_mask_collator",), ("mask",)),
    Fault("collator-right-padded", "data.collator", "ppo", {"data": {"collator": _p("right_padded_collator")}},
          ("finding:boundary/padding_side",), ("right_padded_collator",), ("left",)),
    Fault("collator-lists", "data.collator", "ppo", {"data": {"collator": _p("list_collator")}},
          ("finding:boundary/collator_not_tensor",), ("list_collator",), ("torch tensors",)),
    Fault("collator-dpo-float-ids", "data.collator", "dpo", {"data": {"collator": _p("float_pairs_collator")}},
          ("finding:boundary/collator_float_ids",), ("float_pairs_collator",), ("torch.long",)),
    # reward functions (prompts, responses, examples)
    Fault("reward-nan", "data.reward_fn", "ppo", {"data": {"reward_fn": _p("nan_reward")}},
          ("finding:boundary/reward_nonfinite",), ("nan_reward",), ("guard the reward",)),
    Fault("reward-inf", "data.reward_fn", "grpo", {"data": {"reward_fn": _p("inf_reward")}},
          ("finding:boundary/reward_nonfinite",), ("inf_reward",), ("guard the reward",)),
    Fault("reward-constant", "data.reward_fn", "grpo", {"data": {"reward_fn": _p("constant_reward")}},
          ("no_signal",), ("constant_reward",), ("reads the response",)),
    Fault("reward-fp64", "data.reward_fn", "ppo", {"data": {"reward_fn": _p("float64_reward")}},
          ("finding:boundary/reward_dtype",), ("float64_reward",), ("float32",)),
    Fault("reward-column", "data.reward_fn", "ppo", {"data": {"reward_fn": _p("column_reward")}},
          ("finding:boundary/reward_shape",), ("column_reward",), ("one scalar per sequence",)),
    Fault("reward-bf16", "data.reward_fn", "grpo", {"data": {"reward_fn": _p("bf16_reward")}},
          ("finding:boundary/reward_dtype",), ("bf16_reward",), (".float()",)),
    Fault("reward-short", "data.reward_fn", "ppo", {"data": {"reward_fn": _p("short_reward")}},
          ("exception",), ("data.reward_fn",), ("one score per response",)),
    Fault("reward-raises", "data.reward_fn", "grpo", {"data": {"reward_fn": _p("raising_reward")}},
          ("exception",), ("raising_reward",), ("raising_reward",)),
    Fault("reward-sigkill", "data.reward_fn", "ppo", {"data": {"reward_fn": _p("sigkill_reward")}},
          ("killed",), ("reward",), ("killed process",)),
    # reward models (tokenizer, device) and reward-model directories
    Fault("rm-fp16", "model.reward_model", "ppo", {"model": {"reward_model": _p("fp16_reward_model")}},
          ("finding:boundary/reward_model",), ("reward",), ("float32",)),
    Fault("rm-nan-head", "model.reward_model", "grpo", {"model": {"reward_model": _p("nan_head_reward_model")}},
          ("finding:numerics/weight_nonfinite",), ("score",), ("reload or inspect",)),
    Fault("rm-divides-by-zero", "model.reward_model", "ppo",
          {"model": {"reward_model": _p("dividing_reward_model")}},
          ("finding:boundary/reward_nonfinite", "finding:plugin/nonfinite_op"), ("dividing_reward_model",), ("guard",)),
    Fault("rm-two-logits", "model.reward_model", "ppo", {"model": {"reward_model": _p("two_logit_reward_model")}},
          ("exception",), ("model.reward_model",), ("one score",)),
    Fault("rm-dir-nan", "model.reward_model", "ppo", {"model": {"reward_model": "{dirs}/nan_rm"}},
          ("finding:numerics/weight_nonfinite",), ("score",), ("reload or inspect",)),
    # model directories
    Fault("dir-outlier-layer-fp16", "model.path", "ppo", {"model": {"path": "{dirs}/outlier_actor"}},
          ("finding:numerics/weight_outlier",), ("layers.1.mlp.down_proj",), ("reload or inspect",), preset="fp16"),
    Fault("dir-nan-weight", "model.path", "grpo", {"model": {"path": "{dirs}/nan_actor"}},
          ("finding:numerics/weight_nonfinite",), ("layers.0.self_attn.o_proj",), ("reload or inspect",)),
    Fault("dir-critic-outlier", "model.critic_path", "ppo", {"model": {"critic_path": "{dirs}/outlier_backbone"}},
          ("finding:numerics/weight_outlier",), ("layers.0.mlp.up_proj",), ("reload or inspect",)),
    Fault("dir-small-vocab", "model.path", "ppo", {"model": {"path": "{dirs}/small_vocab"}},
          ("exception", "preflight"), ("model.tokenizer", "model.path"), ("tokenizer",)),
    Fault("dir-outlier-dpo-bf16", "model.path", "dpo", {"model": {"path": "{dirs}/outlier_actor"}},
          ("finding:numerics/weight_outlier",), ("layers.1.mlp.down_proj",), ("reload or inspect",), preset="bf16"),
    # precision overrides
    Fault("override-rollout-bf16", "precision.overrides", "ppo",
          {"precision": {"overrides": {"rollout": {"compute_dtype": "bf16"}}}},
          ("finding:boundary/rollout_dtype",), ("rollout",), ("compute_dtype: fp32",)),
    # model.setup (model, role, tokenizer)
    Fault("setup-bf16-value-head", "model.setup", "ppo", _setup("critic", "bf16_value_head"),
          ("finding:dtype/param_storage", "finding:dtype/mixed_params"), ("value_head",), ("bf16_value_head",)),
    Fault("setup-casting-hook", "model.setup", "ppo", _setup("actor", "bf16_output_hook"),
          ("finding:dtype/module_output",), ("model.layers.0",), ("remove the cast", "forward hook")),
    Fault("setup-casting-hook-crash", "model.setup", "grpo", _setup("actor", "bf16_value_hook"),
          ("finding:dtype/module_output",), ("v_proj",), ("remove the cast", "forward hook")),
    Fault("setup-log-activation", "model.setup", "ppo", _setup("actor", "log_activation"),
          ("nonfinite",), ("act_fn",), ("log of <= 0",)),
    Fault("setup-late-inv-freq", "model.setup", "ppo", _setup("actor", "late_inv_freq_cast"),
          ("finding:dtype/buffer_precision",), ("rotary_emb",), ("inv_freq",)),
    Fault("setup-bf16-mlp", "model.setup", "ppo", _setup("actor", "bf16_mlp_cast"),
          ("finding:dtype/param_storage", "finding:dtype/mixed_params"), ("layers.0.mlp",), ("bf16_mlp_cast",)),
    Fault("setup-bf16-mlp-dpo", "model.setup", "dpo", _setup("actor", "bf16_mlp_cast"),
          ("finding:dtype/param_storage", "finding:dtype/mixed_params"), ("layers.0.mlp",), ("bf16_mlp_cast",)),
    Fault("setup-scaled-weights-fp16", "model.setup", "ppo", _setup("actor", "scaled_down_proj"),
          ("finding:numerics/weight_outlier",), ("layers.1.mlp.down_proj",), ("reload or inspect",), preset="fp16"),
    Fault("setup-scaling-hook-fp16", "model.setup", "ppo", _setup("actor", "scaling_hook"),
          ("overflow_skips", "loss_scale_collapse", "nonfinite"), ("layers.0.mlp",), ("forward hook",),
          preset="fp16"),
    Fault("setup-nan-hook-reference", "model.setup", "ppo", _setup("reference", "nan_hook"),
          ("nonfinite",), ("layers.1.mlp.down_proj",), ("forward hook",)),
    Fault("setup-bf16-lm-head", "model.setup", "grpo", _setup("actor", "bf16_lm_head"),
          ("finding:dtype/param_storage", "finding:dtype/mixed_params"), ("lm_head",), ("bf16_lm_head",)),
    Fault("setup-fp16-reference", "model.setup", "ppo", _setup("reference", "fp16_reference"),
          ("finding:dtype/param_storage",), ("reference",), ("fp16_reference",)),
    Fault("setup-log-activation-grpo-bf16", "model.setup", "grpo", _setup("actor", "log_activation"),
          ("nonfinite",), ("act_fn",), ("log of <= 0",), preset="bf16"),
)  # fmt: skip

GPU_FAULTS: tuple[Fault, ...] = (
    # a 0.45 GiB allocator cap: the planner puts the step at 0.62 GiB allocated (32 x 1024 tokens in one
    # micro-batch), with checkpointing at 0.33 and micro-batch 16 at 0.31: both fit the cap; counting
    # the 0.5 GiB CUDA context against it (the old arithmetic), neither would
    Fault("cap-activations", "hardware.memory_gb", "ppo",
          {"data": {"prompt_length": 512, "response_length": 512},
           "algo": {"batch_size": 32, "mini_batch_size": 32, "micro_batch_size": 32}},
          ("oom",), ("actor_update", "critic"), ("grad_checkpointing", "micro_batch_size"), device="cuda"),
)  # fmt: skip
"""Memory caps need a CUDA allocator to cap: ``--device cuda`` runs these (every variant of its suite
under hardware.memory_gb 0.45, the clean controls too) instead of the CPU set."""
GPU_CONTROLS = {"ppo": ("fp32", "bf16")}


@dataclasses.dataclass
class Result:
    name: str
    point: str
    algo: str
    preset: str
    control: bool
    verdict: str
    kind: str
    title: str
    first_fix: str
    root_right: bool
    fix_right: bool


# ---------------------------------------------------------------- model directories


def build_model_dirs(root: Path) -> None:
    """Tiny-llama checkpoints (save_pretrained, the real loading path) with one planted fault each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trainer.config import ModelConfig
    from trainer.models import load_tokenizer, preset_config

    tok = load_tokenizer(ModelConfig())
    cfg = preset_config(ModelConfig(), tok)

    def save(model, name: str) -> None:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        lm.model.layers[1].mlp.down_proj.weight.mul_(3e4)
    save(lm, "outlier_actor")
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        lm.model.layers[0].self_attn.o_proj.weight[3, 5] = float("nan")
    save(lm, "nan_actor")
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        lm.model.layers[0].mlp.up_proj.weight.mul_(1e4)
    lm.model.save_pretrained(root / "outlier_backbone")
    small = preset_config(ModelConfig(), tok)
    small.vocab_size = len(tok) // 2
    save(AutoModelForCausalLM.from_config(small), "small_vocab")
    rm_cfg = preset_config(ModelConfig(), tok, num_labels=1)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(rm_cfg)
    with torch.no_grad():
        rm.score.weight[0, 7] = float("nan")
    save(rm, "nan_rm")


# ---------------------------------------------------------------- suites


def _fill(value: Any, dirs: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{dirs}", str(dirs))
    if isinstance(value, Mapping):
        return {k: _fill(v, dirs) for k, v in value.items()}
    return value


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def suite_for(algo: str, faults: Sequence[Fault], controls: Sequence[str], dirs: Path, device: str) -> dict:
    """One suite per algorithm: its faults and its clean controls as variants."""
    train = _merge(
        {
            "model": {"preset": "tiny-llama"},
            "steps": 2,
            "threads": 1,
            "data": {"task": "digits", "prompt_length": 8, "response_length": 4, "num_examples": 64},
        },
        BASE[algo],
    )
    variants = {f"clean-{p}": {"precision": {"preset": p}} for p in controls}
    for f in faults:
        over = _merge(_fill(dict(f.train), dirs), {"precision": {"preset": f.preset}, "steps": f.steps})
        variants[f.name] = over
    suite = {
        "name": f"faults_{algo}",
        "train": train,
        "audit": {"level": "full", "full_steps": 2, "every": 1},
        "hardware": {"target": "cpu"},
        "variants": variants,
    }
    if device == "cuda":
        suite["hardware"] = {"target": "h200", "memory_gb": 0.45}
    return suite


def run_suite(suite: Mapping[str, Any], work: Path, device: str) -> Path:
    """``verlaudit run`` on the suite (a YAML file under ``work``); returns the report directory."""
    import yaml

    path = work / f"{suite['name']}.yaml"
    path.write_text(f"# Run: verlaudit run {path.name}\n" + yaml.safe_dump(dict(suite), sort_keys=False))
    out = work / "runs" / suite["name"]
    cmd = [sys.executable, "-m", "verlaudit", "run", str(path), "--out", str(out), "--device", device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    refused = re.search(r"\bvariants\.([\w.-]+?)\.\S*: (.*)", proc.stderr)
    # stopped at preflight: only the refused variant's directory was written
    if proc.returncode == 2 and refused:
        shutil.rmtree(out, ignore_errors=True)
        raise Refused(refused.group(1), proc.stderr.strip().splitlines()[-1])
    if not out.exists():
        raise RuntimeError(
            f"verlaudit run {path} wrote nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return out


class Refused(Exception):
    """``verlaudit run`` stopped at preflight on one variant, before any worker started: the one-line error
    is what the user sees, so it is scored as that fault's first cause (kind ``preflight``)."""

    def __init__(self, variant: str, message: str) -> None:
        super().__init__(message)
        self.variant, self.message = variant, message


def score_refused(fault: Fault, message: str) -> Result:
    """A fault refused at preflight: root right when the error names the culprit and the fault accepts a
    refusal before the run (kind ``exception``: it would otherwise fail at step 0), fix right when the
    error's advice holds one of the fix words."""
    text = message.lower()
    named = any(c.lower() in text for c in fault.culprit)
    root = named and ("preflight" in fault.kinds or "exception" in fault.kinds)
    fix = root and any(w.lower() in text for w in fault.fix)
    return Result(fault.name, fault.point, fault.algo, fault.preset, False, "error", "preflight", message, message,
                  root, fix)  # fmt: skip


# ---------------------------------------------------------------- scoring


def _fix_text(fix: Any) -> str:
    return f"{fix.suite or ''} {fix.verl or ''} {fix.why}".lower()


def score(run_dir: Path, fault: Fault | None, *, algo: str, preset: str, name: str) -> Result:
    """Diagnoses one run directory and scores its first cause (a control: no error-level cause)."""
    from verlaudit.analysis.diagnose.diagnosis import diagnose_path

    (d,) = diagnose_path(run_dir)
    first = d.causes[0] if d.causes else None
    kind, title = (first.kind, first.title) if first else ("-", "no problems found")
    fix = first.fixes[0] if first and first.fixes else None
    fix_text = _fix_text(fix) if fix else ""
    if fault is None:
        right = d.verdict != "error"
        return Result(name, "-", algo, preset, True, d.verdict, kind, title, fix_text, right, right)
    named = first is not None and any(c in f"{first.where or ''} {first.title}" for c in fault.culprit)
    root_right = first is not None and d.verdict != "clean" and first.kind in fault.kinds and named
    fix_right = root_right and any(w.lower() in fix_text for w in fault.fix)
    return Result(
        fault.name, fault.point, algo, preset, False, d.verdict, kind, title, fix_text, root_right, fix_right
    )


def run_all(
    faults: Sequence[Fault], controls: Mapping[str, Sequence[str]], work: Path, device: str
) -> list[Result]:
    """Runs ``faults`` and the clean ``controls`` (algorithm -> presets) in one suite per algorithm and
    scores each run."""
    dirs = work / "models"
    dirs.mkdir(parents=True, exist_ok=True)
    if any("{dirs}" in json.dumps(dict(f.train)) for f in faults):
        build_model_dirs(dirs)
    results: list[Result] = []
    for algo in BASE:
        mine = [f for f in faults if f.algo == algo]
        presets = tuple(controls.get(algo, ()))
        if not mine and not presets:
            continue
        while True:
            try:
                out = run_suite(suite_for(algo, mine, presets, dirs, device), work, device)
                break
            except Refused as r:
                (fault,) = [f for f in mine if f.name == r.variant]
                results.append(score_refused(fault, r.message))
                mine = [f for f in mine if f is not fault]
        for p in presets:
            results.append(score(out / f"clean-{p}", None, algo=algo, preset=p, name=f"{algo}-clean-{p}"))
        for f in mine:
            results.append(score(out / f.name, f, algo=algo, preset=f.preset, name=f.name))
    return results


def render(results: Sequence[Result], command: str, seconds: float) -> str:
    faults = [r for r in results if not r.control]
    controls = [r for r in results if r.control]
    both = sum(r.root_right and r.fix_right for r in faults)
    lines = [
        "# Root cause first: planted faults through the plug-in points",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, commit {_commit()}, {_machine()}, {seconds:.0f} s).",
        "Faults: tests/fault_plugins.py and benchmarks/root_cause_faults.py (what each one is and what a right "
        "diagnosis names); scoring: the benchmark's docstring.",
        "",
        f"- faults: {len(faults)}; first cause names the root: {_pct(sum(r.root_right for r in faults), len(faults))}",
        f"- first cause names the root and its first fix addresses it: {_pct(both, len(faults))} (target >= 90%)",
        f"- clean controls (PPO, GRPO, DPO x {', '.join(PRESETS)}) with no error-level cause: "
        f"{_pct(sum(r.root_right for r in controls), len(controls))}",
        "",
        "| fault | plug-in point | algo | preset | verdict | first cause | root | fix | first fix |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mark = (
            (lambda ok: "yes" if ok else "**no**")
            if not r.control
            else (lambda ok: "clean" if ok else "**error**")
        )
        lines.append(
            f"| {r.name} | {r.point} | {r.algo} | {r.preset} | {r.verdict} | {_cell(r.title)} "
            f"| {mark(r.root_right)} | {'-' if r.control else mark(r.fix_right)} | {_cell(r.first_fix, 70)} |"
        )
    return "\n".join(lines) + "\n"


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "0/0"


def _cell(text: str, width: int = 80) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores visible)"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--only", help="comma-separated fault names (no controls unless 'controls' is listed)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the memory-cap faults")
    p.add_argument("--keep", help="run in this directory and keep it (default: a temporary one)")
    args = p.parse_args(argv)
    pool = GPU_FAULTS if args.device == "cuda" else FAULTS
    wanted = set(args.only.split(",")) if args.only else None
    faults = [f for f in pool if wanted is None or f.name in wanted]
    all_controls = GPU_CONTROLS if args.device == "cuda" else {a: PRESETS for a in BASE}
    controls = all_controls if wanted is None or "controls" in wanted else {}
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="root_cause_"))
    if args.keep:
        shutil.rmtree(work / "runs", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        results = run_all(faults, controls, work, args.device)
        for r in results:  # the temporary directory's name says nothing: <work> in the report
            r.title, r.first_fix = (x.replace(str(work), "<work>") for x in (r.title, r.first_fix))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    cmd = (
        "PYTHONPATH=$PWD python benchmarks/root_cause_faults.py"
        + "".join(f" --{k} {v}" for k, v in (("out", args.out), ("only", args.only)) if v)
        + (" --device cuda" if args.device == "cuda" else "")
    )
    report = render(results, cmd, time.monotonic() - t0)
    print(report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
