"""The DPO recipe: preference pairs, a trainable policy and its frozen reference, TRL's loss types.

One step: collate ``batch_size`` (prompt, chosen, rejected) pairs; take the reference's sequence
log-probs of both completions; then, per mini-batch, the policy's, the DPO loss, backward with
micro-batch accumulation, and an optimizer step. Metrics follow TRL/verl: ``rewards/chosen``,
``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``. Run it:
``python -m trainer.train --config cfg.yaml`` with ``algo.name: dpo`` (or `pytest tests/test_train.py`).
"""

from __future__ import annotations

from functools import partial

import torch

from trainer import losses as L
from trainer.common import (
    Averages,
    Resolved,
    Setup,
    StepLog,
    backward,
    build_setup,
    local_batch,
    local_size,
    optimizer_metrics,
    optimizer_step,
    split_indices,
)
from trainer.config import TrainConfig
from trainer.events import Observer
from trainer.update_stats import dpo_direction, dpo_drift, update_size, weight_sample

PAIR_KEYS = (
    "chosen_input_ids",
    "chosen_attention_mask",
    "chosen_response_mask",
    "rejected_input_ids",
    "rejected_attention_mask",
    "rejected_response_mask",
)


def check_pair_batch(batch, source: str, where: str) -> None:
    """A collator must return the six pair tensors with matching shapes; ValueError otherwise."""
    missing = [k for k in PAIR_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"{where}: collator {source} returned no {', '.join(missing)}; expected keys {PAIR_KEYS}"
        )
    for side in ("chosen", "rejected"):
        ids, resp = batch[f"{side}_input_ids"], batch[f"{side}_response_mask"]
        if ids.shape != batch[f"{side}_attention_mask"].shape or resp.shape[1] >= ids.shape[1]:
            raise ValueError(
                f"{where}: collator {source}: {side}_input_ids {tuple(ids.shape)}, attention_mask "
                f"{tuple(batch[f'{side}_attention_mask'].shape)}, response_mask {tuple(resp.shape)} do not fit "
                "(input_ids [B, P+R], response_mask [B, R] with R < P+R)"
            )
    if batch["chosen_input_ids"].shape != batch["rejected_input_ids"].shape:
        raise ValueError(f"{where}: collator {source}: chosen and rejected must be padded to the same shape")


def pair_logps(setup: Setup, role: str, model, ids, attn, resp_mask) -> torch.Tensor:
    """Sequence log-probs [N] (sum over the response tokens), fp32."""
    from trainer.logprobs import sequence_logprobs

    with setup.autocast(role):
        logprobs, _ = sequence_logprobs(model, ids, attn, resp_mask.shape[1])
    return L.masked_sum(logprobs, resp_mask, dim=-1)


def _stack(batch, idx: torch.Tensor, device: torch.device):
    """Chosen rows then rejected rows of ``idx`` in one batch, so the policy runs one forward."""
    ids = torch.cat([batch["chosen_input_ids"][idx], batch["rejected_input_ids"][idx]]).to(device)
    attn = torch.cat([batch["chosen_attention_mask"][idx], batch["rejected_attention_mask"][idx]]).to(device)
    resp = torch.cat([batch["chosen_response_mask"][idx], batch["rejected_response_mask"][idx]]).to(device)
    return ids, attn, resp


