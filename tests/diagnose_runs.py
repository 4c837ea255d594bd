"""Run directories written the way the worker writes them, for the diagnose tests (test_diagnose.py,
test_root_cause.py and others plant findings and metrics in them)."""

from trainer.config import TrainConfig
from trainer.precision import resolve_policy
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.rundir import RunWriter


def make_run(
    path,
    *,
    preset="fp32",
    algo="ppo",
    steps=10,
    metrics=None,
    findings=(),
    status=("completed", {}),
    model=None,
    **cfg,
):
    """A run directory as the worker writes it: manifest (config + policy), metrics, findings, status."""
    algo = {"name": algo} if isinstance(algo, str) else algo
    data = {"algo": algo, "precision": {"preset": preset}, "steps": steps, **cfg}
    if model:
        data["model"] = model
    config = TrainConfig.from_dict(data)
    policy = resolve_policy(preset, grad_checkpointing=config.precision.grad_checkpointing)
    with RunWriter(path) as w:
        w.write_manifest(
            {
                "variant": path.name,
                "suite": "t",
                "seed": 0,
                "config": config.to_dict(),
                "policy": policy.to_dict(),
                "memory": {"source": "rss", "reason": "no NVML"},
            }
        )
        for i, m in enumerate(metrics if metrics is not None else [_healthy(s) for s in range(steps)]):
            w.metrics(i, m)
        for f in findings:
            w.finding(f)
        if status is not None:
            w.status(status[0], **status[1])
    return path


def _healthy(step):
    # a slowly improving run: loss falls, score rises, no skips
    return {
        "actor/loss": 1.0 - 0.01 * step,
        "actor/grad_norm": 0.5,
        "actor/skipped": 0.0,
        "actor/loss_scale": 1.0,
        "critic/score/mean": 0.2 + 0.01 * step,
        "critic/score/std": 0.1,
        "perf/step_time_s": 0.1,
    }


def run_cli(argv):
    """`verlaudit diagnose ...` through the real command line (ValueError -> one-line error, exit 2)."""
    from verlaudit import cli

    return cli.main(["diagnose", *argv])


def causes(path):
    (d,) = diagnose_path(path)
    return d
