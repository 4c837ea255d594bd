"""The roles of an own loop keep their relations across steps (`verlaudit.integrations.loop_roles`): each
relation broken in several ways on a tiny Llama (or a tiny LM) under `verlaudit.watch`, beside the correct
loop that must stay clean. Versions: a sampling copy never synced, synced from the initial state dict,
synced for one tensor only (a bf16 copy synced every step, and one synced every other step, are clean).
Identity and state: a new AdamW per step, ``state.clear()``, ``load_state_dict`` of the first state, a
scheduler and a GradScaler built per step. The sampler's temperature in the loss: sampled at 0.6 and read
at 1, sampled at 1 and read at 0.7, sampled at the model's generation_config temperature. Graph hygiene:
sequences, a mask and advantages made under inference mode; a KL reward, a std-normalised shaped reward and
a log-prob baseline that carry the graph (their detached versions, and a PPO-clip loss, are clean).
Run: `pytest tests/test_loop_roles.py`."""

from __future__ import annotations

import copy

import pytest
import torch

import verlaudit
from verlaudit.rundir import read_run

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, ROWS, STEPS = 32, 5, 6, 6, 4


def kinds(path):
    return sorted({f.kind for f in read_run(path).findings if f.severity in ("warning", "error")})


def found(path, kind):
    return [f for f in read_run(path).findings if f.kind == kind]


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits with some spread, as a trained model's
        m.lm_head.weight.mul_(40.0)
    return m


def prompts(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(3, VOCAB, (ROWS, PROMPT), generator=g)


def sample(model, ids, step, temperature=1.0, **kw):
    torch.manual_seed(1000 + step)
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
            do_sample=True, temperature=temperature, top_k=0, pad_token_id=0, eos_token_id=2, **kw,
        )  # fmt: skip


def logp_of(model, seq, temperature=1.0):
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits
    lp = (logits[:, PROMPT - 1 : -1].float() / temperature).log_softmax(-1)
    return lp.gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def rewards_of(seq):
    return (seq[:, PROMPT:] % 3 == 0).float().mean(-1) + 0.01 * torch.arange(seq.shape[0])


