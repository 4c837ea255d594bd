"""The seventh blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. Written from the brief (the fault classes of issue 24) by someone who has not read how
verlaudit detects anything; none repeats a mechanism of benchmarks/blind_faults/ .. blind_faults_6/ (their
faults tables' name / class / point / mechanism lines).

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`), ``variant`` (if any) onto the variant's
``precision: {preset: ...}``; ``{plugins}`` and ``{assets.NAME}`` in their strings become the absolute
plug-in folder and asset paths (`benchmarks/blind_faults_7/assets.py`). A fault with ``loop`` instead runs
``plugins/own_loops.py LOOP RUN_DIR`` (the user's own loop under ``verlaudit.watch``).

Scoring fields (benchmarks/faultbench.py `score`): ``root_words`` is a list of word groups, and the first
cause's title / where / kind / what must contain a word of every group; ``culprit``: any of them must
appear in the first cause's where or title; ``fix_words``: any of them in the first fix's suite / verl /
why text; ``severity``: the verdict a correct diagnosis gives (reported, not scored). The expectations
describe the fault in the words a correct diagnosis has to use; written before any run.
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
"""The shipped tiny suites' settings with small batches and 3 steps (as the earlier benches)."""

AUDIT: dict[str, dict[str, Any]] = {
    "ppo": {"level": "full", "full_steps": 2, "every": 10},
    "grpo": {"level": "full", "full_steps": 2, "every": 10},
    "dpo": {"level": "full", "full_steps": 2, "every": 10, "shadow": True},
}

FP16 = ["fp16", "float16", "half"]
BF16 = ["bf16", "bfloat16"]
NONFINITE = ["nan", "non-finite", "nonfinite", "inf", "not finite"]
SCORE = ["reward", "score"]
ROUNDING = ["precision", "round", "quantis", "quantiz", "resolution", "spacing", "lost", "ties", "distinct"]
REF = ["reference", "ref"]


def _f(name, cls, point, algo, preset, train, mechanism, root_words, culprit, fix_words, severity, loop=None,
       variant=None):  # fmt: skip
    out = {"name": name, "cls": cls, "point": point, "algo": algo, "preset": preset, "train": train,
           "mechanism": mechanism, "root_words": root_words, "culprit": culprit, "fix_words": fix_words,
           "severity": severity}  # fmt: skip
    if loop:
        out["loop"] = loop
    if variant:
        out["variant"] = variant
    return out


