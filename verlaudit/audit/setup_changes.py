"""What the user's ``model.setup`` changed, as findings: one per role and aspect that the trainer's
before/after record (`trainer.setup_diff`, stored on the model as ``setup_changes``) shows, each
naming the setup function (``model.setup.<role> (file.py:function)``) and what it did: cast
parameters (``setup/dtype``), resized the embeddings (``setup/vocab``), changed which parameters train
(``setup/trainable``), untied the output embeddings (``setup/ties``), replaced modules
(``setup/modules``), registered forward hooks (``setup/hooks``), changed training mode or dropout
(``setup/mode``).

A change is a fact, not a fault: most are ``info``, and `verlaudit diagnose` names the setup function
as the culprit of the findings a change explains (the rules in `verlaudit.analysis.diagnose.rules`).
A change is a warning on its own when it contradicts the run: a cast away from the policy's
parameter dtype, embeddings grown past the tokenizer's ids, most of a trainable model frozen, a frozen
role (reference, reward model) left in training mode with dropout. Exercised by `pytest
tests/test_setup_diff.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from verlaudit import kinds as K
from verlaudit.dtypes import dtype_name
from verlaudit.rundir import Finding

ATTR = "setup_changes"
"""The model attribute `trainer.models.apply_setup` writes (`trainer.setup_diff.SETUP_CHANGES_ATTR`)."""

FROZEN_SHARE = 0.5
"""A trainable role left with less than this share of the parameters that trained before its setup."""


def _names(xs: list[str], count: int) -> str:
    shown = ", ".join(x or "<model>" for x in xs)
    return shown + (f" and {count - len(xs)} more" if count > len(xs) else "")


def _dtype(c: Mapping[str, Any], who: str, role: str, policy: Any, modules: Mapping[str, Any] | None):
    want = dtype_name(getattr(policy, "param_dtype", None))
    to = ", ".join(c["to"])
    contradicts = bool(want) and any(d != want for d in c["to"])
    replaced = ""
    if modules:
        replaced = " (replaced " + ", ".join(f"{n}: {a} -> {b}" for n, a, b in modules["replaced"][:3]) + ")"
    msg = (
        f"{who} put {c['elements']} of the {role}'s {c['total']} parameter elements ({c['params']} tensor(s): "
        f"{_names(c['names'], c['params'])}) in {to}, from {', '.join(c['from'])}{replaced}"
        + (f"; the policy stores {role} weights in {want}" if contradicts else "")
    )
    fix = (
        f"keep the {role}'s parameters in {want}: remove the cast ({to}) from {who}; a lower-precision role "
        f"is set with precision.overrides.{role}.param_dtype / compute_dtype, which the trainer pairs with "
        "fp32 master weights and loss scaling"
    )
    return ("warning" if contradicts else "info"), msg, fix, c["names"][0] if c["names"] else None


def _vocab(c: Mapping[str, Any], who: str, role: str, vocab: int | None):
    grew = vocab is not None and c["after"] is not None and c["after"] > vocab and c["before"] == vocab
    msg = (
        f"{who} resized the {role}'s embeddings from {c['before']} to {c['after']} rows"
        + (f" (output {c['out_before']} -> {c['out_after']})" if c["out_after"] != c["after"] else "")
        + (f"; the tokenizer has {vocab} ids" if vocab is not None else "")
        + (": the model can sample ids the tokenizer and the roles not resized do not have" if grew else "")
    )
    fix = (
        f"resize to the tokenizer's size in {who} (model.resize_token_embeddings(len(tokenizer)), no "
        "pad_to_multiple_of), or give every role the same resize and the tokenizer the added tokens"
    )
    return ("warning" if grew else "info"), msg, fix, "model.embed_tokens"


def _trainable(c: Mapping[str, Any], who: str, role: str, trainable: bool):
    share = c["after"] / c["before"] if c["before"] else 1.0
    msg = (
        f"{who} left {c['after']} of the {role}'s {c['total']} parameter elements trainable "
        f"({c['training_params']} of {c['params']} tensors: {_names(c['training'], c['training_params'])}; "
        f"{c['before']} trained before it): {c['frozen']} tensor(s) frozen (requires_grad False)"
    )
    fix = (
        f"check the requires_grad logic in {who}: it froze {100 * (1 - share):.0f}% of the {role}'s "
        "trainable parameters (freeze what you mean to keep fixed, train the rest)"
    )
    warn = trainable and share < FROZEN_SHARE
    return ("warning" if warn else "info"), msg, fix, c["training"][0] if c["training"] else None


def _mode(c: Mapping[str, Any], who: str, role: str, trainable: bool):
    drop = {**c["dropout"], **c["attr_dropout"], **{f"config.{k}": v for k, v in c["config_dropout"].items()}}
    shown = ", ".join(f"{k or '<model>'}={v:g}" for k, v in list(drop.items())[:4])
    msg = f"{who} left the {role} in {'training' if c['training'] else 'eval'} mode" + (
        f" with dropout ({shown})" if drop else ""
    )
    stochastic = not trainable and c["training"] and bool(drop)
    if stochastic:
        msg += ": its scores / log-probs change from call to call on the same input"
    fix = f"call model.eval() at the end of {who} and set dropout to 0 for a model that only scores"
    return ("warning" if stochastic else "info"), msg, fix, None


def _finding(kind: str, role: str, who: str, severity: str, msg: str, fix: str, module, observed) -> Finding:
    return Finding(
        severity=severity,
        kind=kind,
        role=role,
        where=who,
        message=msg,
        observed={"module": module, **{k: v for k, v in observed.items() if k != "aspect"}},
        expected="what the model was built as",
        fix=fix,
    )


# long: one branch per aspect of the trainer's record, each with its message, severity and fix
def findings(
    config: Mapping[str, Any],
    models: Mapping[str, nn.Module],
    policy: Any,
    tokenizer_info: Mapping[str, Any],
    trainable_roles,
) -> list[Finding]:
    """The ``setup/*`` findings of every model that carries the trainer's record of its setup."""
    out: list[Finding] = []
    vocab = tokenizer_info.get("vocab_size") if isinstance(tokenizer_info, Mapping) else None
    for role, model in models.items():
        rec = getattr(model, ATTR, None)
        if not isinstance(rec, Mapping) or not rec.get("changes"):
            continue
        who = f"{rec.get('key', 'model.setup')} ({rec.get('spec', '?')})"
        by = {c.get("aspect"): c for c in rec["changes"] if isinstance(c, Mapping)}
        role_policy = getattr(policy, "roles", {}).get(role) if policy is not None else None
        trainable = role in trainable_roles

        if "dtype" in by:
            out.append(
                _finding(
                    K.SETUP_DTYPE,
                    role,
                    who,
                    *_dtype(by["dtype"], who, role, role_policy, by.get("modules")),
                    by["dtype"],
                )
            )
        if "vocab" in by:
            out.append(
                _finding(K.SETUP_VOCAB, role, who, *_vocab(by["vocab"], who, role, vocab), by["vocab"])
            )
        if "trainable" in by:
            out.append(
                _finding(
                    K.SETUP_TRAINABLE,
                    role,
                    who,
                    *_trainable(by["trainable"], who, role, trainable),
                    by["trainable"],
                )
            )
        if "ties" in by:
            msg = (
                f"{who} untied the {role}'s output embeddings (lm_head) from its input embeddings: two "
                "tensors that train apart"
            )
            fix = f"call model.tie_weights() at the end of {who}, or set tie_word_embeddings false if a separate head is meant"
            out.append(_finding(K.SETUP_TIES, role, who, "info", msg, fix, "lm_head", by["ties"]))
        if "modules" in by:
            m = by["modules"]
            shown = ", ".join(f"{n}: {a} -> {b}" for n, a, b in m["replaced"])
            msg = f"{who} replaced {m['count']} module(s) of the {role}: {shown}"
            fix = f"check the replacement modules of {who}: their dtype, inputs and outputs against the originals'"
            out.append(_finding(K.SETUP_MODULES, role, who, "info", msg, fix, m["replaced"][0][0], m))
        if "hooks" in by:
            h = by["hooks"]
            msg = f"{who} registered forward hooks on {h['count']} module(s) of the {role}: {_names(h['modules'], h['count'])}"
            fix = f"remove the forward hooks {who} registers, or keep their outputs in the module's own dtype"
            out.append(
                _finding(
                    K.SETUP_HOOKS, role, who, "info", msg, fix, h["modules"][0] if h["modules"] else None, h
                )
            )
        if "mode" in by:
            out.append(
                _finding(K.SETUP_MODE, role, who, *_mode(by["mode"], who, role, trainable), by["mode"])
            )
    return out
