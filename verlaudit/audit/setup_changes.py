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
from verlaudit.audit import grad_hooks, setup_effect, setup_text
from verlaudit.dtypes import dtype_name
from verlaudit.rundir import Finding

ATTR = "setup_changes"
"""The model attribute `trainer.models.apply_setup` writes (`trainer.setup_diff.SETUP_CHANGES_ATTR`)."""

LOAD_REPORT = "load_report"
"""The model attribute with what its checkpoint lacked (`trainer.models.LOAD_REPORT_ATTR`)."""

FROZEN_SHARE = 0.5
"""A trainable role left with less than this share of the parameters that trained before its setup."""


_names = setup_text.names


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
    head = list(c.get("head_frozen") or [])
    if trainable and head:
        what = "value head: its values" if role == "critic" else "output head (lm_head): its logits"
        msg += (
            f"; it froze the {role}'s {what} are a fixed projection of the features "
            f"({', '.join(head)} kept at its init)"
        )
        fix = (
            fix
            if share < FROZEN_SHARE
            else (
                f"keep the {role}'s head trainable: leave requires_grad True on {', '.join(head)} in {who} "
                "(freeze the body, never the head the loss reads)"
            )
        )
    warn = trainable and (share < FROZEN_SHARE or bool(head))
    module = head[0] if trainable and head else c["training"][0] if c["training"] else None
    return ("warning" if warn else "info"), msg, fix, module


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


def _load(c: Mapping[str, Any], who: str, role: str):
    """A state dict the setup loaded into the model: a finding when it left most of it at init."""
    where = f"the {role}" + (f"'s {c['module']}" if c.get("module") else "")
    nothing = c["given"] > 0 and c["loaded"] <= 0
    if not nothing and c["missing"] <= c["expected"] / 2:
        return None  # a partial load (a head left out) is a choice the call says it makes
    prefix = c.get("prefix")
    hint = ""
    if prefix and not prefix.startswith("-"):
        hint = f"; the given keys lack the prefix {prefix!r} ({c['unexpected_names'][0]!r} is the model's {prefix + c['unexpected_names'][0]!r})"
    elif prefix:
        hint = f"; the given keys carry an extra prefix {prefix[1:]!r}"
    msg = (
        f"{who} called load_state_dict(strict={c['strict']}) on {where} ({c['type']}) with {c['given']} "
        f"tensors: {c['loaded']} matched its names, {c['unexpected']} unexpected keys were ignored (e.g. "
        f"{_names(c['unexpected_names'][:2], c['unexpected'])}) and {c['missing']} of its {c['expected']} "
        f"tensors are missing from the state dict (e.g. {_names(c['missing_names'][:2], c['missing'])}){hint}: "
        + ("nothing was loaded, " if nothing else "")
        + f"the {role} keeps its initial (random) weights there"
    )
    if prefix and not prefix.startswith("-"):
        into = ".".join(x for x in (c.get("module"), prefix.rstrip(".")) if x)
        how = (
            f"load into model.{into} (model.{into}.load_state_dict(...)), or prefix the keys with {prefix!r}"
        )
    elif prefix:
        how = f"strip {prefix[1:]!r} from the keys before load_state_dict"
    else:
        how = "load a state dict whose keys are the model's own names (model.state_dict().keys())"
    fix = f"{how} in {who}; keep strict=True (or check the missing_keys / unexpected_keys it returns)"
    return ("error" if nothing else "warning"), msg, fix, c.get("module") or None


def _graph(c: Mapping[str, Any], who: str, role: str):
    off = c.get("grad_off_in") or []
    dead = not c["output_requires_grad"]
    if off and c.get("reentrant"):
        name, typ = off[0]
        msg = (
            f"after {who}, the {role}'s {name or '<model>'} ({typ}) runs its layers inside a reentrant "
            f"torch.utils.checkpoint (use_reentrant=True; {_names(c['reentrant'][:2], len(c['reentrant']))} "
            "compute without gradients and are recomputed in backward only for inputs that require grad): no "
            "input of the checkpointed block requires grad (the parameters before it, the embeddings, are "
            "frozen), so its output carries no graph and the weights inside it get no gradient"
        )
        fix = (
            f"checkpoint with use_reentrant=False in {typ}.forward (which {who} put in the {role}), or call "
            "model.enable_input_require_grads() after freezing the embeddings (or keep them requires_grad), so "
            "that the checkpointed layers' input requires grad"
        )
    elif off:
        name, typ = off[0]
        msg = (
            f"after {who}, the {role}'s {name or '<model>'} ({typ}) runs its forward with gradients off "
            "(torch.no_grad / inference_mode inside it): what it computes carries no autograd graph, so "
            "the trainable weights below it get no gradient"
        )
        fix = (
            f"remove the @torch.no_grad() decorator (or no_grad / inference_mode block) from {typ}.forward, "
            f"which {who} put in the {role}: a module that trains must compute with gradients on"
        )
    elif c.get("detached_in"):
        name, typ = c["detached_in"][0]
        msg = (
            f"after {who}, the {role}'s {name or '<model>'} ({typ}) returns a tensor cut from the autograd "
            "graph (.detach() / .data / a new tensor) although its submodules' outputs carry one: the "
            "trainable weights below it get no gradient through it"
        )
        fix = f"remove the .detach() (or .data) from {typ}.forward, which {who} put in the {role}"
    else:
        name = None
        msg = f"after {who}, the {role}'s output carries no autograd graph (requires_grad False)"
        fix = f"remove the .detach() / no_grad from the modules {who} put in the {role}"
    if dead:
        msg += (
            f": the {role}'s output does not require grad although {c['trainable']} of its tensors do, so "
            "the loss's backward fails (or trains nothing)"
        )
    else:
        msg += f" ({c['reached']} of its {c['trainable']} trainable tensors are still reached)"
    return ("error" if dead else "warning"), msg, fix, name


