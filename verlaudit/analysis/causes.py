"""What a diagnosis is made of, for a run directory and a foreign log alike: `Fix` (the suite key,
the verl key, why), `Cause` (what happened, evidence, fixes, what the source cannot tell),
`Diagnosis` (one source's ranked causes), the pure ranking, and the fixes both readers offer for the
same problem (a dtype error, a NaN made in the backward pass), so a log and a run get the same advice.
Exercised by `pytest tests/test_diagnose.py tests/test_logparse.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verlaudit import verl_keys as V

SEVERITY_WEIGHT = {"error": 100.0, "warning": 10.0, "info": 1.0}


@dataclasses.dataclass(frozen=True)
class Fix:
    """One concrete change: the suite key to set, the verl key that does the same, the setting in the
    log's own framework when that is not verl, and why."""

    suite: str | None
    verl: str | None = None
    why: str = ""
    key: str | None = None
    """The same change in the framework a foreign log came from (a TrainingArguments / GRPOConfig
    field, a DeepSpeed config key, an OpenRLHF flag, a vLLM engine argument), spelled as that
    framework spells it; None for verl (see ``verl``) and for advice that is not a setting."""
    framework: str | None = None
    """The framework ``key`` belongs to (``trl``, ``deepspeed``, ``openrlhf``, ``vllm``, ...)."""


@dataclasses.dataclass
class Cause:
    """One explanation of (part of) what happened, with the numbers that support it."""

    severity: str
    kind: str
    """``oom``, ``nonfinite``, ``dtype_error``, ``loss_scale_collapse``, ``overflow_skips``,
    ``reward_collapse``, ``reward_variance``, ``killed``, ``exception``, ``interrupted``, ``refused``,
    ``device_mismatch``, ``finding:<kind>``; from foreign logs also ``oom_host``, ``oom_kv_cache``,
    ``nccl_timeout``, ``nccl_error``, ``ray_actor_died``, ``cuda_error``, ``dtype_unsupported``,
    ``unscale_fp16``, ``import_error``, ``weight_sync``, ``engine_error``, ``compile_error``,
    ``version_mismatch`` (two libraries' versions do not fit), ``engine_feature`` (the engine lacks a
    call the trainer makes), ``engine_limit`` (a request over the engine's configured limits),
    ``collapse`` (NaN / spiking gradient norm, then reward 0, loss exactly 0 or entropy collapsing) and
    ``mismatch`` (a rollout-vs-trainer metric outside its published bound)."""
    title: str
    what: str
    evidence: list[str] = dataclasses.field(default_factory=list)
    fixes: list[Fix] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)
    """What this source cannot tell (a foreign log has no culprit module, no memory classes)."""
    step: int | None = None
    where: str | None = None
    """The culprit: a module path, a boundary, a rank, a setting, a function (a run's phase for
    run-directory causes that have no finer culprit)."""
    score: float = 0.0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    phase: str | None = None
    """The phase it was first seen in. For a run directory: a trainer phase (`trainer.events.PHASES`);
    None: setup or unknown. For a foreign log: the phase the failure happened in, from the traceback's
    frames or the log's last activity line (``generate``, ``logprob``, ``reference``, ``values``,
    ``update``, ``weight_sync``, ``checkpoint``, ``init``); None when the log does not show it. One
    table maps the two onto each other (`verlaudit.analysis.logs.phases.TABLE`)."""
    framework: str | None = None
    """For a foreign log: the framework whose messages it shows (``verl``, ``trl``, ``openrlhf``, ...)."""
    rank: int | None = None
    """For a multi-rank log: the rank the cause points at (the first failing rank, or the one the
    others waited for)."""
    line: int | None = None
    """For a foreign log: the line number of the cause's first evidence (root before cascade)."""
    role: str | None = None
    cls: str | None = None
    """Its class in the root-cause rules (`verlaudit.analysis.diagnose.rules`; a log's from
    `verlaudit.analysis.logs.classify`); None: not classified yet."""
    seq: float = 0.0
    """Order of recording within its step and phase (the findings.jsonl line; a failure is last)."""
    chain: list[str] = dataclasses.field(default_factory=list)
    """On a root: the chain it starts, ``[root, consequence, ...]`` as short labels."""
    consequence_of: str | None = None
    """On a consequence: the root cause's title (its fixes are the root's)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fixes"] = [dataclasses.asdict(f) for f in self.fixes]
        return d


@dataclasses.dataclass
class Diagnosis:
    """The diagnosis of one run directory or one log file."""

    source: str
    source_kind: str  # "run" | "log"
    name: str
    state: str
    summary: str
    causes: list[Cause]

    @property
    def verdict(self) -> str:
        sev = {c.severity for c in self.causes}
        return "error" if "error" in sev else "warning" if "warning" in sev else "clean"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_kind": self.source_kind,
            "name": self.name,
            "state": self.state,
            "verdict": self.verdict,
            "summary": self.summary,
            "causes": [c.to_dict() for c in self.causes],
        }


def rank(causes: list[Cause]) -> list[Cause]:
    """Errors before warnings before info; within a severity the higher score (the cause that
    explains the failure reason, the earlier first step) first."""
    for c in causes:
        c.score += SEVERITY_WEIGHT.get(c.severity, 0.0)
    return sorted(causes, key=lambda c: (-c.score, c.step if c.step is not None else 1 << 30))


INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")


def dtype_fixes(observed: str | None, expected: str | None = None, *, autocast: bool = False) -> list[Fix]:
    """What to do about a dtype error, for a log and for a run alike (`observed`: the odd operand's dtype,
    `expected`: the other one). Only fixes that would work: none for integer ids (autocast never casts
    ids; the code that made them float must keep them torch.long), no bf16 autocast where the run
    already computes under autocast (``autocast``: known from a run's policy)."""
    if observed in INTEGER_DTYPES or expected in INTEGER_DTYPES:
        return []
    fixes = []
    if not autocast:
        fixes.append(
            Fix(
                "precision.preset: bf16",
                V.PARAM_DTYPE_BF16,
                "under autocast each op casts its inputs, so mixed fp32/bf16 operands stop failing",
            )
        )
    fixes.append(
        Fix(
            f"precision.overrides.<role>.compute_dtype: {observed or 'fp32'}",
            f"{V.ROLLOUT_DTYPE} / {V.MODEL_DTYPE}",
            "or make the role that produced the tensor compute in the same dtype as the one consuming it (e.g. "
            "the reward model or value head)",
        )
    )
    return fixes


BACKWARD_NAN_WHAT = (
    "The loss was finite while the gradients were NaN from the first (logged) step, before training could "
    "diverge: the backward pass itself produced NaN. The usual cause in RL batches: attention rows that see no key (the left padding of prompts "
    "under causal + padding masking). Math attention returns zeros there, but fused kernels (cuDNN's on Hopper, "
    "seen on an H200) leave NaN in those rows' backward, and NaN x 0 spreads into every weight gradient. Next: "
    "a custom autograd function or a log/sqrt at 0."
)


def backward_nan_fixes() -> list[Fix]:
    """What to do about a NaN made in the backward pass (`BACKWARD_NAN_WHAT`)."""
    return [
        Fix(
            None,
            V.REMOVE_PADDING,
            "unpadded (varlen) attention has no padding rows; in plain HF code give each padding query its own "
            "position to attend to (a 4-D mask, as trainer/logprobs.py attention_inputs does) or right-pad",
        ),
        Fix(
            None,
            None,
            "to confirm: rerun one step under torch.nn.attention.sdpa_kernel(SDPBackend.MATH); finite "
            "gradients there point at the fused kernel's empty rows",
        ),
    ]
