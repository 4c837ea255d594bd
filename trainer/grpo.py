"""The GRPO recipe: PPO's clipped update with group-normalised advantages and no critic.

One step: sample ``group_size`` responses for each of ``batch_size`` prompts; score them; each
response's advantage is its score normalised within its group, broadcast over its tokens; the KL to
the reference (when ``kl_coef > 0``) is a loss term with ``algo.kl_estimator``. The rollout, scoring
and actor update are PPO's functions (`trainer.ppo`), called in GRPO's order. Run it:
``python -m trainer.train --config cfg.yaml`` with ``algo.name: grpo`` (or `pytest tests/test_train.py`).
"""

from __future__ import annotations

import torch

from trainer import losses as L
from trainer.common import Resolved, StepLog, local_batch
from trainer.config import TrainConfig
from trainer.events import Observer
from trainer.ppo import (
    actor_logprobs,
    generate,
    prepare,
    reference_logprobs,
    rollout_metrics,
    score_responses,
    update_actor,
)


def run(config: TrainConfig, observer: Observer, resolved: Resolved) -> list[dict[str, float]]:
    """Trains ``config.steps`` GRPO steps; returns the per-step metrics."""
    algo = config.algo
    g = algo.group_size
    setup, source, collator, reward_name, reward_fn, engine, batches = prepare(
        config, observer, resolved, critic=False
    )
    actor = setup.models["actor"]
    log = StepLog(observer, config.abort_on_nonfinite_loss, setup.dist)
    for step in range(config.steps):
        log.start(step)
        examples = local_batch(next(batches), setup)  # over prompts: each rank samples whole groups
        with observer.phase("rollout"):
            rollout = generate(setup, observer, engine, collator, source, examples, step, num_samples=g)
        mask = rollout.response_mask
        grouped = [ex for ex in examples for _ in range(g)]  # aligned with the repeat-interleaved rows
        with observer.phase("reward"):
            scores = score_responses(setup, observer, rollout, grouped, reward_fn, reward_name)
        ref_logprobs = None
        if "reference" in setup.models:
            with observer.phase("ref"):
                ref_logprobs = reference_logprobs(setup, observer, rollout)

        with observer.phase("actor_update"):
            with torch.no_grad():
                old_logprobs, _ = actor_logprobs(setup, actor, rollout, entropy=False)
            observer.on_forward(role="actor", name="old_logprobs", output=old_logprobs)
            metrics = rollout_metrics(rollout, old_logprobs)
            if ref_logprobs is not None:
                kl = L.kl_penalty(old_logprobs, ref_logprobs, algo.kl_estimator)
                metrics["rollout/kl_ref"] = float(L.masked_mean(kl, mask))
            advantages = L.grpo_advantages(scores, g)[:, None] * mask.float()
            metrics.update(update_actor(setup, observer, rollout, old_logprobs, advantages, ref_logprobs))

        metrics.update({
            "critic/score/mean": float(scores.mean()),
            "critic/score/std": float(scores.std()) if scores.numel() > 1 else 0.0,
            # No KL in the reward: the token-level reward summed over a sequence is its score.
            "critic/rewards/mean": float(scores.mean()),
            "critic/advantages/mean": float(L.masked_mean(advantages, mask)),
            "critic/returns/mean": float(L.masked_mean(advantages, mask)),  # verl: returns = advantages
            "response_length/mean": float(mask.float().sum(-1).mean()),
        })  # fmt: skip
        log.end(step, metrics)
    return log.history
