"""Gradient hooks a user's ``model.setup`` registered on parameters, as ``setup/grad_hooks`` findings (the
trainer's ``grad_hooks`` aspect of the setup record, `trainer.setup_grad_hooks`: the probe batch's gradient
with and without the hooks, at loss scale 1 and at fp16's initial 2^16).

The finding reads the measurement at the scale the role's backward runs at (its policy's loss scaling: a
hook on a parameter runs inside the backward, before ``unscale_``, so under fp16 it sees the gradient x the
scale) and says how the hooks changed it: the share of elements changed, the share held at one magnitude (a
clamp's bound: the update then follows sign(g)), the cosine to the gradient and to its sign, the norm ratio
(a scale). An error when `CHANGED_ERROR` of the elements or more change, a warning from `CHANGED_WARN`; hooks
that leave the probe's gradient as it was (an observer, a hook that only logs) are information. It names the
setup, the hook functions (file:line) and the fix: remove the hooks; bound the update with the norm clip
after ``unscale_`` (``algo.max_grad_norm``). Exercised by `pytest tests/test_setup_grad_hooks.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import setup_text
from verlaudit.rundir import Finding

ATTR = "setup_changes"
"""The model attribute `trainer.models.apply_setup` writes (`trainer.setup_diff.SETUP_CHANGES_ATTR`)."""
CHANGED_ERROR = 0.5
"""Gradient elements the hooks changed (share) from which the update no longer follows the gradient."""
CHANGED_WARN = 0.05
"""From this share the hooks rewrite a visible part of the gradient."""
SIGN_LIKE = 0.9
"""The hooked gradient's cosine to sign(g) from which the update follows the gradient's sign."""


def _scale(policy: Any, role: str) -> float:
    roles = (policy.to_dict().get("roles") or {}) if hasattr(policy, "to_dict") else dict(policy or {})
    r = roles.get(role) or {}
    if str(r.get("loss_scaling") or "none") == "none":
        return 1.0
    return float(r.get("init_scale") or 65536.0)


def _pick(by: Mapping[str, Any], scale: float) -> tuple[float, Mapping[str, Any]] | None:
    got = [(float(k), v) for k, v in by.items() if isinstance(v, Mapping)]
    return min(got, key=lambda kv: abs(kv[0] - scale)) if got else None


def _one(c: Mapping[str, Any], who: str, role: str, scale: float) -> Finding | None:
    hooks = ", ".join(c.get("hooks") or []) or "?"
    more = f" and {c['hook_count'] - 3} more" if c.get("hook_count", 0) > 3 else ""
    on = f"{c['params']} of the {role}'s {c['trainable']} trainable parameters ({setup_text.names(c.get('names') or [], c['params'])})"
    picked = _pick(c.get("by_scale") or {}, scale)
    if picked is None:
        return setup_text.finding(
            K.SETUP_GRAD_HOOKS, "info", role, who,
            f"{who} registers gradient hooks ({hooks}{more}) on {on}; the probe could not measure what they do",
            f"check what the hooks {who} registers do to the gradient", None, c,
            expected="the gradient the loss gives, unchanged by hooks",
        )  # fmt: skip
    at, m = picked
    base = (c.get("by_scale") or {}).get("1")
    how = []
    scaled_only = m["cos"] > 0.999 and abs(m["norm_ratio"] - 1) > 0.01
    if m["held"] >= 0.5 * m["changed"] and m["changed"] > 0:
        how.append(f"{m['held']:.0%} of them held at one magnitude (+-{m['bound']:.3g}: a clamp)")
    if m["cos_sign"] >= SIGN_LIKE:
        how.append(
            f"the result's cosine to sign(g) is {m['cos_sign']:.2f}: the update follows the gradient's sign"
        )
    elif scaled_only:
        how.append(
            f"it is the gradient x {m['norm_ratio']:.3g} (a scale: its direction is kept, so Adam's normalised "
            "step hardly changes, an SGD step shrinks or grows by that factor)"
        )
    else:
        how.append(f"cosine to the gradient {m['cos']:.2f}, norm {m['norm_ratio']:.3g}x")
    scaled = ""
    if at > 1:
        was = f" (at loss scale 1 they change {base['changed']:.0%})" if isinstance(base, Mapping) else ""
        scaled = (
            f"; under this role's fp16 loss scaling the hooks run inside the backward, before the GradScaler's "
            f"unscale_, so they see the gradient x {at:g}{was}"
        )
    sev = "error" if m["changed"] >= CHANGED_ERROR else "warning" if m["changed"] >= CHANGED_WARN else "info"
    if sev == "error" and scaled_only:
        sev = "warning"  # the gradient's direction is intact
    msg = (
        f"{who} registers element-wise gradient hooks ({hooks}{more}) on {on}: on the probe batch, at the loss "
        f"scale the {role}'s backward runs at ({at:g}), they change {m['changed']:.0%} of the gradient's "
        f"elements ({m['elements']} measured): " + "; ".join(how) + scaled
        + (": the optimizer steps on what the hooks made of the gradient, not on the loss's gradient" if sev != "info" else "")
    )  # fmt: skip
    fix = (
        f"remove the gradient hooks {who} registers ({hooks}); to bound the update clip the gradient's norm "
        "after unscale_ (algo.max_grad_norm, e.g. 1.0) instead of clamping elements"
    )
    return setup_text.finding(
        K.SETUP_GRAD_HOOKS, sev, role, who, msg, fix, (c.get("names") or [None])[0], c,
        expected="the gradient the loss gives, unchanged by hooks",
    )  # fmt: skip


def findings(models: Mapping[str, nn.Module], policy: Any) -> list[Finding]:
    """One ``setup/grad_hooks`` finding per role whose setup record carries a ``grad_hooks`` aspect."""
    out: list[Finding] = []
    for role, model in models.items():
        rec = getattr(model, ATTR, None)
        if not isinstance(rec, Mapping):
            continue
        who = f"{rec.get('key', 'model.setup')} ({rec.get('spec', '?')})"
        for c in rec.get("changes") or []:
            if isinstance(c, Mapping) and c.get("aspect") == "grad_hooks":
                f = _one(c, who, role, _scale(policy, role))
                if f is not None:
                    out.append(f)
    return out
