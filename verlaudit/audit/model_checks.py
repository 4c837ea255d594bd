"""What the built models compute at setup, on the task's own text, against what they should:

- ``model/checkpoint_untrained``: a policy loaded from a checkpoint (``model.path``, or weights a
  ``model.setup`` loaded) predicts the task's answers no better than the answers' own token
  frequencies: the weights it runs are not the trained model's (a head tied to the embeddings because
  the export dropped ``lm_head.weight``, layers or tensors under other names, a tokenizer it was not
  trained with). The message names what the evidence points to.
- ``setup/hook_output``: a forward hook from user code changes the role's output (the same forward with
  the user's hooks set aside differs): logits divided by a temperature, values scaled.
- ``setup/mask_ignored`` / ``model/padding_dependent``: the outputs of a row's real tokens change when
  the row is left-padded, though the mask marks the padding: the attention mask is not honoured (a hook
  that drops it, a patched forward). Named after the setup (and its hook) when one explains it.
- ``setup/value_offset``: after a setup the critic's values start far outside the builtin task's
  reward range [0, 1] (a value head's bias or scale).

Cost: a handful of no-grad forwards of 16 short rows per role at setup (eval mode, the RNG restored,
the model's training mode put back), none at step time. Exercised by `pytest tests/test_model_checks.py`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit import tokenizer_checks
from verlaudit.rundir import Finding

ROLES = ("actor", "reference", "critic")
"""Roles whose forward the trainer calls with (ids, attention mask)."""
_OWN_HOOKS = ("torch.", "transformers.", "accelerate.", "trainer.", "verlaudit.", "peft.")
PAD_ROWS = 8
"""Rows compared padded and alone."""
HOOK_CHANGE = 0.05
"""A hook's mean relative change of the output past which it changes what the model computes, not only
how it rounds (a cast to bf16 changes it by about 0.4%, a temperature of 0.7 by 43%)."""
VALUE_OFFSET = 5.0
"""Critic values whose mean magnitude passes this many times the reward range [0, 1] at setup."""


def _tol(model: nn.Module) -> float:
    """Relative difference two forwards of the same tokens may show: rounding of the stored dtype
    (another kernel path, another reduction order), with room."""
    p = next(model.parameters(), None)
    return 1e-3 if p is None or p.dtype in (torch.float32, torch.float64) else 0.05


def _who(model: nn.Module) -> str | None:
    rec = getattr(model, "setup_changes", None)
    if isinstance(rec, Mapping):
        return f"{rec.get('key', 'model.setup')} ({rec.get('spec', '?')})"
    return None


def _aspects(model: nn.Module) -> set[str]:
    rec = getattr(model, "setup_changes", None)
    ch = rec.get("changes") if isinstance(rec, Mapping) else None
    return {c.get("aspect") for c in ch or [] if isinstance(c, Mapping)}


def batch(tokenizer: Any, pairs: Sequence[tuple[str, str]], device) -> tuple[torch.Tensor, ...] | None:
    """Prompt + answer + eos rows, left-padded as the trainer's collators pad: (ids, mask, answer mask)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is None or eos is None:
        return None
    rows, ans = [], []
    for p, a in pairs:
        pi = tokenizer(p, add_special_tokens=True)["input_ids"]
        ai = tokenizer(a, add_special_tokens=False)["input_ids"] + [eos]
        rows.append(pi + ai)
        ans.append([0] * len(pi) + [1] * len(ai))
    w = max(map(len, rows))
    ids = torch.tensor([[pad] * (w - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (w - len(r)) + [1] * len(r) for r in rows], device=device)
    answer = torch.tensor([[0] * (w - len(r)) + a for r, a in zip(rows, ans, strict=True)], device=device)
    return ids, mask, answer


def _out(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    t = getattr(out, "logits", None)
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def forward(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, *, hooks: bool = True, plain: bool = False
) -> torch.Tensor | None:
    """The role's output (fp32) on ``ids`` as the trainer calls it (`trainer.logprobs.attention_inputs`
    for a causal LM), no grad, eval mode, RNG restored; ``hooks=False`` sets the user's forward hooks aside;
    ``plain``: a causal LM called with ids and mask alone, as generation and other callers do (no
    position ids, from which the library can rebuild the sequences' bounds without the mask)."""
    from trainer.logprobs import _accepts, attention_inputs

    kept = []
    if not hooks:
        for m in model.modules():
            for d in (m._forward_hooks, m._forward_pre_hooks):
                mine = {k: h for k, h in d.items() if _user(h)}
                kept.append((d, mine))
                for k in mine:
                    d.pop(k)
    was = [(m, m.training) for m in model.modules()]
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if _accepts(model, "use_cache"):
                attn = {"attention_mask": mask} if plain else attention_inputs(model, mask)
                out = model(input_ids=ids, use_cache=False, **attn)
            else:
                out = model(input_ids=ids, attention_mask=mask)
        t = _out(out)
        return None if t is None else t.float()
    except Exception:  # a module of another signature: no reading, never a failed run
        return None
    finally:
        for m, t in was:
            m.training = t
        for d, mine in kept:
            d.update(mine)


def _user(h: Any) -> bool:
    h = getattr(h, "func", h)
    return not str(getattr(h, "__module__", "") or "").startswith(_OWN_HOOKS)


def _hook_names(model: nn.Module) -> list[str]:
    """``file.py:line (function)`` of each forward hook from user code, with its module."""
    out = []
    for name, m in model.named_modules():
        for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:
            if not _user(h):
                continue
            fn = getattr(h, "func", h)
            try:
                at = f"{os.path.basename(inspect.getsourcefile(fn) or '?')}:{inspect.getsourcelines(fn)[1]}"
            except (TypeError, OSError):
                at = getattr(fn, "__module__", "?")
            kind = "pre-hook" if h in m._forward_pre_hooks.values() else "hook"
            out.append(
                f"{at} ({getattr(fn, '__qualname__', type(fn).__name__)}, forward {kind} on {name or 'the model'})"
            )
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12))


