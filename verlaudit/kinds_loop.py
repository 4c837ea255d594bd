"""Finding kinds of the user's own loop audited in place (`verlaudit.integrations.loop_*`) and of integer
arithmetic inside plug-ins: registered here, re-exported by `verlaudit.kinds` (write them as ``K.NAME``).
Split out of kinds.py for length."""

from __future__ import annotations

from verlaudit.kind_registry import _f

# ---------------------------------------------------------------- plug24: the user's own loop
# (`verlaudit.integrations.loop_checks`) and integer arithmetic inside plug-ins (`verlaudit.audit.plugins`)
LOOP_UNSCALED_BACKWARD = _f(
    "loop/unscaled_backward",
    "loop_scaling",
    "scaler.step with no scaler.scale(loss) since the last update: the backward ran on the unscaled loss",
)
LOOP_SCALER_BYPASSED = _f(
    "loop/scaler_bypassed",
    "loop_scaling",
    "optimizer.step() outside scaler.step after a scaled backward: the gradients carry the loss scale",
)
LOOP_FP16_NO_SCALER = _f(
    "loop/fp16_no_scaler", "loop_scaling", "an fp16 autocast forward of a trained model with no GradScaler"
)
LOOP_STEP_WITHOUT_GRADS = _f(
    "loop/step_without_grads",
    "loop_scaling",
    "an optimizer step with no gradient on any parameter (zero_grad between backward and step)",
)
LOOP_AUTOCAST_INACTIVE = _f(
    "loop/autocast_inactive",
    "autocast_device",
    "an autocast region around a forward that does nothing for it (another device type, or disabled)",
)
LOOP_WEIGHT_ROUND_TRIP = _f(
    "loop/weight_round_trip",
    "round_trip",
    "a trained model cast from its storage dtype to fp16/bf16 and back: its master weights rounded",
)
LOOP_COMPUTE_BELOW_CONTRACT = _f(
    "loop/compute_below_contract",
    "compute_dtype",
    "an own loop's forward returned a narrower dtype than its declared contract computes in",
)
PLUGIN_ROUND_TRIP = _f(
    "plugin/round_trip",
    "plugin_precision",
    "values a reward function or collator cast to fp16/bf16 and straight back up: rounded, not computed",
)
PLUGIN_INT_WRAP = _f(
    "plugin/int_wrap",
    "plugin_precision",
    "integer arithmetic in a plug-in that wrapped around (a narrow torch integer dtype, a numpy scalar)",
)

# ---------------------------------------------------------------- loop24: an own loop's protocol
# (`verlaudit.integrations.loop_protocol`, `loop_direction`)
LOOP_CLIP_SCALED = _f(
    "loop/clip_scaled_grads",
    "loop_scaling",
    "clip_grad_norm_ / clip_grad_value_ on gradients still carrying the GradScaler's scale (no unscale_)",
)
LOOP_SCALER_NOT_UPDATED = _f(
    "loop/scaler_not_updated",
    "loop_scaling",
    "a GradScaler stepped again (or to the end) with no scaler.update() after its step",
)
LOOP_UNSCALE_TWICE = _f(
    "loop/unscale_twice",
    "loop_scaling",
    "scaler.unscale_ called again on an optimizer already unscaled since the scaler's last update",
)
LOOP_SCHEDULER_CADENCE = _f(
    "loop/scheduler_cadence",
    "loop_cadence",
    "an LR scheduler stepped more than once per optimizer step (per micro-batch): its schedule runs fast",
)
LOOP_GRADS_NOT_CLEARED = _f(
    "loop/grads_not_cleared",
    "loop_cadence",
    "no zero_grad between optimizer steps: each backward adds to the last step's gradients",
)
LOOP_ZERO_GRAD_IN_ACCUMULATION = _f(
    "loop/zero_grad_in_accumulation",
    "loop_cadence",
    "zero_grad between the micro-batches of one optimizer step: earlier micro-batches' gradients lost",
)
LOOP_OPTIMIZER_PARAMS = _f(
    "loop/optimizer_params",
    "loop_optimizer",
    "an own loop's optimizer that does not hold the watched model's trainable parameters",
)
LOOP_LOSS_NO_GRAPH = _f(
    "loop/loss_without_graph",
    "loop_graph",
    "backward() on a loss with no autograd graph (log-probs from a no-grad forward, or detached)",
)
LOOP_LOGPROBS_LOW_PRECISION = _f(
    "loop/logprobs_low_precision",
    "island_dtype",
    "a log_softmax / logsumexp in the user's loop returning fp16/bf16 log-probs under an fp32 contract",
)
LOOP_UPDATE_AGAINST_ADVANTAGE = _f(
    "loop/update_against_advantage",
    "loop_objective",
    "optimizer steps that lower the log-probs of responses with positive advantage (flipped loss sign)",
)

