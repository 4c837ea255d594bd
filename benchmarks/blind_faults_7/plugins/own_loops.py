"""A user's own small RL loops on the digits task (a tiny Llama, a few steps on CPU), audited in place with
``verlaudit.watch`` (README "Audit your own trainer").

    python own_loops.py NAME OUT_DIR      # runs loop NAME, writes its run directory at OUT_DIR

Each loop writes ``OUT_DIR.evidence.json`` beside the run directory: what the loop measured about itself
(losses, update sizes, weight norms, ...), read by verify.py; the run directory is verlaudit's.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for _p in (str(ROOT), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

N_PROMPTS, NEW, STEPS, P = 8, 6, 4, 12
EV: dict = {}


def tokenizer():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def policy(tok, seed: int = 31, **config):
    from assets import small_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(small_config(tok, **config))


def prompts(tok, step: int):
    from trainer.data import TASKS

    ex = TASKS["digits"].make_examples(N_PROMPTS, seed=700 + step)
    enc = tok([e["prompt"] for e in ex], padding="max_length", max_length=P, return_tensors="pt")
    return ex, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def sample(model, tok, batch, step: int, autocast=None):
    """Sampled responses (exactly NEW tokens) and the sampler's log-probs of them."""
    torch.manual_seed(9000 + step)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), ctx:
        out = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_k=0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, output_scores=True,
                             return_dict_in_generate=True)  # fmt: skip
    seq = out.sequences
    lp = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, seq[:, P:, None]).squeeze(-1)
    return seq, lp


def rewards(tok, seq, ex):
    texts = tok.batch_decode(seq[:, P:], skip_special_tokens=True)
    out = []
    for t, e in zip(texts, ex):
        a = e["answer"]
        out.append(sum(1.0 if x == y else (0.25 if x.isdigit() else 0.0) for x, y in zip(t, a)) / len(a))
    return torch.tensor(out)


def mask_for(batch, seq):
    return torch.cat([batch["attention_mask"], torch.ones_like(seq[:, P:])], 1)


def logp(model, batch, seq, autocast=None):
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        logits = model(input_ids=seq, attention_mask=mask_for(batch, seq)).logits
    return logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, seq[:, P:, None]).squeeze(-1)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in params])


def grad_norm(params) -> float:
    gs = [p.grad.detach().float().flatten() for p in params if p.grad is not None]
    return float(torch.cat(gs).norm()) if gs else 0.0


def run(name, out_dir, step_fn, *, precision="fp32", opt_fn=None, model_kw=None, ref=False, eval_rollout=True,
        rollout_autocast=None):  # fmt: skip
    """The shared loop: sample, reward, one update per step (``step_fn``), under ``verlaudit.watch``."""
    import verlaudit

    tok = tokenizer()
    model = policy(tok, **(model_kw or {}))
    reference = copy.deepcopy(model).eval().requires_grad_(False) if ref else None
    opt = opt_fn(model) if opt_fn else torch.optim.AdamW(model.parameters(), lr=1e-3)
    EV.update(
        {
            "loop": name,
            "loss": [],
            "update_norm": [],
            "reward_std": [],
            "weight_norm": [flat(model.parameters()).norm().item()],
            "notes": {},
        }
    )
    watched = {"actor": model, "reference": reference} if ref else model
    with verlaudit.watch(watched, opt, out_dir=out_dir, precision=precision, tokenizer=tok) as w:
        for step in range(STEPS):
            ex, batch = prompts(tok, step)
            w.batch(batch, source="own_loops.prompts")
            if eval_rollout:
                model.eval()
            with w.phase("rollout"):
                seq, roll_lp = sample(model, tok, batch, step, autocast=rollout_autocast)
            model.train()
            r = rewards(tok, seq, ex)
            w.reward(r, source="own_loops.rewards")
            EV["reward_std"].append(float(r.std()))
            before = flat(model.parameters())
            with w.phase("actor_update"):
                loss = step_fn(model, opt, tok, batch, seq, roll_lp, r, reference)
            after = flat(model.parameters())
            EV["loss"].append(float(loss))
            EV["update_norm"].append(float((after - before).norm()))
            EV["weight_norm"].append(float(after.norm()))
            w.log({"actor/loss": float(loss), "critic/score/mean": float(r.mean())})
    return EV


def pg_loss(lp, r):
    adv = r - r.mean()
    return -(adv[:, None] * lp).mean()


# ---------------------------------------------------------------- the loops


