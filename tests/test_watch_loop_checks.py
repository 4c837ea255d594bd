"""An own loop's precision mistakes that only its own calls show (`verlaudit.integrations.loop_checks`),
each planted in a way the blind bench does not (a decorator autocast, an unsupported dtype, fp16 and
bf16 round trips after training, an optimizer step bypassing the scaler, zero_grad between backward and
step), with the correct loop beside it that must stay clean. A two-layer model on the CPU, a few steps.
Run: `pytest tests/test_watch_loop_checks.py`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import verlaudit
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.rundir import read_run


def model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def data(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def kinds(path, severity=("warning", "error")):
    return sorted({f.kind for f in read_run(path).findings if f.severity in severity})


def run_loop(path, *, steps=3, precision=None, scaler=None, forward=None, step_fn=None, between=None):
    model, opt = model_and_opt()
    forward = forward or (lambda m, x: m(x))
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=path, precision=precision) as w:
        for i in range(steps):
            if between is not None:
                between(model, i)
            with w.phase("actor_update"):
                loss = forward(model, data(i)).float().pow(2).mean()
                if step_fn is not None:
                    step_fn(model, opt, scaler, loss)
                else:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            w.log({"actor/loss": loss})
    return model


# ---------------------------------------------------------------- autocast that does nothing


def test_an_autocast_decorator_for_cuda_on_a_cpu_model_is_named_with_its_line(tmp_path):
    @torch.autocast("cuda", dtype=torch.float16)  # a GPU recipe's decorator, run on the CPU
    def fwd(m, x):
        return m(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_loop(tmp_path / "run", forward=fwd, precision="fp32")
    (f,) = [f for f in read_run(tmp_path / "run").findings if f.kind == "loop/autocast_inactive"]
    assert f.observed["region"]["device"] == "cuda" and f.observed["tensors_on"] == "cpu"
    assert "test_watch_loop_checks.py" in f.where and "device_type='cpu'" in f.fix
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/autocast_inactive"


def test_an_autocast_torch_switched_off_for_its_dtype_is_named(tmp_path):
    def fwd(m, x):
        with torch.autocast("cpu", dtype=torch.float64):  # not a CPU autocast dtype: torch disables it
            return m(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_loop(tmp_path / "run", forward=fwd)
    (f,) = [f for f in read_run(tmp_path / "run").findings if f.kind == "loop/autocast_inactive"]
    assert f.observed["region"]["enabled"] is False and "switched it off" in f.message


def test_autocast_disabled_on_purpose_or_active_on_the_models_device_is_clean(tmp_path):
    def island(m, x):  # an fp32 island inside a bf16 region: enabled=False is the user's choice
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autocast("cpu", enabled=False):
                return m(x)

    def nested(m, x):  # a cuda region inside an active cpu one: the cpu one applies
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return m(x)

    for name, fwd in (("island", island), ("nested", nested), ("plain", None)):
        run_loop(tmp_path / name, forward=fwd)
        assert kinds(tmp_path / name) == [], name
    assert torch.autocast.__enter__.__module__ == "torch.amp.autocast_mode"  # the tap is off after exit


# ---------------------------------------------------------------- weights cast down and back up


@pytest.mark.parametrize(
    "down,up",
    [
        (lambda m: m.half(), lambda m: m.float()),
        (lambda m: m.to(torch.bfloat16), lambda m: m.to(dtype=torch.float32)),
    ],
    ids=["half-float", "to-bf16-to-fp32"],
)
def test_a_round_trip_of_the_trained_weights_after_an_update_is_an_error(tmp_path, down, up):
    def evaluate_in_low_precision(model, i):  # e.g. a cheap evaluation every other step
        if i == 2:
            down(model)
            with torch.no_grad():
                model(data(99).to(next(model.parameters()).dtype))
            up(model)

    run_loop(tmp_path / "run", precision="fp32", between=evaluate_in_low_precision)
    (f,) = [f for f in read_run(tmp_path / "run").findings if f.kind == "loop/weight_round_trip"]
    assert f.severity == "error" and f.observed["optimizer_steps_before"] == 2
    assert f.observed["low_exact_share"] == 1.0 and "test_watch_loop_checks.py:" in f.where
    assert "separate" in f.fix and "copy" in f.fix
    assert nn.Module._apply.__module__ == "torch.nn.modules.module"  # the cast tap is off after exit
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/weight_round_trip"


def test_a_low_precision_copy_and_a_device_move_are_no_round_trip(tmp_path):
    def generate_with_a_copy(model, i):
        fast = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():
            fast(data(i).bfloat16())
        model.to("cpu")

    run_loop(tmp_path / "run", precision="fp32", between=generate_with_a_copy)
    assert kinds(tmp_path / "run") == []


# ---------------------------------------------------------------- the GradScaler's order


def _scaled(model, opt, scaler, loss):
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_the_correct_fp16_scaler_loop_is_clean(tmp_path):
    def fwd(m, x):
        with torch.autocast("cpu", dtype=torch.float16):
            return m(x)

    run_loop(tmp_path / "run", forward=fwd, scaler=torch.amp.GradScaler("cpu"), step_fn=_scaled)
    assert kinds(tmp_path / "run") == []


def test_an_optimizer_step_that_bypasses_the_scaler_is_an_error(tmp_path):
    def bypass(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        opt.step()  # the gradients still carry the scale (no scaler.step / update)

    run_loop(tmp_path / "run", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0), step_fn=bypass)
    (f,) = [f for f in read_run(tmp_path / "run").findings if f.kind == "loop/scaler_bypassed"]
    assert f.severity == "error" and f.observed["loss_scale"] == 1024.0 and "scaler.step" in f.fix


def test_a_scaler_step_after_an_unscaled_backward_is_the_root_of_the_failure(tmp_path):
    def unscaled(model, opt, scaler, loss):
        opt.zero_grad()
        loss.backward()
        scaler.step(opt)
        scaler.update()

    with pytest.raises(AssertionError):
        run_loop(tmp_path / "run", scaler=torch.amp.GradScaler("cpu"), step_fn=unscaled)
    (d,) = diagnose_path(tmp_path / "run")
    first = d.causes[0]
    assert first.kind == "finding:loop/unscaled_backward", [c.title for c in d.causes]
    assert "scaler.scale(loss)" in first.fixes[0].why
    assert any(c.kind == "exception" and c.consequence_of == first.title for c in d.causes)


def test_fp16_autocast_without_a_scaler_and_zero_grad_after_backward_are_named(tmp_path):
    def fwd(m, x):
        with torch.autocast("cpu", dtype=torch.float16):
            return m(x)

    def late_zero_grad(model, opt, scaler, loss):
        loss.backward()
        opt.zero_grad()  # between backward and step: the step sees no gradient
        opt.step()

    run_loop(tmp_path / "fp16", forward=fwd)
    assert kinds(tmp_path / "fp16") == ["loop/fp16_no_scaler"]
    run_loop(tmp_path / "order", step_fn=late_zero_grad)
    assert kinds(tmp_path / "order") == ["loop/step_without_grads"]


def test_a_declared_fp32_contract_run_under_bf16_autocast_is_named_and_a_declared_bf16_one_is_clean(tmp_path):
    def fwd(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x)

    run_loop(tmp_path / "fp32", forward=fwd, precision="fp32")
    (f,) = [f for f in read_run(tmp_path / "fp32").findings if f.kind == "loop/compute_below_contract"]
    assert f.observed == {"output_dtype": "bf16", "param_dtype": "fp32"} and "precision='bf16'" in f.fix
    run_loop(tmp_path / "bf16", forward=fwd, precision="bf16")
    assert kinds(tmp_path / "bf16") == []
