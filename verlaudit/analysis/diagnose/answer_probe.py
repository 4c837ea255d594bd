"""What the reward probe (`verlaudit.audit.probes_answer`) says about a run without a learning signal.

A GRPO run whose groups all scored alike has no learning signal; whether that is a fault depends on the
reward. The audit handed each row's reference answer to the reward function as the response (in a forked
child) and wrote what it scored:

- ``reward/answer_scores`` (info): the reference answer scores above a wrong one; when every silent step's
  rewards were no higher than a wrong answer's, the policy has not yet sampled a correct answer (a sparse
  reward at the start of a run): the no-signal cause becomes info, with the probe's numbers;
- ``reward/answer_unscored`` (error): the reward cannot fire; that finding is its own cause (a data /
  plug-in tier root that explains the no-signal symptom) and the no-signal cause carries its evidence;
  so do ``reward/answer_lenient`` (near misses score as the answer: a loose tolerance) and
  ``data/answer_form`` (the answers' canonical form scores below their raw one: a float's repr, a '.0'):
  a reward that misjudges answers is never called sparse. Nor is one whose near misses the probe did not
  show to score below the answer (an older run directory).

Exercised by `pytest tests/test_probes_fork.py -k settle`.
"""

from __future__ import annotations

import dataclasses
import math

from verlaudit import kinds as K
from verlaudit.analysis.causes import Cause
from verlaudit.rundir import RunDir

FAULTS = (K.REWARD_ANSWER_UNSCORED, K.REWARD_ANSWER_LENIENT, K.ANSWER_FORM)
"""The probe's findings that say the reward misjudges answers: each is a root, never a sparse reward."""


def sparse_shown(observed: object) -> bool:
    """Whether the probe showed what a sparse reward needs: the reference answer fires, and the near misses
    next to it (an integer +-1, a changed last letter) were probed and scored below it (a probe of this
    version: the counts are recorded; rows with no near miss to probe, answers of neither digits nor
    letters, show no leniency either)."""
    if not isinstance(observed, dict):
        return False
    rows, scored = observed.get("near_miss_rows"), observed.get("near_miss_scored")
    # no row with a near miss (answers of neither digits nor letters): nothing could show leniency
    return isinstance(rows, int) and isinstance(scored, int) and scored == 0


def settle(run: RunDir, cause: Cause, silent: list[int]) -> Cause:
    """``cause`` (the no-signal cause) as the reward probe's findings qualify it: info ("no correct answer
    sampled yet") only where the probe showed the reward scores the reference answer as correct, its
    near misses as wrong and the answers' canonical form as their raw one; a probe finding that the reward
    misjudges answers is the root instead (it stays a cause of its own and the no-signal cause cites it)."""
    faults = [f for f in run.findings if f.kind in FAULTS and f.severity != "info"]
    if faults:
        return dataclasses.replace(
            cause,
            evidence=[*cause.evidence, *(f"the reward probe (step {f.step}): {f.message}" for f in faults)],
        )
    fires = next((f for f in run.findings if f.kind == K.REWARD_ANSWER_SCORES), None)
    if fires is None or not isinstance(fires.observed, dict):
        return cause
    if not sparse_shown(fires.observed):
        return dataclasses.replace(
            cause, evidence=[*cause.evidence, f"the reward probe (step {fires.step}): {fires.message}; its near "
                             "misses were not shown to score below the answer, so no sparse reward is claimed"]
        )  # fmt: skip
    wrong = fires.observed.get("wrong_mean")
    right = fires.observed.get("right_mean")
    if not isinstance(wrong, (int, float)) or not isinstance(right, (int, float)):
        return cause
    means = dict(run.series("reward/mean"))
    at = [means.get(s) for s in silent]
    tol = 1e-6 * max(1.0, abs(wrong), abs(right))
    if not at or any(m is None or not math.isfinite(m) or m > wrong + tol for m in at):
        return dataclasses.replace(
            cause, evidence=[*cause.evidence, f"the reward probe (step {fires.step}): {fires.message}"]
        )
    return dataclasses.replace(
        cause,
        severity="info",
        title=f"No correct answer sampled yet in {len(silent)} step(s): every response scored as a wrong answer "
        f"does ({max(at):.3g}); the reward can fire (the reference answer scores {right:.3g})",
        what="A sparse reward the policy has not hit yet: the reward function scores the reference answer above a "
        "wrong one (probed in a forked copy of the process), so the missing signal is the policy's, not the "
        "reward's. Larger groups or more steps let it find a first correct answer.",
        evidence=[*cause.evidence, f"the reward probe (step {fires.step}): {fires.message}"],
    )
