"""Which recorded problem explains which: the rule table behind ``verlaudit diagnose``'s root cause.

Every cause a diagnosis finds gets a *class* (registered with its kind in `verlaudit.kinds`, which
holds the class vocabulary: `class_of` a finding kind, `cause_class` a cause kind) and a *moment*
(`Moment`: step, phase, then order of recording). A rule ``(root class, symptom class)`` in `RULES`
says the first can produce the second; the root of a cause is the earliest cause (not later in step
and phase) that a rule lets explain it, followed back as far as rules go: the float ids a collator
returned explain the dtype error of the embedding that received them, a reward that returned NaN
explains the NaN loss, the corrupted weights of a reward model explain that NaN reward. `chains`
orders a diagnosis as root first, then what it explains ("root -> consequence"), then the
independent causes. Pure: it reads causes, not runs.

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
_PLUGIN_NAN = "the NaN/Inf the plug-in's op produced is the reward, then the advantages and the loss"
_OUTPUT = "a module that returns another dtype hands it to the next module"
_SETUP_CAST = "the setup cast the model: what follows computes and updates in the dtype it chose"
_SETUP_VOCAB = "the setup resized the embeddings: ids past the tokenizer's and the other roles' rows"
_SETUP_MODULE = "the setup put its own module in the model: its dtype and output are the module's"
_SETUP_HOOK = "the setup's forward hook changes the module's output before anything sees it"
_CHANGED_MODULE_SYMPTOMS = (
    "module_output_dtype",
    "module_input_dtype",
    "dtype_error",
    "compute_dtype",
    "island_dtype",
    "precision_excess",
    "nonfinite",
    "overflow",
)
"""What a module the setup replaced, or hooked, explains in its own role."""
_OVERRIDE_SCALE = "without the preset's dynamic loss scaling fp16 gradients underflow or overflow unchecked"
_OVERRIDE_STORE = (
    "weights stored below fp32 lose their updates, or fp16 AdamW state overflows (eps 1e-8 is 0)"
)
_OVERRIDE_COMPUTE = "a role computing below the preset's dtype rounds what the other roles compare it with"

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
    ("reward_integer", "no_signal"): Rule(
        "scores truncated to whole numbers are all one value: no advantage"
    ),
    ("reward_model_dtype", "dtype_error"): Rule(
        "the reward model's weights meet activations of another dtype"
    ),
    ("reward_model_dtype", "module_input_dtype"): Rule(_CAST, same_role=True),
    ("reward_model_dtype", "compute_dtype"): Rule(_CAST, same_role=True),
    # inside the plug-ins: the op or the dtype in the user's code that made the reward or the batch
    ("plugin_nonfinite", "reward_nonfinite"): Rule(_PLUGIN_NAN),
    ("plugin_nonfinite", "nonfinite"): Rule(_PLUGIN_NAN),
    ("plugin_nonfinite", "overflow"): Rule("a NaN/Inf the plug-in made makes the gradients non-finite"),
    ("plugin_precision", "reward_nonfinite"): Rule("fp16/bf16 arithmetic overflows where fp32 does not"),
    ("plugin_precision", "no_signal"): Rule(
        "scores rounded to a low-precision spacing become ties: equal rewards, no advantage"
    ),
    ("plugin_precision", "reward_dtype"): Rule("a reward computed in fp16/bf16 is returned in that dtype"),
    ("plugin_precision", "ids_float"): Rule("float math on ids in the collator leaves them floating"),
    ("reward_model_dtype", "plugin_precision"): Rule("a reward model stored in fp16/bf16 scores in it"),
    ("param_dtype", "plugin_precision"): Rule(
        "a reward model cast to fp16/bf16 scores in it", same_role=True
    ),
    ("plugin_precision", "ids_range"): Rule("ids rounded in a float dtype can land outside the vocabulary"),
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
    ("param_dtype", "update_underflow"): Rule(
        "an update smaller than the stored weight's rounding step leaves it unchanged", same_role=True
    ),
    ("module_output_dtype", "dtype_error"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "module_input_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "compute_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "island_dtype"): Rule(_OUTPUT, same_role=True),
    ("module_output_dtype", "precision_excess"): Rule(
        "a cast below the module's dtype rounds its output more than that dtype does", same_role=True
    ),
    ("compute_dtype", "island_dtype"): Rule(
        "an autocast that moves a role's matmuls to bf16/fp16 hands the islands its low-precision outputs",
        same_role=True,
    ),
    ("module_input_dtype", "dtype_error"): Rule("the op receives operands of two dtypes", same_role=True),
    ("weights_nonfinite", "reference"): Rule(
        "weights changed on the actor after the reference was copied from it"
    ),
    ("weights_outlier", "reference"): Rule(
        "weights changed on the actor after the reference was copied from it"
    ),
    ("param_dtype", "weights_nonfinite"): Rule(
        "weights stored in fp16 without fp32 master copies take the optimizer's update in fp16: it "
        "overflows, or AdamW's eps rounds to 0 and divides by 0",
        same_role=True,
    ),
    ("tied_weights", "reference"): Rule(
        "an untied output head is a parameter the tied reference does not have"
    ),
    ("vocab", "exception"): Rule("sampled ids past a model's rows index outside its embedding table"),
    # what the user's model.setup changed (`verlaudit.audit.setup_changes`): the change, then what it made
    **{
        ("setup_dtype", s): Rule(_SETUP_CAST, same_role=True)
        for s in (
            "param_dtype",
            "buffer_dtype",
            "grad_dtype",
            "dtype_error",
            "module_input_dtype",
            "compute_dtype",
            "island_dtype",
            "update_underflow",
            "weights_nonfinite",
            "nonfinite",
            "overflow",
            "grad_underflow",
            "reward_dtype",
            "plugin_precision",
        )
    },
    **{("setup_vocab", s): Rule(_SETUP_VOCAB) for s in ("vocab", "ids_range", "reference", "exception")},
    ("setup_vocab", "tied_weights"): Rule(_SETUP_VOCAB, same_role=True),
    ("setup_ties", "tied_weights"): Rule("the setup gave the output layer its own tensor", same_role=True),
    ("setup_ties", "reference"): Rule(
        "an untied output head is a parameter the tied reference does not have"
    ),
    **{
        ("setup_modules", s): Rule(_SETUP_MODULE, same_role=True)
        for s in ("param_dtype", *_CHANGED_MODULE_SYMPTOMS)
    },
    **{
        ("setup_hooks", s): Rule(_SETUP_HOOK, same_role=True)
        for s in ("user_hook", *_CHANGED_MODULE_SYMPTOMS)
    },
    ("setup_mode", "dropout"): Rule("the setup left dropout on in training mode", same_role=True),
    # setup24: what a setup (or a checkpoint directory) left that its metadata does not show
    **{
        ("setup_graph", s): Rule(
            "a module that runs its forward with gradients off hands the loss no graph to the weights below it",
            same_role=True,
        )
        for s in ("exception", "update_underflow", "no_signal")
    },
    **{
        ("setup_roles", s): Rule(
            "the setup changed the actor after the reference was copied from it: they differ from step 0"
        )
        for s in ("reference", "kl_penalty", "mismatch")
    },
    **{
        ("setup_load", s): Rule("a state dict that matched nothing leaves the model at its random init")
        for s in ("reference", "no_signal", "kl_penalty")
    },
    **{
        ("newly_initialised", s): Rule(
            "a reward model's randomly initialised score head scores random features of the response"
        )
        for s in ("no_signal", "reward_dtype", "reward_nonfinite")
    },
    # a role's precision set away from the preset's contract (precision.overrides)
    **{
        ("override_scaling", s): Rule(_OVERRIDE_SCALE, same_role=True)
        for s in ("grad_underflow", "overflow", "nonfinite")
    },
    **{
        ("override_storage", s): Rule(_OVERRIDE_STORE, same_role=True)
        for s in ("weights_nonfinite", "update_underflow", "nonfinite", "overflow", "grad_underflow")
    },
    **{
        ("override_compute", s): Rule(_OVERRIDE_COMPUTE, same_role=True)
        for s in (
            "reference",
            "island_dtype",
            "compute_dtype",
            "precision_excess",
            "grad_underflow",
            "overflow",
            "nonfinite",
            "plugin_precision",
            "reward_dtype",
        )
    },
    # training dynamics
    ("learning_rate", "overflow"): Rule(
        "weights grown by too large updates make activations and gradients beyond fp16's range",
        same_role=True,
    ),
    ("learning_rate", "nonfinite"): Rule("updates too large for the weights drive the loss to Inf/NaN"),
    # dyn24: a sampling setting that makes a group's responses identical makes their rewards identical
    ("sampling", "no_signal"): Rule("identical responses get identical rewards: the group advantages are 0"),
    # the policy the trainer recomputes is not the one the rollout sampled
    ("dropout", "mismatch"): Rule(
        "dropout in the trainer's forward (not in the rollout's) changes every recomputed log-prob"
    ),
    ("rollout_engine", "mismatch"): Rule(
        "the engine samples from another distribution (temperature, top-k / top-p, log-probs mode) than the "
        "trainer recomputes"
    ),
    # plug24: the user's own loop (`verlaudit.integrations.loop_checks`)
    ("loop_scaling", "exception"): Rule(
        "a GradScaler used out of order (no scale before the backward) fails its own checks at step"
    ),
    **{
        ("loop_scaling", s): Rule("fp16 gradients outside the loss scaler underflow, overflow or go NaN")
        for s in ("overflow", "nonfinite", "update_underflow")
    },
    **{
        ("autocast_device", s): Rule("an autocast that does nothing leaves the forward in the weights' dtype")
        for s in ("compute_dtype", "island_dtype", "mismatch")
    },
    **{
        ("round_trip", s): Rule("weights rounded to bf16/fp16 each step lose the updates below its spacing")
        for s in ("update_underflow", "mismatch", "precision_excess", "no_signal")
    },
    # inv24: the data's and the reward's invariants (`verlaudit.audit.invariants_data`, `invariants_reward`)
    ("reward_constant", "no_signal"): Rule("one reward for every response is one reward within every group"),
    ("reward_integer", "reward_constant"): Rule("scores truncated to whole numbers can all be one value"),
    ("plugin_precision", "reward_constant"): Rule(
        "scores rounded to a low-precision spacing can all round to one value"
    ),
    ("reward_position", "reward_constant"): Rule(
        "a score read at a position that is padding in every row is the pad token's, the same for all"
    ),
    ("reward_position", "no_signal"): Rule(
        "a score read at a padded position is the same for every response"
    ),
    # loop24: an own loop's cadence and graph (`verlaudit.integrations.loop_protocol`)
    ("loop_cadence", "update_underflow"): Rule(
        "a schedule run several times per optimizer step reaches a learning rate of 0: every update is lost"
    ),
    ("loop_graph", "exception"): Rule("backward() on a loss with no autograd graph raises at that step"),
    ("loop_optimizer", "update_underflow"): Rule(
        "weights the optimizer does not hold keep their gradients and never change"
    ),
    # model24: the tokenizer, the checkpoint and a setup's forwards against the task's text (model_checks)
    **{
        ("tokenizer_vocab", s): Rule(
            "the model reads other ids than it was trained on: its answers are wrong"
        )
        for s in ("no_signal", "reward_constant", "reference", "mismatch")
    },
    **{
        ("tokenizer_decode", s): Rule(
            "the reward reads decoded text that differs from what the model produced"
        )
        for s in ("no_signal", "reward_constant")
    },
    **{
        ("chat_template", s): Rule("a template without the content makes every prompt the same frame")
        for s in ("no_signal", "reward_constant")
    },
    **{
        ("weights_untrained", s): Rule("a policy that does not know the task scores the same low reward")
        for s in ("no_signal", "reward_constant", "reference")
    },
    **{
        ("hook_output", s): Rule("a hooked output is not the model's: its log-probs differ from step 0")
        for s in ("reference", "mismatch", "no_signal")
    },
    **{
        ("mask_ignored", s): Rule(
            "a forward that attends to padding computes other log-probs for the same tokens"
        )
        for s in ("reference", "mismatch", "no_signal", "reward_constant")
    },
    **{
        ("setup_remap", s): Rule("a checkpoint loaded into the wrong parameters is not the trained policy")
        for s in ("no_signal", "reward_constant", "reference")
    },
    **{
        ("setup_zero_grad", s): Rule(
            "trainable tensors with zero gradient never move the policy", same_role=True
        )
        for s in ("no_signal", "update_underflow")
    },
    ("setup_zero_grad", "reference"): Rule(
        "the setup that added the zero-initialised tensors added parameters the reference does not have"
    ),
    # data24: the examples' invariants and the reward's probes (`invariants_examples`, `probes_*`)
    ("completion_prompt", "identical_pairs"): Rule(
        "completions that repeat the prompt share it: cut to the response length, both sides are its copy"
    ),
    ("plugin_numpy_bool", "no_signal"): Rule("a sum of numpy bools takes two values: a group's scores tie"),
    ("plugin_numpy_bool", "reward_constant"): Rule(
        "a sum of numpy bools takes two values: a batch's scores tie"
    ),
    ("response_length", "no_signal"): Rule("responses cut before the answer can be complete score alike"),
    # numerics
    ("overflow", "nonfinite"): Rule("an fp16 overflow is an Inf, and Inf - Inf is NaN"),
    # foreign logs (`verlaudit.analysis.logs.classify`): the classes a log can tell
    (FAILURE, CASCADE_CLASS): Rule(
        "a rank that failed first makes the others time out; a dead worker makes its callers fail"
    ),
    # setupg: what a setup changed in what a model computes (`verlaudit.audit.setup_effect`)
    **{
        ("setup_interface", s): Rule("the module the setup returned lacks the members the trainer calls")
        for s in ("exception", "reference", "vocab", "tied_weights", "setup_roles")
    },
    **{
        ("setup_settings", s): Rule("a module setting the setup changed makes the model compute otherwise")
        for s in ("reference", "mismatch", "hook_output", "weights_untrained", "precision_excess")
    },
    **{
        ("setup_adapter", s): Rule("adapters that do not start at zero make the actor another model at init")
        for s in ("reference", "mismatch", "kl_penalty")
    },
    **{
        ("setup_collapse", s): Rule("outputs saturated by the setup are one value for every input")
        for s in ("reward_constant", "no_signal", "user_hook", "setup_hooks")
    },
    **{
        ("setup_shared", s): Rule("parameters shared by two roles are stepped by both roles' updates")
        for s in ("reference", "mismatch", "weights_outlier", "learning_rate", "exception")
    },
    # loopg: an own loop's update checked against its loss (`verlaudit.integrations.loop_update`, `loop_tokens`)
    ("loop_optimizer", "loop_cadence"): Rule(
        "gradients of parameters no optimizer holds are never cleared by its zero_grad: they pile up"
    ),
    **{
        (root, "loop_objective"): Rule(
            "a loss that reads other tokens than the response's next ones moves the log-probs it does not measure"
        )
        for root in ("loop_alignment", "loop_loss_tokens")
    },
    ("loop_order", "overflow"): Rule("a clip after the step never bounds the update that overflows"),
}
"""(root class, symptom class) -> why the root produces the symptom. One rule per line, each tested
in tests/test_rules.py."""


# ---------------------------------------------------------------- cfg24: causal order by tier
# Beside the pairs above, one general rule: a cause of an earlier tier (what the user's setup code did to
# a model, then a suite key, then the data and the plug-ins, then the training dynamics) explains a
# symptom of the training outcome when it acts on what the symptom is about (its *channel*): a key that
# scales the loss or the scaler explains skipped steps and overflows; a tokenizer or data problem that
# takes the information from the prompts or the responses explains rewards that do not vary. The pairs
# stay for the relations between causes and for the same-role constraints; the tiers order a root that
# no pair names above the symptom it produced, instead of the symptom coming first.

TIERS = ("setup", "config", "data", "dynamics", "symptom")
"""setup > config > data/plug-in > dynamics > symptom: a cause of an earlier tier can explain a later one."""

GRADIENT_SCALE, REWARD_SIGNAL, UPDATE = "gradient_scale", "reward_signal", "update"
"""Channels: the size of the loss and its gradients (overflow, underflow, NaN); the reward's information
about the response (no variance within groups, one reward for all); whether the trained weights move."""

TIER_CHANNELS: dict[str, tuple[str, frozenset[str]]] = {
    # setup (model.setup and what a checkpoint directory left)
    "setup_dtype": ("setup", frozenset({GRADIENT_SCALE, UPDATE})),
    "setup_trainable": ("setup", frozenset({UPDATE})),
    "setup_graph": ("setup", frozenset({UPDATE})),
    "setup_load": ("setup", frozenset({REWARD_SIGNAL})),
    "newly_initialised": ("setup", frozenset({REWARD_SIGNAL})),
    # suite keys
    "config_off": ("config", frozenset({UPDATE})),
    "config_saturation": ("config", frozenset({GRADIENT_SCALE})),
    "config_truncation": ("config", frozenset({UPDATE})),
    "config_scaler": ("config", frozenset({GRADIENT_SCALE})),
    "config_loss_scale": ("config", frozenset({GRADIENT_SCALE})),
    "override_scaling": ("config", frozenset({GRADIENT_SCALE})),
    "override_storage": ("config", frozenset({GRADIENT_SCALE, UPDATE})),
    "override_compute": ("config", frozenset({GRADIENT_SCALE, REWARD_SIGNAL})),
    "sampling": ("config", frozenset({REWARD_SIGNAL})),
    "group_size": ("config", frozenset({REWARD_SIGNAL})),
    "label_smoothing": ("config", frozenset({UPDATE})),
    "weight_decay": ("config", frozenset({UPDATE})),
    # data, tokenizer and plug-ins
    "tokenizer_ids": ("data", frozenset({REWARD_SIGNAL})),
    "vocab": ("data", frozenset({REWARD_SIGNAL})),
    "truncation": ("data", frozenset({REWARD_SIGNAL})),
    "identical_pairs": ("data", frozenset({REWARD_SIGNAL, UPDATE})),
    "empty_response": ("data", frozenset({REWARD_SIGNAL})),
    "prompt_eos": ("data", frozenset({REWARD_SIGNAL})),
    "response_eos": ("data", frozenset({REWARD_SIGNAL})),
    "row_order": ("data", frozenset({REWARD_SIGNAL})),
    "mask_padding": ("data", frozenset({REWARD_SIGNAL})),
    "padding": ("data", frozenset({REWARD_SIGNAL})),
    "reward_position": ("data", frozenset({REWARD_SIGNAL})),
    "reward_inverted": ("data", frozenset({REWARD_SIGNAL})),
    "reward_integer": ("data", frozenset({REWARD_SIGNAL})),
    "plugin_precision": ("data", frozenset({REWARD_SIGNAL})),
    "reward_model_dtype": ("data", frozenset({REWARD_SIGNAL})),
    # training dynamics
    "learning_rate": ("dynamics", frozenset({GRADIENT_SCALE})),
    # symptoms of the training outcome
    "overflow": ("symptom", frozenset({GRADIENT_SCALE})),
    "grad_underflow": ("symptom", frozenset({GRADIENT_SCALE})),
    "nonfinite": ("symptom", frozenset({GRADIENT_SCALE})),
    "update_underflow": ("symptom", frozenset({UPDATE})),
    "no_signal": ("symptom", frozenset({REWARD_SIGNAL})),
    "reward_constant": ("symptom", frozenset({REWARD_SIGNAL})),
    "reward_trend": ("symptom", frozenset({REWARD_SIGNAL})),
    # combo: keys wrong together (`verlaudit.audit.config_pairs`), resolution lost in fp16/bf16
    "config_combination": ("config", frozenset({GRADIENT_SCALE, UPDATE})),
    "advantage_norm": ("config", frozenset({REWARD_SIGNAL})),
    "precision_resolution": ("config", frozenset({REWARD_SIGNAL, UPDATE})),
    # setupg: what a setup changed in what a model computes
    "setup_settings": ("setup", frozenset({REWARD_SIGNAL, GRADIENT_SCALE})),
    "setup_adapter": ("setup", frozenset({REWARD_SIGNAL})),
    "setup_collapse": ("setup", frozenset({REWARD_SIGNAL})),
    "setup_shared": ("setup", frozenset({REWARD_SIGNAL, GRADIENT_SCALE, UPDATE})),
    "special_doubled": ("data", frozenset({REWARD_SIGNAL})),
    # loopg: an own loop's code is the user's, like a plug-in: what it gets wrong explains the outcome
    "loop_optimizer": ("data", frozenset({UPDATE})),
    "loop_order": ("data", frozenset({UPDATE, GRADIENT_SCALE})),
    "loop_alignment": ("data", frozenset({UPDATE, REWARD_SIGNAL})),
    "loop_loss_tokens": ("data", frozenset({UPDATE, REWARD_SIGNAL})),
    # rfprobe: the reward function's contract (`verlaudit.audit.probes_fork`, `probes_answer`)
    "reward_batch": ("data", frozenset({REWARD_SIGNAL})),
    "reward_stateful": ("data", frozenset({REWARD_SIGNAL})),
    "reward_mutates": ("data", frozenset({REWARD_SIGNAL})),
    "reward_unscored": ("data", frozenset({REWARD_SIGNAL})),
    "answer_form": ("data", frozenset({REWARD_SIGNAL})),
    # rank12: a reward that scores near misses as the answer
    "reward_lenient": ("data", frozenset({REWARD_SIGNAL})),
}
"""class -> (tier, channels). A class not listed takes part only through the pairs in `RULES`."""

# dyn12: a legal key whose measured effect on the update is total, null or backwards is a suite key's
# doing: it explains the outcome's symptoms on the channel it acts on (`verlaudit.audit.update_effect`)
TIER_CHANNELS.update(
    {
        "grad_clip": ("config", frozenset({UPDATE, GRADIENT_SCALE})),
        "value_clip": ("config", frozenset({UPDATE, REWARD_SIGNAL})),
        "trust_region": ("config", frozenset({UPDATE, REWARD_SIGNAL})),
        "preference_direction": ("config", frozenset({UPDATE})),
        "update_null": ("config", frozenset({UPDATE})),
        # dyn13: a beta that keeps a preference loss at its zero-margin value; hooks that rewrite the gradient
        "preference_flat": ("config", frozenset({UPDATE})),
        "setup_grad_hooks": ("setup", frozenset({UPDATE, GRADIENT_SCALE})),
    }
)

# data12: what the model is shown or scored against is not what the dataset says (`verlaudit.audit.data_contract`):
# data-tier roots of the reward's signal (the tier rule puts them above no-signal and a constant reward)
TIER_CHANNELS.update(
    {
        cls: ("data", frozenset({REWARD_SIGNAL}))
        for cls in (
            "prompt_rewritten",
            "special_content",
            "bos_missing",
            "conflicting_labels",
            "answer_notation",
            "answer_unreachable",
            # data13 (`verlaudit.audit.data_information`): the data says less than it looks
            "constant_targets",
            "few_prompts",
            "prompt_form",
        )
    }
)
TIER_CHANNELS.update(
    {cls: ("data", frozenset({REWARD_SIGNAL, UPDATE})) for cls in ("pairs_format_only", "pair_prompt")}
)

# rank12: what a model computes. A setup that changed the model (its modules, hooks, weights, settings, what it
# loaded) makes it compute otherwise from step 0: against the reference it was copied from, the rollout engine
# that runs the same weights, its fp32 shadow, and so the KL term. Those are the setup's symptoms, whatever new
# setup kind names the change: a setup-tier class on this channel explains them by the tier rule.
MODEL = "model"
"""Channel: what the model computes (its log-probs against the reference, the rollout's, an fp32 shadow)."""
for _cls in (
    "setup_dtype", "setup_graph", "setup_load", "newly_initialised", "setup_settings", "setup_adapter",
    "setup_collapse", "setup_shared", "setup_modules", "setup_hooks", "hook_output", "setup_remap", "setup_roles",
    "mask_ignored", "setup_mode",
):  # fmt: skip
    _tier, _ch = TIER_CHANNELS.get(_cls, ("setup", frozenset()))
    TIER_CHANNELS[_cls] = (_tier, _ch | {MODEL})
for _cls in ("reference", "mismatch", "precision_excess", "kl_penalty"):
    TIER_CHANNELS.setdefault(_cls, ("symptom", frozenset({MODEL})))
RULES.update(
    {
        ("reference", "kl_penalty"): Rule(
            "an actor that is not the reference from step 0 pays a KL that no update made: the penalty dominates"
        ),
    }
)


def by_tier(root: str, symptom: str) -> Rule | None:
    """The general rule: ``root`` of an earlier tier than the ``symptom`` (a symptom-tier class) that
    shares one of its channels explains it."""
    r, s = TIER_CHANNELS.get(root), TIER_CHANNELS.get(symptom)
    if r is None or s is None or s[0] != "symptom" or TIERS.index(r[0]) >= TIERS.index(s[0]):
        return None
    shared = sorted(r[1] & s[1])
    if not shared:
        return None
    return Rule(f"a {r[0]} cause that acts on the {shared[0].replace('_', ' ')} produces this {symptom}")


def explains(root: str, symptom: str) -> Rule | None:
    """The rule by which a ``root`` class produces a ``symptom`` class (a pair of `RULES`, else the
    tier rule `by_tier`), or None."""
    return RULES.get((root, symptom)) or by_tier(root, symptom)


# ---------------------------------------------------------------- chains over causes


@dataclasses.dataclass(frozen=True)
class Event:
    """What the chain builder needs of one cause: its class, moment and role."""

    cls: str
    moment: Moment
    role: str | None = None
    weight: int = 0
    """Its own severity (error 2, warning 1, info 0): of two roots seen in one step and phase, the one that
    says more (a warning of what a setup's hook changes, over the info that the setup registered hooks)."""


STANDING_TIERS = ("setup", "config", "data")
"""Tiers whose causes are standing properties of the run (what the setup did, a key's value, the data, the
user's reward or loop code): a probe that saw one at step 1 saw what was already so at step 0."""
STANDING_WINDOW = 1
"""The last step of the audit's first look (setup and the first steps, audited in full and probed): a standing
cause first seen there was there from the start; one first seen later may have come from what went wrong."""


def standing(root: str, symptom: str) -> bool:
    """Whether a ``root`` class of a standing tier explains a ``symptom``-tier class although it was recorded
    later within the audit's first look: the moment a check recorded it is when it looked, not when it began."""
    r, s = TIER_CHANNELS.get(root), TIER_CHANNELS.get(symptom)
    return r is not None and s is not None and r[0] in STANDING_TIERS and s[0] == "symptom"


def _can_explain(root: Event, symptom: Event) -> Rule | None:
    rule = explains(root.cls, symptom.cls)
    early = root.moment.step <= STANDING_WINDOW and standing(root.cls, symptom.cls)
    if rule is None or not (root.moment.not_after(symptom.moment) or early):
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
    the earliest event that a rule lets explain the current one (`_earliest`: of one step and phase the more
    severe, then the one recorded first; ties: the one listed first)."""
    chain = [i]
    while True:
        cur = events[chain[0]]
        options = [j for j, e in enumerate(events) if j not in chain and _can_explain(e, cur)]
        if not options:
            return chain
        chain.insert(0, min(options, key=lambda j: _earliest(events[j], j)))


def _earliest(e: Event, j: int) -> tuple[float, int, int, float, int]:
    """The order of candidate roots: step and phase first, then the more severe, then the order of recording."""
    return (e.moment.step, e.moment.phase, -e.weight, e.moment.seq, j)


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


# ---------------------------------------------------------------- setup12: a setup's change is the root of what follows
# from it (`verlaudit.audit.setup_values`); a compute override that makes the actor differ from the rollout engine
_SETUP_WEIGHTS = (
    "weights the setup re-initialised or rescaled are not the checkpoint's: every comparison with it moves"
)
_SETUP_HOOK_EFFECT = "the setup's hook changes what the module computes (noise, a scale, one mode only)"
_SETUP_MODES = "a forward the setup made random or mode-dependent differs between the rollout and the trainer"
_SETUP12_SYMPTOMS = (
    "reference",
    "weights_untrained",
    "mismatch",
    "kl_penalty",
    "precision_excess",
    "hook_output",
    "user_hook",
    "setup_hooks",
    "setup_roles",
    "no_signal",
    "reward_constant",
    "rollout_dtype",
)
"""What a setup's rewritten weights, hooks or forward explain (in any role: a setup of the actor moves the KL to
the reference, the rollout's log-probs, the reward model's scores)."""
_SETUP12_NUMERIC = ("overflow", "nonfinite", "grad_underflow")
"""Numeric blow-ups a setup's scale produces: their own finding heads the chain, naming the setup
(`verlaudit.analysis.diagnose.setup_cause.absorb`)."""
RULES.update(
    {
        **{("setup_weights", s): Rule(_SETUP_WEIGHTS) for s in (*_SETUP12_SYMPTOMS, *_SETUP12_NUMERIC)},
        **{
            ("setup_hook_effect", s): Rule(_SETUP_HOOK_EFFECT)
            for s in (*_SETUP12_SYMPTOMS, *_SETUP12_NUMERIC)
        },
        **{("setup_modes", s): Rule(_SETUP_MODES) for s in _SETUP12_SYMPTOMS},
        **{
            ("setup_modules", s): Rule("modules the setup replaced compute otherwise than the checkpoint's")
            for s in ("weights_untrained", "mismatch")
        },
        **{
            ("override_not_realised", s): Rule(
                "the role runs at another precision than its key asks for: what it computes (its scores' spread, "
                "its log-probs) is not what the configured run would compute"
            )
            for s in (
                "kl_penalty",
                "no_signal",
                "reward_constant",
                "reward_model_dtype",
                "mismatch",
                "rollout_dtype",
                "precision_excess",
                "reference",
                "param_dtype",
            )
        },
        **{
            ("override_rollout_apart", s): Rule(
                "the actor computing below the rollout's dtype recomputes the sampled tokens' log-probs with "
                "another rounding than the engine sampled them with"
            )
            for s in ("rollout_dtype", "mismatch")
        },
        ("setup_graph", "reference"): Rule(
            "the setup that wrapped the actor's layers (and cut their graph) renamed what the reference holds"
        ),
    }
)
TIER_CHANNELS.update(
    {
        "setup_weights": ("setup", frozenset({REWARD_SIGNAL, UPDATE})),
        "setup_hook_effect": ("setup", frozenset({REWARD_SIGNAL})),
        "setup_modes": ("setup", frozenset({REWARD_SIGNAL})),
        "override_not_realised": ("config", frozenset({REWARD_SIGNAL})),
        "update_term_lost": ("config", frozenset({UPDATE})),
        "grad_accumulation": ("config", frozenset({GRADIENT_SCALE, UPDATE})),
        "override_rollout_apart": ("config", frozenset({REWARD_SIGNAL})),
    }
)
