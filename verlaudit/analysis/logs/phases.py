"""The one phase vocabulary of diagnose. A foreign log's failure is placed in a phase of an RL step from
a traceback's frames or from the log's last activity line: ``generate``, ``logprob`` (the no-grad
old-log-prob pass), ``reference``, ``values``, ``update`` (forward and backward with gradients),
``weight_sync`` (trainer -> rollout engine, sleep mode wake-up included), ``checkpoint``, ``init``.
Names are the functions verl, TRL / HF Trainer, OpenRLHF, NeMo-RL, the engines and our own trainer
use. `TABLE` maps these onto the phases our trainer marks (`trainer.events.PHASES`, what a run
directory records) and back: `trainer_phase`, `log_phase`; the root-cause rules rank both
vocabularies from it. Exercised by ``pytest tests/test_log_rules.py -k phase``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from trainer.events import PHASES as TRAINER_PHASES
from verlaudit.analysis.logs.lines import Frame, hints

PHASES = ("generate", "logprob", "reference", "values", "update", "weight_sync", "checkpoint", "init")

TABLE: tuple[tuple[str | None, str | None], ...] = (
    (None, "init"),  # setup: before the trainer's first step
    ("rollout", "generate"),
    ("rollout", "weight_sync"),  # on_weight_sync runs inside the rollout phase
    ("reward", None),  # a log names no reward phase: a reward failure shows as its caller's
    ("ref", "reference"),
    ("critic", "values"),
    ("actor_update", "update"),
    ("actor_update", "logprob"),  # the old log-probs are the first forward of actor_update
    ("critic_update", "update"),  # update_critic's frames: `trainer_phase` tells it from the actor's
    (None, "checkpoint"),  # our trainer marks no checkpoint phase
)
"""(trainer phase, log phase) in the order a step runs them, a trainer phase's main log phase first (the
one `log_phase` names): every name of `trainer.events.PHASES` and of `PHASES` appears
(tests/test_log_rules.py checks it)."""
RANK: dict[str | None, int] = {None: 0, **{t: i + 1 for i, t in enumerate(TRAINER_PHASES)}}
for _t, _lp in TABLE:
    if _lp is not None and _lp not in RANK:
        RANK[_lp] = RANK[_t] if _t else (0 if _lp == "init" else len(TRAINER_PHASES) + 1)
"""The moment of a phase within a step, for either vocabulary: setup (and ``init``) first, then the
trainer's phases in the order it runs them, each log phase at its trainer phase, a checkpoint last."""


def trainer_phase(phase: str | None, funcs: Iterable[str] = ()) -> str | None:
    """The trainer phase a log phase is (``update`` with ``update_critic`` among the frames' functions
    ``funcs`` is ``critic_update``); a trainer phase is itself; None for setup, a checkpoint or an
    unknown name."""
    if phase in TRAINER_PHASES:
        return phase
    if phase == "update" and any("critic" in f and phase_of_name(f) == "update" for f in funcs):
        return "critic_update"
    return next((t for t, lp in TABLE if lp == phase and phase is not None), None)


def log_phase(phase: str | None) -> str | None:
    """The log phase a trainer phase is (``actor_update`` -> ``update``); a log phase is itself."""
    if phase in PHASES:
        return phase
    return next((lp for t, lp in TABLE if t == phase and phase is not None), None)


