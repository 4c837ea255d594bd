"""Model, tokenizer and data directories that some blind faults point their suites at.

Everything is written with ``save_pretrained`` from a tiny config (or, for the word tokenizer and the
verl rows, built here), deterministically, into one assets directory; `build_assets` skips what is
already there. ``python benchmarks/blind_faults_2/assets.py DIR`` builds them alone.
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


def _char_tokenizer():
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


def _save_lm(path: Path, seed: int, with_tokenizer: bool = True, **kw) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = _char_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tok, **kw))
    model.save_pretrained(path)
    if with_tokenizer:
        tok.save_pretrained(path)


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


def _save_sft_model(path: Path, steps: int = 300) -> None:
    """A tiny Llama fine-tuned on the digits task: it answers ``dddd`` and then emits ``<eos>``."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _char_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
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


def _save_eos_appending_tokenizer(path: Path) -> None:
    """The character tokenizer with ``add_eos_token``-style post-processing: every encoding ends in eos."""
    from tokenizers import processors

    tok = _char_tokenizer()
    core = tok.backend_tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_id
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A $B <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)]
    )
    tok.save_pretrained(path)


def _save_pad_is_eos_tokenizer(path: Path) -> None:
    """The character tokenizer with its pad token set to eos (the usual ``pad_token = eos_token``)."""
    tok = _char_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(path)


def _save_lm_dir_as_rm(path: Path) -> None:
    """A causal-LM checkpoint (the SFT'd digits model's weights, no classification head)."""
    import shutil

    src = path.parent / "sft_lm"
    for f in src.iterdir():
        if f.is_file() and f.name != ".done":
            shutil.copy(f, path / f.name)


def _save_big_activation_lm(path: Path) -> None:
    """A tiny Llama whose MLP output projections are scaled up, so its residual stream reaches ~1e5."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _char_tokenizer()
    torch.manual_seed(21)
    model = AutoModelForCausalLM.from_config(tiny_config(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(BIG_ACT_SCALE[0])
            layer.mlp.up_proj.weight.mul_(BIG_ACT_SCALE[0])
            layer.mlp.down_proj.weight.mul_(BIG_ACT_SCALE[1])
    model.save_pretrained(path)
    tok.save_pretrained(path)


BIG_ACT_SCALE = (50.0, 3000.0)
"""How much the big-activation model's gate / up and down projections are scaled: its residual stream
after the first layer reaches ~1.4e5 (fp16's largest value is 65504), its weights stay below 300."""


def _save_arith_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: a short addition question per row, ground truth the sum."""
    import pandas as pd

    rng = random.Random(7)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append(
            {
                "data_source": "arith/add",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    pd.DataFrame(rows).to_parquet(path)


BUILDERS = {
    "sft_lm": _save_sft_model,
    "lm_dir_as_rm": _save_lm_dir_as_rm,
    "big_act_lm": _save_big_activation_lm,
    "tok_eos_appended": _save_eos_appending_tokenizer,
    "tok_pad_is_eos": _save_pad_is_eos_tokenizer,
}
"""Built in this order (``lm_dir_as_rm`` copies ``sft_lm``)."""


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
    rows = out / "arith_rows.parquet"
    if not rows.exists():
        _save_arith_rows(rows)
    paths["arith_rows"] = str(rows)
    (out / "assets.json").write_text(json.dumps(paths, indent=1))
    return paths


if __name__ == "__main__":
    print(json.dumps(build_assets(sys.argv[1] if len(sys.argv) > 1 else "/tmp/blind2_assets"), indent=1))
