"""Module probes and numerics on tiny models driven by hand through the observer protocol:
gradient checkpointing (use_reentrant=False), NaN/Inf provenance forward and backward, hooks
removed on exit, lost updates and gradient counts worked by hand.

Run: `pytest tests/test_audit_probes.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.precision import resolve_policy
from verlaudit.audit import Auditor, AuditSettings
from verlaudit.audit import numerics as N

# eos 2: LlamaConfig's default, the tiny models' config (a tokenizer with another eos is a finding of its own)
TOK = {"vocab_size": 20, "pad_token_id": 0, "eos_token_id": 2, "padding_side": "left"}


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=20,
        max_position_embeddings=32,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def one_step(auditor, model, forward, policy, step=0, lr=1e-3):
    """What a recipe does for one step, with the observer calls of trainer/events.py."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    auditor.on_step_start(step)
    with auditor.phase("actor_update"):
        loss = forward(model)
        auditor.on_loss(role="actor", loss=loss, terms={})
        loss.backward()
        auditor.on_backward(role="actor", model=model, loss_scale=1.0)
        auditor.on_before_optimizer_step(role="actor", model=model, optimizer=opt)
        opt.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.zero_grad(set_to_none=True)
        auditor.on_optimizer_step(
            role="actor",
            model=model,
            optimizer=opt,
            scaler_state={"mode": "none", "scale": 1.0},
            skipped=False,
            grad_norm=0.0,
        )
    auditor.on_step_end(step, {"actor/loss": float(loss.detach())})
    return grads


def lm_loss(model):
    ids = torch.arange(12).reshape(2, 6) % 20
    return model(input_ids=ids, labels=ids).loss


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_checkpointing_with_hooks_gives_the_same_gradients_and_no_findings():
    policy = resolve_policy("fp32")
    plain = tiny_llama()
    plain.train()
    ref = {
        n: g
        for n, g in one_step(Auditor(settings=AuditSettings(level="off")), plain, lm_loss, policy).items()
    }
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    before = hook_count(model)  # HF registers a hook of its own for checkpointing
    with Auditor(settings=AuditSettings(level="full", full_steps=1, every=0)) as a:
        a.on_setup(config={}, policy=policy, models={"actor": model}, tokenizer_info=TOK)
        a.on_step_start(0)
        assert hook_count(model) > before
        grads = one_step(a, model, lm_loss, policy)
        assert a.context.sampled and a.probe is not None
    for n, g in ref.items():
        torch.testing.assert_close(grads[n], g)
    assert [f for f in a.findings.all() if f.severity != "info"] == []
    assert hook_count(model) == before  # every hook of ours came off


class Sqrt(nn.Module):
    """Finite forward at 0, infinite derivative there: a backward-only producer."""

    def forward(self, x):
        return torch.sqrt(x - x.detach().min())


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # log of negative entries: NaN in the forward


def seq_model(middle):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), middle, nn.Linear(4, 4), nn.Linear(4, 1))


def drive(model, step=0):
    policy = resolve_policy("fp32")
    with Auditor(settings=AuditSettings(level="full", full_steps=5, every=0)) as a:
        a.on_setup(config={}, policy=policy, models={"actor": model}, tokenizer_info=TOK)
        one_step(
            a, model, lambda m: m(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).sum(), policy
        )
    return a


def test_backward_producer_is_the_module_whose_gradient_became_nonfinite():
    a = drive(seq_model(Sqrt()))
    f = a.findings.find("numerics/nonfinite_backward")
    assert [(x.where, x.severity) for x in f] == [("1", "error")]  # the Sqrt, not the Linear before it
    assert a.findings.find("numerics/nonfinite_forward") == []


def test_forward_producer_is_told_apart_from_propagators():
    a = drive(seq_model(Log()))
    f = a.findings.find("numerics/nonfinite_forward")
    assert [x.where for x in f] == ["1"]  # log; modules 2, 3 and the Sequential only propagated
    assert a.provenance.forward_propagated >= 2
    assert a.findings.find("numerics/nonfinite_backward") == []  # forward already explains it


