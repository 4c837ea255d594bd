"""Whether a step's rewards can teach the policy anything: GRPO groups whose responses all got the same
reward have zero group-relative advantages. `reward_groups` counts them (one reduction and one host
read, on the reward the audit already reads back); `no_signal_finding` turns a step where every group
is identical into a ``reward/no_signal`` finding with the fraction, and the `Auditor` writes the
fraction every step as ``reward/identical_group_frac``. Exercised by
`pytest tests/test_root_cause.py -k signal`.
"""

from __future__ import annotations

import torch

from verlaudit import kinds as K
from verlaudit.rundir import Finding

METRIC = "reward/identical_group_frac"


def reward_groups(rewards: torch.Tensor, group_size: int) -> tuple[int, int] | None:
    """(groups whose rewards are all equal, groups) for rewards laid out group by group; None when
    the rewards are not whole groups of ``group_size`` (>= 2)."""
    n = rewards.numel()
    if group_size < 2 or n == 0 or n % group_size:
        return None
    g = rewards.detach().float().reshape(-1, group_size)
    spread = g.amax(dim=1) - g.amin(dim=1)
    tol = 1e-6 * g.abs().amax(dim=1).clamp(min=1.0)
    same = spread <= tol  # a group holding NaN is not "identical": the non-finite checks report it
    return int(same.sum()), int(g.shape[0])


TINY_STD_METRIC = "reward/tiny_std_group_frac"
"""combo: the share of GRPO groups whose rewards differ (not identical) with a std below `TINY_GROUP_STD`."""
TINY_GROUP_STD = 1e-3
"""A group std under which GRPO's std normalisation multiplies the group's reward differences by 1000 or
more: a 0/1 correctness reward's non-identical groups have a std of 0.43 or more (group of 4), a reward
model's scores differ by far more than this unless the differences are tie-breaks or float noise."""


def tiny_std_groups(rewards: torch.Tensor, group_size: int) -> float | None:
    """The share of groups (laid out group by group) whose rewards are not all equal (`reward_groups`'
    tolerance) and whose std is below `TINY_GROUP_STD`; None when the rewards are not whole groups."""
    n = rewards.numel()
    if group_size < 2 or n == 0 or n % group_size:
        return None
    g = rewards.detach().double().reshape(-1, group_size)
    spread = g.amax(dim=1) - g.amin(dim=1)
    differ = spread > 1e-6 * g.abs().amax(dim=1).clamp(min=1.0)
    tiny = differ & (g.std(dim=1, unbiased=True) < TINY_GROUP_STD)
    return float(tiny.sum()) / float(g.shape[0])


def no_signal_finding(
    identical: int,
    groups: int,
    *,
    source: str,
    pg_loss: float | None,
    step: int | None,
    phase: str | None = "reward",
) -> Finding | None:
    """A warning when every group's rewards are identical: group-relative advantages are all zero."""
    if groups == 0 or identical < groups:
        return None
    zero = pg_loss is not None and pg_loss == 0.0
    return Finding(
        severity="warning",
        kind=K.NO_SIGNAL,
        role="reward",
        where=f"reward:{source}",
        step=step,
        phase=phase,
        observed={
            "identical_groups": identical,
            "groups": groups,
            "fraction": identical / groups,
            **({"pg_loss": pg_loss} if pg_loss is not None else {}),
        },
        expected="rewards that differ within a group",
        message=f"all {groups} groups got identical rewards within the group: the advantages are zero"
        + (" and the policy loss is exactly 0" if zero else "")
        + ", so this step teaches the policy nothing",
        fix="check that the reward reads the response and returns one score per response; a sparse binary "
        "reward needs larger groups (algo.group_size) or more diverse sampling (algo.temperature)",
    )


CONSTANT_STEPS = 2
"""Steps in a row whose rewards are one value for the whole batch before it is a finding: one step of a
sparse reward (every response wrong at the start) is common, two in a row of exactly one value for every
response are a reward that does not read them (the clean controls' rewards differ at every step)."""


def reward_key(data: dict) -> str:
    """The config key (with its spec) of what makes the rewards, for a finding's ``where``."""
    if data.get("train_files"):
        key = data.get("reward_fn_key") or "data_source"
        if key != "data_source":  # verl passes this column as data_source: the first suspect
            return f"data.reward_fn_key ({key})"
        return f"data.compute_score ({data.get('compute_score') or 'verl default'})"
    if data.get("reward_fn"):
        return f"data.reward_fn ({data['reward_fn']})"
    return f"data.task ({data.get('task')})"


