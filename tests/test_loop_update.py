"""Whether an own loop's optimizer step is the update of its loss (`verlaudit.integrations.loop_update`): a
clip after the step, gradients scaled in place after it, an output head replaced after the optimizer was
built (tied, and untied with the old tensor left in the optimizer), each in a tiny loop of its own, beside
correct loops that must stay clean (clipped before the step, accumulated, a GradScaler in fp16, a frozen
base with a trained adapter). Run: `pytest tests/test_loop_update.py`."""

from __future__ import annotations

import torch
from torch import nn

import verlaudit
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.rundir import read_run

VOCAB = 12


def kinds(path, severity=("warning", "error")):
    return sorted({f.kind for f in read_run(path).findings if f.severity in severity})


def found(path, kind):
    return [f for f in read_run(path).findings if f.kind == kind]


class TinyLM(nn.Module):
    def __init__(self, seed=0, tied=True):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.mid, self.head = (
            nn.Embedding(VOCAB, 16),
            nn.Linear(16, 16),
            nn.Linear(16, VOCAB, bias=False),
        )
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.mid(self.emb(input_ids))))


def ids(step):
    return torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(step))


def loss_of(model, step):
    x = ids(step)
    return model(x)[:, :-1].float().log_softmax(-1).gather(-1, x[:, 1:, None]).mean().neg()


def loop(path, step_fn, *, model=None, opt=None, steps=3, scaler=None, precision="fp32", before=None):
    model = model or TinyLM()
    opt = opt or torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    if before is not None:
        before(model, opt)
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=path, precision=precision) as w:
        for i in range(steps):
            with w.phase("actor_update"):
                loss = step_fn(model, opt, i)
            w.log({"actor/loss": loss})
    return model


def clip_after(model, opt, i):
    opt.zero_grad()
    loss = loss_of(model, i)
    loss.backward()
    opt.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # meant to bound the step above
    return loss


def clip_before(model, opt, i):
    opt.zero_grad()
    loss = loss_of(model, i)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    opt.step()
    return loss


def test_a_clip_after_the_step_is_an_error_naming_its_line_and_one_before_it_is_clean(tmp_path):
    loop(tmp_path / "after", clip_after)
    (f,) = found(tmp_path / "after", "loop/grads_after_step")
    assert f.severity == "error" and "test_loop_update.py" in f.where and "clip_grad_norm_" in f.where
    assert f.observed["grad_norm_at_step"] > 0.01 and abs(f.observed["grad_norm_after_clip"] - 0.01) < 1e-4
    assert "before the step" in f.fix and "loop/clip_before_backward" not in kinds(tmp_path / "after")
    (d,) = diagnose_path(tmp_path / "after")
    assert d.causes[0].kind == "finding:loop/grads_after_step", [c.title for c in d.causes]
    loop(tmp_path / "before", clip_before)
    assert kinds(tmp_path / "before") == []


def test_a_clip_after_a_first_step_without_gradients_is_still_a_clip_after_the_step(tmp_path):
    def first_zero(model, opt, i):  # step 0's loss is constant (no gradient), as when every reward ties
        opt.zero_grad()
        loss = loss_of(model, i) * (i > 0)
        loss.backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        return loss

    loop(tmp_path / "run", first_zero)
    assert kinds(tmp_path / "run") == ["loop/grads_after_step"]
    (f,) = found(tmp_path / "run", "loop/grads_after_step")
    assert f.severity == "error"


def test_a_clip_after_the_step_that_changed_nothing_is_still_out_of_order(tmp_path):
    def loose(model, opt, i):
        opt.zero_grad()
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        return loss

    loop(tmp_path / "run", loose)
    (f,) = found(tmp_path / "run", "loop/grads_after_step")
    assert f.severity == "warning" and f.observed["tensors_changed"] == 0 and "changed nothing" in f.message


def test_a_clip_before_the_backward_is_out_of_order_and_a_clip_per_micro_batch_is_not(tmp_path):
    def clip_first(model, opt, i):
        opt.zero_grad()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # on last step's cleared gradients
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        return loss

    def clip_each(model, opt, i):
        opt.zero_grad()
        for k in range(2):
            (loss_of(model, 10 * i + k) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the last one follows the last backward
        opt.step()
        return loss_of(model, i).detach()

    loop(tmp_path / "first", clip_first)
    (f,) = found(tmp_path / "first", "loop/clip_before_backward")
    assert f.observed["backwards_after_clip"] == 1 and "clip_grad_norm_" in f.where
    assert "loop/grads_after_step" not in kinds(tmp_path / "first")
    loop(tmp_path / "each", clip_each)
    assert kinds(tmp_path / "each") == []


def test_a_second_step_on_the_same_gradients_is_an_error_and_a_closure_step_is_not(tmp_path):
    def twice(model, opt, i):
        opt.zero_grad()
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.step()  # e.g. a step in the loop body and another in a helper it calls
        return loss

    loop(tmp_path / "twice", twice)
    (f,) = found(tmp_path / "twice", "loop/step_repeated")
    assert f.severity == "error" and "test_loop_update.py" in f.where
    model = TinyLM()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)

    def closure_step(model, opt, i):
        def closure():
            opt.zero_grad()
            loss = loss_of(model, i)
            loss.backward()
            return loss

        return opt.step(closure)

    loop(tmp_path / "lbfgs", closure_step, model=model, opt=lbfgs)
    assert kinds(tmp_path / "lbfgs") == []


