"""The PPO/GRPO actor update normalises by the whole mini-batch (verl's global-batch ``loss_agg_mode``):
on a ragged rollout, the gradient of one optimizer step does not depend on how the mini-batch is cut
into micro-batches, in every aggregation mode; it equals the gradient of the loss computed over the
whole mini-batch at once. Tiny-llama on CPU in fp32 (tolerances: float32 summation order only).

Run: PYTHONPATH=. pytest -q tests/test_loss_normalisation.py
"""

import dataclasses

import pytest
import torch

from trainer import losses as L
from trainer.common import resolve
from trainer.config import TrainConfig
from trainer.events import NULL_OBSERVER, Observer
from trainer.ppo import actor_logprobs, generate, prepare, update_actor


class GradCapture(Observer):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, *, role, model, optimizer):
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )


def _ragged(rollout):
    """Cut rows to 1, 2, 3 and 4 valid tokens (the mask stays a prefix, attention follows it)."""
    mask = rollout.response_mask.clone()
    for i in range(mask.shape[0]):
        mask[i, 1 + i % mask.shape[1] :] = 0
    r = mask.shape[1]
    attn = rollout.attention_mask.clone()
    attn[:, -r:] = mask
    return dataclasses.replace(rollout, response_mask=mask, attention_mask=attn)


def _first_step_grads(micro: int, mode: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    cfg = TrainConfig.from_dict(
        {
            "algo": {
                "name": "grpo",
                "batch_size": 2,
                "group_size": 2,
                "mini_batch_size": 4,
                "micro_batch_size": micro,
                "max_grad_norm": 0.0,
                "loss_agg_mode": mode,
                "entropy_coef": 0.01,
            },
            "data": {"prompt_length": 12, "response_length": 4, "num_examples": 64},
            "device": "cpu",
            "seed": 0,
        }
    )
    p = prepare(cfg, NULL_OBSERVER, resolve(cfg), critic=False)
    rollout = _ragged(
        generate(p.setup, NULL_OBSERVER, p.engine, p.collator, p.source, next(p.batches), 0, num_samples=2)
    )
    with torch.no_grad():
        old, _ = actor_logprobs(p.setup, p.setup.models["actor"], rollout, entropy=False)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None] * rollout.response_mask
    cap = GradCapture()
    update_actor(p.setup, cap, rollout, old, adv)
    return cap.grads[0], rollout.response_mask


@pytest.mark.parametrize("mode", L.LOSS_AGG_MODES)
def test_gradient_does_not_depend_on_the_micro_batch_split(mode):
    whole, mask = _first_step_grads(4, mode)
    assert mask.sum(-1).tolist() == [1, 2, 3, 4]  # ragged, so per-micro-batch means would differ
    for micro in (1, 2):
        split, _ = _first_step_grads(micro, mode)
        for name, g in whole.items():
            assert torch.allclose(split[name], g, rtol=1e-4, atol=1e-7), (micro, name)
