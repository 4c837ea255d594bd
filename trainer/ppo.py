"""The PPO recipe, top to bottom: setup, rollout, score, reference, values, advantages, update, log.

One step: sample ``batch_size`` responses with the HF generate engine; score them (task reward
function or reward model); take reference log-probs (when ``kl_coef > 0``) and critic values;
recompute the actor's log-probs (``old_logprobs``); KL penalty in the reward or as a loss term;
GAE; whitened advantages; ``ppo_epochs`` passes of clipped policy and value updates over
mini-batches with micro-batch gradient accumulation. Run it:
``python -m trainer.train --config cfg.yaml`` with ``algo.name: ppo`` (or `pytest tests/test_train.py`).
"""

from __future__ import annotations

import torch

from trainer import losses as L
from trainer.common import (
    Averages,
    Resolved,
    Setup,
    StepLog,
    backward,
    build_setup,
    convert_rewards,
    local_batch,
    local_size,
    optimizer_metrics,
    optimizer_step,
    position_ids_for,
    split_indices,
)
from trainer.config import TrainConfig
from trainer.events import Observer


def score_responses(
    setup: Setup, observer: Observer, rollout, examples, reward_fn, reward_name
) -> torch.Tensor:
    """Sequence scores [B] fp32 from the reward model when there is one, else the reward function.

    ``examples`` are aligned with the rollout rows (already repeated for GRPO groups)."""
    rm = setup.models.get("reward")
    b = rollout.response_ids.shape[0]
    if rm is not None:
        from trainer.models import score_with_reward_model

        with torch.no_grad(), setup.autocast("reward"):
            raw = score_with_reward_model(rm, rollout.input_ids, rollout.attention_mask)
        where, source = "model.reward_model", f"model:{setup.config.model.reward_model}"
    else:
        prompts = [ex["prompt"] for ex in examples]
        raw = reward_fn(prompts, rollout.responses_text(setup.tokenizer), examples)
        where, source = (
            "data.reward_fn" if setup.config.data.reward_fn else "data.task",
            f"function:{reward_name}",
        )
    scores = convert_rewards(raw, b, setup.device, where)
    observer.on_reward(source=source, raw=raw, rewards=scores, expected_shape=(b,), model=rm)
    return scores


def rollout_metrics(rollout, old_logprobs: torch.Tensor) -> dict[str, float]:
    """Rollout vs training log-probs of the same tokens (verl ``rollout_corr/...``): a bf16 engine
    feeding an fp32 trainer shows up here. ``kl`` is the k1 estimate of KL(rollout || actor)
    (tokens were sampled by the rollout engine)."""
    mask = rollout.response_mask
    diff = rollout.logprobs.float() - old_logprobs
    absdiff = diff.abs() * mask
    return {
        "rollout_corr/kl": float(L.masked_mean(diff, mask)),
        "rollout_corr/abs_diff_mean": float(L.masked_mean(diff.abs(), mask)),
        "rollout_corr/abs_diff_max": float(absdiff.max()) if absdiff.numel() else 0.0,
    }


def critic_values(critic, input_ids, attention_mask, response_length: int, left_padded=None) -> torch.Tensor:
    """Values [B, R] of the states before each response token (positions P-1 .. P+R-2), fp32."""
    position_ids = position_ids_for(attention_mask)
    values = critic(input_ids, attention_mask, position_ids=position_ids, left_padded=left_padded)
    return values[:, -(response_length + 1) : -1].float()


def reference_logprobs(setup: Setup, observer: Observer, rollout) -> torch.Tensor:
    from trainer.logprobs import sequence_logprobs

    r = rollout.response_ids.shape[1]
    with torch.no_grad(), setup.autocast("reference"):
        ref_logprobs, _ = sequence_logprobs(
            setup.models["reference"],
            rollout.input_ids,
            rollout.attention_mask,
            r,
            temperature=setup.config.algo.temperature,
            left_padded=rollout.left_padded,
        )
    observer.on_forward(role="reference", name="ref_logprobs", output=ref_logprobs)
    return ref_logprobs


