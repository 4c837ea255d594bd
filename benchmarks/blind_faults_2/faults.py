"""The second blind fault table: every planted fault with the answer a correct diagnosis should give, and
the clean controls. None repeats a mechanism of benchmarks/blind_faults/faults.py.

Each suite fault is one suite of one variant (named after the fault) on the tiny CPU model. ``train`` is
deep-merged onto the algorithm's base config (`BASE`); ``{plugins}`` and ``{assets.NAME}`` in its strings
become the absolute plug-in folder and asset directories (`benchmarks/blind_faults_2/assets.py`). A fault
with ``loop`` instead runs ``plugins/own_loops.py LOOP RUN_DIR`` (the user's own loop under
``verlaudit.watch``).

Scoring fields (see run_blind.py): ``root_words`` is a list of word groups, and the first cause's
title / where / kind / what must contain a word of every group; ``culprit``: any of them must appear in
the first cause's where or title; ``fix_words``: any of them in the first fix's suite / verl / why text;
``severity``: the verdict a correct diagnosis gives (reported, not scored). Written before any run.
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
"""The shipped tiny suites' settings, smaller batches, 3 steps (the previous bench's bases)."""

AUDIT: dict[str, dict[str, Any]] = {
    "ppo": {"level": "full", "full_steps": 2, "every": 10},
    "grpo": {"level": "full", "full_steps": 2, "every": 10},
    "dpo": {"level": "full", "full_steps": 2, "every": 10, "shadow": True},
}

FP16 = ["fp16", "float16", "half"]
BF16 = ["bf16", "bfloat16"]
NONFINITE = ["nan", "non-finite", "nonfinite", "inf", "not finite"]


def _f(name, cls, point, algo, preset, train, mechanism, root_words, culprit, fix_words, severity, loop=None):
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
    return out


RW = "{plugins}/rewards.py:"
RM = "{plugins}/reward_models.py:"
CO = "{plugins}/collators.py:"
DS = "{plugins}/data_sources.py:"
SU = "{plugins}/model_setup.py:"
VS = "{plugins}/verl_scoring.py:"
VERL = {"train_files": "{assets.arith_rows}", "prompt_length": 32, "response_length": 8}

FAULTS: list[dict[str, Any]] = [
    # ------------------------------------------------------------ 1. precision lost in user code
    _f("rf_fp16_std_eps", 1, "data.reward_fn", "grpo", "fp32",
       {"data": {"reward_fn": RW + "standardized_exact_reward"}},
       "the reward function standardises exact-match rewards over the batch in fp16 with eps 1e-8, which is 0 "
       "in fp16: when every reward is equal (all 0 early on) it computes 0 / 0 and returns NaN rewards",
       [NONFINITE, ["reward", "score", "std", "eps", "standardi", "normali", "divis"]],
       ["standardized_exact_reward", "rewards.py", "reward_fn"],
       ["float32", "fp32", "eps", "float"], "error"),
    _f("rf_fp16_norm_overflow", 1, "data.reward_fn", "ppo", "bf16",
       {"data": {"reward_fn": RW + "char_profile_reward"}},
       "a cosine-similarity reward squares weighted character counts (320^2 = 102400) in fp16; the square "
       "overflows to inf, so the norm is inf and every similarity is 0 (or inf / inf = NaN)",
       [FP16 + ["overflow", "65504"], ["reward", "score", "norm", "overflow", "inf", "nan"]],
       ["char_profile_reward", "rewards.py", "reward_fn"],
       ["float32", "fp32", "float", "normalize"], "error"),
    _f("rm_bf16_prefix_cancel", 1, "model.reward_model", "ppo", "bf16",
       {"model": {"reward_model": RM + "load_response_sum_rm"}},
       "the reward model scores the response as the difference of two bf16 running sums (~1300 and ~800, "
       "bf16 spacing 4-8): catastrophic cancellation quantises the scores to a few values",
       [BF16 + ["cancel", "cumsum", "running sum", "round"], ["score", "reward", "cancel", "precision",
                                                              "quantis", "quantiz", "distinct", "resolution"]],
       ["load_response_sum_rm", "reward_models.py", "reward_model"],
       ["float32", "fp32", "float"], "warning"),
    _f("cs_uint8_length_wrap", 1, "data.compute_score", "grpo", "fp32",
       {"data": {**VERL, "compute_score": VS + "compute_score"}},
       "the verl compute_score keeps lengths in a numpy uint8 array; ground-truth length minus a longer "
       "solution's length wraps around to ~250, so the length penalty is ~12 and rewards are hugely negative",
       [["uint8", "unsigned", "wrap", "overflow", "underflow", "integer"], ["length", "penalty", "score",
                                                                             "reward"]],
       ["compute_score", "verl_scoring.py"],
       ["int", "int64", "float", "signed", "abs"], "warning"),
    # ------------------------------------------------------------ 2. violated run invariants
    _f("collator_reorders_rows", 2, "data.collator", "grpo", "bf16",
       {"data": {"collator": CO + "length_bucketed_prompts"}},
       "the collator sorts the prompts by length (longest first), so row i of input_ids is no longer example "
       "i: each response is rewarded against another prompt's answer",
       [["order", "sort", "row", "align", "match", "example", "permut", "shuffl"]],
       ["length_bucketed_prompts", "collators.py", "collator"],
       ["order", "sort", "example"], "error"),
    _f("reference_is_actor", 2, "model.setup.reference", "grpo", "fp32",
       {"model": {"setup": SU + "share_policy_weights"}},
       "the setup hands the reference role the actor module itself (to save memory), so the reference moves "
       "with the policy and the KL term is identically 0: no KL regularisation at all",
       [["reference", "ref"], ["actor", "same", "shared", "alias", "identical", "policy", "kl"]],
       ["share_policy_weights", "model_setup.py", "setup"],
       ["copy", "reference", "deepcopy", "frozen", "separate"], "error"),
    _f("rm_scores_last_column", 2, "model.reward_model", "ppo", "fp32",
       {"model": {"preset": None, "path": "{assets.sft_lm}", "reward_model": RM + "load_last_token_rm"}},
       "the reward model scores the embedding of the last column, ignoring the attention mask; the SFT "
       "policy stops after 5 tokens, so for most rows the last column is padding and the score is the pad "
       "token's, the same for every response",
       [["pad", "mask", "last"], ["reward", "score", "token", "position"]],
       ["load_last_token_rm", "reward_models.py", "reward_model"],
       ["mask", "last non-pad", "attention_mask", "pad"], "error"),
    _f("reward_fn_key_wrong_column", 2, "data.reward_fn_key", "grpo", "bf16-pure",
       {"data": {**VERL, "compute_score": VS + "compute_score_by_source", "reward_fn_key": "ability"}},
       "data.reward_fn_key 'ability' passes the rows' ability ('math') as data_source; the user's dispatch "
       "has no scorer for it and returns 0, so every reward is 0 whatever the response",
       [["reward_fn_key", "data_source", "source", "ability"]],
       ["reward_fn_key"],
       ["reward_fn_key", "data_source"], "error"),
    _f("reward_is_distance", 2, "data.reward_fn", "ppo", "fp32",
       {"data": {"reward_fn": RW + "edit_distance_reward"}},
       "the reward function returns the edit distance to the answer (lower is better) as the reward, so "
       "the policy is trained to move away from the answer",
       [["sign", "invert", "negat", "distance", "higher", "lower", "maximi", "minimi"]],
       ["edit_distance_reward", "rewards.py", "reward_fn"],
       ["negat", "-", "1 -", "sign"], "error"),
    # ------------------------------------------------------------ 3. training dynamics
    _f("entropy_coef_huge", 3, "algo.entropy_coef", "ppo", "fp32",
       {"model": {"preset": None, "path": "{assets.sft_lm}"}, "algo": {"entropy_coef": 5.0}},
       "entropy_coef 5 (verl's default is 0) on an SFT'd policy: the entropy bonus outweighs the task reward, "
       "the policy is pushed towards uniform over the vocabulary",
       [["entropy"]], ["entropy_coef", "entropy_coeff"], ["entropy_coef", "entropy_coeff"], "warning"),
    _f("kl_adaptive_runaway", 3, "algo.kl_ctrl_horizon", "ppo", "bf16",
       {"algo": {"kl_ctrl_type": "adaptive", "kl_ctrl_target_kl": 1.0e-6, "kl_ctrl_horizon": 1, "kl_coef": 0.01}},
       "adaptive KL control with horizon 1 (target_kl 1e-6): each update multiplies the coefficient by "
       "1 + clip(kl / target - 1, +-0.2) x batch / horizon = 1 +- 1.6, so it flips sign (KL below target "
       "at the start) and then grows 2.6x per step: the KL term rewards drifting from the reference",
       [["kl"], ["adaptive", "coef", "horizon", "target", "controller", "grow"]],
       ["kl_ctrl", "kl_ctrl_horizon", "kl_ctrl_target_kl"], ["kl_ctrl", "horizon", "target_kl", "fixed"],
       "warning"),
    _f("temperature_collapse", 3, "algo.temperature", "grpo", "fp16", {"algo": {"temperature": 0.002}},
       "rollout temperature 0.002: sampling is nearly greedy, the group's responses are identical, so the "
       "group-normalised advantages are 0 and GRPO does not learn",
       [["temperature", "greedy", "identical", "diversity", "same"]],
       ["temperature"], ["temperature"], "warning"),
    _f("gamma_zero", 3, "algo.gamma", "ppo", "bf16-pure", {"algo": {"gamma": 0.0}},
       "gamma 0 with an outcome reward on the last token: the return of every earlier token is its own value "
       "target only, the reward reaches only the final token (credit assignment cut)",
       [["gamma", "discount"]], ["gamma"], ["gamma"], "warning"),
    _f("dpo_label_smoothing_half", 3, "algo.label_smoothing", "dpo", "fp32",
       {"algo": {"label_smoothing": 0.49}},
       "cDPO label_smoothing 0.49 assumes 49% of the labels are flipped: the loss's two terms nearly cancel and "
       "the preference gradient is ~2% of plain DPO's",
       [["label_smoothing", "label smoothing", "smoothing"]],
       ["label_smoothing"], ["label_smoothing"], "warning"),
    _f("rollout_rs_rejects_all", 3, "rollout_correction.rollout_rs_threshold", "grpo", "bf16",
       {"rollout": {"engine": "fused"},
        "rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.0001}},
       "token-level rejection with ratio bound 1.0001: the fused bf16 rollout engine's log-probs differ from "
       "the trainer's by more than that on most tokens, so about three quarters of the tokens (and a token "
       "of every sequence) are masked out of the policy gradient",
       [["reject", "rollout_rs", "mask", "threshold"]],
       ["rollout_rs", "rollout_correction"], ["rollout_rs_threshold", "rollout_rs"], "warning"),
    _f("critic_lr_huge", 3, "algo.critic_lr", "ppo", "fp16", {"algo": {"critic_lr": 5.0}},
       "critic learning rate 5.0 (actor 2e-3): the value network's weights are wrecked by the first update, "
       "values and value loss blow up and the advantages are garbage",
       [["critic", "value"], ["lr", "learning rate", "critic_lr"]],
       ["critic_lr", "critic.optim.lr"], ["critic_lr", "critic.optim.lr"], "error"),
    _f("weight_decay_huge", 3, "algo.weight_decay", "dpo", "bf16",
       {"model": {"preset": None, "path": "{assets.sft_lm}"}, "algo": {"weight_decay": 200.0}},
       "weight_decay 200 at lr 1e-3 on an SFT'd policy: decoupled decay shrinks every weight by 20% per step, "
       "the policy's knowledge decays toward uniform outputs whatever the loss",
       [["weight_decay", "weight decay", "decay"]],
       ["weight_decay"], ["weight_decay"], "warning"),
    # ------------------------------------------------------------ 4. setup-time changes by user code
    _f("setup_load_strict_false", 4, "model.setup.actor", "dpo", "fp32",
       {"model": {"setup": {"actor": SU + "load_sft_backbone"}}},
       "the setup loads the SFT backbone's state_dict into the CausalLM with strict=False; its keys lack the "
       "'model.' prefix, so nothing is loaded and the policy trains from random init",
       [["load", "state_dict", "strict", "missing", "unexpected", "keys", "random", "init"]],
       ["load_sft_backbone", "model_setup.py", "setup"],
       ["strict", "prefix", "model.", "load_state_dict", "from_pretrained"], "error"),
    _f("setup_no_grad_head", 4, "model.setup.actor", "grpo", "bf16",
       {"model": {"setup": {"actor": SU + "soft_cap_logits"}}},
       "the setup wraps lm_head in a soft-cap module whose forward is decorated @torch.no_grad() (copied "
       "from inference code): the logits carry no graph and the actor's backward fails",
       [["grad", "no_grad", "graph", "requires_grad", "backward"]],
       ["soft_cap_logits", "model_setup.py", "setup"],
       ["no_grad", "remove", "decorator"], "error"),
    _f("setup_unregistered_head", 4, "model.setup.critic", "ppo", "fp32",
       {"model": {"setup": {"critic": SU + "mlp_value_head"}}},
       "the critic's new value head keeps its layers in a plain Python list: they are not registered "
       "parameters, so the critic's optimizer never updates them (the value head never trains)",
       [["register", "parameter", "optimizer", "list", "modulelist", "not trained", "frozen", "untrained"]],
       ["mlp_value_head", "model_setup.py", "setup"],
       ["modulelist", "nn.ModuleList", "nn.Sequential", "register"], "warning"),
    _f("setup_rope_actor_only", 4, "model.setup.actor", "ppo", "fp32",
       {"model": {"setup": {"actor": SU + "extend_rope_context"}}},
       "the setup rescales the actor's RoPE frequencies (base x16) after the reference was copied from it; "
       "reference and actor disagree from step 0, the KL penalty measures the RoPE change",
       [["reference", "ref", "kl"], ["rope", "rotary", "position", "actor", "differ", "mismatch", "setup"]],
       ["extend_rope_context", "model_setup.py", "setup"],
       ["reference", "every role", "*", "config", "rope_scaling"], "warning"),
    _f("rm_dir_is_causal_lm", 4, "model.reward_model", "grpo", "fp32",
       {"model": {"reward_model": "{assets.lm_dir_as_rm}"}},
       "model.reward_model names a causal-LM checkpoint (no classification head): it loads as a sequence "
       "classifier with a newly initialised random score head, so the rewards are random features",
       [["reward", "score"], ["head", "random", "init", "classif", "untrained", "newly"]],
       ["reward_model", "lm_dir_as_rm"],
       ["reward_model", "classification", "head", "checkpoint"], "error"),
    # ------------------------------------------------------------ 5. data and tokenizer problems
    _f("tokenizer_appends_eos", 5, "model.tokenizer", "grpo", "fp32",
       {"model": {"tokenizer": "{assets.tok_eos_appended}"}},
       "the tokenizer directory's post-processor appends eos to every encoding (add_eos_token): every prompt "
       "ends with <eos>, so generation starts after an end-of-sequence token",
       [["eos", "end-of-sequence", "end of sequence"], ["prompt", "append", "add_eos", "tokenizer"]],
       ["model.tokenizer", "tokenizer", "tok_eos_appended"],
       ["add_eos", "eos", "tokenizer", "post_processor"], "error"),
    _f("dataset_literal_eos", 5, "data.dataset", "ppo", "fp32",
       {"data": {"dataset": DS + "few_shot_prompts"}},
       "few-shot prompts join the solved example and the question with the literal string '<eos>', which "
       "the tokenizer turns into the eos token: every prompt has an end-of-sequence token in its middle",
       [["eos", "special", "end-of-sequence"], ["prompt", "middle", "literal", "dataset", "text"]],
       ["few_shot_prompts", "data_sources.py", "dataset"],
       ["separator", "eos", "newline", "split_special_tokens", "\\n"], "error"),
    _f("dpo_collator_masks_eos", 5, "data.collator", "dpo", "bf16",
       {"model": {"tokenizer": "{assets.tok_pad_is_eos}"}, "data": {"collator": CO + "preference_batch"}},
       "the tokenizer's pad token is eos, and the DPO collator builds its masks as ids != pad: the eos that "
       "ends every completion is masked out, so the policy is never trained to stop",
       [["eos", "pad"], ["mask", "response", "stop"]],
       ["preference_batch", "collators.py", "collator"],
       ["eos", "pad", "mask", "length"], "error"),
    _f("collator_extra_dim", 5, "data.collator", "ppo", "bf16-pure",
       {"data": {"collator": CO + "per_example_prompts"}},
       "the collator tokenises each prompt with return_tensors='pt' and stacks them: input_ids is [B, 1, P] "
       "instead of [B, P]",
       [["shape", "dimension", "dim", "3-d", "[b, 1", "rank", "ndim"]],
       ["per_example_prompts", "collators.py", "collator"],
       ["squeeze", "cat", "shape", "[b, p]"], "error"),
    _f("dpo_pairs_inverted", 5, "data.dataset", "dpo", "fp16",
       {"data": {"dataset": DS + "ranked_pairs"}},
       "the dataset maps a rating dump's 'preferred' field the wrong way round: every chosen completion is "
       "the rejected one, DPO trains the policy towards the wrong answers",
       [["chosen", "rejected", "preference", "label"], ["swap", "invert", "revers", "wrong", "flip"]],
       ["ranked_pairs", "data_sources.py", "dataset"],
       ["chosen", "rejected", "preferred", "swap"], "error"),
    _f("dataset_chat_messages", 5, "data.dataset", "grpo", "bf16",
       {"data": {"dataset": DS + "chat_prompts"}},
       "the dataset's prompt is a list of chat messages (verl's file layout) instead of a string",
       [["prompt"], ["str", "string", "chat", "message", "list", "type"]],
       ["chat_prompts", "data_sources.py", "dataset"],
       ["str", "chat_template", "train_files", "content", "string"], "error"),
    # ------------------------------------------------------------ 6. precision configuration via suite keys
    _f("rollout_fp16_under_fp32", 6, "precision.overrides.rollout", "grpo", "fp32",
       {"precision": {"overrides": {"rollout": {"compute_dtype": "fp16"}}}},
       "an fp32 run whose rollout engine is overridden to fp16 compute: the sampling policy is not the trained "
       "one, rollout and trainer log-probs disagree on every token (off-policy without correction)",
       [["rollout"], FP16 + ["mismatch", "precision"]],
       ["overrides.rollout", "precision.overrides", "rollout"],
       ["fp32", "float32", "rollout", "override", "rollout_is"], "warning"),
    _f("critic_init_scale_tiny", 6, "precision.overrides.critic.init_scale", "ppo", "fp16",
       {"precision": {"overrides": {"critic": {"init_scale": 1.0e-6}}}},
       "the critic's dynamic loss scale starts at 1e-6 instead of 65536: its fp16 gradients are scaled down "
       "and underflow to zero, and the scale only doubles every 2000 steps",
       [["scale", "init_scale", "loss scal"], ["underflow", "zero", "small", "critic", "tiny"]],
       ["init_scale", "precision.overrides"], ["init_scale", "65536"], "warning"),
    _f("bf16_pure_tiny_lr", 6, "precision.preset", "dpo", "bf16-pure", {"algo": {"lr": 1.0e-6}},
       "bf16-pure (bf16 parameters and AdamW state) with lr 1e-6: every update is below half a bf16 ulp of "
       "the weights and is rounded away, the policy never leaves the reference",
       [BF16, ["update", "lost", "ulp", "round", "stagnat", "master", "unchanged", "param"]],
       ["precision.preset", "bf16-pure", "preset"], ["bf16", "fp32", "master"], "warning"),
    _f("fp16_on_large_activations", 6, "precision.preset", "ppo", "fp16",
       {"model": {"preset": None, "path": "{assets.big_act_lm}"}},
       "the model's residual stream reaches ~1.4e5 (massive activations) and the run picks fp16: the "
       "first layer's MLP output overflows fp16 (max 65504) and every forward is inf / NaN",
       [FP16, ["overflow", "inf", "range", "65504", "nan", "non-finite"]],
       ["precision.preset", "preset", "fp16"], ["bf16", "fp32"], "error"),
    # ------------------------------------------------------------ 7. the user's own loop
    _f("loop_unscaled_backward", 7, "own loop (verlaudit.watch)", "grpo", "fp16", {},
       "the loop calls loss.backward() on the unscaled loss and then scaler.step / scaler.update: the "
       "GradScaler has no scale for the step (it was never used for the backward)",
       [["scal", "gradscaler"], ["backward", "scale(", "unscaled", "not scaled", "step"]],
       ["own_loops", "loop_unscaled_backward", "scaler", "gradscaler"],
       ["scaler.scale", "scale(loss)"], "error", loop="loop_unscaled_backward"),
    _f("loop_bf16_round_trip", 7, "own loop (verlaudit.watch)", "grpo", "fp32", {},
       "the loop casts the policy to bf16 for generation and back to fp32 for the update every step: the "
       "fp32 weights are rounded to bf16 each step and most updates (below the bf16 spacing at lr 1e-5) are erased",
       [BF16, ["cast", "round", "weight", "param", "master", "lost", "update"]],
       ["own_loops", "loop_bf16_round_trip", "fast_rollout", "to(", "cast"],
       ["copy", "autocast", "fp32", "float32", "separate"], "error", loop="loop_bf16_round_trip"),
    _f("loop_autocast_wrong_device", 7, "own loop (verlaudit.watch)", "grpo", "bf16", {},
       "a bf16 loop uses torch.autocast('cuda') on a CPU run: autocast is disabled, every matmul runs in fp32 "
       "while the declared contract is bf16",
       [["autocast"], ["cuda", "device", "disabled", "fp32", "float32", "not active", "inactive"]],
       ["autocast", "own_loops", "loop_autocast_wrong_device"],
       ["cpu", "device_type"], "warning", loop="loop_autocast_wrong_device"),
]  # fmt: skip

_CTL: dict[str, dict[str, Any]] = {
    "ppo_fp32": {"seed": 3},
    "ppo_fp16": {"algo": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 4}},
    "ppo_bf16": {"model": {"setup": {"critic": SU + "fp32_value_head"}}, "seed": 1},
    "ppo_bf16_pure": {"seed": 2, "data": {"task": "copy"}},
    "grpo_fp32": {"data": {"reward_fn": RW + "digit_reward"}, "seed": 4},
    "grpo_fp16": {"algo": {"group_size": 8, "batch_size": 2}, "seed": 5},
    "grpo_bf16": {"data": {"collator": CO + "prompts_left_padded"}, "seed": 6},
    "grpo_bf16_pure": {"seed": 7},
    "dpo_fp32": {"seed": 8, "algo": {"beta": 0.2}},
    "dpo_fp16": {"algo": {"batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 4}, "seed": 9},
    "dpo_bf16": {"data": {"task": "sort"}, "seed": 10},
    "dpo_bf16_pure": {"seed": 11},
}
"""Per-control variations from the previous bench's controls: seeds, batch sizes, tasks, a correct plug-in."""

CONTROLS: list[dict[str, Any]] = [
    {"name": f"ctl_{algo}_{preset.replace('-', '_')}", "algo": algo, "preset": preset,
     "train": _CTL[f"{algo}_{preset.replace('-', '_')}"]}
    for algo in ("ppo", "grpo", "dpo")
    for preset in PRESETS
] + [
    {"name": "ctl_loop_bf16", "algo": "grpo", "preset": "bf16", "train": {}, "loop": "loop_bf16_correct"},
]  # fmt: skip
"""Clean controls: each algorithm in each preset, nothing planted, plus one correct own loop (bf16
autocast on the CPU); a correct diagnosis is clean."""


def by_name() -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in FAULTS + CONTROLS}
