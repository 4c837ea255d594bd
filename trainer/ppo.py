"""The PPO recipe, top to bottom: setup, rollout, score, reference, values, advantages, update, log.

One step: sample ``batch_size`` responses; score them (task reward function or reward model); take
reference log-probs (when a KL term is on: ``use_kl_in_reward`` / ``use_kl_loss``) and critic
values; recompute the actor's log-probs (``old_logprobs``); the KL penalty in the token rewards;
GAE with whitened advantages; ``ppo_epochs`` passes of ``loss_mode`` policy updates (plus the KL
loss term) and clipped value updates over mini-batches, each micro-batch's loss normalised by its
mini-batch's token count (verl's semantics and defaults: `trainer.config.AlgoConfig`). The steps it
shares with GRPO are `trainer.rl_steps`'s. Run it:
``python -m trainer.train --config cfg.yaml`` with ``algo.name: ppo`` (or `pytest tests/test_train.py`).
"""

from __future__ import annotations

import torch

from trainer import advantages as A
from trainer import losses as L
from trainer.common import (
    Averages,
    Resolved,
    Setup,
    StepLog,
    backward,
    local_batch,
    local_size,
    mini_batch_norm,
    optimizer_step,
    position_ids_for,
    split_indices,
)
from trainer.config import TrainConfig
from trainer.events import Observer
from trainer.mismatch import weighted_advantages
from trainer.rl_steps import (
    _add,
    _select,
    actor_logprobs,
    correct_rollout,
    generate,
    kl_controller,
    loss_old_logprobs,
    prepare,
    reference_logprobs,
    rollout_metrics,
    score_responses,
    shaped_rewards,
    update_actor,
    update_metrics,
)
from trainer.update_stats import update_size, weight_sample


def critic_values(critic, input_ids, attention_mask, response_length: int, left_padded=None) -> torch.Tensor:
    """Values [B, R] of the states before each response token (positions P-1 .. P+R-2), fp32."""
    position_ids = position_ids_for(attention_mask)
    values = critic(input_ids, attention_mask, position_ids=position_ids, left_padded=left_padded)
    return values[:, -(response_length + 1) : -1].float()


def update_critic(setup: Setup, observer: Observer, rollout, old_values, returns) -> dict:
    """``ppo_epochs`` passes of verl's clipped value loss (``cliprange_value``), aggregated like the actor's."""
    algo = setup.config.algo
    model, opt, scaler = setup.models["critic"], setup.optimizers["critic"], setup.scalers["critic"]
    avg, norms, skips = Averages(), [], []
    b, r = rollout.response_ids.shape
    mini_size = local_size(algo.mini_batch_size, setup, "algo.mini_batch_size")
    for _ in range(algo.ppo_epochs):
        perm = torch.randperm(b)
        for mini in split_indices(b, mini_size):
            mini = perm[mini]
            norm = mini_batch_norm(
                rollout.response_mask[mini.to(setup.device)],
                setup,
                algo.loss_scale_factor,
                per_sequence=algo.follows("sum_norm_per_sequence"),
            )
            sums: dict[str, float] = {}
            for micro in split_indices(len(mini), algo.micro_batch_size):
                idx = mini[micro].to(setup.device)
                sub = _select(rollout, idx)
                with setup.autocast("critic"):
                    values = critic_values(model, sub.input_ids, sub.attention_mask, r, sub.left_padded)
                observer.on_forward(role="critic", name="values", output=values)
                vf_loss, vf_clipfrac = L.value_loss(
                    values,
                    old_values[idx],
                    returns[idx],
                    sub.response_mask,
                    algo.cliprange_value,
                    algo.loss_agg_mode,
                    norm,
                )
                loss = algo.vf_coef * vf_loss
                observer.on_loss(role="critic", loss=loss, terms={"vf_loss": vf_loss})
                backward(loss, "critic", model, scaler, observer, accum=1.0)
                _add(sums, vf_loss=vf_loss)
                avg.add(vf_clipfrac=vf_clipfrac)
            avg.add(**sums)
            norm_value, skipped = optimizer_step("critic", model, opt, scaler, observer, algo.max_grad_norm)
            norms.append(norm_value)
            skips.append(float(skipped))
    return update_metrics("critic", avg, norms, skips, opt, scaler)


