"""An own loop's protocol, cadence, graph and direction (`verlaudit.integrations.loop_protocol`,
`loop_direction`, `loop_calls`), each planted in a tiny loop of its own, beside the correct loop that must
stay clean: clip before ``unscale_``, a GradScaler never updated, a scheduler stepped per micro-batch,
``zero_grad(set_to_none=False)`` between backward and step, a backward on a loss without a graph (the
rollout's no-grad log-probs, or detached ones), a log-softmax in bf16, and a policy-gradient loss whose sign
is flipped. Run: `pytest tests/test_loop_protocol.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import verlaudit
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.integrations import loop_calls
from verlaudit.rundir import read_run

VOCAB, PROMPT, LENGTH, ROWS = 12, 4, 10, 8


def kinds(path, severity=("warning", "error")):
    return sorted({f.kind for f in read_run(path).findings if f.severity in severity})


def found(path, kind):
    return [f for f in read_run(path).findings if f.kind == kind]


def mlp_and_opt(seed=0, lr=1e-3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def x(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


class TinyLM(nn.Module):
    """A causal LM small enough for a test: embeddings, a running mean over the prefix, a head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
        return self.head(torch.tanh(h.cumsum(1) / steps))


def sequences(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)


def token_logp(logits, seq):
    return logits[:, PROMPT - 1 : -1].float().log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def pg_loop(path, *, sign=-1.0, steps=4, cast=None, precision="fp32"):
    """REINFORCE with a batch-mean baseline on fixed sequences; the reward counts the response's 3s."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with verlaudit.watch(model, opt, out_dir=path, precision=precision) as w:
        for step in range(steps):
            seq = sequences(step)
            w.batch(
                {"input_ids": seq[:, :PROMPT], "attention_mask": torch.ones(ROWS, PROMPT, dtype=torch.long)}
            )
            rewards = w.reward((seq[:, PROMPT:] == 3).float().mean(-1) + 0.1 * torch.arange(ROWS) / ROWS)
            with w.phase("actor_update"):
                logits = model(input_ids=seq, attention_mask=torch.ones_like(seq))
                if cast is not None:
                    lp = logits[:, PROMPT - 1 : -1].to(cast).log_softmax(-1)
                    logp = lp.gather(-1, seq[:, PROMPT:, None]).squeeze(-1).float()
                else:
                    logp = token_logp(logits, seq)
                adv = rewards - rewards.mean()
                loss = sign * (adv[:, None] * logp).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            w.log({"actor/loss": loss})


# ---------------------------------------------------------------- the GradScaler's protocol


def scaler_loop(path, step_fn, *, steps=3):
    model, opt = mlp_and_opt(lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=path, precision="fp16") as w:
        for i in range(steps):
            with w.phase("actor_update"):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x(i)).float().pow(2).mean()
                step_fn(model, opt, scaler, loss)
            w.log({"actor/loss": loss})


def test_clipping_before_unscale_is_an_error_and_clipping_after_it_is_clean(tmp_path):
    def clip_scaled(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still x65536
        scaler.step(opt)
        scaler.update()

    def clip_unscaled(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()

    scaler_loop(tmp_path / "bad", clip_scaled)
    (f,) = found(tmp_path / "bad", "loop/clip_scaled_grads")
    assert f.severity == "error" and f.observed["loss_scale"] == 65536.0 and f.observed["limit"] == 1.0
    assert "test_loop_protocol.py:" in f.where and "scaler.unscale_(optimizer) before" in f.fix
    (d,) = diagnose_path(tmp_path / "bad")
    assert d.causes[0].kind == "finding:loop/clip_scaled_grads"
    scaler_loop(tmp_path / "good", clip_unscaled)
    assert kinds(tmp_path / "good") == []
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # the taps are off


def test_a_scaler_never_updated_is_the_root_of_torchs_refusal(tmp_path):
    def no_update(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)

    with pytest.raises(RuntimeError):
        scaler_loop(tmp_path / "run", no_update)
    (f,) = found(tmp_path / "run", "loop/scaler_not_updated")
    assert f.severity == "error" and "scaler.update()" in f.fix and f.observed["previous_step"]
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/scaler_not_updated", [c.title for c in d.causes]
    assert any(c.kind == "exception" and c.consequence_of == d.causes[0].title for c in d.causes)


def test_a_single_scaler_step_with_no_update_is_named_at_the_end(tmp_path):
    def no_update(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)

    scaler_loop(tmp_path / "run", no_update, steps=1)
    (f,) = found(tmp_path / "run", "loop/scaler_not_updated")
    assert "never called" in f.message


# ---------------------------------------------------------------- the cadence


def accumulation_loop(path, *, per_micro, micro=4, steps=3, chained=False):
    model, opt = mlp_and_opt()
    total = steps
    if chained:
        sched = torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - k / total)),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
            ]
        )
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - k / total))
    with verlaudit.watch(model, opt, out_dir=path, precision="fp32") as w:
        for i in range(steps):
            with w.phase("actor_update"):
                opt.zero_grad()
                for k in range(micro):
                    (model(x(10 * i + k)).pow(2).mean() / micro).backward()
                    if per_micro:
                        sched.step()
                opt.step()
                if not per_micro:
                    sched.step()
            w.log({"actor/loss": 0.0})


def test_a_scheduler_stepped_per_micro_batch_is_an_error_naming_its_line(tmp_path):
    accumulation_loop(tmp_path / "bad", per_micro=True)
    (f,) = found(tmp_path / "bad", "loop/scheduler_cadence")
    assert f.severity == "error" and f.observed["scheduler_steps_per_optimizer_step"] == 4
    assert f.observed["backwards"] == 4 and f.observed["lr"] == 0.0
    assert "test_loop_protocol.py:" in f.where and "once per optimizer step" in f.fix
    (d,) = diagnose_path(tmp_path / "bad")
    assert d.causes[0].kind == "finding:loop/scheduler_cadence", [c.title for c in d.causes]


def test_a_scheduler_stepped_per_optimizer_step_and_a_chained_one_are_clean(tmp_path):
    accumulation_loop(tmp_path / "good", per_micro=False)
    accumulation_loop(tmp_path / "chained", per_micro=False, chained=True)
    assert kinds(tmp_path / "good") == [] and kinds(tmp_path / "chained") == []


def test_zero_grad_keeping_zeros_between_backward_and_step_is_an_error_naming_the_zero_grad(tmp_path):
    model, opt = mlp_and_opt()
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", precision="fp32") as w:
        for i in range(3):
            with w.phase("actor_update"):
                model(x(i)).pow(2).mean().backward()
                opt.zero_grad(set_to_none=False)  # zeros, not None: the step finds "gradients"
                opt.step()
    (f,) = found(tmp_path / "run", "loop/step_without_grads")
    assert f.severity == "error" and "test_loop_protocol.py:" in f.observed["zero_grad_after_backward"]
    assert "before loss.backward()" in f.fix
    assert torch.optim.Optimizer.zero_grad.__module__ == "torch.optim.optimizer"  # the tap is off


# ---------------------------------------------------------------- the graph


def test_a_loss_built_from_the_rollouts_no_grad_log_probs_is_named_before_torch_refuses_it(tmp_path):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError), verlaudit.watch(model, opt, out_dir=tmp_path / "run") as w:
        seq = sequences(0)
        with w.phase("rollout"), torch.no_grad():
            old_logp = token_logp(model(input_ids=seq), seq)  # the rollout's
        rewards = w.reward((seq[:, PROMPT:] == 3).float().mean(-1))
        with w.phase("actor_update"):
            loss = -((rewards - rewards.mean())[:, None] * old_logp).mean()
            opt.zero_grad()
            loss.backward()
    (f,) = found(tmp_path / "run", "loop/loss_without_graph")
    assert f.observed["grad_forwards_since_step"] == 0 and "rollout" in f.message
    assert "recompute the log-probs with a forward of the policy" in f.fix
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/loss_without_graph", [c.title for c in d.causes]


def test_a_loss_detached_from_a_forward_with_gradients_is_named_as_detached(tmp_path):
    model, opt = mlp_and_opt()
    with pytest.raises(RuntimeError), verlaudit.watch(model, opt, out_dir=tmp_path / "run") as w:
        with w.phase("actor_update"):
            loss = model(x(0)).pow(2).mean().detach()
            loss.backward()
    (f,) = found(tmp_path / "run", "loop/loss_without_graph")
    assert f.observed["grad_forwards_since_step"] == 1 and "detached" in f.message


# ---------------------------------------------------------------- log-probs in low precision


def test_log_probs_taken_from_bf16_logits_are_named_with_their_line_and_fp32_ones_are_clean(tmp_path):
    pg_loop(tmp_path / "bf16", cast=torch.bfloat16, steps=2)
    (f,) = found(tmp_path / "bf16", "loop/logprobs_low_precision")
    assert f.observed["output_dtype"] == "bf16" and "test_loop_protocol.py:" in f.where
    assert "float()" in f.fix
    pg_loop(tmp_path / "fp32", steps=2)
    assert kinds(tmp_path / "fp32") == []
    assert "log_softmax" not in vars(torch.Tensor)  # the tap is off after the block


def test_a_low_precision_log_softmax_inside_the_models_forward_or_a_library_is_not_the_loops(tmp_path):
    class Bf16Head(TinyLM):
        def forward(self, input_ids, attention_mask=None):
            return super().forward(input_ids).bfloat16().log_softmax(-1).float()

    model = Bf16Head()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", precision="fp32") as w:
        with w.phase("actor_update"):
            seq = sequences(0)
            loss = (
                -model(input_ids=seq).mean()
                - torch.nn.functional.log_softmax(torch.randn(2, 3).bfloat16(), -1).float().mean() * 0
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    # the forward's own log_softmax is the model's (dtype checks see it); F.log_softmax's inner method call
    # is torch's; only the call this test made itself counts
    (f,) = found(tmp_path / "run", "loop/logprobs_low_precision")
    assert f.observed["shape"] == [2, 3]


# ---------------------------------------------------------------- the direction of the update


def test_a_flipped_policy_gradient_sign_is_an_error_and_the_correct_loss_is_clean(tmp_path):
    pg_loop(tmp_path / "flipped", sign=+1.0)
    (f,) = found(tmp_path / "flipped", "loop/update_against_advantage")
    assert f.severity == "error" and all(s < 0 for s in f.observed["sum_adv_dlogp"])
    assert f.observed["steps"] >= 2 and "test_loop_protocol.py:" in f.where and "-(advantages" in f.fix
    (d,) = diagnose_path(tmp_path / "flipped")
    assert d.causes[0].kind == "finding:loop/update_against_advantage"
    pg_loop(tmp_path / "correct", sign=-1.0)
    assert kinds(tmp_path / "correct") == []
    assert not loop_calls._LISTENERS and torch.Tensor.backward.__module__ == "torch._tensor"


def test_unscale_twice_and_model_zero_grad_after_backward_are_named(tmp_path):
    def twice(model, opt, scaler, loss):
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.unscale_(opt)  # e.g. once in a clipping helper, once in the loop
        scaler.step(opt)
        scaler.update()

    with pytest.raises(RuntimeError):
        scaler_loop(tmp_path / "twice", twice)
    (d,) = diagnose_path(tmp_path / "twice")
    assert d.causes[0].kind == "finding:loop/unscale_twice", [c.title for c in d.causes]
    model, opt = mlp_and_opt()
    with verlaudit.watch(model, opt, out_dir=tmp_path / "order", precision="fp32") as w:
        with w.phase("actor_update"):
            model(x(0)).pow(2).mean().backward()
            model.zero_grad()  # the model's, not the optimizer's: the same gradients
            opt.step()
    (f,) = found(tmp_path / "order", "loop/step_without_grads")
    assert f.severity == "error" and nn.Module.zero_grad.__module__ == "torch.nn.modules.module"


def test_the_advantages_the_loop_passes_are_what_the_direction_is_measured_against(tmp_path):
    """A loop whose ``w.reward`` gets costs (lower is better) and whose advantage is minus the centred
    cost: correct, and clean once it passes its advantages; measured against the rewards it is not."""

    def run(path, pass_adv):
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with verlaudit.watch(model, opt, out_dir=path, precision="fp32") as w:
            for step in range(4):
                seq = sequences(step)
                w.batch({"input_ids": seq[:, :PROMPT]})
                cost = w.reward((seq[:, PROMPT:] != 3).float().mean(-1) + 0.1 * torch.arange(ROWS) / ROWS)
                with w.phase("actor_update"):
                    logp = token_logp(model(input_ids=seq), seq)
                    adv = -(cost - cost.mean())
                    loss = -(adv[:, None] * logp).mean()
                    w.loss(loss, **({"advantages": adv} if pass_adv else {}))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

    run(tmp_path / "passed", True)
    assert kinds(tmp_path / "passed") == []
    run(tmp_path / "rewards", False)
    assert kinds(tmp_path / "rewards") == ["loop/update_against_advantage"]


def test_gradients_never_cleared_between_steps_are_an_error_and_a_manual_clear_is_clean(tmp_path):
    def run(path, clear):
        model, opt = mlp_and_opt()
        with verlaudit.watch(model, opt, out_dir=path, precision="fp32") as w:
            for i in range(3):
                with w.phase("actor_update"):
                    model(x(i)).pow(2).mean().backward()
                    opt.step()
                    if clear:
                        for p in model.parameters():
                            p.grad = None

    run(tmp_path / "never", clear=False)
    (f,) = found(tmp_path / "never", "loop/grads_not_cleared")
    assert f.severity == "error" and f.step == 1 and "zero_grad()" in f.fix
    (d,) = diagnose_path(tmp_path / "never")
    assert d.causes[0].kind == "finding:loop/grads_not_cleared"
    run(tmp_path / "manual", clear=True)
    assert kinds(tmp_path / "manual") == []


def test_an_optimizer_built_on_another_model_is_an_error_at_entry_and_a_partial_one_only_info(tmp_path):
    model, _ = mlp_and_opt()
    other, opt = mlp_and_opt(seed=1)  # e.g. built before the model was re-created
    with verlaudit.watch(model, opt, out_dir=tmp_path / "other", precision="fp32") as w:
        with w.phase("actor_update"):
            opt.zero_grad()
            model(x(0)).pow(2).mean().backward()
            opt.step()
    assert "loop/step_without_grads" not in kinds(tmp_path / "other")  # one finding for one fault
    (f,) = found(tmp_path / "other", "loop/optimizer_params")
    assert f.severity == "error" and f.step is None and f.observed["missing_share"] == 1.0
    (d,) = diagnose_path(tmp_path / "other")
    assert d.causes[0].kind == "finding:loop/optimizer_params", [c.title for c in d.causes]
    model, _ = mlp_and_opt()
    opt = torch.optim.SGD(model[0].parameters(), lr=1e-3)  # the last layer left out on purpose
    with verlaudit.watch(model, opt, out_dir=tmp_path / "part", precision="fp32") as w:
        with w.phase("actor_update"):
            opt.zero_grad()
            model(x(0)).pow(2).mean().backward()
            opt.step()
    assert kinds(tmp_path / "part", ("info",)) == ["loop/optimizer_params"]
    # loopg: the left-out layer still gets gradients (never cleared, never applied): a warning naming it
    (f,) = found(tmp_path / "part", "loop/params_outside_optimizer")
    assert f.severity == "warning" and f.observed["parameters"] == ["2.weight", "2.bias"]
    assert kinds(tmp_path / "part") == ["loop/params_outside_optimizer"]


def test_zero_grad_inside_the_accumulation_loop_is_an_error_counting_the_lost_micro_batches(tmp_path):
    model, opt = mlp_and_opt()
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", precision="fp32") as w:
        for i in range(2):
            with w.phase("actor_update"):
                for k in range(4):
                    opt.zero_grad()  # meant once per step, written once per micro-batch
                    (model(x(10 * i + k)).pow(2).mean() / 4).backward()
                opt.step()
    (f,) = found(tmp_path / "run", "loop/zero_grad_in_accumulation")
    assert f.severity == "error" and f.observed == {"backwards_discarded": 3, "backwards_applied": 1}
    assert "out of the micro-batch loop" in f.fix
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/zero_grad_in_accumulation"
