"""Plain PyTorch RL loops of a user's own, audited in place with ``verlaudit.watch`` (README "Audit your own
trainer"): REINFORCE (or a clipped ratio) with a batch-mean baseline on the digits task, on a tiny Llama, a few steps on CPU.

    python own_loops.py NAME OUT_DIR      # runs loop NAME, writes its run directory at OUT_DIR

Each loop also writes ``OUT_DIR.evidence.json`` beside the run directory: what the loop itself measured
(its losses, weight changes, learning rates, dtypes), read by verify.py; the run directory is verlaudit's.
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

PROMPTS, NEW_TOKENS, STEPS, PROMPT_LEN, MICRO = 8, 6, 4, 16, 4


def _tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def _model(tok, seed: int = 11):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(tok))


def _batch(tok, step: int):
    from trainer.data import TASKS

    ex = TASKS["digits"].make_examples(PROMPTS, seed=400 + step)
    enc = tok([e["prompt"] for e in ex], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    return ex, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _rollout(model, tok, batch, step: int, temperature: float = 1.0, grad_mode=torch.no_grad):
    torch.manual_seed(3000 + step)
    with grad_mode():
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
            temperature=temperature, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    seq = out.sequences
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    rollout_logp = scores.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)
    return seq, rollout_logp


def digit_reward(tok, seq, examples):
    texts = tok.batch_decode(seq[:, PROMPT_LEN:], skip_special_tokens=True)
    return torch.tensor(
        [sum(1.0 if a == b else (0.25 if a.isdigit() else 0.0) for a, b in zip(t, e["answer"])) / len(e["answer"])
         for t, e in zip(texts, examples)]  # fmt: skip
    )


def _attn(batch, seq):
    return torch.cat([batch["attention_mask"], torch.ones_like(seq[:, PROMPT_LEN:])], dim=1)


def _token_logp(logits, seq):
    """log-probs of the response tokens, from fp32 logits."""
    lp = logits[:, PROMPT_LEN - 1 : -1].float().log_softmax(-1)
    return lp.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)


def _snapshot(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _reinforce_loss(logp, rewards):
    adv = rewards - rewards.mean()
    return -(adv[:, None] * logp).mean()


def _grad_norm(model) -> float:
    gs = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(gs).norm()) if gs else 0.0



def _loop(name, out_dir, *, precision, step_fn, lr=1e-3, scaler=None, opt_fn=None, rollout_fn=None):
    """The shared loop: rollout, reward, one update per step, all under ``verlaudit.watch``."""
    import verlaudit

    tok = _tok()
    model = _model(tok)
    opt = opt_fn(model) if opt_fn else torch.optim.AdamW(model.parameters(), lr=lr)
    ev = _EV
    ev.update({"loop": name, "loss": [], "update_norm": [], "skipped": [], "lr": [], "notes": {}})
    start = _snapshot(model)
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=out_dir, precision=precision, tokenizer=tok) as w:
        for step in range(STEPS):
            ex, batch = _batch(tok, step)
            w.batch(batch, source="own_loops._batch")
            with w.phase("rollout"):
                seq, rollout_logp = (rollout_fn or _rollout)(model, tok, batch, step)
            rewards = digit_reward(tok, seq, ex)
            ev.setdefault("reward_std", []).append(float(rewards.std()))
            w.reward(rewards, source="own_loops.digit_reward")
            before = _snapshot(model)
            with w.phase("actor_update"):
                loss = step_fn(model, opt, scaler, batch, seq, rollout_logp, rewards, ev)
            after = _snapshot(model)
            ev["loss"].append(float(loss.detach()))
            ev["update_norm"].append(float((after - before).norm()))
            ev["skipped"].append(bool(torch.equal(after, before)))
            ev["lr"].append(float(opt.param_groups[0]["lr"]))
            w.log({"actor/loss": float(loss), "actor/lr": ev["lr"][-1], "critic/score/mean": float(rewards.mean())})
    ev["total_change"] = float((_snapshot(model) - start).norm())
    return ev


def _forward_logp(model, batch, seq, autocast=None):
    if autocast is None:
        logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
    else:
        with torch.autocast("cpu", dtype=autocast):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
    return _token_logp(logits, seq)


def _forward_loss(model, batch, seq, rewards, autocast=None):
    return _reinforce_loss(_forward_logp(model, batch, seq, autocast), rewards)


def _adam_steps(opt) -> int:
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps) if steps else 0


# ---------------------------------------------------------------- the loops


def loop_optimizer_on_reference_copy(out_dir):
    """fp32; a frozen reference copy of the policy is made for a KL term, and the optimizer is built from
    ``ref.parameters()`` (the two names swapped when the copy was added)."""
    models = {}

    def opt_fn(model):
        import copy

        ref = copy.deepcopy(model)
        models["ref"], models["ref_start"] = ref, _snapshot(ref)
        return torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        loss = _forward_loss(model, batch, seq, rewards)
        opt.zero_grad()
        loss.backward()
        ev["notes"].setdefault("policy_grad_norm", []).append(_grad_norm(model))
        opt.step()
        ev["notes"].setdefault("ref_change", []).append(float((_snapshot(models["ref"]) - models["ref_start"]).norm()))
        return loss

    return _loop("loop_optimizer_on_reference_copy", out_dir, precision="fp32", step_fn=step, opt_fn=opt_fn)


def loop_double_step(out_dir):
    """fp16 autocast + GradScaler; after ``scaler.step(opt)`` / ``scaler.update()`` the loop also calls
    ``opt.step()`` (left from the fp32 version of the loop)."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        loss = _forward_loss(model, batch, seq, rewards, autocast=torch.float16)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.step()
        ev["notes"].setdefault("adam_step_count", []).append(_adam_steps(opt))
        return loss

    return _loop("loop_double_step", out_dir, precision="fp16", step_fn=step, scaler=scaler)


