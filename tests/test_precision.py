"""Tests for trainer/precision.py: presets, overrides, reasons, errors, and LossScaler against
torch.amp.GradScaler("cpu") on identical toy problems.

Run: PYTHONPATH=. pytest -q tests/test_precision.py
"""

import math

import pytest
import torch

from trainer.precision import LossScaler, resolve_policy

F32, F16, B16 = torch.float32, torch.float16, torch.bfloat16


def test_fp32_preset_is_all_fp32_without_scaling():
    p = resolve_policy("fp32")
    for role in ("actor", "critic", "reference", "reward", "rollout"):
        r = p[role]
        assert (r.param_dtype, r.compute_dtype, r.autocast, r.loss_scaling) == (F32, F32, False, "none")
    assert p["actor"].trainable and not p["reference"].trainable


def test_fp16_preset_autocasts_with_fp32_master_and_dynamic_scaling():
    p = resolve_policy("fp16")
    a = p["actor"]
    assert (a.param_dtype, a.compute_dtype, a.autocast, a.optim_state_dtype) == (F32, F16, True, F32)
    assert a.loss_scaling == "dynamic" and "underflow" in a.reasons["loss_scaling"]
    # frozen roles store fp16 and compute natively (no autocast needed)
    assert (p["reference"].param_dtype, p["reference"].autocast, p["reference"].loss_scaling) == (
        F16,
        False,
        "none",
    )


def test_bf16_and_bf16_pure_presets():
    a = resolve_policy("bf16")["actor"]
    assert (a.param_dtype, a.compute_dtype, a.autocast, a.loss_scaling) == (F32, B16, True, "none")
    pure = resolve_policy("bf16-pure")["actor"]
    assert (pure.param_dtype, pure.compute_dtype, pure.autocast, pure.optim_state_dtype) == (
        B16,
        B16,
        False,
        B16,
    )
    assert "verl" in pure.reasons["param_dtype"]


def test_overrides_apply_and_explain_themselves():
    # compute moved away from fp16: the scaler goes, with its reason
    p = resolve_policy("fp16", {"critic": {"compute_dtype": "bf16"}})
    c = p["critic"]
    assert (c.compute_dtype, c.autocast, c.loss_scaling) == (B16, True, "none")
    assert "compute_dtype" in c.reasons and "away from fp16" in c.reasons["loss_scaling"]
    # a bf16 run with an fp32 reference: autocast follows from param != compute being false here
    ref = resolve_policy("bf16", {"reference": {"param_dtype": "fp32", "compute_dtype": "fp32"}})["reference"]
    assert (ref.param_dtype, ref.compute_dtype, ref.autocast) == (F32, F32, False)
    # fp16 compute on an fp32 preset adds dynamic scaling
    a = resolve_policy("fp32", {"actor": {"compute_dtype": "fp16"}})["actor"]
    assert (a.autocast, a.loss_scaling) == (True, "dynamic")
    assert resolve_policy("fp32", grad_checkpointing={"actor": True})["actor"].grad_checkpointing
    d = p.to_dict()
    assert d["roles"]["critic"]["compute_dtype"] == "bf16" and d["preset"] == "fp16"


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("fp8",), {}, "precision.preset: unknown preset 'fp8'"),
        (("fp32", {"critc": {}}), {}, "precision.overrides: unknown role 'critc'"),
        (("fp32", {"actor": {"colour": 1}}), {}, "precision.overrides.actor.colour: unknown field"),
        (
            ("fp32", {"actor": {"param_dtype": "int8"}}),
            {},
            "precision.overrides.actor.param_dtype: unknown dtype",
        ),
        (
            ("bf16", {"actor": {"autocast": False}}),
            {},
            "precision.overrides.actor: compute_dtype bf16 differs from param_dtype fp32 with autocast false",
        ),
        (("fp32",), {"grad_checkpointing": {"reference": True}}, "precision.grad_checkpointing: 'reference'"),
        (("fp32",), {"where": "variants.x.precision", "grad_checkpointing": {"rollout": True}}, "variants.x"),
    ],
)
def test_policy_errors_name_the_field(args, kwargs, expected):
    with pytest.raises(ValueError) as info:
        resolve_policy(*args, **kwargs)
    assert str(info.value).startswith(expected), str(info.value)


def _toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    return model, x


def _loss(model, x, step, bad_steps):
    loss = (model(x) ** 2).mean()
    # multiplying by inf makes every gradient inf/nan: an overflow both scalers must catch
    return loss * float("inf") if step in bad_steps else loss


def _run_grad_scaler(steps, bad_steps, **kw):
    model, x = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gs = torch.amp.GradScaler("cpu", **kw)
    scales, skips = [], []
    for step in range(steps):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        gs.scale(_loss(model, x, step, bad_steps)).backward()
        gs.step(opt)
        gs.update()
        skips.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(gs.get_scale())
    return scales, skips, [p.detach() for p in model.parameters()]