def _padding_change(model: nn.Module, ids, mask, *, hooks: bool) -> float | None:
    """Mean relative change of a row's real-token outputs between the padded batch and the row alone,
    over the `PAD_ROWS` most padded rows, the worst of the trainer's call and the `plain` one."""
    plains = (False, True) if _rotary(model) else (False,)  # absolute positions shift with padding
    got = [_padding_change_of(model, ids, mask, hooks=hooks, plain=plain) for plain in plains]
    return None if got[0] is None else max(g for g in got if g is not None)


def _rotary(model: nn.Module) -> bool:
    """Whether positions enter only relatively (rotary embeddings): then a left-padded row called
    without position ids computes the same for its real tokens, as long as the mask is honoured."""
    return any(name.endswith("rotary_emb") for name, _ in model.named_modules())


def _padding_change_of(model: nn.Module, ids, mask, *, hooks: bool, plain: bool) -> float | None:
    padded = forward(model, ids, mask, hooks=hooks, plain=plain)
    if padded is None:
        return None
    order = sorted(range(ids.shape[0]), key=lambda i: int(mask[i].sum()))[:PAD_ROWS]
    worst = 0.0
    for i in order:
        real = mask[i].bool()
        if bool(real.all()):
            continue
        alone = forward(model, ids[i : i + 1, real], mask[i : i + 1, real], hooks=hooks, plain=plain)
        if alone is None:
            return None
        worst = max(worst, _rel(padded[i, real], alone[0]))
    return worst


