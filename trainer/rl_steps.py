"""The steps every rollout recipe shares (PPO and the critic-free recipe, `trainer.ppo` and `trainer.grpo`):
setup and data (`prepare`), sampling (`generate`), scoring (`score_responses`), reference and actor
log-probs, the KL in the reward (`shaped_rewards`), verl's rollout correction (`correct_rollout`) and the
actor update (`update_actor`: ``ppo_epochs`` passes of ``loss_mode`` over mini-batches, each micro-batch's
loss its share of its mini-batch's aggregate). Each recipe calls them in its own order, top to bottom.
Exercised by `pytest tests/test_train.py tests/test_loss_normalisation.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer import advantages as A
from trainer import losses as L
from trainer.common import (
    Averages,
    Resolved,
    Setup,
    backward,
    build_setup,
    convert_rewards,
    local_size,
    mean_over_ranks,
    mini_batch_norm,
    optimizer_metrics,
    optimizer_step,
    reward_parts,
    split_indices,
    split_reward_parts,
)
from trainer.config import AlgoConfig, DataConfig, TrainConfig
from trainer.events import Observer


def reward_where(data_cfg: DataConfig, reward_name: str) -> str:
    """What a reward conversion error names: the config key, and for verl data the compute_score function
    (``reward_name`` as `trainer.data.get_reward_fn` returns it)."""
    if data_cfg.train_files is not None:
        return f"data.compute_score ({reward_name.removeprefix('verl:')})"
    return "data.reward_fn" if data_cfg.reward_fn else "data.task"


def score_responses(
    setup: Setup, observer: Observer, rollout, examples, reward_fn, reward_name
) -> torch.Tensor:
    """Sequence scores [B] fp32 from the reward model when there is one, else the reward function.

    ``examples`` are aligned with the rollout rows (already repeated for GRPO groups)."""
    return score_components(setup, observer, rollout, examples, reward_fn, reward_name, ())[0]


def score_components(
    setup: Setup, observer: Observer, rollout, examples, reward_fn, reward_name, keys: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`score_responses`' scores [B], and the reward components named by ``keys`` [K, B] fp32 (None
    without keys): a reward function may return one dict per response, ``score`` and named parts (verl's
    ``compute_score`` form, `trainer.common.split_reward_parts`); the observer sees the scores."""
    rm = setup.models.get("reward")
    b = rollout.response_ids.shape[0]
    if rm is not None:
        from trainer.models import score_with_reward_model

        where, source = "model.reward_model", f"model:{setup.config.model.reward_model}"
        with torch.no_grad(), setup.autocast("reward"):
            score = functools.partial(score_with_reward_model, rm, rollout.input_ids, rollout.attention_mask)
            raw = observer.plugin_call("reward_model", source, score)

        def rescore(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), setup.autocast("reward"):
                return score_with_reward_model(rm, ids, mask)

        context = {
            "input_ids": rollout.input_ids,
            "attention_mask": rollout.attention_mask,
            "rescore": rescore,
        }
    else:
        prompts = [ex["prompt"] for ex in examples]
        where, source = reward_where(setup.config.data, reward_name), f"function:{reward_name}"
        texts = rollout.responses_text(setup.tokenizer)
        call = functools.partial(reward_fn, prompts, texts, examples)
        raw = observer.plugin_call("reward_fn", source, call)
        context = {"responses": texts, "examples": examples}
    raw, parts = split_reward_parts(raw, where)
    scores = convert_rewards(raw, b, setup.device, where)
    observer.on_reward(source=source, raw=raw, rewards=scores, expected_shape=(b,), model=rm, context=context)
    if not keys:
        return scores, None
    return scores, reward_parts(parts, keys, b, setup.device, where)


def rollout_metrics(rollout, old_logprobs: torch.Tensor, entropy=None, ratio_bound: float = 2.0) -> dict:
    """Rollout vs training log-probs of the same tokens (`trainer.mismatch.mismatch_metrics`: verl's
    ``training/rollout_probs_diff_*`` and ``rollout_corr/...``, whatever the engine): a bf16 engine
    feeding an fp32 trainer shows up here. Plus what the engine reported with the rollout (a weight
    sync's ``rollout/weight_sync_*``)."""
    from trainer.mismatch import mismatch_metrics

    metrics = mismatch_metrics(
        rollout.logprobs, old_logprobs, rollout.response_mask, entropy=entropy, ratio_bound=ratio_bound
    )
    return {**metrics, **rollout.metrics}


