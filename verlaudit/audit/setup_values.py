"""What a user's ``model.setup`` did to a model's weights and forward, as findings (the trainer's record,
`trainer.setup_values`: a sample of every parameter, the hooks and the forward's modes, before and after
the call). Each names the setup function, the module, before -> after, and a fix that undoes that change:

- ``setup/weights_rewritten``: loaded weights the setup re-initialised (after and before uncorrelated),
  rescaled (after = c x before), zeroed or changed: the role is no longer the checkpoint it was loaded
  from (an actor re-initialised starts from scratch while its reference is the checkpoint; a head x 0.1
  divides every logit by 10).
- ``setup/hook_effect``: a forward hook or pre-hook the setup registered changes the tensor it receives:
  adds noise (two calls on the same input differ), only in training mode (the rollout samples in eval
  mode, the trainer recomputes in training mode: their log-probs differ by the hook), or scales it.
- ``setup/forward_not_deterministic``: without a hook to blame, the model's forward after the setup gives
  two outputs for one input, or differs between training and eval mode, where the model as built did not.

Weights a setup loads (``load_state_dict``, ``from_pretrained``) and a critic's value head are the
setup's job and stay quiet; so do hooks that only observe or round. Exercised by `pytest
tests/test_setup_values.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import setup_text
from verlaudit.rundir import Finding

ATTR = "setup_changes"
"""The model attribute `trainer.models.apply_setup` writes (`trainer.setup_diff.SETUP_CHANGES_ATTR`)."""
MOVED = 0.05
"""A mean relative change past which a hook or a forward computes something else, not a rounding."""
SAME = 1e-2
"""A forward's two calls (or its two modes) apart by more than this, where they agreed before the setup."""
REINIT_SHARE = 0.5
"""Re-initialised elements, as a share of the role's, from which the role starts from scratch: an error."""
LOADED_ROLES = ("actor", "reference", "reward", "critic")
_HEADS = ("value_head", "score", "v_head", "summary")
"""A critic's (or scorer's) head, re-initialised by design for a critic."""


_names = setup_text.names
_finding = functools.partial(
    setup_text.finding,
    expected="the model as it was built: the checkpoint's weights, the same forward in every mode and call",
)


def _loaded(rec: Mapping[str, Any]) -> bool:
    """Whether the setup loaded weights into the model itself (its rewritten values are the load's)."""
    for c in rec.get("changes") or []:
        if not isinstance(c, Mapping):
            continue
        if c.get("aspect") == "load" and c.get("loaded", 0) > 0:
            return True
        if c.get("aspect") in ("pretrained", "remapped"):
            return True
    return False


def _moved(by: Mapping[str, Any]) -> float | None:
    fn = by.get("function")
    if not isinstance(fn, Mapping):
        return None
    return float("inf") if not fn.get("finite", True) else float(fn.get("change", 0.0))


def _head(name: str) -> bool:
    return any(h in name.split(".") for h in _HEADS)