# long: the two forwards (hooks on / off, padded / alone) and their findings share the role's inputs and state
def hook_findings(role: str, model: nn.Module, ids, mask) -> list[Finding]:
    """``setup/hook_output`` and ``setup/mask_ignored`` / ``model/padding_dependent`` for one role."""
    hooks = _hook_names(model)
    tol = _tol(model)
    who = _who(model)
    out: list[Finding] = []
    pad = _padding_change(model, ids, mask, hooks=True)
    if pad is None or not math.isfinite(pad):
        return []
    pad_bare = _padding_change(model, ids, mask, hooks=False) if hooks else pad
    real = mask.bool()
    if pad > tol and (pad_bare is not None and pad_bare <= tol and hooks):
        what = f"the forward hook(s) {'; '.join(hooks[:3])}"
        msg = (
            f"{what} make the {role}'s outputs depend on padding: a left-padded row's real tokens get outputs "
            f"{pad:.1%} (mean relative) away from the same row alone, {pad_bare:.2g} without the hook(s): the "
            "attention_mask is dropped or ignored, so every forward attends to the padding of the prompts"
        )
        fix = (
            f"remove the hook in {who or 'the code that registered it'} ({hooks[0]}) or make it pass "
            "attention_mask on: the mask must reach the attention of every forward"
        )
        kind = K.SETUP_MASK_IGNORED if who else K.PADDING_DEPENDENT
        out.append(
            _f(
                kind,
                "error",
                role,
                who or hooks[0],
                msg,
                fix,
                {"change": pad, "bare": pad_bare, "hooks": hooks},
            )
        )
    elif pad > tol:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        msg = (
            f"the {role}'s outputs depend on padding: a left-padded row's real tokens get outputs {pad:.1%} "
            f"(mean relative) away from the same row alone (attention {impl}): the attention_mask is not "
            "honoured, so every forward attends to the padding of the prompts"
        )
        fix = f"make the {role}'s forward use the attention_mask it is given" + (
            f" (check what {who} changed in its attention or forward)" if who else ""
        )
        kind = K.SETUP_MASK_IGNORED if who else K.PADDING_DEPENDENT
        out.append(_f(kind, "error", role, who or role, msg, fix, {"change": pad, "attn": impl}))
    if not hooks or out:
        return out
    a, b = forward(model, ids, mask, hooks=True), forward(model, ids, mask, hooks=False)
    if a is None or b is None or a.shape != b.shape:
        return out
    a, b = a[real], b[real]
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return out  # a hook that makes NaN/Inf: the numerics checks name its module
    change = _rel(a, b)
    if change <= max(tol, HOOK_CHANGE):
        return out  # a cast or a rounding hook: the dtype checks say what it rounds
    c = float((a * b).sum() / (b * b).sum().clamp_min(1e-30))
    scaled = _rel(a, c * b) <= tol
    how = (
        f"it multiplies the output by {c:.3g}"
        + (f" (a temperature of {1 / c:.3g} on the logits)" if role != "critic" else "")
        if scaled
        else f"it changes the output by {change:.1%} (mean relative)"
    )
    msg = (
        f"the forward hook(s) on the {role} ({'; '.join(hooks[:3])}) change what its forward returns: {how}; "
        + (
            "the reference's log-probs are not the actor's starting policy, so the KL differs from 0 at step 0 "
            "and pulls the policy towards the hooked model"
            if role == "reference"
            else "the loss reads the hooked output, not the model's"
        )
    )
    fix = f"remove the hook from {who or 'the code that registered it'} ({hooks[0]}): the {role}'s logits must be the model's own"
    kind = K.SETUP_HOOK_OUTPUT
    out.append(
        _f(
            kind,
            "warning",
            role,
            who or hooks[0],
            msg,
            fix,
            {"change": change, "scale": c if scaled else None, "hooks": hooks},
        )
    )
    return out


def _f(kind, severity, role, where, msg, fix, observed) -> Finding:
    return Finding(severity=severity, kind=kind, role=role, where=where, message=msg, fix=fix, observed=observed,
                   expected="the model's own output, the same with and without padding")  # fmt: skip


def _nll(model: nn.Module, ids, mask, answer) -> tuple[float, float, float] | None:
    """(the policy's mean NLL of the answer tokens, the entropy of the answer tokens' own frequencies,
    log of the vocabulary size)."""
    logits = forward(model, ids, mask)
    if logits is None or logits.dim() != 3:
        return None
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = answer[:, 1:].float()
    if float(m.sum()) <= 0:
        return None
    nll = float(-(lp * m).sum() / m.sum())
    tokens = ids[:, 1:][m.bool()]
    freq = torch.bincount(tokens).float()
    freq = freq[freq > 0] / freq.sum()
    return nll, float(-(freq * freq.log()).sum()), math.log(logits.shape[-1])


