"""An own loop's reference stays frozen and apart from the policy (`verlaudit.integrations.loop_reference`):
a KL-penalised loop on a tiny Llama whose reference is a shallow copy, shares the policy's trunk, or was
loaded with ``assign=True`` from the policy's own tensors; a declared reference whose parameters are in the
optimizer; the deep-copied reference stays clean. Run: `pytest tests/test_loop_reference.py`."""

from __future__ import annotations

import copy

import pytest
import torch

import verlaudit
from verlaudit.rundir import read_run

pytest.importorskip("transformers")

from test_loop_roles import PROMPT, kinds, llama, logp_of, prompts, rewards_of, sample  # noqa: E402


def found(path, kind):
    return [f for f in read_run(path).findings if f.kind == kind]


def _shallow(model):
    return copy.copy(model)


def _trunk(model):
    ref = copy.deepcopy(model)
    ref.model = model.model  # the reference's trunk assigned from the policy
    return ref


def _assigned(model):
    ref = llama(seed=5)
    ref.load_state_dict(model.state_dict(), assign=True)
    return ref


def kl_loop(path, make_ref, *, declare=False, train_ref=False, steps=3):
    model = llama()
    ref = make_ref(model)
    params = list(model.parameters()) + (list(ref.parameters()) if train_ref else [])
    opt = torch.optim.AdamW(params, lr=1e-2)
    models = {"actor": model, "reference": ref} if declare else model
    with verlaudit.watch(models, opt if not declare else {"actor": opt}, out_dir=path, precision="fp32") as w:
        for step in range(steps):
            seq = sample(model, prompts(step), step)
            r = w.reward(rewards_of(seq))
            with w.phase("actor_update"):
                lp = logp_of(model, seq)
                with torch.no_grad():
                    ref_lp = logp_of(ref, seq)
                loss = -((r - r.mean())[:, None] * lp).mean() + 0.1 * (lp - ref_lp).sum(-1).mean()
                if train_ref:
                    loss = loss + 0.0 * logp_of(ref, seq).mean()  # a term that reaches the reference
                opt.zero_grad()
                loss.backward()
                opt.step()
    return path


@pytest.mark.parametrize("make_ref", [_shallow, _trunk, _assigned], ids=["shallow", "trunk", "assigned"])
def test_a_reference_sharing_the_policys_tensors_is_named(tmp_path, make_ref):
    (f,) = found(kl_loop(tmp_path / "run", make_ref), "loop/reference_shared")
    assert f.observed["shared_tensors"] >= 5 and "deepcopy" in f.fix and "logp_of" in f.where


def test_a_declared_reference_that_is_trained_moved(tmp_path):
    path = kl_loop(tmp_path / "run", lambda m: copy.deepcopy(m), declare=True, train_ref=True)
    (f,) = found(path, "loop/reference_moved")
    assert f.observed["moved_tensors"] >= 1


@pytest.mark.parametrize("declare", [False, True])
def test_a_deep_copied_frozen_reference_is_clean(tmp_path, declare):
    path = kl_loop(tmp_path / "run", lambda m: copy.deepcopy(m).eval().requires_grad_(False), declare=declare)
    assert not {"loop/reference_shared", "loop/reference_moved"} & set(kinds(path)), kinds(path)
    assert PROMPT


# ---------------------------------------------------------------- old log-probs with their graph: the gradient cancels


def _old_with_graph(model, seq, r):
    old = logp_of(model, seq)  # meant as the behaviour log-probs: recomputed with the graph
    lp = logp_of(model, seq)
    ratio = (lp - old).exp()
    adv = (r - r.mean())[:, None]
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()


def _old_detached(model, seq, r):
    with torch.no_grad():
        old = logp_of(model, seq)
    lp = logp_of(model, seq)
    ratio = (lp - old).exp()
    adv = (r - r.mean())[:, None]
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()


def _seq_level_old_with_graph(model, seq, r):  # a sequence-level ratio, old log-probs summed with the graph
    old = logp_of(model, seq).sum(-1)
    lp = logp_of(model, seq).sum(-1)
    return -((lp - old).exp() * (r - r.mean())).mean()


@pytest.mark.parametrize("loss_fn", [_old_with_graph, _seq_level_old_with_graph], ids=["token", "sequence"])
def test_old_log_probs_with_their_graph_cancel_the_gradient(tmp_path, loss_fn):
    from test_loop_roles import rl_loop

    (f,) = found(rl_loop(tmp_path / "run", loss_fn=loss_fn, steps=2), "loop/gradient_cancels")
    assert "detach" in f.fix and "no_grad" in f.fix


def test_detached_old_log_probs_and_a_cleared_step_are_not_a_cancellation(tmp_path):
    from test_loop_roles import rl_loop

    assert kinds(rl_loop(tmp_path / "ok", loss_fn=_old_detached, steps=2)) == []
