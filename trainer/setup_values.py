"""What a user's ``model.setup`` did to the values of a model's parameters and to its forward, that its
metadata (`trainer.setup_diff`) and the eval-mode probe with the hooks set aside (`trainer.setup_effect`)
cannot show:

- ``values``: the parameters whose values the setup rewrote, compared on a fixed sample of each tensor's
  elements taken before the call: re-initialised (after and before uncorrelated), rescaled (after = c x
  before), zeroed, or otherwise changed. A cast only rounds them (compared in the coarser dtype).
- ``hook_effect``: for each forward hook or pre-hook the setup registered, what it does to the tensor it
  receives, in eval mode and in training mode: the relative change, whether it is a scale (and by what),
  and whether two calls on the same input give two results (noise). The hook is called a second time on a
  copy of its input for that; its first result is the one the model uses.
- ``modes``: whether the model's forward (its hooks set aside: they are ``hook_effect``'s) is still a
  function of its input after the setup (two calls with the same input, in eval mode and in training mode) and how far its training-mode
  output is from its eval-mode one, before and after the setup: a noise the setup added, or a forward that
  the rollout (eval mode) and the trainer (training mode) compute differently.

`before` reads the model before its setup, `after` returns the aspects (plain dicts) that
`trainer.setup_effect.after` adds to the record. Cost: a sample of at most `SAMPLE` elements per
parameter (host copies), and four no-grad forwards of the probe batch before and after (RNG restored,
training modes put back); only for a model whose parameters live on one device. Exercised by
`pytest tests/test_setup_values.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

SAMPLE = 2048
"""Elements read per parameter (a fixed sample): enough to tell a scale or a new init apart."""
_LIST = 6
"""Names kept per list (the counts say how many in all)."""
SAME = 1e-2
"""Mean relative difference up to which a tensor kept its values (a bf16 cast moves them by ~0.2%)."""
SCALE_RESID = 2e-2
"""Relative residual of after - c x before under which the tensor was multiplied by c."""
UNRELATED = 0.3
"""|correlation| of before and after below which the setup replaced the values (a new init)."""
PROBE_ROWS, PROBE_LEN = 8, 6


def _plain(model: nn.Module) -> bool:
    ps = list(model.parameters())
    return bool(ps) and not any(type(p).__name__ == "DTensor" or p.is_meta for p in ps)


def _index(numel: int) -> torch.Tensor:
    if numel <= SAMPLE:
        return torch.arange(numel)
    gen = torch.Generator().manual_seed(1202)
    return torch.randint(0, numel, (SAMPLE,), generator=gen).unique()


def _take(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.take(p.detach(), idx.to(p.device)).double().cpu()


def _hook_keys(model: nn.Module) -> dict[str, tuple[set[int], set[int]]]:
    return {n: (set(m._forward_hooks), set(m._forward_pre_hooks)) for n, m in model.named_modules()}


def before(model: nn.Module, vocab: int) -> dict[str, Any] | None:
    """A sample of every floating parameter, the hooks the modules carry, and the forward's modes."""
    if not _plain(model):
        return None
    weights = {}
    for n, p in model.named_parameters():
        if p.is_floating_point() and p.numel():
            idx = _index(p.numel())
            weights[n] = (tuple(p.shape), idx, _take(p, idx), p.dtype)
    return {"weights": weights, "hooks": _hook_keys(model), "modes": modes(model, vocab)}


# ---------------------------------------------------------------- values
def _classify(a: torch.Tensor, b: torch.Tensor) -> tuple[str, float] | None:
    """(what happened, a number: the scale or the correlation) to a tensor sampled as ``a`` before and
    ``b`` after, or None when it kept its values."""
    scale = float(a.abs().mean())
    diff = float((a - b).abs().mean())
    if diff <= SAME * max(scale, 1e-12) or diff == 0:
        return None
    if float(b.abs().max()) == 0:
        return "zeroed", 0.0
    if scale == 0:
        return "reinit", 0.0  # a tensor at zero that the setup filled: a new init
    c = float((a * b).sum() / (a * a).sum())
    if float((b - c * a).norm()) <= SCALE_RESID * float(b.norm()):
        return "scaled", c
    da, db = a - a.mean(), b - b.mean()
    den = float(da.norm() * db.norm())
    r = float((da * db).sum()) / den if den > 0 else 0.0
    return ("reinit", r) if abs(r) < UNRELATED else ("changed", r)


