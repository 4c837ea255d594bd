"""Gradient hooks a user's ``model.setup`` registered on parameters (``p.register_hook``), and what they do
to the gradient, measured on the probe batch of `trainer.setup_values`: the gradients of a sample of the
hooked parameters with the hooks (``torch.autograd.grad`` runs a leaf's hooks) and without them (the same
forward through ``torch.func.functional_call`` on hook-free copies of those parameters), at loss scale 1
and at 2^16, the scale fp16's GradScaler starts at: a hook on a parameter runs inside the backward, before
any ``unscale_``, so under fp16 it sees the gradient times the loss scale.

`before` notes each parameter's hook keys; `after` returns one ``grad_hooks`` aspect for the setup's record
(`trainer.models.apply_setup`): how many parameters carry new hooks, the hook functions (name, file:line)
and per scale the share of gradient elements the hooks changed, the share held at one magnitude (a clamp's
bound), the cosine of the hooked gradient to the gradient and to its sign, and the norm ratio.
`verlaudit.audit.grad_hooks` turns it into ``setup/grad_hooks``. Cost: one forward and two backward passes of
the 8 x 6 probe per scale, gradients only for the sampled tensors; only when a setup added such a hook.
Exercised by `pytest tests/test_setup_grad_hooks.py`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from trainer.setup_probe import _output_tensor
from trainer.setup_values import _ids, _mode, _plain

SCALES = (1.0, 65536.0)
"""Loss scales the gradient is measured at: none, and fp16's GradScaler's initial scale."""
SAMPLE = 8
"""Hooked parameters measured (the first, matrices first)."""
REL = 1e-4
"""An element whose hooked gradient differs from the gradient by more than this share of it is changed (the
two backward passes compute the same operations: an identity hook differs by nothing)."""


def _keys(p: torch.Tensor) -> set[int]:
    return set(getattr(p, "_backward_hooks", None) or {})


def before(model: nn.Module) -> dict[int, set[int]]:
    """id(parameter) -> the keys of the hooks it carries before the setup."""
    return {id(p): _keys(p) for p in model.parameters()}


def _where(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


def _loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A language model's next-token loss on the probe (a value or score head: its mean)."""
    if out.dim() == 3 and out.shape[-1] > 1:
        lp = out[:, :-1].float().log_softmax(-1)
        return -lp.gather(-1, ids[:, 1:, None]).mean()
    return out.float().mean()


def _stats(h: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    changed = (h - g).abs() > REL * g.abs()
    top = h.abs().max()
    held = (h.abs() >= top * (1 - 1e-6)) & changed if float(top) > 0 else torch.zeros_like(changed)
    cos = torch.nn.functional.cosine_similarity
    gn = float(g.norm())
    return {
        "changed": float(changed.float().mean()),
        "held": float(held.float().mean()),
        "bound": float(top),
        "cos": float(cos(h, g, dim=0)) if gn > 0 and float(h.norm()) > 0 else 0.0,
        "cos_sign": float(cos(h, torch.sign(g), dim=0)) if gn > 0 and float(h.norm()) > 0 else 0.0,
        "norm_ratio": float(h.norm()) / gn if gn > 0 else 0.0,
    }


def after(pre: dict[int, set[int]] | None, model: nn.Module, vocab: int) -> list[dict[str, Any]]:
    """The ``grad_hooks`` aspect (module docstring), or nothing when the setup added no parameter hook."""
    if pre is None:
        return []

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hooked = [(n, p, [f for k, f in p._backward_hooks.items() if k not in pre.get(id(p), set())])
              for n, p in named if _keys(p) - pre.get(id(p), set())]  # fmt: skip
    if not hooked:
        return []
    fns = {_where(f): None for _, _, fs in hooked for f in fs}
    rec: dict[str, Any] = {"aspect": "grad_hooks", "params": len(hooked), "trainable": len(named),
                           "hooks": list(fns)[:3], "hook_count": len(fns), "names": [n for n, _, _ in hooked[:4]]}  # fmt: skip
    if not _plain(model):  # sharded or meta parameters: nothing to probe
        return [rec]
    sample = sorted(hooked, key=lambda t: t[1].dim() < 2)[:SAMPLE]
    dev = sample[0][1].device
    ids = _ids(model, vocab).to(dev)  # setup_values' probe batch
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    params = [p for _, p, _ in sample]
    by: dict[str, Any] = {}
    try:
        devices = [dev.index or 0] if dev.type == "cuda" else []
        with _mode(model, False), torch.random.fork_rng(devices=devices), torch.enable_grad():
            out = _output_tensor(model(**kw))
            copies = {n: p.detach().clone().requires_grad_(True) for n, p, _ in sample}
            free = _output_tensor(torch.func.functional_call(model, copies, (), kw))
            if out is None or free is None:
                return [rec]
            loss, loss_free = _loss(out, ids), _loss(free, ids)
            for s in SCALES:
                h = torch.autograd.grad(loss * s, params, retain_graph=True, allow_unused=True)
                g = torch.autograd.grad(
                    loss_free * s, list(copies.values()), retain_graph=True, allow_unused=True
                )
                pairs = [(a, b) for a, b in zip(h, g, strict=True) if a is not None and b is not None]
                if pairs:
                    hv = torch.cat([a.detach().float().reshape(-1) for a, _ in pairs])
                    gv = torch.cat([b.detach().float().reshape(-1) for _, b in pairs])
                    by[f"{s:g}"] = {**_stats(hv, gv), "elements": int(gv.numel())}
    except Exception:  # noqa: BLE001  a model or hook that fails on the probe: the hooks are still named
        with contextlib.suppress(Exception):
            model.zero_grad(set_to_none=True)
        return [rec]
    return [{**rec, "by_scale": by}]
