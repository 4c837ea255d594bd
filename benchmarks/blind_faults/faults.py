"""The blind fault table: every planted fault with the answer a correct diagnosis should give, and the
clean controls.

Each fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is deep-
merged onto the algorithm's base config (`BASE`); ``{plugins}`` and ``{assets.NAME}`` in its strings
become the absolute plug-in folder and asset directories (`benchmarks/blind_faults/assets.py`).

Scoring fields (see run_blind.py): ``root_words`` is a list of word groups, and the first cause's
title / where / kind / what must contain a word of every group; ``culprit``: any of them must appear in
the first cause's where or title; ``fix_words``: any of them in the first fix's suite / verl / why text;
``severity``: the verdict a correct diagnosis gives (reported, not scored). Written before any
diagnosis was run or read.
"""

from __future__ import annotations

from typing import Any

CLASSES = {
    1: "precision lost inside the user's code",
    2: "violated run invariants",
    3: "training dynamics",
    4: "setup-time changes by user code",
    5: "data and tokenizer problems",
    6: "precision configuration via suite keys",
}

PRESETS = ("fp32", "fp16", "bf16", "bf16-pure")

BASE: dict[str, dict[str, Any]] = {
    "ppo": {
        "model": {"preset": "tiny-llama"},
        "data": {"task": "digits", "prompt_length": 16, "response_length": 8},
        "algo": {"name": "ppo", "lr": 2.0e-3, "critic_lr": 2.0e-3, "batch_size": 8, "mini_batch_size": 8,
                 "micro_batch_size": 8, "ppo_epochs": 1, "use_kl_in_reward": True, "kl_coef": 0.01,
                 "lam": 0.95, "cliprange_value": 0.2, "vf_coef": 0.5},
        "steps": 3,
        "threads": 1,
    },
    "grpo": {
        "model": {"preset": "tiny-llama"},
        "data": {"task": "digits", "prompt_length": 16, "response_length": 8},
        "algo": {"name": "grpo", "lr": 1.0e-3, "batch_size": 4, "group_size": 4, "mini_batch_size": 16,
                 "micro_batch_size": 8, "use_kl_loss": True, "kl_loss_coef": 0.01,
                 "kl_loss_type": "low_var_kl"},
        "steps": 3,
        "threads": 1,
    },
    "dpo": {
        "model": {"preset": "tiny-llama"},
        "data": {"task": "digits", "prompt_length": 16, "response_length": 8},
        "algo": {"name": "dpo", "lr": 1.0e-3, "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 8,
                 "beta": 0.1},
        "steps": 3,
        "threads": 1,
    },
}  # fmt: skip
"""The shipped tiny suites' settings (suites/tiny_cpu.yaml, grpo_tiny_cpu.yaml, dpo_tiny_cpu.yaml), smaller
batches, 3 steps."""

AUDIT: dict[str, dict[str, Any]] = {
    "ppo": {"level": "full", "full_steps": 2, "every": 10},
    "grpo": {"level": "full", "full_steps": 2, "every": 10},
    "dpo": {"level": "full", "full_steps": 2, "every": 10, "shadow": True},
}

FP16 = ["fp16", "float16", "half"]
BF16 = ["bf16", "bfloat16"]
LR = ["lr", "learning rate", "learning_rate"]
TOO_BIG = ["large", "high", "too", "diverg", "blow", "explod", "unstable", "instab", "big"]
LR_CULPRIT = ["algo.lr", "optim.lr"]
LR_FIX = ["lr:", "lr=", "learning rate", "algo.lr", "optim.lr"]


def _f(name, cls, point, algo, preset, train, mechanism, root_words, culprit, fix_words, severity):
    return {
        "name": name,
        "cls": cls,
        "point": point,
        "algo": algo,
        "preset": preset,
        "train": train,
        "mechanism": mechanism,
        "root_words": root_words,
        "culprit": culprit,
        "fix_words": fix_words,
        "severity": severity,
    }