def rl_loop(path, *, sampler=None, before_step=None, make_opt=None, per_step=None, gen_t=1.0, loss_t=1.0,
            loss_fn=None, steps=STEPS, rollout_mode=torch.no_grad, lr=3e-2):  # fmt: skip
    """REINFORCE with a batch-mean baseline on a tiny Llama. ``sampler(model, state)`` gives the model that
    generates; ``before_step(model, opt, state)`` runs before each update; ``make_opt`` builds the optimizer
    (or ``per_step`` a new one each step); ``loss_fn(model, seq, rewards)`` replaces the loss."""
    model = llama()
    opt = (make_opt or (lambda m: torch.optim.AdamW(m.parameters(), lr=lr)))(model)
    state = {"init": copy.deepcopy(model.state_dict()), "opt0": None}
    with verlaudit.watch(model, opt, out_dir=path, precision="fp32") as w:
        for step in range(steps):
            gen = sampler(model, state) if sampler else model
            with rollout_mode():
                seq = sample(gen, prompts(step), step, temperature=gen_t)
            if rollout_mode is torch.inference_mode:
                seq = seq.clone() if state.get("clone") else seq
            r = w.reward(rewards_of(seq))
            if per_step is not None:
                opt = per_step(model)
            if before_step is not None:
                before_step(model, opt, state)
            with w.phase("actor_update"):
                if loss_fn is not None:
                    loss = loss_fn(model, seq, r)
                else:
                    loss = -((r - r.mean())[:, None] * logp_of(model, seq, loss_t)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return path


# ---------------------------------------------------------------- versions: the sampler's weights


def _once(model, state):
    if "copy" not in state:
        state["copy"] = copy.deepcopy(model).eval()
    return state["copy"]


def _synced(dtype=None, every=1):
    def sampler(model, state):
        if "copy" not in state:
            state["copy"] = copy.deepcopy(model).eval().to(dtype or torch.float32)
            state["n"] = 0
        state["n"] += 1
        if (state["n"] - 1) % every == 0:
            state["copy"].load_state_dict(model.state_dict())
        return state["copy"]

    return sampler


def _from_initial(model, state):
    gen = _once(model, state)
    gen.load_state_dict(state["init"])  # "synced" every step, from the state dict saved before the loop
    return gen


def _head_only(model, state):
    gen = _once(model, state)
    with torch.no_grad():
        gen.lm_head.weight.copy_(model.lm_head.weight)  # the sync forgot every tensor but the head
    return gen


@pytest.mark.parametrize("sampler", [_once, _from_initial, _head_only], ids=["never", "initial", "head_only"])
def test_a_sampling_copy_that_lags_the_policy_is_stale(tmp_path, sampler):
    path = rl_loop(tmp_path / "run", sampler=sampler)
    (f,) = found(path, "loop/stale_sampler")
    assert f.severity == "error" and "sync" in f.fix and "test_loop_roles.py" in f.where
    assert f.observed["stale_tensors"] >= (10 if sampler is not _head_only else 5)
    if sampler is _head_only:
        assert "lm_head" not in f.message


@pytest.mark.parametrize(
    "sampler",
    [None, _synced(), _synced(torch.bfloat16), _synced(every=2)],
    ids=["policy", "synced", "bf16", "every2"],
)
def test_a_sampler_in_step_with_the_policy_is_clean(tmp_path, sampler):
    path = rl_loop(tmp_path / "run", sampler=sampler)
    assert "loop/stale_sampler" not in kinds(path)


# ---------------------------------------------------------------- identity and state: the optimizer's


def test_a_new_optimizer_each_step_restarts_its_state(tmp_path):
    path = rl_loop(tmp_path / "run", per_step=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    (f,) = found(path, "loop/optimizer_recreated")
    assert f.observed["how"] == "new" and "test_loop_roles.py" in f.where and "once" in f.fix


def test_an_optimizer_state_cleared_or_reloaded_each_step_restarts(tmp_path):
    path = rl_loop(tmp_path / "clear", before_step=lambda m, o, s: o.state.clear())
    (f,) = found(path, "loop/optimizer_recreated")
    assert f.observed["how"] == "cleared"

    def reload(model, opt, state):
        if state["opt0"] is None:
            state["opt0"] = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(state["opt0"])

    path = rl_loop(tmp_path / "reload", before_step=reload, steps=5)
    (f,) = found(path, "loop/optimizer_recreated")
    assert f.observed["how"] == "loaded" and "test_loop_roles.py" in f.where


def test_schedulers_and_scalers_built_per_step_restart(tmp_path):
    def sched(model, opt, state):
        state["s"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))

    path = rl_loop(tmp_path / "sched", before_step=sched)
    (f,) = found(path, "loop/scheduler_recreated")
    assert f.observed["built"] >= 2 and "once" in f.fix

    def scaler(model, opt, state):
        state["scaler"] = torch.amp.GradScaler("cpu")

    path = rl_loop(tmp_path / "scaler", before_step=scaler)
    assert found(path, "loop/scaler_recreated")


def test_a_correct_loop_with_one_optimizer_scheduler_and_sgd_per_step_is_clean(tmp_path):
    path = rl_loop(tmp_path / "ok")
    assert kinds(path) == []
    # plain SGD keeps no state: building it per step changes nothing
    path = rl_loop(tmp_path / "sgd", per_step=lambda m: torch.optim.SGD(m.parameters(), lr=1e-2))
    assert "loop/optimizer_recreated" not in kinds(path)


# ---------------------------------------------------------------- the sampler's temperature in the loss


@pytest.mark.parametrize("gen_t,loss_t", [(0.6, 1.0), (1.0, 0.7), (1.5, 1.0)])
def test_a_loss_at_another_temperature_than_the_sampler_is_named(tmp_path, gen_t, loss_t):
    path = rl_loop(tmp_path / "run", gen_t=gen_t, loss_t=loss_t, steps=2)
    (f,) = found(path, "loop/temperature_mismatch")
    assert f.observed["sampling_temperature"] == gen_t
    assert f.observed["loss_temperature"] == pytest.approx(loss_t, rel=0.05)
    assert "temperature" in f.fix


def test_the_generation_config_temperature_counts(tmp_path):
    def sampler(model, state):
        model.generation_config.temperature = 0.5
        return model

    def no_kwarg(model, ids, step, temperature=None, **kw):
        torch.manual_seed(step)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=True, top_k=0, pad_token_id=0, eos_token_id=2)  # fmt: skip

    global sample
    saved, sample = sample, no_kwarg
    try:
        path = rl_loop(tmp_path / "run", sampler=sampler, steps=2)
    finally:
        sample = saved
    (f,) = found(path, "loop/temperature_mismatch")
    assert f.observed["sampling_temperature"] == 0.5


