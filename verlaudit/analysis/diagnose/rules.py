"""Which recorded problem explains which: the rule table behind ``verlaudit diagnose``'s root cause.

Every cause a diagnosis finds gets a *class* (`finding_class` for audit findings, `CAUSE_CLASSES`
for the analyses' own kinds) and a *moment* (`Moment`: step, phase, then order of recording). A
rule ``(root class, symptom class)`` in `RULES` says the first can produce the second; the root of
a cause is the earliest cause (not later in step and phase) that a rule lets explain it, followed
back as far as rules go: the float ids a collator returned explain the dtype error of the embedding
that received them, a reward that returned NaN explains the NaN loss, the corrupted weights of a
reward model explain that NaN reward. `chains` orders a diagnosis as root first, then what it
explains ("root -> consequence"), then the independent causes. Pure: it reads causes, not runs.

What the order relies on: a finding's step and phase are exact (the auditor stamps them as it
records); findings.jsonl keeps each finding where it was first recorded (`FindingLog` appends new
findings and rewrites the file in first-seen order), which orders findings of one phase only
approximately (non-finite checks are read at the next optimizer step), so within one step and
phase a rule decides, not the line order. A run's failure (status.json) is its last moment.

A foreign log is ordered by the same rules (the one root-cause ordering of diagnose): a log cannot
tell the classes above, only which failure came first and which kinds usually follow another
failure (`verlaudit.analysis.logs.classify`: ``log_failure``, ``log_cascade``), and its moments are
its lines, which are exact. Exercised by `pytest tests/test_rules.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from verlaudit.analysis.logs import CASCADE_CLASS, FAILURE
from verlaudit.analysis.logs.phases import RANK as PHASE_RANK

# PHASE_RANK ranks a phase of either vocabulary (the trainer's, a log's: the one table in
# verlaudit.analysis.logs.phases). Setup and the collation of a DPO batch come before a step's first
# phase (rank 0).
LAST = math.inf


@dataclasses.dataclass(frozen=True, order=True)
class Moment:
    """When a cause was first seen: setup is step -1; ``seq`` orders records within a phase."""

    step: float
    phase: int
    seq: float = 0.0

    @staticmethod
    def of(step: int | None, phase: str | None, seq: float = 0.0) -> Moment:
        return Moment(-1.0 if step is None else float(step), PHASE_RANK.get(phase, len(PHASE_RANK)), seq)

    def not_after(self, other: Moment) -> bool:
        """Whether this moment is at or before ``other`` by step and phase (line order aside)."""
        return (self.step, self.phase) <= (other.step, other.phase)


# ---------------------------------------------------------------- classes

ROOT_CLASSES = (
    "weights_nonfinite",  # NaN/Inf stored in the weights (a corrupted checkpoint or a broken setup)
    "weights_outlier",  # one module's weights far out of its siblings' range
    "param_dtype",  # parameters stored in a dtype the policy does not say (a cast submodule, a head)
    "buffer_dtype",  # a buffer in a dtype that loses precision (rotary inv_freq)
    "ids_float",  # token ids or masks that became floating point
    "ids_range",  # token ids outside the vocabulary
    "ids_dtype",  # integer ids of another width (int32)
    "batch_shape",  # collator fields that disagree in batch size or shape, or are not tensors
    "padding",  # prompts padded on the wrong side
    "reward_model_dtype",  # a reward model stored in another dtype than the policy's
    "reward_nonfinite",  # a reward function or model that returned NaN/Inf
    "reward_shape",  # a reward of the wrong shape or type
    "reward_dtype",  # a reward in fp64/fp16
    "no_signal",  # rewards identical within every group: no advantage, no gradient
    "module_output_dtype",  # a module returned another dtype than it computes in (a casting hook)
    "module_input_dtype",  # activations entering a module in another dtype outside autocast
    "compute_dtype",  # a module computing in another dtype than the policy's
    "island_dtype",  # log-probs / values / losses not kept in fp32
    "grad_dtype",  # gradients in another dtype than the policy's
    "rollout_dtype",  # rollout engine dtype differs from the actor's compute dtype
    "vocab",  # the model emits ids its tokenizer cannot decode
)
SYMPTOM_CLASSES = (
    "dtype_error",  # a runtime dtype error (the run died)
    "exception",  # another exception (IndexError, ValueError in the trainer, ...)
    "nonfinite",  # NaN/Inf in the loss, gradients or a forward
    "overflow",  # fp16 overflow: skipped steps, loss-scale collapse
    "oom",
    "killed",
    "other",
)

CAUSE_CLASSES: dict[str, str] = {
    "dtype_error": "dtype_error",
    "device_mismatch": "exception",
    "exception": "exception",
    "compile_error": "exception",
    "nonfinite": "nonfinite",
    "nonfinite_skips": "nonfinite",
    "loss_scale_collapse": "overflow",
    "overflow_skips": "overflow",
    "oom": "oom",
    "killed": "killed",
    "no_signal": "no_signal",
    "weights": "weights_outlier",
}
"""Cause kinds of the run analyses (`verlaudit.analysis.causes.Cause.kind`) -> class; a cause made
from an audit finding (kind ``finding:<kind>``) is classed by `finding_class`."""

_FINDING_CLASSES: dict[str, str] = {
    "numerics/weight_nonfinite": "weights_nonfinite",
    "numerics/weight_outlier": "weights_outlier",
    "dtype/param_storage": "param_dtype",
    "dtype/mixed_params": "param_dtype",
    "dtype/buffer_precision": "buffer_dtype",
    "dtype/int_became_float": "ids_float",
    "boundary/rollout_tokens": "ids_range",
    "boundary/padding_side": "padding",
    "boundary/reward_model": "reward_model_dtype",
    "reward/no_signal": "no_signal",
    "dtype/module_output": "module_output_dtype",
    "dtype/module_input": "module_input_dtype",
    "dtype/compute": "compute_dtype",
    "dtype/island": "island_dtype",
    "dtype/grad": "grad_dtype",
    "boundary/rollout_dtype": "rollout_dtype",
    "boundary/vocab_mismatch": "vocab",
    "runtime/dtype_error": "dtype_error",
    "memory/oom": "oom",
    "numerics/overflow": "overflow",
    "numerics/headroom": "overflow",
}
_NONFINITE = ("nan", "inf", "-inf", "nan+inf")


def finding_class(kind: str, observed: Any = None, expected: Any = None) -> str:
    """The class of an audit finding from its kind and what it observed: ``boundary/collator`` is
    ``ids_float`` for a float dtype, ``ids_dtype`` for another integer width, ``ids_range`` for an id
    range, else ``batch_shape`` (shapes, sizes, a list instead of a tensor);
    ``boundary/reward`` is ``reward_nonfinite`` / ``reward_dtype`` / ``reward_shape``."""
    if kind == "boundary/collator":
        if isinstance(observed, str) and observed.startswith(("fp", "bf")):
            return "ids_float"
        if isinstance(observed, str) and observed.startswith(("int", "uint")):
            return "ids_dtype"  # int32 ids: a narrower integer, harmless to the embedding
        if isinstance(expected, list) and len(expected) == 2 and expected[0] == 0:
            return "ids_range"  # expected [0, vocab - 1]; a shape mismatch expects [batch, length]
        return "batch_shape"
    if kind == "boundary/reward":
        if expected == "finite" or str(observed).lower() in _NONFINITE:
            return "reward_nonfinite"
        if isinstance(observed, list) or expected == "numbers":
            return "reward_shape"
        return "reward_dtype"
    if kind.startswith("numerics/nonfinite") or kind == "numerics/skipped_step":
        return "nonfinite"
    return _FINDING_CLASSES.get(kind, "other")


# ---------------------------------------------------------------- the rule table


@dataclasses.dataclass(frozen=True)
class Rule:
    """``root`` can produce ``symptom``; ``same_role``: only within one role's model (a cast module
    of the critic does not explain a dtype error in the actor)."""

    why: str
    same_role: bool = False


_FLOAT_IDS = "token ids that are not integers cannot index an embedding"
_NAN_WEIGHTS = "a forward through NaN/Inf weights returns NaN/Inf"
_OUTLIER = "weights far larger than their siblings' make activations that overflow or turn NaN"
_CAST = "a module stored in another dtype meets the activations of its neighbours"
_OUTPUT = "a module that returns another dtype hands it to the next module"

RULES: dict[tuple[str, str], Rule] = {
    # inputs
    ("ids_float", "dtype_error"): Rule(_FLOAT_IDS),
    ("ids_float", "exception"): Rule(_FLOAT_IDS),
    ("ids_float", "ids_float"): Rule("the float ids the collator returned reached the model"),
    ("ids_range", "exception"): Rule("an id past the vocabulary indexes outside the embedding table"),
    ("ids_range", "nonfinite"): Rule("an id past the vocabulary reads memory outside the embedding table"),
    ("batch_shape", "exception"): Rule("fields of different shapes cannot be combined by the model"),
    # rewards
    ("reward_nonfinite", "nonfinite"): Rule(
        "a NaN/Inf reward makes the advantages, the loss and the gradients NaN"
    ),
    ("reward_nonfinite", "overflow"): Rule(
        "a NaN/Inf reward makes the gradients non-finite, so steps are skipped"
    ),
    ("reward_model_dtype", "reward_dtype"): Rule("the reward model scores in its own dtype"),
    ("reward_model_dtype", "dtype_error"): Rule(
        "the reward model's weights meet activations of another dtype"
    ),
    ("reward_model_dtype", "module_input_dtype"): Rule(_CAST, same_role=True),
    ("reward_model_dtype", "compute_dtype"): Rule(_CAST, same_role=True),
    # weights
    ("weights_nonfinite", "nonfinite"): Rule(_NAN_WEIGHTS, same_role=True),
    ("weights_nonfinite", "reward_nonfinite"): Rule(_NAN_WEIGHTS, same_role=True),
    ("weights_nonfinite", "overflow"): Rule(_NAN_WEIGHTS, same_role=True),
    ("weights_nonfinite", "exception"): Rule("the sampler cannot draw from NaN/Inf probabilities"),
    ("weights_outlier", "nonfinite"): Rule(_OUTLIER, same_role=True),
    ("weights_outlier", "reward_nonfinite"): Rule(_OUTLIER, same_role=True),
    ("weights_outlier", "overflow"): Rule(_OUTLIER, same_role=True),
    ("weights_outlier", "exception"): Rule("the sampler cannot draw from the NaN/Inf logits they produce"),
    # dtypes of modules
    ("param_dtype", "dtype_error"): Rule(_CAST, same_role=True),
    ("param_dtype", "module_input_dtype"): Rule(_CAST, same_role=True),
    ("param_dtype", "compute_dtype"): Rule(_CAST, same_role=True),
    ("param_dtype", "grad_dtype"): Rule("gradients take their parameter's dtype", same_role=True),
    ("param_dtype", "island_dtype"): Rule(_CAST, same_role=True),
    ("param_dtype", "buffer_dtype"): Rule("casting a whole model casts its buffers too", same_role=True),
    ("param_dtype", "reward_dtype"): Rule("a reward model scores in the dtype it is stored in"),
    ("module_output_dtype", "dtype_error"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "module_input_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "compute_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "island_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_input_dtype", "dtype_error"): Rule("the op receives operands of two dtypes", same_role=True),
    # numerics
    ("overflow", "nonfinite"): Rule("an fp16 overflow is an Inf, and Inf - Inf is NaN"),
    # foreign logs (`verlaudit.analysis.logs.classify`): the classes a log can tell
    (FAILURE, CASCADE_CLASS): Rule(
        "a rank that failed first makes the others time out; a dead worker makes its callers fail"
    ),
}
"""(root class, symptom class) -> why the root produces the symptom. One rule per line, each tested
in tests/test_rules.py."""


def explains(root: str, symptom: str) -> Rule | None:
    """The rule by which a ``root`` class produces a ``symptom`` class, or None."""
    return RULES.get((root, symptom))


# ---------------------------------------------------------------- chains over causes


@dataclasses.dataclass(frozen=True)
class Event:
    """What the chain builder needs of one cause: its class, moment and role."""

    cls: str
    moment: Moment
    role: str | None = None


def _can_explain(root: Event, symptom: Event) -> Rule | None:
    rule = explains(root.cls, symptom.cls)
    if rule is None or not root.moment.not_after(symptom.moment):
        return None
    if explains(symptom.cls, root.cls) and not root.moment < symptom.moment:
        return None  # a rule both ways (same class) in one step and phase: the earlier record is the root
    if rule.same_role and root.role and symptom.role and _model(root.role) != _model(symptom.role):
        return None
    return rule


def _model(role: str) -> str:
    """The model a role's records are about: the rollout engine runs the actor's modules."""
    return "actor" if role == "rollout" else role


def root_of(events: Sequence[Event], i: int) -> list[int]:
    """The chain from the root to ``events[i]``: indices, root first, ``i`` last. Each step back takes
    the earliest event that a rule lets explain the current one (ties: the one listed first)."""
    chain = [i]
    while True:
        cur = events[chain[0]]
        options = [j for j, e in enumerate(events) if j not in chain and _can_explain(e, cur)]
        if not options:
            return chain
        chain.insert(0, min(options, key=lambda j: (events[j].moment, j)))


def chains(events: Sequence[Event], ranked: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups of (the causal path from a root to the most important cause it explains, every other
    cause it explains in time order), in ``ranked`` order (indices of ``events``, most important first).
    Every index is in exactly one group; a cause nothing explains and that explains nothing is a path
    of its own."""
    done: set[int] = set()
    order = {j: n for n, j in enumerate(ranked)}
    out: list[tuple[list[int], list[int]]] = []
    for i in ranked:
        if i in done:
            continue
        path = [j for j in root_of(events, i) if j not in done] or [i]
        rest = _explained_by(events, path[0], done | set(path))
        if len(path) == 1 and rest:  # a root ranked above all it explains: its most important consequence
            path.append(min(rest, key=lambda j: order[j]))
            rest.discard(path[-1])
        others = sorted(rest, key=lambda j: (events[j].moment, j))
        done.update(path + others)
        out.append((path, others))
    return out


def _explained_by(events: Sequence[Event], root: int, taken: set[int]) -> set[int]:
    """Every event reachable from ``root`` through rules (transitively), minus ``taken``."""
    found: set[int] = set()
    frontier = [root]
    while frontier:
        cur = frontier.pop()
        for j, e in enumerate(events):
            if j not in taken and j not in found and _can_explain(events[cur], e):
                found.add(j)
                frontier.append(j)
    return found


def severity_max(severities: Sequence[str]) -> str:
    order = {"info": 0, "warning": 1, "error": 2}
    return max(severities, key=lambda s: order.get(s, 0))


def phase_name(rank: int) -> str | None:
    for name, r in PHASE_RANK.items():
        if r == rank:
            return name
    return None


def moment_words(m: Moment) -> str:
    if m.step < 0:
        return "setup"
    ph = phase_name(m.phase)
    return f"step {int(m.step)}" + (f", {ph}" if ph else "")
