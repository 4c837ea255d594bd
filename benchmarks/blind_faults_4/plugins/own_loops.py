"""Plain PyTorch RL loops of a user's own, audited in place with ``verlaudit.watch`` (README "Audit your own
trainer"): REINFORCE with a batch-mean baseline on the digits task, on a tiny Llama, a few steps on CPU.

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


def _rollout(model, tok, batch, step: int):
    torch.manual_seed(3000 + step)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    seq = out.sequences
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    rollout_logp = scores.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)
    return seq, rollout_logp


def digit_reward(tok, seq, examples):
    texts = tok.batch_decode(seq[:, PROMPT_LEN:], skip_special_tokens=True)
    return torch.tensor(
        [sum(a == b for a, b in zip(t, e["answer"])) / len(e["answer"]) for t, e in zip(texts, examples)]
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


def _loop(name, out_dir, *, precision, step_fn, lr=1e-3, scaler=None, opt_fn=None, sched_fn=None,
          after_opt=None):
    """The shared loop: rollout, reward, one update per step, all under ``verlaudit.watch``."""
    import verlaudit

    tok = _tok()
    model = _model(tok)
    opt = opt_fn(model) if opt_fn else torch.optim.AdamW(model.parameters(), lr=lr)
    sched = sched_fn(opt) if sched_fn else None
    if after_opt is not None:
        after_opt(model, opt)
    ev = _EV
    ev.update({"loop": name, "loss": [], "update_norm": [], "skipped": [], "lr": [], "notes": {}})
    start = _snapshot(model)
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=out_dir, precision=precision, tokenizer=tok) as w:
        for step in range(STEPS):
            ex, batch = _batch(tok, step)
            w.batch(batch, source="own_loops._batch")
            with w.phase("rollout"):
                seq, rollout_logp = _rollout(model, tok, batch, step)
            rewards = digit_reward(tok, seq, ex)
            w.reward(rewards, source="own_loops.digit_reward")
            before = _snapshot(model)
            with w.phase("actor_update"):
                loss = step_fn(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev)
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


def _forward_loss(model, batch, seq, rewards, autocast=None):
    if autocast is None:
        logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
    else:
        with torch.autocast("cpu", dtype=autocast):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
    return _reinforce_loss(_token_logp(logits, seq), rewards)


# ---------------------------------------------------------------- the loops


def loop_never_zero_grad(out_dir):
    """fp16 autocast + GradScaler used as documented, except that the gradients are never cleared: each
    backward adds to what the previous steps left in ``.grad``."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        ev["notes"].setdefault("grad_norm_before_backward", []).append(_grad_norm(model))
        loss = _forward_loss(model, batch, seq, rewards, autocast=torch.float16)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return _loop("loop_never_zero_grad", out_dir, precision="fp16", step_fn=step, scaler=scaler)


