"""Test helpers for verl jobs: a small parquet in verl's RL format, a tiny local model with a chat
template, and a compute_score file, all made here (nothing is downloaded). Used by
tests/test_verl_data.py and tests/test_from_verl.py."""

from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A chat template over the project's character tokenizer: ``<user>text\\n<assistant>``."""

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Partial credit for digits, so a tiny random model gets a non-zero reward."""
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(1, len(solution_str)), "acc": float(ground_truth in solution_str),
            "pred": solution_str[:8]}
'''


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-shaped rows in verl's RL format (short questions, so tiny prompt lengths fit)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"Add {a} and {b}. End with #### n."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i, "answer": f"{a}+{b}={a + b} #### {a + b}"},
            }
        )
    return rows


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return path


def write_reward(path: Path, text: str = REWARD_FILE) -> Path:
    path.write_text(text)
    return path


def tiny_qwen_dir(path: Path, *, chat_template: bool = True) -> Path:
    """A 2-layer Qwen2 saved with save_pretrained, with the project's tokenizer (and a chat template)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def two_rank_extras(rank: int, init_file: str, out: str) -> None:
    """One rank of tests/test_verl_data.py's two-process check of `StepLog`'s extra metrics (gloo)."""
    import json

    import torch
    import torch.distributed as dist

    from trainer import common
    from trainer.distributed import DistInfo
    from trainer.events import NULL_OBSERVER

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        info = DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        # rank 0: acc on 2 responses (1, 0); rank 1: acc on 1 response (1) and a key rank 0 never saw
        extras = (
            {"reward_extra/acc/mean": (1.0, 2)}
            if rank == 0
            else {"reward_extra/acc/mean": (1.0, 1), "reward_extra/len/mean": (8.0, 2)}
        )

        class Source:  # a reward function with metrics of its own, asked by the log
            pending: dict = {}

            def take_step_metrics(self):
                out, self.pending = self.pending, {}
                return out

        source = Source()
        log = common.StepLog(NULL_OBSERVER, 0, info, sources=(source,))
        log.start(0)
        source.pending = extras
        got = log.end(0, {"actor/loss": float(rank)})
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()
