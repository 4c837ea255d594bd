"""What a user's ``model.setup`` did that its before/after metadata (`trainer.setup_diff`) cannot
show: the state dicts it loaded and what they matched (`recording_loads`, `loads_into`), whether the model it
left still builds an autograd graph to its trainable parameters and to nothing else
(`graph_probe`), and whether roles that start from one checkpoint still agree after their setups
(`compare_roles`: buffers and config; the parameters are the audit's reference check). A
checkpoint the trainer loads itself reports the weights it did not hold (`loading_report`). Each
returns plain dicts that `trainer.models` adds to the model's record; `verlaudit.audit.setup_changes`
turns them into findings.

Cost: the load record wraps the user's own calls; the probe is one forward of four tokens per
trainable role that has a setup (no backward, the model's hooks set aside, the RNG restored);
the role comparison reads only the buffers a setup wrote. Exercised by `pytest
tests/test_setup_probe.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

_LIST = 6
"""Names kept per list (the counts say how many in all)."""

ROLE_CONFIG_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "_attn_implementation",
    "vocab_size",
    "rms_norm_eps",
    "sliding_window",
    "hidden_act",
    "tie_word_embeddings",
)
"""Config fields that change what a model computes: roles built from one checkpoint must agree."""

SAME_START = (("actor", "reference"),)
"""Role pairs the trainer builds from one set of weights (the reference is a copy of the actor)."""


def _prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """The prefix that maps the given keys onto the model's (``model.`` for a backbone's state dict
    loaded into its causal LM), or with a leading ``-`` the one to strip, when one does."""
    for u in unexpected[:20]:
        for m in missing:
            if m.endswith("." + u):
                return m[: -len(u)]
            if u.endswith("." + m):
                return "-" + u[: -len(m)]
    return None


@contextlib.contextmanager
def recording_loads() -> Iterator[list[tuple[nn.Module, dict[str, Any]]]]:
    """Within the block, every ``load_state_dict`` is recorded as ``(module, what it matched)``
    (strict, keys given, missing, unexpected); the call is the user's, unchanged. `loads_into` keeps
    those into the model a setup handed on."""
    calls: list[tuple[nn.Module, dict[str, Any]]] = []
    original = nn.Module.load_state_dict

    def load_state_dict(self, state_dict, *args, **kwargs):
        result = original(self, state_dict, *args, **kwargs)
        if isinstance(state_dict, Mapping):
            strict = kwargs.get("strict", args[0] if args else True)
            missing = list(getattr(result, "missing_keys", []))
            unexpected = list(getattr(result, "unexpected_keys", []))
            calls.append(
                (
                    self,
                    {
                        "type": type(self).__name__,
                        "strict": bool(strict),
                        "given": len(state_dict),
                        "loaded": len(state_dict) - len(unexpected),
                        "expected": len(self.state_dict()),
                        "missing": len(missing),
                        "unexpected": len(unexpected),
                        "missing_names": missing[:_LIST],
                        "unexpected_names": unexpected[:_LIST],
                        "prefix": _prefix(missing, unexpected),
                        # where each given tensor's storage lives (no copy): `moved_tensors` matches
                        # them against the checkpoints the setup read; stripped from the record
                        _GIVEN: {
                            str(k): v.data_ptr()
                            for k, v in list(state_dict.items())[:_GIVEN_MAX]
                            if isinstance(v, torch.Tensor) and v.numel() > 1
                        },
                    },
                )
            )
        return result

    nn.Module.load_state_dict = load_state_dict  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        nn.Module.load_state_dict = original  # type: ignore[method-assign]


def loads_into(model: nn.Module, calls: list[tuple[nn.Module, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The recorded loads into ``model`` or one of its submodules (a head the setup built and then
    loaded too), each with the submodule's name (``module``)."""
    where = {id(m): n for n, m in model.named_modules()}
    return [
        {"module": where[id(m)], **{k: v for k, v in c.items() if k != _GIVEN}}
        for m, c in calls
        if id(m) in where
    ]


_GIVEN = "_given"
"""The private field of a recorded load: the given keys' storage pointers."""
_GIVEN_MAX = 4096
"""Tensors of one state dict whose storage is noted (a state dict of more is matched on its first ones)."""