def correct_rollout(setup: Setup, rollout, old_logprobs: torch.Tensor):
    """verl's rollout correction (``rollout_correction``), between the KL reward and the advantages as
    in verl: the rollout with rejected tokens out of its response mask (what GAE and both updates see),
    the truncated importance weights (or None) and their ``rollout_corr/`` metrics (of the raw or the
    truncated weights, as the targeted verl line logs them). Under ``bypass_mode`` nothing: the
    correction runs in the loss (`trainer.losses.bypass_policy_loss`), as in verl."""
    import dataclasses

    from trainer.mismatch import rollout_correction

    if setup.config.rollout_correction.bypass_mode:
        return rollout, None, {}
    algo = setup.config.algo
    c = rollout_correction(
        rollout.logprobs,
        old_logprobs,
        rollout.response_mask,
        setup.config.rollout_correction,
        truncated_metrics=algo.follows("is_metrics_truncated"),
        raw_seq_fractions=algo.follows("is_seq_fractions_raw"),
    )
    return dataclasses.replace(rollout, response_mask=c.mask), c.weights, c.metrics


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


def actor_logprobs(setup: Setup, model, rollout, *, entropy: bool, sum_pi_squared: list | None = None):
    """The actor's log-probs (and entropies) of the rollout's responses; ``sum_pi_squared``: a list that
    gets the same forward's sum_v pi_v^2 appended (`trainer.logprobs.sequence_logprobs`)."""
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
            sum_pi_squared=sum_pi_squared,
        )


def policy_loss_params(algo: AlgoConfig) -> L.PolicyLossParams:
    """The policy-loss knobs of ``algo``, unset clip sides resolved to ``clip_ratio`` (as verl)."""
    low = algo.clip_ratio if algo.clip_ratio_low is None else algo.clip_ratio_low
    high = algo.clip_ratio if algo.clip_ratio_high is None else algo.clip_ratio_high
    return L.PolicyLossParams(
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=algo.clip_ratio_c,
        loss_agg_mode=algo.loss_agg_mode,
        clip_cov_ratio=algo.clip_cov_ratio,
        clip_cov_lb=algo.clip_cov_lb,
        clip_cov_ub=algo.clip_cov_ub,
        kl_cov_ratio=algo.kl_cov_ratio,
        ppo_kl_coef=algo.ppo_kl_coef,
        tau_pos=algo.tau_pos,
        tau_neg=algo.tau_neg,
        dro_beta=algo.dro_beta,
    )


def loss_old_logprobs(setup: Setup, rollout, old_logprobs: torch.Tensor) -> torch.Tensor:
    """The old log-probs of the KL reward and the loss: the trainer's recomputed ones, or under verl's
    ``rollout_correction.bypass_mode`` the rollout engine's."""
    return rollout.logprobs if setup.config.rollout_correction.bypass_mode else old_logprobs


def _add(sums: dict[str, float], **values: torch.Tensor) -> None:
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + float(v.detach())