def test_runtime_error_is_attributed_and_propagates():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16)))
    a = Auditor(settings=AuditSettings(level="full"))
    with pytest.raises(RuntimeError):
        with a:
            a.on_setup(config={}, policy=resolve_policy("fp32"), models={"actor": model}, tokenizer_info=TOK)
            a.on_step_start(0)
            with a.phase("actor_update"):
                model(torch.zeros(1, 4))
    assert a.failure["reason"] == "dtype_error"
    assert (a.failure["where"], a.failure["phase"], a.failure["step"]) == ("1.0", "actor_update", 0)
    assert a.probe.failed_in == ("actor", "1.0")  # the hook stack agrees with the traceback
    [f] = a.findings.find("runtime/dtype_error")
    assert (f.where, f.observed, f.expected) == ("1.0", "fp32", "bf16")
    assert hook_count(model) == 0


def test_grad_stats_by_hand():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([float("inf"), 0.0, 1e-6, 1.0])
    s = N.grad_stats([("w.weight", p)], torch.float16)
    # 1 non-finite; below fp16's smallest normal 6.1e-5: 0.0 and 1e-6 -> 2 of 4
    assert (s.nonfinite, s.first_nonfinite, s.underflow_frac) == (1, ["w.weight"], 0.5)


@pytest.mark.parametrize("dtype, lost", [(torch.bfloat16, 1.0), (torch.float32, 0.0)])
def test_update_underflow_by_hand(dtype, lost):
    # weights at 1.0, SGD step of 1e-4: bf16's spacing just below 1.0 is 2**-8 = 0.0039, so 1.0 - 1e-4
    # rounds back to 1.0 (every update lost); fp32 keeps it
    p = nn.Parameter(torch.ones(8, dtype=dtype))
    p.grad = torch.ones(8, dtype=dtype)
    snap = N.snapshot([("w.weight", p)])
    with torch.no_grad():
        p -= 1e-4 * p.grad
    frac, per_module = N.update_underflow(snap, [("w.weight", p)])
    assert frac == lost and per_module == {"w": lost}


def test_bf16_pure_low_lr_reports_lost_updates_end_to_end():
    policy = resolve_policy("bf16-pure")
    model = tiny_llama().to(torch.bfloat16)
    with Auditor(settings=AuditSettings(level="full", full_steps=1, every=0)) as a:
        a.on_setup(config={}, policy=policy, models={"actor": model}, tokenizer_info=TOK)
        one_step(a, model, lm_loss, policy, lr=1e-6)
    [f] = a.findings.find("numerics/update_underflow")
    assert f.observed["fraction"] > 0.9


def test_full_level_reads_the_step_back_once_not_per_module(monkeypatch):
    """The hooks keep every maximum on the device; the auditor reads them when it settles at the
        optimizer step (one read per device), then replays them in call order. Counted: reads of values
        back to the host while a hooked forward + backward runs (none beyond the model's own; the code before
    this read 122 times here), and the reads of the flush (one ``tolist`` of every value)."""
    from tests.test_attention_mask import _HostReads

    policy = resolve_policy("fp32")
    model = tiny_llama()
    lm_loss(model).backward()  # HF reads once on a model's first call; not counted
    with _HostReads() as plain:  # what the model itself reads (HF's own code), without hooks
        lm_loss(model).backward()
    with Auditor(settings=AuditSettings(level="full", full_steps=1, every=0)) as a:
        a.on_setup(config={}, policy=policy, models={"actor": model}, tokenizer_info=TOK)
        a.on_step_start(0)
        with a.phase("actor_update"), _HostReads() as reads:
            loss = lm_loss(model)
            loss.backward()
        assert reads.n == plain.n  # the hooks added none
        assert len(a.probe._log) > 2 * len(list(model.modules()))  # forwards + gradients, recorded
        tolist, calls = torch.Tensor.tolist, []

        def counted(t):
            calls.append(t.numel())
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        a.probe.flush()
        monkeypatch.undo()
        assert len(calls) == 1 and calls[0] > 2 * len(list(model.modules())) and a.probe._log == []
        assert 0 < a.probe.absmax["actor"] < float("inf")  # replayed: the step's largest activation
