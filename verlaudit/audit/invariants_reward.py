"""The reward's invariants: a reward must score the response it is given, by what the task asks.

Read on audited steps from what the trainer hands ``on_reward`` besides the scores (``context``:
the responses' text and their examples for a reward function; the scored ids, mask and a ``rescore``
callable, the same reward model call under the same autocast, for a reward model):

- the reward agrees with the task (`task_agreement_findings`): where the examples carry the builtin
  task's ``answer`` and the reward is the user's own, the task's scorer and the reward must not rank the
  responses in opposite orders (a rank correlation of `INVERTED_CORR` or below: a distance returned as
  a reward, a loss where a score was meant, a sign lost). Free: the rewards are already computed, the
  task's scorer is a string comparison;
- the reward model's score depends on the tokens, not on where the padding is
  (`position_findings`): the same rows, their padding moved to the left (every attended token at
  the right end, position ids from the mask as the trainer passes them), must score the same. A
  model that reads the last column (padding for every short row), or index ``mask.sum() - 1``
  (wrong under left padding), scores another token once the padding moves. One extra forward of the
  reward model on an audited step (a second, of the same layout, only when the scores moved: a random
  forward, dropout left on, is the nondeterminism check's); the random state is forked around them.

Exercised by `pytest tests/test_invariants_reward.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit import probes_reward, reward_signal
from verlaudit.audit.invariants_data import builtin_task
from verlaudit.rundir import Finding

INVERTED_CORR = -0.5
"""Spearman correlation between the user's reward and the task's scorer at or below which the reward is
inverted. A reward that measures the task (partial credit, a shaped version) correlates positively; one
unrelated to it scatters around 0 (|r| < 0.3 on batches of 8+ responses); a distance or a negated score
is near -1."""
STRONG_CORR = -0.7
"""At or below it the inversion is an error; between it and the bound a warning (a reward unrelated to the
task pooled over 10 steps of 8 responses crosses -0.5 in ~2% of runs, -0.7 in well under 1%)."""
MIN_ROWS = 16
"""Responses (pooled over steps) the correlation needs before it is judged (fewer: any order is chance)."""
POSITION_TOL = 1e-3
"""Relative change of a reward model's scores when only the padding moves, beyond which the score reads
a position: a model that reads the tokens changes by its dtype's rounding of a reordered reduction
(< 1e-5 in fp32, < 1e-2 in bf16 where the scale is the scores' spread); a score read at a pad position
changes by the scores' whole spread."""


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank)."""
    order = torch.argsort(x, stable=True)
    r = torch.empty_like(x)
    r[order] = torch.arange(x.numel(), dtype=x.dtype)
    out = r.clone()
    for v in torch.unique(x):
        sel = x == v
        if int(sel.sum()) > 1:
            out[sel] = r[sel].mean()
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rank correlation of two 1-D series; None when either is constant."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return None if den == 0 else float((ra * rb).sum()) / den


def _source_key(data: Mapping[str, Any]) -> str:
    return f"data.reward_fn ({data['reward_fn']})" if data.get("reward_fn") else "the reward"


def _bound(n: int) -> float:
    """The correlation at or below which ``n`` pooled responses say "inverted": `INVERTED_CORR`, or
    stricter on fewer than 23 responses (2.33 / sqrt(n - 1): a chance ordering of ``n`` responses reaches
    it once in a hundred; past 23 the bound stays at `INVERTED_CORR`, which chance reaches ever more
    rarely as responses pool)."""
    return -max(-INVERTED_CORR, 2.33 / math.sqrt(max(n - 1, 1)))


class TaskAgreement:
    """The user's reward against the builtin task's own scorer of the same responses, pooled over steps:
    each step's ranks centred within the step (rewards of different steps need not share a scale), the
    correlation judged once `MIN_ROWS` responses are in and at every step after, until it is found."""

    def __init__(self) -> None:
        self.ra: list[torch.Tensor] = []
        self.rb: list[torch.Tensor] = []

    def observe(
        self,
        rewards: torch.Tensor,
        *,
        responses: Sequence[str],
        examples: Sequence[Mapping[str, Any]],
        data: Mapping[str, Any],
        ctx: Mapping[str, Any],
    ) -> list[Finding]:
        if not data.get("reward_fn") or data.get("train_files"):
            return []  # the task's reward itself, or verl's compute_score over files the task does not grade
        task = builtin_task(data)
        b = int(rewards.numel())
        if task is None or b < 2 or len(responses) != b or len(examples) != b:
            return []
        if not all(isinstance(ex, Mapping) and isinstance(ex.get("answer"), str) for ex in examples):
            return []
        try:
            truth = torch.tensor([float(task.score(str(r), ex)) for r, ex in zip(responses, examples)])
        except Exception:  # the examples are not the task's: nothing to compare with
            return []
        r = rewards.detach().double().cpu()
        if not bool(torch.isfinite(r).all()):
            return []
        ra, rb = _ranks(r), _ranks(truth.double())
        self.ra.append(ra - ra.mean())
        self.rb.append(rb - rb.mean())
        a, t = torch.cat(self.ra), torch.cat(self.rb)
        n = int(a.numel())
        den = float(a.norm() * t.norm())
        if n < MIN_ROWS or den == 0:
            return []
        rho = float((a * t).sum()) / den
        if rho > _bound(n):
            return []
        at = _source_key(data)
        return [
            Finding(
                severity="error"
                if rho <= STRONG_CORR
                else "warning",  # an unrelated reward reaches -0.5 by chance
                kind=K.REWARD_INVERTED,
                role="reward",
                where=at,
                message=f"{at} ranks the responses against the task's own scorer ({task.name}, graded against the "
                f"examples' 'answer'): rank correlation {rho:.2f} over {n} responses, so the responses closest to "
                "the answer get the lowest rewards and the policy is trained away from it (a distance or loss "
                "returned where a score was meant: lower is better)",
                observed={"spearman": rho, "responses": n},
                expected=f"> {_bound(n):.2f} (a reward that grows as the response gets closer to the answer)",
                fix=f"{at}: return a score that is higher for better responses: negate the distance (-d), or "
                "1 - d / max_d",
                **ctx,
            )
        ]


def task_scores(responses: Any, examples: Any, data: Mapping[str, Any]) -> torch.Tensor | None:
    """The builtin task's own scores of the responses (the examples carry its ``answer``), or None."""
    task = builtin_task(data)
    if task is None or data.get("train_files") or not isinstance(responses, Sequence) or not examples:
        return None
    if len(responses) != len(examples) or not all(
        isinstance(ex, Mapping) and isinstance(ex.get("answer"), str) for ex in examples
    ):
        return None
    try:
        return torch.tensor([float(task.score(str(r), ex)) for r, ex in zip(responses, examples)])
    except Exception:  # the examples are not the task's
        return None