@pytest.mark.parametrize("t", [0.6, 1.0])
def test_a_loss_at_the_sampling_temperature_is_clean(tmp_path, t):
    path = rl_loop(tmp_path / "run", gen_t=t, loss_t=t, steps=2)
    assert kinds(path) == []


# ---------------------------------------------------------------- graph hygiene


def test_sequences_made_under_inference_mode_are_named_at_that_line(tmp_path):
    with pytest.raises(RuntimeError, match="nference tensor"):
        rl_loop(tmp_path / "run", rollout_mode=torch.inference_mode)
    (f,) = found(tmp_path / "run", "loop/inference_tensor")
    assert "input_ids" in f.message and "test_loop_roles.py" in f.where and "no_grad" in f.fix


def test_advantages_or_an_in_place_edit_under_inference_mode_are_named_and_a_harmless_mask_is_not(tmp_path):
    def masked(model, seq, r):  # a mask made under inference mode that nothing saves for backward: works
        with torch.inference_mode():
            mask = torch.ones_like(seq)
        logits = model(input_ids=seq, attention_mask=mask).logits
        lp = logits[:, PROMPT - 1 : -1].log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)
        return -((r - r.mean())[:, None] * lp).mean()

    assert "loop/inference_tensor" not in kinds(rl_loop(tmp_path / "mask", loss_fn=masked))

    def adv_inference(model, seq, r):
        with torch.inference_mode():
            adv = (r - r.mean())[:, None].expand(-1, NEW).clone()
        return -(adv * logp_of(model, seq)).mean()

    with pytest.raises(RuntimeError, match="nference"):
        rl_loop(tmp_path / "adv", loss_fn=adv_inference)
    (f,) = found(tmp_path / "adv", "loop/inference_tensor")
    assert "test_loop_roles.py" in f.where and "saved for backward" in f.observed["error"]

    def edit_in_place(model, seq, r):
        seq[:, -1] = 2  # end every response with eos, on the rollout's own tensor
        return -((r - r.mean())[:, None] * logp_of(model, seq)).mean()

    with pytest.raises(RuntimeError, match="nference"):
        rl_loop(tmp_path / "edit", loss_fn=edit_in_place, rollout_mode=torch.inference_mode)
    (f,) = found(tmp_path / "edit", "loop/inference_tensor")
    assert "test_loop_roles.py" in f.where and "place" in f.observed["error"]


def _kl_shaped(detach):
    ref = llama()

    def loss(model, seq, r):
        lp = logp_of(model, seq)
        with torch.no_grad():
            ref_lp = logp_of(ref, seq)
        kl = ((lp.detach() if detach else lp) - ref_lp).sum(-1)
        shaped = r - 0.1 * kl
        return -((shaped - shaped.mean())[:, None] * lp).mean()

    return loss


def _std_normalised(model, seq, r):
    lp = logp_of(model, seq)
    shaped = r + 0.05 * lp.sum(-1)  # an entropy-like bonus in the reward, with its graph
    adv = (shaped - shaped.mean()) / (shaped.std() + 1e-6)
    return -(adv[:, None] * lp).mean()