RW = "{plugins}/rewards.py:"
RM = "{plugins}/reward_models.py:"
CO = "{plugins}/collators.py:"
DS = "{plugins}/data_sources.py:"
SU = "{plugins}/model_setup.py:"
VS = "{plugins}/verl_scoring.py:"

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rf_fp16_underflow", 1, "data.reward_fn", "ppo", "fp32",
       {"data": {"reward_fn": RW + "sequence_likelihood_reward"}},
       "the reward is a product of per-character probabilities accumulated in an fp16 tensor, which "
       "underflows to exactly 0 for every realistic response, so all rewards are 0",
       [FP16, ["underflow", "subnormal", "flush", "zero"]],
       ["sequence_likelihood_reward", "rewards.py", "reward_fn"],
       ["float32", "fp32", "float64", "log"], "error"),
    _f("rf_bf16_swamped", 1, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "format_bonus_reward"}},
       "small per-digit bonuses (0.002) are added to 1.0 in a bf16 tensor, where the spacing near 1 is "
       "0.0078, so every bonus is rounded away and all rewards are exactly 1.0",
       [BF16, ["round", "precision", "resolution", "identical", "same", "collapse", "lost", "swamp",
               "absorb", "constant", "distinct", "spacing"]],
       ["format_bonus_reward", "rewards.py", "reward_fn"],
       ["float32", "fp32", "float"], "warning"),
    _f("rf_int_rewards", 1, "data.reward_fn", "grpo", "bf16",
       {"data": {"reward_fn": RW + "graded_digit_reward"}},
       "fractional partial-credit scores are written into an integer numpy array, truncating every "
       "reward below 1 to 0",
       [["int", "integer", "int64", "int32", "long"], ["reward", "score", "truncat", "fraction"]],
       ["graded_digit_reward", "rewards.py", "reward_fn"],
       ["float"], "warning"),
    _f("rm_fp16_exp_overflow", 1, "model.reward_model", "ppo", "fp16",
       {"model": {"reward_model": RM + "load_attention_pool_rm"}},
       "the user's reward model, loaded in fp16, pools with exp(score / 0.1) without subtracting the max; "
       "exp overflows fp16 (> 65504) and inf / inf gives NaN scores",
       [FP16, ["overflow", "inf", "exp", "65504", "out of range"]],
       ["load_attention_pool_rm", "reward_models.py", "reward_model"],
       ["float32", "fp32", "logsumexp", "softmax", "max"], "error"),
    _f("rm_bf16_onepass_norm", 1, "model.reward_model", "grpo", "bf16",
       {"model": {"reward_model": RM + "load_mean_pool_rm"}},
       "the user's reward model normalises with a one-pass variance E[x^2] - E[x]^2 in bf16; on features "
       "with a large common offset the subtraction cancels to zero or a negative number and the scores are NaN",
       [BF16, ["norm", "variance", "cancel", "nan", "non-finite", "nonfinite"]],
       ["load_mean_pool_rm", "reward_models.py", "reward_model"],
       ["float32", "fp32", "float"], "error"),
    _f("collator_bf16_ids", 1, "data.collator", "grpo", "bf16",
       {"model": {"tokenizer": "{assets.tok_words}"},
        "data": {"dataset": DS + "word_echo_prompts", "reward_fn": RW + "word_echo_reward",
                 "collator": CO + "collate_to_model_dtype"}},
       "the collator casts the whole batch to bf16 before turning ids back to long; token ids above 256 "
       "are not exact in bf16, so about a third of the prompt ids of this 605-token vocabulary become other tokens",
       [BF16 + ["round"], ["id", "ids", "input_ids", "token"]],
       ["collate_to_model_dtype", "collators.py", "collator"],
       ["long", "int64", "integer", "int"], "error"),
    _f("cs_fp16_length_penalty", 1, "data.compute_score", "grpo", "fp32",
       {"data": {"train_files": "{assets.arith_rows}", "compute_score": VS + "compute_score",
                 "prompt_length": 32, "response_length": 48}},
       "the verl compute_score takes a cubic length penalty as length**3 / budget**3 in numpy float16; "
       "48**3 overflows to inf, so the penalty is 0 or inf/inf = NaN and long responses get NaN rewards",
       [["nan", "non-finite", "nonfinite", "inf", "overflow", "not finite"],
        ["score", "reward", "compute_score"]],
       ["compute_score", "verl_scoring.py"],
       ["float32", "fp32", "float64", "float", "compute_score"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("collator_mask_covers_pad", 2, "data.collator", "ppo", "bf16",
       {"data": {"collator": CO + "pad_prompts"}},
       "the collator left-pads the prompts but returns an all-ones attention mask, so every model attends "
       "to the padding tokens",
       [["mask", "attention_mask"], ["pad", "padding"]],
       ["pad_prompts", "collators.py", "collator"],
       ["mask", "pad"], "error"),
    _f("collator_right_padded", 2, "data.collator", "grpo", "fp16",
       {"data": {"collator": CO + "fixed_width_prompts"}},
       "the collator right-pads the prompts (padding after the text), so generation continues after "
       "the padding instead of from the last prompt token",
       [["right"], ["pad", "padding", "padded"]],
       ["fixed_width_prompts", "collators.py", "collator"],
       ["left"], "error"),
    _f("dpo_identical_pairs", 2, "data.dataset", "dpo", "fp32",
       {"data": {"dataset": DS + "preference_pairs"}},
       "the distractor list aliases the answer list, so shuffling it shuffles both and every pair has "
       "chosen == rejected: the DPO loss is constant log 2 with zero gradient",
       [["identical", "same", "equal", "duplicate"], ["chosen", "rejected", "pair"]],
       ["preference_pairs", "data_sources.py", "dataset"],
       ["rejected", "chosen", "pair"], "error"),
    _f("dpo_pairs_cut_identical", 2, "data.response_length", "dpo", "bf16",
       {"data": {"dataset": DS + "reasoned_pairs", "response_length": 8}},
       "chosen and rejected share a 39-character rationale and differ only in the answer after it; "
       "data.response_length 8 cuts both completions to the same 8 tokens, so every pair is identical",
       [["truncat", "cut", "response_length", "too short", "length"],
        ["identical", "same", "equal", "indistinguishable"]],
       ["response_length"],
       ["response_length"], "error"),
    _f("prompts_truncated_identical", 2, "data.prompt_length", "grpo", "bf16-pure",
       {"data": {"dataset": DS + "instructed_prompts", "prompt_length": 16}},
       "the prompts put the digits first and a long instruction after them; prompt_length 16 keeps only "
       "the end, which is the same instruction text for every prompt, so all prompts are identical",
       [["truncat", "cut", "prompt_length", "too long", "longer", "overlong"],
        ["identical", "same", "duplicate", "indistinguishable", "collapse", "lost"]],
       ["prompt_length"],
       ["prompt_length"], "error"),
    _f("ref_fresh_init", 2, "model.setup.reference", "grpo", "fp32",
       {"model": {"setup": {"reference": SU + "load_reference"}}},
       "the reference setup builds a new model with from_config (random weights) instead of the actor's "
       "starting point, so the KL term pulls the policy towards a random model",
       [["reference", "ref"], ["differ", "mismatch", "initial", "init", "starting", "random",
                               "not the actor", "kl"]],
       ["load_reference", "model_setup.py", "setup"],
       ["reference", "setup", "from_pretrained", "copy"], "error"),
    _f("actor_dropout_in_config", 2, "model.path", "ppo", "fp32",
       {"model": {"preset": None, "path": "{assets.dropout_lm}"}},
       "the model directory's config has attention_dropout 0.2, so dropout is active in the actor's and "
       "critic's training forwards (old log-probs, ratios, values) while the rollout runs in eval mode",
       [["dropout"]],
       ["model.path", "attention_dropout", "dropout_lm", "config.json"],
       ["dropout", "eval"], "warning"),
    _f("untied_output_head", 2, "model.setup.actor", "dpo", "fp32",
       {"model": {"preset": None, "path": "{assets.tied_lm}",
                  "setup": {"actor": SU + "separate_output_head"}}},
       "the model ties lm_head to the input embeddings (tie_word_embeddings true); the setup gives the "
       "head its own copy, so the two train apart while the config still says they are tied",
       [["tie", "tied", "tying", "untied", "untie", "shared"], ["embed", "lm_head", "head", "output"]],
       ["separate_output_head", "model_setup.py", "setup"],
       ["tie", "tied"], "warning"),
    _f("dpo_pairs_misaligned", 2, "data.collator", "dpo", "fp16",
       {"data": {"collator": CO + "pack_pairs"}},
       "the DPO collator packs prompt + completion and right-pads the whole row, so the completion is not "
       "in the last R columns the response mask describes: the log-probs are taken over padding",
       [["response", "completion"], ["align", "shift", "offset", "pad", "position", "last"]],
       ["pack_pairs", "collators.py", "collator"],
       ["response_mask", "pad", "left", "align", "response"], "error"),
    _f("reward_scores_prompt", 2, "data.reward_fn", "grpo", "bf16-pure",
       {"data": {"reward_fn": RW + "answer_match_reward"}},
       "the reward function zips the prompts instead of the responses, so the reward depends on the prompt "
       "only: all responses of a group get the same reward and every GRPO advantage is 0",
       [["response", "completion"], ["ignor", "independ", "not depend", "doesn't depend", "constant",
                                     "identical", "same", "variance", "zero advantage", "std"]],
       ["answer_match_reward", "rewards.py", "reward_fn"],
       ["response", "reward_fn"], "error"),
    _f("rm_mc_dropout", 2, "model.setup.reward", "ppo", "fp32",
       {"model": {"reward_model": "preset:tiny-llama", "setup": {"reward": SU + "mc_dropout_reward"}}},
       "the reward-role setup turns attention dropout on and puts the reward model in train mode, so the "
       "same response scores differently from call to call",
       [["dropout", "train mode", "training mode", "stochastic", "nondeterministic", "non-deterministic",
         "eval"]],
       ["mc_dropout_reward", "model_setup.py", "setup"],
       ["eval", "dropout"], "warning"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("lr_huge_fp16", 3, "algo.lr", "ppo", "fp16", {"algo": {"lr": 5.0}},
       "actor learning rate 5.0 (vs 2e-3): the first updates wreck the weights and the fp16 forwards "
       "overflow",
       [LR, TOO_BIG], LR_CULPRIT, LR_FIX, "error"),
    _f("lr_huge_bf16", 3, "algo.lr", "grpo", "bf16", {"algo": {"lr": 3.0}},
       "actor learning rate 3.0 (vs 1e-3) under bf16: the policy collapses in the first steps",
       [LR, TOO_BIG], LR_CULPRIT, LR_FIX, "error"),
    _f("clip_ratio_tiny", 3, "algo.clip_ratio", "ppo", "fp32",
       {"algo": {"clip_ratio": 0.001, "ppo_epochs": 2, "mini_batch_size": 4, "micro_batch_size": 4}},
       "clip_ratio 0.001 clips nearly every token after the first update, so the policy gradient is 0 "
       "for almost all of each step's updates (training stalls)",
       [["clip"]], ["clip_ratio"], ["clip_ratio"], "warning"),
    _f("kl_coef_huge", 3, "algo.kl_coef", "ppo", "bf16", {"algo": {"kl_coef": 100.0}},
       "kl_coef 100 in the reward: once the policy moves, the KL penalty is orders of magnitude larger "
       "than the task score and dominates the return",
       [["kl"], ["coef", "penalty", "large", "dominat"]], ["kl_coef"], ["kl_coef", "kl_ctrl"], "warning"),
    _f("minibatch_too_many", 3, "algo.mini_batch_size", "grpo", "fp16",
       {"algo": {"mini_batch_size": 1, "micro_batch_size": 1, "ppo_epochs": 4}},
       "mini_batch_size 1 with 4 epochs: 64 optimizer steps on one 16-row rollout, so the policy drifts "
       "far from the sampling policy within a step (ratios off, clipping saturated)",
       [["mini_batch", "mini-batch", "minibatch", "ppo_epochs", "epochs", "updates", "off-policy", "stale"]],
       ["mini_batch_size", "ppo_epochs"], ["mini_batch_size", "ppo_epochs"], "warning"),
    _f("grpo_single_sample", 3, "algo.group_size", "grpo", "bf16",
       {"algo": {"group_size": 1, "mini_batch_size": 4, "micro_batch_size": 4}},
       "GRPO with group_size 1 (verl's rollout.n default): every group has one response, no group baseline, "
       "so the advantage is the raw (non-negative) score",
       [["group", "rollout.n", "samples per prompt", "one response"]],
       ["group_size", "rollout.n"], ["group_size", "rollout.n"], "warning"),
    _f("static_scale_overflow", 3, "precision.overrides.actor.init_scale", "ppo", "fp16",
       {"precision": {"overrides": {"actor": {"loss_scaling": "static", "init_scale": 1.0e9}}}},
       "a static loss scale of 1e9 makes every fp16 actor gradient overflow; static scaling never backs "
       "off, so every actor step is skipped",
       [["scal"], ["overflow", "inf", "skip", "static", "non-finite", "nonfinite"]],
       ["init_scale", "loss_scaling", "precision.overrides"],
       ["dynamic", "init_scale", "loss_scaling"], "error"),
    _f("rollout_top_p_offpolicy", 3, "rollout.top_p", "grpo", "fp32", {"rollout": {"top_p": 0.5}},
       "the rollout samples with top_p 0.5 while the trainer's log-probs are over the full vocabulary, "
       "so rollout and trainer disagree on every token's probability (off-policy ratios)",
       [["top_p", "top-p", "nucleus", "sampling"]],
       ["top_p"], ["top_p", "rollout_is", "rollout_correction"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_critic_half", 4, "model.setup.critic", "ppo", "fp32",
       {"model": {"setup": {"critic": SU + "half_critic"}}},
       "the critic setup calls model.half() in an fp32 run: the critic trains with fp16 weights, fp16 AdamW "
       "state and no loss scaling",
       [FP16, ["critic"]], ["half_critic", "model_setup.py", "setup"],
       ["fp32", "float32", "override", "float"], "error"),
    _f("setup_policy_bf16_master", 4, "model.setup.actor", "dpo", "bf16",
       {"algo": {"lr": 1.0e-5}, "model": {"setup": {"actor": SU + "bf16_policy"}}},
       "the actor setup casts the policy to bf16 under the bf16 (mixed) preset, replacing the fp32 master "
       "weights: at lr 1e-5 most updates are below half a bf16 ulp and are lost",
       [BF16, ["master", "param", "weight", "storage", "update", "lost", "rounding"]],
       ["bf16_policy", "model_setup.py", "setup"],
       ["fp32", "float32", "master", "remove"], "warning"),
    _f("setup_pad_vocab", 4, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "pad_vocab"}}},
       "the actor setup resizes the embeddings to a multiple of 64 (100 -> 128 rows) without new tokens: "
       "the actor samples ids the tokenizer and the (unresized) reference do not have",
       [["vocab", "embedding", "resize", "rows"], ["tokenizer", "mismatch", "size", "range", "reference"]],
       ["pad_vocab", "model_setup.py", "setup"],
       ["tokenizer", "vocab", "resize", "pad_to_multiple_of"], "error"),
    _f("setup_freeze_inverted", 4, "model.setup.actor", "ppo", "bf16-pure",
       {"model": {"setup": {"actor": SU + "freeze_embeddings"}}},
       "meant to freeze the embeddings, the setup sets requires_grad = ('embed_tokens' in name): only the "
       "embeddings train and every other actor parameter is frozen",
       [["frozen", "freeze", "requires_grad", "trainable", "froze", "not trained"]],
       ["freeze_embeddings", "model_setup.py", "setup"],
       ["requires_grad", "freeze", "trainable"], "warning"),
    _f("setup_half_norm", 4, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "use_fast_norm"}}},
       "the actor setup replaces the final RMSNorm with an fp16 module in an fp32 run; its fp16 output "
       "meets the fp32 lm_head and the forward fails with a dtype mismatch",
       [FP16, ["norm", "dtype", "module", "mismatch"]],
       ["use_fast_norm", "model_setup.py", "setup"],
       ["fp32", "float32", "dtype"], "error"),
    _f("setup_bf16_hooks", 4, "model.setup", "dpo", "fp32",
       {"model": {"setup": SU + "compress_activations"}},
       "the setup registers forward hooks that cast every decoder layer's output to bf16 in an fp32 run: "
       "the residual stream is rounded to bf16 after each layer (silent precision loss)",
       [BF16, ["hook", "activation", "hidden", "cast", "layer", "output"]],
       ["compress_activations", "model_setup.py", "setup"],
       ["hook", "fp32", "float32", "remove"], "warning"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("collator_byte_ids", 5, "data.collator", "ppo", "fp32",
       {"data": {"task": "copy", "collator": CO + "byte_collator"}},
       "the collator uses UTF-8 byte values as token ids; letters d-h are bytes 100-104, beyond the "
       "100-id vocabulary, so the embedding lookup goes out of range",
       [["vocab", "out of range", "range", "index", "embedding"], ["id", "token"]],
       ["byte_collator", "collators.py", "collator"],
       ["tokenizer", "vocab", "id"], "error"),
    _f("collator_float_ids", 5, "data.collator", "dpo", "bf16",
       {"data": {"collator": CO + "pair_collator"}},
       "the DPO collator builds input_ids with torch.zeros (float32) and never casts them to long; the "
       "embedding refuses float indices",
       [["float", "dtype", "long"], ["id", "indices", "index"]],
       ["pair_collator", "collators.py", "collator"],
       ["long", "int64"], "error"),
    _f("collator_time_major", 5, "data.collator", "grpo", "bf16-pure",
       {"data": {"collator": CO + "pad_sequence_collator"}},
       "pad_sequence without batch_first returns [T, B]: the collator's ids and mask are transposed, "
       "so T 'prompts' of B tokens are generated and the reward gets a different count than the examples",
       [["shape", "transpos", "dimension", "batch_first", "[b", "time-major", "axes"]],
       ["pad_sequence_collator", "collators.py", "collator"],
       ["batch_first", "transpose", "shape", ".t"], "error"),
    _f("dpo_empty_chosen", 5, "data.dataset", "dpo", "bf16-pure",
       {"data": {"dataset": DS + "pairs_from_records"}},
       "the dataset reads the chosen text from a key the records do not have (rec.get('good', '')), so "
       "every chosen completion is empty (eos only)",
       [["empty", "blank", "no tokens", "zero-length", "length 0", "only eos", "''", '""'],
        ["chosen", "response", "completion"]],
       ["pairs_from_records", "data_sources.py", "dataset"],
       ["chosen", "good", "target", "dataset"], "error"),
    _f("dataset_missing_answer", 5, "data.dataset", "ppo", "fp32",
       {"data": {"dataset": DS + "graded_prompts"}},
       "the dataset's examples carry the expected completion as 'target', but the task's rule reward "
       "reads 'answer': the reward phase fails on the missing field",
       [["answer", "field", "key", "missing"]],
       ["graded_prompts", "data_sources.py", "dataset"],
       ["answer", "reward_fn"], "error"),
    _f("tokenizer_eos_mismatch", 5, "model.tokenizer", "ppo", "fp32",
       {"model": {"preset": None, "path": "{assets.sft_lm}", "tokenizer": "{assets.tok_newline_eos}"}},
       "the tokenizer directory declares '\\n' (id 99) as eos while the model (config eos_token_id 2) "
       "ends its answers with <eos>: generation never stops at the model's eos, every response runs to "
       "the full length",
       [["eos", "end-of-sequence", "end of sequence", "stop"], ["tokenizer", "mismatch", "differ", "model",
                                                               "config"]],
       ["model.tokenizer", "tokenizer", "tok_newline_eos"],
       ["tokenizer", "eos"], "error"),
    _f("critic_backbone_small_vocab", 5, "model.critic_path", "ppo", "fp32",
       {"model": {"critic_path": "{assets.critic_vocab64}"}},
       "the critic backbone directory embeds only 64 ids while the tokenizer (and the actor) use 100: "
       "the first response token above 63 goes out of range in the critic's embedding",
       [["vocab", "embedding", "out of range", "index", "range", "64"], ["critic"]],
       ["critic_path"], ["critic_path", "vocab", "tokenizer"], "error"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("reference_bf16_override", 6, "precision.overrides.reference", "grpo", "fp32",
       {"precision": {"overrides": {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16"}}}},
       "an fp32 run with the reference overridden to bf16: the reference is the actor's start rounded to "
       "bf16, so the KL term is non-zero from the first step and measures rounding, not policy drift",
       [["reference", "ref"], BF16], ["overrides.reference", "precision.overrides", "reference"],
       ["fp32", "float32", "override", "reference"], "warning"),
    _f("fp16_without_loss_scaling", 6, "precision.overrides.actor.loss_scaling", "ppo", "fp16",
       {"precision": {"overrides": {"actor": {"loss_scaling": "none"}}}},
       "an fp16 run with the actor's loss scaling turned off: small fp16 gradients underflow to zero",
       [["scal"], FP16 + ["underflow"]], ["loss_scaling", "precision.overrides"],
       ["dynamic", "loss_scaling"], "warning"),
    _f("fp16_master_weights", 6, "precision.overrides.actor.param_dtype", "ppo", "fp16",
       {"precision": {"overrides": {"actor": {"param_dtype": "fp16"}}}},
       "the fp16 preset with the actor's param_dtype overridden to fp16: no fp32 master weights, AdamW "
       "state in fp16 (its eps 1e-8 is 0 in fp16), updates lost or non-finite",
       [FP16, ["master", "param", "weight", "optimizer", "adam", "eps", "state"]],
       ["param_dtype", "precision.overrides"], ["fp32", "float32", "param_dtype"], "error"),
]  # fmt: skip

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset, "train": {}}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
]
"""Clean controls: each algorithm in each preset, nothing planted; a correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
