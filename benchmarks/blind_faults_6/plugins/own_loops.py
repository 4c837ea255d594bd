"""Plain PyTorch RL loops of a user's own, audited in place with ``verlaudit.watch`` (README "Audit your own
trainer"): REINFORCE (or a clipped ratio) with a batch-mean baseline on the digits task, on a tiny Llama, a
few steps on CPU.

    python own_loops.py NAME OUT_DIR      # runs loop NAME, writes its run directory at OUT_DIR

Each loop also writes ``OUT_DIR.evidence.json`` beside the run directory: what the loop itself measured
(its losses, weight changes, learning rates), read by verify.py; the run directory is verlaudit's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for p in (str(ROOT), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

PROMPTS, NEW_TOKENS, STEPS, PROMPT_LEN = 8, 8, 4, 16


def _tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def _model(tok, seed: int = 13):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(tok))


def _batch(tok, step: int):
    from trainer.data import TASKS

    ex = TASKS["digits"].make_examples(PROMPTS, seed=600 + step)
    enc = tok([e["prompt"] for e in ex], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    return ex, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _rollout(model, tok, batch, step: int, autocast=None):
    torch.manual_seed(5000 + step)
    ctx = (
        torch.autocast("cpu", dtype=autocast)
        if autocast is not None
        else torch.autocast("cpu", enabled=False)
    )
    with torch.no_grad(), ctx:
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, top_k=0,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    seq = out.sequences
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    rollout_logp = scores.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)
    return seq, rollout_logp


def _credit(text: str, answer: str) -> float:
    return sum(1.0 if a == b else (0.25 if a.isdigit() else 0.0) for a, b in zip(text, answer)) / len(answer)


def digit_reward(tok, seq, examples, start: int = PROMPT_LEN):
    texts = tok.batch_decode(seq[:, start:], skip_special_tokens=True)
    return torch.tensor([_credit(t, e["answer"]) for t, e in zip(texts, examples)])


def _attn(batch, seq):
    return torch.cat([batch["attention_mask"], torch.ones_like(seq[:, PROMPT_LEN:])], dim=1)


def _token_logp(logits, seq):
    """log-probs of the response tokens, from fp32 logits."""
    lp = logits[:, PROMPT_LEN - 1 : -1].float().log_softmax(-1)
    return lp.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)


def _snapshot(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                      for p in model.parameters()])  # fmt: skip


def _forward_logp(model, batch, seq, autocast=None, mask=True):
    kw = {"attention_mask": _attn(batch, seq)} if mask else {}
    if autocast is None:
        logits = model(input_ids=seq, **kw).logits
    else:
        with torch.autocast("cpu", dtype=autocast):
            logits = model(input_ids=seq, **kw).logits
    return _token_logp(logits, seq)


def _reinforce_loss(logp, rewards):
    adv = rewards - rewards.mean()
    return -(adv[:, None] * logp).mean()


def _loop(name, out_dir, *, precision, step_fn, lr=1e-3, scaler=None, opt_fn=None, rollout_autocast=None,
          reward_start=PROMPT_LEN, models=None):  # fmt: skip
    """The shared loop: rollout, reward, one update per step, all under ``verlaudit.watch``."""
    import verlaudit

    tok = _tok()
    model = _model(tok)
    opt = opt_fn(model) if opt_fn else torch.optim.AdamW(model.parameters(), lr=lr)
    ev = _EV
    ev.update({"loop": name, "loss": [], "update_norm": [], "skipped": [], "lr": [], "notes": {}})
    start = _snapshot(model)
    watched = models(model) if models else model
    with verlaudit.watch(
        watched, opt, scaler=scaler, out_dir=out_dir, precision=precision, tokenizer=tok
    ) as w:
        for step in range(STEPS):
            ex, batch = _batch(tok, step)
            w.batch(batch, source="own_loops._batch")
            with w.phase("rollout"):
                seq, rollout_logp = _rollout(model, tok, batch, step, autocast=rollout_autocast)
            rewards = digit_reward(tok, seq, ex, start=reward_start)
            ev.setdefault("reward_std", []).append(float(rewards.std()))
            w.reward(rewards, source="own_loops.digit_reward")
            before = _snapshot(model)
            with w.phase("actor_update"):
                loss = step_fn(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex)
            after = _snapshot(model)
            ev["loss"].append(float(loss.detach()))
            ev["update_norm"].append(float((after - before).norm()))
            ev["skipped"].append(bool(torch.equal(after, before)))
            ev["lr"].append(float(opt.param_groups[0]["lr"]))
            w.log(
                {
                    "actor/loss": float(loss),
                    "actor/lr": ev["lr"][-1],
                    "critic/score/mean": float(rewards.mean()),
                }
            )
    ev["total_change"] = float((_snapshot(model) - start).norm())
    return ev


# ---------------------------------------------------------------- the loops


def loop_advantage_broadcast_over_tokens(out_dir):
    """fp32; the advantage (one per sequence, shape [B]) multiplies the token log-probs [B, T] without
    ``[:, None]``: with 8 prompts and 8 new tokens the shapes broadcast silently, along the token axis."""

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        logp = _forward_logp(model, batch, seq)
        adv = rewards - rewards.mean()
        loss = -(adv * logp).mean()
        # the loop's own check (not used for the update): the gradient of the intended loss
        g_bug = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        g_ok = torch.autograd.grad(-(adv[:, None] * logp).mean(), list(model.parameters()), retain_graph=True)
        fb, fo = torch.cat([x.flatten() for x in g_bug]), torch.cat([x.flatten() for x in g_ok])
        ev["notes"].setdefault("cos_to_intended_grad", []).append(
            float(torch.nn.functional.cosine_similarity(fb, fo, 0))
        )
        ev["notes"]["shapes"] = [list(adv.shape), list(logp.shape)]
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_advantage_broadcast_over_tokens", out_dir, precision="fp32", step_fn=step)


def loop_update_forward_without_mask(out_dir):
    """fp32; the rollout generates from left-padded prompts with their attention mask, the update's forward
    is called as ``model(input_ids=seq)`` (no mask: 'the padding is on the left, causal attention handles
    it')."""

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        logp = _forward_logp(model, batch, seq, mask=False)
        with torch.no_grad():
            masked = _forward_logp(model, batch, seq, mask=True)
        ev["notes"].setdefault("update_vs_rollout_logp_abs", []).append(
            float((logp.detach() - rollout_logp).abs().mean())
        )
        ev["notes"].setdefault("masked_vs_rollout_logp_abs", []).append(
            float((masked - rollout_logp).abs().mean())
        )
        loss = _reinforce_loss(logp, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_update_forward_without_mask", out_dir, precision="fp32", step_fn=step)


def loop_response_slice_off_by_one(out_dir):
    """bf16 autocast; the reward decodes the responses as ``seq[:, PROMPT_LEN - 1:]`` (the slice of the
    log-prob code, which needs the position before the first response token)."""

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        texts = tok.batch_decode(seq[:, PROMPT_LEN - 1 :], skip_special_tokens=True)
        ev["notes"]["decoded_first_chars"] = sorted({t[:1] for t in texts})
        right = torch.cat(
            [
                seq[:, :PROMPT_LEN],
                torch.tensor(
                    [
                        tok(e["answer"], add_special_tokens=False)["input_ids"]
                        + [tok.eos_token_id] * (NEW_TOKENS - 4)
                        for e in ex
                    ]
                ),
            ],
            1,
        )
        ev["notes"]["reward_of_exact_answers"] = digit_reward(tok, right, ex, start=PROMPT_LEN - 1).tolist()
        loss = _reinforce_loss(_forward_logp(model, batch, seq, autocast=torch.bfloat16), rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_response_slice_off_by_one", out_dir, precision="bf16", step_fn=step,
                 rollout_autocast=torch.bfloat16, reward_start=PROMPT_LEN - 1)  # fmt: skip


WARMUP_STEPS, PEAK_LR = 2, 1e-3


def loop_lr_written_to_wrong_key(out_dir):
    """fp32; AdamW built with lr 0 and a hand-written warmup that sets ``group['learning_rate']`` each step
    (the key of the config file, not the optimizer's ``'lr'``)."""

    def opt_fn(model):
        return torch.optim.AdamW(model.parameters(), lr=0.0)

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        n = len(ev["loss"])
        for g in opt.param_groups:
            g["learning_rate"] = PEAK_LR * min(1.0, (n + 1) / WARMUP_STEPS)
        loss = _reinforce_loss(_forward_logp(model, batch, seq), rewards)
        opt.zero_grad()
        loss.backward()
        ev["notes"].setdefault("grad_norm", []).append(float(_flat_grad(model).norm()))
        opt.step()
        ev["notes"].setdefault("intended_lr", []).append(opt.param_groups[0]["learning_rate"])
        return loss

    return _loop("loop_lr_written_to_wrong_key", out_dir, precision="fp32", step_fn=step, opt_fn=opt_fn)


def _scaled_backward(scaler, loss):
    """The team's mixed-precision helper: scale, then backward."""
    scaler.scale(loss).backward()


def loop_double_loss_scaling(out_dir):
    """fp16 autocast + GradScaler; the loop passes ``scaler.scale(loss)`` to the team's backward helper,
    which scales again."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        loss = _reinforce_loss(_forward_logp(model, batch, seq, autocast=torch.float16), rewards)
        opt.zero_grad()
        _scaled_backward(scaler, scaler.scale(loss))
        ev["notes"].setdefault("scale_before_step", []).append(float(scaler.get_scale()))
        scaler.step(opt)
        scaler.update()
        return loss

    return _loop("loop_double_loss_scaling", out_dir, precision="fp16", step_fn=step, scaler=scaler,
                 rollout_autocast=torch.float16)  # fmt: skip


KL_BETA = 0.05


def loop_bf16_reference_kl_correct(out_dir):
    """bf16 autocast, a frozen reference copy (passed to watch as a role), the KL to it detached into the
    reward, gradient clipping after backward and before the step (a correct loop, for a control)."""
    refs = {}

    def models(model):
        import copy

        refs["ref"] = copy.deepcopy(model).eval().requires_grad_(False)
        return {"actor": model, "reference": refs["ref"]}

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev, tok, ex):
        logp = _forward_logp(model, batch, seq, autocast=torch.bfloat16)
        with torch.no_grad():
            ref_logp = _forward_logp(refs["ref"], batch, seq, autocast=torch.bfloat16)
        shaped = rewards - KL_BETA * (logp.detach() - ref_logp).sum(-1)
        adv = shaped - shaped.mean()
        loss = -(adv[:, None] * logp).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return _loop("loop_bf16_reference_kl_correct", out_dir, precision="bf16", step_fn=step,
                 rollout_autocast=torch.bfloat16, models=models)  # fmt: skip


_EV: dict = {}
"""The running loop's evidence (written even when the loop raises)."""
LOOPS = {name: fn for name, fn in dict(globals()).items() if name.startswith("loop_")}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in LOOPS:
        print(f"usage: own_loops.py NAME OUT_DIR; NAME one of {', '.join(LOOPS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    out = Path(argv[1])
    rc = 0
    try:
        LOOPS[argv[0]](out)
    except Exception as e:  # the loop's own failure is evidence; the traceback still goes to stderr
        _EV["error"] = f"{type(e).__name__}: {e}"
        rc = 1
        import traceback

        traceback.print_exc()
    out.with_name(out.name + ".evidence.json").write_text(json.dumps(_EV, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