def _run_loss_scaler(steps, bad_steps, mode="dynamic", **kw):
    model, x = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ls = LossScaler(mode, **kw)
    scales, skips = [], []
    for step in range(steps):
        opt.zero_grad()
        ls.scale_loss(_loss(model, x, step, bad_steps)).backward()
        ls.unscale_(model.parameters())
        skipped = not ls.should_step()
        if not skipped:
            opt.step()
        ls.update()
        skips.append(skipped)
        scales.append(ls.scale)
    return scales, skips, [p.detach() for p in model.parameters()], ls


def test_loss_scaler_matches_grad_scaler_trajectory():
    kw = {"init_scale": 2.0**10, "growth_interval": 3}
    bad = {2, 3, 9}
    g_scales, g_skips, g_params = _run_grad_scaler(12, bad, **kw)
    l_scales, l_skips, l_params, ls = _run_loss_scaler(12, bad, **kw)
    assert l_scales == g_scales
    assert l_skips == g_skips
    assert [i for i, s in enumerate(l_skips) if s] == sorted(bad)
    for a, b in zip(l_params, g_params):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    # 1024 -> backoff at 2, 3 -> 256; 3 finite (4,5,6) -> 512; 7,8 finite then backoff at 9 -> 256;
    # 10, 11 finite: no growth yet
    assert l_scales[-1] == 256.0
    assert (ls.backoffs, ls.growths, ls.skipped_steps) == (3, 1, 3)


def test_injected_inf_skips_step_halves_scale_keeps_weights():
    model, x = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ls = LossScaler("dynamic", init_scale=256.0)
    before = [p.detach().clone() for p in model.parameters()]
    ls.scale_loss(_loss(model, x, 0, {0})).backward()
    assert ls.unscale_(model.parameters()) is True
    assert not ls.should_step()
    if ls.should_step():  # the trainer's path: a skipped step never reaches the optimizer
        opt.step()
    ls.update()
    assert ls.scale == 128.0 and ls.state()["event"] == "backoff" and ls.state()["found_inf"]
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_growth_after_growth_interval():
    scales, skips, _, ls = _run_loss_scaler(7, set(), init_scale=4.0, growth_interval=3)
    # growth after finite steps 3 and 6
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    assert not any(skips) and ls.growths == 2


def test_unscale_divides_gradients_exactly():
    model, x = _toy()
    ls = LossScaler("static", init_scale=8.0)
    ls.scale_loss((model(x) ** 2).mean()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    ls.unscale_(model.parameters())
    for s, p in zip(scaled, model.parameters()):
        assert torch.equal(p.grad, s / 8.0)  # 1/8 is exact in binary


def test_mode_none_skips_nonfinite_and_counts():
    scales, skips, _, ls = _run_loss_scaler(4, {1}, mode="none")
    assert skips == [False, True, False, False]
    assert scales == [1.0] * 4 and ls.skipped_steps == 1 and ls.backoffs == 0
    # static: the scale never moves, the bad step is still skipped
    scales, skips, _, ls = _run_loss_scaler(3, {0}, mode="static", init_scale=64.0)
    assert scales == [64.0] * 3 and skips == [True, False, False]


def test_bf16_gradients_are_checked_too():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    p.grad = torch.tensor([1.0, math.inf, 0.0], dtype=torch.bfloat16)
    ls = LossScaler("none")
    assert ls.unscale_([p]) is True and not ls.should_step()


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="loss_scaling: unknown mode 'auto'"):
        LossScaler("auto")


@pytest.mark.parametrize("scale_mode", ["none", "dynamic"])
def test_bf16_fallback_unscale_matches_fused_kernel(monkeypatch, scale_mode):
    # On CUDA, bf16 gradients (bf16-pure) take the foreach-norm path because the fused kernel has no
    # bf16 variant there; force that path on CPU and check it agrees with the fused kernel.
    import trainer.precision as P

    def grads(bad):
        g = [torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16), torch.tensor([4.0], dtype=torch.bfloat16)]
        if bad is not None:
            g[1][0] = bad
        return g

    for bad in (None, float("inf"), float("nan")):
        results = []
        for fused in (True, False):
            monkeypatch.setattr(P, "_fused_unscale_supported", lambda d, t, f=fused: f)
            s = P.LossScaler(scale_mode, init_scale=4.0)
            params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads(bad)]
            for p, g in zip(params, grads(bad)):
                p.grad = g
            found = s.unscale_(params)
            results.append((found, [p.grad.float().tolist() for p in params]))
        assert results[0][0] == results[1][0] == (bad is not None)
        if bad is None:
            assert results[0][1] == results[1][1]  # e.g. 1.5 / 4 = 0.375 in both
