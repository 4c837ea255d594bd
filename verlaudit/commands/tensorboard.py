"""`verlaudit tensorboard PATH`: a run directory (or every run of a suite's output) as TensorBoard event files.

The command: export (`verlaudit.integrations.tensorboard.export_tree`) and print where the files went
and the ``tensorboard --logdir`` line to view them. Exit code 0, 2 on bad input or a missing
tensorboard package. Exercised by `pytest tests/test_integrations_tensorboard.py`.
"""

from __future__ import annotations

import argparse

from verlaudit.integrations import tensorboard as tb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a run directory, or a suite's output directory of run directories")
    p.add_argument(
        "--logdir",
        help=f"where the event files go (default PATH/{tb.TB_DIR}, one subfolder per run for a suite)",
    )


def main(args: argparse.Namespace) -> int:
    exported = tb.export_tree(args.path, args.logdir)
    for folder, n in exported:
        print(f"{folder}: {n} summaries")
    base = args.logdir or (exported[0][0] if len(exported) == 1 else exported[0][0].parent)
    print(f"view: tensorboard --logdir {base}")
    return 0
