"""Plain PyTorch RL loops of a user's own, audited in place with ``verlaudit.watch`` (README "Audit your own
trainer"): REINFORCE with a batch-mean baseline on the digits task, on a tiny Llama, 4 steps on CPU.

    python own_loops.py NAME OUT_DIR      # runs loop NAME, writes its run directory at OUT_DIR

Each loop also writes ``OUT_DIR.evidence.json`` beside the run directory: what the loop itself measured
(its losses, weight changes, dtypes), read by verify.py; the run directory is verlaudit's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for p in (str(ROOT), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

PROMPTS, NEW_TOKENS, STEPS, PROMPT_LEN = 8, 6, 4, 16


def _tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def _model(tok, seed: int = 0, sft: bool = False):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if sft:
        return AutoModelForCausalLM.from_pretrained(os.environ["BLIND2_SFT_CKPT"])
    return AutoModelForCausalLM.from_config(tiny_config(tok))


def _batch(tok, step: int):
    from trainer.data import TASKS

    ex = TASKS["digits"].make_examples(PROMPTS, seed=100 + step)
    enc = tok([e["prompt"] for e in ex], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    return ex, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _rollout(model, tok, batch, step: int):
    torch.manual_seed(1000 + step)
    with torch.no_grad():
        seq = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    return seq


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


def _loop(name, out_dir, *, precision, step_fn, sft=False, lr=1e-3, scaler=None, model_fn=None):
    """The shared loop: rollout, reward, one update per step, all under ``verlaudit.watch``."""
    import verlaudit

    tok = _tok()
    model = model_fn(tok) if model_fn else _model(tok, sft=sft)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ev = _EV
    ev.update({"loop": name, "loss": [], "update_norm": [], "skipped": [], "notes": {}})
    start = _snapshot(model)
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=out_dir, precision=precision, tokenizer=tok) as w:
        for step in range(STEPS):
            ex, batch = _batch(tok, step)
            w.batch(batch, source="own_loops._batch")
            with w.phase("rollout"):
                seq = _rollout(model, tok, batch, step)
            rewards = digit_reward(tok, seq, ex)
            w.reward(rewards, source="own_loops.digit_reward")
            before = _snapshot(model)
            with w.phase("actor_update"):
                loss = step_fn(model, opt, scaler, batch, seq, rewards, ev)
            after = _snapshot(model)
            ev["loss"].append(float(loss.detach()))
            ev["update_norm"].append(float((after - before).norm()))
            ev["skipped"].append(bool(torch.equal(after, before)))
            w.log({"actor/loss": float(loss), "critic/score/mean": float(rewards.mean())})
    end = _snapshot(model)
    ev["total_change"] = float((end - start).norm())
    ev["bf16_exact_fraction"] = float((end.bfloat16().float() == end).float().mean())
    ev["equal_to_bf16_start_fraction"] = float((end == start.bfloat16().float()).float().mean())
    return ev


def _reinforce_loss(logp, rewards):
    adv = rewards - rewards.mean()
    return -(adv[:, None] * logp).mean()


# ---------------------------------------------------------------- the loops


def loop_unscaled_backward(out_dir):
    """fp16 autocast with a GradScaler whose step/update are called, but the backward is of the plain loss."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, opt, scaler, batch, seq, rewards, ev):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        loss = _reinforce_loss(_token_logp(logits, seq), rewards)
        opt.zero_grad()
        loss.backward()
        ev["notes"].setdefault("grad_norm_before_step", []).append(
            float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())
        )
        scaler.step(opt)
        scaler.update()
        return loss

    return _loop("loop_unscaled_backward", out_dir, precision="fp16", step_fn=step, scaler=scaler)


def loop_bf16_round_trip(out_dir):
    """The policy is cast to bf16 for generation and back to fp32 for the update, every step."""

    def step(model, opt, scaler, batch, seq, rewards, ev):
        logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        loss = _reinforce_loss(_token_logp(logits, seq), rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def fast_rollout(model, tok, batch, step_i):
        model.to(torch.bfloat16)
        try:
            return _ROLLOUT(model, tok, batch, step_i)
        finally:
            model.float()
            now = _snapshot(model)
            notes = _EV["notes"]
            notes.setdefault("bf16_exact_after_cast", []).append(
                float((now.bfloat16().float() == now).float().mean())
            )
            if "_last" in _STATE:
                notes.setdefault("unchanged_since_last_cast", []).append(
                    float((now == _STATE["_last"]).float().mean())
                )
            _STATE["_last"] = now

    global _rollout
    _rollout = fast_rollout
    try:
        return _loop("loop_bf16_round_trip", out_dir, precision="fp32", step_fn=step, lr=1e-5)
    finally:
        _rollout = _ROLLOUT


def loop_autocast_wrong_device(out_dir):
    """A bf16 autocast loop written for GPUs (``device_type='cuda'``), run on the CPU."""

    def step(model, opt, scaler, batch, seq, rewards, ev):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        ev["notes"]["logits_dtype"] = str(logits.dtype)
        loss = _reinforce_loss(_token_logp(logits, seq), rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_autocast_wrong_device", out_dir, precision="bf16", step_fn=step)


def loop_bf16_correct(out_dir):
    """bf16 autocast on the CPU, fp32 weights and log-probs (a correct loop, for the control)."""

    def step(model, opt, scaler, batch, seq, rewards, ev):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=seq, attention_mask=_attn(batch, seq)).logits
        ev["notes"]["logits_dtype"] = str(logits.dtype)
        loss = _reinforce_loss(_token_logp(logits, seq), rewards)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return _loop("loop_bf16_correct", out_dir, precision="bf16", step_fn=step)


_ROLLOUT = _rollout
_EV: dict = {}
_STATE: dict = {}
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
