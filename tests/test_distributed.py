"""FSDP2 on CPU: two gloo processes under torchrun train a tiny Llama like one process does.

`pytest tests/test_distributed.py` launches this same file once as
``python -m torch.distributed.run --nproc_per_node 2 tests/test_distributed.py OUT.json``; the worker
(`_worker_main`) runs every scenario in that one job (imports dominate the cost on 2 cores) and
rank 0 writes the results, which the tests below check. Each FSDP run is compared with a
single-process run of the same model on the same global batch, computed in the same worker.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainer import distributed as D  # noqa: E402
from trainer.precision import LossScaler, resolve_policy  # noqa: E402

VOCAB = 64
CFG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
STEPS, LR, MAX_NORM = 3, 1.0, 0.5


# ----------------------------------------------------------------------------------------- worker
def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG, attn_implementation="sdpa"))


def _global_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))


def _loss(model, ids, role):
    """Mean next-token NLL; log-softmax in fp32 (the log-probs island), as the recipes take it."""
    with role.autocast_ctx("cpu"):
        logits = model(input_ids=ids).logits
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -lp.mean(), logits.dtype


def _inject_inf(model) -> None:
    for p in model.parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if g.numel():
            g.view(-1)[0] = float("inf")
            return


def _train(model, ids, role, *, info=None, scaler=None, inject_step=None, torch_scaler=None):
    """SGD (scale-sensitive, unlike Adam: a summed instead of averaged gradient would show)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"loss": [], "grad_norm": [], "scale": [], "skipped": [], "logits_dtype": None}
    for step in range(STEPS):
        loss, out["logits_dtype"] = _loss(model, ids, role)
        if torch_scaler is not None:
            torch_scaler.scale(loss).backward()
        else:
            (scaler.scale_loss(loss) if scaler else loss).backward()
        if step == inject_step and info is not None and info.rank == 1:
            _inject_inf(model)  # one rank only: the skip decision must still agree
        before = D.full_state_dict(model) if inject_step is not None else None
        if torch_scaler is not None:
            torch_scaler.unscale_(opt)
            norm = D.clip_grad_norm_(model.parameters(), MAX_NORM)
            torch_scaler.step(opt)
            torch_scaler.update()
            out["scale"].append(float(torch_scaler.get_scale()))
        else:
            found = scaler.unscale_(model.parameters()) if scaler else False
            norm = D.clip_grad_norm_(model.parameters(), MAX_NORM)
            if not found:
                opt.step()
            if scaler:
                scaler.update()
                out["scale"].append(scaler.scale)
        if before is not None:
            after = D.full_state_dict(model)
            out["skipped"].append(all(torch.equal(before[k], after[k]) for k in before))
        opt.zero_grad(set_to_none=True)
        metrics = {"loss": float(loss), "norm": float(norm)}
        if info is not None:
            metrics = D.reduce_metrics(metrics, info)
        out["loss"].append(metrics["loss"])
        out["grad_norm"].append(metrics["norm"])
    return out


def _weights_report(ref_init, ref_final, got_final) -> dict:
    """Relative error of the update (final - init) of the FSDP run against the reference's."""
    num = sum(float((got_final[k] - ref_final[k]).float().norm() ** 2) for k in ref_final)
    den = sum(float((ref_final[k] - ref_init[k]).float().norm() ** 2) for k in ref_final)
    return {"update_rel_err": math.sqrt(num / den), "update_norm": math.sqrt(den)}


def _scenario(info, preset: str, *, reshard: bool = True, fp16_scaler: str | None = None) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    role = resolve_policy(preset)["actor"]
    ids = _global_batch()
    base = _model().to(role.param_dtype)
    init = {k: v.detach().clone() for k, v in base.named_parameters()}
    ref = copy.deepcopy(base)
    kw = {} if fp16_scaler is None else {"inject_step": 1}
    if fp16_scaler == "ours":
        kw["scaler"] = LossScaler("dynamic", init_scale=2.0**10, growth_interval=1)
    ref_scaler = LossScaler("dynamic", init_scale=2.0**10) if fp16_scaler else None
    ref_out = _train(ref, ids, role, scaler=ref_scaler)
    model = D.shard_model(copy.deepcopy(base), role, reshard_after_forward=reshard)
    if fp16_scaler == "torch":
        kw["torch_scaler"] = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=1)
    got = _train(model, ids[D.local_slice(len(ids), info)], role, info=info, **kw)
    final = D.full_state_dict(model)
    local = next(iter(model.parameters()))
    return {
        "ref": {**ref_out, "logits_dtype": str(ref_out["logits_dtype"])},
        "fsdp": {**got, "logits_dtype": str(got["logits_dtype"])},
        "weights": _weights_report(init, {k: v.detach() for k, v in ref.named_parameters()}, final),
        "param_is_dtensor": hasattr(local, "to_local"),
        "param_dtype": str(local.dtype),
        "local_rows": local.to_local().shape[0],
        "full_rows": local.shape[0],
    }


