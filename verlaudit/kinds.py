"""Every finding kind, named once: what it means and which root-cause class it belongs to.

The audit writes a finding's kind with one of the constants below (``K.REWARD_NONFINITE``, never the
string), and ``verlaudit diagnose`` reads a finding's class from here (`class_of`) instead of guessing
it from the values the finding observed. A kind is one problem: a reward's dtype, device, shape and
non-finite values are four kinds, so that a reward on the wrong device is not ordered as a dtype
problem. The classes (`ROOT_CLASSES`, `SYMPTOM_CLASSES`) are the vocabulary of the rule table in
`verlaudit.analysis.diagnose.rules`, which says which class can produce which. The run analyses' own
cause kinds (`CAUSES`: ``dtype_error``, ``oom``, ``killed`` ...) are registered here in the same way.

Run directories written before the kinds were split carry the old catch-alls (``boundary/collator``,
``boundary/reward``, ...); `verlaudit.rundir` maps them to these kinds when it reads findings.jsonl.
Its machinery (`Kind`, the tables) is `verlaudit.kind_registry`; the own loop's kinds are
`verlaudit.kinds_loop`, the token contract's `verlaudit.kinds_tokens` and the measured-effect kinds `verlaudit.kinds_effects` (split out for length, re-exported here). This module imports only those and its
class table (`verlaudit.kind_classes`) from verlaudit. `pytest tests/test_kinds.py` fails on a kind the audit
writes that is not registered here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from verlaudit.kind_classes import CLASSES, ROOT_CLASSES, SYMPTOM_CLASSES  # noqa: F401  (re-exported: the classes live beside)
from verlaudit.kind_registry import _CAUSES, _FINDINGS, Kind, _c, _f  # noqa: F401  (Kind is re-exported)
from verlaudit.kinds_effects import (  # noqa: F401  (re-exported: the measured-effect kinds live beside)
    ANSWER_NOTATION,
    ANSWER_UNREACHABLE,
    BOS_MISSING,
    CHOSEN_PUSHED_DOWN,
    COMPLETION_REWRITTEN,
    COMPUTE_BELOW_CONTRACT,
    CONFLICTING_ANSWERS,
    CONFLICTING_PREFERENCES,
    CONSTANT_TARGETS,
    DECAY_ROUNDED_AWAY,
    FEW_PROMPTS,
    GRAD_ACCUMULATION_ROUNDING,
    GRAD_CLIP_TOTAL,
    NO_TRUST_REGION,
    NULL_UPDATE,
    PAIR_PROMPT_MISMATCH,
    PAIRS_FORMAT_ONLY,
    PRECISION_NOT_REALISED,
    PROMPT_FORM,
    PROMPT_REWRITTEN,
    REWARD_ANSWER_LENIENT,
    REWARD_VALUE_GRID,
    SETUP_HOOK_EFFECT,
    SETUP_NOT_DETERMINISTIC,
    SETUP_WEIGHTS,
    SPECIAL_TOKEN_CONTENT,
    VALUE_CLIP_TOTAL,
)
from verlaudit.kinds_loop import (  # noqa: F401  (re-exported: the own loop's kinds live beside)
    LOOP_AUTOCAST_INACTIVE,
    LOOP_CLIP_BEFORE_BACKWARD,
    LOOP_CLIP_SCALED,
    LOOP_COMPUTE_BELOW_CONTRACT,
    LOOP_FP16_NO_SCALER,
    LOOP_GRADS_AFTER_STEP,
    LOOP_GRADS_NOT_CLEARED,
    LOOP_LOGPROBS_LOW_PRECISION,
    LOOP_LOGPROBS_MISALIGNED,
    LOOP_LOSS_NO_GRAPH,
    LOOP_LOSS_OUTSIDE_RESPONSE,
    LOOP_LOSS_SKIPS_FIRST_TOKEN,
    LOOP_OPTIMIZER_PARAMS,
    LOOP_OPTIMIZER_STALE_PARAMS,
    LOOP_PARAMS_OUTSIDE_OPTIMIZER,
    LOOP_SCALER_BYPASSED,
    LOOP_SCALER_NOT_UPDATED,
    LOOP_SCHEDULER_CADENCE,
    LOOP_STEP_REPEATED,
    LOOP_STEP_WITHOUT_GRADS,
    LOOP_UNSCALE_TWICE,
    LOOP_UNSCALED_BACKWARD,
    LOOP_UPDATE_AGAINST_ADVANTAGE,
    LOOP_WEIGHT_ROUND_TRIP,
    LOOP_ZERO_GRAD_IN_ACCUMULATION,
    PLUGIN_INT_WRAP,
    PLUGIN_ROUND_TRIP,
)
from verlaudit.kinds_tokens import (  # noqa: F401  (re-exported: the token contract's kinds live beside)
    PAIR_EOS_CUT,
)
from verlaudit.kinds_update import (  # noqa: F401  (re-exported: the kinds of session 13's update checks)
    CONFIG_KL_LOSS_NO_GRADIENT,
    LOOP_LOSS_SCALED_TWICE,
    PREFERENCE_FLAT,
    SETUP_GRAD_HOOKS,
)

# ---------------------------------------------------------------- the collator's batch
COLLATOR_NOT_TENSOR = _f(
    "boundary/collator_not_tensor", "batch_shape", "a collator field of token ids or masks is not a tensor"
)
COLLATOR_FLOAT_IDS = _f(
    "boundary/collator_float_ids", "ids_float", "token ids or masks from the collator are floating point"
)
COLLATOR_ID_WIDTH = _f(
    "boundary/collator_id_width",
    "ids_dtype",
    "token ids from the collator are an integer type other than int64",
)
COLLATOR_ID_RANGE = _f(
    "boundary/collator_id_range", "ids_range", "token ids from the collator lie outside [0, vocabulary size)"
)
COLLATOR_SHAPE = _f(
    "boundary/collator_shape",
    "batch_shape",
    "collator tensors disagree on the batch size, or a mask's shape is not its ids'",
)
PADDING_SIDE = _f(
    "boundary/padding_side", "padding", "prompts are padded on the other side than the tokenizer's"
)
MASK_COVERS_PADDING = _f(
    "boundary/mask_covers_padding",
    "mask_padding",
    "the attention mask is 1 on pad tokens at the padded end: the model attends to padding",
)
IDENTICAL_PAIRS = _f(
    "boundary/identical_pairs",
    "identical_pairs",
    "DPO pairs whose chosen and rejected responses are the same tokens: no preference, no gradient",
)
EMPTY_RESPONSES = _f(
    "boundary/empty_responses",
    "empty_response",
    "a DPO side whose response is empty (only eos / pad) in many pairs: the dataset's text is missing",
)
PROMPT_TRUNCATION = _f(
    "boundary/prompt_truncation",
    "truncation",
    "prompts cut by a length limit (an error when most lost their bos or the answer's content, or merged)",
)

# ---------------------------------------------------------------- the reward
REWARD_DTYPE = _f(
    "boundary/reward_dtype",
    "reward_dtype",
    "a reward tensor or array in another dtype than fp32 (fp64, fp16, int)",
)
REWARD_DEVICE = _f(
    "boundary/reward_device",
    "reward_device",
    "a reward tensor on another device than training's: a copy per step",
)
REWARD_LIST = _f(
    "boundary/reward_list",
    "reward_shape",
    "a reward returned as a Python list, converted to fp32 on the host",
)
REWARD_NOT_NUMBERS = _f("boundary/reward_not_numbers", "reward_shape", "a reward list that holds non-numbers")
REWARD_SHAPE = _f(
    "boundary/reward_shape", "reward_shape", "a reward of another shape than one scalar per sequence"
)
REWARD_INTEGER = _f(
    "boundary/reward_integer",
    "reward_integer",
    "an integer reward tensor or array whose scores are all one value: fractions were truncated",
)
REWARD_NONFINITE = _f("boundary/reward_nonfinite", "reward_nonfinite", "rewards that are NaN or Inf")
REWARD_MODEL_DTYPE = _f(
    "boundary/reward_model", "reward_model_dtype", "a reward model's parameters are stored in another dtype"
)
# ---------------------------------------------------------------- inside the plug-ins (`verlaudit.audit.plugins`)
PLUGIN_NONFINITE_OP = _f(
    "plugin/nonfinite_op",
    "plugin_nonfinite",
    "the first op inside a reward or collator that made NaN/Inf from finite inputs",
)
PLUGIN_LOW_PRECISION = _f(
    "plugin/low_precision", "plugin_precision", "a reward function or collator ran floating ops in fp16/bf16"
)
PLUGIN_PRECISION_LOSS = _f(
    "plugin/precision_loss",
    "plugin_precision",
    "a reward's scores differ from the same call in fp32/fp64: ties, NaN/Inf or moved values",
)
PLUGIN_INT_PRECISION = _f(
    "plugin/int_precision",
    "plugin_precision",
    "integers (ids, counts) held in a float dtype beyond the largest integer it holds exactly",
)
PLUGIN_UNDERFLOW = _f(
    "plugin/underflow",
    "plugin_precision",
    "an fp16/bf16 op inside a reward or collator flushed values to 0 (or subnormals) that fp32 holds",
)
NO_SIGNAL = _f("reward/no_signal", "no_signal", "rewards identical within every group: no learning signal")

# ---------------------------------------------------------------- the rollout
ROLLOUT_DTYPE = _f(
    "boundary/rollout_dtype", "rollout_dtype", "the rollout samples in another dtype than the actor trains in"
)
ROLLOUT_ENGINE_DTYPE = _f(
    "boundary/rollout_engine_dtype",
    "rollout_engine",
    "the engine computes in another dtype than it was asked for",
)
ROLLOUT_KV_CACHE = _f(
    "boundary/rollout_kv_cache", "rollout_engine", "the engine caches keys and values below its compute dtype"
)
ROLLOUT_LOGPROBS = _f(
    "boundary/rollout_logprobs",
    "rollout_engine",
    "a log-softmax below fp32 on the engine's or the trainer's side",
)
ROLLOUT_SAMPLING = _f(
    "boundary/rollout_sampling",
    "rollout_engine",
    "the engine's sampling settings or log-probs mode differ from the trainer's recomputation",
)
ROLLOUT_TOKEN_RANGE = _f(
    "boundary/rollout_token_range", "ids_range", "sampled token ids outside the model's vocabulary"
)
ROLLOUT_SHAPE = _f(
    "boundary/rollout_shape", "batch_shape", "rollout response ids, mask and log-probs of different shapes"
)
VOCAB_MISMATCH = _f("boundary/vocab_mismatch", "vocab", "the model samples ids its tokenizer cannot decode")
WEIGHT_SYNC = _f(
    "rollout/weight_sync",
    "weight_sync",
    "the weight push left parameters unmatched, or the engine's log-probs disagree after it",
)
MISMATCH_BEYOND_DTYPE = _f(
    "mismatch/beyond_dtype",
    "mismatch",
    "rollout-vs-trainer token k3 above what the two dtypes' rounding explains",
)

# ---------------------------------------------------------------- dtypes of modules and tensors
INT_BECAME_FLOAT = _f(
    "dtype/int_became_float", "ids_float", "token ids or masks reached a model as floating point"
)
FLOAT_BECAME_INT = _f(
    "dtype/float_became_int",
    "module_input_dtype",
    "a linear or norm received an integer tensor as activations",
)
ISLAND_NOT_FLOAT = _f(
    "dtype/island_not_float",
    "island_dtype",
    "a log-prob, value or loss handed to the algorithm is not a float tensor",
)
ISLAND = _f(
    "dtype/island",
    "island_dtype",
    "log-probs, values, losses or norms below the fp32 the policy keeps them in",
)
MIXED_PARAMS = _f("dtype/mixed_params", "param_dtype", "one module holds parameters of several dtypes")
PARAM_STORAGE = _f(
    "dtype/param_storage", "param_dtype", "parameters stored in another dtype than the policy's"
)
BUFFER_PRECISION = _f(
    "dtype/buffer_precision", "buffer_dtype", "rotary buffers stored in a dtype that loses positions"
)
MODULE_INPUT = _f(
    "dtype/module_input", "module_input_dtype", "activations of another dtype enter a module outside autocast"
)
MODULE_OUTPUT = _f(
    "dtype/module_output",
    "module_output_dtype",
    "a module returns a lower precision than went in, outside autocast",
)
COMPUTE = _f("dtype/compute", "compute_dtype", "a linear computes in another dtype than the policy's")
CONTRACT_COMPUTE = _f(
    "contract/compute_dtype",
    "compute_dtype",
    "a role's measured matmuls ran in another dtype than its policy's",
)
GRAD = _f("dtype/grad", "grad_dtype", "gradients in another dtype than the policy's grad dtype")
USER_HOOK = _f("model/user_hook", "user_hook", "a module carries a forward hook from user code")
REFERENCE_NOT_ACTOR = _f(
    "model/reference_not_actor",
    "reference",
    "before any update the reference's weights differ from the actor's beyond dtype rounding",
)
DROPOUT_ACTIVE = _f(
    "model/dropout_active",
    "dropout",
    "a trainable role trains with dropout: its log-probs are not the policy the rollout sampled",
)
TOKENIZER_SPECIAL_IDS = _f(
    "model/tokenizer_special_ids",
    "tokenizer_ids",
    "the tokenizer's eos (or pad) id is not the one the model's config ends sequences with",
)
NONDETERMINISTIC_FORWARD = _f(
    "model/nondeterministic_forward",
    "dropout",
    "two forwards of the same tokens through a trained role or the reward model differ: a random forward",
)
TIED_WEIGHTS_BROKEN = _f(
    "model/tied_weights_broken",
    "tied_weights",
    "the config ties input and output embeddings but they are separate tensors after setup",
)

# ---------------------------------------------------------------- what model.setup changed (`verlaudit.audit.setup_changes`)
SETUP_PREFIX = "setup/"
"""The kinds below: what model.setup changed (facts that diagnose names as the culprit of what follows)."""
SETUP_DTYPE = _f("setup/dtype", "setup_dtype", "model.setup cast parameters to another dtype")
SETUP_VOCAB = _f("setup/vocab", "setup_vocab", "model.setup resized the input or output embeddings")
SETUP_TRAINABLE = _f(
    "setup/trainable", "setup_trainable", "model.setup changed which parameters of a model train"
)
SETUP_TIES = _f("setup/ties", "setup_ties", "model.setup untied the output embeddings from the input ones")
SETUP_MODULES = _f("setup/modules", "setup_modules", "model.setup replaced modules by others")
SETUP_HOOKS = _f("setup/hooks", "setup_hooks", "model.setup registered forward hooks")
SETUP_MODE = _f("setup/mode", "setup_mode", "model.setup changed training mode or dropout")
# setup24: `trainer.setup_probe`'s readings (`verlaudit.audit.setup_changes`)
SETUP_LOAD = _f(
    "setup/load_mismatch",
    "setup_load",
    "model.setup loaded a state dict whose keys did not match the model's: weights left at init",
)
SETUP_NO_GRAPH = _f(
    "setup/no_graph",
    "setup_graph",
    "after model.setup a trainable model's forward runs (partly) with gradients off",
)
SETUP_UNREGISTERED = _f(
    "setup/unregistered_params",
    "setup_unregistered",
    "tensors that require grad take part in the forward but are no parameters: never optimized",
)
SETUP_ROLES_DIFFER = _f(
    "setup/roles_differ",
    "setup_roles",
    "after model.setup the actor and the reference copied from it differ (buffers, config)",
)
NEWLY_INITIALISED = _f(
    "model/newly_initialised",
    "newly_initialised",
    "a checkpoint directory lacked weights of the model built from it: initialised at random",
)

# ---------------------------------------------------------------- numerics
NONFINITE_FORWARD = _f(
    "numerics/nonfinite_forward", "nonfinite", "the first module whose forward made NaN/Inf"
)
NONFINITE_BACKWARD = _f(
    "numerics/nonfinite_backward", "nonfinite", "the first module whose backward made NaN/Inf gradients"
)
NONFINITE_BOUNDARY = _f("numerics/nonfinite_boundary", "nonfinite", "log-probs or values that hold NaN/Inf")
NONFINITE_LOSS = _f("numerics/nonfinite_loss", "nonfinite", "a non-finite loss")
NONFINITE_GRADS = _f(
    "numerics/nonfinite_grads", "nonfinite", "non-finite gradient elements at the optimizer step"
)
SKIPPED_STEP = _f("numerics/skipped_step", "nonfinite", "an optimizer step skipped for non-finite gradients")
OVERFLOW = _f("numerics/overflow", "overflow", "an fp16 forward output overflowed to Inf from finite inputs")
HEADROOM = _f("numerics/headroom", "overflow", "fp16 activations or gradients close to fp16's largest value")
GRAD_UNDERFLOW = _f(
    "numerics/grad_underflow", "grad_underflow", "fp16 gradient elements below the smallest normal"
)
UPDATE_UNDERFLOW = _f(
    "numerics/update_underflow",
    "update_underflow",
    "weight updates lost to the rounding of the stored weights",
)
WEIGHT_NONFINITE = _f("numerics/weight_nonfinite", "weights_nonfinite", "NaN/Inf stored in the weights")
WEIGHT_GROWTH = _f(
    "dynamics/weight_growth",
    "learning_rate",
    "most of a trainable role's weight matrices grew several times since setup: the learning rate",
)
CLIP_SATURATED = _f(
    "dynamics/clip_saturated",
    "clip_range",
    "a token clip range far narrower than one update moves the policy: most tokens clipped",
)
STALE_UPDATES = _f(
    "dynamics/stale_updates",
    "stale_updates",
    "many optimizer steps on one rollout batch drive the policy off the sampling one: ratios clipped",
)
KL_DOMINATES = _f(
    "dynamics/kl_dominates",
    "kl_penalty",
    "the KL penalty or loss outweighs the task score or the advantages",
)
NO_GROUP_BASELINE = _f(
    "dynamics/no_group_baseline",
    "group_size",
    "a group-baseline estimator with one response per prompt: no comparison between responses",
)
# dyn24: configuration and dynamics as causes (verlaudit/audit/config_checks.py, dynamics.py)
LABEL_SMOOTHING = _f(
    "config/label_smoothing",
    "label_smoothing",
    "DPO label smoothing near 0.5: the preference gradient cancels",
)
DISCOUNT = _f(
    "config/discount", "discount", "a gamma or GAE lambda that cuts the outcome score from early tokens"
)
KL_CONTROLLER = _f(
    "dynamics/kl_controller",
    "kl_controller",
    "an adaptive KL controller stepping by half its coefficient or more: geometric growth or a sign flip",
)
WEIGHT_DECAY = _f("config/weight_decay", "weight_decay", "lr x weight_decay shrinks every weight each step")
ENTROPY_DOMINATES = _f(
    "dynamics/entropy_dominates", "entropy_bonus", "the entropy bonus outweighs the advantages per token"
)
SAMPLING_COLLAPSE = _f(
    "dynamics/sampling_collapse",
    "sampling",
    "a group's responses identical under a sampling setting that removes diversity (temperature, top_k)",
)
SAMPLING_NOISE = _f(
    "dynamics/sampling_noise",
    "sampling",
    "a sampling temperature so high that the responses are near-uniform noise",
)
REJECTION_SATURATED = _f(
    "dynamics/rejection_saturated",
    "rejection",
    "rollout rejection (rollout_rs) masks most tokens out of the policy gradient",
)
WEIGHT_OUTLIER = _f("numerics/weight_outlier", "weights_outlier", "a parameter far out of its siblings' RMS")
# ---------------------------------------------------------------- where precision is lost (audit level full)
FP16_UNDERFLOW = _f(
    "precision/fp16_underflow",
    "grad_underflow",
    "a module's fp16 gradients below the smallest normal at its scale",
)
ISLAND_OPS = _f("precision/island_ops", "island_dtype", "ops of an fp32 island ran on low-precision inputs")
SHADOW_EXCESS = _f(
    "precision/shadow_excess",
    "precision_excess",
    "a module's error against its fp32 shadow beyond its rounding",
)
SHADOW_SKIPPED = _f(
    "precision/shadow_skipped", "audit_gap", "the fp32 shadow skipped a module or did not run"
)

# ---------------------------------------------------------------- inv24: the data's invariants
ROWS_REORDERED = _f(
    "boundary/rows_reordered",
    "row_order",
    "the collated rows are the examples' prompts in another order: rewards read against other rows",
)
PROMPT_EOS = _f(
    "boundary/prompt_eos",
    "prompt_eos",
    "attended prompt tokens are the eos id (at a prompt's end or inside it)",
)
RESPONSE_EOS_MASKED = _f(
    "boundary/response_eos_masked",
    "response_eos",
    "the eos that ends each response is outside its response mask: stopping is never trained",
)
FROZEN_ROLE_SHARED = _f(
    "model/frozen_role_shared",
    "shared_role",
    "a reference or reward model that is the actor's (critic's) module or holds its parameter tensors",
)
REWARD_POSITION = _f(
    "reward/position_dependent",
    "reward_position",
    "the reward model scores the same tokens differently when only their padding moves",
)
REWARD_CONSTANT = _f(
    "reward/constant",
    "reward_constant",
    "every response of the batch got the same reward, step after step",
)
REWARD_INVERTED = _f(
    "reward/inverted",
    "reward_inverted",
    "the reward (or the preference pairs) ranks the task's correct answers below wrong ones",
)
# cfg24: numeric keys outside their sane range (verlaudit/audit/config_ranges.py), confirmed by the run's
# metrics in verlaudit/analysis/diagnose/config_cause.py
CONFIG_COEF_ZERO = _f(
    "config/coefficient_zero", "config_off", "a loss coefficient of 0 removes a trained component's gradient"
)
CONFIG_SATURATED = _f(
    "config/loss_saturated",
    "config_saturation",
    "a DPO beta so large that beta x margin saturates the sigmoid",
)
CONFIG_IS_TRUNCATION = _f(
    "config/is_threshold",
    "config_truncation",
    "a truncation threshold below 1 that truncates every IS weight",
)
CONFIG_SCALER = _f(
    "config/loss_scaler",
    "config_scaler",
    "a GradScaler growth interval or initial scale that keeps it overflowing",
)
CONFIG_LOSS_SCALE_FACTOR = _f(
    "config/loss_scale_factor", "config_loss_scale", "a loss divisor far from the response length"
)

# ---------------------------------------------------------------- model24: tokenizer, checkpoint and setup forwards
# (`verlaudit.audit.model_checks`, `verlaudit.audit.setup_changes`)
TOKENIZER_VOCAB = _f(
    "model/tokenizer_vocab",
    "tokenizer_vocab",
    "model.tokenizer gives tokens other ids than the tokenizer saved with model.path",
)
TOKENIZER_DECODE = _f(
    "model/tokenizer_round_trip",
    "tokenizer_decode",
    "decode(encode(text)) differs from the text for the task's prompts or answers",
)
CHAT_TEMPLATE_CONTENT = _f(
    "model/chat_template_content",
    "chat_template",
    "the chat template renders a message without its content",
)
WEIGHTS_UNTRAINED = _f(
    "model/checkpoint_untrained",
    "weights_untrained",
    "the loaded policy predicts the task's answers no better than their token frequencies",
)
SETUP_LOAD_REMAPPED = _f(
    "setup/load_remapped",
    "setup_remap",
    "model.setup loaded a checkpoint's tensors into parameters of other names (same shapes)",
)
SETUP_HOOK_OUTPUT = _f(
    "setup/hook_output",
    "hook_output",
    "a forward hook model.setup registered changes the model's output",
)
SETUP_MASK_IGNORED = _f(
    "setup/mask_ignored",
    "mask_ignored",
    "after model.setup the real tokens' outputs change with padding: the attention mask is not honoured",
)
PADDING_DEPENDENT = _f(
    "model/padding_dependent",
    "mask_ignored",
    "the real tokens' outputs change with padding: the attention mask is not honoured",
)
SETUP_ZERO_GRADIENT = _f(
    "setup/zero_gradient",
    "setup_zero_grad",
    "after model.setup no trainable tensor of a role gets a gradient (factors initialised to zero)",
)
SETUP_VALUE_OFFSET = _f(
    "setup/value_offset",
    "value_offset",
    "after model.setup the critic's values start far outside the task's reward range",
)

# ---------------------------------------------------------------- data24: examples' invariants, reward probes
REWARD_BATCH_DEPENDENT = _f(
    "reward/batch_dependent",
    "reward_batch",
    "the same rows scored in another batch composition get other rewards (normalised across the batch)",
)
REWARD_FOLLOWS_ROW = _f(
    "reward/follows_row",
    "reward_row_order",
    "the rewards rise (or fall) with the row index, step after step: sorted, not in the responses' order",
)
PROMPT_HAS_ANSWER = _f(
    "data/prompt_has_answer",
    "answer_leak",
    "the prompts the policy sees hold the examples' answers",
)
DUPLICATE_ROWS = _f(
    "data/duplicate_rows",
    "duplicate_rows",
    "most rows of a batch are one example (the same object or the same text)",
)
COMPLETION_REPEATS_PROMPT = _f(
    "data/completion_repeats_prompt",
    "completion_prompt",
    "chosen and rejected completions start with the prompt itself",
)
EMPTY_PROMPTS = _f("data/empty_prompts", "empty_prompt", "examples whose prompt text is empty or blank")
RESPONSE_SHORTER_THAN_ANSWER = _f(
    "data/response_shorter_than_answer",
    "response_length",
    "data.response_length is below the token count of most answers plus eos",
)
ANSWERS_LOW_PRECISION = _f(
    "data/answers_low_precision",
    "data_precision",
    "the examples' numeric answers all lie on a fp16/bf16 grid (rounded through a low-precision float)",
)
PLUGIN_NUMPY_BOOL_ADD = _f(
    "plugin/numpy_bool_add",
    "plugin_numpy_bool",
    "a plug-in adds numpy bools: np.bool_ + np.bool_ is True, not 2, so a count of checks stops at 1",
)

# ---------------------------------------------------------------- combo: keys wrong in combination
# (verlaudit/audit/config_pairs.py) and a tensor's spread under its dtype's spacing (diagnose/resolution.py)
CONFIG_PENALTY_TWICE = _f(
    "config/penalty_twice",
    "config_combination",
    "one penalty applied twice: the KL to the reference both in the reward and in the actor loss",
)
CONFIG_LOSS_TYPE_SCALE = _f(
    "config/loss_type_scale",
    "config_combination",
    "a loss's scale key read with another loss type's meaning (IPO's tau set like DPO's beta)",
)
CONFIG_LOSS_AGG_FP16 = _f(
    "config/loss_agg_fp16",
    "config_loss_scale",
    "a token-sum loss under fp16 loss scaling: tokens x a mean's size, its scaled gradients overflow",
)
CONFIG_CLIP_ZERO_WIDTH = _f(
    "config/clip_zero_width",
    "config_combination",
    "a clip bound of zero width: clip_ratio_low / _high 0 clips every token on that side at ratio 1",
)
CONFIG_TEMPERATURE_DTYPE = _f(
    "config/temperature_dtype",
    "config_combination",
    "a low sampling temperature over fp16/bf16 rollout logits: their rounding is amplified 1 / T",
)
PRECISION_WEIGHT_GRID = _f(
    "precision/weight_grid",
    "precision_resolution",
    "weights rounded onto a grid whose step exceeds the typical weight: most of a tensor exactly 0",
)

# ---------------------------------------------------------------- setupg: what a setup changed in what a model computes
# (`trainer.setup_effect`, `verlaudit.audit.setup_effect`)
SETUP_SETTINGS = _f(
    "setup/module_settings",
    "setup_settings",
    "model.setup changed plain settings of modules or the config (a norm's eps, a scaling)",
)
SETUP_INTERFACE = _f(
    "setup/interface_lost",
    "setup_interface",
    "model.setup returned a module (a wrapper) lacking members of the model it replaced (generate)",
)
SETUP_ADAPTER_INIT = _f(
    "setup/adapter_init",
    "setup_adapter",
    "model.setup added parameters (adapters) that do not start at zero: the model's output moved at init",
)
SETUP_COLLAPSED = _f(
    "setup/outputs_collapsed",
    "setup_collapse",
    "after model.setup distinct inputs give (nearly) one output value: a clamp or rounding saturates them",
)
SETUP_SHARED = _f(
    "setup/shared_params",
    "setup_shared",
    "after model.setup two roles share parameter tensors they did not share before (an aliased trunk)",
)
CHAT_TEMPLATE_GENERATION = _f(
    "model/chat_template_generation_prompt",
    "chat_template",
    "the chat template renders the same prompt with add_generation_prompt: no assistant turn is opened",
)
SPECIAL_TOKEN_DOUBLED = _f(
    "data/special_token_doubled",
    "special_doubled",
    "most prompt rows start with a special token (bos) twice where the tokenizer adds it once",
)

# ---------------------------------------------------------------- rfprobe: reward functions probed in a fork (`probes_fork`, `probes_answer`)
REWARD_NOT_REPEATABLE = _f(
    "reward/not_repeatable",
    "reward_stateful",
    "the reward function scores the same batch differently when called twice (state or randomness)",
)
REWARD_FOLLOWS_POSITION = _f(
    "reward/follows_position",
    "reward_batch",
    "a row's reward changes when the batch's rows are reordered: it follows the position, not the row",
)
REWARD_BATCH_SIZE = _f(
    "reward/batch_size_dependent",
    "reward_batch",
    "the same rows scored in a smaller batch (halves, one group at a time) get other rewards",
)
REWARD_MUTATES_EXAMPLES = _f(
    "reward/mutates_examples",
    "reward_mutates",
    "the reward function removed or rewrote fields of the examples it was handed",
)
REWARD_ANSWER_SCORES = _f(
    "reward/answer_scores",
    "reward_unscored",
    "info: the reference answer as the response scores above a wrong answer (the reward can fire)",
)
REWARD_ANSWER_UNSCORED = _f(
    "reward/answer_unscored",
    "reward_unscored",
    "the reference answer as the response scores no more than a wrong answer: the reward cannot fire",
)
ANSWER_FORM = _f(
    "data/answer_form",
    "answer_form",
    "the answers' canonical form (stripped, NFKC, integer text) scores below their raw form",
)
# ---------------------------------------------------------------- failures
RUNTIME_DTYPE_ERROR = _f("runtime/dtype_error", "dtype_error", "the run died of a dtype error in a module")
OOM = _f("memory/oom", "oom", "the run ran out of memory")

FINDINGS: Mapping[str, Kind] = MappingProxyType(_FINDINGS)
"""Every finding kind the audit writes, by name."""


# the run analyses' causes (`verlaudit.analysis.causes.Cause.kind`); a cause made from a finding is
# ``finding:<kind>`` and takes the finding's class
_c("dtype_error", "dtype_error", "the run died of a dtype error")
_c("device_mismatch", "exception", "tensors of one op on different devices")
_c("exception", "exception", "the run died of another exception")
_c("compile_error", "exception", "torch.compile failed")
_c("nonfinite", "nonfinite", "the loss or gradients became NaN/Inf")
_c("nonfinite_skips", "nonfinite", "optimizer steps skipped for non-finite gradients without loss scaling")
_c("loss_scale_collapse", "overflow", "the fp16 loss scale collapsed")
_c("overflow_skips", "overflow", "fp16 overflows made the loss scaler skip steps")
_c("oom", "oom", "out of memory")
_c("killed", "killed", "the process was killed (no status)")
_c("no_signal", "no_signal", "no group's rewards vary")
_c("weights", "weights_outlier", "weights far out of family")
_c("preflight", "suite_config", "a suite key refused before any worker started (preflight)")
_c("rollout_mismatch", "mismatch", "rollout and trainer log-probs differ beyond dtype rounding")
_c("override_storage", "override_storage", "precision.overrides stores a role's weights below the preset's")
_c("override_compute", "override_compute", "precision.overrides computes a role below the preset's dtype")
_c("override_scaling", "override_scaling", "precision.overrides departs from the preset's loss scaling")
_c(  # setup12
    "override_rollout_apart",
    "override_rollout_apart",
    "precision.overrides computes the actor below the rollout engine's dtype: ratios carry the rounding",
)
_c("override_ignored", "override_ignored", "precision.overrides asks for a dtype its model does not run in")
# cfg24: the reward trend causes (`verlaudit.analysis.diagnose.trajectory.reward_trend_causes`)
_c("reward_collapse", "reward_trend", "the reward fell and stayed down")
_c("reward_variance", "reward_trend", "the reward's variance exploded")
# combo: read from the run's metrics (`verlaudit.analysis.diagnose.pair_cause`)
ADV_NORM_TINY_STD = _c(
    "adv_norm_tiny_std",
    "advantage_norm",
    "GRPO's std normalisation dividing by a group std near 0: reward differences of noise become +-1",
)
RESOLUTION_LOST = _c(
    "resolution_lost",
    "precision_resolution",
    "a tensor in fp16/bf16 whose spread is within a few units of the dtype's spacing at its magnitude",
)

CAUSES: Mapping[str, Kind] = MappingProxyType(_CAUSES)
"""The run analyses' cause kinds, by name (a kind not here is classed ``other``)."""