KL_BETA = 0.1


def loop_kl_reward_not_detached(out_dir):
    """fp32; the reward is shaped with a KL penalty to a frozen reference, ``r - beta * (logp - ref_logp)``,
    computed from the policy's log-probs with their graph (no ``.detach()``)."""
    refs = {}

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        import copy

        if "ref" not in refs:
            refs["ref"] = copy.deepcopy(model).eval()
        with torch.no_grad():
            ref_logp = _forward_logp(refs["ref"], batch, seq)
        logp = _forward_logp(model, batch, seq)
        kl = (logp - ref_logp).sum(-1)
        shaped = rewards - KL_BETA * kl
        adv = shaped - shaped.mean()
        loss = -(adv[:, None] * logp).mean()
        # what the same loss gives with the shaped reward detached (the loop's own check, not used)
        adv_d = adv.detach()
        g = torch.autograd.grad(loss, [p for p in model.parameters()], retain_graph=True, allow_unused=True)
        g_d = torch.autograd.grad(-(adv_d[:, None] * logp).mean(), [p for p in model.parameters()],
                                  retain_graph=True, allow_unused=True)  # fmt: skip
        flat = torch.cat([x.flatten() for x in g if x is not None])
        flat_d = torch.cat([x.flatten() for x in g_d if x is not None])
        ev["notes"].setdefault("grad_rel_diff_vs_detached", []).append(
            float((flat - flat_d).norm() / flat_d.norm().clamp_min(1e-12)))
        ev["notes"]["adv_requires_grad"] = bool(adv.requires_grad)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_kl_reward_not_detached", out_dir, precision="fp32", step_fn=step)