# long: one branch per kind of rewrite (re-initialised, scaled, tied, zeroed, changed), each with its words and fix
def _weights(c: Mapping[str, Any], by, who: str, role: str, trains: bool):
    groups = {k: dict(v) for k, v in c.items() if isinstance(v, Mapping)}
    tied_to = groups.pop("tied_to", None)
    if role == "critic":  # a critic's head is new by design: only its trunk counts
        for g in groups.values():
            keep = [i for i, n in enumerate(g["names"]) if not _head(n)]
            g["names"] = [g["names"][i] for i in keep]
            g["numbers"] = [g["numbers"][i] for i in keep]
            g["count"] = (
                len(keep) if g["count"] <= len(g["names"]) else g["count"] - (len(g["names"]) - len(keep))
            )
        groups = {k: g for k, g in groups.items() if g["names"]}
    if not groups or set(groups) == {"changed"} and (_moved(by) or 0) <= MOVED:
        return None
    if tied_to:
        groups["tied_to"] = tied_to
    moved = _moved(by)
    parts, fixes = [], []
    if "reinit" in groups:
        g = groups["reinit"]
        parts.append(
            f"re-initialised {g['count']} of its {c['tensors']} weight tensors ({g['elements']} of {c['elements']} "
            f"elements: {_names(g['names'][:3], g['count'])}): their values after the setup are uncorrelated with "
            f"the loaded ones (correlation {max(abs(x) for x in g['numbers']):.2f} at most): re-initialised at random (or overwritten with other weights), not "
            "the checkpoint's"
        )
        fixes.append(
            f"do not re-initialise the loaded weights in {who}: call reset_parameters() / the init only on the "
            "modules you add (a new head only), never on model.modules() of a loaded model"
        )
    if "scaled" in groups:
        g = groups["scaled"]
        fac = sorted({round(x, 4) for x in g["numbers"]})
        parts.append(
            f"multiplied {g['count']} weight tensor(s) ({_names(g['names'][:3], g['count'])}) by "
            f"{', '.join(f'{x:g}' for x in fac[:3])}"
            + (
                f" (the output head: every logit x {fac[0]:g}, a temperature of {1 / fac[0]:.3g} baked into the "
                "weights)"
                if any("head" in n or "lm_head" in n for n in g["names"]) and fac and fac[0]
                else ""
            )
        )
        fixes.append(
            f"remove the scaling of {_names(g['names'][:2], g['count'])} from {who}: keep the checkpoint's weights, "
            "and apply a temperature or calibration only where it is meant (the sampling temperature, or the "
            "scorer's output), not in the weights every role trains and compares"
        )
    if "tied" in groups:
        g, to = groups["tied"], groups.get("tied_to", {}).get("names", [])
        parts.append(
            f"tied {_names(g['names'][:2], g['count'])} to {_names(to[:2], len(to))} (the checkpoint's own tensor "
            "replaced by another parameter's)"
        )
        fixes.append(
            f"do not tie {_names(g['names'][:2], g['count'])} in {who}: the checkpoint was trained with its own "
            "tensor there (tie_word_embeddings false); keep it untied"
        )
    if "zeroed" in groups:
        g = groups["zeroed"]
        parts.append(f"set {g['count']} weight tensor(s) to zero ({_names(g['names'][:3], g['count'])})")
        fixes.append(f"do not zero the loaded weights {_names(g['names'][:2], g['count'])} in {who}")
    if "changed" in groups and not parts:
        g = groups["changed"]
        parts.append(
            f"changed the values of {g['count']} weight tensor(s) ({_names(g['names'][:3], g['count'])})"
        )
        fixes.append(
            f"leave the loaded weights of {_names(g['names'][:2], g['count'])} as the checkpoint has them in {who}"
        )
    share = groups.get("reinit", {}).get("elements", 0) / max(1, c["elements"])
    msg = f"{who} rewrote the {role}'s loaded weights: " + "; ".join(parts)
    if moved is not None and moved > MOVED:
        msg += f"; its output on a probe batch moved by {moved:.0%} (mean relative)"
    per_role = str(by.get("_key", "")).startswith("model.setup.")
    msg += f": the {role} is no longer the checkpoint it was loaded from" + (
        " (and not the reference, which is the checkpoint): the KL to the reference is not 0 at step 0"
        if role == "actor" and per_role
        else ""
    )
    severity = "error" if share >= REINIT_SHARE else "warning" if moved is None or moved > MOVED else "info"
    groups.pop("tied_to", None)
    first = next(iter(groups.values()))["names"]
    return severity, msg, " ".join(fixes), first[0] if first else None


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else 0.0


def _hook(c: Mapping[str, Any], who: str, role: str, trains: bool):
    e, t = c.get("eval") or {}, c.get("train") or {}
    if not e and not t:
        return None
    kind = "pre-hook" if c.get("pre") else "forward hook"
    what = f"the {kind} {c['hook']} on {c['module'] or '<model>'}"
    en, tn = _num(e.get("noise")), _num(t.get("noise"))
    ec, tc = _num(e.get("change")), _num(t.get("change"))
    train_only = bool(t) and (tn > MOVED or tc > MOVED) and ec <= MOVED and en <= MOVED
    if en > MOVED or (not e and tn > MOVED):
        sev = "error"
        how = (
            f"adds random noise to the {'input' if c.get('pre') else 'output'} it receives: two calls on the same "
            f"input differ by {en or tn:.0%} (mean relative), in eval mode too"
        )
        why = f"the {role}'s forward is not a function of its input: its log-probs / scores change from call to call"
    elif train_only and tn > MOVED:
        sev = "error" if trains else "info"
        how = (
            f"adds random noise in training mode only (two calls on the same input differ by {tn:.0%}, mean "
            f"relative; {tc:.0%} from its input) and leaves it unchanged in eval mode"
        )
        why = (
            f"the rollout samples from the {role} in eval mode (noiseless) while the trainer's old log-probs and "
            "update run it in training mode (noisy): rollout and trainer log-probs disagree by the noise, in any "
            "dtype, and the ratios / KL measure the hook"
        )
    elif train_only:
        sev = "error" if trains else "info"
        how = f"changes it by {tc:.0%} (mean relative) in training mode only and leaves it unchanged in eval mode"
        why = "the rollout (eval mode) and the trainer (training mode) compute two different models"
    elif max(ec, tc) > MOVED:
        sev = "warning"
        scale = e.get("scale", t.get("scale"))
        how = (
            f"multiplies the {'input' if c.get('pre') else 'output'} it receives by {scale:.4g} in every mode"
            if scale is not None
            else f"changes it by {max(ec, tc):.0%} (mean relative) in every mode"
        )
        why = f"every forward of the {role} is no longer the checkpoint's model (it was not trained with it)"
    else:
        return None
    msg = f"{who} registered {what}, which {how}: {why}"
    noisy = max(en, tn) > MOVED
    fix = f"remove the {kind} ({c['hook']}) that {who} registers on {c['module'] or 'the model'}" + (
        ": noise on the embeddings (NEFTune) is an SFT regulariser; in RL the sampled and the trained "
        "policy must be one function (no noise in the forward)"
        if noisy
        else ": the model must compute the same in training and eval mode"
        if train_only
        else (
            f": the checkpoint was not trained with that scale ({e.get('scale', t.get('scale')):.4g}); a "
            "scale the architecture needs belongs in the model's own forward or config, as trained"
            if e.get("scale", t.get("scale")) is not None
            else ": the checkpoint was not trained with it"
        )
    )
    return sev, msg, fix, c["module"] or None


