"""``verlaudit from-verl FILE [-o suite.yaml] [--run]``: a verl launch script (or Hydra YAML) -> a suite.

Parses the script (`verlaudit.verl.launch`), maps every key (`verlaudit.verl.mapping`), writes the suite
(`verlaudit.verl.writer`) after validating it as `verlaudit run` would, prints each key it could not map
with the reason, and with ``--run`` runs the suite as `verlaudit run` does (`verlaudit.commands.run`). Exercised by
`pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verlaudit.commands import run as run_command
from verlaudit.run.suite import Suite
from verlaudit.verl.launch import read_launch
from verlaudit.verl.mapping import map_launch
from verlaudit.verl.writer import render, suite_paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file", help="verl launch script (python3 -m verl.trainer.main_ppo key=value ...) or Hydra YAML"
    )
    p.add_argument("-o", "--output", help="suite YAML to write (default: ./<script name>.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite the suite file if it exists")
    p.add_argument(
        "--target",
        default="h100-80gb",
        help="GPU the job is meant for (verl scripts name none; default h100-80gb); cpu for a CPU run",
    )
    p.add_argument(
        "--model", help="a local model directory or a known model name, instead of the script's model"
    )
    p.add_argument(
        "--audit-level",
        default="boundary",
        choices=("off", "boundary", "full"),
        help="the suite's audit level (default boundary, the always-on level)",
    )
    p.add_argument(
        "--verl-version",
        help="the verl release line the script was written for (0.7 ... 0.10; default: the latest release "
        "line); keys whose semantics changed between verl versions follow it (algo.verl_version)",
    )
    p.add_argument("--run", action="store_true", help="run the suite right away (verlaudit run)")
    p.add_argument("--steps", type=int, help="with --run: training steps for every variant")
    p.add_argument("--variants", help="with --run: comma-separated variants to run")
    p.add_argument("--device", choices=("cpu", "cuda"), help="with --run: run on cpu or cuda")
    p.add_argument("--out", help="with --run: the report directory")


def main(args: argparse.Namespace) -> int:
    launch = read_launch(args.file)
    mapped = map_launch(launch, target=args.target, model=args.model, verl_version=args.verl_version)
    out = Path(args.output) if args.output else Path(Path(args.file).stem + ".yaml")
    if out.exists() and not args.force:
        raise ValueError(f"-o {out}: exists; pass --force to overwrite it or choose another file")
    text, data = render(mapped, launch, out, audit_level=args.audit_level)
    try:
        Suite.from_dict(data, source=str(out))
    except ValueError as e:
        raise ValueError(f"{args.file}: the suite made from it does not validate: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    counts = {
        k: sum(r.kind == k for r in mapped.records) for k in ("mapped", "default", "consistent", "unmapped")
    }
    print(
        f"verlaudit from-verl: wrote {out} ({counts['mapped']} keys mapped, {counts['default']} verl defaults "
        f"written, {counts['consistent']} consistent, {counts['unmapped']} not mapped)"
    )
    unmapped = [r for r in mapped.records if r.kind == "unmapped"]
    if unmapped:
        print("not mapped:")
        for r in unmapped:
            print(f"  {'line ' + str(r.line) if r.line else 'default'}: {r.verl}={r.text}: {r.reason}")
    for note in mapped.notes + suite_paths(mapped.train, out)[1]:  # the paths it could not make relative
        print(f"note: {note}")
    if not args.run:
        print(f"run it: verlaudit run {out}")
        return 0
    run_args = argparse.Namespace(
        suite=str(out),
        steps=args.steps,
        variants=args.variants,
        seeds=None,
        out=args.out,
        device=args.device,
        audit_level=None,
        no_progress=True,
        report_only=None,
    )
    return run_command.main(run_args)
