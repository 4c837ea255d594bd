"""What a user's ``model.setup`` changed in what a model computes, as findings (the trainer's record,
`trainer.setup_effect`: the model before and after the call):

- ``setup/module_settings``: plain settings of modules or of the config changed (a norm's
  ``variance_epsilon``, attention's ``scaling``), named with before -> after and the config field the
  value came from; a warning when the model's output on the probe batch moved with them (the model is
  no longer the checkpoint), else a fact that explains what follows.
- ``setup/interface_lost``: the setup returned another module (a wrapper) that lacks members of the
  model it replaces (``generate``, ``config``, the embeddings): the trainer's calls on them fail.
- ``setup/adapter_init``: the setup added parameters (adapters, LoRA factors) and the model's output at
  init moved: added tensors that do not start at zero make the adapted model another model.
- ``setup/outputs_collapsed``: distinct probe inputs gave distinct outputs before the setup and (nearly)
  one value after it: a clamp, a rounding or a saturating hook; every score or log-prob is the same.
- ``setup/shared_params``: after the setups two roles share parameter tensors they did not share
  before (a critic whose trunk is the actor's): two optimizers step the same weights, or a frozen role
  moves with a trained one.

Changes a setup normally makes (a value head re-initialised, adapters that start at zero, a dtype the
policy asked for, caching flags) stay quiet. Exercised by `pytest tests/test_setup_effect.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import setup_text, setup_values
from verlaudit.rundir import Finding

ATTR = "setup_changes"
"""The model attribute `trainer.models.apply_setup` writes (`trainer.setup_diff.SETUP_CHANGES_ATTR`)."""
MOVED = 0.05
"""A mean relative change of the probe output past which the setup changed what the model computes, not
how it rounds (a cast to bf16 moves it by about 0.4%)."""
COLLAPSE = 4
"""Distinct probe outputs divided by at least this factor (and at least 4 before): collapsed."""
LOADED_ROLES = ("actor", "reference", "reward")
"""Roles whose output is the loaded model's own (a critic's value head is set by its setup by design)."""


_names = setup_text.names
_finding = functools.partial(
    setup_text.finding, expected="the model as it was built, computing what it computed before the setup"
)


def _moved(fn: Mapping[str, Any] | None) -> str:
    if not fn:
        return ""
    if not fn.get("finite", True):
        return "its output on a probe batch is NaN/Inf after it (finite before)"
    return f"its output on a probe batch moved by {fn['change']:.0%} (mean relative) from the model as built"


def _settings(c: Mapping[str, Any], fn, who: str, role: str):
    parts, fixes = [], []
    for g in c["changed"][:3]:
        where = _names(g["modules"][:3], g["count"]) if g["modules"] != ["<config>"] else "the config"
        src = f" (the config's {g['config_field']} is {g['before']})" if g.get("config_field") else ""
        parts.append(
            f"{g['attr']} of {g['count']} module(s) ({where}) from {g['before']} to {g['after']}{src}"
        )
        keep = (
            f"the model's config value ({g['config_field']} = {g['before']})"
            if g.get("config_field")
            else g["before"]
        )
        fixes.append(f"leave {g['attr']} at {keep}")
    moved = bool(fn) and (not fn.get("finite", True) or fn.get("change", 0) > MOVED)
    msg = f"{who} changed the {role}'s module settings: " + "; ".join(parts)
    if moved:
        msg += f"; {_moved(fn)}: the {role} no longer computes what the checkpoint it was loaded from does"
    fix = "; ".join(fixes) + f": remove the assignment from {who} (a setting the checkpoint was trained with)"
    module = c["changed"][0]["modules"][0] if c["changed"] and c["changed"][0]["modules"] else None
    return ("warning" if moved else "info"), msg, fix, module


def _interface(c: Mapping[str, Any], who: str, role: str, trains: bool):
    lost = _names(c["lost"], c["count"])
    calls = [n for n in ("generate", "config", "get_input_embeddings") if n in c.get("lost_interface", [])]
    calls = calls if role == "actor" else []  # the other roles' models are only called forward
    fatal = role == "actor" and bool(calls)
    msg = (
        f"{who} returned a {c['after_type']} module in place of the {role}'s {c['before_type']}: the wrapper "
        f"lacks {lost} of the model it replaced"
        + (
            f"; the trainer calls {', '.join(n + '()' if n != 'config' else '.config' for n in calls)} on the "
            f"{role}, so those calls fail (AttributeError: '{c['after_type']}' object has no attribute ...)"
            if calls
            else ""
        )
    )
    inner = f" (the model is its .{c['inner']})" if c.get("inner") else ""
    fix = (
        f"return None from {who} and change the model in place, or return the model itself{inner}; a wrapper "
        f"must forward generate / config and the embeddings to the wrapped model (e.g. a __getattr__ that "
        "falls back to it)"
    )
    # a role the trainer only calls forward on (reference, critic, reward) may be wrapped: a fact that
    # explains a failure that follows, not a fault of its own
    return ("error" if fatal else "info"), msg, fix, c.get("inner")


def _adapter(c: Mapping[str, Any], fn, who: str, role: str):
    up = c.get("up") or c["names"]
    msg = (
        f"{who} added {c['count']} tensor(s) to the {role} ({c['elements']} elements: "
        f"{_names(c['names'][:4], c['count'])}), "
        + ("none of them zero" if not c["zero_count"] else f"only {c['zero_count']} of them zero")
        + f", and at init {_moved(fn)}: the adapters do not start as the identity, so the adapted {role} is "
        "not the model it was built from"
        + (
            " (and not the reference, which has no adapters): the KL differs from 0 at step 0"
            if role == "actor"
            else ""
        )
    )
    fix = (
        f"init the up-projection factor of each adapter to zeros in {who} (nn.init.zeros_ on {_names(up[:2], len(up))}: "
        "lora_B = 0) so that the adapted model starts exactly at the base model"
    )
    return "warning", msg, fix, up[0] if up else None


def _collapsed(fn: Mapping[str, Any], hooks, settings, who: str, role: str):
    lo, hi = fn["range"]
    what = "scores" if role == "reward" else "values" if role == "critic" else "outputs"
    by = (
        f"the forward hook(s) it registered on {_names(hooks['modules'][:2], hooks['count'])}"
        if hooks
        else "the settings it changed"
        if settings
        else "what it changed"
    )
    msg = (
        f"after {who} the {role}'s {what} on {fn['rows']} distinct probe inputs take {fn['distinct']} distinct "
        f"value(s) (in [{lo:.4g}, {hi:.4g}]) where the model as built gave {fn['distinct_before']} (in "
        f"[{fn['range_before'][0]:.4g}, {fn['range_before'][1]:.4g}]): {by} saturates (clamps / rounds) them, so "
        f"every response gets the same {what[:-1]} and the {what} carry no signal"
    )
    rng = f"[{fn['range_before'][0]:.3g}, {fn['range_before'][1]:.3g}]"
    fix = (
        f"remove the clamp (forward hook) {who} registers on the {role}, or set its range from this model's "
        f"own {what} (about {rng} on the probe batch) so that it does not clip them all"
        if hooks
        else f"undo the change {who} makes to the {role}: its {what} must stay distinct for distinct inputs "
        f"(about {rng} before it)"
    )
    return "error", msg, fix, (hooks or {}).get("modules", [None])[0]


def _shared(c: Mapping[str, Any], who: str):
    a, b = c["roles"]
    both = len(c["trains"]) == 2
    frozen = [r for r in (a, b) if r not in c["trains"]]
    msg = (
        f"after {who} the {b} and the {a} share {c['count']} parameter tensor(s) ({c['elements']} elements; "
        f"{b}: {_names(c['names'][1][:2], c['count'])} are the {a}'s {_names(c['names'][0][:2], c['count'])}): "
        + (
            f"the {a}'s and the {b}'s optimizers both step the same weights, so the {b}'s loss moves the {a} "
            "(and each update is applied twice, with two optimizers' states)"
            if both
            else f"the {frozen[0]} role, meant to stay fixed, moves with every update of the trained one"
            if frozen and c["trains"]
            else "the two roles are one model"
        )
    )
    fix = (
        f"give the {b} its own copy in {who} (copy.deepcopy of the {a}'s module, or load it separately) "
        f"instead of assigning the {a}'s module: roles must not share (alias) parameter tensors"
    )
    return ("error" if c["trains"] else "warning"), msg, fix, c["names"][1][0] if c["names"][1] else None


def findings(models: Mapping[str, nn.Module], trainable_roles) -> list[Finding]:
    """The findings of `trainer.setup_effect`'s aspects of every model's setup record."""
    out: list[Finding] = []
    pairs: set[tuple[str, ...]] = set()
    for role, model in models.items():
        rec = getattr(model, ATTR, None)
        if not isinstance(rec, Mapping) or not rec.get("changes"):
            continue
        who = f"{rec.get('key', 'model.setup')} ({rec.get('spec', '?')})"
        by = {c.get("aspect"): c for c in rec["changes"] if isinstance(c, Mapping)}
        fn = by.get("function")
        if "settings" in by:
            out.append(
                _finding(
                    K.SETUP_SETTINGS,
                    *_lead(_settings(by["settings"], fn, who, role), role, who),
                    by["settings"],
                )
            )
        if "interface" in by:
            got = _interface(by["interface"], who, role, role in trainable_roles)
            out.append(_finding(K.SETUP_INTERFACE, *_lead(got, role, who), by["interface"]))
        moved = bool(fn) and (not fn.get("finite", True) or fn.get("change", 0) > MOVED)
        if (
            "added" in by
            and moved
            and role in LOADED_ROLES
            and by["added"]["zero_count"] < by["added"]["count"]
        ):
            out.append(
                _finding(
                    K.SETUP_ADAPTER_INIT, *_lead(_adapter(by["added"], fn, who, role), role, who), by["added"]
                )
            )
        # a trainable role's outputs tied at init (a value head started at zero) train apart; a frozen
        # role's, or ones a hook or a setting keeps tied, stay so
        lasting = role not in trainable_roles or any(k in by for k in ("hooks", "settings", "modules"))
        if (
            lasting
            and fn
            and fn.get("finite")
            and fn["distinct_before"] >= 4
            and fn["distinct"] * COLLAPSE <= fn["distinct_before"]
        ):
            got = _collapsed(fn, by.get("hooks"), by.get("settings"), who, role)
            out.append(_finding(K.SETUP_COLLAPSED, *_lead(got, role, who), fn))
        for c in rec["changes"]:
            # two trained roles; a frozen role that holds a trained one's tensors is
            # `invariants_data.shared_role_findings`' (model/frozen_role_shared)
            if (
                isinstance(c, Mapping)
                and c.get("aspect") == "shared"
                and len(c.get("trains") or []) == 2
                and tuple(c["roles"]) not in pairs
            ):
                pairs.add(tuple(c["roles"]))
                sev, msg, fix, module = _shared(c, who)
                out.append(_finding(K.SETUP_SHARED, sev, c["roles"][1], who, msg, fix, module, c))
    return out + setup_values.findings(models, trainable_roles)


def _lead(got: tuple[str, str, str, Any], role: str, who: str) -> tuple[str, str, str, str, str, Any]:
    sev, msg, fix, module = got
    return sev, role, who, msg, fix, module