def _logp_baseline(model, seq, r):
    lp = logp_of(model, seq)
    return -((r - 0.1 * lp.sum(-1).mean())[:, None] * lp).mean()


@pytest.mark.parametrize(
    "loss_fn", [_kl_shaped(False), _std_normalised, _logp_baseline], ids=["kl", "std", "baseline"]
)
def test_an_advantage_with_the_policys_graph_is_named(tmp_path, loss_fn):
    path = rl_loop(tmp_path / "run", loss_fn=loss_fn, steps=2)
    (f,) = found(path, "loop/constant_with_grad")
    assert f.observed["rows_coupled"] >= 1 and "detach" in f.fix and "test_loop_roles.py" in f.where


def _ppo_clip(model, seq, r):
    lp = logp_of(model, seq)
    old = lp.detach() + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    ratio = (lp - old).exp()
    adv = ((r - r.mean()) / (r.std() + 1e-6))[:, None]
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + 0.01 * (lp * lp.exp()).mean()


@pytest.mark.parametrize("loss_fn", [_kl_shaped(True), _ppo_clip], ids=["kl_detached", "ppo"])
def test_constant_advantages_are_clean(tmp_path, loss_fn):
    path = rl_loop(tmp_path / "run", loss_fn=loss_fn, steps=2)
    assert kinds(path) == []


def test_an_autograd_grad_of_the_loop_is_not_gradients_left_uncleared(tmp_path):
    def with_own_grad(model, seq, r):
        loss = -((r - r.mean())[:, None] * logp_of(model, seq)).mean()
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)  # the loop's own diagnostics
        return loss

    path = rl_loop(tmp_path / "run", loss_fn=with_own_grad, steps=3)
    assert kinds(path) == []


# ---------------------------------------------------------------- versions of another structure: a base model under an adapter


class Adapted(torch.nn.Module):
    """A frozen base LM with a trained low-rank adapter on its logits (starts at zero, as LoRA does)."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        h = base.config.hidden_size
        self.down, self.up = torch.nn.Linear(h, rank, bias=False), torch.nn.Linear(rank, VOCAB, bias=False)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, input_ids, attention_mask=None):
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return transformers.modeling_outputs.CausalLMOutput(
            logits=out.logits + self.up(self.down(out.hidden_states[-1]))
        )


def adapter_loop(path, *, lr=5e-2, steps=5):
    base = llama()
    policy = Adapted(base)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    with verlaudit.watch(policy, opt, out_dir=path, precision="fp32") as w:
        for step in range(steps):
            seq = sample(base, prompts(step), step)  # the sampler runs the base weights, not the adapter
            r = w.reward(rewards_of(seq))
            with w.phase("actor_update"):
                loss = -((r - r.mean())[:, None] * logp_of(policy, seq)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    return path


def test_a_sampler_running_the_base_weights_of_a_trained_adapter_is_stale(tmp_path):
    (f,) = found(adapter_loop(tmp_path / "run"), "loop/stale_sampler")
    drift = f.observed["logprob_drift"]
    assert drift[0][1] < 1e-4 < drift[-1][1] and "test_loop_roles.py" in f.where and "sync" in f.fix


def test_a_base_sampler_whose_adapter_does_not_move_is_clean(tmp_path):
    assert "loop/stale_sampler" not in kinds(adapter_loop(tmp_path / "run", lr=0.0))


def test_a_grad_scaler_built_and_used_per_step_is_named_above_the_missing_scaler(tmp_path):
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", precision="fp16") as w:
        for step in range(3):
            seq = sample(model, prompts(step), step)
            r = w.reward(rewards_of(seq))
            with w.phase("actor_update"), torch.autocast("cpu", dtype=torch.float16):
                loss = -((r - r.mean())[:, None] * logp_of(model, seq)).mean()
            scaler = torch.amp.GradScaler("cpu")  # built inside the step: its scale restarts each step
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    from verlaudit.analysis.diagnose.diagnosis import diagnose_path

    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/scaler_recreated", [c.title for c in d.causes]
