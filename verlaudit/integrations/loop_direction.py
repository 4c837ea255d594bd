"""Does the own loop's update move the policy toward the advantage?

A policy-gradient step, whatever its estimator, raises the log-probability of the responses whose
advantage is positive and lowers the others' (to first order: the loss is minus advantage x log-prob,
and every optimizer descends its loss). A loss whose sign is flipped, advantages paired with the wrong
rows, or a ratio taken the wrong way round make it go the other way, and nothing at a boundary shows
it: the loss is finite, the gradients are fine, the rewards only drift.

`DirectionProbe` measures it on the batch the loop itself trained on: the token ids of the trained
model's forwards with gradients since its last optimizer step (integer ``input_ids`` of a causal LM,
micro-batches concatenated in order), the rewards the loop passed to `Watch.reward`, and two extra
no-grad forwards in eval mode, just before and just after the optimizer step, that give each
response's summed log-prob change. With the advantage taken as the loop's own (``advantages=`` passed
to `Watch.loss`, per row) or else as the reward minus the batch's mean, a step is *against the advantage* when ``sum(adv * dlogp) < 0``. It probes while every measured step so
far went against it (a step that goes with it ends the probing: a correct loop costs two forwards, once),
at most `MAX_PROBES` steps, and reports once at least `MIN_STEPS` steps all went against it with a
correlation of at most `MAX_CORR`. It stays out of the way when it cannot match rows (PPO epochs over
mini-batches, DPO pairs, models that do not take token ids). Exercised by `pytest tests/test_loop_protocol.py`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.integrations.loop_checks import output_tensor
from verlaudit.rundir import Finding

MAX_PROBES = 6
MIN_STEPS = 2
MAX_CORR = -0.5
CHUNK = 4
"""Rows per probe forward."""


def _logits(output: Any) -> torch.Tensor | None:
    """The forward's [batch, length, vocab] logits (`loop_checks.output_tensor` of three dimensions), else None."""
    t = output_tensor(output)
    return t if t is not None and t.dim() == 3 else None


