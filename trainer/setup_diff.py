"""What the user's ``model.setup`` changed on a model: a summary taken before and after the call
(`snapshot`), compared (`changes`), so that the consequences that appear later in the run can be
traced to the setup function that caused them.

A snapshot is metadata only (no device work): the parameters' dtypes and which of them train, the
embedding rows, whether the output embeddings are the input ones, the modules' types, the forward
hooks, training mode and the Dropout probabilities, and which tensor holds each parameter and buffer
with its in-place version counter (`written`: what the setup assigned or wrote). `changes` returns one plain dict per aspect
that differs (``aspect``: ``dtype``, ``vocab``, ``trainable``, ``ties``, ``modules``, ``hooks``,
``mode``), each with the numbers before and after. `trainer.models.apply_setup` stores the result on
the model it hands on as ``model.setup_changes`` (``{"key", "spec", "role", "changes"}``). Exercised
by `pytest tests/test_setup_diff.py`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn

from trainer.precision import dtype_name

SETUP_CHANGES_ATTR = "setup_changes"
"""The attribute of a model that holds what its ``model.setup`` changed."""

_LIST = 6
"""Names listed per aspect (the counts say how many in all)."""


def _weight(get: Any) -> Any:
    """The embedding matrix of ``get()``: its ``weight``, else the first 2-d weight inside it (a
    wrapper around the head, such as a soft-cap module, keeps the head's rows)."""
    try:
        module = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    w = getattr(module, "weight", None)
    if w is None and isinstance(module, nn.Module):
        w = next((m.weight for m in module.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)
                  and m.weight.dim() == 2), None)  # fmt: skip
    return w


def _head_params(model: nn.Module, w_out: Any) -> list[str]:
    """Names of the parameters of the model's output head: the module holding the output embeddings
    (a policy's lm_head), else a ``value_head`` (a critic's)."""
    head = None
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] == "value_head" or (
            w_out is not None and getattr(m, "weight", None) is w_out
        ):
            head = name
            break
    if head is None:
        return []
    return [n for n, _ in model.named_parameters() if n == head or n.startswith(head + ".")]


def _version(t: Any) -> tuple[int, int]:
    """Which tensor holds a name, and how often it was written in place (torch's version counter):
    metadata that changes when a setup assigns or writes a parameter or buffer."""
    try:
        return id(t), int(t._version)
    except (RuntimeError, AttributeError):  # an inference tensor keeps no counter
        return id(t), -1


def _hooks(m: nn.Module) -> int:
    return len(m._forward_hooks) + len(m._forward_pre_hooks)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """The metadata of ``model`` that `changes` compares."""
    params = list(model.named_parameters())
    w_in = _weight(getattr(model, "get_input_embeddings", None))
    w_out = _weight(getattr(model, "get_output_embeddings", None))
    return {
        "id": id(model),
        "dtypes": {n: dtype_name(p.dtype) for n, p in params},
        "numel": {n: p.numel() for n, p in params},
        "trainable": {n for n, p in params if p.requires_grad},
        "versions": {n: _version(t) for n, t in [*params, *model.named_buffers()]},
        "head": _head_params(model, w_out),
        "rows_in": int(w_in.shape[0]) if w_in is not None and w_in.dim() == 2 else None,
        "rows_out": int(w_out.shape[0]) if w_out is not None and w_out.dim() == 2 else None,
        "tied": None if w_in is None or w_out is None else w_in is w_out,
        "types": {n: type(m).__name__ for n, m in model.named_modules()},
        "hooks": {n: _hooks(m) for n, m in model.named_modules() if _hooks(m)},
        "training": model.training,
        "dropout": {
            n: float(m.p)
            for n, m in model.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and float(m.p) > 0
        },
        "config_dropout": {
            k: float(v)
            for k, v in getattr(getattr(model, "config", None), "__dict__", {}).items()
            if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        },
        "attr_dropout": {
            n: float(m.attention_dropout)
            for n, m in model.named_modules()
            if isinstance(getattr(m, "attention_dropout", None), (int, float)) and m.attention_dropout > 0
        },
    }