def run(config: TrainConfig, observer: Observer, resolved: Resolved) -> list[dict[str, float]]:
    """Trains ``config.steps`` PPO steps; returns the per-step metrics."""
    algo = config.algo
    p = prepare(config, observer, resolved, critic=True)
    setup = p.setup
    actor, critic, ref = setup.models["actor"], setup.models["critic"], setup.models.get("reference")
    kl_ctrl = kl_controller(algo)
    log = StepLog(observer, config.abort_on_nonfinite_loss, setup.dist, sources=(p.reward_fn,))
    for step in range(config.steps):
        log.start(step)
        examples = local_batch(next(p.batches), setup)
        with observer.phase("rollout"):
            rollout = generate(setup, observer, p.engine, p.collator, p.source, examples, step)
        mask, r = rollout.response_mask, rollout.response_ids.shape[1]
        with observer.phase("reward"):
            scores = score_responses(setup, observer, rollout, examples, p.reward_fn, p.reward_name)
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
                old_logprobs, old_entropy = actor_logprobs(setup, actor, rollout, entropy=True)
            observer.on_forward(role="actor", name="old_logprobs", output=old_logprobs)
            metrics = rollout_metrics(
                rollout, old_logprobs, old_entropy, config.rollout_correction.is_bounds()[1]
            )
            old_logprobs = loss_old_logprobs(setup, rollout, old_logprobs)  # the rollout's in bypass mode
            token_rewards, kl_metrics = shaped_rewards(
                setup, scores, mask, old_logprobs, ref_logprobs, kl_ctrl
            )
            metrics.update(kl_metrics)
            # verl's order: the correction after the KL reward, before the advantages; rejected tokens
            # leave the mask of GAE and of both updates (``train`` is ``rollout`` without a correction)
            train, is_weights, corr_metrics = correct_rollout(setup, rollout, old_logprobs)
            metrics.update(corr_metrics)
            advantages, returns = A.compute_advantages(
                "gae", token_rewards, train.response_mask, values=values, gamma=algo.gamma, lam=algo.lam
            )
            kl_ref = ref_logprobs if algo.use_kl_loss else None
            weighted = weighted_advantages(advantages, is_weights)
            before = weight_sample(actor, setup.dist.distributed)
            metrics.update(
                update_actor(setup, observer, train, old_logprobs, weighted, kl_ref_logprobs=kl_ref)
            )
            metrics.update({f"actor/{k}": v for k, v in update_size(before).items()})
        with observer.phase("critic_update"):
            before = weight_sample(critic, setup.dist.distributed)
            metrics.update(update_critic(setup, observer, train, values, returns))
            metrics.update({f"critic/{k}": v for k, v in update_size(before).items()})

        metrics.update(
            {
                "critic/score/mean": float(scores.mean()),
                "critic/score/std": float(scores.std()) if scores.numel() > 1 else 0.0,
                "critic/rewards/mean": float(L.masked_sum(token_rewards, mask, dim=-1).mean()),
                "critic/advantages/mean": float(L.masked_mean(advantages, mask)),
                "critic/returns/mean": float(L.masked_mean(returns, mask)),
                "critic/values/mean": float(L.masked_mean(values, mask)),
                "critic/returns/std": float(L.masked_var(returns, mask).clamp(min=0.0).sqrt()),
                "critic/values/std": float(L.masked_var(values, mask).clamp(min=0.0).sqrt()),
                "response_length/mean": float(mask.float().sum(-1).mean()),
            }
        )
        log.end(step, metrics)
    return log.history