FINDING_PREFIX = "finding:"


def finding(name: str) -> Kind:
    """The registered finding kind ``name``; ValueError naming the known kinds when it is not one."""
    try:
        return FINDINGS[name]
    except KeyError:
        raise ValueError(
            f"finding kind {name!r} is not registered in verlaudit/kinds.py; known: {', '.join(sorted(FINDINGS))}"
        ) from None


def class_of(name: str) -> str:
    """The class of a finding kind; ``other`` for a name nobody registered (a newer writer's kind)."""
    k = FINDINGS.get(name)
    return k.cls if k is not None else "other"


def cause_class(kind: str) -> str:
    """The class of a cause kind: ``finding:<kind>`` takes the finding's, else `CAUSES`', else ``other``."""
    if kind.startswith(FINDING_PREFIX):
        return class_of(kind.removeprefix(FINDING_PREFIX))
    k = CAUSES.get(kind)
    return k.cls if k is not None else "other"


# ---------------------------------------------------------------- loop12: the roles of an own loop across steps
# (registered in `verlaudit.kinds_loop`, re-exported here)
from verlaudit import kinds_loop as _kinds_loop  # noqa: E402

LOOP_STALE_SAMPLER = _kinds_loop.LOOP_STALE_SAMPLER
LOOP_OPTIMIZER_RECREATED = _kinds_loop.LOOP_OPTIMIZER_RECREATED
LOOP_SCHEDULER_RECREATED = _kinds_loop.LOOP_SCHEDULER_RECREATED
LOOP_SCALER_RECREATED = _kinds_loop.LOOP_SCALER_RECREATED
LOOP_TEMPERATURE_MISMATCH = _kinds_loop.LOOP_TEMPERATURE_MISMATCH
LOOP_INFERENCE_TENSOR = _kinds_loop.LOOP_INFERENCE_TENSOR
LOOP_CONSTANT_WITH_GRAD = _kinds_loop.LOOP_CONSTANT_WITH_GRAD
LOOP_REFERENCE_SHARED = _kinds_loop.LOOP_REFERENCE_SHARED
LOOP_REFERENCE_MOVED = _kinds_loop.LOOP_REFERENCE_MOVED
LOOP_GRADIENT_CANCELS = _kinds_loop.LOOP_GRADIENT_CANCELS
