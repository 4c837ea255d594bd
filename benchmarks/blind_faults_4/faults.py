"""The fourth blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. None repeats a mechanism of benchmarks/blind_faults/, benchmarks/blind_faults_2/ or
benchmarks/blind_faults_3/ (their faults.py).

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`), ``variant`` (if any) onto the variant's
``precision: {preset: ...}``; ``{plugins}`` and ``{assets.NAME}`` in their strings become the absolute
plug-in folder and asset paths (`benchmarks/blind_faults_4/assets.py`). A fault with ``loop`` instead runs
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
VERL = {"prompt_length": 32, "response_length": 8}
LOOP = "own loop (verlaudit.watch)"

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rm_int8_absmax_outlier", 1, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_int8_scorer"}},
       "the reward-model loader fake-quantises every weight matrix to int8 with one per-tensor scale "
       "(max |w| / 127); the head's outlier weight (40) makes the step 0.31 while the other weights are "
       "~0.05, so they all round to 0: every response gets the same score",
       [["quantis", "quantiz", "int8", "round", "distinct", "resolution", "constant", "identical", "same"],
        ["reward", "score"]],
       ["load_int8_scorer", "reward_models.py", "reward_model"],
       ["per-channel", "per channel", "float", "fp32", "quantis", "quantiz", "scale"], "error"),
    _f("cs_float32_truth_equality", 1, "data.compute_score", "grpo", "fp32",
       {"data": {**VERL, "train_files": "{assets.decimal_rows}", "compute_score": VS + "decimal_score"}},
       "the verl compute_score compares the parsed answer (a float64) for exact equality with the ground "
       "truth stored through a float32 table: float32(0.7) is 0.699999988, so every right decimal answer "
       "except 0.5 scores 0",
       [["float32", "fp32", "float64", "precision", "equal", "exact", "round"], ["score", "reward",
                                                                                   "ground_truth", "answer"]],
       ["decimal_score", "verl_scoring.py", "compute_score"],
       ["isclose", "tolerance", "float64", "string", "str", "decimal"], "error"),
    _f("dataset_g_format_answers", 1, "data.dataset", "ppo", "bf16",
       {"data": {"dataset": DS + "seven_digit_answers"}},
       "the dataset writes its integer answers back as text with f'{x:g}', which keeps 6 significant "
       "digits: 7777777 becomes '7.77778e+06', so no response can match the answer the reward checks",
       [["format", "digits", "significant", "precision", "exponent", "e+06", "scientific", "answer"],
        ["answer", "label", "target", "dataset"]],
       ["seven_digit_answers", "data_sources.py", "dataset"],
       ["str(", "int", "format", "string", ":d"], "error"),
    _f("dataset_fp16_rating_ties", 1, "data.dataset", "dpo", "fp32",
       {"data": {"dataset": DS + "rated_pairs"}},
       "the preference dataset picks chosen as the higher of two ratings kept in float16; ratings ~3000 "
       "have a float16 spacing of 2, the right answer's 0.3 lead rounds away and the tie goes to the "
       "second candidate: about 40% of the pairs prefer the wrong answer",
       [FP16 + ["tie", "round", "precision", "rating"], ["chosen", "rejected", "pair", "preference", "label"]],
       ["rated_pairs", "data_sources.py", "dataset"],
       ["float32", "float64", "fp32", "tie", "rating"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("rf_running_max_normaliser", 2, "data.reward_fn", "ppo", "fp32",
       {"data": {"reward_fn": RW + "running_max_normalised_reward"}},
       "the reward function divides each score by the best raw score seen so far in the run (module "
       "state): the same response to the same prompt scores differently as the run goes on (rewards are "
       "not a function of prompt and response)",
       [["state", "history", "running", "depend", "non-stationary", "nonstationary", "same response",
         "differ", "changes"], ["reward", "score"]],
       ["running_max_normalised_reward", "rewards.py", "reward_fn"],
       ["state", "running", "fixed", "constant", "normali"], "error"),
    _f("rf_judge_batch_limit", 2, "data.reward_fn", "grpo", "bf16",
       {"data": {"reward_fn": RW + "judge_endpoint_reward"}},
       "the reward client sends the whole 16-response batch in one judge request; the judge answers only "
       "the first 8 and the client fills the rest with 0: half the rows (all responses to the last two "
       "prompts) get reward 0 whatever they say",
       [["row", "position", "index", "order", "batch", "zero", "missing", "last", "half"],
        ["reward", "score"]],
       ["judge_endpoint_reward", "rewards.py", "reward_fn"],
       ["batch", "limit", "chunk", "request", "split"], "error"),
    _f("rf_group_reshape_transposed", 2, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "group_relative_bonus_reward"}},
       "the reward function centres each group's credits but reshapes the batch to [group, prompts] "
       "instead of [prompts, group]: each 'group' mixes responses to four different prompts, so a "
       "response's reward depends on the responses to other prompts",
       [["group", "reshape", "other rows", "other prompt", "depend", "mix", "layout", "order"],
        ["reward", "score"]],
       ["group_relative_bonus_reward", "rewards.py", "reward_fn"],
       ["reshape", "group", "layout", "(-1,", "prompts, group"], "error"),
    _f("rf_pops_answer", 2, "data.reward_fn", "grpo", "bf16-pure",
       {"data": {"reward_fn": RW + "answer_popping_reward"}},
       "the reward function pops 'answer' out of each example dict; GRPO's group repeats the same dict "
       "for the group's responses, so only the first response of each group is scored and the others "
       "(and every later use of the example) get 0",
       [["pop", "mutat", "modif", "in place", "answer", "missing", "first"], ["reward", "score", "example"]],
       ["answer_popping_reward", "rewards.py", "reward_fn"],
       ["pop", "copy", "get", "mutat"], "error"),
    _f("rf_mean_of_empty_nan", 2, "data.reward_fn", "ppo", "bf16",
       {"data": {"reward_fn": RW + "per_digit_mean_reward"}},
       "the reward is np.mean over the digits a response wrote; a response without any digit gives "
       "np.mean([]) = NaN, so a large share of the rewards are NaN",
       [NONFINITE, ["reward", "score", "mean", "empty"]],
       ["per_digit_mean_reward", "rewards.py", "reward_fn"],
       ["empty", "nan", "default", "0.0", "if hits"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("kl_in_reward_and_loss", 3, "algo.use_kl_loss", "ppo", "bf16",
       {"algo": {"use_kl_in_reward": True, "kl_coef": 0.05, "use_kl_loss": True, "kl_loss_coef": 0.05}},
       "PPO with the KL to the reference both subtracted from the reward (use_kl_in_reward, kl_coef 0.05) "
       "and added to the actor loss (use_kl_loss, kl_loss_coef 0.05): the KL is penalised twice",
       [["kl"], ["twice", "both", "double", "use_kl_loss", "use_kl_in_reward", "reward and", "and loss"]],
       ["use_kl_loss", "use_kl_in_reward", "kl_loss", "kl_coef"],
       ["use_kl_loss", "use_kl_in_reward"], "warning"),
    _f("dpo_robust_eps_near_half", 3, "algo.label_smoothing", "dpo", "fp32",
       {"algo": {"dpo_loss": "robust", "label_smoothing": 0.45}},
       "robust DPO with label_smoothing 0.45 divides by 1 - 2 x 0.45 = 0.1: the loss is 10x as steep in "
       "the margin as plain DPO's (its flipped-label term, weighted 0.45 / 0.1, is unbounded below), so "
       "every margin change moves the loss ten times as much",
       [["label_smoothing", "label smoothing", "robust", "smoothing"]],
       ["label_smoothing", "dpo_loss", "robust"], ["label_smoothing"], "warning"),
    _f("grpo_std_norm_tiebreak", 3, "algo.norm_adv_by_std_in_grpo", "grpo", "fp32",
       {"data": {"reward_fn": RW + "exact_with_length_tiebreak_reward"}},
       "GRPO's std normalisation on rewards that differ within a group only by a 1e-4 x length tie-break "
       "(no response is exact yet): dividing by a std of ~1e-4 turns the tie-break into advantages of "
       "+-1, so the policy is trained on response length alone",
       [["std", "normali", "tie", "spread", "tiny", "small"], ["advantage", "reward", "group"]],
       ["norm_adv_by_std_in_grpo", "exact_with_length_tiebreak_reward", "rewards.py", "advantage"],
       ["norm_adv_by_std_in_grpo", "tie", "std"], "warning"),
    _f("clip_ratio_low_zero", 3, "algo.clip_ratio_low", "grpo", "fp32",
       {"algo": {"clip_ratio_low": 0.0, "ppo_epochs": 4, "mini_batch_size": 8, "micro_batch_size": 8}},
       "clip_ratio_low 0 (meant as 'no lower clip') makes the lower clip 1 - 0 = 1: once a token's ratio "
       "drops below 1 with a negative advantage it is clipped, so after the first mini-batch the policy "
       "cannot lower bad tokens any further",
       [["clip_ratio_low", "clip", "lower"]], ["clip_ratio_low"], ["clip_ratio_low"], "warning"),
    _f("ipo_tau_tiny", 3, "algo.beta", "dpo", "bf16", {"algo": {"dpo_loss": "ipo", "beta": 0.005}},
       "IPO with tau (algo.beta) 0.005: IPO regresses the log-ratio margin onto 1 / (2 tau) = 100, so the "
       "loss is ~1e4 and pushes the margins far from the reference",
       [["beta", "tau", "ipo"]], ["beta", "ipo", "dpo_loss"], ["beta", "tau"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_critic_shares_actor_trunk", 4, "model.setup", "ppo", "fp32",
       {"model": {"setup": SU + "shared_trunk"}},
       "the setup replaces the critic's backbone by the actor's decoder (shared trunk): the actor's and the "
       "critic's optimizers both step the same tensors, the value loss moves the policy",
       [["share", "shared", "same", "alias", "trunk", "backbone"], ["critic", "actor", "parameter", "tensor"]],
       ["shared_trunk", "model_setup.py", "setup"],
       ["separate", "copy", "share", "deepcopy", "backbone"], "error"),
    _f("setup_norm_eps_inflated", 4, "model.setup", "dpo", "bf16",
       {"model": {**SFT, "setup": SU + "stable_norm_eps"}},
       "the setup sets every RMSNorm's epsilon to 1.0 on the SFT model (every role): the norms no longer "
       "normalise activations of size ~1, the loaded policy is not the SFT model any more",
       [["eps", "epsilon", "norm", "variance_epsilon"], ["setup", "changed", "model", "weight", "function"]],
       ["stable_norm_eps", "model_setup.py", "setup"],
       ["eps", "epsilon", "1e-5", "1e-6", "remove"], "error"),
    _f("setup_wrapper_without_generate", 4, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "wrapped_policy"}}},
       "the actor setup returns the policy inside a wrapper nn.Module with only forward(): the rollout "
       "calls generate() / the config on it and the run fails",
       [["wrapper", "generate", "attribute", "module", "returned", "replace"]],
       ["wrapped_policy", "model_setup.py", "setup"],
       ["return none", "in place", "generate", "wrapper", "unwrap"], "error"),
    _f("setup_reward_clamp_saturates", 4, "model.setup.reward", "ppo", "fp32",
       {"model": {"reward_model": "{assets.positive_rm}", "setup": {"reward": SU + "calibrated_reward_range"}}},
       "the reward-role setup clamps the scores to [-1, 1] (another RM's calibration) while this RM's "
       "scores are ~4 +- 0.005: every score is clamped to exactly 1.0, the rewards are constant",
       [["clamp", "clip", "saturat", "constant", "identical", "same"], ["reward", "score"]],
       ["calibrated_reward_range", "model_setup.py", "setup"],
       ["clamp", "range", "remove", "hook"], "error"),
    _f("setup_lora_b_random", 4, "model.setup.actor", "grpo", "bf16",
       {"model": {"setup": {"actor": SU + "lora_policy"}}},
       "the actor setup adds LoRA adapters with B initialised randomly (like A) and scale alpha / r = 16: "
       "the adapted policy is not the model it was built from, the reference (built from the same "
       "weights, no adapters) differs from the actor from step 0",
       [["lora", "adapter", "init", "reference", "actor"], ["differ", "mismatch", "init", "zero", "kl",
                                                           "start", "setup"]],
       ["lora_policy", "model_setup.py", "setup"], ["zero", "lora_b", "init"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("dataset_answers_shifted", 5, "data.dataset", "ppo", "fp32",
       {"data": {"dataset": DS + "two_file_examples"}},
       "the dataset zips questions with answers read from a second file whose header was skipped twice: "
       "every prompt is paired with the next prompt's answer",
       [["answer", "label", "target"], ["shift", "offset", "misalign", "off-by-one", "other prompt",
                                        "wrong", "mismatch", "pair"]],
       ["two_file_examples", "data_sources.py", "dataset"],
       ["header", "align", "zip", "offset", "shift"], "error"),
    _f("dataset_float_answer_text", 5, "data.dataset", "grpo", "bf16",
       {"data": {"dataset": DS + "csv_answers"}},
       "the dataset reads a CSV whose answer column has one blank, so pandas parses it as float64; after "
       "dropping the blank row the answers are str(float): '4444.0' (and '0.0' for 0000), which no "
       "response of the right length matches",
       [["float", ".0", "dtype", "pandas", "format"], ["answer", "label", "target", "dataset"]],
       ["csv_answers", "data_sources.py", "dataset"],
       ["dtype", "str", "int", "astype", "Int64"], "error"),
    _f("tokenizer_strips_spaces", 5, "model.tokenizer", "ppo", "fp32",
       {"model": {**SFT, "tokenizer": "{assets.tok_strip_spaces}"}},
       "model.tokenizer names a tokenizer whose normalizer deletes every space: '4 7 1 9:' reaches the SFT "
       "model as '4719:', a prompt format it was never trained on",
       [["tokenizer", "normaliz", "normalis", "space", "whitespace"], ["prompt", "space", "text", "differ",
                                                                       "mismatch", "model"]],
       ["model.tokenizer", "tokenizer", "tok_strip_spaces"],
       ["tokenizer", "normalizer", "model.path"], "error"),
    _f("dataset_fullwidth_digits", 5, "data.dataset", "grpo", "fp16",
       {"data": {"dataset": DS + "forum_prompts"}},
       "the dataset's prompts are written with full-width digits (U+FF10..), which the character "
       "tokenizer does not have: every digit becomes <unk>, and the prompts lose the digit the answer "
       "depends on",
       [["unk", "unknown", "vocab", "out of vocabulary", "oov"], ["prompt", "token", "digit", "dataset"]],
       ["forum_prompts", "data_sources.py", "dataset"],
       ["nfkc", "normali", "ascii", "unicode"], "error"),
    _f("tokenizer_template_ignores_generation_prompt", 5, "model.tokenizer", "grpo", "fp32",
       {"model": {"tokenizer": "{assets.tok_chat_no_gen_prompt}"},
        "data": {**VERL, "train_files": "{assets.arith_rows}", "compute_score": VS + "exact_score"}},
       "the tokenizer's chat template (written for SFT data) never emits the assistant header for "
       "add_generation_prompt: every verl prompt ends after the user's turn, and the policy generates "
       "the next user message rather than an answer",
       [["chat", "template"], ["generation", "assistant", "add_generation_prompt", "header", "turn"]],
       ["chat_template", "tokenizer", "tok_chat_no_gen_prompt"],
       ["add_generation_prompt", "chat_template", "template"], "error"),
    _f("dataset_answer_leading_space", 5, "data.dataset", "ppo", "bf16-pure",
       {"data": {"dataset": DS + "solved_lines"}},
       "the dataset splits '4 7 1 9: 4444' at the colon and keeps ' 4444' as the answer: every answer "
       "starts with a space, the rule reward compares position by position and the exact answer scores "
       "0.65",
       [["space", "whitespace", "strip", "leading"], ["answer", "label", "target"]],
       ["solved_lines", "data_sources.py", "dataset"], ["strip"], "error"),
    _f("verl_ground_truth_int", 5, "data.train_files", "grpo", "fp16",
       {"data": {**VERL, "train_files": "{assets.int_truth_rows}", "compute_score": VS + "strict_score"}},
       "the verl rows store reward_model.ground_truth as an integer (7) and the compute_score compares the "
       "extracted text '7' with it: str == int is always False, every reward is 0",
       [["ground_truth", "type", "int", "str", "string"], ["score", "reward", "compare", "zero", "never"]],
       ["int_truth_rows", "ground_truth", "strict_score", "verl_scoring.py", "train_files"],
       ["str(", "string", "ground_truth"], "error"),
    _f("collator_double_bos", 5, "data.collator", "grpo", "bf16",
       {"model": SFT, "data": {"collator": CO + "bos_prefixed_prompts"}},
       "the collator prepends bos to prompts the tokenizer already starts with bos: every prompt begins "
       "<bos><bos>, a format the SFT model never saw",
       [["bos", "begin", "special"], ["double", "twice", "duplicate", "two", "repeated"]],
       ["bos_prefixed_prompts", "collators.py", "collator"],
       ["add_special_tokens", "bos", "remove"], "warning"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("reward_role_fp16_underflow", 6, "precision.overrides.reward", "ppo", "fp32",
       {"model": {"reward_model": "{assets.tiny_scale_rm}"}},
       "an fp32 run whose reward role is overridden to fp16, with a reward model whose scores are ~1e-8 "
       "(a score head of tiny scale): below fp16's smallest subnormal, every score flushes to 0",
       [["reward"], FP16 + ["underflow", "subnormal", "zero", "flush"]],
       ["overrides.reward", "precision.overrides", "reward"],
       ["fp32", "float32", "override", "reward"], "error",
       variant={"precision": {"overrides": {"reward": {"param_dtype": "fp16", "compute_dtype": "fp16"}}}}),
    _f("critic_bf16_offset_returns", 6, "precision.overrides.critic", "ppo", "fp32",
       {"data": {"reward_fn": RW + "offset_credit_reward"},
        "model": {"setup": {"critic": SU + "value_bias_at_mean_return"}}},
       "an fp32 run whose critic is overridden to bf16 (parameters and compute) while the returns are "
       "50 + credit (the value head warm-started at the mean return): bf16's spacing at 50 is 0.25, so "
       "the values (and advantages) are rounded to quarter steps of a signal that spans 1",
       [["critic", "value"], BF16 + ["round", "precision", "resolution", "spacing"]],
       ["overrides.critic", "precision.overrides", "critic"],
       ["fp32", "float32", "override", "critic"], "warning",
       variant={"precision": {"overrides": {"critic": {"param_dtype": "bf16", "compute_dtype": "bf16"}}}}),
    _f("fp16_token_sum_overflow", 6, "algo.loss_agg_mode", "grpo", "fp16",
       {"algo": {"loss_agg_mode": "token-sum"}, "steps": 4},
       "loss_agg_mode token-sum under fp16: the loss is summed over the 16 x 8 tokens instead of "
       "averaged (128x larger), its gradients x the 65536 loss scale overflow fp16 and the dynamic "
       "scaler skips steps",
       [["loss_agg_mode", "token-sum", "token_sum", "sum"], ["overflow", "skip", "scale", "inf"] + FP16],
       ["loss_agg_mode"], ["loss_agg_mode", "token-mean"], "warning"),
    _f("bf16_rollout_low_temperature", 6, "algo.temperature", "grpo", "bf16",
       {"rollout": {"engine": "fused"}, "algo": {"temperature": 0.1}},
       "the fused bf16 rollout engine at temperature 0.1: the logits are divided by 0.1, which multiplies "
       "the bf16 rounding difference between the engine's and the trainer's logits by 10, so rollout and "
       "trainer log-probs disagree far more than at temperature 1",
       [["temperature", "rollout", "mismatch", "log-prob", "logprob"], BF16 + ["temperature", "mismatch",
                                                                               "differ", "off-policy"]],
       ["temperature", "rollout"], ["temperature", "fp32", "rollout_is", "rollout_correction"], "warning"),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_never_zero_grad", 7, LOOP, "grpo", "fp16", {},
       "fp16 + GradScaler, but optimizer.zero_grad() is never called: every backward adds to the previous "
       "steps' gradients, each update uses the sum of all gradients so far",
       [["zero_grad", "grad", "accumul"], ["never", "missing", "stale", "accumul", "previous", "clear"]],
       ["own_loops", "loop_never_zero_grad", "zero_grad"],
       ["zero_grad"], "error", loop="loop_never_zero_grad"),
    _f("loop_logprobs_shifted", 7, LOOP, "grpo", "bf16", {},
       "the loop reads each response token's log-prob from the logits at the token's own position "
       "(logits[:, P:]) instead of the position before it: the loss scores each token by the "
       "distribution of the next one",
       [["shift", "align", "off-by-one", "position", "offset"], ["logprob", "log-prob", "log prob",
                                                                  "logits", "token"]],
       ["own_loops", "loop_logprobs_shifted", "logits", "logprob"],
       ["shift", "p - 1", "-1", "[:, :-1]", "align"], "error", loop="loop_logprobs_shifted"),
    _f("loop_head_replaced_after_optimizer", 7, LOOP, "grpo", "fp32", {},
       "the loop replaces lm_head by an untied copy after building the optimizer: the new head's "
       "parameters are not in the optimizer, they get gradients but never change",
       [["optimizer", "param"], ["head", "lm_head", "missing", "not in", "never", "frozen", "update"]],
       ["own_loops", "loop_head_replaced_after_optimizer", "lm_head", "optimizer"],
       ["optimizer", "before", "param"], "error", loop="loop_head_replaced_after_optimizer"),
    _f("loop_clip_after_step", 7, LOOP, "grpo", "fp32", {},
       "the loop calls clip_grad_norm_(0.05) after optimizer.step(): the step uses the unclipped "
       "gradients (norms of ~0.1-1) and the clipping only rescales gradients that are then thrown away",
       [["clip", "clip_grad_norm"], ["after", "order", "step", "unclipped"]],
       ["own_loops", "loop_clip_after_step", "clip"],
       ["before", "clip", "order"], "error", loop="loop_clip_after_step"),
    _f("loop_loss_over_whole_sequence", 7, LOOP, "grpo", "fp32", {},
       "the policy-gradient loss takes the log-probs of every token of prompt + response (the LM-loss "
       "shift), so the prompt's tokens and its left padding are pushed up or down with the advantage",
       [["prompt", "padding", "pad", "mask"], ["loss", "token", "logprob", "log-prob", "response"]],
       ["own_loops", "loop_loss_over_whole_sequence", "loss", "mask"],
       ["response", "mask", "prompt"], "error", loop="loop_loss_over_whole_sequence"),
    _f("loop_step_per_micro_batch", 7, LOOP, "grpo", "fp32", {},
       "gradient accumulation over 4 micro-batches with optimizer.step() inside the micro-batch loop and "
       "zero_grad() only once per step: 4 optimizer steps per batch, the first micro-batch's gradient "
       "applied 4 times, the second 3 times ...",
       [["micro", "accumul", "step"], ["step", "inside", "every", "per micro", "each"]],
       ["own_loops", "loop_step_per_micro_batch", "step", "micro"],
       ["after", "accumul", "outside", "once"], "error", loop="loop_step_per_micro_batch"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 31, "data": {"task": "copy"}},
    "ppo_fp16": {"seed": 32, "data": {"reward_fn": RW + "exact_match_reward"}},
    "ppo_bf16": {"seed": 33, "algo": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2}},
    "ppo_bf16_pure": {"seed": 34, "model": {"setup": {"critic": SU + "zero_bias_value_head"}}},
    "grpo_fp32": {"seed": 35, "data": {**VERL, "train_files": "{assets.arith_rows}",
                                       "compute_score": VS + "exact_score"}},
    "grpo_fp16": {"seed": 36, "algo": {"group_size": 2, "batch_size": 8, "mini_batch_size": 16,
                                       "micro_batch_size": 8}},
    "grpo_bf16": {"seed": 37, "data": {"task": "sort"}},
    "grpo_bf16_pure": {"seed": 38, "model": {"reward_model": RM + "load_float_scorer"}},
    "dpo_fp32": {"seed": 39, "data": {"dataset": DS + "clean_pairs"}},
    "dpo_fp16": {"seed": 40, "data": {"task": "sort"}},
    "dpo_bf16": {"seed": 41, "algo": {"beta": 0.05}},
    "dpo_bf16_pure": {"seed": 42, "data": {"task": "copy"}},
}  # fmt: skip
"""Per-control variations from the previous benches' controls: seeds, batch and group sizes, tasks, a
correct plug-in."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_bf16_accumulate", "algo": "grpo", "preset": "bf16", "train": {},
     "loop": "loop_bf16_accumulate_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop (bf16
autocast, two accumulated micro-batches); a correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