def _modes(c: Mapping[str, Any], who: str, role: str, trains: bool):
    parts = []
    if c["eval_noise"] > max(SAME, 10 * c["eval_noise_before"]):
        parts.append(f"two eval-mode calls on the same input differ by {c['eval_noise']:.0%} (mean relative)")
    if c["train_noise"] > max(SAME, 10 * c["train_noise_before"]):
        parts.append(f"two training-mode calls differ by {c['train_noise']:.0%}")
    if c["train_vs_eval"] > max(SAME, 10 * c["train_vs_eval_before"]):
        parts.append(f"training and eval mode differ by {c['train_vs_eval']:.0%}")
    if not parts:
        return None
    msg = (
        f"after {who} the {role}'s forward is not one function of its input: "
        + "; ".join(parts)
        + f" (the model as built: {c['eval_noise_before']:.2g}, {c['train_noise_before']:.2g}, "
        f"{c['train_vs_eval_before']:.2g}): the rollout (eval mode) and the trainer (training mode) log-probs "
        "disagree by what the setup changed, not by rounding"
    )
    fix = (
        f"undo what {who} changed in the {role}'s forward: no random numbers in a module's forward (dropout "
        "forced on, noise), and the same computation in training and eval mode"
    )
    sev = "error" if trains or c["eval_noise"] > SAME else "info"
    return sev, msg, fix, None


def findings(models: Mapping[str, nn.Module], trainable_roles) -> list[Finding]:
    """The findings of `trainer.setup_values`' aspects of every model's setup record."""
    out: list[Finding] = []
    for role, model in models.items():
        rec = getattr(model, ATTR, None)
        if not isinstance(rec, Mapping) or not rec.get("changes"):
            continue
        who = f"{rec.get('key', 'model.setup')} ({rec.get('spec', '?')})"
        trains = role in trainable_roles
        by = {c.get("aspect"): c for c in rec["changes"] if isinstance(c, Mapping)}
        by["_key"] = rec.get("key", "")
        if "values" in by and role in LOADED_ROLES and not _loaded(rec):
            got = _weights(by["values"], by, who, role, trains)
            if got is not None:
                out.append(_finding(K.SETUP_WEIGHTS, got[0], role, who, *got[1:], by["values"]))
        hooked = False
        fn = by.get("function") if isinstance(by.get("function"), Mapping) else {}
        collapsed = (
            fn.get("finite")
            and fn.get("distinct_before", 0) >= 4
            and fn["distinct"] * 4 <= fn["distinct_before"]
        )
        for c in rec["changes"]:
            if isinstance(c, Mapping) and c.get("aspect") == "hook_effect":
                got = _hook(c, who, role, trains)
                if got is not None and collapsed and got[0] == "warning":
                    hooked = True  # a clamp that collapses the outputs: `setup/outputs_collapsed` says so
                    continue
                if got is not None:
                    hooked = True
                    out.append(_finding(K.SETUP_HOOK_EFFECT, got[0], role, who, *got[1:], c))
        if "modes" in by and not hooked:
            got = _modes(by["modes"], who, role, trains)
            if got is not None:
                out.append(_finding(K.SETUP_NOT_DETERMINISTIC, got[0], role, who, *got[1:], by["modes"]))
    return out
