"""Audit settings: how much to audit, and on which steps.

The one `AuditSettings` class: the suite's ``audit:`` section (`verlaudit.run.suite`), the worker
spec's ``audit`` (`verlaudit.run.worker`) and the `Auditor` all read it. ``from_dict`` checks types
and unknown keys and raises ValueError with the field path (``audit.level: 'loud'; expected one of
off, boundary, full``); ``to_dict`` gives the plain data back. Exercised by
`pytest tests/test_audit_collectors.py tests/test_suite.py tests/test_worker.py`.
"""

from __future__ import annotations

import dataclasses

# _Section is the config package's recursive from_dict/to_dict with field-path errors; reusing it
# keeps audit errors worded exactly like TrainConfig's.
from trainer.config_base import Section as _Section

LEVELS = ("off", "boundary", "full")
SHADOW_MATMULS = ("fp32", "tf32x3")
"""`verlaudit.audit.shadow_ops.MATMULS`, restated so that reading settings imports no torch (checked
equal by tests/test_audit_shadow_accuracy.py)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditSettings(_Section):
    """How much to audit, and on which steps."""

    level: str = "full"
    """``off``: metrics, memory and status only; ``boundary``: + batch / rollout / reward / loss checks
    and optimizer numerics; ``full``: + per-module dtype and numerics hooks on sampled steps."""
    full_steps: int = 2
    """The first ``full_steps`` steps are audited at the full level ..."""
    every: int = 10
    """... and every ``every``-th step after (0: never); the others at the boundary level. Lost
    updates (`numerics.update_underflow`) are measured on the same steps at both levels, and on
    step 0 even when ``full_steps`` is 0."""
    shadow: bool = False
    """Also run the fp32 shadow on the sampled steps (`verlaudit.audit.shadow`): each module's error
    against fp32, the log-prob error per token, gradient errors, written to shadow.jsonl. Costs a few
    fp32 forwards and backwards of ``shadow_rows`` rows per role on those steps (``timing_s/shadow``),
    and one block's fp32 weights of memory."""
    shadow_rows: int = 2
    """Rows of each shadowed micro-batch that run through the fp32 copies."""
    shadow_param_grads: bool = True
    """With the shadow, also compare each module's weight gradients with fp32's (``param_grad``
    records in shadow.jsonl: the error and the fraction of gradients lost to underflow). Costs one
    backward of each block in its own precision and the fp32 backward's weight gradients, about a
    third of the shadow's backward; off, the blocks' input-gradient errors are still measured."""
    shadow_matmul: str = "fp32"
    """How the shadow's fp32 matrix products run: ``fp32`` (exact), or ``tf32x3``, three TF32
    tensor-core products of split operands, within a few 2^-22 of fp32 at about a third of its time on
    a GPU (`verlaudit.audit.shadow_ops.MATMULS`; no gain on a CPU), for two more copies of one block's
    fp32 weights of memory (each weight's halves). A role whose policy computes in fp32 is shadowed with
    exact products either way."""
    opcount_steps: int = 1
    """On this many sampled steps (the first ones; 0: never), count the ops each module runs per dtype
    (`verlaudit.audit.opcount`, opcounts.jsonl): what ran in bf16, what autocast left in fp32, where
    dtypes were promoted. The counts repeat from step to step, and counting costs a Python call per
    op, so one step is usually enough."""
    rerun_plugins: bool = False
    """On sampled full-audit steps, call the user's reward function and collator a second time with their
    floating ops promoted to fp64 and compare the results (`verlaudit.audit.plugins`). Off by default:
    user code may keep state, count calls or hit a service, and is then called twice on those steps.
    Without it their calls are still watched (the first op that produced a NaN/inf, fp16/bf16 ops, ids
    held in floats, with their lines); a reward model's forward is always re-run in fp32 (a pure forward)."""

    probe_plugins: bool = True
    """On the first two sampled full-audit steps, probe the reward function's contract in forked copies of the
    process (`verlaudit.audit.probes_fork`, `probes_answer`): the same batch twice, reordered, in halves and
    one group at a time must give each row the same reward; each row's reference answer as the response
    must score above a wrong answer, its canonical form as the raw one. The children start from the state
    the real call starts from and exit after; the run never sees their calls. Skipped without os.fork
    (said once in events.jsonl) and for calls that fail in the child. ``false`` turns it off (a reward
    that calls a paid service: each probe call is a request)."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"audit.level: {self.level!r}; expected one of {', '.join(LEVELS)}")
        if not _count(self.full_steps):
            raise ValueError(f"audit.full_steps: expected an integer >= 0, got {self.full_steps!r}")
        if not _count(self.every):
            raise ValueError(f"audit.every: expected an integer >= 0 (0: never), got {self.every!r}")
        if not _count(self.shadow_rows) or self.shadow_rows < 1:
            raise ValueError(f"audit.shadow_rows: expected an integer >= 1, got {self.shadow_rows!r}")
        if not _count(self.opcount_steps):
            raise ValueError(f"audit.opcount_steps: expected an integer >= 0, got {self.opcount_steps!r}")
        if not isinstance(self.shadow, bool):
            raise ValueError(f"audit.shadow: expected true or false, got {self.shadow!r}")
        if self.shadow_matmul not in SHADOW_MATMULS:
            raise ValueError(
                f"audit.shadow_matmul: {self.shadow_matmul!r}; expected one of {', '.join(SHADOW_MATMULS)}"
            )
        if not isinstance(self.shadow_param_grads, bool):
            raise ValueError(
                f"audit.shadow_param_grads: expected true or false, got {self.shadow_param_grads!r}"
            )
        if not isinstance(self.probe_plugins, bool):
            raise ValueError(
                f"audit.probe_plugins: expected true or false, got {self.probe_plugins!r} (false turns the "
                "reward function's forked probes off)"
            )
        if not isinstance(self.rerun_plugins, bool):
            raise ValueError(f"audit.rerun_plugins: expected true or false, got {self.rerun_plugins!r}")

    def is_full(self, step: int) -> bool:
        """Whether ``step`` is audited at the full level (module hooks on)."""
        if self.level != "full":
            return False
        return step < self.full_steps or (self.every > 0 and step % self.every == 0)

    def measures_updates(self, step: int) -> bool:
        """Whether this step snapshots a sample of the weights to count updates lost to rounding:
        cheap (`numerics.UPDATE_SAMPLE` elements per tensor, one host read), but not free, so only
        on `is_full`'s schedule, at the boundary level too."""
        if self.level == "off":
            return False
        return step < max(1, self.full_steps) or (self.every > 0 and step % self.every == 0)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