def loop_logprobs_shifted(out_dir):
    """bf16 autocast; the response log-probs are read from the logits at the response's own positions
    (``logits[:, P:]``) instead of the positions before them (``logits[:, P - 1 : -1]``)."""

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        lp = logits[:, PROMPT_LEN:].float().log_softmax(-1)
        logp = lp.gather(-1, seq[:, PROMPT_LEN:, None]).squeeze(-1)
        right = _token_logp(logits.detach(), seq)
        ev["notes"].setdefault("loop_vs_rollout_logp_abs", []).append(float((logp.detach() - rollout_logp).abs().mean()))
        ev["notes"].setdefault("aligned_vs_rollout_logp_abs", []).append(float((right - rollout_logp).abs().mean()))
        ev["notes"].setdefault("loop_vs_aligned_logp_abs", []).append(float((logp.detach() - right).abs().mean()))
        loss = _reinforce_loss(logp, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_logprobs_shifted", out_dir, precision="bf16", step_fn=step)


def loop_head_replaced_after_optimizer(out_dir):
    """fp32; after the optimizer is built, the output head is replaced by an untied copy of itself (a new
    ``nn.Linear``) so that it can train apart from the embeddings."""
    head = {}

    def untie(model, opt):
        old = model.lm_head
        new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        model.lm_head = new
        head["start"] = new.weight.detach().clone()
        head["in_optimizer"] = any(p is new.weight for g in opt.param_groups for p in g["params"])

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        loss = _forward_loss(model, batch, seq, rewards)
        opt.zero_grad()
        loss.backward()
        ev["notes"].setdefault("head_grad_norm", []).append(float(model.lm_head.weight.grad.norm()))
        opt.step()
        ev["notes"].setdefault("head_change", []).append(float((model.lm_head.weight - head["start"]).norm()))
        ev["notes"]["head_in_optimizer"] = head["in_optimizer"]
        return loss

    return _loop("loop_head_replaced_after_optimizer", out_dir, precision="fp32", step_fn=step, after_opt=untie)


CLIP = 0.05
"""The recipe's gradient-norm bound."""


def loop_clip_after_step(out_dir):
    """fp32, SGD; the gradient norm is clipped to ``CLIP``, after ``optimizer.step()``."""

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        loss = _forward_loss(model, batch, seq, rewards)
        opt.zero_grad()
        loss.backward()
        ev["notes"].setdefault("grad_norm_at_step", []).append(_grad_norm(model))
        opt.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        return loss

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.5)

    return _loop("loop_clip_after_step", out_dir, precision="fp32", step_fn=step, opt_fn=sgd)


def loop_loss_over_whole_sequence(out_dir):
    """fp32; the policy-gradient loss takes the log-probs of every token of the sequence (the shift of
    a language-model loss), the prompt's tokens and its left padding included."""

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        lp = logits[:, :-1].float().log_softmax(-1)
        logp = lp.gather(-1, seq[:, 1:, None]).squeeze(-1)
        ev["notes"]["loss_tokens_per_row"] = int(logp.shape[1])
        ev["notes"]["response_tokens_per_row"] = int(seq.shape[1] - PROMPT_LEN)
        ev["notes"].setdefault("pad_tokens_in_loss", []).append(int((seq[:, 1:] == _tok_pad()).sum()))
        loss = _reinforce_loss(logp, rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_loss_over_whole_sequence", out_dir, precision="fp32", step_fn=step)


def _tok_pad() -> int:
    return _tok().pad_token_id


def loop_step_per_micro_batch(out_dir):
    """fp32, gradient accumulation over 4 micro-batches: the gradients are cleared once per step, but
    ``optimizer.step()`` runs after every micro-batch's backward."""

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        opt.zero_grad()
        n = seq.shape[0] // MICRO
        total_loss = torch.zeros(())
        steps = 0
        for i in range(MICRO):
            sl = slice(i * n, (i + 1) * n)
            sub = {k: v[sl] for k, v in batch.items()}
            loss = _forward_loss(model, sub, seq[sl], rewards[sl]) / MICRO
            loss.backward()
            total_loss = total_loss + loss.detach()
            opt.step()
            steps += 1
        ev["notes"].setdefault("optimizer_steps", []).append(steps)
        state = next(iter(opt.state.values()))
        ev["notes"].setdefault("adam_step_count", []).append(float(state["step"]))
        return total_loss

    return _loop("loop_step_per_micro_batch", out_dir, precision="fp32", step_fn=step)


def loop_bf16_accumulate_correct(out_dir):
    """bf16 autocast, two micro-batches accumulated (each loss halved), gradients cleared before and the
    optimizer stepped after them, clipping before the step (a correct loop, for the control)."""

    def step(model, opt, scaler, sched, batch, seq, rollout_logp, rewards, ev):
        opt.zero_grad()
        n = seq.shape[0] // 2
        total_loss = torch.zeros(())
        for i in range(2):
            sl = slice(i * n, (i + 1) * n)
            sub = {k: v[sl] for k, v in batch.items()}
            loss = _forward_loss(model, sub, seq[sl], rewards[sl], autocast=torch.bfloat16) / 2
            loss.backward()
            total_loss = total_loss + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total_loss

    return _loop("loop_bf16_accumulate_correct", out_dir, precision="bf16", step_fn=step)


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
