"""Model, tokenizer and data files that some items of the seventh blind bench point their suites at.

Everything is built deterministically into one assets directory; `build_assets` skips what is already
there. ``python benchmarks/blind_faults_7/assets.py DIR`` builds them alone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
)
"""The tiny Llama shape every model asset of this bench has."""

SFT_STEPS = 220
EARLY_STEP = 12
"""The SFT run's length and the step at which its early checkpoint (`sft_early`) is saved."""


def char_tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def small_config(tok, **kw):
    from transformers import LlamaConfig

    args = dict(SMALL, vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)  # fmt: skip
    args.update(kw)
    return LlamaConfig(**args)


def _rows(tok, n: int, rng: random.Random):
    """Digits prompt + answer + eos rows, right-padded, and the mask of the answer tokens."""
    import torch

    from trainer.data import TASKS

    seqs, marks = [], []
    for _ in range(n):
        prompt, answer = TASKS["digits"].make_prompt_answer(rng)
        p = tok(prompt)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        marks.append([0] * len(p) + [1] * len(a))
    w = max(len(s) for s in seqs)
    ids = torch.full((n, w), tok.pad_token_id)
    attn = torch.zeros((n, w), dtype=torch.long)
    target = torch.zeros((n, w))
    for i, (s, m) in enumerate(zip(seqs, marks)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        target[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, attn, target


def _sft(out: Path) -> None:
    """Fine-tunes a tiny untied Llama on the digits task (answer ``dddd<eos>``); saves the final model at
    ``out`` and the one after `EARLY_STEP` steps beside it (``sft_early``)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = char_tok()
    torch.manual_seed(77)
    model = AutoModelForCausalLM.from_config(small_config(tok, tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(77)
    model.train()
    for step in range(SFT_STEPS):
        ids, attn, target = _rows(tok, 32, rng)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view(ids.shape[0], -1)
        loss = (nll * target[:, 1:]).sum() / target[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 == EARLY_STEP:
            early = out.parent / "sft_early"
            early.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(early)
            tok.save_pretrained(early)
            (early / ".done").write_text("ok\n")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "sft_loss.txt").write_text(f"{float(loss.detach()):.4f}\n")


def _rope_reexport(out: Path) -> None:
    """The SFT checkpoint re-exported by a conversion script that writes its own default rope_theta
    (1e6, a long-context model's) into config.json; the weights are unchanged."""
    src = out.parent / "sft_lm"
    for f in src.iterdir():
        if f.is_file() and f.name != ".done":
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = 1000000.0
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = 1000000.0
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _critic_backbone_dropout(out: Path) -> None:
    """A tiny Llama backbone saved by the value-model team with attention_dropout 0.3 in its config (their
    pre-training recipe's regulariser), used as model.critic_path."""
    import torch
    from transformers import AutoModel

    tok = char_tok()
    torch.manual_seed(78)
    AutoModel.from_config(small_config(tok, attention_dropout=0.3)).save_pretrained(out)
    tok.save_pretrained(out)


def _tok_eos_first(out: Path) -> None:
    """The character tokenizer re-exported with a GPT-2-style template: sequences start with <eos> (used
    there as bos as well) instead of <bos>."""
    from tokenizers import processors

    tok = char_tok()
    eos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", pair="<eos> $A $B", special_tokens=[("<eos>", eos)]
    )
    tok.bos_token = "<eos>"
    tok.save_pretrained(out)


def _product_rows(path: Path, n: int = 256) -> None:
    """verl rows: products of two four-digit numbers (ground truth up to ~1e8)."""
    import pandas as pd

    rng = random.Random(71)
    rows = []
    for i in range(n):
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        rows.append({"data_source": "arith/mul4", "prompt": [{"role": "user", "content": f"{a}*{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


def _sum_rows(path: Path, n: int = 256, *, thousands: bool = False, seed: int = 72) -> None:
    """verl rows: sums of two numbers in 100..999 (sums 200..1998); with ``thousands`` the exporter wrote
    each ground truth with a thousands separator (f'{x:,}': '1,234')."""
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        truth = f"{a + b:,}" if thousands else str(a + b)
        rows.append({"data_source": "arith/add3", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


BUILDERS = {
    "sft_lm": _sft,
    "sft_rope_reexport": _rope_reexport,
    "critic_dropout": _critic_backbone_dropout,
    "tok_eos_first": _tok_eos_first,
}
"""Directory assets, built in this order (``sft_early`` is written by ``sft_lm``'s build)."""

ROWS = {
    "product_rows": _product_rows,
    "thousands_rows": lambda p: _sum_rows(p, thousands=True),
    "sum_rows": lambda p: _sum_rows(p, seed=73),
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
    paths["sft_early"] = str(out / "sft_early")
    for name, build in ROWS.items():
        rows = out / f"{name}.parquet"
        if not rows.exists():
            build(rows)
        paths[name] = str(rows)
    (out / "assets.json").write_text(json.dumps(paths, indent=1))
    return paths


if __name__ == "__main__":
    print(json.dumps(build_assets(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bf7_assets"), indent=1))
