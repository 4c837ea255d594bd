"""The root-cause and symptom classes of finding kinds: the vocabulary `verlaudit.kinds` files every kind
under and the rule table of `verlaudit.analysis.diagnose.rules` is written in (which class can produce
which). Kept apart from the registry so that each stays readable; imports nothing from verlaudit.
Exercised by `pytest tests/test_kinds.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

ROOT_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "weights_nonfinite": "NaN/Inf stored in the weights (a corrupted checkpoint or a broken setup)",
        "weights_outlier": "one module's weights far out of its siblings' range",
        "param_dtype": "parameters stored in a dtype the policy does not say (a cast submodule, a head)",
        "buffer_dtype": "a buffer in a dtype that loses precision (rotary inv_freq)",
        "ids_float": "token ids or masks that became floating point",
        "ids_range": "token ids outside the vocabulary",
        "ids_dtype": "integer ids of another width (int32)",
        "batch_shape": "batch fields that disagree in batch size or shape, or are not tensors",
        "padding": "prompts padded on the wrong side",
        "reward_model_dtype": "a reward model stored in another dtype than the policy's",
        "reward_nonfinite": "a reward function or model that returned NaN/Inf",
        "reward_shape": "a reward of the wrong shape or type (a list, non-numbers)",
        "reward_dtype": "a reward in another dtype than fp32 (fp64, fp16, integers)",
        "reward_device": "a reward on another device than the training's",
        "no_signal": "rewards identical within every group: no advantage, no gradient",
        "module_output_dtype": "a module returned another dtype than it computes in (a casting hook)",
        "module_input_dtype": "activations entering a module in another dtype outside autocast",
        "compute_dtype": "a module computing in another dtype than the policy's",
        "island_dtype": "an fp32 island (log-probs, values, losses, norms, softmax) computed below fp32",
        "grad_dtype": "gradients in another dtype than the policy's",
        "rollout_dtype": "rollout engine dtype differs from the actor's compute dtype",
        "rollout_engine": "the engine computes or samples otherwise than the trainer recomputes",
        "weight_sync": "the rollout engine does not compute with the actor's current weights",
        "vocab": "the model emits ids its tokenizer cannot decode",
        "user_hook": "user code hooked into a module's forward",
        "plugin_nonfinite": "user plug-in code (a reward, a collator) whose own op produced NaN/Inf",
        "plugin_precision": "user plug-in code computing in a dtype that rounds its result (fp16/bf16, ids in floats)",
        "mask_padding": "an attention mask that lets the model attend to pad tokens",
        "identical_pairs": "preference pairs whose chosen and rejected sides are the same tokens",
        "truncation": "prompts or completions cut by a length limit: their start, the answer's content or one side's eos lost",
        "reference": "a reference policy that is not the actor's starting point",
        "dropout": "dropout or another random op in a forward that must be deterministic (training roles, reward)",
        "tied_weights": "input and output embeddings the config ties, held as separate tensors",
        "learning_rate": "a learning rate so large that every layer's weights grow",
        "reward_integer": "a reward in an integer dtype: fractional scores truncated to whole numbers",
        "empty_response": "preference pairs or examples whose response is empty (no token but eos)",
        "tokenizer_ids": "a tokenizer whose eos / pad / bos ids are not the model config's",
        "suite_config": "a suite key naming something that cannot run (refused before any worker started)",
        "setup_dtype": "the user's model.setup cast a model's parameters to another dtype",
        "setup_vocab": "the user's model.setup resized a model's embeddings",
        "setup_trainable": "the user's model.setup froze most of a trainable model",
        "setup_ties": "the user's model.setup untied a model's input and output embeddings",
        "setup_modules": "the user's model.setup replaced modules of a model",
        "setup_hooks": "the user's model.setup registered forward hooks on a model",
        "setup_mode": "the user's model.setup changed a model's training mode or dropout",
        # setup24: what model.setup (or a checkpoint directory) left that its metadata does not show
        "setup_load": "the user's model.setup loaded a state dict whose keys did not match: weights left at init",
        "setup_graph": "after model.setup a trainable model's forward builds no autograd graph to its weights",
        "setup_unregistered": "tensors that train in the forward but are no parameters: never optimized",
        "setup_roles": "model.setup changed one of two roles built from the same weights (actor, reference)",
        "newly_initialised": "weights a checkpoint directory lacked, initialised at random by the loader",
        "override_storage": "a precision override that stores a role's weights below the preset's (no fp32 master)",
        "override_compute": "a precision override that computes a role below the preset's dtype",
        "override_scaling": "a loss-scaling override that departs from the preset's dynamic scaling",
        "clip_range": "a PPO clip range so narrow that clipping removes most of the policy gradient",
        "stale_updates": "so many optimizer steps on one rollout batch that the updates are off-policy",
        "kl_penalty": "a KL coefficient so large that the KL term, not the task, drives the update",
        "group_size": "groups of one response under a group-baseline estimator: no baseline to compare",
        # dyn24: settings that make a loss or an update degenerate (config_checks, dynamics)
        "label_smoothing": "a DPO label smoothing near 0.5: the preference terms cancel (or robust's gradient explodes)",
        "discount": "a discount (gamma, GAE lambda) that keeps an outcome score from the early tokens",
        "kl_controller": "an adaptive KL controller whose coefficient grows geometrically or turns negative",
        "weight_decay": "a weight decay that shrinks every weight each optimizer step, whatever the loss",
        "entropy_bonus": "an entropy coefficient whose term outweighs the advantages: the policy goes uniform",
        "sampling": "a sampling setting (temperature, top_k, top_p) that makes a group's responses identical",
        "rejection": "a rollout rejection threshold that masks most tokens out of the policy gradient",
        # plug24: the user's own loop (`verlaudit.integrations.loop_checks`)
        "loop_scaling": "an own loop's fp16 backward or optimizer step outside its GradScaler",
        "autocast_device": "an autocast region that is off for the device of the model's tensors or its dtype",
        "round_trip": "weights cast to fp16/bf16 and back: rounded every time, small updates erased",
        # inv24: the data's invariants (`verlaudit.audit.invariants_data`)
        "row_order": "a batch whose rows are not the examples in their order: rewards scored against others' answers",
        "prompt_eos": "prompts that hold the end-of-sequence token (appended by the tokenizer, a literal in the text)",
        "response_eos": "a response mask that leaves out the eos ending the response: stopping is never trained",
        "shared_role": "a frozen role (reference, reward) that is a trained role's module or shares its tensors",
        "reward_position": "a reward model whose score depends on where the padding is, not on the tokens it scores",
        "reward_constant": "a reward that is one value for every response of the batch: it reads nothing of them",
        "reward_inverted": "a reward or preference that ranks the task's own correct answers below its wrong ones",
        # loop24: the order, cadence, graph and direction of an own loop (`verlaudit.integrations.loop_protocol`)
        "loop_cadence": "an own loop's scheduler or zero_grad called at another cadence than its optimizer steps",
        "loop_graph": "an own loop's loss with no autograd graph to the policy (built from no-grad log-probs)",
        "loop_objective": "an own loop's update that lowers the log-probs of the responses with positive advantage",
        "loop_optimizer": "an own loop's optimizer that does not hold (all of) the trained model's parameters",
        # cfg24: a numeric key outside its sane range, confirmed by the run (`verlaudit.audit.config_ranges`)
        "config_off": "a coefficient set to 0 (or near it) that removes a trained component's loss: it never trains",
        "config_saturation": "a loss temperature (DPO beta) so large that the loss saturates: no gradient or an exploding loss",
        "config_truncation": "an importance-sampling threshold that truncates every on-policy token's weight",
        "config_scaler": "a loss-scaler setting (growth interval, initial scale) that keeps the scale overflowing or underflowing",
        "config_loss_scale": "a loss divisor far from the response length: the loss and its gradients scaled out of range",
        # model24: the tokenizer and the loaded model against each other (`verlaudit.audit.model_checks`)
        "tokenizer_vocab": "a tokenizer that numbers its tokens otherwise than the one the model was trained with",
        "tokenizer_decode": "a tokenizer whose decode does not give back the text it encoded",
        "chat_template": "a chat template that leaves the message's content out of the prompt",
        "weights_untrained": "a checkpoint that predicts the task's answers no better than their token frequencies",
        "setup_remap": "the user's model.setup loaded a checkpoint's tensors under other names (layers reordered)",
        "hook_output": "a forward hook a setup registered that changes the model's output (its scale, its values)",
        "mask_ignored": "a model whose outputs for real tokens change with padding: the attention mask is ignored",
        "value_offset": "a critic whose values start far outside the rewards' range (a value head's bias or scale)",
        "setup_zero_grad": "the user's model.setup left a role whose trainable tensors all get a zero gradient",
        # data24: the examples' invariants and the reward's intervention probes (`invariants_examples`, `invariants_reward`)
        "reward_batch": "a reward whose score of a response depends on the other responses of the batch",
        "reward_row_order": "rewards that follow the row's position in the batch, not the response in it",
        "answer_leak": "prompts that already hold the answer the reward checks (a leaked target)",
        "duplicate_rows": "distinct dataset rows that are the same example (one object aliased, or copies)",
        "completion_prompt": "preference completions that repeat the prompt (the whole conversation in chosen/rejected)",
        "empty_prompt": "examples whose prompt is empty (the policy generates from nothing)",
        "response_length": "a response length shorter than the task's answers: every response is cut",
        "data_precision": "dataset values stored in a low-precision float (answers rounded to fp16/bf16 spacing)",
        "plugin_numpy_bool": "user plug-in code that adds numpy bools (+ is a logical or): a count that stops at 1",
        # combo: keys wrong in combination, and resolution lost at a low-precision boundary
        "config_combination": "settings each valid alone and wrong together (a penalty twice, a scale key of another loss)",
        "advantage_norm": "an advantage normalisation dividing by a statistic that is (near) 0 for the run's rewards",
        "precision_resolution": "a tensor in fp16/bf16 whose spread is within a few units of the dtype's spacing",
        # setupg: what a setup changed in what a model computes (`verlaudit.audit.setup_effect`)
        "setup_settings": "the user's model.setup changed modules' settings (a norm's eps): the model computes otherwise",
        "setup_interface": "the user's model.setup returned a wrapper lacking the model's members (generate, config)",
        "setup_adapter": "the user's model.setup added adapters that do not start at zero: another model at init",
        "setup_collapse": "the user's model.setup made distinct inputs give one output (a clamp, a rounding hook)",
        "setup_shared": "the user's model.setup made two roles share parameter tensors (an aliased trunk)",
        "special_doubled": "prompts that start with a special token (bos) twice: the collator added one the tokenizer adds",
        # loopg: an own loop's update checked against its loss (`verlaudit.integrations.loop_update`, `loop_tokens`)
        "loop_order": "an own loop that clips or changes its gradients after the optimizer step that used them",
        "loop_loss_tokens": "an own loop's loss that reads prompt or padding positions, not only the response",
        "loop_alignment": "an own loop's log-probs, reward text or token weights misaligned with the sampled tokens",
        # rfprobe: the reward function's contract, probed in a forked copy of the process
        "reward_stateful": "a reward function whose score of a row changes from call to call (state, randomness)",
        "reward_mutates": "a reward function that changes the examples it is handed (pops or rewrites a field)",
        "reward_unscored": "a reward function that does not score the reference answer above a wrong one",
        "answer_form": "dataset answers in a form a correct response does not write (whitespace, full-width, '4444.0')",
        # dyn12: a legal key whose effect on the update is total, null or backwards (`verlaudit.audit.update_effect`)
        "grad_clip": "a max_grad_norm so far below the gradient norm that the clip, not the loss, sets every update",
        "value_clip": "a value clip range so narrow for the returns that the clip removes the critic's update",
        "trust_region": "a clip side opened (or a loss without a clip) while several updates move the policy past it",
        "preference_direction": "a preference loss whose own gradient lowers the chosen answers it should prefer",
        "update_null": "a learning rate so small that the optimizer steps leave the weights where they were",
        # data12: what the model is shown or scored against is not what the dataset says (`data_contract`)
        "prompt_rewritten": "a collator or template that drops, cuts or rewrites part of the prompt text it encodes",
        "special_content": "a special token (pad, eos, bos) that is also a character of the text: content masked or skipped",
        "bos_missing": "prompts without the bos the checkpoint's tokenizer starts every sequence with",
        "conflicting_labels": "the same prompt with different ground truths (or preferences the other way round)",
        "answer_notation": "ground truths in another notation than the prompts write them (case, full-width)",
        "answer_unreachable": "ground truths or prompts holding characters the tokenizer's vocabulary lacks (<unk>)",
        # data13: what a dataset says less than it looks (`data_information`)
        "constant_targets": "a dataset whose every example has the same answer / label: the targets ignore the prompt",
        "few_prompts": "a dataset with fewer distinct prompts than one batch (a smoke-test size left in)",
        "pairs_format_only": "preference pairs that differ only in formatting noise (a space, the case)",
        "pair_prompt": "preference pairs whose chosen and rejected rows follow different prompts (a collator shift)",
        "prompt_form": "prompts in a form (a trailing space) the policy was not trained on, measured on the policy",
        # setup12: what a setup did to the weights and the forward; precision asked for vs realised
        "setup_weights": "model.setup re-initialised, rescaled or zeroed a model's loaded weights",
        "setup_hook_effect": "a hook model.setup registered adds noise, scales, or acts in one mode only",
        "setup_modes": "after model.setup the forward differs between calls or between training and eval mode",
        "override_not_realised": "a role's parameters, gradients, optimizer state or forward in another dtype than the suite asked for",
        "override_rollout_apart": "an actor compute override below the rollout engine's dtype (the ratios' rounding)",
        "update_term_lost": "a term of the optimizer's update (weight decay) below half the weights' spacing",
        # rank12: the reward probe's near misses
        "reward_lenient": "a reward function that scores near-miss wrong answers as correct (a loose tolerance, a partial match)",
        # dyn13: a step that does not do what the objective asks (`kinds_update`)
        "preference_flat": "a preference loss scale (beta) so small the loss stays at its zero-margin value while the policy drifts",
        "setup_grad_hooks": "gradient hooks a setup registered that clamp, sign or scale every parameter's gradient",
        "override_ignored": "a precision override the role's model does not follow (a loader that keeps its own dtype)",
        # prec13: many micro-batch gradients summed into a low-precision .grad
        "grad_accumulation": "micro-batch gradients accumulated in an fp16/bf16 .grad: the sum carries several roundings",
    }
)
"""Classes of problems that can start a chain: the root of a diagnosis is one of these."""

SYMPTOM_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "dtype_error": "a runtime dtype error (the run died)",
        "exception": "another exception (IndexError, ValueError in the trainer, ...)",
        "nonfinite": "NaN/Inf in the loss, gradients or a forward",
        "overflow": "fp16 overflow: skipped steps, loss-scale collapse, values near fp16's maximum",
        "grad_underflow": "gradients below fp16's smallest normal",
        "update_underflow": "weight updates lost to the rounding of the stored weights",
        "precision_excess": "a module adds more error than its dtype's rounding explains",
        "mismatch": "rollout and trainer log-probs differ beyond what the dtypes explain",
        "oom": "out of memory",
        "killed": "the process was killed",
        "audit_gap": "part of the audit did not run (not a problem of the run)",
        "log_failure": "a foreign log's own failure: the first error that is not the echo of another",
        "log_cascade": "a foreign log's error that follows from another (a rank's exit, a raised-again error)",
        # cfg24: the reward's trend over the run (`verlaudit.analysis.diagnose.trajectory`)
        "reward_trend": "the reward collapsing or its variance exploding over the run",
        "other": "none of the above (a kind nobody classed)",
    }
)
"""Classes of what a problem produces."""

CLASSES: Mapping[str, str] = MappingProxyType({**ROOT_CLASSES, **SYMPTOM_CLASSES})
"""Every class, root and symptom."""