def _unregistered(c: Mapping[str, Any], who: str, role: str):
    msg = (
        f"{c['count']} tensor(s) with requires_grad ({c['elements']} elements: {_names(c['names'], c['count'])}) "
        f"take part in the {role}'s forward after {who} but are not registered parameters of the {role} "
        "(held in a plain list, dict or attribute): the optimizer, built from the model's parameters, "
        "never updates them, so they stay at their init (not trained)"
    )
    fix = (
        f"hold the layers {who} adds in nn.ModuleList / nn.Sequential / nn.ModuleDict (a tensor in "
        "nn.Parameter) so that they are registered, and their parameters trained"
    )
    module = str(c["names"][0]).split("[")[0] if c.get("names") else None
    return "warning", msg, fix, module


def _roles(c: Mapping[str, Any], who: str, role: str):
    a, b = c["roles"]
    other = b if role == a else a
    config = "; ".join(
        f"{'' if '.' in k else 'config.'}{k}: {a} {v[0]} vs {b} {v[1]}" for k, v in c["config"].items()
    )
    differ = (
        f"{c['differ_count']} of the {c['compared']} tensors it wrote differ between {a} and {b} "
        f"({_names(c['differ'], c['differ_count'])})"
        if c["differ_count"]
        else ""
    )
    msg = (
        f"{who} changed the {role} but not the {other} built from the same weights: "
        + "; ".join(x for x in (differ, config) if x)
        + f": the {b} is not the {a}'s starting point, they disagree from step 0 and the KL to the "
        "reference measures the setup's change, not training"
    )
    rope = any("rotary" in n or "inv_freq" in n for n in c.get("differ") or []) or any(
        k.startswith(("rope", "partial_rotary")) for k in c["config"]
    )
    fix = (
        f"run the setup on the {other} too (model.setup: one plug-in for every role, or "
        f"model.setup.{other}: the same function), or make the change in the checkpoint's config"
        + (" (rope_scaling / rope_theta)" if rope else "")
        + " so that every role is built with it"
    )
    module = c["differ"][0] if c.get("differ") else None
    return "warning", msg, fix, module


def _newly_initialised(
    rep: Mapping[str, Any], role: str, roles: list[str], who: str | None = None
) -> Finding:
    names = _names(rep["missing_names"][:3], rep["missing"])
    into = f" (as {rep['into']})" if rep.get("into") else ""
    scorer = role == "reward"
    arch = ", ".join(rep.get("architectures") or []) or "?"
    msg = (
        (
            f"{who} loaded {rep['path']!r} with from_pretrained{into}: it lacks "
            if who
            else f"{rep['source']} {rep['path']!r} lacks "
        )
        + f"{rep['missing']} of the weights of the {' and '.join(roles)} built from it ({names}"
        + (f"; {rep['mismatched']} of another shape" if rep.get("mismatched") else "")
        + "): the loader initialised them at random (newly initialised)"
        + (
            f"; the checkpoint is a {arch}, without a trained classification (score) head, and the reward "
            "model is frozen: its scores are a random projection of the features"
            if scorer
            else ""
        )
    )
    fix = (
        f"point {rep['source']} at a sequence-classification checkpoint with a trained score head, or "
        "train the reward model's head first"
        if scorer
        else f"load a checkpoint that holds every weight of the model ({names})"
        + (f" in {who}" if who else f" from {rep['source']}")
    )
    return Finding(
        severity="error" if scorer or (role == "actor" and not who) else "warning",
        kind=K.NEWLY_INITIALISED,
        role=role,
        where=who or f"{rep['source']} ({rep['path']})",
        message=msg,
        observed={"module": (rep["missing_names"] or [None])[0], **rep},
        expected="every weight of the model read from the checkpoint",
        fix=fix,
    )


