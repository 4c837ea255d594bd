"""An own loop that scales its loss more than once (`verlaudit.integrations.loop_scale`,
``loop/loss_scaled_twice``): a helper handed the scaled loss, a rescale of a sum over scaled micro-batch
losses, a scaled loss scaled again after a multiplication; each named at the second ``scaler.scale`` line
with the first one and the factor scale^2, and rooted above the loss-scale collapse it causes. One scale per
micro-batch (accumulation), one per loss of two models, and the plain loop stay clean. Run:
`pytest tests/test_loop_scale.py`."""

from __future__ import annotations

from tests.test_loop_protocol import found, kinds, scaler_loop
from verlaudit.analysis.diagnose.diagnosis import diagnose_path

KIND = "loop/loss_scaled_twice"


def _helper(scaler, loss):
    scaler.scale(loss).backward()  # the team's helper: scale, then backward


def handed_scaled(model, opt, scaler, loss):
    opt.zero_grad()
    _helper(scaler, scaler.scale(loss))
    scaler.step(opt)
    scaler.update()


def rescaled_sum(model, opt, scaler, loss):
    opt.zero_grad()
    parts = [scaler.scale(loss * 0.5), scaler.scale(loss * 0.5)]
    scaler.scale(sum(parts)).backward()  # the micro-batches were already scaled
    scaler.step(opt)
    scaler.update()


def scaled_times(model, opt, scaler, loss):
    opt.zero_grad()
    scaled = scaler.scale(loss)
    scaler.scale(scaled * 2.0).backward()
    scaler.step(opt)
    scaler.update()


def test_each_double_scaling_is_named_at_its_second_scale_line_and_heads_the_diagnosis(tmp_path):
    for fn, text in (
        (handed_scaled, "_helper"),
        (rescaled_sum, "rescaled_sum"),
        (scaled_times, "scaled_times"),
    ):
        path = tmp_path / fn.__name__
        scaler_loop(path, fn, steps=4)
        (f,) = found(path, KIND)
        assert f.severity == "error" and text in f.where and "test_loop_scale.py:" in f.where
        assert f.observed["gradient_factor"] == 65536.0**2 and f.observed["first_scale_at"]
        assert f.fix.startswith("scale once")
        (d,) = diagnose_path(path)
        assert d.causes[0].kind == f"finding:{KIND}", [c.kind for c in d.causes[:3]]


def accumulate(model, opt, scaler, loss):
    opt.zero_grad()
    for part in (loss * 0.5, loss * 0.5):
        scaler.scale(part).backward(retain_graph=True)
    scaler.step(opt)
    scaler.update()


def plain(model, opt, scaler, loss):
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_one_scale_per_micro_batch_or_per_step_is_clean(tmp_path):
    for fn in (accumulate, plain):
        scaler_loop(tmp_path / fn.__name__, fn)
        assert found(tmp_path / fn.__name__, KIND) == []
        assert kinds(tmp_path / fn.__name__) == []
