"""What a user's ``model.setup`` changed that `trainer.setup_diff`'s metadata leaves out: the plain
settings of every module and of the config (a norm's ``variance_epsilon``, attention's ``scaling``,
``config.rms_norm_eps``), the members of a model that the module the setup returned lacks (a wrapper
without ``generate``), the parameters it added and whether they start at zero, what the model
computes on a fixed probe batch before and after the call (`probe_output`: how far the output moved,
and whether distinct inputs still give distinct outputs), and the parameters two roles share after
their setups that they did not share before (`shared`: a critic whose trunk is the actor's).

`before` takes the state of one model before its setup, `after` compares it with the model the setup
handed on and returns one plain dict per aspect (``settings``, ``interface``, ``added``,
``function``), added by `trainer.models.apply_setup` to the model's record; ``shared`` is added
after every role's setup. `verlaudit.audit.setup_effect` turns them into findings.

Cost: two no-grad forwards of a probe batch of 8 x 6 tokens per role that has a setup (eval mode,
the RNG restored, training modes put back, the model's hooks set aside: a user hook may count calls;
only a frozen role's hooks that the setup added run, once, since a scorer's clamp is what it changed),
and a walk over the modules' attributes. Exercised by `pytest
tests/test_setup_effect.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_LIST = 6
"""Names kept per list (the counts say how many in all)."""
PROBE_ROWS, PROBE_LEN = 8, 6
"""The probe batch: rows of random ids (a fixed generator), all attended."""
INTERFACE = (
    "generate",
    "config",
    "get_input_embeddings",
    "get_output_embeddings",
    "resize_token_embeddings",
    "generation_config",
    "can_generate",
    "prepare_inputs_for_generation",
    "gradient_checkpointing_enable",
    "tie_weights",
)
"""Members of a model the trainer and its engines call, listed first when a replacement lacks them."""
_SKIP_ATTRS = ("training", "inplace")
_QUIET_CONFIG = (
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "torchscript",
    "gradient_checkpointing",
)
"""Config fields a setup sets without changing what the model computes (caching, outputs, ids)."""


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _settings(model: nn.Module) -> dict[tuple[str, str], Any]:
    """(module name, attribute) -> value of every plain setting of every module (``<config>`` for
    the model's config); dropout and training mode are `trainer.setup_diff`'s ``mode``."""
    out: dict[tuple[str, str], Any] = {}
    for name, m in model.named_modules():
        drop = isinstance(m, nn.modules.dropout._DropoutNd)
        for k, v in vars(m).items():
            if k.startswith("_") or k in _SKIP_ATTRS or "dropout" in k or "checkpointing" in k:
                continue
            if drop and k == "p":
                continue
            if _plain(v):
                out[(name, k)] = v
    cfg = getattr(model, "config", None)
    for k, v in getattr(cfg, "__dict__", {}).items():
        if not k.startswith("_") and "dropout" not in k and k not in _QUIET_CONFIG and _plain(v):
            out[("<config>", k)] = v
    return out


def _members(model: nn.Module) -> set[str]:
    """Public names reachable on ``model`` without evaluating any property."""
    names = {n for n in dir(type(model)) if not n.startswith("_")}
    names |= {n for n in vars(model) if not n.startswith("_")}
    names |= set(model._modules) | set(model._parameters) | set(model._buffers)
    return names


def _distributed_or_meta(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" or p.is_meta for p in model.parameters())


def _output_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "values", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


@contextlib.contextmanager
def _eval(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t


@contextlib.contextmanager
def _hooks_aside(model: nn.Module, aside: bool):
    """The model's forward hooks set aside (a user hook may count calls or keep state) when ``aside``."""
    mods = list(model.modules()) if aside else []
    kept = [(m._forward_hooks, m._forward_pre_hooks) for m in mods]
    for m in mods:
        m._forward_hooks, m._forward_pre_hooks = type(m._forward_hooks)(), type(m._forward_pre_hooks)()
    try:
        yield
    finally:
        for m, (fwd, pre) in zip(mods, kept, strict=True):
            m._forward_hooks, m._forward_pre_hooks = fwd, pre


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def probe_output(model: nn.Module, vocab: int, *, hooks: bool = False) -> torch.Tensor | None:
    """The model's output (logits, values, scores) on the probe batch, as fp32 on the CPU, its forward
    hooks set aside unless ``hooks``; None when it cannot run (another signature, a sharded or meta
    model)."""
    params = list(model.parameters())
    if not params or _distributed_or_meta(model):
        return None
    dev = params[0].device
    gen = torch.Generator().manual_seed(20261202)
    ids = torch.randint(1, max(2, int(vocab)), (PROBE_ROWS, PROBE_LEN), generator=gen).to(dev)
    devices = [dev.index or 0] if dev.type == "cuda" else []
    try:
        with (
            _eval(model),
            _hooks_aside(model, not hooks),
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
        ):
            t = _output_tensor(model(input_ids=ids, attention_mask=torch.ones_like(ids)))
    except Exception:  # a user module with another signature: no probe, never a failed run
        return None
    return None if t is None or not t.is_floating_point() else t.detach().float().cpu()


def before(model: nn.Module, vocab: int) -> dict[str, Any]:
    """What `after` compares: settings, members, parameter identities, the probe output."""
    return {
        "settings": _settings(model),
        "members": _members(model),
        "params": {id(p) for p in model.parameters()},
        "output": probe_output(model, vocab),
        "hooks": _hook_count(model),
        "id": id(model),
        "type": type(model).__name__,
        "values": _values_before(model, vocab),
        "grad_hooks": _guarded(lambda: _grad_hooks().before(model)),
    }


def _values_before(model: nn.Module, vocab: int) -> dict[str, Any] | None:
    from trainer import setup_values

    try:
        return setup_values.before(model, vocab)
    except Exception:  # the record is never why a run stops
        return None


def _config_field(value: Any, config: Mapping[str, Any]) -> str | None:
    """The config field holding ``value`` (where a module's setting came from), if one does."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return next((k for k, v in config.items() if type(v) is type(value) and v == value), None)


def _settings_change(a: dict[tuple[str, str], Any], b: dict[tuple[str, str], Any]) -> dict[str, Any] | None:
    config = {k: v for (m, k), v in a.items() if m == "<config>"}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for key, v in b.items():
        if key in a and a[key] != v and a[key] == a[key]:  # NaN != NaN is no change
            groups.setdefault((key[1], repr(a[key]), repr(v)), []).append(key[0])
    if not groups:
        return None
    changed = []
    for (attr, was, now), mods in sorted(groups.items(), key=lambda g: -len(g[1])):
        old = next(a[(m, attr)] for m in mods)
        field = None if mods == ["<config>"] else _config_field(old, config)
        changed.append(
            {"attr": attr, "before": was, "after": now, "modules": mods[:_LIST], "count": len(mods),
             "config_field": field}
        )  # fmt: skip
    return {"aspect": "settings", "changed": changed[:_LIST], "groups": len(changed)}


def _interface_change(pre: dict[str, Any], model: nn.Module) -> dict[str, Any] | None:
    if pre["id"] == id(model):
        return None
    lost = {n for n in sorted(pre["members"] - _members(model))[:400] if not _reachable(model, n)}
    if not lost:
        return None
    first = [n for n in INTERFACE if n in lost]
    return {
        "aspect": "interface",
        "before_type": pre["type"],
        "after_type": type(model).__name__,
        "lost": (first + sorted(lost - set(first)))[:_LIST],
        "lost_interface": first,
        "count": len(lost),
        "inner": next((n for n, m in model.named_children() if _members(m) >= set(first)), None),
    }


def _reachable(model: nn.Module, name: str) -> bool:
    """Whether ``model.name`` resolves after all (a wrapper whose ``__getattr__`` forwards to the model)."""
    try:
        getattr(model, name)
    except Exception:
        return False
    return True


def _added(pre: dict[str, Any], model: nn.Module) -> dict[str, Any] | None:
    new = [(n, p) for n, p in model.named_parameters() if id(p) not in pre["params"]]
    if not new:
        return None
    zero = [n for n, p in new if p.numel() and int(torch.count_nonzero(p.detach())) == 0]
    return {
        "aspect": "added",
        "count": len(new),
        "elements": sum(p.numel() for _, p in new),
        "names": [n for n, _ in new][:_LIST],
        "shapes": [list(p.shape) for _, p in new][:_LIST],
        "zero": zero[:_LIST],
        "zero_count": len(zero),
        # the low-rank side of a factor pair: the tensor whose last dim is smallest ([out, r] of B = up)
        "up": [n for n, p in new if p.dim() == 2 and p.shape[1] < p.shape[0]][:_LIST],
    }


def _distinct(t: torch.Tensor) -> int:
    return int(torch.unique(t.reshape(t.shape[0], -1), dim=0).shape[0])


def compare_outputs(a: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any] | None:
    """How the probe output moved from ``a`` (before) to ``b`` (after): mean relative change, the
    distinct rows of each, their range. None when either is missing or they cannot be compared."""
    if a is None or b is None or a.dim() != b.dim() or a.shape[:-1] != b.shape[:-1] or a.dim() == 0:
        return None
    n = min(a.shape[-1], b.shape[-1])  # a resized vocabulary: the rows both have
    a, b = a[..., :n], b[..., :n]
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return {"aspect": "function", "finite_before": bool(torch.isfinite(a).all()), "finite": False}
    scale = float(a.abs().mean())
    return {
        "aspect": "function",
        "change": float((a - b).abs().mean()) / scale if scale > 0 else float(b.abs().mean() > 0),
        "distinct_before": _distinct(a),
        "distinct": _distinct(b),
        "rows": int(a.shape[0]),
        "range_before": [float(a.min()), float(a.max())],
        "range": [float(b.min()), float(b.max())],
        "finite": True,
    }


def after(pre: dict[str, Any] | None, model: nn.Module, vocab: int, *, trains: bool) -> list[dict[str, Any]]:
    """The aspects of the setup's change that `before` can show (module docstring). The output is
    compared with the hooks set aside, except for a frozen role the setup hooked (a scorer's clamp):
    its hooks run once, on the probe batch."""
    if pre is None:
        return []
    hooked = not trains and _hook_count(model) > pre["hooks"]
    moved = compare_outputs(pre["output"], probe_output(model, vocab, hooks=hooked))
    if (
        moved is not None
        and moved["finite"]
        and moved["change"] == 0
        and moved["distinct"] == moved["distinct_before"]
    ):
        moved = None  # the same output: the setup changed nothing the model computes
    found = [
        _settings_change(pre["settings"], _settings(model)),
        _interface_change(pre, model),
        _added(pre, model),
        moved,
    ]
    hooks = _guarded(lambda: _grad_hooks().after(pre.get("grad_hooks"), model, vocab)) or []
    return [f for f in found if f is not None] + _values_after(pre.get("values"), model, vocab) + hooks


def _grad_hooks():
    from trainer import setup_grad_hooks

    return setup_grad_hooks


def _guarded(fn):
    """``fn()``, or None where it fails: the record is never why a run stops."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def _values_after(pre: Any, model: nn.Module, vocab: int) -> list[dict[str, Any]]:
    """`trainer.setup_values.after`: the values, hooks and forward modes the setup changed."""
    from trainer import setup_values

    try:
        return setup_values.after(pre, model, vocab)
    except Exception:  # the record is never why a run stops
        return []


def pointers(models: Mapping[str, nn.Module]) -> dict[str, dict[int, str]]:
    """Per role, the storage of each parameter (data pointer -> name)."""
    out: dict[str, dict[int, str]] = {}
    for role, m in models.items():
        if isinstance(m, nn.Module) and not _distributed_or_meta(m):
            out[role] = {p.data_ptr(): n for n, p in m.named_parameters() if p.numel() > 0}
    return out


def shared(
    before_ptrs: Mapping[str, Mapping[int, str]], models: Mapping[str, nn.Module], trainable: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Pairs of roles whose parameters share storage after the setups and did not before (one optimizer
    steps the other's weights, or a frozen role moves with a trained one)."""
    now = pointers(models)
    roles = list(now)
    out = []
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            if models[a] is models[b]:
                continue
            common = set(now[a]) & set(now[b])
            common -= set(before_ptrs.get(a, {})) & set(before_ptrs.get(b, {}))
            if not common:
                continue
            params_a = {p.data_ptr(): p for p in models[a].parameters()}
            params_b = {p.data_ptr(): p for p in models[b].parameters()}
            # a tensor trained in a role that trains: its updates reach the other role (frozen bases
            # shared by an adapter policy and its reference are a saving, not a fault)
            trained = [
                c for c in common
                if (a in trainable and params_a[c].requires_grad) or (b in trainable and params_b[c].requires_grad)
            ]  # fmt: skip
            if not trained:
                continue
            out.append(
                {
                    "aspect": "shared",
                    "roles": [a, b],
                    "count": len(common),
                    "elements": sum(params_a[c].numel() for c in common if c in params_a),
                    "of": [len(now[a]), len(now[b])],
                    "names": [
                        sorted(now[a][c] for c in common)[:_LIST],
                        sorted(now[b][c] for c in common)[:_LIST],
                    ],
                    "trains": [r for r in (a, b) if r in trainable],
                    "trained": len(trained),
                }
            )
    return out


def add_shared(
    before_ptrs: Mapping[str, Mapping[int, str]],
    models: Mapping[str, nn.Module],
    trainable: tuple[str, ...],
    attr: str,
) -> None:
    """`shared` added to the setup record (``attr``) of each role of a pair whose setup ran."""
    for pair in shared(before_ptrs, models, trainable):
        for role in pair["roles"]:
            rec = getattr(models[role], attr, None)
            if isinstance(rec, dict):
                rec["changes"].append(pair)