def update_actor(
    setup: Setup, observer: Observer, rollout, old_logprobs, advantages, *, kl_ref_logprobs=None
) -> dict:
    """``ppo_epochs`` passes of ``algo.loss_mode``, minus ``entropy_coef`` x entropy, plus
    ``kl_loss_coef`` x the KL loss against ``kl_ref_logprobs`` when they are given (None: no KL loss).

    Every micro-batch's terms are its share of its mini-batch's aggregate (`mini_batch_norm`), so
    the backward needs no accumulation divisor and the loss metrics are the mini-batch sums of the
    shares, averaged over mini-batches (verl logs them the same way)."""
    algo = setup.config.algo
    params = policy_loss_params(algo)
    rc = setup.config.rollout_correction
    if rc.bypass_mode:
        bypass = L.Bypass(
            rc, rc.loss_type, algo.follows("is_metrics_truncated"), algo.follows("is_seq_fractions_raw")
        )
        params = dataclasses.replace(params, bypass=bypass)
    extra = Averages()  # metrics a loss reports under their own names (bypass_mode's rollout_corr/*)
    model, opt, scaler = setup.models["actor"], setup.optimizers["actor"], setup.scalers["actor"]
    avg, norms, skips = Averages(), [], []
    b = rollout.response_ids.shape[0]
    mini_size = local_size(algo.mini_batch_size, setup, "algo.mini_batch_size")
    for _ in range(algo.ppo_epochs):
        perm = torch.randperm(b)  # global RNG, seeded once in setup
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
                logprobs, ent = actor_logprobs(setup, model, sub, entropy=True)
                observer.on_forward(role="actor", name="logprobs", output=logprobs)
                mask = sub.response_mask
                pg = L.policy_loss(
                    algo.loss_mode, logprobs, old_logprobs[idx], advantages[idx], mask, params, norm
                )
                entropy = L.agg_loss(ent, mask, algo.loss_agg_mode, norm)
                loss = pg.loss - algo.entropy_coef * entropy
                terms = {"pg_loss": pg.loss, "entropy": entropy}
                if kl_ref_logprobs is not None:
                    kl = L.kl_penalty(logprobs, kl_ref_logprobs[idx], algo.kl_loss_type)
                    terms["kl_loss"] = L.agg_loss(kl, mask, algo.loss_agg_mode, norm)
                    loss = loss + algo.kl_loss_coef * terms["kl_loss"]
                observer.on_loss(role="actor", loss=loss, terms=terms)
                backward(loss, "actor", model, scaler, observer, accum=1.0)
                _add(sums, loss=loss, **terms)
                avg.add(pg_clipfrac=pg.clipfrac, ppo_kl=pg.ppo_kl, pg_clipfrac_lower=pg.clipfrac_lower)
                extra.add(**pg.metrics)
            avg.add(**sums)
            norm_value, skipped = optimizer_step("actor", model, opt, scaler, observer, algo.max_grad_norm)
            norms.append(norm_value)
            skips.append(float(skipped))
    metrics = {**update_metrics("actor", avg, norms, skips, opt, scaler), **extra.means()}
    if kl_ref_logprobs is not None:
        metrics["actor/kl_coef"] = algo.kl_loss_coef
    return metrics