def load_findings(models: Mapping[str, nn.Module]) -> list[Finding]:
    """A ``model/newly_initialised`` finding per checkpoint the trainer loaded that lacked weights
    (`trainer.models` keeps ``from_pretrained``'s loading info as ``load_report``), once per directory."""
    by: dict[tuple[str, str], list[str]] = {}
    reps: dict[tuple[str, str], Mapping[str, Any]] = {}
    for role, model in models.items():
        rep = getattr(model, LOAD_REPORT, None)
        if isinstance(rep, Mapping) and rep.get("missing", 0) + rep.get("mismatched", 0) > 0:
            key = (str(rep.get("source")), str(rep.get("path")))
            by.setdefault(key, []).append(role)
            reps.setdefault(key, rep)
    return [_newly_initialised(reps[k], roles[0], roles) for k, roles in by.items()]


def _finding(kind: str, role: str, who: str, severity: str, msg: str, fix: str, module, observed) -> Finding:
    return setup_text.finding(
        kind, severity, role, who, msg, fix, module, observed, expected="what the model was built as"
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
            fn = by.get("function") or {}
            moved = role != "critic" and (
                not fn.get("finite", True) or fn.get("change", 0) > setup_effect.MOVED
            )
            if (
                moved and "dtype" not in by
            ):  # setup12: the replacement computes otherwise than the checkpoint's
                msg += (
                    f"; the {role}'s output on a probe batch moved by {fn.get('change', float('inf')):.0%} (mean "
                    "relative) with them: the replacements compute something else than the checkpoint's modules, "
                    f"so the {role} is not the model it was loaded as"
                )
                n, a, b = m["replaced"][0]
                fix = (
                    f"keep the checkpoint's {a} at {n} (and the other replaced modules) in {who}, or make the {b} "
                    "compute what it did (same activation, normalisation and scaling as the model was trained with)"
                )
            sev = "warning" if moved and "dtype" not in by else "info"
            out.append(_finding(K.SETUP_MODULES, role, who, sev, msg, fix, m["replaced"][0][0], m))
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
        out += _probe_findings(rec, who, role)
    return (
        out
        + load_findings(models)
        + setup_effect.findings(models, trainable_roles)
        + grad_hooks.findings(models, policy)
    )


def _probe_findings(rec: Mapping[str, Any], who: str, role: str) -> list[Finding]:
    """The findings of `trainer.setup_probe`'s aspects of a setup record (load, graph, roles)."""
    out: list[Finding] = []
    for c in rec["changes"]:
        if not isinstance(c, Mapping):
            continue
        aspect = c.get("aspect")
        if aspect == "load":
            got = _load(c, who, role)
            if got is not None:
                out.append(_finding(K.SETUP_LOAD, role, who, *got, c))
        elif aspect == "no_graph":
            out.append(_finding(K.SETUP_NO_GRAPH, role, who, *_graph(c, who, role), c))
        elif aspect == "unregistered":
            out.append(_finding(K.SETUP_UNREGISTERED, role, who, *_unregistered(c, who, role), c))
        elif aspect == "remapped":
            out.append(_finding(K.SETUP_LOAD_REMAPPED, role, who, *_remapped(c, who, role), c))
        elif aspect == "pretrained":
            out.append(_newly_initialised(c, role, [role], who))
        elif aspect == "roles" and role == (c.get("setup") or [role])[0]:
            got = _roles(c, who, role)
            out.append(_finding(K.SETUP_ROLES_DIFFER, role, who, *got, c))
    return out


def _remapped(c: Mapping[str, Any], who: str, role: str):
    """A checkpoint's tensors loaded under other names than its own (`trainer.setup_probe.moved_tensors`)."""
    pairs = "; ".join(f"{into} <- {frm}" for into, frm in c["pairs"][:3])
    layers = any(".layers." in f".{a}" or ".h." in f".{a}" for a, _ in c["pairs"])
    msg = (
        f"{who} loaded {c['count']} of the {c['matched']} tensors it took from the checkpoint {c.get('source')} "
        f"into the {role}'s parameters of other names ({pairs}): same shapes, so the load passed, but "
        + ("the decoder layers run in another order" if layers else "the tensors sit in other places")
        + f" and the {role} is not the checkpoint's model"
    )
    fix = (
        f"fix the key mapping in {who}: each checkpoint tensor must load into the parameter of its own name "
        "(layers.i -> layers.i: check the converter's layer index / order)"
    )
    return "error", msg, fix, c["pairs"][0][0] if c["pairs"] else None
