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