def values(pre: Mapping[str, Any] | None, model: nn.Module) -> dict[str, Any] | None:
    """The ``values`` aspect: the parameters the setup re-initialised, rescaled, zeroed or changed."""
    if not pre or not _plain(model):
        return None
    groups: dict[str, list[tuple[str, int, float]]] = {}
    total = elements = 0
    owner: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        owner.setdefault(p.data_ptr(), n)
    for n, p in model.named_parameters(remove_duplicate=False):
        got = pre["weights"].get(n)
        if got is None or tuple(p.shape) != got[0] or not p.is_floating_point():
            continue
        total += 1
        elements += p.numel()
        found = _classify(got[2], _take(p, got[1]))
        if found is not None and owner.get(p.data_ptr(), n) != n:
            found = ("tied:" + owner[p.data_ptr()], 0.0)  # now the storage of another parameter
        if found is not None:
            groups.setdefault(found[0].split(":")[0], []).append((n, p.numel(), found[1]))
            if found[0].startswith("tied:"):
                groups.setdefault("tied_to", []).append((found[0][5:], 0, 0.0))
    if not groups:
        return None
    out: dict[str, Any] = {"aspect": "values", "tensors": total, "elements": elements}
    for what, rows in groups.items():
        out[what] = {
            "count": len(rows),
            "elements": sum(r[1] for r in rows),
            "names": [r[0] for r in rows][:_LIST],
            "numbers": [round(r[2], 4) for r in rows][:_LIST],
        }
    return out


# ---------------------------------------------------------------- hooks and modes
def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    for name in ("logits", "values", "last_hidden_state"):
        t = getattr(x, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(x, (tuple, list)):
        return next((t for t in x if isinstance(t, torch.Tensor)), None)
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    s = float(a.abs().mean())
    d = float((a - b).abs().mean())
    return d / s if s > 0 else float(d > 0)


def _effect(a: torch.Tensor, b: torch.Tensor, again: torch.Tensor | None) -> dict[str, Any]:
    """What a hook did to ``a`` (its input) giving ``b``; ``again``: its result on a copy of ``a``."""
    out: dict[str, Any] = {"change": _rel(a, b), "noise": _rel(b, again) if again is not None else None}
    if a.shape == b.shape and a.is_floating_point() and b.is_floating_point():
        x, y = a.detach().double(), b.detach().double()
        den = float((x * x).sum())
        if den > 0:
            c = float((x * y).sum()) / den
            if float((y - c * x).norm()) <= SCALE_RESID * max(float(y.norm()), 1e-30):
                out["scale"] = c
    return out


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if old is None:
        return {**new, "calls": 1}
    out = {**old, "calls": old["calls"] + 1, "change": max(old["change"], new["change"])}
    if new.get("noise") is not None:
        out["noise"] = max(old.get("noise") or 0.0, new["noise"])
    same = "scale" in old and "scale" in new and abs(new["scale"] - old["scale"]) <= 1e-3 * abs(old["scale"])
    if not same:
        out.pop("scale", None)
    return out


def _forward_wrapper(fn, rec: dict[str, Any], mode: list[str]):
    def wrapper(module, *rest):
        out = rest[-1]
        t0 = _first_tensor(out)
        if not isinstance(t0, torch.Tensor):
            return None  # nothing to measure: the user's hook is not called (it may count its calls)
        t0 = t0.detach().clone()
        r = fn(module, *rest)
        res = out if r is None else r
        t1 = _first_tensor(res)
        again = None
        if t0 is not None and isinstance(out, torch.Tensor):
            r2 = fn(module, *rest[:-1], t0.clone())
            again = _first_tensor(t0 if r2 is None else r2)
        if t0 is not None and isinstance(t1, torch.Tensor):
            rec[mode[0]] = _merge(rec.get(mode[0]), _effect(t0, t1.detach().clone(), again))
        return r

    return wrapper


def _pre_wrapper(fn, rec: dict[str, Any], mode: list[str], with_kwargs: bool):
    def wrapper(module, args, *kw):
        t0 = _first_tensor(args)
        if not isinstance(t0, torch.Tensor):
            return None  # nothing to measure (keyword inputs only): the user's hook is not called
        t0 = t0.detach().clone()
        r = fn(module, args, *kw)
        new = args if r is None else (r[0] if with_kwargs else r)
        t1 = _first_tensor(new if isinstance(new, tuple) else (new,))
        again = None
        if t0 is not None:
            copy = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
            r2 = fn(module, copy, *kw)
            new2 = copy if r2 is None else (r2[0] if with_kwargs else r2)
            again = _first_tensor(new2 if isinstance(new2, tuple) else (new2,))
        if t0 is not None and isinstance(t1, torch.Tensor):
            rec[mode[0]] = _merge(rec.get(mode[0]), _effect(t0, t1.detach().clone(), again))
        return r

    return wrapper


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    kept = [(m, m.training) for m in model.modules()]
    for m in model.modules():
        m.training = training
    try:
        yield
    finally:
        for m, t in kept:
            m.training = t


def _ids(model: nn.Module, vocab: int) -> torch.Tensor:
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(20261202)
    return torch.randint(1, max(2, int(vocab)), (PROBE_ROWS, PROBE_LEN), generator=gen).to(dev)


def _run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    t = _first_tensor(model(input_ids=ids, attention_mask=torch.ones_like(ids)))
    return t.detach().double().cpu() if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def modes(model: nn.Module, vocab: int) -> dict[str, float] | None:
    """The forward's output (its hooks set aside) called twice in eval mode and twice in training mode on the
    probe batch: ``eval_noise`` / ``train_noise`` (mean relative difference of the two calls) and
    ``train_vs_eval`` (first calls). None when it cannot run."""
    if not _plain(model):
        return None
    ids = _ids(model, vocab)
    dev = ids.device
    got: dict[str, torch.Tensor | None] = {}
    mods = list(
        model.modules()
    )  # the hooks set aside: a user hook may count calls (its effect is `hook_effects`')
    kept = [(m._forward_hooks, m._forward_pre_hooks) for m in mods]
    for m in mods:
        m._forward_hooks, m._forward_pre_hooks = type(m._forward_hooks)(), type(m._forward_pre_hooks)()
    try:
        with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []), torch.no_grad():
            for training in (False, True):
                with _mode(model, training):
                    got[f"{training}0"], got[f"{training}1"] = _run(model, ids), _run(model, ids)
    except Exception:  # a user module with another signature: no probe, never a failed run
        return None
    finally:
        for m, (fwd, pre) in zip(mods, kept, strict=True):
            m._forward_hooks, m._forward_pre_hooks = fwd, pre
    if any(v is None for v in got.values()):
        return None
    return {
        "eval_noise": _rel(got["False0"], got["False1"]),
        "train_noise": _rel(got["True0"], got["True1"]),
        "train_vs_eval": _rel(got["False0"], got["True0"]),
    }