class DirectionProbe:
    """The probe of one trained role's ``model``; see the module docstring."""

    def __init__(self, role: str, model: nn.Module) -> None:
        self.role, self.model = role, model
        self.inputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.rewards: torch.Tensor | None = None
        self.advantages: list[torch.Tensor] = []
        """Per-row advantages the loop passed (`Watch.loss(..., advantages=...)`), micro-batches in order."""
        self.prompt: torch.Tensor | None = None
        self.before: torch.Tensor | None = None
        self.measured: list[tuple[float, float]] = []
        """(sum of adv x dlogp, correlation) of each probed step."""
        self.done = False
        self.busy = False
        self.reported = False

    # -- what the loop passes -----------------------------------------------------------------------
    def on_forward(self, args: Any, kwargs: dict) -> None:
        if self.done or self.busy or not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            return
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            mask = None
        self.inputs.append((ids.detach(), mask.detach() if mask is not None else None))

    def on_rewards(self, rewards: torch.Tensor) -> None:
        self.rewards = rewards.detach().float().reshape(-1).cpu()

    def on_advantages(self, adv: Any) -> None:
        if isinstance(adv, torch.Tensor) and adv.dim() >= 1 and adv.is_floating_point():
            a = adv.detach().float()
            self.advantages.append((a.reshape(a.shape[0], -1).mean(-1) if a.dim() > 1 else a).cpu())

    def _adv(self) -> torch.Tensor | None:
        """The loop's own advantages when they cover its rows, else the reward minus the batch mean."""
        rows = sum(ids.shape[0] for ids, _ in self.inputs)
        if self.advantages and sum(a.numel() for a in self.advantages) == rows:
            return torch.cat(self.advantages)
        if self.rewards is None or self.rewards.numel() != rows:
            return None
        return self.rewards - self.rewards.mean()

    def on_batch(self, batch: Any) -> None:
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        self.prompt = ids.detach() if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None

    # -- the optimizer step --------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self.done or not self.inputs or len({ids.shape[1] for ids, _ in self.inputs}) != 1:
            return False
        adv = self._adv()
        return adv is not None and bool(torch.isfinite(adv).all()) and bool(adv.abs().max() > 0)

    def before_step(self) -> None:
        self.before = self._logp() if self._ready() else None

    def after_step(self, line: str | None, where: dict) -> Finding | None:
        """After the optimizer step: the measured change, and the finding once it is decided."""
        before, self.before = self.before, None
        try:
            if before is None:
                return None
            after = self._logp()
            adv = self._adv()
            if after is None or adv is None:
                return None
            delta = (after - before).double()
            if not bool(torch.isfinite(delta).all()) or float(delta.abs().max()) == 0.0:
                return None
            s = float((adv.double() * delta).sum())
            dc = delta - delta.mean()
            den = float(adv.double().norm() * dc.norm())
            corr = float((adv.double() * dc).sum()) / den if den > 0 else 0.0
            self.measured.append((s, corr))
            if s >= 0 or len(self.measured) >= MAX_PROBES:
                self.done = True
            return self._decide(line, where)
        finally:
            self.inputs, self.advantages = [], []
            self.rewards = None

    def _decide(self, line: str | None, where: dict) -> Finding | None:
        m = self.measured
        if self.reported or len(m) < MIN_STEPS or any(s >= 0 for s, _ in m):
            return None
        mean_corr = sum(c for _, c in m) / len(m)
        if mean_corr > MAX_CORR:
            return None
        self.reported = self.done = True
        at = line or "the loop's loss"
        return Finding(
            severity="error",
            kind=K.LOOP_UPDATE_AGAINST_ADVANTAGE,
            message=f"each of the {self.role}'s first {len(m)} optimizer steps lowered the log-probability of "
            "the responses with positive advantage (reward above the batch mean) and raised the others' "
            f"(correlation of the per-response log-prob change with the advantage {mean_corr:+.2f}, measured "
            "on the batch the loop trained on, before and after each step): the update climbs away from the "
            f"reward -- the policy-gradient loss at {at} has its sign flipped (+advantage x log-prob, gradient "
            "ascent on the loss instead of maximising the objective)",
            role=self.role,
            where=f"policy-gradient loss at {at}",
            observed={
                "steps": len(m),
                "sum_adv_dlogp": [round(s, 6) for s, _ in m],
                "correlation": [round(c, 3) for _, c in m],
            },
            expected="log-probs of positive-advantage responses that rise after an optimizer step",
            fix=f"at {at}: negate the policy-gradient loss, loss = -(advantages * logp).mean() (minimise minus "
            "the objective); check that each advantage multiplies its own response's log-prob",
            **where,
        )

    def _logp(self) -> torch.Tensor | None:
        """Each row's summed log-prob of its response tokens under the model now (no grad, eval), in
        chunks of `CHUNK` rows (the [rows, length, vocab] logits of one chunk at a time)."""
        ids = torch.cat([i for i, _ in self.inputs])
        masks = [m for _, m in self.inputs]
        mask = torch.cat(masks) if all(m is not None for m in masks) else None
        keep = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        if mask is not None:
            keep &= mask[:, 1:].bool()
        p = self.prompt
        if p is not None and p.shape[0] == ids.shape[0] and p.shape[1] < ids.shape[1]:
            if torch.equal(ids[:, : p.shape[1]].to(p.device), p):
                keep[:, : p.shape[1] - 1] = False  # the response's tokens only
        was = self.model.training
        self.busy = True
        rows = []
        try:
            self.model.eval()
            with torch.no_grad():
                for k in range(0, ids.shape[0], CHUNK):
                    sl = slice(k, k + CHUNK)
                    kwargs = {"input_ids": ids[sl]}
                    if mask is not None:
                        kwargs["attention_mask"] = mask[sl]
                    logits = _logits(self.model(**kwargs))
                    if logits is None or logits.shape[:2] != ids[sl].shape:
                        self.done = True
                        return None
                    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[sl, 1:, None]).squeeze(-1)
                    rows.append((lp * keep[sl]).sum(-1).cpu())
        except Exception:  # a model that does not take these arguments: no probe, never a failure
            self.done = True
            return None
        finally:
            self.model.train(was)
            self.busy = False
        out = torch.cat(rows)
        return out if not math.isnan(float(out.sum())) else None