def test_gradients_scaled_in_place_after_the_step_are_named_by_the_step(tmp_path):
    def scale_after(model, opt, i):
        opt.zero_grad()
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        for p in model.parameters():  # a "normalisation" written after the step
            p.grad.mul_(0.5)
        return loss

    loop(tmp_path / "run", scale_after)
    (f,) = found(tmp_path / "run", "loop/grads_after_step")
    assert f.severity == "error" and f.observed["tensors_changed"] == f.observed["tensors"]
    assert "optimizer.step" in f.where and "before optimizer.step()" in f.fix


def test_correct_loops_stay_clean(tmp_path):
    def accumulate(model, opt, i):
        opt.zero_grad()
        for k in range(2):
            (loss_of(model, 10 * i + k) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss_of(model, i).detach()

    def step_then_clear(model, opt, i):
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    def clear_by_hand(model, opt, i):
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        for p in model.parameters():  # cleared in place, not through zero_grad
            p.grad.zero_()
        return loss

    loop(tmp_path / "by_hand", clear_by_hand)
    loop(tmp_path / "accumulate", accumulate)
    loop(tmp_path / "clear_after", step_then_clear)
    scaler = torch.amp.GradScaler("cpu")

    def fp16(model, opt, i):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, i)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    loop(tmp_path / "fp16", fp16, scaler=scaler, precision="fp16")
    base = TinyLM()
    for p in base.parameters():
        p.requires_grad_(False)
    base.mid.bias.requires_grad_(True)  # the one trained part, as with an adapter
    loop(tmp_path / "adapter", clip_before, model=base)
    for name in ("by_hand", "accumulate", "clear_after", "fp16", "adapter"):
        assert kinds(tmp_path / name) == [], name


def replace_head(model, opt):
    new = nn.Linear(16, VOCAB, bias=False)
    with torch.no_grad():
        new.weight.copy_(model.head.weight)
    model.head = new


def test_a_head_replaced_after_the_optimizer_is_named_and_its_uncleared_gradients_are_not_the_root(tmp_path):
    def plain(model, opt, i):
        opt.zero_grad()
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        return loss

    model = loop(
        tmp_path / "tied", plain, before=replace_head
    )  # the old head was the embedding: no stale tensor
    (f,) = found(tmp_path / "tied", "loop/params_outside_optimizer")
    assert (
        f.observed["parameters"] == ["head.weight"] and "head" in f.where and "after replacing head" in f.fix
    )
    assert f.severity == "warning" and "loop/grads_not_cleared" not in kinds(tmp_path / "tied")
    assert model.head.weight.grad is not None  # it got gradients, and the optimizer never saw them
    (d,) = diagnose_path(tmp_path / "tied")
    assert d.causes[0].kind == "finding:loop/params_outside_optimizer", [c.title for c in d.causes]
    loop(tmp_path / "untied", plain, model=TinyLM(tied=False), before=replace_head)
    (f,) = found(tmp_path / "untied", "loop/params_outside_optimizer")
    assert f.severity == "error" and f.observed["stale_optimizer_tensors"] == 1
    assert "loop/optimizer_stale_params" not in kinds(tmp_path / "untied")  # one fault, one finding

    def frozen_head(model, opt):  # the replacement frozen: only the old tensor in the optimizer tells
        replace_head(model, opt)
        model.head.weight.requires_grad_(False)

    loop(tmp_path / "stale", plain, model=TinyLM(tied=False), before=frozen_head)
    (f,) = found(tmp_path / "stale", "loop/optimizer_stale_params")
    assert f.severity == "warning" and f.observed["stale_tensors"] == 1


def test_without_the_update_audit_a_replaced_head_is_only_a_symptom(tmp_path, monkeypatch):
    from verlaudit.integrations import loop_update

    monkeypatch.setattr(loop_update.UpdateAudit, "before_step", lambda *a, **k: None)
    monkeypatch.setattr(loop_update.UpdateAudit, "after_step", lambda *a, **k: None)
    loop(tmp_path / "run", clip_after, model=TinyLM(tied=False), before=replace_head)
    assert "loop/params_outside_optimizer" not in kinds(tmp_path / "run")
    assert "loop/grads_after_step" not in kinds(tmp_path / "run")
