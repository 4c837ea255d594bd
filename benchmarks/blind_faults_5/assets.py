"""Model, tokenizer and data directories that some faults of the fifth blind bench point their suites at.

Everything is built deterministically into one assets directory (``save_pretrained`` from a tiny config,
or built here); `build_assets` skips what is already there. ``python benchmarks/blind_faults_5/assets.py
DIR`` builds them alone.
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


def _save_sft_model(path: Path, steps: int = 300) -> None:
    """A tiny Llama (untied head) fine-tuned on the digits task: it answers ``dddd`` and then ``<eos>``."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config(tok, tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(3)
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


def _char_core(characters: str, fuse: bool = True):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from trainer.tokenizer import SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in characters:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    if fuse:
        core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return core


def _wrap(core):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", truncation_side="left", model_max_length=4096, clean_up_tokenization_spaces=False,
    )  # fmt: skip



def _save_pad_is_digit_tokenizer(path: Path) -> None:
    """The character tokenizer saved with its pad token set to the character '0' (a script that "fixed"
    a missing pad token with the first token of an id range it believed unused)."""
    tok = char_tokenizer()
    tok.pad_token = "0"
    tok.save_pretrained(path)


def _save_no_bos_tokenizer(path: Path) -> None:
    """The character tokenizer re-exported without the post-processor that prepends <bos> (the export
    script's template only had ``$A``)."""
    from tokenizers import processors

    from trainer.tokenizer import CHARACTERS

    core = _char_core(CHARACTERS)
    core.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    _wrap(core).save_pretrained(path)


def _save_float_sum_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: adding two tenths; the export script computes the ground truth as ``str(a / 10 + b /
    10)`` in binary floating point."""
    import pandas as pd

    rng = random.Random(51)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 4), rng.randint(1, 4)
        rows.append({"data_source": "arith/decimal", "prompt": [{"role": "user", "content": f"0.{a}+0.{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a / 10 + b / 10)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


def _save_arith_rows(path: Path, n: int = 256) -> None:
    """verl RL rows: a short addition question per row, ground truth the sum (a string)."""
    import pandas as pd

    rng = random.Random(53)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"data_source": "arith/add", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i}})  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)


BUILDERS = {
    "sft_lm": _save_sft_model,
    "tok_pad_is_digit": _save_pad_is_digit_tokenizer,
    "tok_no_bos": _save_no_bos_tokenizer,
}
"""Directory assets, built in this order."""

ROWS = {"float_sum_rows": _save_float_sum_rows, "arith_rows": _save_arith_rows}
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
    print(json.dumps(build_assets(sys.argv[1] if len(sys.argv) > 1 else "/tmp/blind5_assets"), indent=1))
