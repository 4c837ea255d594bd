"""Rollout engine throughput at the Llama-2-7B shape: HF generate (dynamic and static cache) beside our
static decode loop (eager, whole step captured as a CUDA graph, single-token forward compiled by
torch.compile, both), in one process.

    PYTHONUNBUFFERED=1 python benchmarks/rollout_bench.py --out $OUT                 # H200, ~3-4 min
    python benchmarks/rollout_bench.py --out /tmp/rb --device cpu --preset tiny-llama  # CPU smoke

Shape (issue 6): bf16 weights (``bf16-pure`` rollout role), batch 32, 128-token prompts (four rows
left-padded), 128 new tokens, plain sampling (temperature 1, no top-k). Per engine (``--engines``):
median wall time of ``--repeats`` calls after one warm-up (which pays torch.compile: its time is
``compile_s``), new tokens/s end to end (batch x 128 / wall) and decode only (batch x timed decode
steps / decode time), both against the floor, peak allocated memory, and for our engines the prefill
/ decode / graph-capture split. The weight-bandwidth floor is the bytes of every weight a decode step
reads (all but the embedding table) over the device-to-device copy bandwidth measured in the same
run (bytes read + written / time), so one decode step of batch B can emit at most B / floor tokens
per second. For the fastest of our engines (or ``--detail``) one more call times ~50 back-to-back
decode steps between CUDA events (GPU time per step, against the host loop's time per step) and
profiles 3 steps (top-25 kernels -> profile_<engine>.txt). Same-seed agreement between the engines is
recorded, not asserted. Writes rollout_bench.json and rollout_bench.md under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.rollout import StaticDecodeEngine  # noqa: E402

GIB = 2**30
ENGINES = (
    "ours_static",
    "ours_static_graphs",
    "ours_static_compiled",
    "ours_static_graphs_compiled",
    "ours_fused",
    "ours_fused_graphs",
    "ours_fused_graphs_compiled",
    "hf_static",
    "hf_dynamic",
)
DEFAULT_ENGINES = (
    "ours_static_graphs_compiled,ours_fused,ours_fused_graphs,ours_fused_graphs_compiled,hf_dynamic"
)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (moves when a compiled call (re)compiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class TimedStaticDecodeEngine(StaticDecodeEngine):
    """`StaticDecodeEngine` with this benchmark's instrumentation, outside the engine: after each
    `generate`, ``last_stats`` holds prefill / decode / graph-capture / compile seconds and the decode
    step counts; ``on_decode_ready(replay, state)``, if set, runs once after the first decode step
    (``replay()`` runs one more step; the callee restores ``state``). Steps that capture or compile
    are timed apart from ``decode_s``, and so is the hook."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_decode_ready = None
        self.last_stats: dict[str, float] = {}
        self._t: dict[str, float] = {}
        inner = self._decode_forward

        def forward(*a):
            if not self._t.get("compile_pending"):
                return inner(*a)
            # the first compiled call of a generate() compiles when the shapes are new: time it
            # apart (outside any capture: with cuda_graphs it is the warm-up run)
            self._t["compile_pending"] = 0.0
            graphs, c0 = _compiled_graphs(), self._sync()
            out = inner(*a)
            if _compiled_graphs() != graphs:
                self._t["compile_s"] = self._sync() - c0
            return out

        self._decode_forward = forward

    def _sync(self) -> float:
        _sync(self.device)
        return time.perf_counter()

    def _decode(self, prompt_ids, prompt_mask, pad, eos):
        self._t = {
            "compile_pending": float(self.compile),
            "compile_s": 0.0,
            "capture_s": 0.0,
            "hook_s": 0.0,
        }
        t0 = self._sync()
        tokens, logprobs = super()._decode(prompt_ids, prompt_mask, pad, eos)
        t = self._t
        n, graphs, compile_s = tokens.shape[1], self.cuda_graphs, t["compile_s"]
        # steps inside decode_s: the capture's warm-up step and a compiling step are timed apart
        timed = (n - 1) - (1 if graphs and n > 1 else 0) - (1 if compile_s and not graphs else 0)
        self.last_stats = {
            "prefill_s": t["t1"] - t0,
            "decode_s": t["t2"] - t["t1"] - t["capture_s"] - t["hook_s"] - (0.0 if graphs else compile_s),
            "capture_s": max(t["capture_s"] - compile_s, 0.0) if graphs else 0.0,
            "compile_s": compile_s,
            "decode_steps": float(n - 1),
            "timed_steps": float(max(timed, 0)),
        }
        return tokens, logprobs

    def _decode_loop(self, step, st, r):
        self._t["t1"] = self._sync()
        n = super()._decode_loop(step, st, r)
        self._t["t2"] = self._sync()
        return n

    def _capture(self, step):
        c0 = time.perf_counter()
        graph = super()._capture(step)
        self._t["capture_s"] = self._sync() - c0
        return graph

    def _decode_ready(self, replay, state) -> None:
        if self.on_decode_ready is not None:
            h0 = self._sync()
            self.on_decode_ready(replay, state)
            self._t["hook_s"] = self._sync() - h0


