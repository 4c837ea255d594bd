"""`verlaudit.watch` on a plain PyTorch loop: a clean loop writes a run directory that diagnose calls
clean; planted faults (float ids from the collator, a bf16 reward, an fp16 loss scale driven to 1)
are found and named; the contract is inferred from the first forward's autocast. Tiny model, a few
steps, CPU. Run: `pytest tests/test_integrations_watch.py`."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import verlaudit
from trainer.config import ModelConfig
from trainer.models import preset_config
from trainer.tokenizer import build_tokenizer
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.rundir import read_run


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny(tok):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config(ModelConfig(preset="tiny-llama"), tok))


def batches(tok, n, *, cast_ids=False):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(4, len(tok), (2, 8), generator=g)
        yield {"input_ids": ids.float() if cast_ids else ids, "attention_mask": torch.ones_like(ids)}


def loop(w, model, opt, tok, *, steps=3, autocast=torch.bfloat16, scaler=None, blow_up=1.0, reward=None):
    for batch in batches(tok, steps):
        w.batch(batch, source="my_collate")
        if reward is not None:
            reward(batch["input_ids"])
        with w.phase("actor_update"), torch.autocast("cpu", dtype=autocast):
            loss = model(**batch, labels=batch["input_ids"]).loss * blow_up
        w.loss(loss)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        w.log({"actor/loss": loss})


def bad_findings(run):
    return [f for f in run.findings if f.severity in ("warning", "error")]


def test_verlaudit_watch_is_the_integration(tok):
    from verlaudit.integrations.watch import watch

    assert verlaudit.watch is watch
    assert "watch" in dir(verlaudit)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        verlaudit.nope  # noqa: B018


def test_clean_loop_is_clean_and_the_contract_is_inferred_at_the_first_forward(tok, tmp_path):
    model = tiny(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", tokenizer=tok) as w:
        loop(w, model, opt, tok)
    run = read_run(tmp_path / "run")
    assert run.state == "completed"
    assert [m["step"] for m in run.metrics] == [0, 1, 2]  # one line per optimizer step, none extra
    assert all("actor/loss" in m and "actor/grad_norm" in m for m in run.metrics)
    assert bad_findings(run) == []
    contract = run.manifest["contract"]
    # entered outside autocast: the first forward's bf16 autocast decides the contract
    assert contract["source"] == "inferred" and contract["preset"] == "bf16"
    assert run.manifest["policy"]["roles"]["actor"]["compute_dtype"] == "bf16"
    (d,) = diagnose_path(tmp_path / "run")
    assert d.verdict == "clean", [c.title for c in d.causes]
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # hooks off at exit


def test_float_ids_from_the_collator_are_named(tok, tmp_path):
    model = tiny(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with verlaudit.watch(model, opt, out_dir=tmp_path / "run", precision="bf16") as w:
        w.batch(next(batches(tok, 1, cast_ids=True)), source="my_collate")
    run = read_run(tmp_path / "run")
    (f,) = [f for f in run.findings if f.kind == "boundary/collator_float_ids"]
    assert f.severity == "error" and f.where == "collator:my_collate.input_ids"


def test_bf16_reward_and_fp16_loss_scale_collapse_are_diagnosed(tok, tmp_path):
    model = tiny(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)

    def my_reward(ids):
        return torch.ones(ids.shape[0], dtype=torch.bfloat16)

    with verlaudit.watch(model, opt, scaler=scaler, out_dir=tmp_path / "run") as w:
        # x1e5: the fp16 backward overflows, each step is skipped and the scale halves
        loop(
            w,
            model,
            opt,
            tok,
            steps=5,
            autocast=torch.float16,
            scaler=scaler,
            blow_up=1e5,
            reward=w.reward_fn(my_reward),
        )
    assert "unscale_" not in scaler.__dict__ and "update" not in scaler.__dict__  # the tap is off
    run = read_run(tmp_path / "run")
    assert run.manifest["contract"]["preset"] == "fp16"
    # halved from 8 at each skipped step, down to 1 (where this loss stops overflowing)
    assert [v for _, v in run.series("actor/loss_scale")][:3] == [4.0, 2.0, 1.0]
    assert [v for _, v in run.series("actor/skipped")][:3] == [1.0, 1.0, 1.0]
    (d,) = diagnose_path(tmp_path / "run")
    kinds = [c.kind for c in d.causes]
    assert "loss_scale_collapse" in kinds
    reward = next(c for c in d.causes if c.kind == "finding:boundary/reward_dtype")
    assert reward.where == "reward:function:my_reward"  # the user's function, by its name


def test_a_run_that_raises_gets_a_failed_status(tok, tmp_path):
    model = tiny(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError), verlaudit.watch(model, opt, out_dir=tmp_path / "run") as w:
        batch = next(batches(tok, 1, cast_ids=True))
        with w.phase("actor_update"):
            model(**batch)  # float ids into the embedding
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed" and status["phase"] == "actor_update"


def test_bad_arguments_say_what_to_pass(tok, tmp_path):
    model = tiny(tok)
    with pytest.raises(ValueError, match=r"precision='bf61'\): unknown preset"):
        verlaudit.watch(model, out_dir=tmp_path / "a", precision="bf61")  # at the call, not at entry
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        verlaudit.watch({"policy": model}, out_dir=tmp_path / "b")
    with (
        pytest.raises(ValueError, match=r"phase\('train'\): unknown phase"),
        verlaudit.watch(model, out_dir=tmp_path / "c") as w,
    ):
        with w.phase("train"):
            pass
