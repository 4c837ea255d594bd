"""The third blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. None repeats a mechanism of benchmarks/blind_faults/faults.py or
benchmarks/blind_faults_2/faults.py.

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`), ``variant`` (if any) onto the variant's
``precision: {preset: ...}``; ``{plugins}`` and ``{assets.NAME}`` in their strings become the absolute
plug-in folder and asset paths (`benchmarks/blind_faults_3/assets.py`). A fault with ``loop`` instead runs
``plugins/own_loops.py LOOP RUN_DIR`` (the user's own loop under ``verlaudit.watch``).

Scoring fields (benchmarks/faultbench.py `score`): ``root_words`` is a list of word groups, and the first
cause's title / where / kind / what must contain a word of every group; ``culprit``: any of them must
appear in the first cause's where or title; ``fix_words``: any of them in the first fix's suite / verl /
why text; ``severity``: the verdict a correct diagnosis gives (reported, not scored). Written before any
run.
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
    7: "the user's own loop audited in place",
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
"""The previous benches' bases: the shipped tiny suites' settings, smaller batches, 3 steps."""

AUDIT: dict[str, dict[str, Any]] = {
    "ppo": {"level": "full", "full_steps": 2, "every": 10},
    "grpo": {"level": "full", "full_steps": 2, "every": 10},
    "dpo": {"level": "full", "full_steps": 2, "every": 10, "shadow": True},
}

FP16 = ["fp16", "float16", "half"]
BF16 = ["bf16", "bfloat16"]
NONFINITE = ["nan", "non-finite", "nonfinite", "inf", "not finite"]


def _f(name, cls, point, algo, preset, train, mechanism, root_words, culprit, fix_words, severity, loop=None,
       variant=None):  # fmt: skip
    out = {
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
    if loop:
        out["loop"] = loop
    if variant:
        out["variant"] = variant
    return out


RW = "{plugins}/rewards.py:"
RM = "{plugins}/reward_models.py:"
CO = "{plugins}/collators.py:"
DS = "{plugins}/data_sources.py:"
SU = "{plugins}/model_setup.py:"
VS = "{plugins}/verl_scoring.py:"
SFT = {"preset": None, "path": "{assets.sft_lm}"}
VERL = {"train_files": "{assets.arith_rows}", "prompt_length": 32, "response_length": 8}
LOOP = "own loop (verlaudit.watch)"

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rf_fp16_log_sigmoid", 1, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "judge_log_likelihood_reward"}},
       "the reward is log(sigmoid(margin)) computed in fp16 with margins down to -20: sigmoid(-20) = 2e-9 is "
       "below fp16's smallest subnormal, becomes 0, and log(0) = -inf for every wrong response",
       [NONFINITE + ["-inf", "underflow"], ["reward", "score", "log", "sigmoid"]],
       ["judge_log_likelihood_reward", "rewards.py", "reward_fn"],
       ["logsigmoid", "log_sigmoid", "float32", "fp32", "float"], "error"),
    _f("collator_uint8_bitwise_not", 1, "data.collator", "ppo", "bf16",
       {"data": {"collator": CO + "compact_mask_prompts"}},
       "the collator keeps the pad mask as uint8 and inverts it with ~, which on uint8 is bitwise: the "
       "attention mask is 254 on real tokens and 255 on padding (every position non-zero, nothing masked)",
       [["mask", "attention_mask"], ["uint8", "255", "254", "bitwise", "invert", "not 0/1", "0 or 1",
                                     "binary", "padding", "pad"]],
       ["compact_mask_prompts", "collators.py", "collator"],
       ["bool", "logical_not", "1 -", "long", "!= pad", "ne("], "error"),
    _f("cs_numpy_bool_sum", 1, "data.compute_score", "grpo", "fp32",
       {"data": {**VERL, "compute_score": VS + "compute_score"}},
       "the verl compute_score adds three numpy bools (exact + has_number + short) and divides by 3; numpy "
       "bool + bool is logical OR, so the sum is 0 or 1 and the score only takes the values 0 and 1/3",
       [["bool", "numpy", "logical"], ["score", "reward", "sum", "add", "count"]],
       ["compute_score", "verl_scoring.py"],
       ["int(", "float(", "astype", "sum(", "python bool", "integer"], "warning"),
    _f("dataset_fp16_answers", 1, "data.dataset", "ppo", "fp32",
       {"data": {"dataset": DS + "numeric_answer_table"}},
       "the dataset stores the numeric answers in a float16 array: integers above 2048 are rounded to fp16's "
       "spacing (3333 -> 3332, 7777 -> 7776, 9999 -> 10000), so half of the answers the reward checks "
       "against are wrong (and 0000 becomes 0)",
       [FP16 + ["round", "precision", "2048"], ["answer", "label", "target", "dataset"]],
       ["numeric_answer_table", "data_sources.py", "dataset"],
       ["str", "string", "int64", "float32", "object"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("rf_memoised_per_prompt", 2, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "memoised_credit_reward"}},
       "the reward function caches the score by prompt: every later response to a prompt (the rest of its "
       "GRPO group, and later steps) gets the first response's score, so rewards do not depend on the "
       "response and the group advantages are 0",
       [["cache", "memo", "prompt", "same", "identical", "independent", "depend", "constant"],
        ["reward", "score", "advantage"]],
       ["memoised_credit_reward", "rewards.py", "reward_fn"],
       ["cache", "memo", "response", "key"], "error"),
    _f("rf_returns_sorted", 2, "data.reward_fn", "ppo", "bf16",
       {"data": {"reward_fn": RW + "winsorised_credit_reward"}},
       "the reward function winsorises the batch's scores but returns the sorted array, not the scores in "
       "the responses' order: rewards rise with the row index whatever the responses are",
       [["order", "sort", "row", "align", "permut", "index", "position"], ["reward", "score"]],
       ["winsorised_credit_reward", "rewards.py", "reward_fn"],
       ["order", "sort", "clip", "unsort"], "error"),
    _f("rf_swallowed_key_error", 2, "data.reward_fn", "grpo", "bf16-pure",
       {"data": {"reward_fn": RW + "robust_solution_reward"}},
       "the reward function reads e['solution'], which the examples do not have, inside a bare "
       "try/except that returns 0: every reward is 0, whatever the response, and nothing fails",
       [["reward", "score"], ["zero", "constant", "exception", "except", "solution", "keyerror", "same"]],
       ["robust_solution_reward", "rewards.py", "reward_fn"],
       ["answer", "except", "solution", "key"], "error"),
    _f("rm_softmax_over_batch", 2, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_good_bad_classifier"}},
       "the reward model's P(good) is logits.softmax(dim=0)[:, 1], a softmax over the batch instead of the "
       "two classes: each response's reward depends on the other responses in the batch and the rewards "
       "sum to 1",
       [["softmax", "dim", "batch", "other rows", "depend", "normali", "sum to"], ["reward", "score"]],
       ["load_good_bad_classifier", "reward_models.py", "reward_model"],
       ["dim=-1", "dim=1", "softmax(-1)", "class"], "error"),
    _f("model_dir_head_dropped_tied", 2, "model.path", "dpo", "fp32",
       {"model": {"preset": None, "path": "{assets.sft_head_dropped}"}},
       "the exporter wrote the SFT checkpoint with tie_word_embeddings true and no lm_head.weight, but the "
       "model's head was trained apart from its embeddings: loading ties the head to the input embeddings, "
       "the trained head is gone and the policy is not the SFT model",
       [["tie", "tied", "lm_head", "head"], ["embedding", "missing", "checkpoint", "weight", "trained"]],
       ["tie_word_embeddings", "lm_head", "model.path", "sft_head_dropped"],
       ["tie_word_embeddings", "lm_head", "export", "save"], "error"),
    _f("collator_prompt_has_answer", 2, "data.collator", "grpo", "bf16",
       {"data": {"collator": CO + "formatted_prompts"}},
       "the collator renders each prompt with the SFT formatting function, prompt + answer: the answer the "
       "reward checks is inside the prompt the policy sees (a leaked target)",
       [["answer", "target", "label", "leak"], ["prompt", "input"]],
       ["formatted_prompts", "collators.py", "collator"],
       ["prompt", "answer", "remove", "format"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("vf_coef_zero", 3, "algo.vf_coef", "ppo", "bf16", {"algo": {"vf_coef": 0.0}},
       "vf_coef 0: the critic's loss is multiplied by 0, its gradient is 0 and it never trains; the "
       "advantages come from a random value function",
       [["critic", "value", "vf_coef"], ["zero", "not train", "never", "frozen", "grad"]],
       ["vf_coef"], ["vf_coef"], "error"),
    _f("dpo_beta_huge", 3, "algo.beta", "dpo", "fp32", {"algo": {"beta": 50.0}},
       "DPO beta 50 (typical 0.1): the loss is 500x sharper than usual; the first Adam step overshoots, the "
       "margins go negative and beta x margin saturates the sigmoid on the wrong side (loss 0.69 -> ~30)",
       [["beta"]], ["beta"], ["beta"], "warning"),
    _f("rollout_is_threshold_tiny", 3, "rollout_correction.rollout_is_threshold", "grpo", "bf16",
       {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 0.01}},
       "truncated importance sampling with C = 0.01: every token's weight min(ratio, C) is 0.01, the policy "
       "gradient is scaled down 100x against the KL loss (which takes over the update)",
       [["rollout_is", "importance", "truncat", "threshold", "weight"]],
       ["rollout_is", "rollout_correction"], ["rollout_is_threshold", "rollout_is"], "warning"),
    _f("response_length_below_answer", 3, "data.response_length", "ppo", "fp32",
       {"data": {"response_length": 3}},
       "data.response_length 3 while every answer is 4 digits plus eos: each response is cut before it can "
       "be right or end, the reward cannot exceed 0.75 and the policy never samples eos",
       [["response_length", "response length", "truncat", "max_new_tokens", "too short"]],
       ["response_length"], ["response_length"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_lora_zero_init", 4, "model.setup.actor", "ppo", "bf16",
       {"model": {"setup": {"actor": SU + "lora_adapters"}}},
       "the setup freezes the policy and adds LoRA adapters with both A and B initialised to zero: the "
       "gradient of each factor is proportional to the other, so both stay zero and the policy never moves",
       [["lora", "adapter", "zero", "init"], ["grad", "train", "update", "frozen", "moves", "zero"]],
       ["lora_adapters", "model_setup.py", "setup"],
       ["kaiming", "random", "init", "lora_a", "normal"], "error"),
    _f("setup_reference_temperature_hook", 4, "model.setup.reference", "grpo", "fp32",
       {"model": {"setup": {"reference": SU + "reference_at_rollout_temperature"}}},
       "a forward hook divides only the reference's logits by 0.7: the reference is a sharpened copy of the "
       "actor's start, the KL is non-zero from step 0 and pulls the policy towards the sharpened model",
       [["reference", "ref", "kl"], ["hook", "temperature", "logits", "differ", "mismatch", "setup"]],
       ["reference_at_rollout_temperature", "model_setup.py", "setup"],
       ["hook", "remove", "temperature", "reference"], "warning"),
    _f("setup_value_bias_huge", 4, "model.setup.critic", "ppo", "fp32",
       {"model": {"setup": {"critic": SU + "value_head_from_reward_head"}}},
       "the critic's value head gets the reward model's score bias, 25, while the returns are in [0, 1]: "
       "every value is ~25, the advantages are ~-24 and the value loss is huge at the start",
       [["value", "critic"], ["bias", "init", "scale", "large", "offset", "25"]],
       ["value_head_from_reward_head", "model_setup.py", "setup"],
       ["bias", "zero", "init"], "warning"),
    _f("setup_layers_loaded_reversed", 4, "model.setup", "dpo", "fp32",
       {"model": {"setup": SU + "load_converted_sft"}},
       "the setup loads the SFT checkpoint through a converter that numbers the decoder layers from the end "
       "(layers.i -> layers.L-1-i; same shapes, the strict load passes): the layers run in reverse order and "
       "the loaded policy is not the SFT model",
       [["layer", "load", "weight", "state_dict", "convert", "order", "revers", "mapping"]],
       ["load_converted_sft", "model_setup.py", "setup"],
       ["layer", "mapping", "convert", "order", "index"], "error"),
    _f("setup_hook_drops_attention_mask", 4, "model.setup", "dpo", "bf16",
       {"model": {"setup": SU + "mask_free_attention"}},
       "the setup registers a forward pre-hook on every model that removes the attention_mask argument (to "
       "take the mask-free attention path): every forward attends to the left padding of the prompts",
       [["mask", "attention_mask"], ["hook", "pad", "drop", "remov", "ignor", "setup"]],
       ["mask_free_attention", "model_setup.py", "setup"],
       ["hook", "remove", "attention_mask", "mask"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("dataset_aliased_rows", 5, "data.dataset", "dpo", "fp16",
       {"data": {"dataset": DS + "templated_rows"}},
       "the dataset builds its rows as [{}] * n and fills them in place: every row is the same dict, so all "
       "512 preference pairs are the last prompt with its chosen and rejected",
       [["duplicate", "identical", "same", "alias", "one example", "distinct", "unique"],
        ["prompt", "example", "row", "dataset"]],
       ["templated_rows", "data_sources.py", "dataset"],
       ["copy", "dict", "comprehension", "new"], "error"),
    _f("dpo_completions_repeat_prompt", 5, "data.dataset", "dpo", "bf16",
       {"data": {"dataset": DS + "conversation_pairs"}},
       "the preference pairs hold the whole conversation in chosen / rejected (prompt + completion), so "
       "the prompt is repeated inside each completion and data.response_length 8 keeps mostly the prompt "
       "copy (a third of the pairs identical)",
       [["prompt"], ["chosen", "rejected", "completion", "repeat", "contain", "duplicat", "prefix"]],
       ["conversation_pairs", "data_sources.py", "dataset"],
       ["strip", "prompt", "remove", "completion"], "error"),
    _f("tokenizer_other_vocab_order", 5, "model.tokenizer", "ppo", "fp32",
       {"model": {**SFT, "tokenizer": "{assets.tok_sorted_vocab}"}},
       "model.tokenizer names a tokenizer of the same size whose characters are numbered in another order: "
       "every prompt reaches the SFT model as other token ids than it was trained on, and its answers decode "
       "to other characters",
       [["tokenizer", "vocab", "ids"], ["mismatch", "order", "differ", "other", "model", "wrong"]],
       ["model.tokenizer", "tokenizer", "tok_sorted_vocab"],
       ["tokenizer", "model.path", "same"], "error"),
    _f("dataset_empty_prompts", 5, "data.dataset", "ppo", "bf16-pure",
       {"data": {"dataset": DS + "parsed_dump_prompts"}},
       "the dataset's regex misses a quarter of the dump's lines ('Q:' without the space) and returns an "
       "empty prompt for them: those examples are generated from <bos> alone and rewarded against an answer "
       "the policy cannot know",
       [["empty", "blank", "no prompt", "length 0", "zero-length", "missing"], ["prompt"]],
       ["parsed_dump_prompts", "data_sources.py", "dataset"],
       ["regex", "filter", "empty", "parse", "drop"], "error"),
    _f("tokenizer_chat_template_field", 5, "model.tokenizer", "grpo", "fp32",
       {"model": {"tokenizer": "{assets.tok_chat_text_field}"},
        "data": {**VERL, "compute_score": VS + "exact_score"}},
       "the tokenizer's chat template reads m['text'], but verl messages carry 'content': Jinja renders the "
       "missing field as an empty string, so every prompt is 'user: \\nassistant: ' with no question",
       [["chat", "template"], ["empty", "content", "text", "identical", "same", "missing", "question"]],
       ["chat_template", "tokenizer", "tok_chat_text_field"],
       ["content", "chat_template", "template"], "error"),
    _f("tokenizer_spaced_decoder", 5, "model.tokenizer", "grpo", "bf16",
       {"model": {**SFT, "tokenizer": "{assets.tok_spaced_decoder}"}},
       "the tokenizer directory has no Fuse decoder, so decoding joins the characters with spaces: the SFT "
       "policy's correct '4444' is decoded as '4 4 4 4' and the reward compares that with '4444'",
       [["decode", "decoder", "space", "detokeni"], ["tokenizer", "response", "text"]],
       ["model.tokenizer", "tokenizer", "tok_spaced_decoder"],
       ["decoder", "fuse", "tokenizer"], "error"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("fp16_growth_interval_one", 6, "precision.overrides.actor.growth_interval", "ppo", "fp16",
       {"steps": 8}, "the actor's dynamic loss scale doubles after every finite step (growth_interval 1 "
       "instead of 2000): it climbs until the gradients overflow, halves, climbs again, and every other step "
       "or so is skipped",
       [["growth_interval", "loss scale", "scale"], ["skip", "overflow", "grow", "double", "oscillat"]],
       ["growth_interval", "precision.overrides"], ["growth_interval", "2000"], "warning",
       variant={"precision": {"overrides": {"actor": {"growth_interval": 1}}}}),
    _f("reward_role_bf16_offset_rm", 6, "precision.overrides.reward", "ppo", "fp32",
       {"model": {"reward_model": "{assets.offset_rm}"}},
       "an fp32 run whose reward role is overridden to bf16, with a reward model whose scores are ~40 with a "
       "spread far below bf16's spacing there (0.25): every score rounds to the same value, the rewards are "
       "constant",
       [["reward"], BF16 + ["round", "quantis", "quantiz", "precision", "distinct", "resolution"]],
       ["overrides.reward", "precision.overrides", "reward"],
       ["fp32", "float32", "override", "reward"], "warning",
       variant={"precision": {"overrides": {"reward": {"param_dtype": "bf16", "compute_dtype": "bf16"}}}}),
    _f("reward_role_fp16_big_activations", 6, "precision.overrides.reward", "grpo", "fp32",
       {"model": {"reward_model": "{assets.big_act_rm}"}},
       "an fp32 run whose reward role is overridden to fp16, with a reward model whose residual stream "
       "reaches ~1e5: its forward overflows fp16 and every reward is NaN",
       [["reward"], FP16 + NONFINITE + ["overflow"]],
       ["overrides.reward", "precision.overrides", "reward"],
       ["fp32", "bf16", "override", "reward"], "error",
       variant={"precision": {"overrides": {"reward": {"param_dtype": "fp16", "compute_dtype": "fp16"}}}}),
    _f("loss_scale_factor_tiny", 6, "algo.loss_scale_factor", "grpo", "fp16",
       {"algo": {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 0.001}, "steps": 6},
       "seq-mean-token-sum-norm with loss_scale_factor 0.001 (meant to be the response length, 8): the loss "
       "is 8000x larger, its fp16 gradients x 65536 overflow and the dynamic scaler skips the first steps",
       [["loss_scale_factor", "loss scale factor", "loss_agg_mode"]],
       ["loss_scale_factor", "loss_agg_mode"], ["loss_scale_factor"], "warning"),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_zero_grad_late", 7, LOOP, "grpo", "fp32", {},
       "the loop calls optimizer.zero_grad() between loss.backward() and optimizer.step(): every step "
       "steps on cleared gradients and the policy never changes",
       [["zero_grad", "grad"], ["step", "before", "order", "cleared", "none", "zero"]],
       ["own_loops", "loop_zero_grad_late", "zero_grad"],
       ["zero_grad", "before", "backward"], "error", loop="loop_zero_grad_late"),
    _f("loop_clip_scaled_grads", 7, LOOP, "grpo", "fp16", {},
       "fp16 + GradScaler with SGD: clip_grad_norm_(1.0) runs on the still-scaled gradients (no "
       "scaler.unscale_ first), so after unscaling every update is ~65536x smaller than intended",
       [["clip", "unscale"], ["scale", "scaler", "gradscaler"]],
       ["own_loops", "loop_clip_scaled_grads", "clip", "scaler"],
       ["unscale_", "unscale"], "error", loop="loop_clip_scaled_grads"),
    _f("loop_scaler_never_updated", 7, LOOP, "grpo", "fp16", {},
       "the loop uses scaler.scale(loss).backward() and scaler.step(opt) but never scaler.update(): the "
       "scale is never adjusted and the second step() fails",
       [["scaler", "gradscaler", "update"], ["update", "never", "missing", "step"]],
       ["own_loops", "loop_scaler_never_updated", "scaler"],
       ["scaler.update", "update()"], "error", loop="loop_scaler_never_updated"),
    _f("loop_bf16_logprobs", 7, LOOP, "grpo", "bf16", {},
       "the loop casts the logits to bf16 before log_softmax: token log-probs carry bf16's 3 significant "
       "digits (spacing 0.03 around -4.6), distinct probabilities round together in the policy gradient",
       [BF16, ["log_softmax", "logprob", "log-prob", "log prob", "logits", "cast"]],
       ["own_loops", "loop_bf16_logprobs", "log_softmax", "logits"],
       ["float()", "fp32", "float32"], "warning", loop="loop_bf16_logprobs"),
    _f("loop_scheduler_per_micro_batch", 7, LOOP, "grpo", "fp32", {},
       "the scheduler (linear decay to 0 over the run's 4 optimizer steps) is stepped after every one of "
       "the 4 micro-batches: the learning rate is 0 from the first optimizer step on",
       [["scheduler", "lr", "learning rate"], ["micro", "zero", "decay", "accumul", "per step"]],
       ["own_loops", "loop_scheduler_per_micro_batch", "scheduler", "lr"],
       ["scheduler.step", "optimizer step", "after opt", "per step"], "error",
       loop="loop_scheduler_per_micro_batch"),
    _f("loop_rollout_logprobs_as_policy", 7, LOOP, "grpo", "fp32", {},
       "the policy-gradient loss reuses the log-probs generate() returned under no_grad: the loss has no "
       "graph and loss.backward() fails",
       [["grad", "graph", "no_grad", "detach", "requires_grad"], ["rollout", "logprob", "log-prob", "loss",
                                                                  "backward"]],
       ["own_loops", "loop_rollout_logprobs_as_policy", "rollout"],
       ["forward", "recompute", "policy"], "error", loop="loop_rollout_logprobs_as_policy"),
    _f("loop_loss_sign_flipped", 7, LOOP, "grpo", "fp32", {},
       "the loop's REINFORCE loss is +(advantage x log-prob) instead of its negative: every optimizer step "
       "lowers the log-probability of the responses with positive advantage (gradient ascent on the loss)",
       [["sign", "negat", "ascent", "flipped", "maximi", "minimi"], ["loss", "advantage", "reward"]],
       ["own_loops", "loop_loss_sign_flipped", "loss"],
       ["sign", "negat", "-(", "minus"], "error", loop="loop_loss_sign_flipped"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 13, "data": {"reward_fn": RW + "exact_or_partial_reward"}},
    "ppo_fp16": {"seed": 14, "algo": {"batch_size": 6, "mini_batch_size": 6, "micro_batch_size": 3}},
    "ppo_bf16": {"seed": 15, "model": {"setup": {"critic": SU + "fp32_value_head_small_init"}}},
    "ppo_bf16_pure": {"seed": 16, "data": {"task": "sort"}},
    "grpo_fp32": {"seed": 17, "algo": {"group_size": 6, "batch_size": 2, "mini_batch_size": 12,
                                       "micro_batch_size": 6}},
    "grpo_fp16": {"seed": 18, "data": {"collator": CO + "plain_prompts"}},
    "grpo_bf16": {"seed": 19, "model": {"reward_model": RM + "load_fixed_scorer"}},
    "grpo_bf16_pure": {"seed": 20, "data": {"task": "copy"}},
    "dpo_fp32": {"seed": 21, "data": {"task": "copy"}},
    "dpo_fp16": {"seed": 22, "algo": {"beta": 0.3}},
    "dpo_bf16": {"seed": 23, "algo": {"batch_size": 6, "mini_batch_size": 6, "micro_batch_size": 3}},
    "dpo_bf16_pure": {"seed": 24, "data": {"dataset": DS + "digit_pairs"}},
}  # fmt: skip
"""Per-control variations from the previous benches' controls: seeds, batch and group sizes, tasks, a
correct plug-in."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_fp16_scaler", "algo": "grpo", "preset": "fp16", "train": {},
     "loop": "loop_fp16_scaler_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop (fp16
autocast with a GradScaler on the CPU); a correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