RANDOM_BAND = 0.1
"""An answer NLL within this share of log(vocab) is a never-trained checkpoint's (random init), left alone:
a trained one loaded wrong keeps part of what it learnt (below) or is confidently wrong (above)."""
_CONFIG_FIELDS = ("rope_theta", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "num_hidden_layers")
"""Config fields that change what a checkpoint computes, quoted when it does not know its task."""


def _checkpoint_keys(path: str) -> set[str] | None:
    try:
        from safetensors import safe_open

        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        keys: set[str] = set()
        for f in files:
            with safe_open(os.path.join(path, f), "pt") as h:
                keys |= set(h.keys())
        return keys if files else None
    except Exception:
        return None


def untrained_finding(
    config: Mapping[str, Any], actor: nn.Module, ids, mask, answer, explained: bool
) -> Finding | None:
    """``model/checkpoint_untrained`` for a policy whose weights came from a checkpoint (model.path, or a
    setup that loaded some) when its answer NLL is no better than the answers' token frequencies."""
    model_cfg = config.get("model") or {}
    path = model_cfg.get("path")
    aspects = _aspects(actor)
    loaded = bool(aspects & {"load", "pretrained", "remapped"})
    report = getattr(actor, "load_report", None)
    if isinstance(report, Mapping) and report.get("missing", 0) + report.get("mismatched", 0) > 0:
        return None  # weights the checkpoint lacked: `model/newly_initialised` names them
    if explained or "remapped" in aspects or not (path or loaded):
        return None
    got = _nll(actor, ids, mask, answer)
    if got is None:
        return None
    nll, unigram, uniform = got
    if nll <= unigram or abs(nll - uniform) <= RANDOM_BAND * uniform:
        return None  # it knows the task; or it is an untrained checkpoint (a random init is no loading fault)
    ev = (
        f"the policy's NLL of the task's answers is {nll:.2f} nats per token, no better than the "
        f"{unigram:.2f} of the answers' own token frequencies (a random model: about {uniform:.2f})"
    )
    who = _who(actor)
    cfg = getattr(actor, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    keys = _checkpoint_keys(path) if path and not loaded else None
    if loaded and who:
        where = who
        msg = f"after {who} loaded weights into the actor, {ev}: the weights it loaded are not the trained model's"
        fix = f"check the state dict {who} loads: every tensor under its own name and layer index, nothing left at init"
    elif model_cfg.get("tokenizer") and nll > uniform:
        where = f"model.tokenizer ({model_cfg['tokenizer']})"
        msg = (
            f"{ev}, worse than uniform: the ids of model.tokenizer are not the ones the model was trained on"
        )
        fix = "use the tokenizer the model was trained with (the one saved with model.path)"
    elif tied and keys is not None and not any(k.endswith("lm_head.weight") for k in keys):
        where = f"model.path ({path}) tie_word_embeddings"
        msg = (
            f"model.path ({path}) ties the output head to the input embeddings (config tie_word_embeddings: "
            f"true) and its checkpoint holds no lm_head.weight, so the head is the embedding matrix; {ev}: the "
            "trained head is missing from the checkpoint (an export that dropped a head it believed tied)"
        )
        fix = (
            f"re-export the checkpoint with its trained lm_head.weight and tie_word_embeddings false in "
            f"{path}/config.json (save_pretrained of the trained model); a head trained apart from the "
            "embeddings cannot be tied"
        )
    else:
        where = f"model.path ({path})"
        fields = ", ".join(
            f"{k}={getattr(cfg, k)!r}" for k in _CONFIG_FIELDS if getattr(cfg, k, None) is not None
        )
        msg = (
            f"{ev}: the checkpoint in model.path ({path}) does not compute as the trained model did: its "
            f"weights (names, layer order, dtype) or its config.json ({fields}) are not the ones it was "
            "trained with"
        )
        fix = (
            f"check the checkpoint in {path}: the weights of the model you trained under their own names, and "
            "the config.json it was trained with (rope_theta, rms_norm_eps, hidden_act, tie_word_embeddings)"
        )
    obs = {"nll": round(nll, 4), "unigram": round(unigram, 4), "uniform": round(uniform, 4)}
    return _f(K.WEIGHTS_UNTRAINED, "error", "actor", where, msg, fix, obs)


def value_finding(config: Mapping[str, Any], critic: nn.Module, ids, mask) -> Finding | None:
    """``setup/value_offset``: after a setup, the critic's mean value magnitude on the task's text is
    over `VALUE_OFFSET` while the builtin task's rule reward is in [0, 1]."""
    model_cfg, data = config.get("model") or {}, config.get("data") or {}
    who = _who(critic)
    if who is None or model_cfg.get("reward_model") or data.get("reward_fn") or data.get("train_files"):
        return None
    v = forward(critic, ids, mask)
    if v is None:
        return None
    v = v.squeeze(-1) if v.dim() == 3 else v
    if v.shape != mask.shape:
        return None
    vals = v[mask.bool()]
    mean = float(vals.mean())
    if abs(mean) <= VALUE_OFFSET:
        return None
    heads = [(n, m) for n, m in critic.named_modules() if isinstance(m, nn.Linear) and m.out_features == 1]
    bias = ""
    if heads and heads[-1][1].bias is not None:
        bias = f"; {heads[-1][0]}.bias is {float(heads[-1][1].bias.detach().float().mean()):.3g}"
    msg = (
        f"after {who} the critic's values on the task's text average {mean:.3g} (std {float(vals.std()):.3g}"
        f"{bias}) while the task's rewards lie in [0, 1]: every advantage starts near {-mean:.3g} and the value "
        "loss is dominated by the value head's offset (its bias or scale)"
    )
    fix = (
        f"initialise the value head small in {who}: bias zero, weight ~ N(0, 1/(10 sqrt(hidden))) (the "
        "trainer's own init); a reward model's score bias or scale does not fit this task's returns"
    )
    return _f(
        K.SETUP_VALUE_OFFSET, "warning", "critic", who, msg, fix, {"mean": mean, "std": float(vals.std())}
    )


def zero_grad_finding(role: str, model: nn.Module, ids, mask, answer) -> Finding | None:
    """``setup/zero_gradient``: after a setup that left trainable tensors at all zeros, not one of the
    role's trainable tensors gets a gradient from its output on the task's text (factors of a product
    that all start at zero): the optimizer never moves it. One backward into `torch.autograd.grad` (the
    parameters' ``.grad`` untouched), at setup only, and only when some trainable tensor is all zeros."""
    from trainer.logprobs import _accepts, attention_inputs

    who = _who(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    zeros = [n for n, p in params if not bool((p.detach() != 0).any())]
    if who is None or not params or not zeros:
        return None  # a product gets a zero gradient from a factor that is zero: none, no backward
    was = [(m, m.training) for m in model.modules()]
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            if _accepts(model, "use_cache"):
                out = _out(model(input_ids=ids, use_cache=False, **attention_inputs(model, mask)))
            else:
                out = _out(model(input_ids=ids, attention_mask=mask))
            if out is None or not out.requires_grad:
                return None  # no graph at all: `setup/no_graph` says so
            sel = out.float()[mask.bool()]
            loss = torch.log_softmax(sel, -1).mean() if sel.dim() == 2 else sel.mean()
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    except Exception:
        return None
    finally:
        for m, t in was:
            m.training = t
    if any(g is not None and bool((g != 0).any()) for g in grads):
        return None
    shown = ", ".join(zeros[:4]) + (f" and {len(zeros) - 4} more" if len(zeros) > 4 else "")
    msg = (
        f"after {who} none of the {role}'s {len(params)} trainable tensors gets a gradient: every one is exactly "
        "0 on the task's text, so the update is 0 and the policy never moves"
        + (
            f"; {len(zeros)} of them are all zeros ({shown}): factors initialised to zero give each other a zero "
            "gradient (the gradient of one is proportional to the other)"
            if zeros
            else ""
        )
    )
    fix = (
        f"initialise one factor of each product randomly in {who} (lora_a ~ kaiming_uniform / normal init, "
        "lora_b may start at zero): the product starts at 0 but its gradient does not"
    )
    return _f(
        K.SETUP_ZERO_GRADIENT,
        "error",
        role,
        who,
        msg,
        fix,
        {"trainable": len(params), "zero_valued": zeros[:6]},
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    coarse = a.dtype if a.element_size() < b.element_size() else b.dtype
    return bool(torch.equal(a.detach().to(dtype=coarse), b.detach().to(device=a.device, dtype=coarse)))


def roles_forward_finding(
    models: Mapping[str, nn.Module], ids, mask, found: Sequence[Finding]
) -> Finding | None:
    """``setup/roles_differ`` when, after a setup on the actor or the reference, their weights are
    equal but their log-probs on the task's text are not: the setup changed how one of them computes
    (a patched ``forward``, a module attribute, a wrapper) and the KL to the reference is not 0 at step 0.
    Left to the other checks when a hook, the padding or the buffers / config comparison explains it."""
    actor, ref = models.get("actor"), models.get("reference")
    if actor is None or ref is None:
        return None
    who = _who(ref) or _who(actor)
    explained = {K.SETUP_HOOK_OUTPUT, K.SETUP_MASK_IGNORED, K.PADDING_DEPENDENT}
    if who is None or any(f.kind in explained for f in found) or "roles" in (_aspects(ref) | _aspects(actor)):
        return None
    sa, sr = actor.state_dict(), ref.state_dict()
    common = set(sa) & set(sr)
    if not common or any(not _same(sa[k], sr[k]) for k in common):
        return None  # the weights differ: the reference check (`model/reference_not_actor`) says where
    la, lr = forward(actor, ids, mask), forward(ref, ids, mask)
    if la is None or lr is None or la.shape != lr.shape or la.dim() != 3:
        return None
    real = mask.bool()
    pa, pr = torch.log_softmax(la[real], -1), torch.log_softmax(lr[real], -1)
    if not (bool(torch.isfinite(pa).all()) and bool(torch.isfinite(pr).all())):
        return None
    change = _rel(pr, pa)
    if change <= max(_tol(actor), _tol(ref), HOOK_CHANGE):
        return None
    kl = float((pa.exp() * (pa - pr)).sum(-1).mean())
    msg = (
        f"after {who} the reference's log-probs on the task's text differ from the actor's by {change:.1%} (mean "
        f"relative; KL {kl:.3g} per token) although their weights are equal: the setup changed how one of them "
        "computes (a patched forward, a module attribute, a wrapper), so the reference is not the actor's "
        "starting policy and the KL is not 0 at step 0"
    )
    fix = f"apply the same change to both roles or remove it from {who}: the reference must compute as the actor starts"
    return _f(K.SETUP_ROLES_DIFFER, "warning", "reference", who, msg, fix, {"change": change, "kl": kl})


def _put_back(get, put, value) -> None:
    """Restores a saved copy, in place for a dict / list the hook mutated (others may hold it)."""
    now = get()
    if isinstance(now, dict) and isinstance(value, dict):
        now.clear()
        now.update(value)
    elif isinstance(now, list) and isinstance(value, list):
        now[:] = value
    elif isinstance(now, set) and isinstance(value, set):
        now.clear()
        now.update(value)
    else:
        put(value)


def _hook_state(h: Any):
    """A function that puts back the state a user hook can reach and change: its closure's cells, its
    attributes, its object's attributes (a bound method or a callable object), the globals it names.
    A hook that counts its calls (to act on the third) then counts the run's calls, not the audit's."""
    fn = getattr(h, "func", h)
    owner = getattr(fn, "__self__", None) or (fn if not inspect.isfunction(fn) else None)
    fn = getattr(fn, "__func__", fn)
    if owner is not None and not inspect.isfunction(fn):
        fn = vars(type(owner)).get("__call__", fn)
    if isinstance(owner, nn.Module):
        owner = None  # a module's own attributes: `kept_state` puts them back
    saved: list[tuple[Any, Any, Any]] = []

    def keep(get, put):
        # plain values and shallow copies of containers: the objects a hook points at (the model's own
        # modules, tensors) keep their identity; a counter in them is put back
        try:
            v = get()
        except Exception:
            return
        if isinstance(v, (dict, list, set)):
            saved.append((get, put, copy.copy(v)))
        elif isinstance(v, (int, float, bool, str, bytes, tuple, frozenset, type(None))):
            saved.append((get, put, v))

    for cell in getattr(fn, "__closure__", None) or ():
        keep(lambda c=cell: c.cell_contents, lambda v, c=cell: setattr(c, "cell_contents", v))
    for obj in (fn, owner):
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict) and not isinstance(obj, type):
            for k in list(d):
                keep(lambda d=d, k=k: d[k], lambda v, d=d, k=k: d.__setitem__(k, v))
    g = getattr(fn, "__globals__", None)
    code = getattr(fn, "__code__", None)
    if isinstance(g, dict) and code is not None:
        for name in code.co_names:
            v = g.get(name)
            if name in g and not (inspect.ismodule(v) or callable(v) or isinstance(v, type)):
                keep(lambda g=g, n=name: g[n], lambda v, g=g, n=name: g.__setitem__(n, v))

    def restore() -> None:
        for get, put, value in saved:
            try:
                _put_back(get, put, value)
            except Exception:
                pass

    return restore


@contextlib.contextmanager
def kept_state(models: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block the models may run their user hooks; after it every module's attributes, its
    buffers (rebound or changed in place) and its training mode are what they were: a hook that casts a
    buffer on its first call, or counts its calls on the module, does so in the run, not in the audit's
    forwards. (Module-level state of the user's own file is beyond reach.)"""
    saved = []
    hooks = []
    for model in models:
        for m in model.modules():
            hooks += [h for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()] if _user(h)]
            bufs = dict(m._buffers)
            values = {k: b.detach().clone() for k, b in bufs.items() if isinstance(b, torch.Tensor)}
            saved.append((m, dict(m.__dict__), bufs, values))
    reach = [_hook_state(h) for h in hooks]
    try:
        yield
    finally:
        for restore in reach:
            restore()
        for m, attrs, bufs, values in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._buffers.clear()
            m._buffers.update(bufs)
            with torch.no_grad():
                for k, v in values.items():
                    b = bufs[k]
                    if b.shape == v.shape and not torch.equal(b, v):
                        b.copy_(v)


def findings(config: Mapping[str, Any], models: Mapping[str, nn.Module], tokenizer: Any) -> list[Finding]:
    """The tokenizer's findings (`verlaudit.audit.tokenizer_checks`), then each role's forwards on the
    task's text, with the models' state kept (`kept_state`)."""
    roles = [m for r, m in models.items() if r in ROLES and isinstance(m, nn.Module)]
    with kept_state(roles):
        return _findings(config, models, tokenizer)


def _findings(config: Mapping[str, Any], models: Mapping[str, nn.Module], tokenizer: Any) -> list[Finding]:
    """The tokenizer's findings (`verlaudit.audit.tokenizer_checks`), then each role's forwards on the task's text."""
    pairs = tokenizer_checks.texts(config)
    out = tokenizer_checks.findings(config, tokenizer, pairs)
    if not pairs or tokenizer is None:
        return out
    for role in ROLES:
        model = models.get(role)
        p = next(model.parameters(), None) if model is not None else None
        if p is None or type(p).__name__ == "DTensor":
            continue
        got = batch(tokenizer, pairs, p.device)
        if got is None:
            return out
        ids, mask, answer = got
        out += hook_findings(role, model, ids, mask)
        if role == "actor":
            explained = any(
                f.kind in (K.TOKENIZER_VOCAB, K.SETUP_MASK_IGNORED, K.PADDING_DEPENDENT) for f in out
            )
            found = untrained_finding(config, model, ids, mask, answer, explained)
            out += [found] if found else []
        if role in ("actor", "critic"):
            found = zero_grad_finding(role, model, ids, mask, answer)
            out += [found] if found else []
        if role == "critic":
            found = value_finding(config, model, ids, mask)
            out += [found] if found else []
    actor = models.get("actor")
    p = next(actor.parameters(), None) if actor is not None else None
    got = batch(tokenizer, pairs, p.device) if p is not None and type(p).__name__ != "DTensor" else None
    if got is not None:
        found = roles_forward_finding(models, got[0], got[1], out)
        out += [found] if found else []
    return out