def loop_stale_rollout_copy(out_dir):
    """fp32; the sampler is a copy of the policy made once before the loop (for a separate generation
    process); its weights are never synced from the policy."""
    gen = {}

    def rollout(model, tok, batch, step):
        import copy

        if "model" not in gen:
            gen["model"] = copy.deepcopy(model).eval()
            gen["start"] = _snapshot(gen["model"])
        return _rollout(gen["model"], tok, batch, step)

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        logp = _forward_logp(model, batch, seq)
        ev["notes"].setdefault("policy_vs_sampler_logp_abs", []).append(float((logp.detach() - rollout_logp).abs().mean()))
        ev["notes"].setdefault("sampler_change", []).append(float((_snapshot(gen["model"]) - gen["start"]).norm()))
        loss = _reinforce_loss(logp, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_stale_rollout_copy", out_dir, precision="fp32", step_fn=step, lr=3e-3, rollout_fn=rollout)


def loop_inference_mode_tensors(out_dir):
    """fp32; the rollout runs under ``torch.inference_mode()`` (faster than no_grad), and its sequences feed
    the training forward."""

    def rollout(model, tok, batch, step):
        return _rollout(model, tok, batch, step, grad_mode=torch.inference_mode)

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        ev["notes"]["seq_is_inference"] = bool(seq.is_inference())
        loss = _forward_loss(model, batch, seq, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_inference_mode_tensors", out_dir, precision="fp32", step_fn=step, rollout_fn=rollout)


ROLLOUT_TEMPERATURE = 0.6
CLIP_EPS = 0.2


def loop_temperature_not_applied(out_dir):
    """fp32, a clipped-ratio loss against the sampler's log-probs: the rollout samples at temperature 0.6,
    the loop's log-probs are taken from the raw logits (temperature 1)."""

    def rollout(model, tok, batch, step):
        return _rollout(model, tok, batch, step, temperature=ROLLOUT_TEMPERATURE)

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        logp = _forward_logp(model, batch, seq)
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
            at_t = (logits[:, PROMPT_LEN - 1 : -1].float() / ROLLOUT_TEMPERATURE).log_softmax(-1)
            at_t = at_t.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)
        ev["notes"].setdefault("loop_vs_rollout_logp_abs", []).append(float((logp.detach() - rollout_logp).abs().mean()))
        ev["notes"].setdefault("tempered_vs_rollout_logp_abs", []).append(float((at_t - rollout_logp).abs().mean()))
        ratio = (logp - rollout_logp).exp()
        adv = (rewards - rewards.mean())[:, None]
        ev["notes"].setdefault("clipped_fraction", []).append(float(((ratio - 1).abs() > CLIP_EPS).float().mean()))
        loss = -torch.min(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_temperature_not_applied", out_dir, precision="fp32", step_fn=step, rollout_fn=rollout)


def loop_optimizer_recreated(out_dir):
    """fp32; the optimizer is built inside the step (it was moved there when the learning rate became a
    per-step schedule)."""

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        lr = 1e-3
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        loss = _forward_loss(model, batch, seq, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ev["notes"].setdefault("adam_step_count", []).append(_adam_steps(opt))
        return loss

    return _loop("loop_optimizer_recreated", out_dir, precision="fp32", step_fn=step)


def loop_fp16_accumulate_clip_correct(out_dir):
    """fp16 autocast + GradScaler, two accumulated micro-batches, ``unscale_`` then clip, ``scaler.step`` and
    ``update`` once per step (a correct loop, for a control)."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, opt, scaler, batch, seq, rollout_logp, rewards, ev):
        opt.zero_grad()
        n = seq.shape[0] // 2
        total = torch.zeros(())
        for i in range(2):
            sl = slice(i * n, (i + 1) * n)
            sub = {k: v[sl] for k, v in batch.items()}
            logp = _forward_logp(model, sub, seq[sl], autocast=torch.float16)
            adv = rewards[sl] - rewards.mean()
            loss = -(adv[:, None] * logp).mean() / 2
            scaler.scale(loss).backward()
            total = total + loss.detach()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return total

    return _loop("loop_fp16_accumulate_clip_correct", out_dir, precision="fp16", step_fn=step, scaler=scaler)


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