def _same_name(a: str, b: str) -> bool:
    """Whether two state-dict keys name the same tensor, up to a prefix one of them carries (a backbone's
    ``layers.0.x`` is its causal LM's ``model.layers.0.x``)."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def moved_tensors(
    model: nn.Module,
    loads: list[tuple[nn.Module, dict[str, Any]]],
    pretrained: list[tuple[nn.Module, dict[str, Any], str]],
) -> dict[str, Any] | None:
    """The tensors of a checkpoint a setup read (``from_pretrained``, `recording_pretrained`) that its
    ``load_state_dict`` into ``model`` put under another name than the checkpoint's own: a converter
    whose name map permutes layers (``layers.i -> layers.L-1-i``), swaps q/k or heads. Same shapes, so a
    strict load passes and the model computes something else. Matched by storage (the state dict's
    tensors are the checkpoint's, no copy); None when nothing moved."""
    where = {id(m) for m in model.modules()}
    sources: dict[int, tuple[set[str], str]] = {}
    for src, _info, path in pretrained:
        if id(src) in where:
            continue  # the model itself (or a part of it) loaded in place
        for name, t in src.state_dict().items():
            if t.numel() > 1:
                sources.setdefault(t.data_ptr(), (set(), path))[0].add(name)
    if not sources:
        return None
    moved, matched, path = [], 0, None
    for m, c in loads:
        if id(m) not in where:
            continue
        for key, ptr in (c.get(_GIVEN) or {}).items():
            hit = sources.get(ptr)
            if hit is None:
                continue
            matched += 1
            if not any(_same_name(key, n) for n in hit[0]):
                moved.append([key, sorted(hit[0])[0]])
                path = hit[1]
    if not moved:
        return None
    return {"count": len(moved), "matched": matched, "pairs": moved[:_LIST], "source": path}


def moved_or_none(model: nn.Module, loads: Any, pretrained: Any) -> dict[str, Any] | None:
    """`moved_tensors`, or None when it cannot read the models (the record is never why a run stops)."""
    try:
        return moved_tensors(model, loads, pretrained)
    except Exception:
        return None


@contextlib.contextmanager
def recording_pretrained() -> Iterator[list[tuple[nn.Module, dict[str, Any], str]]]:
    """Within the block, every ``from_pretrained`` of a transformers model is recorded with its
    loading info (what the checkpoint lacked: newly initialised), as ``(model, info, path)``; the
    caller gets what it asked for (the model, or the model and its info)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    calls: list[tuple[nn.Module, dict[str, Any], str]] = []

    def from_pretrained(cls, path, *args, **kwargs):
        asked = kwargs.pop("output_loading_info", False)
        model, info = original.__func__(cls, path, *args, output_loading_info=True, **kwargs)
        calls.append((model, info, str(path)))
        return (model, info) if asked else model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
    try:
        yield calls
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]


def pretrained_into(model: nn.Module, calls, source: str) -> list[dict[str, Any]]:
    """`loading_report` of each recorded ``from_pretrained`` whose model is part of ``model`` (the
    module the setup or loader handed on), with where in it (``into``)."""
    where = {id(m): n for n, m in model.named_modules()}
    out = []
    for loaded, info, path in calls:
        rep = loading_report(info, source, path) if id(loaded) in where else None
        if rep is not None:
            rep["into"] = where[id(loaded)]
            rep["architectures"] = list(getattr(loaded.config, "architectures", None) or [])
            out.append(rep)
    return out


def loading_report(info: Mapping[str, Any] | None, source: str, path: str) -> dict[str, Any] | None:
    """What ``from_pretrained(..., output_loading_info=True)`` said it could not fill from ``path``:
    the weights the checkpoint lacks are newly initialised at random. None when it held them all."""
    if not isinstance(info, Mapping):
        return None
    missing = sorted(str(k) for k in info.get("missing_keys") or [])
    mismatched = [str(k[0] if isinstance(k, (tuple, list)) else k) for k in info.get("mismatched_keys") or []]
    if not missing and not mismatched:
        return None
    return {
        "source": source,
        "path": path,
        "missing": len(missing),
        "missing_names": missing[:_LIST],
        "mismatched": len(mismatched),
        "mismatched_names": mismatched[:_LIST],
        "unexpected": len(info.get("unexpected_keys") or []),
    }


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


def _graph_leaves(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """The tensors that would receive a gradient from ``t`` (AccumulateGrad nodes of its graph)."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [t.grad_fn] if t.grad_fn is not None else []
    if t.grad_fn is None and t.requires_grad:
        leaves[id(t)] = t
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves[id(var)] = var
        todo += [n for n, _ in node.next_functions]
    return leaves


def _held_names(model: nn.Module) -> dict[int, str]:
    """Tensors a module holds outside its registered parameters and children: in plain lists, tuples
    and dicts, or as plain attributes (``name`` -> where), for naming unregistered leaves."""
    out: dict[int, str] = {}
    for mname, m in model.named_modules():
        for attr, v in vars(m).items():
            if attr.startswith("_"):
                continue
            where = f"{mname}.{attr}" if mname else attr
            items = (
                list(v.items())
                if isinstance(v, dict)
                else list(enumerate(v))
                if isinstance(v, (list, tuple))
                else [(None, v)]
            )
            for k, item in items[:64]:
                at = where if k is None else f"{where}[{k!r}]"
                if isinstance(item, nn.Module):
                    for pn, p in item.named_parameters():
                        out.setdefault(id(p), f"{at}.{pn}")
                elif isinstance(item, torch.Tensor):
                    out.setdefault(id(item), at)
    return out


def _distributed(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def _probe_forward(
    model: nn.Module, ids: torch.Tensor
) -> tuple[Any, dict[str, bool], dict[str, bool]] | None:
    """The model's output on ``ids`` with gradients on, and per module whether gradients were on
    when its forward began and whether its (floating) output requires grad; None when it cannot
    run. The model's own hooks are set aside (a user hook may count calls or keep state; what a setup
    hooked is in its record) and the RNG is restored: the run sees no extra forward."""
    names = {id(m): name for name, m in model.named_modules()}
    grad_on: dict[str, bool] = {}
    out_graph: dict[str, bool] = {}
    reentrant: set[str] = set()

    def pre(mod, _args):
        name = names.get(id(mod), "?")
        grad_on.setdefault(name, torch.is_grad_enabled())
        if not torch.is_grad_enabled() and name not in reentrant and _in_reentrant_checkpoint():
            reentrant.add(name)

    def post(mod, _args, output):
        o = _output_tensor(output)
        if o is not None and o.is_floating_point():
            out_graph.setdefault(names.get(id(mod), "?"), bool(o.requires_grad))

    mods = list(model.modules())
    kept = [(m._forward_hooks, m._forward_pre_hooks) for m in mods]
    for m in mods:
        m._forward_hooks, m._forward_pre_hooks = type(m._forward_hooks)(), type(m._forward_pre_hooks)()
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception:  # a user module with another signature: no probe, never a failed run
        return None
    finally:
        for m, (fwd, pre_hooks) in zip(mods, kept, strict=True):
            m._forward_hooks, m._forward_pre_hooks = fwd, pre_hooks
    if reentrant:
        grad_on["<reentrant>"] = sorted(reentrant)  # type: ignore[assignment]
    return out, grad_on, out_graph


def _in_reentrant_checkpoint() -> bool:
    """Whether the current forward runs inside ``torch.utils.checkpoint``'s reentrant function (which
    computes without gradients and builds its graph only for inputs that require grad)."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        if (
            f.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")
            and f.f_code.co_name == "forward"
        ):
            return True
        f = f.f_back
    return False


def _grad_breaks(model: nn.Module, grad_on: dict[str, bool], out_graph: dict[str, bool]):
    """(the outermost modules whose forward ran with gradients on while a trainable child's ran off,
    the innermost ones that returned a tensor cut from the graph a child's output had), as
    ``[name, type]`` lists. A child without trainable weights may compute under no_grad (Hugging
    Face's rotary embedding does, by design)."""
    off, cut = [], []
    for name, m in model.named_modules():
        if not grad_on.get(name, False):
            continue
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        if any(grad_on.get(k) is False and any(p.requires_grad for p in c.parameters()) for k, c in kids):
            off.append([name, type(m).__name__])
        elif out_graph.get(name) is False and any(out_graph.get(k) is True for k, _ in kids):
            cut.append([name, type(m).__name__])
    # the innermost cut is where it happens (its parents only pass on what it returned)
    below = lambda a, b: b != a and (not a or b.startswith(a + "."))  # noqa: E731
    cut = [
        c for c in cut if not any(below(o[0], c[0]) for o in off) and not any(below(c[0], d[0]) for d in cut)
    ]
    return off, cut


def graph_probe(model: nn.Module, vocab: int) -> dict[str, Any] | None:
    """One forward of a few tokens with gradients on (`_probe_forward`): whether the output carries
    a graph to the trainable parameters, which module's forward turned gradients off or cut the graph
    (`_grad_breaks`), and which tensors that require grad take part in the output without being
    parameters of the model (the optimizer, built from ``model.parameters()``, never updates them).
    None when nothing is wrong or it cannot run."""
    params = list(model.parameters())
    trainable = {id(p) for p in params if p.requires_grad}
    if not trainable or _distributed(model):
        return None
    n = max(2, min(4, int(vocab)))
    ids = torch.arange(1, n + 1, device=params[0].device).remainder(max(1, int(vocab))).unsqueeze(0)
    probed = _probe_forward(model, ids)
    t = _output_tensor(probed[0]) if probed is not None else None
    if probed is None or t is None:
        return None
    reentrant = probed[1].pop("<reentrant>", [])
    off, cut = _grad_breaks(model, probed[1], probed[2])
    report: dict[str, Any] = {}
    leaves = _graph_leaves(t) if t.requires_grad else {}
    reached = trainable & set(leaves)
    if not t.requires_grad or off or cut:
        report["no_graph"] = {
            "output_requires_grad": bool(t.requires_grad),
            "grad_off_in": off[:_LIST],
            "detached_in": cut[:_LIST],
            "count": len(off) + len(cut),
            "reached": len(reached),
            "trainable": len(trainable),
            # setup12: modules run inside a reentrant torch.utils.checkpoint, and whether any parameter
            # before them trains (frozen embeddings: no input of the checkpoint requires grad)
            "reentrant": list(reentrant)[:_LIST],
        }
    registered = {id(p) for p in params}
    stray = [v for k, v in leaves.items() if k not in registered and v.requires_grad]
    if stray:
        held = _held_names(model)
        report["unregistered"] = {
            "names": [held.get(id(v), f"<tensor {tuple(v.shape)}>") for v in stray][:_LIST],
            "count": len(stray),
            "elements": sum(v.numel() for v in stray),
            "trainable": len(trainable),
        }
    return report or None


def _config_fields(model: nn.Module) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    return {k: repr(getattr(cfg, k)) for k in ROLE_CONFIG_FIELDS if hasattr(cfg, k)}


def _module_settings(ma: nn.Module, mb: nn.Module) -> dict[str, list[Any]]:
    """Plain number / string settings of the modules both models have (a norm's
    ``variance_epsilon``, attention's ``scaling`` or ``sliding_window``) that differ; training mode,
    dropout and activation checkpointing are left out (a frozen reference is in eval mode, without
    checkpointing, by design)."""
    mods_b = dict(mb.named_modules())
    out: dict[str, list[Any]] = {}
    for name, m in ma.named_modules():
        other = mods_b.get(name)
        if other is None or type(other) is not type(m):
            continue
        vb = vars(other)
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training" or "dropout" in k or "checkpointing" in k:
                continue
            if isinstance(v, (bool, int, float, str)) and k in vb and vb[k] != v:
                out[f"{name}.{k}" if name else k] = [repr(v), repr(vb[k])]
                if len(out) >= _LIST:
                    return out
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, compared in the coarser of the two dtypes (a role stored in bf16 is the actor's
    weights rounded to bf16: not a difference a setup made)."""
    if a.shape != b.shape:
        return False
    coarse = a.dtype if a.element_size() < b.element_size() else b.dtype
    return bool(torch.equal(a.detach().to(dtype=coarse), b.detach().to(device=a.device, dtype=coarse)))


def compare_roles(models: Mapping[str, nn.Module], written: Mapping[str, set[str]]) -> list[dict[str, Any]]:
    """For each pair of roles built from one set of weights (`SAME_START`) where a setup ran on
    either: the buffers a setup wrote whose values now differ between them (rotary frequencies, a
    causal mask), and the config fields that differ. One dict per pair that disagrees; values are
    compared only for the buffers a setup wrote (once, at setup)."""
    out: list[dict[str, Any]] = []
    for a, b in SAME_START:
        if a not in models or b not in models or not (a in written or b in written):
            continue
        ma, mb = models[a], models[b]
        if _distributed(ma) or _distributed(mb):
            continue
        # buffers only: the parameters are compared for every run by the audit's reference check
        # (`verlaudit.audit.invariants.reference_divergence`), which names the setup too
        ta, tb = dict(ma.named_buffers()), dict(mb.named_buffers())
        names = sorted((written.get(a, set()) | written.get(b, set())) & set(ta) & set(tb))
        differ = [n for n in names if not _same(ta[n], tb[n])]
        only = sorted(set(ta) ^ set(tb))
        ca, cb = _config_fields(ma), _config_fields(mb)
        config = {k: [ca.get(k), cb.get(k)] for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}
        config = config if ca and cb else {}  # a module without a config (a wrapper) is another finding's
        config |= _module_settings(ma, mb)
        if not differ and not config:
            continue  # a tensor one role has alone (an adapter, a head) is not a disagreement
        out.append(
            {
                "roles": [a, b],
                "setup": [r for r in (a, b) if r in written],
                "differ": differ[:_LIST],
                "differ_count": len(differ),
                "compared": len(names),
                "only_one": only[:_LIST],
                "only_one_count": len(only),
                "config": config,
            }
        )
    return out