def _hook_name(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code else name


def hook_effects(pre: Mapping[str, Any] | None, model: nn.Module, vocab: int) -> list[dict[str, Any]]:
    """One ``hook_effect`` aspect per forward hook or pre-hook the setup registered (module docstring)."""
    if not pre or not _plain(model):
        return []
    old = pre["hooks"]
    new: list[tuple[nn.Module, str, int, bool]] = []
    for name, m in model.named_modules():
        fwd, pre_keys = old.get(name, (set(), set()))
        new += [(m, name, k, False) for k in m._forward_hooks if k not in fwd]
        new += [(m, name, k, True) for k in m._forward_pre_hooks if k not in pre_keys]
    if not new:
        return []
    mode = ["eval"]
    recs: list[dict[str, Any]] = []
    originals = []
    for m, _name, k, is_pre in new:
        table = m._forward_pre_hooks if is_pre else m._forward_hooks
        fn = table[k]
        rec: dict[str, Any] = {}
        recs.append(rec)
        originals.append((table, k, fn))
        kw = k in (m._forward_pre_hooks_with_kwargs if is_pre else m._forward_hooks_with_kwargs)
        table[k] = _pre_wrapper(fn, rec, mode, kw) if is_pre else _forward_wrapper(fn, rec, mode)
    ids = _ids(model, vocab)
    dev = ids.device
    try:
        with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []), torch.no_grad():
            for training in (False, True):
                mode[0] = "train" if training else "eval"
                with _mode(model, training):
                    _run(model, ids)
    except Exception:
        pass  # a hook or module that fails on the probe: what was recorded stands
    finally:
        for table, k, fn in originals:
            table[k] = fn
    return [
        {
            "aspect": "hook_effect",
            "module": name,
            "hook": _hook_name(fn),
            "pre": is_pre,
            "eval": rec.get("eval"),
            "train": rec.get("train"),
        }
        for (m, name, k, is_pre), rec, (_t, _k, fn) in zip(new, recs, originals, strict=True)
    ]


def after(pre: Mapping[str, Any] | None, model: nn.Module, vocab: int) -> list[dict[str, Any]]:
    """The aspects of `before`'s reading that changed (module docstring)."""
    if not pre:
        return []
    found: list[dict[str, Any]] = []
    v = values(pre, model)
    if v is not None:
        found.append(v)
    found += hook_effects(pre, model, vocab)
    now = modes(model, vocab)
    was = pre.get("modes")
    if now is not None and was is not None and any(now[k] > max(10 * was[k], SAME) for k in now):
        found.append({"aspect": "modes", **now, **{k + "_before": v for k, v in was.items()}})
    return found