SATURATION_BOUNDS = {1.0: "sigmoid's / a probability's top", 0.0: "sigmoid's bottom", -1.0: "tanh's bottom"}
"""A reward model's one value that is the bound of a squashing function: every score saturated it."""


def saturated(values: list[float]) -> str | None:
    """What a reward model's constant value says when it is a squashing function's bound (rank12: the fix from
    the evidence), else None: a sigmoid / tanh / softmax over one logit returns its bound for every input once
    the logits are large (or there is one class)."""
    if len(values) != 1 or values[0] not in SATURATION_BOUNDS:
        return None
    v = values[0]
    return (
        f"every score is {v:g}, {SATURATION_BOUNDS[v]} bound: the scorer squashes its logit (sigmoid, tanh, a "
        "softmax over a single logit, a clamp) and every logit saturates it; return the raw logit (or "
        "logsigmoid / the logit divided by a temperature) instead of the squashed probability"
        + (", or check for a zero score head" if v == 0.0 else "")
    )


class ConstantWatch:
    """Whether every reward of the batch is one value, step after step (`CONSTANT_STEPS`): the reward
    does not depend on the response at all. Read for a reward model (its scores are continuous: distinct
    sequences tie exactly only when it reads none of them, a position that is padding in every row) and
    for verl's compute_score handed another column than data_source (a dispatch that falls through to
    its default); a rule reward's one value is what a sparse reward gives a policy that gets nothing
    right yet, so it is not read."""

    def __init__(self) -> None:
        self.run: list[tuple[int | None, float]] = []
        self.done = False

    def observe(
        self, rewards: torch.Tensor, *, step: int | None, source: str, data: dict, model_spec: str | None
    ) -> Finding | None:
        fk = data.get("reward_fn_key") or "data_source"
        verl_key = bool(data.get("train_files")) and fk != "data_source"
        if not (source.startswith("model:") or verl_key):
            # a rule reward of one value for every response is what a sparse reward gives a policy that
            # gets nothing right yet (a clean copy-task run scores 0 at two steps in a row): not evidence
            return None
        r = rewards.detach().float().flatten()
        if self.done or r.numel() < 4 or not bool(torch.isfinite(r).all()):
            return None
        lo, hi = float(r.min()), float(r.max())
        if hi - lo > 1e-6 * max(1.0, abs(hi)):
            self.run = []
            return None
        if self.run and self.run[-1][0] == step:  # ReMax's baseline and its samples: one step
            return None
        self.run.append((step, lo))
        if len(self.run) < CONSTANT_STEPS:
            return None
        self.done = True
        values = sorted({v for _, v in self.run})
        at = f"model.reward_model ({model_spec})" if source.startswith("model:") else reward_key(data)
        fix = (
            f"data.reward_fn_key '{fk}': verl passes each row's '{fk}' column to compute_score as data_source; "
            "set it to the column compute_score dispatches on (verl's default 'data_source'), or add a scorer "
            "for that value in compute_score"
            if verl_key
            else f"{at}: check what the reward reads: it returns one value whatever the response (a field read "
            "under a wrong name, a branch that always falls through to a default, a score read at a padded "
            "position)"
        )
        bound = saturated(values) if source.startswith("model:") else None
        if bound is not None:
            fix = f"{at}: {bound}; " + fix
        return Finding(
            severity="warning",
            kind=K.REWARD_CONSTANT,
            role="reward",
            where=at,
            step=self.run[0][0],
            phase="reward",
            message=f"every response got the same reward ({', '.join(f'{v:g}' for v in values)}) at "
            f"{len(self.run)} steps in a row ({r.numel()} responses a step)"
            + (
                f"; data.reward_fn_key '{fk}' hands compute_score the rows' '{fk}' as data_source"
                if verl_key
                else ""
            )
            + ": the reward does not depend on the response, so nothing it scores can teach the policy",
            observed={"values": values, "steps": len(self.run), "responses": int(r.numel())},
            expected="rewards that differ between responses",
            fix=fix,
        )
