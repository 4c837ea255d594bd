"""Per-rank setup memory of a sharded PPO run (actor, critic, reference): meta-device init against the
old whole-model-then-shard build, and (small presets) the sharded weights against one process's.

Run under torchrun, one process per GPU:

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/sharded_setup.py \\
        --out $OUT --preset llama2-7b --build meta        # what build_setup does now
    ... --build whole                                      # each rank builds every model whole first
    ... --preset tiny-llama --compare                      # bit-for-bit check against one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/sharded_setup.py \\
        --out /tmp/s --device cpu --preset tiny-llama --compare          # CPU smoke (gloo)
    ... --device cpu --preset llama-1b --layers 4 --build meta|whole  # host RSS peaks on CPU

Each rank writes ``sharded_setup.<build>.rank<k>.json`` under --out: the peak device memory during
setup (``torch.cuda.max_memory_allocated``; host peak RSS on CPU), the setup time, and with
--compare whether every gathered parameter equals the one-process build's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30


def _peak_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


def _whole_then_shard(cfg, info, policy):
    """The build before meta-device init: every rank holds each model whole, then shards it."""
    from trainer import common
    from trainer import distributed as D
    from trainer.models import load_tokenizer

    tok = load_tokenizer(cfg.model)
    models = common._whole_models(cfg, tok, policy, info.device, critic=True, reference=True)
    for role, model in models.items():
        D.shard_model(model, policy[role], reshard_after_forward=True)
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--layers", type=int, help="override the preset's num_hidden_layers (smaller CPU runs)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--build", default="meta", choices=("meta", "whole"))
    p.add_argument(
        "--compare", action="store_true", help="also build in one process and compare (small presets)"
    )
    args = p.parse_args()

    import torch

    from trainer import distributed as D
    from trainer.common import Resolved, build_setup
    from trainer.config import TrainConfig
    from trainer.events import NULL_OBSERVER

    torch.set_num_threads(1)
    model = {"preset": args.preset, "overrides": {"num_hidden_layers": args.layers} if args.layers else {}}
    cfg = TrainConfig.from_dict(
        {"device": args.device, "model": model, "precision": {"preset": args.precision}}
    )
    info = D.init_distributed(args.device)
    policy = cfg.precision.build_policy(info.device)
    rec = {"build": args.build, "preset": args.preset, "layers": args.layers, "precision": args.precision}
    rec["dist"] = info.to_dict()
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    t0 = time.perf_counter()
    if args.build == "meta":
        roles = dict(critic=True, reference=True, reward_model=False)
        models = build_setup(cfg, NULL_OBSERVER, Resolved(dist=info, policy=policy), **roles).models
    else:
        models = _whole_then_shard(cfg, info, policy)
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    rec.update(setup_s=time.perf_counter() - t0, setup_peak_gib=_peak_gib(info.device))
    rec["params_b"] = {r: sum(p.numel() for p in m.parameters()) / 1e9 for r, m in models.items()}
    if args.compare:
        one_info = D.DistInfo(rank=0, world_size=1, local_rank=0, device=info.device, backend=None)
        roles = dict(critic=True, reference=True, reward_model=False)
        one = build_setup(cfg, NULL_OBSERVER, Resolved(dist=one_info, policy=policy), **roles).models
        rec["equal_to_one_process"] = {}
        for role, model in one.items():
            full = D.full_state_dict(models[role])
            rec["equal_to_one_process"][role] = all(
                torch.equal(full[k], p.detach().cpu()) for k, p in model.named_parameters()
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sharded_setup.{args.build}.rank{info.rank}.json"
    (out / name).write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec), flush=True)
    D.destroy()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the shared hosts
    main()