# long: the DPO recipe's step in the observer protocol's order (reference, forwards, loss, backward, step, metrics)
def run(config: TrainConfig, observer: Observer, resolved: Resolved) -> list[dict[str, float]]:
    """Trains ``config.steps`` DPO steps; returns the per-step metrics."""
    from trainer import data as D

    algo = config.algo
    setup = build_setup(config, observer, resolved, critic=False, reference=True, reward_model=False)
    examples = D.load_examples(config.data, seed=config.seed, pairs=True)
    source, collator = D.build_collator(config.data, setup.tokenizer, pairs=True)
    batches = D.iterate_batches(examples, algo.batch_size, seed=config.seed)
    actor, ref = setup.models["actor"], setup.models["reference"]
    opt, scaler = setup.optimizers["actor"], setup.scalers["actor"]
    log = StepLog(observer, config.abort_on_nonfinite_loss, setup.dist)
    mini_size = local_size(algo.mini_batch_size, setup, "algo.mini_batch_size")
    where = "data.collator" if config.data.collator else "data"
    for step in range(config.steps):
        log.start(step)
        pairs = local_batch(next(batches), setup)
        batch = observer.plugin_call("collator", source, partial(collator, pairs))
        observer.on_batch(role="actor", batch=batch, source=source, examples=pairs)
        check_pair_batch(batch, source, where)
        b = batch["chosen_input_ids"].shape[0]

        with observer.phase("ref"):
            with torch.no_grad():
                ref_logps = pair_logps(setup, "reference", ref, *_stack(batch, torch.arange(b), setup.device))
            ref_chosen, ref_rejected = ref_logps[:b], ref_logps[b:]
            observer.on_forward(role="reference", name="ref_chosen_logps", output=ref_chosen)
            observer.on_forward(role="reference", name="ref_rejected_logps", output=ref_rejected)

        avg, norms, skips, direction = Averages(), [], [], Averages()
        before = weight_sample(actor, setup.dist.distributed)
        with observer.phase("actor_update"):
            for mini in split_indices(b, mini_size):
                for micro in split_indices(len(mini), algo.micro_batch_size):
                    idx = mini[micro]
                    logps = pair_logps(setup, "actor", actor, *_stack(batch, idx, setup.device))
                    n = len(idx)
                    chosen, rejected = logps[:n], logps[n:]
                    observer.on_forward(role="actor", name="chosen_logps", output=chosen)
                    observer.on_forward(role="actor", name="rejected_logps", output=rejected)
                    i = idx.to(setup.device)
                    args = (ref_chosen[i], ref_rejected[i], algo.beta, algo.dpo_loss)
                    terms = {
                        "chosen_lengths": batch["chosen_response_mask"][idx].sum(-1).to(setup.device),
                        "rejected_lengths": batch["rejected_response_mask"][idx].sum(-1).to(setup.device),
                        "label_smoothing": algo.label_smoothing,
                        "discopop_tau": algo.discopop_tau,
                    }
                    losses, r_chosen, r_rejected = L.dpo_loss(chosen, rejected, *args, **terms)
                    direction.add(**dpo_direction(L.dpo_loss, chosen, rejected, *args, **terms))
                    direction.add(**dpo_drift(chosen, rejected, ref_chosen[i], ref_rejected[i], algo.beta))
                    loss = losses.mean()
                    observer.on_loss(role="actor", loss=loss, terms={"dpo_loss": loss})
                    backward(loss, "actor", actor, scaler, observer, accum=len(mini) / n)
                    avg.add(
                        loss=loss,
                        chosen=r_chosen.mean(),
                        rejected=r_rejected.mean(),
                        margins=(r_chosen - r_rejected).mean(),
                        accuracies=(r_chosen > r_rejected).float().mean(),
                        logps_chosen=chosen.detach().mean(),
                        logps_rejected=rejected.detach().mean(),
                    )
                norm, skipped = optimizer_step("actor", actor, opt, scaler, observer, algo.max_grad_norm)
                norms.append(norm)
                skips.append(float(skipped))

        means = avg.means()
        metrics = {
            "actor/loss": means["loss"],
            "actor/grad_norm": sum(norms) / len(norms),
            "actor/skipped": sum(skips) / len(skips),
            **optimizer_metrics("actor", opt, scaler),
            **{f"rewards/{k}": means[k] for k in ("chosen", "rejected", "margins", "accuracies")},
            "logps/chosen": means["logps_chosen"],
            "logps/rejected": means["logps_rejected"],
            **direction.means(),
            **{f"actor/{k}": v for k, v in update_size(before).items()},
        }
        log.end(step, metrics)
    return log.history