def task_agreement_findings(
    rewards: torch.Tensor,
    *,
    responses: Sequence[str],
    examples: Sequence[Mapping[str, Any]],
    data: Mapping[str, Any],
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """`TaskAgreement` on one batch alone."""
    return TaskAgreement().observe(rewards, responses=responses, examples=examples, data=data, ctx=ctx)


def _left_packed(ids: torch.Tensor, mask: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows with every attended token moved to the right end, in order (padding on the left)."""
    keep = mask.bool()
    order = torch.sort(keep.to(torch.int8), dim=1, stable=True).indices  # pads first, tokens after, in order
    new_ids = ids.gather(1, order)
    new_mask = mask.gather(1, order)
    return torch.where(new_mask.bool(), new_ids, torch.full_like(new_ids, pad)), new_mask


def _scored(rescore: Callable, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor | None:
    """The reward model's scores of ``ids`` / ``mask`` under a forked random state (the run draws what it
    would have without the probe); None when the call fails or returns another shape."""
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            out = rescore(ids, mask)
    except Exception:  # the probe is best effort: a model that cannot take the layout is not a finding
        return None
    return out if isinstance(out, torch.Tensor) and out.numel() == n else None


def position_findings(
    scores: torch.Tensor,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rescore: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pad_token_id: int,
    source: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``reward/position_dependent`` when the reward model scores the rows differently once their padding
    is moved to the left (the tokens and their position ids unchanged)."""
    if (
        input_ids.dim() != 2
        or attention_mask.shape != input_ids.shape
        or scores.numel() != input_ids.shape[0]
    ):
        return []
    ids, mask = _left_packed(input_ids, attention_mask, pad_token_id)
    if torch.equal(ids, input_ids) and torch.equal(mask, attention_mask):
        return []  # already left-packed: nothing moves
    again = _scored(rescore, ids, mask, scores.numel())
    if again is None:
        return []
    low = again.dtype if again.is_floating_point() else torch.float32
    a, b = scores.detach().double().flatten().cpu(), again.detach().double().flatten().cpu()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return []
    scale = max(float(a.std()) if a.numel() > 1 else 0.0, 1e-3 * float(a.abs().max()), 1e-12)
    # the model's own rounding of a reordered reduction: 16 units of its output dtype at the scores' magnitude
    tol = POSITION_TOL * scale + 16 * torch.finfo(low).eps / 2 * float(a.abs().max())
    moved = (a - b).abs() > tol
    n = int(moved.sum())
    if not n:
        return []
    same = _scored(rescore, input_ids, attention_mask, scores.numel())  # the same layout again
    if same is None or bool(((same.detach().double().flatten().cpu() - a).abs() > tol).any()):
        return []  # a random forward (dropout): the nondeterminism check names it, not the position
    right = int((~attention_mask.bool()[:, -1]).sum())
    model = source.removeprefix("model:")
    return [
        Finding(
            severity="error",
            kind=K.REWARD_POSITION,
            role="reward",
            where=f"model.reward_model ({model})",
            message=f"the reward model scores {n} of {scores.numel()} rows differently when only their padding moves "
            f"(the same tokens with the same position ids, padding moved to the left; largest change "
            f"{float((a - b).abs().max()):.3g}, the scores' spread {float(a.std()):.3g}): it reads its score at a "
            f"position, not at each row's last attended token; {right} rows end in padding, and their score is the "
            "pad token's, not the response's",
            observed={"rows_changed": n, "rows": int(scores.numel()), "rows_ending_in_padding": right},
            expected="the same scores whatever the padding (the last non-pad token's score)",
            fix=f"model.reward_model ({model}): read the score at each row's last non-pad token, from the attention "
            "mask (index = the last position where attention_mask is 1), not at the last column",
            **ctx,
        )
    ]


class RewardWatch:
    """The reward invariants over a run: a constant reward (every reward of a run without groups,
    `reward_signal.ConstantWatch`; ``grouped``: GRPO's no-signal check covers it),
    the task agreement and the reward model's position probe (audited steps only, each found once)."""

    def __init__(self) -> None:
        self.constant = reward_signal.ConstantWatch()
        self.agreement = TaskAgreement()
        self.row_order = probes_reward.RowOrder()  # data24
        self.normalised = probes_reward.BatchNormalised()
        self.found: set[str] = set()

    def findings(
        self,
        *,
        source: str,
        rewards: Any,
        context: Mapping[str, Any],
        config: Mapping[str, Any],
        pad_token_id: Any,
        sampled: bool,
        where: Mapping[str, Any],
        grouped: bool = False,
    ) -> list[Finding]:
        if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.numel():
            return []
        data = dict(config.get("data") or {})
        spec = (config.get("model") or {}).get("reward_model")
        out: list[Finding] = []
        # GRPO's groups: a constant reward is the no-signal finding's (one value in every group), not a second root
        c = (
            None
            if grouped
            else self.constant.observe(
                rewards, step=where.get("step"), source=source, data=data, model_spec=spec
            )
        )
        if c is not None:
            out.append(c)
        if K.REWARD_INVERTED not in self.found and "responses" in context:  # every step: string comparisons
            out += self.agreement.observe(
                rewards,
                responses=context["responses"],
                examples=context.get("examples") or (),
                data=data,
                ctx=where,
            )
        if source.startswith("function:"):  # data24: rewards sorted by row, every step (a comparison)
            truth = task_scores(context.get("responses"), context.get("examples"), data)
            out += self.row_order.observe(
                rewards, where=reward_signal.reward_key(data), ctx=where, truth=truth
            )
        if K.REWARD_BATCH_DEPENDENT not in self.found:  # data24: a normalisation over the batch, every step
            at = (
                reward_signal.reward_key(data)
                if source.startswith("function:")
                else f"model.reward_model ({spec})"
            )
            out += self.normalised.observe(rewards, where=at, ctx=where)
        if not sampled:
            self.found.update(f.kind for f in out)
            return out
        rescore = context.get("rescore")
        if K.REWARD_POSITION not in self.found and callable(rescore) and isinstance(pad_token_id, int):
            ids, mask = context.get("input_ids"), context.get("attention_mask")
            if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor):
                out += position_findings(
                    rewards,
                    input_ids=ids,
                    attention_mask=mask,
                    rescore=rescore,
                    pad_token_id=pad_token_id,
                    source=source,
                    ctx=where,
                )
        if K.REWARD_BATCH_DEPENDENT not in self.found and callable(rescore):  # data24: batch composition
            ids, mask = context.get("input_ids"), context.get("attention_mask")
            if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor):
                out += probes_reward.batch_findings(
                    rewards, input_ids=ids, attention_mask=mask, rescore=rescore, source=source, ctx=where
                )
        self.found.update(f.kind for f in out)
        return out