def environment(dev: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu_name=props.name, total_memory_gb=round(props.total_memory / GIB, 1))
        try:
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    return env


def _median_seconds(fn) -> float:
    """Device seconds of ``fn()`` between CUDA events: median of 10 after 3 warm-ups."""
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_bandwidth(dev: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    if dev.type != "cuda":
        return float("nan")
    src = torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = _median_seconds(functools.partial(dst.copy_, src))
    del src, dst
    return 2 * 2 * GIB / seconds


def read_bandwidth(dev: torch.device) -> float:
    """Bytes read per second by a reduction over 4 GiB of bf16: the rate a decode step's weight and
    K/V reads can reach at best."""
    if dev.type != "cuda":
        return float("nan")
    src = torch.ones(2 * GIB, dtype=torch.bfloat16, device=dev)
    seconds = _median_seconds(functools.partial(src.sum, dtype=torch.float32))
    del src
    return 4 * GIB / seconds


def build(preset: str, dev: torch.device):
    from trainer.config import ModelConfig
    from trainer.models import build_causal_lm
    from trainer.precision import resolve_policy
    from trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    policy = resolve_policy("bf16-pure")
    model = build_causal_lm(ModelConfig(preset=preset), tok, policy["actor"], dev, seed=0)
    return model, tok, policy["rollout"]


def prompts(vocab: int, batch: int, width: int, dev: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((1, 7, 31, 64)[:batch]):  # a few left-padded rows, like a real batch
        pad = min(pad, width // 2)
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids.to(dev), mask.to(dev)


def make_runner(name: str, model, tok, policy, dev: torch.device, new: int):
    """A callable (ids, mask, seed) -> (Rollout or None, stats) for one engine; ``run.engine`` is our
    engine object (None for HF's static generate)."""
    from transformers import GenerationConfig

    from trainer.rollout import HFGenerateEngine

    if name == "hf_static":
        # HF's own static-cache generate, the issue's 3.7K tokens/s reference; plain sampling. Its
        # automatic torch.compile of static-cache decoding stays off (it fails in 5.17, see the issue)
        cfg = GenerationConfig(
            do_sample=True,
            max_new_tokens=new,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            use_cache=True,
            cache_implementation="static",
            disable_compile=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )

        def run(ids, mask, seed):
            torch.manual_seed(seed)
            model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            return None, {}

        run.engine = None
        return run
    if name not in ENGINES:
        raise ValueError(f"--engines: unknown engine {name!r}; expected some of {', '.join(ENGINES)}")
    kw = dict(device=dev, max_new_tokens=new)
    if name == "hf_dynamic":
        engine = HFGenerateEngine(model, tok, policy, **kw)
    else:
        graphs, compiled, fused = "_graphs" in name, name.endswith("_compiled"), "_fused" in name
        engine = TimedStaticDecodeEngine(
            model, tok, policy, cuda_graphs=graphs, compile=compiled, fused=fused, **kw
        )

    def run(ids, mask, seed):
        r = engine.generate(ids, mask, generator_seed=seed)
        return r, dict(getattr(engine, "last_stats", {}))

    run.engine = engine
    return run


def measure(name, runner, ids, mask, dev, repeats: int) -> tuple[dict, object]:
    b = ids.shape[0]
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    w0 = time.perf_counter()
    rollout, first = runner(ids, mask, 0)  # warm-up (kernels, cuBLAS handles, allocator, compile)
    _sync(dev)
    warmup_s = time.perf_counter() - w0
    walls, stats = [], []
    for i in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        r, st = runner(ids, mask, 1 + i)
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        stats.append(st)
        rollout = r if i == 0 else rollout
    wall = statistics.median(walls)
    new = rollout.response_ids.shape[1] if rollout is not None else None
    row = {
        "engine": name,
        "wall_s": wall,
        "walls_s": walls,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None,
    }
    if rollout is not None:
        row["new_tokens_per_s"] = b * new / wall
        row["mean_response_len"] = float(rollout.response_mask.sum(1).float().mean())
        m = rollout.response_mask.bool()
        row["mean_logprob"] = float(rollout.logprobs[m].mean())
    row["warmup_s"] = warmup_s
    if stats and stats[0]:
        for key in stats[0]:
            row[key] = statistics.median(s[key] for s in stats)
        # the compile is paid by the warm-up call (once per process and shape); later calls report 0
        row["compile_s"] = first.get("compile_s", 0.0)
        steps = max(row["timed_steps"], 1)
        row["decode_ms_per_step"] = 1e3 * row["decode_s"] / steps
        row["decode_tokens_per_s"] = b * steps / row["decode_s"]
    return row, rollout


def _kernel_table(prof, steps: int, top: int = 25) -> tuple[list[dict], str]:
    """Top kernels (device events; CPU ops when there is no device) of a profile, by total time."""
    rows = []
    for evt in prof.key_averages():
        on_device = str(getattr(evt, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        total = getattr(evt, "self_device_time_total", None)
        if total is None:
            total = getattr(evt, "self_cuda_time_total", 0.0)
        if not on_device and total <= 0:
            continue
        rows.append({"name": evt.key, "count": int(evt.count), "total_us": float(total)})
    kind = "kernel"
    if not rows:  # CPU smoke: no device events, report the CPU ops instead
        kind = "cpu op"
        rows = [
            {"name": e.key, "count": int(e.count), "total_us": float(e.self_cpu_time_total)}
            for e in prof.key_averages()
        ]
    rows.sort(key=lambda r: -r["total_us"])
    whole = sum(r["total_us"] for r in rows) or 1.0
    lines = [
        f"{len(rows)} distinct {kind}s, {sum(r['count'] for r in rows) / steps:.0f} launches and "
        f"{whole / steps / 1e3:.3f} ms of {kind} time per decode step ({steps} steps profiled)",
        "",
        f"{'total us':>10} {'count':>7} {'us/step':>9} {'share':>6}  name",
    ]
    for r in rows[:top]:
        lines.append(
            f"{r['total_us']:10.1f} {r['count']:7d} {r['total_us'] / steps:9.1f} "
            f"{100 * r['total_us'] / whole:5.1f}%  {r['name'][:140]}"
        )
    return rows[:top], "\n".join(lines) + "\n"


def detail(name: str, runner, ids, mask, dev: torch.device, new: int, out: Path, replays: int = 50) -> dict:
    """One more call of ``name`` whose decode hook, right after the first decode step, (1) times
    ``replays`` back-to-back decode steps between CUDA events (GPU time per step; the host only
    queues replays, so the GPU never waits on it) and the host time to queue them, (2) profiles 3
    steps; the hook restores the decode buffers after each, so the call still completes normally."""
    from torch.profiler import ProfilerActivity, profile

    engine = runner.engine
    n = min(replays, new - 3)  # the step writes one column / cache slot per replay: stay inside
    if n < 3:
        raise ValueError(f"--new: needs at least 6 new tokens for the replay timing, got {new}")
    res: dict = {"engine": name, "replays": n}

    def hook(replay, state):
        saved = {k: v.clone() for k, v in state.items()}

        def restore():
            for k, v in state.items():
                v.copy_(saved[k])

        _sync(dev)
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        h0 = time.perf_counter()
        for _ in range(n):
            replay()
        res["host_queue_ms_per_step"] = 1e3 * (time.perf_counter() - h0) / n
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            res["gpu_ms_per_step"] = a.elapsed_time(b) / n
        else:
            res["gpu_ms_per_step"] = 1e3 * (time.perf_counter() - h0) / n
        restore()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                replay()
            _sync(dev)
        restore()
        res["top_kernels"], text = _kernel_table(prof, 3)
        header = f"{name}: {n} back-to-back decode steps {res['gpu_ms_per_step']:.3f} ms/step on the device, "
        header += f"{res['host_queue_ms_per_step']:.3f} ms/step to queue on the host\n"
        (out / f"profile_{name}.txt").write_text(header + text)
        print(header + text, flush=True)

    engine.on_decode_ready = hook
    try:
        engine.generate(ids, mask, generator_seed=99)
    finally:
        engine.on_decode_ready = None
    if "gpu_ms_per_step" not in res:
        raise RuntimeError(f"{name}: the decode hook never ran")
    res["loop_ms_per_step"] = 1e3 * engine.last_stats["decode_s"] / max(engine.last_stats["timed_steps"], 1)
    res["profile_file"] = f"profile_{name}.txt"
    return res


def agreement(a, b) -> dict:
    """Same-seed agreement of two rollouts. In bf16 a last-bit logit difference can flip one sampled
    token of a near-uniform random-init model, after which the row's contexts differ: log-probs are
    compared only up to each row's first differing token (same context on both sides)."""
    same = a.response_ids == b.response_ids
    prefix = same.long().cumprod(1).bool() & (a.response_mask & b.response_mask).bool()
    return {
        "first_token_match": float(same[:, 0].float().mean()),
        "rows_identical": float(same.all(1).float().mean()),
        "mean_identical_prefix": float(prefix.sum(1).float().mean()),
        "logprob_max_abs_diff_same_context": float((a.logprobs - b.logprobs)[prefix].abs().max())
        if prefix.any()
        else None,
    }


def markdown(res: dict) -> str:
    env, floor = res["environment"], res["floor"]
    lines = [
        f"Shape: {res['shape']}; GPU {env.get('gpu_name')} (driver {env.get('driver')}), torch {env['torch']}, "
        f"transformers {env['transformers']}, CUDA {env['cuda']}.",
        f"Weight-bandwidth floor: {floor['weight_gb']:.2f} GB of decode-step weights at "
        f"{floor['copy_bw_tb_s']:.2f} TB/s copy bandwidth = {floor['ms_per_step']:.2f} ms per step = "
        f"{floor['tokens_per_s']:.0f} new tokens/s.",
        "",
        "| engine | new tokens/s | % of floor | decode tokens/s | % of floor | decode ms/step | wall s | "
        "prefill s | capture s | compile s (first call) | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    pct = floor["tokens_per_s"]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | failed: {row['error']} | | | | | | | | | |")
            continue

        def f(key, fmt, row=row):
            return format(row[key], fmt) if row.get(key) is not None else "-"

        tps = row.get("new_tokens_per_s") or res["shape_tokens"] / row["wall_s"]
        dtps = row.get("decode_tokens_per_s")
        dpct = f"{100 * dtps / pct:.0f}%" if dtps and pct == pct else "-"
        lines.append(
            f"| {row['engine']} | {tps:.0f} | {100 * tps / pct:.0f}% | {f('decode_tokens_per_s', '.0f')} | {dpct} | "
            f"{f('decode_ms_per_step', '.2f')} | {row['wall_s']:.3f} | {f('prefill_s', '.3f')} | "
            f"{f('capture_s', '.3f')} | {f('compile_s', '.1f')} | {f('max_memory_allocated_gb', '.1f')} |"
        )
    d = res.get("detail")
    if d and "error" not in d:
        lines += [
            "",
            f"Decode step of {d['engine']}: {d['gpu_ms_per_step']:.3f} ms on the device per step "
            f"({d['replays']} back-to-back steps between CUDA events; floor {floor['ms_per_step']:.2f} ms), "
            f"{d['host_queue_ms_per_step']:.3f} ms per step for the host to queue them, "
            f"{d['loop_ms_per_step']:.3f} ms per step in the real loop. Top kernels: {d['profile_file']}.",
        ]
    elif d:
        lines += ["", f"Decode step detail failed: {d['error']}"]
    lines += ["", "Same-seed agreement: " + json.dumps(res["agreement"])]
    return "\n".join(lines) + "\n"


# long: the benchmark's cases run in order and write one table
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of: {', '.join(ENGINES)}")
    ap.add_argument(
        "--detail",
        default="best",
        help="engine to time and profile per step (best: fastest of ours by decode ms/step; none: skip)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": " ".join(sys.argv),
        "environment": environment(dev),
        "shape": f"{args.preset} bf16, batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, sampling",
        "shape_tokens": args.batch * args.new,
        "rows": [],
        "agreement": {},
    }
    bw = copy_bandwidth(dev)
    model, tok, policy = build(args.preset, dev)
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    # bw already counts bytes read + written, i.e. the memory traffic rate; a decode step's traffic is
    # (at least) one read of every weight
    step_s = weight_bytes / bw if bw == bw else float("nan")
    cfg = model.config
    kv_dim = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    # K and V of every layer at the mean number of slots a decode step attends to
    kv_bytes = 2 * cfg.num_hidden_layers * args.batch * kv_dim * 2 * (args.prompt + (args.new - 1) / 2)
    read_bw = read_bandwidth(dev)
    res["floor"] = {
        "weight_gb": weight_bytes / 1e9,
        "kv_gb_mean_step": kv_bytes / 1e9,
        "read_bw_tb_s": read_bw / 1e12,
        "weights_kv_ms_at_read_bw": 1e3 * (weight_bytes + kv_bytes) / read_bw,
        "copy_bw_tb_s": bw / 1e12,
        "ms_per_step": 1e3 * step_s,
        "tokens_per_s": args.batch / step_s,
    }
    print(json.dumps(res["environment"]), json.dumps(res["floor"]), flush=True)
    ids, mask = prompts(model.config.vocab_size, args.batch, args.prompt, dev)
    rollouts, runners = {}, {}
    for name in args.engines.split(","):
        try:
            runners[name] = runner = make_runner(name, model, tok, policy, dev, args.new)
            row, rollouts[name] = measure(name, runner, ids, mask, dev, args.repeats)
        except Exception as e:  # one engine failing must not cost the others' numbers
            row = {
                "engine": name,
                "error": f"{type(e).__name__}: {e}"[:400],
                "traceback": traceback.format_exc(),
            }
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        res["rows"].append(row)
    ours = [r for r in res["rows"] if r.get("decode_ms_per_step") and r["engine"].startswith("ours")]
    pick = min(ours, key=lambda r: r["decode_ms_per_step"])["engine"] if ours else None
    pick = pick if args.detail == "best" else (None if args.detail == "none" else args.detail)
    if pick is not None:
        try:
            res["detail"] = detail(pick, runners[pick], ids, mask, dev, args.new, out)
        except Exception as e:  # the per-engine numbers above stand on their own
            res["detail"] = {
                "engine": pick,
                "error": f"{type(e).__name__}: {e}"[:400],
                "traceback": traceback.format_exc(),
            }
        print(
            json.dumps({k: v for k, v in res["detail"].items() if k not in ("traceback", "top_kernels")}),
            flush=True,
        )
    pairs = [
        ("ours_static_graphs_compiled", "ours_fused_graphs_compiled"),
        ("ours_fused", "ours_fused_graphs"),
        ("ours_static", "ours_static_graphs"),
        ("ours_static_graphs", "ours_static_graphs_compiled"),
        ("ours_static", "ours_static_compiled"),
        ("hf_dynamic", "ours_static"),
    ]
    for a, b in pairs:
        if rollouts.get(a) is not None and rollouts.get(b) is not None:
            res["agreement"][f"{a} vs {b}"] = agreement(rollouts[a], rollouts[b])
    (out / "rollout_bench.json").write_text(json.dumps(res, indent=1))
    (out / "rollout_bench.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
