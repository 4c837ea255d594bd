"""Which verl release line a job targets (``algo.verl_version``) and the keys whose semantics changed
between verl's lines: each change is named once here, with the first line that has the newer form, and
the code that implements a changed key asks `follows`. README "Compatibility with verl and TRL" lists
them. Exercised by `pytest tests/test_verl_versions.py`.
"""

from __future__ import annotations

import dataclasses

LINES = ("0.7", "0.8", "0.9", "0.10")
"""The verl release lines we know the semantics of (``0.10`` is verl main of August 2026, 0.10.dev)."""
LATEST_RELEASE = "0.9"
"""The default: the release line users install."""


@dataclasses.dataclass(frozen=True)
class Change:
    since: str
    """The first release line with the newer semantics."""
    key: str
    """The key (and value) whose meaning changed."""
    what: str
    """The newer semantics, and the older in brackets."""


CHANGES = {
    "sum_norm_per_sequence": Change(
        "0.9",
        "loss_agg_mode: seq-mean-token-sum-norm",
        "the token sums are averaged over the mini-batch's sequences, then divided by loss_scale_factor "
        "(before: summed over the sequences, so the loss and its gradient were larger by the sequence count)",
    ),
    "is_metrics_truncated": Change(
        "0.9",
        "rollout_correction.rollout_is (the rollout_corr/rollout_is_* metrics)",
        "mean, min, max, std, effective sample size and the per-sequence statistics are of the truncated "
        "weights the loss uses; the fractions above / below the threshold stay of the raw ones (before: all "
        "of the raw weights)",
    ),
    "reinforce_carries_holes": Change(  # verl #7300, commit 8a1bf6d5b (2026-08-10), first in v0.9.0
        "0.9",
        "adv_estimator: reinforce_plus_plus",
        "the reward-to-go is carried through masked tokens inside a response (tool observations, tokens "
        "rejected by rollout_rs): they get return 0 and pass the later return on undiscounted (before: "
        "the return restarted from 0 at every masked token)",
    ),
}


def line(version: str) -> tuple[int, int]:
    """``0.9``, ``0.9.1``, ``v0.10.0.dev`` -> (0, 9), (0, 9), (0, 10); ValueError for anything else."""
    parts = version.strip().lstrip("v").split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"{version!r} is not a verl version; expected one of {', '.join(LINES)}") from None
    return major, minor


def check(version: str) -> None:
    """ValueError unless ``version`` is on a known line."""
    known = [line(v) for v in LINES]
    if line(version) not in known:
        raise ValueError(
            f"{version!r}: no verl line we know the semantics of; expected one of {', '.join(LINES)}"
        )


def follows(version: str, change: str) -> bool:
    """Whether verl ``version`` has the newer semantics of ``change`` (a `CHANGES` key)."""
    return line(version) >= line(CHANGES[change].since)