def loop_accumulation_not_averaged(out_dir):
    """SGD, 4 micro-batches of 2 prompts accumulated into one step; each micro-batch's loss is the mean over
    its own rows and is not divided by the number of micro-batches."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        opt.zero_grad()
        total = 0.0
        for i in range(0, N_PROMPTS, 2):
            sub = {k: v[i : i + 2] for k, v in batch.items()}
            adv = (r - r.mean())[i : i + 2]
            loss = -(adv[:, None] * logp(model, sub, seq[i : i + 2])).mean()
            loss.backward()
            total += float(loss)
        # by linearity the intended gradient (the mean over the 8 rows) is the accumulated one / 4
        EV["notes"].setdefault("grad_norm_used", []).append(grad_norm(model.parameters()))
        EV["notes"]["micro_batches"] = 4
        opt.step()
        return torch.tensor(total / 4)

    return run("loop_accumulation_not_averaged", out_dir, step,
               opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.5))  # fmt: skip


def loop_rollout_in_train_mode(out_dir):
    """Clipped-ratio updates against the sampler's log-probs; the policy (attention_dropout 0.2 in its
    config, built with from_config, so in training mode) is never put in eval mode for sampling."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        with torch.no_grad():
            model.eval()
            clean = logp(model, batch, seq)
            model.train()
        EV["notes"].setdefault("rollout_vs_eval_logp_abs", []).append(float((roll_lp - clean).abs().mean()))
        lp = logp(model, batch, seq)
        ratio = torch.exp(lp - roll_lp)
        EV["notes"].setdefault("first_ratio_dev", []).append(float((ratio.detach() - 1).abs().mean()))
        adv = (r - r.mean())[:, None]
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        clipped = ((ratio.detach() < 0.8) | (ratio.detach() > 1.2)).float().mean()
        EV["notes"].setdefault("clip_frac", []).append(float(clipped))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return run(
        "loop_rollout_in_train_mode", out_dir, step, model_kw={"attention_dropout": 0.2}, eval_rollout=False
    )


def loop_ratio_detach_swapped(out_dir):
    """A PPO-style ratio against log-probs recomputed before the update: the loop detaches the new
    log-probs and keeps the graph of the old ones (the two .detach() calls swapped)."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        adv = (r - r.mean())[:, None]
        old = logp(model, batch, seq)
        new = logp(model, batch, seq).detach()
        ratio = torch.exp(new - old)
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            after = logp(model, batch, seq)
        pos = adv[:, 0] > 0
        EV["notes"].setdefault("pos_adv_logp_change", []).append(float((after - new)[pos].sum(1).mean()))
        return loss

    return run("loop_ratio_detach_swapped", out_dir, step)


def loop_decay_per_micro_batch(out_dir):
    """bf16 autocast; decoupled weight decay written by hand (AdamW without its own decay), applied as
    p *= 1 - wd inside the micro-batch loop (4 micro-batches), with wd 0.1 (meant: p *= 1 - lr x wd once
    per step)."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        opt.zero_grad()
        total = 0.0
        for i in range(0, N_PROMPTS, 2):
            sub = {k: v[i : i + 2] for k, v in batch.items()}
            adv = (r - r.mean())[i : i + 2]
            loss = -(adv[:, None] * logp(model, sub, seq[i : i + 2], autocast=torch.bfloat16)).mean() / 4
            loss.backward()
            total += float(loss)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 - 0.1)
        opt.step()
        return torch.tensor(total)

    return run("loop_decay_per_micro_batch", out_dir, step, precision="bf16", rollout_autocast=torch.bfloat16,
               opt_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0))  # fmt: skip


def loop_clip_on_reference(out_dir):
    """SGD with gradient clipping to 0.02 and a frozen reference for a KL penalty; the clip is called on the
    reference's parameters (the variable names differ by one word) instead of the policy's."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        lp = logp(model, batch, seq)
        with torch.no_grad():
            ref_lp = logp(reference, batch, seq)
        loss = pg_loss(lp, r) + 0.05 * (lp - ref_lp).mean()
        opt.zero_grad()
        loss.backward()
        returned = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.02))
        EV["notes"].setdefault("clip_returned", []).append(returned)
        EV["notes"].setdefault("policy_grad_norm_at_step", []).append(grad_norm(model.parameters()))
        opt.step()
        return loss

    return run("loop_clip_on_reference", out_dir, step, ref=True,
               opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.5))  # fmt: skip


def loop_bf16_clipped_ratio_correct(out_dir):
    """A correct loop (control): bf16 autocast for sampling and the update, the sampler's log-probs
    re-scored by the same bf16 forward before the update, a clipped ratio, a frozen reference with a
    detached KL penalty in the reward, clipping between backward and step."""

    def step(model, opt, tok, batch, seq, roll_lp, r, reference):
        with torch.no_grad():
            model.eval()
            old = logp(model, batch, seq, autocast=torch.bfloat16)
            ref_lp = logp(reference, batch, seq, autocast=torch.bfloat16)
            model.train()
        shaped = r - 0.05 * (old - ref_lp).sum(1)
        adv = (shaped - shaped.mean())[:, None]
        lp = logp(model, batch, seq, autocast=torch.bfloat16)
        ratio = torch.exp(lp - old)
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return run("loop_bf16_clipped_ratio_correct", out_dir, step, precision="bf16", ref=True,
               rollout_autocast=torch.bfloat16)  # fmt: skip


LOOPS = {n: f for n, f in dict(globals()).items() if n.startswith("loop_")}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in LOOPS:
        print(f"usage: own_loops.py NAME OUT_DIR; NAME one of {', '.join(LOOPS)}", file=sys.stderr)
        return 2
    name, out = argv[0], Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        LOOPS[name](str(out))
    except Exception as e:  # the loop's own failure is evidence too
        EV["error"] = f"{type(e).__name__}: {e}"
        out.with_name(out.name + ".evidence.json").write_text(json.dumps(EV, indent=1))
        raise
    out.with_name(out.name + ".evidence.json").write_text(json.dumps(EV, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
