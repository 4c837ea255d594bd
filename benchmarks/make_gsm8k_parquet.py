"""Synthetic GSM8K-style data in verl's RL format, so a verl GRPO script can run without downloads.

Each row is a templated arithmetic word problem with verl's GSM8K layout: ``data_source: openai/gsm8k``,
``prompt`` (one user message ending in the instruction to answer after ``####``), ``ability: math``,
``reward_model: {style: rule, ground_truth}`` and ``extra_info: {split, index, answer, question}``; so
verlaudit's built-in GSM8K scorer (`trainer.verl_data.gsm8k_score`) rewards it.
Run: ``python benchmarks/make_gsm8k_parquet.py --rows 512 --out data/gsm8k_synth/train.parquet``
(benchmarks/verl/from_verl_7b.sh does; tests/test_from_verl.py makes its own small file).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana")
ITEMS = ("apples", "books", "stamps", "marbles", "pencils", "shells")


def problem(rng: random.Random) -> tuple[str, str, int]:
    """``(question, worked answer, result)``: has a, buys b packs of c, gives d away."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    d = rng.randint(1, a)
    result = a + b * c - d
    question = (
        f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives "
        f"{d} {item} to a friend. How many {item} does {name} have now?"
    )
    answer = f"{b} * {c} = {b * c}. {a} + {b * c} - {d} = {result}.\n#### {result}"
    return question, answer, result


def rows(n: int, seed: int, split: str = "train") -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, answer, result = problem(rng)
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train")
    p.add_argument("--out", required=True, help="a .parquet (or .jsonl) file to write")
    args = p.parse_args(argv)
    import pandas as pd

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows(args.rows, args.seed, args.split))
    if out.suffix == ".jsonl":
        frame.to_json(out, orient="records", lines=True)
    else:
        frame.to_parquet(out)
    print(f"wrote {args.rows} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
