"""Interventions on the reward: does a response's score follow the response, and only it?

- batch composition (`batch_findings`, a reward model, audited steps): the same rows scored in two
  halves, each half alone, must get the scores they got in the whole batch. A reward model that
  normalises across the batch (a softmax over dim 0 instead of the classes, a batch mean / std, a rank)
  gives a row another score once its neighbours change. Two extra forwards of half the batch (a third
  of the whole batch, the same layout, only when scores moved: a random forward is the nondeterminism
  check's); the random state is forked around them.
- row order (`RowOrder`, every step, free): rewards that are sorted by the row's position step after
  step (a function that returns ``np.sort(scores)``, the ranks, a winsorised copy of the sorted array)
  follow the row, not the response in it. Each sorted step has the chance ``2 / (multinomial of its
  ties)`` of a chance order; the steps' chances multiply until they are below `ORDER_CHANCE`.

Exercised by `pytest tests/test_invariants_examples.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.rundir import Finding

BATCH_TOL = 1e-3
"""Relative change (of the scores' spread) of a row's score when only the other rows of its batch
change, beyond which the score reads the batch: a per-row model changes by its dtype's rounding of a
smaller batch's kernels (< 1e-5 in fp32, < 1e-2 in bf16); a softmax over the batch by the whole spread."""
ORDER_CHANCE = 1e-6
"""Chance of the observed sorted steps under rewards that do not follow the row, below which they do."""
TASK_ORDER_CHANCE = 1e-4
"""The same where the task's own scorer grades the responses and its scores are not sorted at those steps:
a reward that measures the task (any monotone shaping of it) is sorted only when the task's scores are, so
the chance order is left only to a reward unrelated to the task."""
MIN_DISTINCT = 2
"""Distinct rewards a step needs before its order is evidence."""


def _scored(rescore: Callable, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor | None:
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            out = rescore(ids, mask)
    except Exception:  # the probe is best effort: a model that cannot take half a batch is not a finding
        return None
    if not isinstance(out, torch.Tensor) or out.numel() != n:
        return None
    return out.detach().double().flatten().cpu()


def batch_findings(
    scores: torch.Tensor,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    source: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``reward/batch_dependent`` when the rows scored in two halves get other scores than in the batch."""
    b = int(scores.numel())
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or b != input_ids.shape[0] or b < 4:
        return []
    a = scores.detach().double().flatten().cpu()
    if not bool(torch.isfinite(a).all()):
        return []
    h = b // 2
    parts = [
        _scored(rescore, input_ids[s], attention_mask[s], len(range(b)[s]))
        for s in (slice(0, h), slice(h, b))
    ]
    if any(p is None for p in parts):
        return []
    again = torch.cat(parts)
    if not bool(torch.isfinite(again).all()):
        return []
    low = scores.dtype if scores.is_floating_point() else torch.float32
    mag = float(a.abs().max())
    scale = max(float(a.std()), 1e-3 * mag, 1e-12)
    tol = BATCH_TOL * scale + 16 * torch.finfo(low).eps / 2 * mag
    moved = (a - again).abs() > tol
    n = int(moved.sum())
    if not n:
        return []
    same = _scored(rescore, input_ids, attention_mask, b)
    if same is None or bool(((same - a).abs() > tol).any()):
        return []  # a random forward (dropout): the nondeterminism check names it, not the batch
    total = float(a.sum())
    how = ""
    if abs(total - 1.0) < 1e-3:
        how = (
            "; the batch's scores sum to 1 (a softmax over the batch dimension, dim=0, not over the classes)"
        )
    elif abs(float(a.mean())) < 1e-3 * max(1.0, mag) and abs(float(a.std()) - 1.0) < 0.05:
        how = "; the batch's scores have mean 0 and std 1 (normalised over the batch)"
    model = source.removeprefix("model:")
    return [
        Finding(
            severity="error",
            kind=K.REWARD_BATCH_DEPENDENT,
            role="reward",
            where=f"model.reward_model ({model})",
            message=f"the reward model scores {n} of {b} rows differently when the same rows are scored in two "
            f"halves of the batch (largest change {float((a - again).abs().max()):.3g}, the scores' spread "
            f"{float(a.std()):.3g}){how}: each response's reward depends on the other responses it is batched "
            "with, not on the response alone",
            observed={"rows_changed": n, "rows": b, "scores_sum": total},
            expected="each row's score independent of the other rows (the same in any batch)",
            fix=f"model.reward_model ({model}): compute each row's score from that row alone: a softmax over the "
            "class dimension (softmax(dim=-1)), not over the batch (dim=0); no mean / std / rank across the batch",
            **ctx,
        )
    ]


def _sorted(r: torch.Tensor) -> int:
    """1 rising, -1 falling, 0 neither (a constant series is 1)."""
    d = r[1:] - r[:-1]
    return 1 if bool((d >= 0).all()) else -1 if bool((d <= 0).all()) else 0


def _order_chance(r: torch.Tensor) -> float | None:
    """The chance that rewards of this multiset are sorted (either way) by accident; None when they are
    not sorted or hold fewer than `MIN_DISTINCT` values."""
    d = r[1:] - r[:-1]
    if not (bool((d >= 0).all()) or bool((d <= 0).all())):
        return None
    _, counts = torch.unique(r, return_counts=True)
    if counts.numel() < MIN_DISTINCT:
        return None
    log_orders = math.lgamma(r.numel() + 1) - sum(math.lgamma(int(c) + 1) for c in counts)
    return min(1.0, 2.0 * math.exp(-log_orders))


class RowOrder:
    """Rewards sorted by the row index at consecutive steps (``reward/follows_row``), found once."""

    def __init__(self) -> None:
        self.chance = 1.0
        self.steps: list[Any] = []
        self.task = True
        """Every counted step had the task's scores of its responses, not sorted the rewards' way."""
        self.done = False

    def observe(
        self,
        rewards: torch.Tensor,
        *,
        where: str,
        ctx: Mapping[str, Any],
        truth: torch.Tensor | None = None,
    ) -> list[Finding]:
        """``truth``: the task's own scores of the same responses, when it grades them."""
        r = rewards.detach().double().flatten().cpu()
        if self.done or r.numel() < 4 or not bool(torch.isfinite(r).all()):
            return []
        if int(torch.unique(r).numel()) < 2:
            return []  # one value for all: no order to read (the constant / no-signal checks)
        way = _sorted(r)
        if not way:
            self.chance, self.steps, self.task = 1.0, [], True
            return []
        t = (
            truth.double().flatten().cpu()
            if isinstance(truth, torch.Tensor) and truth.numel() == r.numel()
            else None
        )
        if t is not None and _sorted(t) == way and int(torch.unique(t).numel()) > 1:
            self.chance, self.steps, self.task = 1.0, [], True
            return []  # the responses' own scores are in this order: the reward follows them
        p = _order_chance(r)
        step = ctx.get("step")
        if p is None or step in self.steps:
            return []
        self.chance *= p
        self.steps.append(step)
        self.task = self.task and t is not None
        if self.chance > (TASK_ORDER_CHANCE if self.task else ORDER_CHANCE):
            return []
        self.done = True
        rising = way > 0
        told = " (the task's own scores of the same responses are not)" if self.task else ""
        return [
            Finding(
                severity="error",
                kind=K.REWARD_FOLLOWS_ROW,
                role="reward",
                where=where,
                message=f"the rewards are sorted by row index ({'rising' if rising else 'falling'} from row 0 to row "
                f"{r.numel() - 1}) at {len(self.steps)} steps in a row{told} (chance {self.chance:.1e} for rewards that "
                "follow the responses): the reward returns its scores in sorted order, not in the responses' "
                "order, so each response gets the score of another row",
                observed={"sorted_steps": len(self.steps), "chance": self.chance, "rows": int(r.numel())},
                expected="row i's reward is response i's score (no order with the row index)",
                fix=f"{where}: return the scores in the responses' order: clip or rank them in place "
                "(np.clip(scores, lo, hi)), not np.sort(scores); unsort if a sorted copy is needed",
                **ctx,
            )
        ]


NORMALISED_STEPS = 2
"""Steps in a row whose rewards carry one signature of a normalisation over the batch before it is a
finding (a reward that reads only its response reaches a sum of exactly 1, a mean of exactly 0 with a std
of exactly 1, or exact ranks at one step by coincidence at most)."""


def _signature(r: torch.Tensor) -> str | None:
    """Which normalisation over the batch these rewards show exactly: ``softmax`` (all strictly inside
    (0, 1), three or more distinct values, summing to 1), ``zscore`` (mean 0, std 1), ``rank`` (the values
    are 0..n-1, 1..n or their scaling to [0, 1]); None for none."""
    n = r.numel()
    if n < 4 or int(torch.unique(r).numel()) < 3:
        return None
    if bool(((r > 0) & (r < 1)).all()) and abs(float(r.sum()) - 1.0) < 1e-5:
        return "softmax"
    if abs(float(r.mean())) < 1e-5 and min(abs(float(r.std(correction=c)) - 1.0) for c in (0, 1)) < 1e-4:
        return "zscore"
    s = torch.sort(r).values
    ranks = torch.arange(n, dtype=r.dtype)
    if any(bool(torch.allclose(s, g, atol=1e-6, rtol=0)) for g in (ranks, ranks + 1, ranks / (n - 1))):
        return "rank"
    return None


_HOW = {
    "softmax": ("the rewards of each batch are all inside (0, 1) and sum to 1", "a softmax (or a division by "
                "the sum) over the batch"),
    "zscore": ("the rewards of each batch have mean 0 and standard deviation 1", "a z-score over the batch "
               "((r - mean) / std)"),
    "rank": ("the rewards of each batch are exactly the ranks 0..n-1 (or 1..n, or their scaling to [0, 1])",
             "a rank transform over the batch"),
}  # fmt: skip


class BatchNormalised:
    """Rewards that carry one normalisation's signature at `NORMALISED_STEPS` steps in a row
    (``reward/batch_dependent``), found once."""

    def __init__(self) -> None:
        self.run: list[tuple[Any, str]] = []
        self.done = False

    def observe(self, rewards: torch.Tensor, *, where: str, ctx: Mapping[str, Any]) -> list[Finding]:
        r = rewards.detach().double().flatten().cpu()
        if self.done or not bool(torch.isfinite(r).all()):
            return []
        sig = _signature(r)
        step = ctx.get("step")
        if sig is None or (self.run and self.run[-1][1] != sig):
            self.run = [] if sig is None else [(step, sig)]
            return []
        if self.run and self.run[-1][0] == step:
            return []
        self.run.append((step, sig))
        if len(self.run) < NORMALISED_STEPS:
            return []
        self.done = True
        seen, how = _HOW[sig]
        return [
            Finding(
                severity="error",
                kind=K.REWARD_BATCH_DEPENDENT,
                role="reward",
                where=where,
                message=f"{seen} at {len(self.run)} steps in a row ({r.numel()} responses a step): the reward is "
                f"normalised across the batch ({how}), so each response's reward depends on the other responses "
                "it is batched with, not on the response alone",
                observed={"signature": sig, "steps": len(self.run), "rows": int(r.numel())},
                expected="each row's score independent of the other rows",
                fix=f"{where}: score each response alone and return the raw scores: remove {how} (the advantage "
                "estimator already normalises; for class probabilities take softmax(dim=-1) over the classes)",
                **ctx,
            )
        ]