def shaped_rewards(setup: Setup, scores, mask, old_logprobs, ref_logprobs, kl_ctrl: A.KLController):
    """Token-level rewards (score on the last valid token, minus the KL penalty when
    ``use_kl_in_reward``: verl's ``apply_kl_penalty``) and their metrics. ``kl_ctrl`` is updated
    with the batch's KL (averaged over ranks, so every rank keeps the same coefficient)."""
    algo = setup.config.algo
    metrics: dict[str, float] = {}
    if ref_logprobs is not None:  # k1 estimate of KL(actor || reference) on the sampled tokens
        metrics["rollout/kl_ref"] = float(L.masked_mean(old_logprobs - ref_logprobs, mask))
    if not algo.use_kl_in_reward:
        return L.token_level_rewards(scores, mask, None, 0.0), metrics
    kl = L.kl_penalty(old_logprobs, ref_logprobs, algo.kl_penalty) * mask
    beta = kl_ctrl.value
    current = mean_over_ranks(A.reward_kl(kl, mask), setup)
    kl_ctrl.update(current, n_steps=mask.shape[0] * setup.dist.world_size)
    metrics.update({"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta})
    return L.token_level_rewards(scores, mask, kl, beta), metrics


def kl_controller(algo: AlgoConfig) -> A.KLController:
    return A.KLController(algo.kl_coef, algo.kl_ctrl_type, algo.kl_ctrl_target_kl, algo.kl_ctrl_horizon)


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


def generate(
    setup: Setup, observer: Observer, engine, collator, source, examples, step, num_samples=1, baseline=False
):
    """Collate prompts, generate; returns the rollout (rows repeat each prompt ``num_samples`` times).
    ``baseline``: ReMax's greedy rollout, whose log-probs no loss uses (the observer is told so)."""
    sync = engine.sync_weights()  # vLLM: the actor's weights after the last update, pushed and probed
    if sync is not None:
        observer.on_weight_sync(**sync)
    batch = observer.plugin_call("collator", source, functools.partial(collator, examples))
    observer.on_batch(role="actor", batch=batch, source=source, examples=examples)
    ids = batch["input_ids"].to(setup.device)
    mask = batch["attention_mask"].to(setup.device)
    rollout = engine.generate(
        ids,
        mask,
        num_samples=num_samples,
        generator_seed=rollout_seed(setup.config.seed, step, setup.dist.rank),
    )
    if sync is not None:
        from trainer.vllm_engine import weight_sync_metrics

        rollout.metrics.update(weight_sync_metrics(sync))
    observer.on_rollout(
        engine=engine.name,
        engine_dtype=engine.engine_dtype,
        actor_compute_dtype=setup.policy["actor"].compute_dtype,
        prompt_ids=rollout.prompt_ids,
        response_ids=rollout.response_ids,
        response_mask=rollout.response_mask,
        logprobs=rollout.logprobs,
        engine_facts=engine.facts(),
        trainer_facts=trainer_facts(setup.config.algo.temperature, baseline=baseline),
    )
    return rollout


def trainer_facts(temperature: float, *, baseline: bool = False) -> dict[str, Any]:
    """How the trainer recomputes the rollout's log-probs (``trainer_facts`` of ``on_rollout``): at the
    sampling temperature, over the whole vocabulary (no top-k / top-p), log-softmax in fp32
    (`trainer.logprobs.sequence_logprobs`); ``used``: whether a loss uses these log-probs (not ReMax's
    greedy baseline)."""
    return {
        "temperature": float(temperature),
        "top_k": 0,
        "top_p": 1.0,
        "logprob_dtype": torch.float32,
        "used": not baseline,
    }


@dataclasses.dataclass
class Prepared:
    """What a rollout recipe needs besides its models: `prepare`'s result."""

    setup: Setup
    source: str
    """The collator's name, for ``on_batch``."""
    collator: Callable[[list[dict]], dict]
    reward_name: str
    reward_fn: Callable[..., Any]
    engine: Any
    """The rollout engine (`trainer.engines.build_engine`)."""
    batches: Iterator[list[dict]]
    greedy_engine: Any = None
    """ReMax's baseline engine: the same engine with top-k 1 (greedy decoding); None otherwise."""


def prepare(config: TrainConfig, observer: Observer, resolved: Resolved, *, critic: bool) -> Prepared:
    """Setup plus the data side of a rollout recipe: examples, collator, reward fn, engine(s), batches."""
    from trainer import data as D
    from trainer.engines import build_engine

    algo = config.algo
    setup = build_setup(
        config, observer, resolved, critic=critic, reference=algo.uses_reference, reward_model=True
    )
    examples = D.load_examples(config.data, seed=config.seed, pairs=False, tokenizer=setup.tokenizer)
    source, collator = D.build_collator(config.data, setup.tokenizer, pairs=False)
    reward_name, reward_fn = D.get_reward_fn(config.data)
    # with rollout.engine: fused the decode steps run on a snapshot gathered once per rollout: no collectives
    kind = config.rollout.kind
    if config.rollout.cuda_graphs and setup.dist.distributed and kind != "fused":
        raise ValueError(
            f"rollout.cuda_graphs: not with {setup.dist.world_size} ranks (a decode step holds FSDP2 "
            "all-gathers, which a CUDA graph cannot capture); set rollout.engine: fused (decodes on a "
            "snapshot gathered once per rollout) or rollout.cuda_graphs: false"
        )
    if config.rollout.compile and setup.dist.distributed and kind != "fused":
        raise ValueError(
            f"rollout.compile: not with {setup.dist.world_size} ranks (compiling a forward that all-gathers "
            "FSDP2 shards is untested here); set rollout.engine: fused or rollout.compile: false"
        )

    def engine(top_k: int):
        return build_engine(
            setup.models["actor"],
            setup.tokenizer,
            setup.policy["rollout"],
            device=setup.device,
            max_new_tokens=config.data.response_length,
            temperature=algo.temperature,
            top_k=top_k,
            top_p=config.rollout.top_p,
            engine=kind,
            cuda_graphs=config.rollout.cuda_graphs,
            compile=config.rollout.compile,
            vllm={
                "max_model_len": config.data.prompt_length + config.data.response_length,
                "kv_cache_gib": config.rollout.vllm_kv_cache_gib,
                "probe_tokens": config.rollout.vllm_probe_tokens,
                "seed": config.seed,
            },
        )

    # ReMax's baseline is verl's do_sample=False generation: keeping only the top logit is greedy decoding
    if algo.estimator == "remax" and kind == "vllm":
        raise ValueError(
            "rollout.engine: vllm: not with algo.adv_estimator: remax yet (its greedy baseline is a second "
            "engine, and vLLM allows one per process); use rollout.engine: hf, static or fused"
        )
    greedy = engine(1) if algo.estimator == "remax" else None
    batches = D.iterate_batches(examples, algo.batch_size, seed=config.seed)
    return Prepared(setup, source, collator, reward_name, reward_fn, engine(algo.top_k), batches, greedy)
