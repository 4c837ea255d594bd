"""Which verl release line a job targets (``algo.verl_version``) and the keys whose semantics changed
between verl's lines: each change is named once here, with the first line that has the newer form, and
the code that implements a changed key asks `follows`. README "Compatibility with verl and TRL" lists
them. Exercised by `pytest tests/test_verl_versions.py`.
"""

from __future__ import annotations

import dataclasses
import re

LINES = ("0.7", "0.8", "0.9", "0.10")
"""The verl release lines we know the semantics of (``0.10`` is verl main of August 2026, 0.10.dev). The
releases, from verl's tags: v0.7.0 (main of 2026-01-05), v0.7.1 (a branch off main of 2026-03-16), v0.8.0
(main of 2026-06-01), v0.9.0 (a branch off main of 2026-08-12); a change's ``since`` may name a patch
release (``0.7.1``) when it first shipped in one."""
LATEST_RELEASE = "0.9"
"""The default: the release line users install."""


@dataclasses.dataclass(frozen=True)
class Change:
    since: str
    """The first release with the newer semantics (a line, ``0.8``, or a patch release, ``0.7.1``)."""
    key: str
    """The key (and value) whose meaning changed."""
    what: str
    """The newer semantics, and the older in brackets."""
    commit: str = ""
    """verl's commit that made the change (verl-project/verl)."""


CHANGES = {
    "sum_norm_per_sequence": Change(
        "0.7.1",
        "loss_agg_mode: seq-mean-token-sum-norm",
        "the token sums are averaged over the mini-batch's sequences, then divided by loss_scale_factor "
        "(before: summed over the sequences, so the loss and its gradient were larger by the sequence count)",
        "b8d91ef8d (2026-02-26)",
    ),
    "is_metrics_truncated": Change(
        "0.8",
        "rollout_correction.rollout_is (the rollout_corr/rollout_is_* metrics)",
        "mean, std, effective sample size, a token weight's min / max and the per-sequence statistics are of "
        "the weights the loss uses, std and ESS of them clamped to [0, C]; the fractions above / below the "
        "bounds and a sequence weight's min / max stay of the raw ones (before: all of the raw weights, std "
        "and ESS clamped to [1/C, C])",
        "d2916f5a0 (2026-03-24, with IcePop)",
    ),
    "is_seq_fractions_raw": Change(
        "0.9",
        "rollout_correction.rollout_is (rollout_corr/rollout_is_seq_fraction_high, _low)",
        "the fractions of sequences whose mean weight is above / below the bounds are of the raw weights "
        "(before, from 0.8: of the truncated ones, so the high fraction was always 0)",
        "bdfedd461 (2026-06-25)",
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


def release(version: str) -> tuple[int, int, int]:
    """``0.7.1`` -> (0, 7, 1); a line or a dev / rc suffix counts as its .0 (``0.10.0.dev`` -> (0, 10, 0))."""
    major, minor = line(version)
    parts = version.strip().lstrip("v").split(".")
    patch = re.match(r"\d*", parts[2]).group() if len(parts) > 2 else ""
    return major, minor, int(patch or 0)


def check(version: str) -> None:
    """ValueError unless ``version`` is on a known line."""
    known = [line(v) for v in LINES]
    if line(version) not in known:
        raise ValueError(
            f"{version!r}: no verl line we know the semantics of; expected one of {', '.join(LINES)}"
        )


def follows(version: str, change: str) -> bool:
    """Whether verl ``version`` has the newer semantics of ``change`` (a `CHANGES` key)."""
    return release(version) >= release(CHANGES[change].since)