def _build_sharded_scenario(info) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    role = resolve_policy("bf16-pure")["actor"]
    config = LlamaConfig(**CFG, attn_implementation="sdpa")
    model = D.build_sharded(lambda: LlamaForCausalLM(config), role, info, seed=3)
    full = D.full_state_dict(model)
    torch.manual_seed(3)
    one = LlamaForCausalLM(config).to(role.param_dtype)  # what one process builds from the same seed
    q = full["model.layers.0.self_attn.q_proj.weight"]
    half = q.shape[0] // 2
    fresh = type(model.model.rotary_emb)(config=config)
    loss, _ = _loss(model, _global_batch()[D.local_slice(4, info)], resolve_policy("fp32")["actor"])
    loss.backward()
    return {
        "equals_one_process": all(torch.equal(full[k], v) for k, v in one.state_dict().items() if k in full)
        and set(full) == {k for k, _ in one.named_parameters()},
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "all_finite": all(bool(torch.isfinite(v).all()) for v in full.values()),
        "norm_weights_one": all(bool((v == 1).all()) for k, v in full.items() if "norm" in k),
        "q_std": float(q.std()),
        "shards_differ": not torch.allclose(q[:half], q[half:]),
        "inv_freq_ok": bool(torch.equal(model.model.rotary_emb.inv_freq, fresh.inv_freq)),
        "loss": D.reduce_metrics({"loss": float(loss)}, info)["loss"],
        "grads_finite": all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()),
    }


