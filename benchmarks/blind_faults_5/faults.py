"""The fifth blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. None repeats a mechanism of benchmarks/blind_faults/, benchmarks/blind_faults_2/,
benchmarks/blind_faults_3/ or benchmarks/blind_faults_4/ (their faults.py).

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`), ``variant`` (if any) onto the variant's
``precision: {preset: ...}``; ``{plugins}`` and ``{assets.NAME}`` in their strings become the absolute
plug-in folder and asset paths (`benchmarks/blind_faults_5/assets.py`). A fault with ``loop`` instead runs
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
CONSTANT = ["constant", "identical", "same", "no signal", "no variance", "zero variance", "distinct"]

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rm_sigmoid_saturated", 1, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_probability_scorer"}},
       "the reward-model loader returns P(good) = sigmoid(logit) of an RM whose logits sit around +30 "
       "(margin-trained): float32's sigmoid is exactly 1.0 above ~17, so every response scores 1.0",
       [["saturat", "sigmoid", "1.0"] + CONSTANT, ["reward", "score"]],
       ["load_probability_scorer", "reward_models.py", "reward_model"],
       ["logit", "raw", "logsigmoid", "sigmoid"], "error"),
    _f("rm_floor_div_pooling", 1, "model.reward_model", "grpo", "bf16",
       {"model": {"reward_model": RM + "load_floor_pooled_scorer"}},
       "the reward model's mean pooling divides with // (floor division) instead of /: its features "
       "(means in 0.15..0.45) all floor to 0, the pooled vector is all zeros and every response gets the "
       "head's bias",
       [["floor", "//", "division", "integer", "quantis", "quantiz", "round"] + CONSTANT, ["reward", "score", "pool"]],
       ["load_floor_pooled_scorer", "FloorPooledScorer", "reward_models.py", "reward_model"],
       ["/", "true div", "division", "floor"], "error"),
    _f("cs_isclose_rel_tol", 1, "data.compute_score", "grpo", "fp32",
       {"data": {**VERL, "train_files": "{assets.arith_rows}", "compute_score": VS + "lenient_score"}},
       "the verl compute_score compares integer sums with math.isclose(rel_tol=0.1): every answer within "
       "10% of the truth counts as right (16 for 17, 9 for 10), so near-miss wrong answers get full reward",
       [["tolerance", "rel_tol", "isclose", "lenient", "wrong", "incorrect", "near"], ["score", "reward", "answer"]],
       ["lenient_score", "verl_scoring.py", "compute_score"],
       ["abs_tol", "exact", "==", "rel_tol", "int("], "error"),
    _f("rows_float_repr_truth", 1, "data.train_files", "grpo", "bf16",
       {"data": {**VERL, "train_files": "{assets.float_sum_rows}", "compute_score": VS + "exact_score"}},
       "the export script wrote each ground truth as str(a / 10 + b / 10) in binary floating point: "
       "0.1 + 0.2 is '0.30000000000000004', 0.2 + 0.4 '0.6000000000000001', so about a quarter of the rows "
       "have a truth no response can match",
       [["float", "repr", "binary", "round", "representation", "precision", "0.3000"], ["ground_truth", "truth",
                                                                                          "answer", "label"]],
       ["float_sum_rows", "train_files", "ground_truth"],
       ["round(", "decimal", "format", ":.1f"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("collator_mask_padded_other_side", 2, "data.collator", "grpo", "fp32",
       {"data": {"collator": CO + "padded_prompts_with_lengths"}},
       "the collator left-pads the ids but builds the mask from each prompt's length as mask[i, :n] = 1 "
       "(right-aligned): the mask is 1 on the padding and 0 on the prompt's last real tokens",
       [["mask", "attention_mask"], ["pad", "padding", "side", "misalign", "real token", "left"]],
       ["padded_prompts_with_lengths", "collators.py", "collator"],
       ["!= pad", "pad_token_id", "same side", "left", "ids !="], "error"),
    _f("setup_neftune_noise", 2, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "neftune_embeddings"}}},
       "the actor setup registers NEFTune (uniform noise on the input embeddings while the model is in "
       "training mode, copied from an SFT recipe): the rollout (eval mode) samples from the noiseless policy, "
       "the old log-probs and the update see a noisy one, so rollout and trainer log-probs disagree in a "
       "same-dtype (fp32) run",
       [["noise", "neftune", "embedding", "train mode", "training mode", "hook"], ["mismatch", "differ", "rollout",
                                                                                  "log-prob", "logprob", "ratio"]],
       ["neftune_embeddings", "model_setup.py", "setup"],
       ["neftune", "noise", "remove", "hook"], "error"),
    _f("dpo_unfiltered_equal_pairs", 2, "data.dataset", "dpo", "fp16",
       {"data": {"dataset": DS + "sampled_pairs"}},
       "preference pairs of the reference answer (chosen) and an answer sampled from the previous policy "
       "(rejected), never filtered: where the sample was right (45%) chosen == rejected, pairs with no "
       "preference and no gradient",
       [["identical", "same", "equal", "chosen == rejected", "duplicate"], ["pair", "chosen", "rejected",
                                                                           "preference"]],
       ["sampled_pairs", "data_sources.py", "dataset"],
       ["filter", "drop", "!=", "distinct", "remove"], "error"),
    _f("rf_dedup_responses", 2, "data.reward_fn", "grpo", "bf16-pure",
       {"model": SFT, "data": {"reward_fn": RW + "unique_response_reward"}},
       "the reward function calls the judge once per distinct (response, answer) and returns the distinct "
       "scores only: with the SFT policy most of a group's responses are the same text, so it returns fewer "
       "scores than responses",
       [["count", "length", "number", "fewer", "one score per", "mismatch", "shape", "expected"],
        ["reward", "score"]],
       ["unique_response_reward", "rewards.py", "reward_fn"],
       ["one score per", "every response", "per response", "dedup", "duplicate"], "error"),
    _f("rf_as_completed_order", 2, "data.reward_fn", "ppo", "fp32",
       {"data": {"reward_fn": RW + "judge_pool_reward"}},
       "the reward function sends the judge requests through a thread pool and collects the results with "
       "as_completed, i.e. in completion order: each score lands on whichever row finished in that position "
       "(latency depends on the text), not on the response it scored",
       [["order", "row", "misassign", "permut", "shuffl", "other row", "position", "wrong response"],
        ["reward", "score"]],
       ["judge_pool_reward", "rewards.py", "reward_fn"],
       ["map", "order", "index", "as_completed"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("max_grad_norm_tiny", 3, "algo.max_grad_norm", "ppo", "bf16", {"algo": {"max_grad_norm": 1.0e-4}},
       "max_grad_norm 1e-4 (meant as a learning rate?): every actor and critic gradient (norms ~1) is "
       "rescaled by ~1e-4 before the step; with AdamW the step direction survives but the clipping "
       "throws away the gradient's scale and the relative weighting of the micro-batches",
       [["max_grad_norm", "grad_clip", "clip"]], ["max_grad_norm"], ["max_grad_norm"], "warning"),
    _f("clip_ratio_high_typo", 3, "algo.clip_ratio_high", "grpo", "fp32",
       {"algo": {"clip_ratio_high": 2.8, "ppo_epochs": 4, "mini_batch_size": 8, "micro_batch_size": 8}},
       "clip_ratio_high 2.8 (DAPO's clip-higher is 0.28): the upper clip is 1 + 2.8 = 3.8, so over 4 epochs "
       "tokens with positive advantage are never clipped and the policy moves without a trust region "
       "upwards",
       [["clip_ratio_high", "clip", "upper"]], ["clip_ratio_high"], ["clip_ratio_high", "0.28"], "warning"),
    _f("cliprange_value_zero", 3, "algo.cliprange_value", "ppo", "fp16",
       {"algo": {"cliprange_value": 0.0, "ppo_epochs": 2}},
       "cliprange_value 0: the clipped value prediction is the old value itself, so once the critic's "
       "prediction moves the clipped term dominates and its gradient is 0 (the critic barely trains)",
       [["cliprange_value", "value clip", "vf_clip", "clip"]], ["cliprange_value"], ["cliprange_value"],
       "warning"),
    _f("dpo_apo_down_good_chosen", 3, "algo.dpo_loss", "dpo", "bf16", {"algo": {"dpo_loss": "apo_down"}},
       "dpo_loss apo_down (for pairs whose chosen is worse than the model's own outputs) on pairs whose "
       "chosen is the right answer: the loss pushes the chosen log-likelihood down as well as the margin up",
       [["apo_down", "dpo_loss", "apo", "loss type"]], ["dpo_loss", "apo_down"], ["dpo_loss", "sigmoid",
                                                                                 "apo_zero"], "warning"),
    _f("temperature_high_sft", 3, "algo.temperature", "grpo", "bf16-pure",
       {"model": SFT, "algo": {"temperature": 4.0}},
       "rollout temperature 4 on an SFT'd policy that answers right: sampling is near-uniform, the "
       "responses are mostly noise, the reward falls far below the policy's own accuracy",
       [["temperature"]], ["temperature"], ["temperature"], "warning"),
    _f("bypass_reinforce_no_trust_region", 3, "rollout_correction.bypass_mode", "grpo", "fp32",
       {"algo": {"loss_mode": "bypass_mode", "ppo_epochs": 4, "mini_batch_size": 8, "micro_batch_size": 8},
        "rollout_correction": {"bypass_mode": True, "loss_type": "reinforce"}},
       "bypass mode with loss_type reinforce and 4 epochs of 2 mini-batches: the REINFORCE loss has no ratio "
       "and no clip, so the same batch is pushed 8 times in the same direction without a trust region",
       [["bypass", "reinforce", "trust region", "clip", "epoch"]],
       ["bypass_mode", "loss_type", "rollout_correction", "ppo_epochs"],
       ["ppo_clip", "loss_type", "ppo_epochs", "bypass"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_head_scaled", 4, "model.setup", "dpo", "fp32",
       {"model": {**SFT, "setup": SU + "calibrated_head"}},
       "the setup multiplies the SFT checkpoint's output-head weights by 0.1 on every role (a calibration "
       "temperature of 10 baked into the head): the policy's logits are divided by 10, its next-token "
       "distributions nearly flat, it is no longer the SFT model",
       [["head", "lm_head", "logit", "scale", "calibrat", "weight"], ["setup", "changed", "model", "checkpoint"]],
       ["calibrated_head", "model_setup.py", "setup"], ["head", "remove", "temperature", "calibrat"], "error"),
    _f("setup_unscaled_attention", 4, "model.setup", "grpo", "bf16",
       {"model": {**SFT, "setup": SU + "unscaled_attention"}},
       "the setup sets every attention layer's scaling to 1.0 (ported from code that folds 1/sqrt(d) into "
       "the query weights): attention logits are 4x too large, the loaded policy is not the SFT model",
       [["scaling", "attention", "scale", "sqrt"], ["setup", "changed", "model", "checkpoint", "attribute"]],
       ["unscaled_attention", "model_setup.py", "setup"], ["scaling", "head_dim", "sqrt", "remove"], "error"),
    _f("setup_init_weights_wipes", 4, "model.setup.actor", "ppo", "fp32",
       {"model": {**SFT, "setup": {"actor": SU + "fresh_linear_layers"}}},
       "the actor setup calls reset_parameters() on every nn.Linear of the loaded SFT checkpoint (meant for a "
       "new head): every projection and the output head are re-initialised at random, the actor starts from "
       "scratch while the reference and critic are the SFT model",
       [["init", "reinit", "random", "wiped", "overwrit"], ["weight", "setup", "actor", "checkpoint",
                                                            "reference"]],
       ["fresh_linear_layers", "model_setup.py", "setup"], ["reset_parameters", "init", "remove", "head only"],
       "error"),
    _f("setup_reentrant_ckpt_frozen_embed", 4, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "checkpointed_frozen_embeddings"}}},
       "the actor setup freezes the embeddings and wraps every decoder layer in its own reentrant "
       "torch.utils.checkpoint: no input of the checkpointed layers requires grad, so their output has no "
       "graph and the layers get no gradient; only the final norm and lm_head train",
       [["checkpoint", "reentrant", "no grad", "gradient", "zero grad"], ["layer", "decoder", "embedding",
                                                                        "frozen", "parameter"]],
       ["checkpointed_frozen_embeddings", "model_setup.py", "setup"],
       ["use_reentrant", "enable_input_require_grads", "reentrant", "requires_grad", "checkpoint"], "error"),
    _f("setup_embed_scale_hook", 4, "model.setup", "dpo", "bf16-pure",
       {"model": {**SFT, "setup": SU + "normalised_embeddings"}},
       "the setup registers a forward hook scaling the input embeddings by sqrt(hidden_size) = 8 (Gemma's "
       "normaliser, copied into a Llama): every role's forward is no longer the SFT model's",
       [["hook", "embedding", "scale", "normalis", "normaliz"], ["setup", "changed", "output", "model",
                                                                "checkpoint"]],
       ["normalised_embeddings", "model_setup.py", "setup"], ["hook", "remove", "sqrt", "scale"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("tokenizer_pad_is_digit", 5, "model.tokenizer", "ppo", "fp32",
       {"model": {"tokenizer": "{assets.tok_pad_is_digit}"}},
       "model.tokenizer names a tokenizer whose pad token is the character '0': decoding with the special "
       "tokens skipped deletes every '0' a response writes, so '0000' decodes as '' and no answer with a "
       "0 can be matched; prompts' zeros look like padding",
       [["pad", "padding"], ["0", "digit", "real token", "character", "special", "vocab"]],
       ["model.tokenizer", "tokenizer", "tok_pad_is_digit", "pad_token"],
       ["pad_token", "<pad>", "tokenizer"], "error"),
    _f("tokenizer_no_bos", 5, "model.tokenizer", "grpo", "fp32",
       {"model": {**SFT, "tokenizer": "{assets.tok_no_bos}"}},
       "model.tokenizer names a re-export of the SFT model's tokenizer whose post-processor lost the <bos> "
       "template: every prompt reaches the SFT model without the <bos> it was trained with",
       [["bos", "begin", "special", "post-processor", "post_processor"], ["missing", "without", "no ", "lost",
                                                                         "template", "tokenizer"]],
       ["model.tokenizer", "tokenizer", "tok_no_bos"],
       ["bos", "post_processor", "add_special_tokens", "tokenizer"], "error"),
    _f("collator_strips_cue", 5, "data.collator", "grpo", "fp16",
       {"model": SFT, "data": {"collator": CO + "tidy_prompts"}},
       "the collator cleans each prompt with rstrip(' :>|.?') before tokenising: the trailing ':' the SFT "
       "model answers after is gone from every prompt",
       [["prompt", "strip", "cue", "colon", "format", "text"], ["collator", "changed", "differ", "removed",
                                                                "missing"]],
       ["tidy_prompts", "collators.py", "collator"], ["rstrip", "strip", "colon", "prompt"], "error"),
    _f("dataset_case_mismatch", 5, "data.dataset", "ppo", "bf16",
       {"data": {"dataset": DS + "display_copy_examples"}},
       "copy-task examples whose prompts come from the labelling tool's display column (upper case, 'CAB>') "
       "and whose answers from the raw column ('cab'): copying the prompt never matches the answer",
       [["case", "upper", "lower", "capital"], ["answer", "prompt", "label", "mismatch", "dataset"]],
       ["display_copy_examples", "data_sources.py", "dataset"], ["lower", "case", "upper", "column"], "error"),
    _f("dataset_conflicting_duplicates", 5, "data.dataset", "grpo", "fp32",
       {"data": {"dataset": DS + "merged_annotations"}},
       "the dataset merges two annotation batches of the same prompts, the second labelled with an old "
       "guideline (repeat the last digit): most prompts appear twice with two different answers, so the "
       "same response is rewarded for opposite targets",
       [["duplicate", "conflict", "contradict", "two answers", "different answers", "same prompt"],
        ["answer", "label", "prompt", "dataset"]],
       ["merged_annotations", "data_sources.py", "dataset"], ["dedup", "duplicate", "guideline", "conflict"],
       "error"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("actor_compute_bf16_under_fp32", 6, "precision.overrides.actor.compute_dtype", "grpo", "fp32",
       {}, "an fp32 run with the actor's compute overridden to bf16 (autocast; 'faster training') while the "
       "rollout stays fp32: the trainer's log-probs are bf16 forwards of the policy the fp32 rollout sampled "
       "from, every token's ratio carries the bf16 rounding (a mismatch the fp32 run does not have)",
       [["actor", "trainer", "compute"], BF16 + ["mismatch", "rollout", "differ"]],
       ["overrides.actor", "precision.overrides", "compute_dtype"],
       ["override", "fp32", "rollout", "compute_dtype"], "warning",
       variant={"precision": {"overrides": {"actor": {"compute_dtype": "bf16"}}}}),
    _f("bf16_pure_weight_decay_lost", 6, "precision.preset", "dpo", "bf16-pure",
       {"algo": {"weight_decay": 0.01}},
       "bf16-pure (bf16 parameters, no fp32 master copy) with AdamW weight_decay 0.01 at lr 1e-3: the "
       "decoupled decay multiplies each weight by 1 - 1e-5, below half a bf16 ulp, so it rounds back to "
       "the same weight and the decay never happens",
       [BF16 + ["bf16-pure"], ["weight_decay", "decay", "round", "ulp", "lost"]],
       ["precision.preset", "weight_decay", "bf16-pure"],
       ["bf16", "fp32", "master", "weight_decay"], "warning"),
    _f("fp16_critic_points_reward", 6, "precision.preset", "ppo", "fp16",
       {"data": {"reward_fn": RW + "points_reward"}, "steps": 4},
       "fp16 PPO with the reward in product points (0..1000): the critic regresses returns of hundreds, its "
       "value-loss gradients x the 65536 loss scale overflow fp16 and the critic's steps are skipped while "
       "the dynamic scale halves",
       [["critic", "value"], ["overflow", "skip", "scale", "inf"] + FP16],
       ["precision.preset", "points_reward", "rewards.py", "reward_fn", "critic"],
       ["bf16", "normali", "scale the reward", "reward scale"], "warning"),
    _f("reward_override_ignored_by_loader", 6, "precision.overrides.reward", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_calibrated_probability_scorer"}},
       "the suite overrides the reward role to fp16 (parameters and compute, to halve its memory), but the "
       "reward model comes from a user loader that builds it in fp32 and never reads the role's dtype; the "
       "trainer leaves a loader's module as returned, so the configured fp16 reward role runs in fp32 "
       "(configured and effective precision differ; had the cast happened, fp16 would round this RM's "
       "probabilities ~0.9997 to one value)",
       [["reward"], ["fp32", "float32", "configured", "effective", "contract", "dtype", "policy", "override"]],
       ["load_calibrated_probability_scorer", "reward_models.py", "overrides.reward", "reward_model"],
       ["cast", ".half()", ".to(", "dtype", "loader", "override"], "warning",
       variant={"precision": {"overrides": {"reward": {"param_dtype": "fp16", "compute_dtype": "fp16"}}}}),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_optimizer_on_reference_copy", 7, LOOP, "grpo", "fp32", {},
       "the loop makes a reference copy of the policy and builds the optimizer from ref.parameters(): the "
       "optimizer holds none of the trained model's parameters, the policy never changes (its gradients "
       "pile up, never cleared; zero_grad clears the reference's, which get none)",
       [["optimizer"], ["parameter", "param", "none of", "reference", "copy", "not in"]],
       ["own_loops", "loop_optimizer_on_reference_copy", "optimizer"],
       ["model.parameters", "optimizer", "param"], "error", loop="loop_optimizer_on_reference_copy"),
    _f("loop_double_step", 7, LOOP, "grpo", "fp16", {},
       "fp16 + GradScaler used as documented, then opt.step() called a second time after scaler.update(): "
       "every batch makes two Adam steps (the second on the unscaled gradients, skipped-step or not)",
       [["step", "optimizer.step", "opt.step"], ["twice", "double", "second", "two", "extra", "after"]],
       ["own_loops", "loop_double_step", "step"], ["remove", "scaler.step", "once", "step"], "error",
       loop="loop_double_step"),
    _f("loop_kl_reward_not_detached", 7, LOOP, "grpo", "fp32", {},
       "the loop shapes the reward with a KL penalty r - 0.1 x (logp - ref_logp) computed from the policy's "
       "log-probs with their graph: the advantage is not detached, so the loss differentiates through the "
       "advantage too (an extra -logp^2-like term) instead of the policy gradient",
       [["detach", "graph", "advantage", "kl"], ["reward", "advantage", "gradient", "requires_grad"]],
       ["own_loops", "loop_kl_reward_not_detached", "advantage", "kl"],
       ["detach", "no_grad"], "error", loop="loop_kl_reward_not_detached"),
    _f("loop_stale_rollout_copy", 7, LOOP, "grpo", "fp32", {},
       "the sampler is a copy of the policy made once before the loop and never synced: after the first "
       "update every rollout comes from the initial weights, the updates are off-policy and grow more so "
       "each step (no ratio corrects it)",
       [["stale", "sync", "copy", "off-policy", "old weights", "sampler", "rollout"], ["weight", "policy",
                                                                                        "model", "update"]],
       ["own_loops", "loop_stale_rollout_copy", "rollout", "sampler"],
       ["sync", "load_state_dict", "copy", "same model"], "error", loop="loop_stale_rollout_copy"),
    _f("loop_inference_mode_tensors", 7, LOOP, "grpo", "fp32", {},
       "the rollout runs under torch.inference_mode(); its sequences feed the training forward, and the "
       "backward fails: inference tensors cannot be saved for backward",
       [["inference", "inference_mode"], ["tensor", "backward", "autograd", "saved"]],
       ["own_loops", "loop_inference_mode_tensors", "inference_mode", "rollout"],
       ["no_grad", "clone", "inference_mode"], "error", loop="loop_inference_mode_tensors"),
    _f("loop_temperature_not_applied", 7, LOOP, "grpo", "fp32", {},
       "the rollout samples at temperature 0.6 and records those log-probs; the loop's clipped-ratio loss "
       "takes its log-probs from the raw logits (temperature 1): the ratio is off from 1 before any update "
       "and the clip fires on tokens the policy never moved",
       [["temperature"], ["log-prob", "logprob", "ratio", "mismatch", "rollout", "logits"]],
       ["own_loops", "loop_temperature_not_applied", "temperature"],
       ["temperature", "divide", "/ t", "logits /"], "error", loop="loop_temperature_not_applied"),
    _f("loop_optimizer_recreated", 7, LOOP, "grpo", "fp32", {},
       "the loop builds a new AdamW inside every step: the moment estimates restart from zero each step, "
       "every update is Adam's first (bias-corrected) step, ~lr x sign(g), whatever the gradient's size",
       [["optimizer", "adam", "state", "moment"], ["recreat", "new", "every step", "each step", "reset",
                                                   "inside"]],
       ["own_loops", "loop_optimizer_recreated", "optimizer"],
       ["once", "outside", "before the loop", "optimizer"], "error", loop="loop_optimizer_recreated"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 51, "algo": {"batch_size": 16, "mini_batch_size": 8, "micro_batch_size": 4}},
    "ppo_fp16": {"seed": 52, "data": {"dataset": DS + "shuffled_digits"}},
    "ppo_bf16": {"seed": 53, "data": {"reward_fn": RW + "position_credit_reward"}},
    "ppo_bf16_pure": {"seed": 54, "data": {"task": "sort"}},
    "grpo_fp32": {"seed": 55, "algo": {"group_size": 8, "batch_size": 2, "mini_batch_size": 16,
                                       "micro_batch_size": 8}},
    "grpo_fp16": {"seed": 56, "data": {"collator": CO + "left_padded_prompts"}},
    "grpo_bf16": {"seed": 57, "data": {"response_length": 6}},
    "grpo_bf16_pure": {"seed": 58, "algo": {"ppo_epochs": 2}},
    "dpo_fp32": {"seed": 59, "algo": {"beta": 0.2}},
    "dpo_fp16": {"seed": 60, "data": {"dataset": DS + "clean_pairs"}},
    "dpo_bf16": {"seed": 61, "model": SFT},
    "dpo_bf16_pure": {"seed": 62, "algo": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2}},
}  # fmt: skip
"""Per-control variations from the previous benches' controls: seeds, batch and group sizes, tasks, a
correct plug-in of some kinds (dataset, reward function, collator), an SFT checkpoint, another DPO beta."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_fp16_accumulate_clip", "algo": "grpo", "preset": "fp16", "train": {},
     "loop": "loop_fp16_accumulate_clip_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop (fp16 autocast,
GradScaler, two accumulated micro-batches, unscale_ then clip); a correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
