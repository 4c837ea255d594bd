"""The critic-free recipe (GRPO and verl's other outcome estimators): PPO's update, group advantages.

One step: sample ``group_size`` responses for each of ``batch_size`` prompts; score them; token
rewards (minus the KL penalty with ``use_kl_in_reward``); advantages from ``adv_estimator`` with the
rows grouped by prompt (``grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
``remax``, ``gpg``, ``opo``, ``grpo_passk``, ``gdpo``, ``optimal_token_baseline`` and the others; ReMax also
decodes one greedy response per prompt and scores it as the baseline, GDPO reads the reward's components
(``gdpo_reward_keys``), the optimal token baselines the old policy's sum_v pi_v^2 from its log-prob
forward); then PPO's actor update, with the KL loss term when ``use_kl_loss``.
The rollout, scoring and actor update are the steps PPO uses too (`trainer.rl_steps`), called in this
order. Run
it: ``python -m trainer.train --config cfg.yaml`` with ``algo.name: grpo`` (or `pytest tests/test_train.py`).
"""

from __future__ import annotations

import torch

from trainer import advantages as A
from trainer import losses as L
from trainer.common import Resolved, StepLog, local_batch
from trainer.config import TrainConfig
from trainer.events import Observer
from trainer.mismatch import weighted_advantages
from trainer.rl_steps import (
    actor_logprobs,
    correct_rollout,
    generate,
    kl_controller,
    loss_old_logprobs,
    prepare,
    reference_logprobs,
    rollout_metrics,
    score_components,
    score_responses,
    shaped_rewards,
    update_actor,
)
from trainer.update_stats import update_size, weight_sample


def run(config: TrainConfig, observer: Observer, resolved: Resolved) -> list[dict[str, float]]:
    """Trains ``config.steps`` steps of the critic-free recipe; returns the per-step metrics."""
    algo = config.algo
    g = algo.group_size
    p = prepare(config, observer, resolved, critic=False)
    setup = p.setup
    actor = setup.models["actor"]
    kl_ctrl = kl_controller(algo)
    log = StepLog(observer, config.abort_on_nonfinite_loss, setup.dist, sources=(p.reward_fn,))
    for step in range(config.steps):
        log.start(step)
        examples = local_batch(next(p.batches), setup)  # over prompts: each rank samples whole groups
        with observer.phase("rollout"):
            rollout = generate(setup, observer, p.engine, p.collator, p.source, examples, step, num_samples=g)
            if p.greedy_engine is not None:
                greedy = generate(
                    setup, observer, p.greedy_engine, p.collator, p.source, examples, step, baseline=True
                )
        mask = rollout.response_mask
        grouped = [ex for ex in examples for _ in range(g)]  # aligned with the repeat-interleaved rows
        with observer.phase("reward"):
            baselines = None
            if p.greedy_engine is not None:  # scored first: the sampled rows' reward is the step's last
                greedy_scores = score_responses(setup, observer, greedy, examples, p.reward_fn, p.reward_name)
                baselines = greedy_scores.repeat_interleave(g)
            scores, components = score_components(
                setup, observer, rollout, grouped, p.reward_fn, p.reward_name, algo.gdpo_reward_keys or ()
            )
        ref_logprobs = None
        if "reference" in setup.models:
            with observer.phase("ref"):
                ref_logprobs = reference_logprobs(setup, observer, rollout)

        with observer.phase("actor_update"):
            # the optimal token baselines read sum_v pi_v^2 of this forward (verl's calculate_sum_pi_squared)
            spp = [] if A.ADV_ESTIMATOR.entry(algo.estimator).info.get("sum_pi_squared") else None
            with torch.no_grad():
                old_logprobs, old_entropy = actor_logprobs(
                    setup, actor, rollout, entropy=True, sum_pi_squared=spp
                )
            observer.on_forward(role="actor", name="old_logprobs", output=old_logprobs)
            metrics = rollout_metrics(
                rollout, old_logprobs, old_entropy, config.rollout_correction.is_bounds()[1]
            )
            old_logprobs = loss_old_logprobs(setup, rollout, old_logprobs)  # the rollout's in bypass mode
            token_rewards, kl_metrics = shaped_rewards(
                setup, scores, mask, old_logprobs, ref_logprobs, kl_ctrl
            )
            metrics.update(kl_metrics)
            # verl's rollout correction, between the KL reward and the advantages (as in trainer.ppo.run)
            train, is_weights, corr_metrics = correct_rollout(setup, rollout, old_logprobs)
            metrics.update(corr_metrics)
            advantages, returns = A.compute_advantages(
                algo.estimator,
                token_rewards,
                train.response_mask,
                index=A.group_index(mask.shape[0], g, mask.device),
                reward_baselines=baselines,
                gamma=algo.gamma,
                norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
                carry_holes=algo.follows("reinforce_carries_holes"),
                old_logprobs=old_logprobs,
                sum_pi_squared=spp[0] if spp else None,
                is_weights=is_weights,
                components=components,
                component_weights=algo.gdpo_reward_weights,
            )
            kl_ref = ref_logprobs if algo.use_kl_loss else None
            weighted = weighted_advantages(advantages, is_weights)
            before = weight_sample(setup.models["actor"], setup.dist.distributed)
            metrics.update(
                update_actor(setup, observer, train, old_logprobs, weighted, kl_ref_logprobs=kl_ref)
            )
            metrics.update({f"actor/{k}": v for k, v in update_size(before).items()})

        metrics.update(_batch_metrics(scores, token_rewards, mask, advantages, returns, baselines))
        for key, values in zip(algo.gdpo_reward_keys or (), components if components is not None else ()):
            metrics.update(_component_metrics(key, values))
        log.end(step, metrics)
    return log.history


def _batch_metrics(scores, token_rewards, mask, advantages, returns, baselines) -> dict[str, float]:
    """verl's ``critic/*`` batch statistics of the step (and ReMax's greedy baseline)."""
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "critic/rewards/mean": float(L.masked_sum(token_rewards, mask, dim=-1).mean()),
        "critic/advantages/mean": float(L.masked_mean(advantages, mask)),
        "critic/returns/mean": float(L.masked_mean(returns, mask)),
        "response_length/mean": float(mask.float().sum(-1).mean()),
    }
    if baselines is not None:
        out["critic/reward_baseline/mean"] = float(baselines.mean())
    return out


def _component_metrics(key: str, values: torch.Tensor) -> dict[str, float]:
    """verl's ``gdpo/<key>/mean|std|max|min`` of one reward component over the batch (numpy's std: /n)."""
    v = values.double()
    return {
        f"gdpo/{key}/mean": float(v.mean()),
        f"gdpo/{key}/std": float(v.std(correction=0)),
        f"gdpo/{key}/max": float(v.max()),
        f"gdpo/{key}/min": float(v.min()),
    }