# ---------------------------------------------------------------- loopg: an own loop's update against its loss
# (`verlaudit.integrations.loop_update`, `loop_tokens`)
LOOP_GRADS_AFTER_STEP = _f(
    "loop/grads_after_step",
    "loop_order",
    "gradients clipped or changed after the optimizer step that used them (the step saw unprocessed ones)",
)
LOOP_CLIP_BEFORE_BACKWARD = _f(
    "loop/clip_before_backward",
    "loop_order",
    "a clip followed by a backward before the step: the step applies gradients the clip never saw",
)
LOOP_PARAMS_OUTSIDE_OPTIMIZER = _f(
    "loop/params_outside_optimizer",
    "loop_optimizer",
    "trained parameters with gradients at a step that no optimizer holds (replaced after it was built)",
)
LOOP_OPTIMIZER_STALE_PARAMS = _f(
    "loop/optimizer_stale_params",
    "loop_optimizer",
    "optimizer param groups holding tensors the watched model no longer has (a module replaced)",
)
LOOP_LOSS_OUTSIDE_RESPONSE = _f(
    "loop/loss_outside_response",
    "loop_loss_tokens",
    "an own loop's loss with a gradient at prompt or padding positions, not only at the response's",
)
LOOP_LOSS_SKIPS_FIRST_TOKEN = _f(
    "loop/loss_skips_first_token",
    "loop_loss_tokens",
    "an own loop's loss with no gradient at any row's first response token (a mask or slice off by one)",
)
LOOP_STEP_REPEATED = _f(
    "loop/step_repeated",
    "loop_order",
    "an optimizer step on gradients a previous step already applied (no backward between the two)",
)
LOOP_LOGPROBS_MISALIGNED = _f(
    "loop/logprobs_misaligned",
    "loop_alignment",
    "an own loop's loss reads at position t another token's log-prob than the next token t+1 (shifted)",
)

# ---------------------------------------------------------------- loop12: the roles of an own loop across steps
# (`verlaudit.integrations.loop_roles`)
LOOP_STALE_SAMPLER = _f(
    "loop/stale_sampler",
    "weight_sync",
    "an own loop samples with a copy of the policy whose weights never follow the trained ones",
)
LOOP_OPTIMIZER_RECREATED = _f(
    "loop/optimizer_recreated",
    "loop_optimizer",
    "an own loop's optimizer state restarts between steps (a new optimizer per step, state cleared)",
)
LOOP_SCHEDULER_RECREATED = _f(
    "loop/scheduler_recreated",
    "loop_cadence",
    "an own loop builds its LR scheduler again between optimizer steps: the schedule restarts each time",
)
LOOP_SCALER_RECREATED = _f(
    "loop/scaler_recreated",
    "loop_scaling",
    "an own loop builds a new GradScaler between steps: the loss scale restarts and never adapts",
)
LOOP_TEMPERATURE_MISMATCH = _f(
    "loop/temperature_mismatch",
    "rollout_engine",
    "an own loop's loss reads the logits at another temperature than the rollout sampled them at",
)
LOOP_INFERENCE_TENSOR = _f(
    "loop/inference_tensor",
    "loop_graph",
    "a tensor made under torch.inference_mode reaches a forward or loss that autograd must differentiate",
)
LOOP_CONSTANT_WITH_GRAD = _f(
    "loop/constant_with_grad",
    "loop_graph",
    "an own loop's advantage or reward carries the policy's graph (rows coupled through the loss)",
)
LOOP_REFERENCE_SHARED = _f(
    "loop/reference_shared",
    "setup_shared",
    "a model of the policy's class in an own loop sharing the policy's parameter tensors (a shallow copy)",
)
LOOP_REFERENCE_MOVED = _f(
    "loop/reference_moved",
    "reference",
    "an own loop's declared reference whose weights changed during the loop (trained or re-copied)",
)
LOOP_GRADIENT_CANCELS = _f(
    "loop/gradient_cancels",
    "loop_graph",
    "an own loop step with gradients exactly 0 though its loss reads the logits (old log-probs w. graph)",
)
