"""Finding kinds read from a measured effect (session 12): what a legal key did to the update
(`verlaudit.audit.update_effect`), the reward probe's near misses (`verlaudit.audit.probes_answer`), the data
contract (`verlaudit.audit.data_contract`, `special_content`), and what a setup did to the weights and forwards,
precision asked for vs realised, update terms below the storage resolution (`verlaudit.audit.setup_values`,
`update_terms`), requested vs realised precision (`verlaudit.audit.precision_realised`). Registered here, re-exported by `verlaudit.kinds` (write them as ``K.NAME``); split out of
kinds.py for length."""

from __future__ import annotations

from verlaudit.kind_registry import _f

# dyn12: what a legal key did to the update, measured (`verlaudit.audit.update_effect`)
GRAD_CLIP_TOTAL = _f(
    "dynamics/grad_clip_total",
    "grad_clip",
    "max_grad_norm a small fraction of the pre-clip gradient norm at every step: the clip sets the update",
)
VALUE_CLIP_TOTAL = _f(
    "dynamics/value_clip_total",
    "value_clip",
    "a value clip range narrow for the returns that clips most value predictions: no critic gradient",
)
NO_TRUST_REGION = _f(
    "dynamics/no_trust_region",
    "trust_region",
    "a clip side opened (or no clip) while tokens move past the usual bound, unclipped",
)
NULL_UPDATE = _f(
    "dynamics/null_update",
    "update_null",
    "a learning rate so small that the optimizer steps leave the weights where they were",
)
CHOSEN_PUSHED_DOWN = _f(
    "dynamics/chosen_pushed_down",
    "preference_direction",
    "a preference loss whose gradient lowers the chosen answers' log-prob: they fell below the reference",
)

# rank12: the reward probe's near misses (`verlaudit.audit.probes_answer`)
REWARD_ANSWER_LENIENT = _f(
    "reward/answer_lenient",
    "reward_lenient",
    "near-miss wrong answers (an integer +-1, a changed last letter) score as the reference answer",
)

# ---------------------------------------------------------------- data12: the data contract (`data_contract`, `special_content`)
PROMPT_REWRITTEN = _f(
    "data/prompt_rewritten",
    "prompt_rewritten",
    "the prompt rows decode to another text than the examples' prompts: part dropped, cut or rewritten",
)
COMPLETION_REWRITTEN = _f(
    "data/completion_rewritten",
    "prompt_rewritten",
    "a preference pair's chosen / rejected rows decode to another text than the pair's completions",
)
SPECIAL_TOKEN_CONTENT = _f(
    "model/special_token_content",
    "special_content",
    "a pad / eos / bos token that is also a character of the text: masking or skipping it drops content",
)
BOS_MISSING = _f(
    "data/bos_missing",
    "bos_missing",
    "prompts start with another number of bos (0, 2) than the checkpoint's tokenizer puts first",
)
CONFLICTING_ANSWERS = _f(
    "data/conflicting_answers",
    "conflicting_labels",
    "the same prompt appears with different ground truths: one response is rewarded for opposite targets",
)
CONFLICTING_PREFERENCES = _f(
    "data/conflicting_preferences",
    "conflicting_labels",
    "the same prompt's pair appears both ways round (a over b and b over a): the preferences cancel",
)
ANSWER_NOTATION = _f(
    "data/answer_notation",
    "answer_notation",
    "the ground truths write characters in another notation (case, width) than any prompt does",
)
ANSWER_UNREACHABLE = _f(
    "data/answer_unreachable",
    "answer_unreachable",
    "answers (or prompts) hold characters the tokenizer encodes as <unk>: no response can write them",
)

# ---------------------------------------------------------------- setup12: setups' weights and forwards, precision
# asked for vs realised, update terms below the storage resolution
SETUP_WEIGHTS = _f(
    "setup/weights_rewritten",
    "setup_weights",
    "model.setup re-initialised, rescaled or zeroed loaded weights: the role is not its checkpoint",
)
SETUP_HOOK_EFFECT = _f(
    "setup/hook_effect",
    "setup_hook_effect",
    "a hook model.setup registered adds noise, scales its tensor, or acts in training mode only",
)
SETUP_NOT_DETERMINISTIC = _f(
    "setup/forward_not_deterministic",
    "setup_modes",
    "after model.setup the forward gives two outputs for one input, or differs by train / eval mode",
)
PRECISION_NOT_REALISED = _f(
    "precision/requested_not_realised",
    "override_not_realised",
    "a role's weights, gradients or optimizer state not in the dtype its precision key asked for",
)
# prec13: a role computing below the preset, measured; gradients accumulated in a low-precision .grad
COMPUTE_BELOW_CONTRACT = _f(
    "precision/compute_below_contract",
    "override_compute",
    "a compute override below the preset's dtype, with its measured effect on the role's outputs",
)
REWARD_VALUE_GRID = _f(
    "reward/value_grid",
    "plugin_precision",
    "a reward function's values on a decimal grid (a handful of values) from a rounding in its module",
)
GRAD_ACCUMULATION_ROUNDING = _f(
    "numerics/grad_accumulation_rounding",
    "grad_accumulation",
    "many micro-batch gradients summed into an fp16/bf16 .grad: several roundings of the exact sum",
)
DECAY_ROUNDED_AWAY = _f(
    "numerics/decay_rounded_away",
    "update_term_lost",
    "lr x weight_decay x |w| below half the stored weights' spacing: the decay rounds away",
)

# data13: what a dataset says less than it looks (`verlaudit.audit.data_information`)
CONSTANT_TARGETS = _f(
    "data/constant_targets",
    "constant_targets",
    "every example carries the same answer / label / ground truth across many distinct prompts",
)
FEW_PROMPTS = _f(
    "data/few_prompts",
    "few_prompts",
    "the dataset holds fewer distinct prompts than one batch: every batch repeats the same few",
)
PAIRS_FORMAT_ONLY = _f(
    "data/pairs_format_only",
    "pairs_format_only",
    "preference pairs whose chosen and rejected differ only in whitespace / case / punctuation",
)
PAIR_PROMPT_MISMATCH = _f(
    "data/pair_prompt_mismatch",
    "pair_prompt",
    "a collator's chosen and rejected rows of a pair hold different prompts (one side shifted)",
)
PROMPT_FORM = _f(
    "data/prompt_form",
    "prompt_form",
    "prompts in a whitespace form after which the policy finds its targets much less likely",
)
