"""Finding kinds of an optimizer step that does not do what the objective asks (session 13): a KL loss whose
estimator has no expected gradient (`verlaudit.audit.config_pairs`), a preference loss flat at its
zero-margin value while the policy drifts (`verlaudit.audit.update_effect`), gradient hooks a setup
registered that rewrite the gradient (`verlaudit.audit.grad_hooks`), and an own loop that scales its loss
twice (`verlaudit.integrations.loop_scale`). Registered here, re-exported by `verlaudit.kinds` (write them as
``K.NAME``); split out of kinds.py for length."""

from __future__ import annotations

from verlaudit.kind_registry import _f

CONFIG_KL_LOSS_NO_GRADIENT = _f(
    "config/kl_loss_no_gradient",
    "config_combination",
    "a KL loss with the k1 estimator (kl_loss_type kl): on on-policy samples its gradient has mean zero",
)
PREFERENCE_FLAT = _f(
    "dynamics/preference_flat",
    "preference_flat",
    "a preference loss held at its zero-margin value (beta x margin ~ 0) while the log-probs move",
)
SETUP_GRAD_HOOKS = _f(
    "setup/grad_hooks",
    "setup_grad_hooks",
    "gradient hooks a setup registered on parameters rewrite the gradient (clamp, sign, scale)",
)
LOOP_LOSS_SCALED_TWICE = _f(
    "loop/loss_scaled_twice",
    "loop_scaling",
    "an own loop that multiplies its loss by the loss scale twice: gradients scale^2 x the loss",
)
