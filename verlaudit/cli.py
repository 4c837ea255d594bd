"""The ``verlaudit`` command: ``run``, ``diagnose``, ``compare``, ``plan``, ``recommend``, ``tensorboard``,
``from-verl``.

Each subcommand lives in its own module of `verlaudit.commands`, which provides ``add_arguments(parser)`` and
``main(args) -> int``; this file only dispatches and turns user mistakes (ValueError) into a
one-line error with exit code 2 instead of a traceback. Exercised by `pytest tests/test_cli_input.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "run": (
        "verlaudit.commands.run",
        "run a suite: every variant in its own process, then the comparison report",
    ),
    "diagnose": (
        "verlaudit.commands.diagnose",
        "explain a run directory (or a foreign training log): cause, culprit, fix",
    ),
    "compare": (
        "verlaudit.commands.compare",
        "compare a run with a baseline: markdown, JUnit XML, exit 1 on regression",
    ),
    "plan": ("verlaudit.commands.plan", "predict each variant's peak device memory before running"),
    "recommend": (
        "verlaudit.commands.recommend",
        "rank precision recipes by measured cost among those within a tolerance of fp32",
    ),
    "tensorboard": (
        "verlaudit.commands.tensorboard",
        "export a run directory (or a suite's runs) as TensorBoard event files",
    ),
    "from-verl": (
        "verlaudit.commands.from_verl",
        "turn a verl launch script or Hydra YAML into a suite (and --run it)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verlaudit", description="Precision auditing for RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except ValueError as e:
        # one line, whatever the message (a library's error inside it may span several)
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"verlaudit {args.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"verlaudit {args.command}: interrupted; what was written so far is kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
