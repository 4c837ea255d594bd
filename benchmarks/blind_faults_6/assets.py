"""Model, tokenizer and data files that some faults of the sixth blind bench point their suites at.

Everything is built deterministically into one assets directory; `build_assets` skips what is already
there. ``python benchmarks/blind_faults_6/assets.py DIR`` builds them alone.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
)


def char_tokenizer():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def tiny_config(tok, **kw):
    from transformers import LlamaConfig

    args = dict(TINY)
    args.update(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    args.update(kw)
    return LlamaConfig(**args)


def _digits_batch(tok, n: int, rng: random.Random):
    """Prompt + answer + eos rows of the digits task, right-padded, with a loss mask on the answer."""
    import torch

    from trainer.data import TASKS

    task = TASKS["digits"]
    rows, masks = [], []
    for _ in range(n):
        prompt, answer = task.make_prompt_answer(rng)
        p = tok(prompt)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, rows))
    ids = torch.full((n, width), tok.pad_token_id)
    loss_mask = torch.zeros((n, width))
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
        attn[i, : len(r)] = 1
    return ids, attn, loss_mask


def _train_sft(path: Path, *, tied: bool, seed: int, steps: int = 300) -> None:
    """A tiny Llama fine-tuned on the digits task: it answers ``dddd`` and then ``<eos>``."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tok, tie_word_embeddings=tied))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        ids, attn, loss_mask = _digits_batch(tok, 32, rng)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view(ids.shape[0], -1)
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "sft_loss.txt").write_text(f"{float(loss.detach()):.4f}\n")


def _save_sft_model(path: Path) -> None:
    """The SFT checkpoint with its own (untied) output head."""
    _train_sft(path, tied=False, seed=6)


def _save_sft_tied_model(path: Path) -> None:
    """The SFT checkpoint of a model that ties its output head to the input embeddings."""
    _train_sft(path, tied=True, seed=7)


def _save_short_max_length_tokenizer(path: Path) -> None:
    """The character tokenizer re-saved by the export script of the keyword-tagging project, whose
    ``model_max_length`` is 6 (that project's inputs were single keywords); truncation side left."""
    tok = char_tokenizer()
    tok.model_max_length = 6
    tok.truncation_side = "left"
    tok.save_pretrained(path)


SYSTEM_PROMPT = "You are a careful assistant. Answer with the number only."
"""The system message every verl row of `sys_prompt_rows` starts with (57 characters)."""


def _save_sys_prompt_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: a system message, then a short addition question; ground truth the sum."""
    import pandas as pd

    rng = random.Random(61)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"data_source": "arith/add",
                     "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": f"{a}+{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


def _save_three_digit_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: adding two three-digit numbers (sums 200..1998); ground truth the sum."""
    import pandas as pd

    rng = random.Random(62)
    rows = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"data_source": "arith/add3", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


def _save_arith_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: a short addition question per row, ground truth the sum (for a control)."""
    import pandas as pd

    rng = random.Random(63)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"data_source": "arith/add", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


BUILDERS = {
    "sft_lm": _save_sft_model,
    "sft_tied_lm": _save_sft_tied_model,
    "tok_max_len6": _save_short_max_length_tokenizer,
}
"""Directory assets, built in this order."""

ROWS = {
    "sys_prompt_rows": _save_sys_prompt_rows,
    "three_digit_rows": _save_three_digit_rows,
    "arith_rows": _save_arith_rows,
}
"""verl row files (parquet)."""


def build_assets(out: str | os.PathLike) -> dict[str, str]:
    """Builds every asset under ``out`` (skipping the ones present) and returns name -> absolute path."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str] = {}
    for name, build in BUILDERS.items():
        p = out / name
        if not (p / ".done").exists():
            p.mkdir(parents=True, exist_ok=True)
            build(p)
            (p / ".done").write_text("ok\n")
        paths[name] = str(p)
    for name, build in ROWS.items():
        rows = out / f"{name}.parquet"
        if not rows.exists():
            build(rows)
        paths[name] = str(rows)
    (out / "assets.json").write_text(json.dumps(paths, indent=1))
    return paths


if __name__ == "__main__":
    print(json.dumps(build_assets(sys.argv[1] if len(sys.argv) > 1 else "/tmp/blind6_assets"), indent=1))