def _by_dtype(dtypes: dict[str, str], numel: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for n, d in dtypes.items():
        out[d] += numel[n]
    return dict(out)


def _dtype_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    before, after = _by_dtype(a["dtypes"], a["numel"]), _by_dtype(b["dtypes"], b["numel"])
    cast = [n for n, d in b["dtypes"].items() if n in a["dtypes"] and a["dtypes"][n] != d]
    new = [n for n, d in b["dtypes"].items() if n not in a["dtypes"] and d not in before]
    if before == after and not cast:
        return None
    moved = cast + new
    if not moved:
        return None
    return {
        "aspect": "dtype",
        "before": before,
        "after": after,
        "params": len(moved),
        "elements": sum(b["numel"][n] for n in moved),
        "total": sum(b["numel"].values()),
        "to": sorted({b["dtypes"][n] for n in moved}),
        "from": sorted({a["dtypes"][n] for n in cast}) or sorted(before),
        "names": moved[:_LIST],
    }


def _trainable_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    frozen = sorted(n for n in a["trainable"] - b["trainable"] if n in b["numel"])
    if not frozen:
        return None  # nothing that trained stopped training (new parameters train, as they should)
    count = lambda s, side: sum(side["numel"].get(n, 0) for n in s)  # noqa: E731
    unfrozen = sorted(b["trainable"] - a["trainable"])
    return {
        "aspect": "trainable",
        "before": count(a["trainable"], a),
        "after": count(b["trainable"], b),
        "total": sum(b["numel"].values()),
        "frozen": len(frozen),
        "unfrozen": len(unfrozen),
        "training": sorted(b["trainable"])[:_LIST],
        "training_params": len(b["trainable"]),
        "params": len(b["numel"]),
        "head_frozen": sorted(set(frozen) & set(b.get("head", [])))[:_LIST],
    }


def _module_changes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    replaced = [
        (n, a["types"][n], t) for n, t in b["types"].items() if n and n in a["types"] and a["types"][n] != t
    ]
    if replaced:
        out.append(
            {"aspect": "modules", "replaced": [list(r) for r in replaced[:_LIST]], "count": len(replaced)}
        )
    hooked = sorted(n for n, k in b["hooks"].items() if k > a["hooks"].get(n, 0))
    if hooked:
        out.append({"aspect": "hooks", "modules": hooked[:_LIST], "count": len(hooked)})
    return out


def _mode_change(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    keys = ("training", "dropout", "config_dropout", "attr_dropout")
    if all(a[k] == b[k] for k in keys):
        return None
    return {"aspect": "mode", **{k + "_before": a[k] for k in keys}, **{k: b[k] for k in keys}}


def written(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """Names of the parameters and buffers the setup assigned or wrote in place (or added)."""
    a = before.get("versions", {})
    return {n for n, v in after.get("versions", {}).items() if a.get(n) != v}


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per aspect of the model that differs between the two snapshots."""
    out: list[dict[str, Any]] = []
    if before["id"] != after["id"]:
        out.append({"aspect": "replaced"})
    for change in (_dtype_change(before, after), _trainable_change(before, after)):
        if change is not None:
            out.append(change)
    gone = (
        after["rows_in"] is None and after["rows_out"] is None
    )  # a wrapper without embeddings: not a resize
    if not gone and (before["rows_in"], before["rows_out"]) != (after["rows_in"], after["rows_out"]):
        out.append(
            {
                "aspect": "vocab",
                "before": before["rows_in"],
                "after": after["rows_in"],
                "out_before": before["rows_out"],
                "out_after": after["rows_out"],
            }
        )
    if before["tied"] is True and after["tied"] is False:
        out.append({"aspect": "ties", "before": True, "after": False})
    out += _module_changes(before, after)
    mode = _mode_change(before, after)
    if mode is not None:
        out.append(mode)
    return out