def _build_setup_scenario(info, preset: str) -> dict:
    """`build_setup` of a 2-rank PPO run (actor, critic, reference sharded) against the same setup in
    one process: the ranks build on the meta device and materialise only their shards, and the
    gathered weights, buffers and the generator's state afterwards are the one process's, bit for bit."""
    from trainer import meta_init
    from trainer import models as M
    from trainer.common import Resolved, build_setup
    from trainer.config import TrainConfig
    from trainer.events import NULL_OBSERVER

    model = {"overrides": {"num_hidden_layers": 3}}
    cfg = TrainConfig.from_dict({"device": "cpu", "precision": {"preset": preset}, "model": model})
    built_on, peaks = [], []
    real_build, real_replay = M.build_causal_lm, meta_init.replay_init

    def build_spy(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built_on.append(str(next(model.parameters()).device))
        return model

    def replay_spy(*args, **kwargs):
        peaks.append(real_replay(*args, **kwargs))
        return peaks[-1]

    M.build_causal_lm, meta_init.replay_init = build_spy, replay_spy
    try:
        roles = dict(critic=True, reference=True, reward_model=False)
        sharded = build_setup(
            cfg, NULL_OBSERVER, Resolved(dist=info, policy=cfg.precision.build_policy()), **roles
        )
        rng_sharded, sharded_built_on = torch.get_rng_state(), list(built_on)
        one_info = D.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
        one = build_setup(
            cfg, NULL_OBSERVER, Resolved(dist=one_info, policy=cfg.precision.build_policy()), **roles
        )
        rng_one = torch.get_rng_state()
    finally:
        M.build_causal_lm, meta_init.replay_init = real_build, real_replay
    out = {
        "built_on": sharded_built_on,
        "replay_peak_bytes": max(peaks, default=None),
        "rng_equal": torch.equal(rng_sharded, rng_one),
    }
    for role, model in one.models.items():
        full = D.full_state_dict(sharded.models[role])
        params = dict(model.named_parameters())
        out[role] = {
            "sharded": all(hasattr(p, "to_local") for p in sharded.models[role].parameters()),
            "same_names": set(full) == set(params),
            "weights_equal": all(torch.equal(full[k], p.detach()) for k, p in params.items()),
            "dtypes_equal": all(full[k].dtype == p.dtype for k, p in params.items()),
            "buffers_equal": all(
                torch.equal(b, dict(sharded.models[role].named_buffers())[k])
                for k, b in model.named_buffers()
            ),
            "bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "largest_param_bytes": max(p.numel() * p.element_size() for p in params.values()),
        }
    return out


def _fused_rollout_scenario(info, preset: str) -> dict:
    """`rollout.engine: fused` on an FSDP2-sharded actor: the snapshot gathers every shard, so each rank
    samples exactly what one process with the whole model samples (same prompts, same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.rollout import StaticDecodeEngine
    from trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    policy = resolve_policy(preset)
    special = dict(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    config = LlamaConfig(**{**CFG, "vocab_size": len(tok)}, **special, attn_implementation="sdpa")
    torch.manual_seed(11)
    base = LlamaForCausalLM(config).to(policy["actor"].param_dtype)
    g = torch.Generator().manual_seed(100 + info.rank)  # each rank its own prompts, as in training
    ids = torch.randint(4, len(tok), (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2], ids[0, :2] = 0, tok.pad_token_id
    kw = dict(device="cpu", max_new_tokens=9, fused=True)
    seed = 7 + info.rank
    one = StaticDecodeEngine(base, tok, policy["rollout"], **kw).generate(ids, mask, generator_seed=seed)
    sharded = D.shard_model(copy.deepcopy(base), policy["actor"])
    engine = StaticDecodeEngine(sharded, tok, policy["rollout"], **kw)
    got = engine.generate(ids, mask, generator_seed=seed)
    from trainer.fused_decode import FusedWeights

    # gathered, every weight is held anew: the embedding in its stored dtype, the rest in the rollout's
    embed = base.model.embed_tokens.weight
    rest = sum(p.numel() for p in base.parameters()) - embed.numel()
    expected = embed.numel() * embed.element_size() + rest * torch.finfo(engine.engine_dtype).bits // 8
    return {
        "snapshot_bytes": [FusedWeights(sharded, engine.engine_dtype).nbytes(), expected],
        "param_is_dtensor": hasattr(next(iter(sharded.parameters())), "to_local"),
        "engine_dtype": str(engine.engine_dtype),
        "tokens_equal": torch.equal(one.response_ids, got.response_ids),
        "logprobs_equal": torch.equal(one.logprobs, got.logprobs),
        "tokens": got.response_ids.tolist(),
    }


def _worker_main(out_path: str) -> None:
    torch.set_num_threads(1)
    info = D.init_distributed("cpu")
    results = {"info": info.to_dict()}
    results["fp32"] = _scenario(info, "fp32")
    results["fp32_noreshard"] = _scenario(info, "fp32", reshard=False)
    results["bf16"] = _scenario(info, "bf16")
    results["bf16-pure"] = _scenario(info, "bf16-pure")
    results["fp16_ours"] = _scenario(info, "fp16", fp16_scaler="ours")
    results["fp16_torch"] = _scenario(info, "fp16", fp16_scaler="torch")
    results["build_sharded"] = _build_sharded_scenario(info)
    results["setup_fp32"] = _build_setup_scenario(info, "fp32")
    results["setup_bf16"] = _build_setup_scenario(info, "bf16")
    results["fused_fp32"] = _fused_rollout_scenario(info, "fp32")
    results["fused_bf16"] = _fused_rollout_scenario(info, "bf16")
    per_rank = [None] * info.world_size
    torch.distributed.all_gather_object(per_rank, {k: v for k, v in results.items()})
    if info.is_main:
        Path(out_path).write_text(json.dumps({"ranks": per_rank}))
    D.destroy()


# ------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "results.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(Path(__file__).resolve()),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    # torchrun's own report hides the cause; the workers' tracebacks are the "[rankN]:" lines
    worker_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank")]
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n".join(worker_lines)[-8000:]
    return json.loads(out.read_text())["ranks"]


def test_both_ranks_joined_gloo(fsdp):
    assert [r["info"]["rank"] for r in fsdp] == [0, 1]
    assert {r["info"]["backend"] for r in fsdp} == {"gloo"}


@pytest.mark.parametrize("name", ["fp32", "fp32_noreshard"])
def test_fp32_fsdp_matches_single_process(fsdp, name):
    for rank in fsdp:
        r = rank[name]
        assert r["param_is_dtensor"] and r["full_rows"] == 2 * r["local_rows"]  # 64-row embedding, 32 each
        # Same global batch, gradients averaged over ranks: same loss, norm and weights to fp32 rounding.
        assert r["fsdp"]["loss"] == pytest.approx(r["ref"]["loss"], rel=1e-5)
        assert r["fsdp"]["grad_norm"] == pytest.approx(r["ref"]["grad_norm"], rel=1e-4)
        assert min(r["ref"]["grad_norm"]) > MAX_NORM  # so the clip really acted on both sides
        assert r["ref"]["loss"][-1] < r["ref"]["loss"][0]  # the steps trained something
        assert r["weights"]["update_norm"] > 0.1
        assert r["weights"]["update_rel_err"] < 1e-4


def test_reshard_after_forward_false_gives_the_same_numbers(fsdp):
    a, b = fsdp[0]["fp32"]["fsdp"], fsdp[0]["fp32_noreshard"]["fsdp"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_bf16_mixed_fsdp_matches_autocast_single_process(fsdp):
    for rank in fsdp:
        r = rank["bf16"]
        # fp32 master shards, bf16 compute through MixedPrecisionPolicy(param_dtype=bf16)
        assert r["param_dtype"] == "torch.float32"
        assert r["fsdp"]["logits_dtype"] == "torch.bfloat16"
        # Autocast keeps the residual stream fp32 where FSDP's bf16 params make it bf16: the two
        # differ by bf16 rounding (2^-8 relative), not by a factor (2x would be update_rel_err 1).
        assert r["fsdp"]["loss"] == pytest.approx(r["ref"]["loss"], rel=2e-2)
        assert r["fsdp"]["grad_norm"] == pytest.approx(r["ref"]["grad_norm"], rel=5e-2)
        assert r["weights"]["update_rel_err"] < 0.1


def test_bf16_pure_shards_stay_bf16(fsdp):
    for rank in fsdp:
        r = rank["bf16-pure"]
        assert r["param_dtype"] == "torch.bfloat16" and r["fsdp"]["logits_dtype"] == "torch.bfloat16"
        assert r["fsdp"]["loss"] == pytest.approx(r["ref"]["loss"], rel=2e-2)
        assert r["weights"]["update_rel_err"] < 0.1


def test_fp16_inf_on_one_rank_skips_on_both(fsdp):
    for rank in fsdp:
        r = rank["fp16_ours"]["fsdp"]
        # init 2^10, growth every finite step: 2048 after step 0, back to 1024 for the skipped
        # step 1 (inf planted on rank 1 only), 2048 after step 2.
        assert r["scale"] == [2048.0, 1024.0, 2048.0]
        assert r["skipped"] == [False, True, False]


def test_loss_scaler_agrees_with_sharded_grad_scaler(fsdp):
    ours, theirs = fsdp[0]["fp16_ours"], fsdp[0]["fp16_torch"]
    assert ours["fsdp"]["scale"] == theirs["fsdp"]["scale"]
    assert ours["fsdp"]["skipped"] == theirs["fsdp"]["skipped"]
    assert ours["fsdp"]["loss"] == pytest.approx(theirs["fsdp"]["loss"], rel=1e-6)
    # same weights: both runs' updates differ from the (unskipped) reference by the same amount
    assert ours["weights"]["update_rel_err"] == pytest.approx(theirs["weights"]["update_rel_err"], rel=1e-5)


def test_build_sharded_initialises_local_shards(fsdp):
    for rank in fsdp:
        r = rank["build_sharded"]
        assert r["all_finite"] and r["grads_finite"] and r["norm_weights_one"] and r["inv_freq_ok"]
        # the shards hold exactly what one process draws from the same seed, cast to bf16
        assert r["equals_one_process"] and r["dtypes"] == ["torch.bfloat16"]
        assert r["shards_differ"]  # the two halves of one random matrix
        assert r["q_std"] == pytest.approx(0.02, rel=0.15)  # 32x32 draws of N(0, 0.02)
        # std-0.02 weights give near-zero logits: a uniform next-token guess, loss = ln 64 = 4.159
        assert r["loss"] == pytest.approx(math.log(VOCAB), abs=0.05)


@pytest.mark.parametrize("name", ["setup_fp32", "setup_bf16"])
def test_sharded_setup_builds_on_meta_with_the_one_process_weights(fsdp, name):
    for rank in fsdp:
        r = rank[name]
        # the actor (and from it critic and reference) never whole on a rank; the one-process build is
        # made on the CPU in the same worker, after the sharded one
        assert r["built_on"] == ["meta"]
        for role in ("actor", "critic", "reference"):
            assert r[role]["sharded"] and r[role]["same_names"], (role, r[role])
            assert r[role]["weights_equal"] and r[role]["dtypes_equal"] and r[role]["buffers_equal"], role
        # the replay held one full parameter at a time (the embedding, or lm_head), never the model
        assert r["replay_peak_bytes"] <= r["actor"]["largest_param_bytes"] < r["actor"]["bytes"] / 3
        assert r["rng_equal"]  # later draws (data, rollout) see the generator one process leaves
    # bf16: fp32 master weights for actor and critic, the reference stored in bf16 (a cast of the same init)
    bf16 = fsdp[0]["setup_bf16"]
    assert bf16["reference"]["bytes"] * 2 == bf16["actor"]["bytes"]


# ---------------------------------------------------------------------- single-process unit tests
@pytest.mark.parametrize("name", ["fused_fp32", "fused_bf16"])
def test_fused_rollout_on_shards_samples_what_one_process_samples(fsdp, name):
    for rank in fsdp:
        r = rank[name]
        assert r["param_is_dtensor"] and r["tokens_equal"] and r["logprobs_equal"], r
        assert r["engine_dtype"] == ("torch.float32" if name == "fused_fp32" else "torch.bfloat16")
        assert r["snapshot_bytes"][0] == r["snapshot_bytes"][1]  # the gathered embedding counted too
    assert fsdp[0][name]["tokens"] != fsdp[1][name]["tokens"]  # the ranks sampled their own prompts


def test_init_distributed_without_torchrun_is_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = D.init_distributed("cpu")
    assert (info.rank, info.world_size, info.backend, info.distributed) == (0, 1, None, False)
    assert info.device == torch.device("cpu")


def test_init_distributed_refuses_pinned_gpu_and_missing_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="pins every one of the 2 ranks"):
        D.init_distributed("cuda:1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        D.init_distributed("cpu")


@pytest.mark.parametrize(
    "preset, param, reduce",
    [  # the table in fsdp_mixed_precision's docstring
        ("fp32", None, torch.float32),
        ("fp16", torch.float16, torch.float32),
        ("bf16", torch.bfloat16, torch.float32),
        ("bf16-pure", None, torch.bfloat16),
    ],
)
def test_mixed_precision_mapping(preset, param, reduce):
    mp, reasons = D.fsdp_mixed_precision(resolve_policy(preset)["actor"])
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == (param, reduce, None)
    assert set(reasons) == {"param_dtype", "reduce_dtype", "output_dtype"}


def test_shard_model_errors():
    role = resolve_policy("fp32")["actor"]
    with pytest.raises(ValueError, match="no process group"):
        D.shard_model(_model(), role)
    with pytest.raises(ValueError, match="no decoder layer list"):
        D.decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert len(D.decoder_layers(_model())) == CFG["num_hidden_layers"]


def test_clip_grad_norm_plain_tensors_and_nonfinite_left_alone():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    norm = D.clip_grad_norm_([p], 1.0)
    assert float(norm) == pytest.approx(5.0)  # sqrt(9 + 16), measured before clipping
    assert p.grad.tolist() == pytest.approx([0.6, 0.8])  # scaled by 1 / 5
    p.grad = torch.tensor([float("inf"), 4.0])
    assert math.isinf(float(D.clip_grad_norm_([p], 1.0)))
    assert p.grad.tolist() == [float("inf"), 4.0]  # torch's clip would have made [nan, 0]


@given(world=st.integers(1, 8), per=st.integers(1, 16))
def test_local_slices_partition_the_batch(world, per):
    n = world * per
    rows = []
    for rank in range(world):
        info = D.DistInfo(
            rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo"
        )
        rows.extend(range(n)[D.local_slice(n, info)])
    assert rows == list(range(n))


def test_local_slice_uneven_batch_names_the_field():
    info = D.DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match=r"algo.batch_size: 5 rows .* multiple of 2"):
        D.local_slice(5, info)


if __name__ == "__main__":
    _worker_main(sys.argv[1])


def test_each_rank_samples_with_its_own_seed():
    from trainer.rl_steps import rollout_seed

    # rank 0 keeps the one-process formula (seed * 100003 + step): CI baselines stay valid
    assert rollout_seed(3, 7) == 3 * 100_003 + 7 == rollout_seed(3, 7, rank=0)
    seeds = {rollout_seed(0, step, rank) for step in range(50) for rank in range(8)}
    assert len(seeds) == 50 * 8  # no two (step, rank) pairs share a sampling stream