def actor_logprobs(setup: Setup, model, rollout, *, entropy: bool):
    from trainer.logprobs import sequence_logprobs

    r = rollout.response_ids.shape[1]
    with setup.autocast("actor"):
        return sequence_logprobs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            r,
            temperature=setup.config.algo.temperature,
            compute_entropy=entropy,
            left_padded=rollout.left_padded,
        )


def update_actor(setup: Setup, observer: Observer, rollout, old_logprobs, advantages, ref_logprobs) -> dict:
    """``ppo_epochs`` passes of the clipped surrogate (+ entropy bonus, + KL loss when not in reward)."""
    algo = setup.config.algo
    model, opt, scaler = setup.models["actor"], setup.optimizers["actor"], setup.scalers["actor"]
    kl_as_loss = ref_logprobs is not None and (algo.name == "grpo" or not algo.kl_in_reward)
    avg, norms, skips = Averages(), [], []
    b = rollout.response_ids.shape[0]
    mini_size = local_size(algo.mini_batch_size, setup, "algo.mini_batch_size")
    for _ in range(algo.ppo_epochs):
        perm = torch.randperm(b)  # global RNG, seeded once in setup
        for mini in split_indices(b, mini_size):
            mini = perm[mini]
            micros = split_indices(len(mini), algo.micro_batch_size)
            for micro in micros:
                idx = mini[micro].to(setup.device)
                sub = _select(rollout, idx)
                logprobs, ent = actor_logprobs(setup, model, sub, entropy=True)
                observer.on_forward(role="actor", name="logprobs", output=logprobs)
                mask = sub.response_mask
                pg_loss, clipfrac, ppo_kl = L.ppo_policy_loss(
                    logprobs, old_logprobs[idx], advantages[idx], mask, algo.clip_ratio
                )
                entropy = L.entropy_loss(ent, mask)
                loss = pg_loss - algo.entropy_coef * entropy
                terms = {"pg_loss": pg_loss, "entropy": entropy}
                if kl_as_loss:
                    kl_loss = L.masked_mean(
                        L.kl_penalty(logprobs, ref_logprobs[idx], algo.kl_estimator), mask
                    )
                    loss = loss + algo.kl_coef * kl_loss
                    terms["kl_loss"] = kl_loss
                observer.on_loss(role="actor", loss=loss, terms=terms)
                backward(loss, "actor", model, scaler, observer, accum=len(mini) / len(micro))
                avg.add(loss=loss, pg_loss=pg_loss, pg_clipfrac=clipfrac, ppo_kl=ppo_kl, **{
                    k: v for k, v in terms.items() if k != "pg_loss"
                })  # fmt: skip
            norm, skipped = optimizer_step(
                "actor", model, opt, scaler, setup.policy["actor"], observer, algo.max_grad_norm
            )
            norms.append(norm)
            skips.append(float(skipped))
    return update_metrics("actor", avg, norms, skips, opt, scaler)


def update_critic(setup: Setup, observer: Observer, rollout, old_values, returns) -> dict:
    algo = setup.config.algo
    model, opt, scaler = setup.models["critic"], setup.optimizers["critic"], setup.scalers["critic"]
    avg, norms, skips = Averages(), [], []
    b, r = rollout.response_ids.shape
    mini_size = local_size(algo.mini_batch_size, setup, "algo.mini_batch_size")
    for _ in range(algo.ppo_epochs):
        perm = torch.randperm(b)
        for mini in split_indices(b, mini_size):
            mini = perm[mini]
            for micro in split_indices(len(mini), algo.micro_batch_size):
                idx = mini[micro].to(setup.device)
                sub = _select(rollout, idx)
                with setup.autocast("critic"):
                    values = critic_values(model, sub.input_ids, sub.attention_mask, r, sub.left_padded)
                observer.on_forward(role="critic", name="values", output=values)
                vf_loss, vf_clipfrac = L.value_loss(
                    values, old_values[idx], returns[idx], sub.response_mask, algo.value_clip
                )
                loss = algo.vf_coef * vf_loss
                observer.on_loss(role="critic", loss=loss, terms={"vf_loss": vf_loss})
                backward(loss, "critic", model, scaler, observer, accum=len(mini) / len(micro))
                avg.add(vf_loss=vf_loss, vf_clipfrac=vf_clipfrac)
            norm, skipped = optimizer_step(
                "critic", model, opt, scaler, setup.policy["critic"], observer, algo.max_grad_norm
            )
            norms.append(norm)
            skips.append(float(skipped))
    return update_metrics("critic", avg, norms, skips, opt, scaler)