# function names (or the call a frame makes) -> phase; a name matches itself and its `_suffixed` forms
_NAMES = {
    "weight_sync": (
        "load_weights",
        "update_params",
        "update_weights",
        "sync_weights",
        "_sync_weights",
        "broadcast_to_vllm",
        "update_named_param",
        "_move_model_to_vllm",
        "refit",
        "wake_up",
        "weight_loader",
        "update_weights_from_tensor",
        "update_weights_from_ipc",
        "resume_memory_occupation",
    ),
    "checkpoint": (
        "save_checkpoint",
        "_save_checkpoint",
        "save_model",
        "save_pretrained",
        "_save",
        "save_state",
        "_save_optimizer_and_scheduler",
    ),
    "update": (
        "update_policy",
        "update_actor",
        "update_critic",
        "compute_loss",
        "backward",
        "clip_grad_norm_",
        "unscale_",
        "unscale_gradients",
        "forward_backward",
        "optimizer_step",
        "train_batch",
        "ppo_update",
    ),
    "reference": (
        "compute_ref_log_prob",
        "compute_ref_logprobs",
        "get_reference_policy_logprobs",
        "ref_forward",
        "reference_logprobs",  # our trainer (trainer/ppo.py)
    ),
    "logprob": (
        "compute_log_prob",
        "get_logprobs",
        "_get_per_token_logps",
        "compute_action_log_probs",
        "compute_old_log_prob",
        "make_experience",
        "actor_logprobs",  # our trainer (trainer/ppo.py)
    ),
    "values": ("compute_values", "critic_values"),
    "generate": (
        "generate_sequences",
        "generate",
        "_generate",
        "sample",
        "rollout",
        "respond",
        "generate_samples",
        # SGLang's model runner's batch forwards: the engine serving requests (not its scheduler loop, which
        # runs weight-update requests too)
        "forward_decode",
        "forward_extend",
    ),
    "init": (
        "init_model",
        "from_pretrained",
        "init_process_group",
        "init_workers",
        "initialize_cache",
        "_init_cache_engine",
        "init_device",
        "load_model",
        "setup",
    ),
}
_BY_NAME = {name: phase for phase, names in _NAMES.items() for name in names}
# a name that moves weights somewhere is the weight sync whatever the framework calls it
# (broadcast_weights_for_collective, _update_bucket_weights, send_params_to_engine, refit_policy_generation):
# one of these verbs and one of these nouns among its words (logsg branch)
_SYNC_VERBS = frozenset(
    {"update", "sync", "broadcast", "send", "push", "refit", "receive", "recv", "transfer"}
)
_SYNC_NOUNS = frozenset({"weight", "weights", "param", "params", "parameters", "tensor", "tensors", "bucket"})
_ROLE_PREFIX = re.compile(r"^(actor_rollout_ref_|actor_rollout_|actor_|critic_|ref_|rollout_)")


def phase_of_name(name: str | None) -> str | None:
    """The phase a function or method name belongs to (``self.actor.compute_log_prob`` -> logprob)."""
    if not name:
        return None
    name = name.rsplit(".", 1)[-1]
    # verl's fused worker prefixes its methods with the roles it serves: actor_rollout_generate_sequences
    role = _ROLE_PREFIX.match(name)
    if name not in _BY_NAME and role and role.end() < len(name):
        inner = phase_of_name(name[role.end() :])
        return "reference" if inner == "logprob" and role[1] == "ref_" else inner
    words = set(name.lower().split("_"))
    while name:
        if name in _BY_NAME:
            return _BY_NAME[name]
        if "_" not in name.strip("_"):
            break
        name = name.rsplit("_", 1)[0]  # generate_sequences_loop -> generate_sequences
    if words & _SYNC_VERBS and (words & _SYNC_NOUNS or "refit" in words):
        return "weight_sync"
    return None


def phase_of_frames(frames: Iterable[Frame]) -> tuple[str, str] | None:
    """(phase, the function that says so) from frames listed outermost first. The innermost named
    frame wins, except that a log-prob function called inside an update (TRL's ``compute_loss ->
    _get_per_token_logps``) is the update's forward with gradients, and verl's reference pass calls the
    actor's ``compute_log_prob``: the outer reference wins there."""
    found: tuple[str, str] | None = None
    for f in frames:
        for name in (f.func, f.call()):
            p = phase_of_name(name)
            if p is None or name is None:
                continue
            if found and found[0] == "update" and p in ("logprob", "reference"):
                continue
            if found and found[0] == "reference" and p == "logprob":
                continue
            found = (p, name.rsplit(".", 1)[-1])
    return found


_ACTIVITY = [
    ("logprob", re.compile(r"\bCompute log probs\b|\bmake_experience\b|\bcompute_log_prob\b", re.I)),
    (
        "checkpoint",
        re.compile(r"\bSaving (?:model )?checkpoint\b|\bSaving model\b|\bsave_checkpoint\b", re.I),
    ),
    ("init", re.compile(r"\bLoading checkpoint shards\b")),
    ("weight_sync", re.compile(r"seconds to wake up\b|\bupdate_weights\w*")),
    ("generate", re.compile(r"\bProcessed prompts\b|\bgenerate_sequences\b|^\[rollout \d+ / \d+\]")),
]


_ACTIVITY_HINTS = hints(
    "og prob", "make_experience", "compute_log_prob", "Saving", "save_checkpoint", "Loading checkpoint",
    "wake up",
    "update_weights", "Processed prompts", "generate_sequences", "[rollout",
)  # fmt: skip


def activity(text: str) -> str | None:
    """The phase a progress bar or status line announces (``Compute log probs: 76%|...``)."""
    if not _ACTIVITY_HINTS(text):
        return None
    for phase, pat in _ACTIVITY:
        if pat.search(text):
            return phase
    return None
