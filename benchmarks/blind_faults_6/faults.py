"""The sixth blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. None repeats a mechanism of benchmarks/blind_faults/ .. benchmarks/blind_faults_5/
(their faults.py).

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`), ``variant`` (if any) onto the variant's
``precision: {preset: ...}``; ``{plugins}`` and ``{assets.NAME}`` in their strings become the absolute
plug-in folder and asset paths (`benchmarks/blind_faults_6/assets.py`). A fault with ``loop`` instead runs
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
SFT_TIED = {"preset": None, "path": "{assets.sft_tied_lm}"}
VERL = {"prompt_length": 32, "response_length": 8}
LOOP = "own loop (verlaudit.watch)"
CONSTANT = ["constant", "identical", "same", "no signal", "no variance", "zero variance", "distinct", "ties",
            "collapsed"]  # fmt: skip
SCORE = ["reward", "score"]
ROUNDING = ["precision", "round", "quantis", "quantiz", "resolution", "spacing", "lost"]

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rm_serving_autocast_bf16", 1, "model.reward_model", "grpo", "fp32",
       {"model": {"reward_model": RM + "load_serving_scorer"}},
       "an fp32 run whose reward model comes from a user loader whose forward (copied from the RM team's "
       "inference server) runs under torch.autocast('cpu', bfloat16): the RM's logits sit around 24 with a "
       "spread of ~0.04, bf16's spacing there is 0.125, so 32 distinct scores become 2-3 values (the "
       "configured fp32 reward role computes in bf16)",
       [BF16 + ["autocast"] + ROUNDING + CONSTANT, SCORE],
       ["load_serving_scorer", "ServingScorer", "reward_models.py", "reward_model"],
       ["autocast", "fp32", "float32", "remove"], "error"),
    _f("rf_score_read_from_log_line", 1, "data.reward_fn", "ppo", "bf16",
       {"data": {"reward_fn": RW + "judge_logged_reward"}},
       "the reward function takes the judge's calibrated probability (0.88..0.92) and returns it read back "
       "from the client's log record, which formats it with one decimal ('%.1f'): every reward is 0.9",
       [ROUNDING + ["decimal", "format", "string", "log"] + CONSTANT, SCORE],
       ["judge_logged_reward", "rewards.py", "reward_fn"],
       ["format", "decimal", "raw", "round", ".1f", "float"], "error"),
    _f("cs_decimal_context_precision", 1, "data.compute_score", "grpo", "fp32",
       {"data": {**VERL, "train_files": "{assets.three_digit_rows}", "compute_score": VS + "decimal_score"}},
       "the verl compute_score compares answers as decimal.Decimal with unary plus, in a module that sets "
       "decimal.getcontext().prec = 2 for the billing report: both sides are rounded to two significant "
       "digits, so '1230' and '1199' count as right for a truth of 1234 (three- and four-digit sums "
       "compared at two digits)",
       [["decimal", "prec", "context", "significant", "round", "precision"], ["score", "reward", "answer",
                                                                              "compare", "equal", "wrong"]],
       ["decimal_score", "verl_scoring.py", "compute_score"],
       ["prec", "context", "localcontext", "==", "exact", "str", "int("], "error"),
    _f("rm_predicted_label_reward", 1, "model.reward_model", "ppo", "fp16",
       {"model": {"reward_model": RM + "load_label_scorer"}},
       "the reward-model loader returns a two-class classifier whose forward gives logits.argmax(-1), the "
       "predicted label, instead of P(good): the score is quantised to {0, 1}, and since every response's "
       "P(good) is 0.94..0.96 every reward is exactly 1",
       [["argmax", "label", "class", "binary", "quantis", "quantiz", "discret"] + CONSTANT, SCORE],
       ["load_label_scorer", "LabelScorer", "reward_models.py", "reward_model"],
       ["softmax", "probability", "logit", "argmax"], "error"),
    _f("rm_dynamic_int8_quantized", 1, "model.reward_model", "ppo", "fp32",
       {"model": {"reward_model": RM + "load_quantized_scorer"}},
       "the reward-model loader applies torch.ao dynamic int8 quantisation to the RM's linear layers (to "
       "fit the CPU scoring node): its pooled features sit around 4.0 with a spread of 0.02, the "
       "per-tensor activation scale (range including 0) is ~0.03, so the quantisation error (~0.05) is "
       "larger than the scores' spread (~0.01) and the reward ranking is mostly noise",
       [["int8", "quantis", "quantiz", "qint8"] + ROUNDING, SCORE],
       ["load_quantized_scorer", "reward_models.py", "reward_model", "quantize_dynamic"],
       ["quantiz", "quantis", "fp32", "float", "remove"], "error"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("dpo_rejected_prompt_rotated", 2, "data.collator", "dpo", "fp32",
       {"data": {"collator": CO + "paired_rows"}},
       "the DPO collator builds the rejected rows from the examples rotated by one (a second, offset read "
       "of the shard): each pair's rejected completion follows another example's prompt, so chosen and "
       "rejected of a pair no longer share their prompt",
       [["prompt"], ["differ", "mismatch", "share", "same prompt", "other", "pair", "rejected", "misalign"]],
       ["paired_rows", "collators.py", "collator"],
       ["same prompt", "prompt", "shift", "rotat", "align"], "error"),
    _f("dpo_pairs_format_noise_only", 2, "data.dataset", "dpo", "bf16",
       {"data": {"dataset": DS + "formatting_negative_pairs"}},
       "the preference pairs' rejected side is the chosen answer plus a trailing space (the negative-mining "
       "script's 'format noise' mode): every pair differs in one whitespace token only, the preference "
       "carries no information about the answer",
       [["near-identical", "identical", "same", "whitespace", "space", "differ only", "one token", "equal"],
        ["pair", "chosen", "rejected", "preference"]],
       ["formatting_negative_pairs", "data_sources.py", "dataset"],
       ["filter", "whitespace", "strip", "distinct", "negative", "drop"], "error"),
    _f("rf_scores_against_first_example", 2, "data.reward_fn", "grpo", "fp16",
       {"data": {"reward_fn": RW + "first_answer_reward"}},
       "the reward function looks the answer up once, examples[0]['answer'], and scores every response of "
       "the batch against it: only the first prompt's group is scored against its own answer, the other "
       "groups against another prompt's",
       [["answer", "example", "row", "prompt"], ["first", "wrong", "other", "same", "mismatch", "every",
                                                 "misassign"]],
       ["first_answer_reward", "rewards.py", "reward_fn"],
       ["per row", "each example", "zip", "its own", "examples[i]", "per example"], "error"),
    _f("collator_mask_hides_bos", 2, "data.collator", "ppo", "bf16-pure",
       {"model": SFT, "data": {"collator": CO + "character_mask_prompts"}},
       "the collator's attention mask is ids > bos_token_id ('1 on the characters'): besides the padding it "
       "masks out the <bos> that starts every prompt, a real token the SFT model was trained to attend to",
       [["mask", "attention_mask"], ["bos", "real token", "special", "begin", "first token"]],
       ["character_mask_prompts", "collators.py", "collator"],
       ["!= pad", "pad_token_id", "bos", "mask"], "error"),
    _f("verl_truncation_right_system_prompt", 2, "data.truncation", "grpo", "fp32",
       {"data": {**VERL, "train_files": "{assets.sys_prompt_rows}", "compute_score": VS + "partial_score",
                 "truncation": "right"}},
       "verl rows that start with a 57-character system message, prompt_length 32 and truncation right "
       "(keep the start): every rendered prompt is cut inside the shared system message, so all prompts "
       "are the same 32 tokens and the question never reaches the policy",
       [["truncat", "cut", "prompt_length"], ["identical", "same", "distinct", "collapse", "system", "question"]],
       ["truncation", "prompt_length", "data.truncation"],
       ["truncation", "left", "prompt_length", "filter_overlong"], "error"),
    _f("setup_eval_mode_logit_temperature", 2, "model.setup.actor", "grpo", "fp32",
       {"model": {"setup": {"actor": SU + "serving_logits"}}},
       "the actor setup registers a hook dividing the logits by 0.7 when the model is in eval mode (to match "
       "the serving stack): the rollout (eval mode) samples from the sharpened policy, the old log-probs and "
       "the update (train mode) score the raw one, so in a same-dtype fp32 run rollout and trainer "
       "log-probs disagree on every token",
       [["eval", "mode", "temperature", "hook", "training mode"], ["mismatch", "differ", "rollout", "log-prob",
                                                                  "logprob", "ratio"]],
       ["serving_logits", "model_setup.py", "setup"],
       ["hook", "remove", "temperature", "both modes"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("dual_clip_c_near_one", 3, "algo.clip_ratio_c", "ppo", "bf16",
       {"algo": {"clip_ratio_c": 1.01, "ppo_epochs": 4, "mini_batch_size": 4, "micro_batch_size": 4}},
       "clip_ratio_c 1.01 (verl's dual-clip bound, default 3): every negative-advantage token whose ratio "
       "passes 1.01 contributes the constant -A c with zero gradient, so after the first mini-batch of 8 "
       "updates the policy can no longer push down bad tokens it has made more likely",
       [["clip_ratio_c", "dual", "clip"]], ["clip_ratio_c"], ["clip_ratio_c"], "warning"),
    _f("dpo_beta_vanishing", 3, "algo.beta", "dpo", "fp16", {"algo": {"beta": 1.0e-4}},
       "DPO beta 1e-4: beta x margin stays ~0, the loss is log 2 - beta x margin / 2, linear in the margin; "
       "Adam's normalised steps move the policy at full speed with no implicit KL anchor (the sigmoid never "
       "saturates), so the log-probs drift while the loss reads 0.6931 throughout",
       [["beta"]], ["beta", "algo.beta"], ["beta", "0.1"], "warning"),
    _f("lr_vanishing", 3, "algo.lr", "grpo", "fp32", {"algo": {"lr": 1.0e-8}},
       "actor learning rate 1e-8 (GRPO recipes use 1e-6 for 7B models; this tiny model's suite uses 1e-3): "
       "each Adam step moves every weight by ~1e-8, the policy does not change over the run (KL to the "
       "reference stays ~0), the rewards never move",
       [["lr", "learning rate", "learning_rate"]], ["algo.lr", "lr"], ["lr", "learning rate"], "warning"),
    _f("gae_lambda_zero", 3, "algo.lam", "ppo", "fp32", {"algo": {"lam": 0.0}},
       "GAE lambda 0 with an outcome reward on the last token and an untrained critic: each token's "
       "advantage is the one-step TD error r + V(next) - V(now); the reward reaches only the last token's "
       "advantage, every earlier token is trained on the random critic's value differences",
       [["lam", "lambda", "gae"]], ["algo.lam", "lam"], ["lam", "0.95", "lambda"], "warning"),
    _f("kl_loss_k1_estimator", 3, "algo.kl_loss_type", "grpo", "bf16",
       {"algo": {"kl_loss_type": "kl", "kl_loss_coef": 0.2}},
       "kl_loss_type kl (the k1 estimator logp - ref_logp) as the actor's KL loss with coefficient 0.2: on "
       "samples from the policy its gradient is the score function, whose expectation is zero, so the "
       "'KL regularisation' adds noise and no pull towards the reference (k3 / low_var_kl or k2 has the "
       "KL's gradient)",
       [["kl_loss_type", "k1", "estimator", "kl loss", "kl_loss"]], ["kl_loss_type"],
       ["low_var_kl", "k3", "k2", "mse", "kl_loss_type"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_prunes_last_layer", 4, "model.setup", "dpo", "bf16",
       {"model": {**SFT, "setup": SU + "drop_last_layer"}},
       "the setup removes the last decoder layer of every role (layer dropping for faster RL, from a pruning "
       "recipe): the loaded policy and its reference are a 1-layer truncation of the 2-layer SFT checkpoint "
       "and no longer answer like it (DPO starts from a broken policy)",
       [["layer", "decoder", "pruned", "removed", "num_hidden_layers"], ["setup", "changed", "model",
                                                                         "checkpoint", "replaced"]],
       ["drop_last_layer", "model_setup.py", "setup"], ["layer", "remove", "prun", "num_hidden_layers"],
       "error"),
    _f("setup_freeze_tied_embeddings", 4, "model.setup.actor", "ppo", "bf16-pure",
       {"model": {**SFT_TIED, "setup": {"actor": SU + "freeze_input_embeddings"}}},
       "the actor setup freezes the input embeddings (a memory-saving recipe) of a model that ties its "
       "output head to them: the output head is the same tensor, so it is frozen too and the policy's "
       "logits layer never trains",
       [["tied", "tie", "lm_head", "output head", "head", "embedding"], ["frozen", "freeze", "requires_grad",
                                                                        "not train"]],
       ["freeze_input_embeddings", "model_setup.py", "setup"],
       ["untie", "tie_word_embeddings", "requires_grad", "head", "unfreeze"], "warning"),
    _f("setup_head_eos_logit_bias", 4, "model.setup.actor", "dpo", "fp32",
       {"model": {**SFT, "setup": {"actor": SU + "biased_output_head"}}},
       "the actor setup replaces the SFT output head by an nn.Linear whose bias holds the serving API's logit "
       "bias (-5 on <eos>, to stop empty answers): the actor's <eos> logit is 5 below the SFT model's, so "
       "the actor is no longer the reference it is compared with (DPO's implicit rewards are "
       "non-zero before any update) and it learns answers that do not stop",
       [["bias", "head", "lm_head", "output", "eos"], ["setup", "reference", "differ", "changed", "actor"]],
       ["biased_output_head", "model_setup.py", "setup"], ["bias", "zero", "eos", "remove"], "error"),
    _f("setup_freeze_heads_by_name", 4, "model.setup", "ppo", "fp32",
       {"model": {"setup": SU + "freeze_heads"}},
       "the setup (every role) freezes each parameter whose name contains 'head', meant for the actor's "
       "lm_head: the critic's value_head matches too, so the critic's value head never trains and its "
       "values stay at their near-zero init",
       [["value_head", "value head", "critic", "head"], ["frozen", "freeze", "requires_grad", "not train"]],
       ["freeze_heads", "model_setup.py", "setup"],
       ["value_head", "lm_head", "role", "requires_grad", "name"], "error"),
    _f("setup_grad_clamp_hooks", 4, "model.setup.actor", "dpo", "fp16",
       {"model": {"setup": {"actor": SU + "clamped_gradients"}}},
       "the actor setup registers an element-wise gradient clamp to +-1e-3 on every parameter: under fp16 "
       "the hooks see the loss-scaled gradients (x65536), so nearly every element is clamped, and after "
       "unscaling the update follows sign(g) x 1.5e-8 instead of the gradient",
       [["clamp", "hook", "gradient", "grad"], ["setup", "scale", "clip", "element"]],
       ["clamped_gradients", "model_setup.py", "setup"],
       ["hook", "remove", "clip_grad_norm", "max_grad_norm", "clamp"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("dataset_prompt_trailing_space", 5, "data.dataset", "grpo", "bf16",
       {"model": SFT, "data": {"dataset": DS + "spaced_prompts"}},
       "the dataset's prompts end with a space after the colon ('4 7 1 9: '): every prompt ends in a token "
       "the SFT model never saw before its answer, and its answers (trained to follow ':' directly) degrade",
       [["space", "whitespace", "trailing"], ["prompt", "format", "token", "dataset"]],
       ["spaced_prompts", "data_sources.py", "dataset"], ["strip", "space", "trailing", "format"], "error"),
    _f("dataset_labels_reseeded_constant", 5, "data.dataset", "ppo", "fp16",
       {"data": {"dataset": DS + "relabelled_examples"}},
       "the synthetic generator picks each example's target digit with a fresh random.Random(seed) per "
       "example (meant: seed + i): every prompt starts with the same digit and every answer is '7777', so "
       "the policy is rewarded for one constant output whatever the prompt",
       [["answer", "label", "target"], CONSTANT + ["one value", "single", "all the same", "degenerate"]],
       ["relabelled_examples", "data_sources.py", "dataset"],
       ["seed", "rng", "random", "shared", "seed + i"], "error"),
    _f("prompt_length_cuts_first_digit", 5, "data.prompt_length", "grpo", "fp32",
       {"data": {"dataset": DS + "long_digit_prompts"}},
       "prompts of 8-10 digits ('d d ... d:', 15-19 characters + bos) with prompt_length 16: the trainer "
       "keeps each prompt's end, so about two thirds of the prompts lose <bos> and the first digit, the "
       "one the answer repeats",
       [["truncat", "cut", "prompt_length", "longer"], ["prompt", "first", "digit", "token", "lost"]],
       ["prompt_length", "long_digit_prompts", "data_sources.py"],
       ["prompt_length", "truncation", "longer"], "error"),
    _f("tokenizer_max_length_truncation", 5, "model.tokenizer", "ppo", "fp32",
       {"model": {**SFT, "tokenizer": "{assets.tok_max_len6}"}, "data": {"collator": CO + "truncating_prompts"}},
       "model.tokenizer names a copy of the SFT tokenizer re-saved by another project's export script with "
       "model_max_length 6 (truncation side left), and the collator tokenises with truncation=True: every "
       "prompt longer than 6 tokens keeps only its last 6 ('7 1 9:'), so 3-digit prompts lose <bos> and "
       "4-digit prompts also lose the first digit, the one the answer repeats",
       [["truncat", "model_max_length", "cut", "max_length"], ["prompt", "tokenizer", "token"]],
       ["model_max_length", "tok_max_len6", "tokenizer", "truncating_prompts", "collator"],
       ["model_max_length", "truncation", "max_length"], "error"),
    _f("dpo_chosen_cut_before_eos", 5, "data.dataset", "dpo", "bf16-pure",
       {"data": {"dataset": DS + "rationale_pairs"}},
       "chosen completions are the answer plus the annotator's justification ('4444 as first is 4', 18 "
       "characters), rejected ones a bare wrong answer: response_length 8 cuts every chosen side before its "
       "eos while every rejected side ends with eos, so the pairs teach 'do not stop' as much as the answer",
       [["eos", "truncat", "cut", "length", "response_length"], ["chosen", "pair", "completion", "rejected"]],
       ["rationale_pairs", "data_sources.py", "dataset", "response_length"],
       ["response_length", "justification", "rationale", "strip", "eos"], "warning"),
    _f("num_examples_smoke_test", 5, "data.num_examples", "grpo", "fp16", {"data": {"num_examples": 2}},
       "data.num_examples 2 (left from a smoke test): the run trains on two prompts, every batch of four is "
       "the same two prompts repeated, the policy memorises two answers",
       [["num_examples", "examples", "dataset", "prompts"], ["two", "few", "repeat", "duplicate", "distinct",
                                                            "small"]],
       ["num_examples"], ["num_examples"], "warning"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("critic_bf16_weights_verl_lr", 6, "precision.overrides.critic", "ppo", "bf16",
       {"algo": {"critic_lr": 1.0e-5}},
       "a bf16 run with the critic overridden to bf16 parameters (no fp32 master copy, to save memory) and "
       "verl's default critic lr 1e-5: each Adam step (~1e-5 per weight) is below half a bf16 ulp of the "
       "critic's weights (~1e-4 at 0.02..0.1), so it rounds back and the critic never trains",
       [["critic"], BF16 + ["master", "ulp", "round", "param_dtype", "lost"]],
       ["overrides.critic", "precision.overrides", "param_dtype", "critic"],
       ["param_dtype", "fp32", "master", "critic_lr", "override"], "warning",
       variant={"precision": {"overrides": {"critic": {"param_dtype": "bf16", "compute_dtype": "bf16",
                                                       "autocast": False}}}}),
    _f("optim_state_bf16_not_applied", 6, "precision.overrides.actor.optim_state_dtype", "grpo", "bf16", {},
       "a bf16 run with the actor's optim_state_dtype overridden to bf16 (to halve the AdamW moments' "
       "memory): the policy records bf16 moments, but the optimizer keeps its moments in the parameter "
       "dtype (the fp32 master weights), so the configured saving never happens (configured and effective "
       "optimizer-state precision differ)",
       [["optim_state", "optimizer state", "moment", "adam"], ["fp32", "float32", "configured", "effective",
                                                               "ignored", "not applied", "differ"]],
       ["optim_state_dtype", "overrides.actor", "precision.overrides"],
       ["optim_state_dtype", "remove", "override", "param_dtype"], "warning",
       variant={"precision": {"overrides": {"actor": {"optim_state_dtype": "bf16"}}}}),
    _f("critic_compute_bf16_under_fp32", 6, "precision.overrides.critic.compute_dtype", "ppo", "fp32", {},
       "an fp32 run with the critic's compute overridden to bf16 (autocast, 'the critic need not be exact'): "
       "the values and their gradients carry bf16 rounding (~0.4% of each activation) in a run whose "
       "contract, rollout and actor are fp32",
       [["critic", "value"], BF16 + ["compute", "autocast", "override"]],
       ["overrides.critic", "precision.overrides", "compute_dtype"],
       ["override", "fp32", "compute_dtype", "remove"], "warning",
       variant={"precision": {"overrides": {"critic": {"compute_dtype": "bf16"}}}}),
    _f("bf16_pure_grad_accumulation_micro1", 6, "precision.preset", "grpo", "bf16-pure",
       {"algo": {"batch_size": 16, "micro_batch_size": 1, "mini_batch_size": 64}},
       "bf16-pure (bf16 gradients, no fp32 accumulation buffer) with micro_batch_size 1 and mini_batch_size "
       "64: each optimizer step sums 64 micro-batch gradients into a bf16 .grad, each addition rounding to "
       "bf16's 8 bits while the running sum grows 64x past each addend, so the accumulated gradient carries "
       "several times the error of one bf16 rounding",
       [BF16 + ["bf16-pure"], ["accumul", "micro", "gradient", "grad", "round", "sum"]],
       ["precision.preset", "micro_batch_size", "bf16-pure"],
       ["micro_batch_size", "fp32", "bf16", "grad_dtype", "accumul"], "warning"),
    _f("fp16_init_scale_huge", 6, "precision.overrides.actor.init_scale", "ppo", "fp16", {},
       "an fp16 run whose actor loss scaler starts at 2^40 (dynamic, the value copied from a recipe that "
       "meant 2^16 as 'init_scale: 65536'): every scaled gradient overflows, each step is skipped and the "
       "scale halves once per step, so the first ~24 steps of the actor never update (all 3 here)",
       [["scale", "init_scale", "loss scale"], ["overflow", "skip", "inf", "huge", "large"] + FP16],
       ["init_scale", "overrides.actor", "precision.overrides"],
       ["init_scale", "65536", "2**16", "override"], "error",
       variant={"precision": {"overrides": {"actor": {"init_scale": 1099511627776.0}}}}),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_advantage_broadcast_over_tokens", 7, LOOP, "grpo", "fp32", {},
       "the loop multiplies the per-sequence advantage [B] with the token log-probs [B, T] without "
       "[:, None]; with 8 prompts and 8 new tokens it broadcasts silently along the token axis: token j of "
       "every response is weighted by response j's advantage",
       [["advantage", "broadcast", "shape"], ["token", "broadcast", "axis", "dimension", "row", "sequence"]],
       ["own_loops", "loop_advantage_broadcast_over_tokens", "advantage"],
       ["[:, none]", "unsqueeze", "broadcast", "shape"], "error", loop="loop_advantage_broadcast_over_tokens"),
    _f("loop_update_forward_without_mask", 7, LOOP, "grpo", "fp32", {},
       "the rollout generates from left-padded prompts with their attention mask, the update's forward is "
       "model(input_ids=seq) without it: the trained log-probs attend to the padding, in a same-dtype run "
       "they disagree with the rollout's on every token",
       [["mask", "attention_mask", "padding"], ["forward", "update", "log-prob", "logprob", "rollout",
                                               "mismatch", "differ"]],
       ["own_loops", "loop_update_forward_without_mask", "attention_mask"],
       ["attention_mask", "mask"], "error", loop="loop_update_forward_without_mask"),
    _f("loop_response_slice_off_by_one", 7, LOOP, "grpo", "bf16", {},
       "the loop decodes the responses for the reward as seq[:, PROMPT_LEN - 1:] (the log-prob slice): "
       "every decoded response starts with the prompt's last character ':', so the reward compares the "
       "answer shifted by one position (an exact answer scores 0.75: ':444' against '4444')",
       [["reward", "response", "decode", "slice"], ["off by one", "off-by-one", "shift", "prompt", "position",
                                                    "extra", "offset"]],
       ["own_loops", "loop_response_slice_off_by_one", "reward", "decode"],
       ["prompt_len", "slice", "seq[:,", "offset", "decode"], "error", loop="loop_response_slice_off_by_one"),
    _f("loop_lr_written_to_wrong_key", 7, LOOP, "grpo", "fp32", {},
       "the loop builds AdamW with lr 0 and a hand-written warmup that writes group['learning_rate'] (the "
       "config file's name) instead of group['lr']: the optimizer's learning rate stays 0, every step is a "
       "no-op while the gradients are non-zero",
       [["lr", "learning rate", "learning_rate"], ["zero", "0", "never", "no-op", "not change", "param_group"]],
       ["own_loops", "loop_lr_written_to_wrong_key", "lr", "optimizer"],
       ["'lr'", "lr", "param_groups", "scheduler"], "error", loop="loop_lr_written_to_wrong_key"),
    _f("loop_double_loss_scaling", 7, LOOP, "grpo", "fp16", {},
       "fp16 + GradScaler; the loop passes scaler.scale(loss) to the team's backward helper, which scales "
       "again: the backward runs on loss x scale^2 (2^32), every fp16 gradient overflows, every step is "
       "skipped while the scaler halves (its unscale_ divides by the scale once)",
       [["scale", "scaler", "loss scale"], ["twice", "double", "scale^2", "squared", "overflow", "skip"]],
       ["own_loops", "loop_double_loss_scaling", "_scaled_backward", "scaler"],
       ["scale once", "scaler.scale", "once", "remove"], "error", loop="loop_double_loss_scaling"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 71, "model": {"reward_model": RM + "load_logit_scorer"}},
    "ppo_fp16": {"seed": 72, "data": {"response_length": 6}, "algo": {"kl_coef": 0.02}},
    "ppo_bf16": {"seed": 73, "model": {"setup": {"critic": SU + "mlp_value_head"}}},
    "ppo_bf16_pure": {"seed": 74, "algo": {"gamma": 0.99, "lam": 0.9}},
    "grpo_fp32": {"seed": 75, "data": {**VERL, "train_files": "{assets.arith_rows}",
                                       "compute_score": VS + "partial_score"}},
    "grpo_fp16": {"seed": 76, "data": {"reward_fn": RW + "per_row_credit"}},
    "grpo_bf16": {"seed": 77, "data": {"collator": CO + "left_padded_prompts"}},
    "grpo_bf16_pure": {"seed": 78, "algo": {"group_size": 8, "batch_size": 2}},
    "dpo_fp32": {"seed": 79, "data": {"dataset": DS + "clean_pairs"}},
    "dpo_fp16": {"seed": 80, "algo": {"beta": 0.3}},
    "dpo_bf16": {"seed": 81, "model": SFT},
    "dpo_bf16_pure": {"seed": 82, "data": {"response_length": 6}},
}  # fmt: skip
"""Per-control variations from the previous benches' controls: seeds, a task, a correct plug-in of some kinds
(reward model, critic setup, verl rows with a compute_score, reward function, collator, dataset), an SFT
checkpoint, another DPO beta, GAE settings, group size, response length and KL coefficient."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_bf16_reference_kl", "algo": "grpo", "preset": "bf16", "train": {},
     "loop": "loop_bf16_reference_kl_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop (bf16 autocast,
a frozen reference passed to watch, the KL detached into the reward, clipping between backward and step); a
correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