def update_metrics(role: str, avg: Averages, norms: list, skips: list, opt, scaler) -> dict:
    """Means of the micro-batch terms, mean grad norm and skipped fraction over optimizer steps, lr, scale."""
    m = {f"{role}/{k}": v for k, v in avg.means().items()}
    m[f"{role}/grad_norm"] = sum(norms) / len(norms)
    m[f"{role}/skipped"] = sum(skips) / len(skips)
    m.update(optimizer_metrics(role, opt, scaler))
    return m


def _select(rollout, idx: torch.Tensor):
    """The rows ``idx`` of a Rollout (every tensor field indexed on dim 0)."""
    import dataclasses

    return dataclasses.replace(
        rollout,
        **{
            f.name: getattr(rollout, f.name)[idx]
            for f in dataclasses.fields(rollout)
            if isinstance(getattr(rollout, f.name), torch.Tensor)
        },
    )


def rollout_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of one rollout: new every step and different on every rank (each rank
    samples its own slice of prompts; one shared stream would draw the same noise on each). Rank 0
    keeps the single-process value, so one-process runs and their baselines do not change."""
    return seed * 100_003 + step + rank * 1_000_000_007


def generate(setup: Setup, observer: Observer, engine, collator, source, examples, step, num_samples=1):
    """Collate prompts, generate; returns the rollout (rows repeat each prompt ``num_samples`` times)."""
    batch = collator(examples)
    observer.on_batch(role="actor", batch=batch, source=source)
    ids = batch["input_ids"].to(setup.device)
    mask = batch["attention_mask"].to(setup.device)
    rollout = engine.generate(
        ids,
        mask,
        num_samples=num_samples,
        generator_seed=rollout_seed(setup.config.seed, step, setup.dist.rank),
    )
    observer.on_rollout(
        engine=engine.name,
        engine_dtype=engine.engine_dtype,
        actor_compute_dtype=setup.policy["actor"].compute_dtype,
        prompt_ids=rollout.prompt_ids,
        response_ids=rollout.response_ids,
        response_mask=rollout.response_mask,
        logprobs=rollout.logprobs,
    )
    return rollout


def prepare(config: TrainConfig, observer: Observer, resolved: Resolved, *, critic: bool):
    """Setup plus the data side of a rollout recipe: examples, collator, reward fn, engine, batches."""
    from trainer import data as D
    from trainer.rollout import build_engine

    algo = config.algo
    setup = build_setup(
        config, observer, resolved, critic=critic, reference=algo.kl_coef > 0, reward_model=True
    )
    examples = D.load_examples(config.data, seed=config.seed, pairs=False)
    source, collator = D.build_collator(config.data, setup.tokenizer, pairs=False)
    reward_name, reward_fn = D.get_reward_fn(config.data)
    # with rollout.fused the decode steps run on a snapshot gathered once per rollout: no collectives
    if config.rollout.cuda_graphs and setup.dist.distributed and not config.rollout.fused:
        raise ValueError(
            f"rollout.cuda_graphs: not with {setup.dist.world_size} ranks (a decode step holds FSDP2 "
            "all-gathers, which a CUDA graph cannot capture); set rollout.fused: true (decodes on a "
            "snapshot gathered once per rollout) or rollout.cuda_graphs: false"
        )
    if config.rollout.compile and setup.dist.distributed and not config.rollout.fused:
        raise ValueError(
            f"rollout.compile: not with {setup.dist.world_size} ranks (compiling a forward that all-gathers "
            "FSDP2 shards is untested here); set rollout.fused: true or rollout.compile: false"
        )
    engine = build_engine(
        setup.models["actor"],
        setup.tokenizer,
        setup.policy["rollout"],
        device=setup.device,
        max_new_tokens=config.data.response_length,
        temperature=algo.temperature,
        top_k=algo.top_k,
        cache=config.rollout.cache,
        cuda_graphs=config.rollout.cuda_graphs,
        compile=config.rollout.compile,
        fused=config.rollout.fused,
    )
    batches = D.iterate_batches(examples, algo.batch_size, seed=config.seed)
    return setup, source, collator, reward_name, reward_fn, engine, batches


def run(config: TrainConfig, observer: Observer, resolved: Resolved) -> list[dict[str, float]]:
    """Trains ``config.steps`` PPO steps; returns the per-step metrics."""
    algo = config.algo
    setup, source, collator, reward_name, reward_fn, engine, batches = prepare(
        config, observer, resolved, critic=True
    )
    actor, critic, ref = setup.models["actor"], setup.models["critic"], setup.models.get("reference")
    log = StepLog(observer, config.abort_on_nonfinite_loss, setup.dist)
    for step in range(config.steps):
        log.start(step)
        examples = local_batch(next(batches), setup)
        with observer.phase("rollout"):
            rollout = generate(setup, observer, engine, collator, source, examples, step)
        mask, r = rollout.response_mask, rollout.response_ids.shape[1]
        with observer.phase("reward"):
            scores = score_responses(setup, observer, rollout, examples, reward_fn, reward_name)
        ref_logprobs = None
        if ref is not None:
            with observer.phase("ref"):
                ref_logprobs = reference_logprobs(setup, observer, rollout)
        with observer.phase("critic"):
            with torch.no_grad(), setup.autocast("critic"):
                values = critic_values(
                    critic, rollout.input_ids, rollout.attention_mask, r, rollout.left_padded
                )
            observer.on_forward(role="critic", name="values", output=values)

        with observer.phase("actor_update"):
            with torch.no_grad():
                old_logprobs, _ = actor_logprobs(setup, actor, rollout, entropy=False)
            observer.on_forward(role="actor", name="old_logprobs", output=old_logprobs)
            metrics = rollout_metrics(rollout, old_logprobs)
            kl = None
            if ref_logprobs is not None:
                kl = L.kl_penalty(old_logprobs, ref_logprobs, algo.kl_estimator)
                metrics["rollout/kl_ref"] = float(L.masked_mean(kl, mask))
            token_rewards = L.token_level_rewards(
                scores, mask, kl if algo.kl_in_reward else None, algo.kl_coef
            )
            advantages, returns = L.compute_gae(token_rewards, values, mask, algo.gamma, algo.lam)
            if algo.normalize_advantages:
                advantages = L.masked_whiten(advantages, mask)
            metrics.update(update_actor(setup, observer, rollout, old_logprobs, advantages, ref_logprobs))
        with observer.phase("critic_update"):
            metrics.update(update_critic(setup, observer, rollout, values, returns))

        metrics.update({
            "critic/score/mean": float(scores.mean()),
            "critic/score/std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "critic/rewards/mean": float(L.masked_sum(token_rewards, mask, dim=-1).mean()),
            "critic/advantages/mean": float(L.masked_mean(advantages, mask)),
            "critic/returns/mean": float(L.masked_mean(returns, mask)),
            "critic/values/mean": float(L.masked_mean(values, mask)),
            "response_length/mean": float(mask.float().sum(-1).mean()),
        })  # fmt: skip
        log.end(step, metrics)
    return log.history