RW = "{plugins}/rewards.py:"
RM = "{plugins}/reward_models.py:"
CO = "{plugins}/collators.py:"
DS = "{plugins}/datasets.py:"
SU = "{plugins}/setups.py:"
SC = "{plugins}/scoring.py:"
SFT = {"preset": None, "path": "{assets.sft_lm}"}
VERL = {"prompt_length": 32, "response_length": 8}
LOOP = "own loop (verlaudit.watch)"

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rf_float32_ledger_increments", 1, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "ledger_reward"}},
       "the reward function books each response's credit (0..1 in steps of 1/16) in the team's running "
       "reward ledger, a float32 cumulative sum restored at 1.6e7 points, and returns the ledger's "
       "increments: float32's spacing at 1.6e7 is 1.0, so every reward comes back rounded to 0 or 1 (the "
       "partial credit is gone)",
       [["float32", "fp32", "cumsum", "cumulative", "ledger", "running", "offset", "large"] + ROUNDING, SCORE],
       ["ledger_reward", "rewards.py", "reward_fn", "RewardLedger"],
       ["float64", "ledger", "offset", "cumsum", "credit", "directly"], "error"),
    _f("rm_uint8_wire_format", 1, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_packed_scorer"}},
       "the reward model's P(good) (0.601..0.606 on this policy's responses) is sent through the scoring "
       "service's one-byte wire format, (p x 255).to(uint8) / 255: the cast truncates to multiples of "
       "1/255 = 0.0039, so the scores collapse to 2 values and most of their ranking is lost",
       [["uint8", "byte", "integer", "truncat", "255"] + ROUNDING, SCORE],
       ["load_packed_scorer", "PackedProbabilityScorer", "reward_models.py", "reward_model"],
       ["uint8", "float", "fp32", "wire", "255", "raw"], "error"),
    _f("rm_fp16_mask_constant_nan", 1, "model.reward_model", "grpo", "fp16",
       {"model": {"reward_model": RM + "load_half_attention_scorer"}},
       "the reward model (shipped in fp16) excludes padding with the additive bias (1 - mask) x "
       "finfo(float32).min computed in its fp16 dtype: the constant is -inf in fp16, and 0 x -inf is NaN "
       "on every real token, so every score is NaN",
       [NONFINITE + ["finfo", "-inf"], SCORE + ["mask", "bias"]],
       ["load_half_attention_scorer", "AttentionPoolScorer", "reward_models.py", "reward_model"],
       ["finfo", "dtype", "masked_fill", "-1e4", "float32", "fp32"], "error"),
    _f("cs_float32_tolerance_large_ints", 1, "data.compute_score", "grpo", "bf16-pure",
       {"data": {**VERL, "train_files": "{assets.product_rows}", "compute_score": SC + "tolerant_score"}},
       "the verl compute_score accepts |pred - truth| < 0.5 on np.float32 values ('so that 12.0 and 12 "
       "match'): the ground truths are products of two four-digit numbers (up to ~1e8), where float32's "
       "spacing is 4-8, so answers off by up to 4-8 score 1.0",
       [["float32", "fp32", "np.float32"] + ROUNDING + ["tolerance"], SCORE + ["answer", "compare", "wrong"]],
       ["tolerant_score", "scoring.py", "compute_score"],
       ["int(", "integer", "exact", "float64", "str", "=="], "error"),
    _f("rf_fp16_win_rate_ties", 1, "data.reward_fn", "ppo", "fp16",
       {"data": {"reward_fn": RW + "batch_win_rate"}},
       "the reward is each response's win rate against the rest of the batch under an offline judge whose "
       "scores are log-likelihoods near -700 that differ by 0.01-0.2; they are compared as an fp16 tensor "
       "(the judge client's wire format), whose spacing at 700 is 0.5: all scores tie, every win rate is 0",
       [FP16 + ROUNDING + ["tie"], SCORE + ["win", "judge", "compar"]],
       ["batch_win_rate", "rewards.py", "reward_fn"],
       ["float64", "fp32", "float32", "dtype", "fp16"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("setup_reference_earlier_checkpoint", 2, "model.setup.reference", "grpo", "bf16",
       {"model": {**SFT, "setup": {"reference": SU + "reference_from_checkpoint"}}},
       "the reference-role setup loads the team's 'reference' checkpoint, which points at the first saved "
       "SFT checkpoint (12 steps) instead of the one the actor starts from: the reference is not the "
       "actor's starting point, the KL to it is far from 0 at step 0 and the KL loss pulls the policy "
       "back toward a half-trained model",
       [REF, ["actor", "start", "step 0", "initial", "differ", "checkpoint", "kl"]],
       ["reference_from_checkpoint", "setups.py", "setup.reference"],
       ["reference", "same checkpoint", "model.path", "remove", "actor"], "error"),
    _f("collator_mask_drops_last_token", 2, "data.collator", "ppo", "fp32",
       {"model": SFT, "data": {"collator": CO + "span_masked_prompts"}},
       "the collator writes each prompt's mask from its span [P - n, P - 1), taking the last column's "
       "index as the exclusive end: the last real token of every prompt (the ':' the SFT model answers "
       "after) has attention_mask 0, so no position attends to it",
       [["mask", "attention_mask"], ["last", "real token", "off by one", "off-by-one", "final", "cue", "prompt"]],
       ["span_masked_prompts", "collators.py", "collator"],
       ["mask", "end", "p - 1", "off-by-one", "span"], "error"),
    _f("dpo_collator_mirrors_half_the_pairs", 2, "data.collator", "dpo", "fp16",
       {"data": {"collator": CO + "mirrored_pairs"}},
       "the DPO collator presents every second pair mirrored (rejected in the chosen slot and the reverse), "
       "an augmentation from the team's symmetric reward-model loss: half the preference labels are "
       "flipped, so the DPO gradients of the two halves cancel and the net preference signal is ~0",
       [["chosen", "rejected", "pair", "preference", "label"], ["swap", "flip", "mirror", "invert", "half",
                                                                "reverse"]],
       ["mirrored_pairs", "collators.py", "collator"],
       ["mirror", "swap", "chosen", "augment", "remove"], "error"),
    _f("setup_reference_shares_actor_embeddings", 2, "model.setup", "grpo", "fp32",
       {"model": {"setup": SU + "share_frozen_embeddings"}},
       "one setup for every role hands the actor's embedding module to the reference ('identical at the "
       "start, saves memory'): the reference's embeddings are the actor's trainable tensor, so every "
       "actor update moves the reference too and the KL to the reference leaves out the embeddings' drift",
       [REF, ["share", "same tensor", "embed", "moves", "tied", "actor"]],
       ["share_frozen_embeddings", "setups.py", "model.setup"],
       ["copy", "share", "clone", "reference", "remove"], "error"),
    _f("collator_drops_overlong_prompts", 2, "data.collator", "grpo", "bf16-pure",
       {"data": {"collator": CO + "budgeted_prompts"}},
       "the collator leaves prompts longer than 7 tokens out of the batch ('too long for the serving "
       "profile'): it returns fewer rows than the examples it was given, so the rollout's rows and the "
       "examples the rewards are computed against no longer correspond (about a third of the prompts)",
       [["row", "example", "batch", "prompt"], ["fewer", "drop", "missing", "count", "mismatch", "size",
                                                "number", "align"]],
       ["budgeted_prompts", "collators.py", "collator"],
       ["every example", "drop", "truncat", "prompt_length", "filter", "one row"], "error"),
    _f("critic_path_dropout_config", 2, "model.critic_path", "ppo", "fp16",
       {"model": {"critic_path": "{assets.critic_dropout}"}},
       "model.critic_path names the value team's backbone, whose config keeps attention_dropout 0.3 from "
       "their pre-training recipe: the critic's training forwards drop 30% of the attention weights, so "
       "its values during the update are not the values the advantages were computed from",
       [["dropout", "train mode", "training mode"], ["critic", "value"]],
       ["critic_path", "critic_dropout", "attention_dropout"],
       ["attention_dropout", "dropout", "0.0", "eval"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("kl_cov_every_token", 3, "algo.kl_cov_ratio", "grpo", "fp16",
       {"algo": {"loss_mode": "kl_cov", "kl_cov_ratio": 1.0, "ppo_kl_coef": 20.0, "ppo_epochs": 4,
                 "mini_batch_size": 8, "micro_batch_size": 8}},
       "loss_mode kl_cov with kl_cov_ratio 1.0 (verl's default 0.0002: the 0.02% of tokens with the "
       "largest covariance) and ppo_kl_coef 20: every token carries 20 |logp - old logp|, whose gradient "
       "(20 per token, sign of the move) outweighs the policy-gradient term (|A| ~ 1) after the first "
       "mini-batch, so later updates push back toward the sampling policy instead of following the "
       "advantage",
       [["kl_cov", "kl_cov_ratio", "ppo_kl_coef"]], ["kl_cov_ratio", "ppo_kl_coef", "kl_cov"],
       ["kl_cov_ratio", "0.0002", "ppo_kl_coef"], "warning"),
    _f("kl_loss_coef_dominates", 3, "algo.kl_loss_coef", "grpo", "bf16-pure",
       {"algo": {"kl_loss_coef": 50.0, "ppo_epochs": 2, "mini_batch_size": 8, "micro_batch_size": 8}},
       "kl_loss_coef 50 (verl's default 0.001; the team meant 0.05): once the policy has moved after the "
       "first mini-batch, the KL loss's gradient is orders of magnitude larger than the policy gradient, "
       "so every later update pulls the policy back to the reference and the reward cannot improve",
       [["kl_loss_coef", "kl loss", "kl_loss", "kl coefficient"]], ["kl_loss_coef"],
       ["kl_loss_coef", "0.001", "0.01"], "warning"),
    _f("dpo_hinge_beta_large", 3, "algo.dpo_loss", "dpo", "bf16",
       {"algo": {"dpo_loss": "hinge", "beta": 20.0}},
       "dpo_loss hinge with beta 20 (the sigmoid loss's beta 0.1 scaled up 'to make the hinge sharper'): "
       "the hinge relu(1 - beta x margin) has slope 20 in the margin up to 1 / 20 = 0.05 and none past it, so "
       "pairs that pass 0.05 stop contributing while the others get 200x the sigmoid loss's slope; the "
       "updates overshoot, the log-ratio margins go negative (about -2 after one step) and the loss rises "
       "from 1 to ~15 instead of falling",
       [["hinge", "beta", "dpo_loss"]], ["dpo_loss", "beta", "algo.beta"],
       ["beta", "sigmoid", "dpo_loss", "hinge"], "warning"),
    _f("critic_lr_vanishing", 3, "algo.critic_lr", "ppo", "bf16", {"algo": {"critic_lr": 1.0e-7}},
       "critic learning rate 1e-7 (the actor's is 2e-3; the value was copied from a 70B recipe's actor): "
       "each AdamW step moves the critic's weights by ~1e-7, its values stay at their near-zero init, so "
       "the advantages are returns minus an untrained baseline throughout",
       [["critic_lr", "critic", "value"], ["lr", "learning rate", "learning_rate", "not train", "never",
                                           "small", "tiny"]],
       ["critic_lr", "algo.critic_lr"], ["critic_lr", "learning rate"], "warning"),
    _f("clip_ratio_written_as_percent", 3, "algo.clip_ratio", "ppo", "fp32",
       {"algo": {"clip_ratio": 10.0, "ppo_epochs": 4, "mini_batch_size": 4, "micro_batch_size": 4}},
       "clip_ratio 10 ('10 %', meant 0.1): the ratio is clipped to [1 - 10, 1 + 10], i.e. never; over 4 "
       "epochs of 2 mini-batches the same rollout is pushed 8 times with no trust region, the ratios and "
       "the KL to the sampling policy run far past what PPO's clip allows",
       [["clip_ratio", "clip", "trust region"]], ["clip_ratio", "algo.clip_ratio"],
       ["clip_ratio", "0.1", "0.2"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_vocab_rounded_down", 4, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "round_vocab_to_32"}}},
       "the actor setup resizes the embeddings to a multiple of 32 for the matmul kernels but rounds the "
       "vocabulary 100 down to 96: the ids 96-99 (among them ' ', which every prompt contains) are past the "
       "actor's embedding, and the actor's logits no longer cover the tokenizer (nor match the reference's)",
       [["vocab", "embedding", "resize", "rows", "out of range", "index"], ["96", "100", "smaller", "shrink",
                                                                            "tokenizer", "rounded", "fewer"]],
       ["round_vocab_to_32", "setups.py", "setup.actor"],
       ["resize", "round up", "pad_to_multiple_of", "len(tokenizer)", "remove", "128"], "error"),
    _f("setup_ties_untied_head", 4, "model.setup.actor", "dpo", "fp16",
       {"model": {**SFT, "setup": {"actor": SU + "tie_output_head"}}},
       "the actor setup ties the output head to the input embeddings to save memory, on an SFT checkpoint "
       "that was trained untied: the trained lm_head is thrown away, the actor's logits are the embedding "
       "matrix's, so the policy no longer answers like the SFT model and differs from the reference at "
       "step 0",
       [["tie", "tied", "lm_head", "head", "embedding"], ["setup", "untied", "replace", "trained", "differ"]],
       ["tie_output_head", "setups.py", "setup.actor"],
       ["tie", "untied", "remove", "lm_head"], "error"),
    _f("setup_logit_noise_hook", 4, "model.setup.actor", "ppo", "bf16-pure",
       {"model": {"setup": {"actor": SU + "exploration_noise"}}},
       "the actor setup registers 'noisy-net' exploration from the team's bandit code: a forward hook adding "
       "N(0, 0.5^2) noise to the logits of every forward, sampling and scoring alike; the actor is no "
       "longer a deterministic function, so the rollout's log-probs, the old log-probs, the update's and the "
       "reference comparison each see another random policy (~0.3 nats per token apart)",
       [["hook", "noise", "random", "nondetermin", "non-determin"], ["setup", "logit", "forward", "differ",
                                                                    "mismatch"]],
       ["exploration_noise", "_logit_noise", "setups.py", "setup.actor"],
       ["hook", "remove", "noise", "temperature", "entropy"], "error"),
    _f("setup_logit_softcap_tiny", 4, "model.setup.actor", "grpo", "bf16",
       {"model": {**SFT, "setup": {"actor": SU + "soft_cap_logits"}}},
       "the actor setup adds final-logit soft-capping cap x tanh(logits / cap) with cap 1.0 (the serving "
       "config's attention cap instead of its final-logit cap 30): every logit is squeezed into [-1, 1], "
       "the policy over 100 ids is nearly uniform, far from the SFT model and the reference",
       [["cap", "softcap", "soft-cap", "tanh", "logit"], ["setup", "uniform", "squeez", "bound", "1.0", "differ"]],
       ["soft_cap_logits", "SoftCappedHead", "setups.py", "setup.actor"],
       ["cap", "30", "softcap", "remove"], "error"),
    _f("rm_loader_global_forward_hook", 4, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_monitored_scorer"}},
       "the reward-model loader also turns on the RM team's activation monitor, a global module forward "
       "hook (torch.nn.modules.module.register_module_forward_hook) that returns output.detach(): every "
       "module of the process (actor and critic included) now returns a detached output, so the first "
       "backward has no graph and the run fails",
       [["hook", "global", "forward hook", "detach"], ["graph", "grad", "backward", "every module", "loader"]],
       ["load_monitored_scorer", "_monitor", "reward_models.py", "reward_model"],
       ["hook", "global", "detach", "remove", "register_forward_hook"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("dataset_prompt_template_unrendered", 5, "data.dataset", "grpo", "fp16",
       {"data": {"dataset": DS + "templated_prompts"}},
       "the dataset stores the task card's template '{digits}:' as every example's prompt and the digits "
       "in another field (the rendering step was never called): all prompts are the same text while the "
       "answers differ, so the policy cannot tell which digit to repeat",
       [["prompt", "template"], ["identical", "same", "distinct", "unrendered", "placeholder", "format",
                                 "{digits}"]],
       ["templated_prompts", "datasets.py", "dataset"],
       ["format", "render", "template", "digits"], "error"),
    _f("verl_truth_thousands_separator", 5, "data.train_files", "grpo", "bf16",
       {"data": {**VERL, "train_files": "{assets.thousands_rows}", "compute_score": SC + "exact_score"}},
       "the verl rows' ground truths were exported with f'{x:,}': every sum of 1000 or more is written "
       "'1,234', which no number the policy writes (nor the exact scorer) can equal, so about half of the "
       "prompts can never be scored right",
       [["ground_truth", "ground truth", "truth", "answer"], ["comma", "separator", "thousand", "format",
                                                              "1,"]],
       ["train_files", "thousands_rows", "ground_truth"],
       ["separator", "comma", "str(", "export", "format", "replace"], "error"),
    _f("dataset_answers_are_numbers", 5, "data.dataset", "ppo", "fp32",
       {"data": {"dataset": DS + "json_answers"}},
       "the dataset comes from the labelling tool's JSON export, where each answer is a number (4444, not "
       "'4444'): the digits task's rule reward compares the response with the answer character by "
       "character and fails on an int in the reward phase",
       [["answer"], ["int", "number", "str", "type", "not iterable", "string"]],
       ["json_answers", "datasets.py", "dataset"], ["str(", "string", "str", "answer"], "error"),
    _f("task_key_not_the_checkpoints", 5, "data.task", "ppo", "bf16",
       {"model": SFT, "data": {"task": "sort"}},
       "data.task sort (the suite copied from the sort experiment) on the SFT checkpoint trained for "
       "digits: the prompts end with '|' and ask for the digits sorted, which the checkpoint never saw; "
       "it keeps answering its own task, so the run starts far below the checkpoint's skill",
       [["task", "sort", "digits"], ["checkpoint", "sft", "trained", "mismatch", "differ", "other"]],
       ["data.task", "task"], ["data.task", "digits", "task"], "warning"),
    _f("dpo_chosen_never_correct", 5, "data.dataset", "dpo", "bf16-pure",
       {"model": SFT, "data": {"dataset": DS + "near_miss_pairs"}},
       "preference pairs mined from the previous policy's samples: chosen is its best sample (three digits "
       "right, the last one off), rejected its worst; no chosen completion is the right answer, so DPO "
       "pulls the SFT policy, which answered right, toward the near-miss",
       [["chosen"], ["wrong", "incorrect", "never", "answer", "near"]],
       ["near_miss_pairs", "datasets.py", "dataset"], ["chosen", "answer", "reference", "correct"], "error"),
    _f("tokenizer_eos_as_first_token", 5, "model.tokenizer", "dpo", "bf16-pure",
       {"model": {**SFT, "tokenizer": "{assets.tok_eos_first}"}},
       "model.tokenizer names a re-export of the SFT tokenizer with a GPT-2-style template: every sequence "
       "starts with <eos> (its bos is set to eos) instead of <bos>, so every DPO prompt opens with an "
       "end-of-sequence token and the SFT model's answers collapse",
       [["eos", "bos", "first token", "start"], ["tokenizer", "template", "prompt"]],
       ["tok_eos_first", "model.tokenizer", "tokenizer"],
       ["bos", "tokenizer", "template", "post_processor"], "error"),
    _f("model_dir_rope_theta_reexport", 5, "model.path", "dpo", "fp32",
       {"model": {"preset": None, "path": "{assets.sft_rope_reexport}"}},
       "model.path names the SFT checkpoint re-exported by a conversion script that wrote its own default "
       "rope_theta 1e6 into config.json (the weights were trained with 10000): every position is encoded "
       "otherwise than in training, and the model no longer ends its answers with <eos>",
       [["rope", "rope_theta", "rotary", "position"], ["config", "checkpoint", "theta", "10000", "export"]],
       ["rope_theta", "sft_rope_reexport", "model.path", "config"],
       ["rope_theta", "10000", "config"], "error"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("rollout_bf16_under_fp16", 6, "precision.overrides.rollout", "grpo", "fp16", {},
       "an fp16 run whose rollout engine is overridden to bf16 weights and compute (from a GPU profile that "
       "had no fast fp16 decode): the samples and their log-probs come from a bf16 copy, 8x coarser than "
       "the fp16 trainer that scores them, so the rollout/trainer log-prob mismatch is bf16's",
       [["rollout"], BF16 + ["override", "mismatch", "differ"]],
       ["overrides.rollout", "precision.overrides", "rollout"],
       ["override", "fp16", "rollout", "remove"], "warning",
       variant={"precision": {"overrides": {"rollout": {"param_dtype": "bf16", "compute_dtype": "bf16",
                                                        "autocast": False}}}}),
    _f("reference_fp32_under_bf16_pure", 6, "precision.overrides.reference", "grpo", "bf16-pure", {},
       "a bf16-pure run whose reference is overridden to fp32 weights and compute ('the KL anchor should be "
       "exact'): the reference keeps the fp32 initial weights while the actor trains from their bf16 "
       "rounding (bf16-pure has no fp32 master), so the reference is not the actor's starting point and "
       "the KL is non-zero at step 0 from the weights' rounding alone",
       [REF, ["fp32", "float32", "override", "step 0", "differ", "rounding"]],
       ["overrides.reference", "precision.overrides", "reference"],
       ["override", "remove", "bf16", "reference"], "warning",
       variant={"precision": {"overrides": {"reference": {"param_dtype": "fp32", "compute_dtype": "fp32",
                                                          "autocast": False}}}}),
    _f("dpo_reference_bf16_under_fp16", 6, "precision.overrides.reference", "dpo", "fp16", {},
       "an fp16 DPO run whose reference is overridden to bf16 weights and compute (to match the serving "
       "copy): the reference's log-probs are a bf16 forward of the actor's starting weights while the actor "
       "runs fp16 autocast over fp32 masters, so policy and reference differ at step 0 and the implicit "
       "rewards start from rounding noise instead of 0",
       [REF, BF16 + ["override", "differ", "step 0"]],
       ["overrides.reference", "precision.overrides", "reference"],
       ["override", "remove", "fp16", "reference"], "warning",
       variant={"precision": {"overrides": {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16",
                                                          "autocast": False}}}}),
    _f("critic_fp16_unscaled", 6, "precision.overrides.critic.loss_scaling", "ppo", "fp16", {},
       "an fp16 PPO run with the critic's loss scaling turned off ('the value loss is large enough'): the "
       "critic's fp16 backward runs unscaled, so the value gradients that pass through its fp16 "
       "activations lose precision in the subnormal range or flush to 0",
       [["critic", "value"], ["loss_scaling", "scal", "underflow", "subnormal"] + FP16],
       ["loss_scaling", "overrides.critic", "precision.overrides"],
       ["loss_scaling", "dynamic", "override", "remove"], "warning",
       variant={"precision": {"overrides": {"critic": {"loss_scaling": "none"}}}}),
    _f("grad_dtype_bf16_not_applied", 6, "precision.overrides.actor.grad_dtype", "grpo", "bf16", {},
       "a bf16 run with the actor's grad_dtype overridden to bf16 (to halve the gradients' memory): the "
       "policy records bf16 gradients, but on one device .grad has the parameter's dtype (the fp32 "
       "masters), so the configured precision of the gradients is not what runs and the saving never "
       "happens",
       [["grad_dtype", "gradient"], ["fp32", "float32", "configured", "effective", "ignored", "not applied",
                                     "differ"]],
       ["grad_dtype", "overrides.actor", "precision.overrides"],
       ["grad_dtype", "remove", "override", "param_dtype"], "warning",
       variant={"precision": {"overrides": {"actor": {"grad_dtype": "bf16"}}}}),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_accumulation_not_averaged", 7, LOOP, "grpo", "fp32", {},
       "SGD with 4 micro-batches accumulated into each step; each micro-batch's loss is its own mean and is "
       "not divided by the number of micro-batches: the accumulated gradient is 4x the batch mean's, so "
       "every step is 4x the configured learning rate's",
       [["accumul", "micro"], ["divide", "average", "scale", "4x", "sum", "mean"]],
       ["own_loops", "loop_accumulation_not_averaged"],
       ["divide", "/ 4", "accum", "mean", "micro"], "error", loop="loop_accumulation_not_averaged"),
    _f("loop_rollout_in_train_mode", 7, LOOP, "grpo", "fp32", {},
       "the policy (attention_dropout 0.2, built with from_config and so in training mode) is never put in "
       "eval mode for sampling: the rollout's tokens and log-probs come from dropout-perturbed forwards, "
       "and the clipped ratio against them is off from 1 before any update",
       [["dropout", "train mode", "training mode", "eval"], ["rollout", "sampl", "generat", "log-prob",
                                                             "logprob", "ratio"]],
       ["own_loops", "loop_rollout_in_train_mode", "generate", "eval"],
       ["eval()", "model.eval", "eval", "dropout"], "error", loop="loop_rollout_in_train_mode"),
    _f("loop_ratio_detach_swapped", 7, LOOP, "grpo", "fp32", {},
       "the loop's ratio exp(new - old) against log-probs recomputed before the update detaches the new "
       "log-probs and keeps the graph of the old ones (the two .detach() calls swapped): the gradient flows "
       "through the denominator, so every update moves the policy against the advantage",
       [["detach", "graph", "ratio", "old"], ["swap", "wrong", "denominator", "new", "direction", "sign",
                                              "opposite", "lower"]],
       ["own_loops", "loop_ratio_detach_swapped"],
       ["detach", "old", "no_grad"], "error", loop="loop_ratio_detach_swapped"),
    _f("loop_decay_per_micro_batch", 7, LOOP, "grpo", "bf16", {},
       "hand-written decoupled weight decay p *= 1 - wd with wd 0.1, inside the loop over 4 micro-batches "
       "(meant: p *= 1 - lr x wd, once per step): every step multiplies every weight by 0.9^4 = 0.66, the "
       "weights shrink toward 0 whatever the loss",
       [["decay", "weight", "shrink", "norm"], ["micro", "every", "lr", "step", "per"]],
       ["own_loops", "loop_decay_per_micro_batch"],
       ["weight_decay", "lr", "decay", "once"], "error", loop="loop_decay_per_micro_batch"),
    _f("loop_clip_on_reference", 7, LOOP, "grpo", "fp32", {},
       "the loop clips gradients to norm 0.02 but calls clip_grad_norm_ on the frozen reference's parameters "
       "(which have no gradients) instead of the policy's: the policy's SGD steps are never clipped (its "
       "gradient norm is ~0.1, several times 0.02)",
       [["clip", "clip_grad_norm"], ["reference", "wrong", "parameters", "never", "unclipped", "policy"]],
       ["own_loops", "loop_clip_on_reference", "clip_grad_norm"],
       ["model.parameters", "clip_grad_norm", "policy", "parameters"], "error", loop="loop_clip_on_reference"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 171, "model": {"reward_model": RM + "load_wide_probability_scorer"}},
    "ppo_fp16": {"seed": 172, "model": SFT, "algo": {"kl_coef": 0.005}},
    "ppo_bf16": {"seed": 173, "model": {"setup": {"critic": SU + "mlp_value_head"}}},
    "ppo_bf16_pure": {"seed": 174, "data": {"collator": CO + "padded_prompts"}},
    "grpo_fp32": {"seed": 175, "data": {**VERL, "train_files": "{assets.sum_rows}",
                                        "compute_score": SC + "exact_score"}},
    "grpo_fp16": {"seed": 176, "data": {"reward_fn": RW + "scaled_credit"}},
    "grpo_bf16": {"seed": 177, "algo": {"loss_mode": "gspo", "clip_ratio": 0.0004}},
    "grpo_bf16_pure": {"seed": 178, "algo": {"group_size": 8, "batch_size": 2}},
    "dpo_fp32": {"seed": 179, "data": {"dataset": DS + "answer_pairs"}},
    "dpo_fp16": {"seed": 180, "algo": {"dpo_loss": "ipo", "beta": 0.5}},
    "dpo_bf16": {"seed": 181, "model": SFT, "data": {"dataset": DS + "answer_pairs"}},
    "dpo_bf16_pure": {"seed": 182, "algo": {"beta": 0.2}},
}  # fmt: skip
"""Per-control variations: new seeds, and a correct plug-in or setting each (a reward model with a useful
spread, the SFT checkpoint, a critic value head, a collator, verl rows with an exact compute_score, a reward
function, GSPO with its own clip, larger groups, a pair dataset, IPO, another beta)."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_bf16_clipped_ratio", "algo": "grpo", "preset": "bf16", "train": {},
     "loop": "loop_bf16_clipped_ratio_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop; a correct
diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
