"""Checks that each planted fault of the seventh blind bench really happens, without diagnosing: the run
directory's status.json and the trainer's own metrics (metrics.jsonl without the auditor's prefixes), the
own loops' evidence files, and direct checks of the plug-ins, assets and trainer code on sample input.
Called by ``run_blind.py --verify``. Every check returns ``(ok, evidence)``; controls are checked to have
completed with finite metrics, no skipped step and a learning signal.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

_SKIP = ("audit/", "numerics/", "mismatch/", "plugin/", "dynamics/", "shadow/", "setup/")
"""Metric prefixes the auditor writes: not read here."""


def plugin(module: str, attr: str) -> Callable:
    key = f"_verify7_{module}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / "plugins" / f"{module}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return getattr(sys.modules[key], attr)


def metrics(rd: Path) -> list[dict[str, Any]]:
    p = rd / "metrics.jsonl"
    out = []
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            out.append({k: v for k, v in d.items() if not k.startswith(_SKIP)})
    return out


def status(rd: Path) -> dict:
    try:
        return json.loads((rd / "status.json").read_text())
    except (OSError, ValueError):
        return {"state": "missing"}


def _num(v):
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def series(ms, key):
    return [_num(m[key]) for m in ms if key in m]


def fmt(xs) -> str:
    return "[" + ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in xs) + "]"


def finite(xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def state(rd: Path) -> str:
    return str(status(rd).get("state"))


def done(rd: Path) -> bool:
    return state(rd) == "completed"


def why(rd: Path) -> str:
    st = status(rd)
    return " ".join(
        f"{st.get('state')} at {st.get('phase')} step {st.get('step')}: {st.get('reason', '')} {st.get('error', '')}".split()
    )[:240]


def evidence(rd: Path) -> dict:
    try:
        return json.loads(rd.with_name(rd.name + ".evidence.json").read_text())
    except (OSError, ValueError):
        return {}


def tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def examples(n=16, seed=0, task="digits"):
    from trainer.data import TASKS

    return TASKS[task].make_examples(n, seed)


def sft(assets, name="sft_lm"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets[name]).eval()


def greedy(model, t, ids, mask, n_new=6):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                             pad_token_id=t.pad_token_id, eos_token_id=t.eos_token_id)  # fmt: skip
    return out[:, ids.shape[1] :]


def accuracy(model, t, ex, collate=None):
    collate = collate or plugin("collators", "padded_prompts")
    b = collate(ex, t)
    texts = t.batch_decode(greedy(model, t, b["input_ids"], b["attention_mask"]), skip_special_tokens=True)
    return sum(x[:4] == e["answer"] for x, e in zip(texts, ex)) / len(ex)


def answer_nll(model, t, n=32):
    """Mean NLL per token of answer + eos on digits prompts."""
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for e in examples(n, seed=11):
            p = t(e["prompt"])["input_ids"]
            a = t(e["answer"], add_special_tokens=False)["input_ids"] + [t.eos_token_id]
            ids = torch.tensor([p + a])
            lp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            tgt = ids[0, 1:]
            tot -= float(lp[len(p) - 1 :].gather(-1, tgt[len(p) - 1 :, None]).sum())
            cnt += len(a)
    return tot / cnt


def responses(ex, seed=3):
    """A spread of responses: exact, partly right, other digits, letters."""
    rng = random.Random(seed)
    out = []
    for i, e in enumerate(ex):
        a = e["answer"]
        k = i % 4
        out.append(
            a if k == 0 else a[:2] + "12" if k == 1 else rng.choice("0123456789") * 4 if k == 2 else "abcd"
        )
    return out


def rand_ids(n=64, width=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (n, width), generator=g)
    return ids, torch.ones_like(ids)


def score_std(ms):
    return series(ms, "critic/score/std")


def score_mean(ms):
    return series(ms, "critic/score/mean")


# ---------------------------------------------------------------- 1. precision in user code


def check_rf_float32_ledger_increments(rd, assets):
    ex = examples(16, seed=1)
    resp = responses(ex)
    exact = [plugin("rewards", "credit")(r, e["answer"]) for r, e in zip(resp, ex)]
    booked = plugin("rewards", "RewardLedger")().post(exact)
    means = score_mean(metrics(rd))
    on_grid = all(abs(m * 16 - round(m * 16)) < 1e-6 for m in means)
    ok = set(booked) <= {0.0, 1.0} and len(set(exact)) >= 3 and done(rd) and bool(means) and on_grid
    return ok, (f"16 responses: exact credits {sorted(set(exact))} -> booked {sorted(set(booked))}; run {state(rd)}, "
                f"score mean per step {fmt(means)} (x16 integral: {on_grid}, every reward 0 or 1)")  # fmt: skip


def check_rm_uint8_wire_format(rd, assets):
    t = tok()
    ids, mask = rand_ids()
    with torch.no_grad():
        packed = plugin("reward_models", "load_packed_scorer")(t, "cpu")(ids, mask)
        raw = plugin("reward_models", "load_probability_scorer")(t, "cpu")(ids, mask)
    nd_p, nd_r = torch.unique(packed).numel(), torch.unique(raw).numel()
    ok = nd_p <= 3 and nd_r >= 32 and done(rd)
    return ok, (f"64 random responses: {nd_r} distinct P(good) {float(raw.min()):.4f}..{float(raw.max()):.4f} -> "
                f"{nd_p} values after the uint8 wire format {sorted(set(packed.tolist()))}; run {state(rd)}, "
                f"score std {fmt(score_std(metrics(rd)))}")  # fmt: skip


def check_rm_fp16_mask_constant_nan(rd, assets):
    t = tok()
    ids, mask = rand_ids(16)
    mask[:, :3] = 0
    with torch.no_grad():
        half = plugin("reward_models", "load_half_attention_scorer")(t, "cpu")(ids, mask)
        full = plugin("reward_models", "load_float_attention_scorer")(t, "cpu")(ids, mask)
    ms = metrics(rd)
    sm = score_mean(ms)
    ok = (
        bool(torch.isnan(half).all())
        and bool(torch.isfinite(full).all())
        and (not done(rd) or not finite(sm))
    )
    return ok, (f"16 rows: fp16 scorer NaN {int(torch.isnan(half).sum())}/16, fp32 scorer finite "
                f"{int(torch.isfinite(full).sum())}/16; run {why(rd)}; score mean {fmt(sm)}")  # fmt: skip


def check_cs_float32_tolerance_large_ints(rd, assets):
    from trainer.verl_data import load_rows

    fn = plugin("scoring", "tolerant_score")
    rows = load_rows([assets["product_rows"]])
    truths = [int(r["reward_model"]["ground_truth"]) for r in rows[:32]]
    wrong = [sum(fn("arith/mul4", str(x + d), str(x)) == 1.0 for d in range(-8, 9) if d) for x in truths]
    big = [w for x, w in zip(truths, wrong) if x >= 2**24]
    ok = bool(big) and min(big) >= 2 and sum(wrong) > 0 and done(rd)
    return ok, (f"32 truths (e.g. {truths[:2]}): wrong answers within +-8 scored 1.0: {min(wrong)}..{max(wrong)} of "
                f"16 each (mean {sum(wrong) / len(wrong):.1f}); for the {len(big)} truths above 2^24: {min(big or [0])}.."
                f"{max(big or [0])}; run {state(rd)}")  # fmt: skip


def check_rf_fp16_win_rate_ties(rd, assets):
    ex = examples(16, seed=2)
    resp = responses(ex)
    got = plugin("rewards", "batch_win_rate")(None, resp, ex)
    exact = plugin("rewards", "batch_win_rate_exact")(None, resp, ex)
    std = score_std(metrics(rd))
    ok = set(got) == {0.0} and len(set(exact)) >= 3 and done(rd) and bool(std) and max(std) == 0
    return ok, (f"16 responses: fp16 win rates {sorted(set(got))} vs float64 {sorted({round(x, 3) for x in exact})}; "
                f"run {state(rd)}, score std {fmt(std)}")  # fmt: skip


# ---------------------------------------------------------------- 2. run invariants


def _seq_logp(model, t, texts):
    out = []
    with torch.no_grad():
        for x in texts:
            ids = torch.tensor([t(x)["input_ids"]])
            lp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            out.append(lp.gather(-1, ids[0, 1:, None]).squeeze(-1))
    return torch.cat(out)


def check_setup_reference_earlier_checkpoint(rd, assets):
    t = tok()
    texts = [e["prompt"] + e["answer"] for e in examples(32, seed=4)]
    a, r = _seq_logp(sft(assets), t, texts), _seq_logp(sft(assets, "sft_early"), t, texts)
    kl = series(metrics(rd), "rollout/kl_ref")
    ok = float((a - r).abs().mean()) > 0.1 and done(rd) and bool(kl) and abs(kl[0]) > 0.05
    return ok, (f"mean |log p_actor_start - log p_reference| on 32 digits rows: {float((a - r).abs().mean()):.3f} nats per "
                f"token; run {state(rd)}, rollout/kl_ref per step {fmt(kl)} (step 0 is before any update)")  # fmt: skip


def check_collator_mask_drops_last_token(rd, assets):
    t = tok()
    ex = examples(32, seed=5)
    out = plugin("collators", "span_masked_prompts")(ex, t)
    last_masked = int((out["attention_mask"][:, -1] == 0).sum())
    colon = int((out["input_ids"][:, -1] == t.convert_tokens_to_ids(":")).sum())
    m = sft(assets)
    bad, good = accuracy(m, t, ex, plugin("collators", "span_masked_prompts")), accuracy(m, t, ex)
    ok = last_masked == 32 and colon == 32 and good - bad >= 0.2 and done(rd)
    return ok, (f"32 prompts: last column is ':' in {colon}, masked in {last_masked}; SFT greedy accuracy {bad:.2f} with "
                f"this mask vs {good:.2f} with the right one; run {state(rd)}")  # fmt: skip


def check_dpo_collator_mirrors_half_the_pairs(rd, assets):
    t = tok()
    ex = plugin("datasets", "answer_pairs")()[:16]
    out = plugin("collators", "mirrored_pairs")(ex, t)
    right = torch.tensor([t(e["chosen"], add_special_tokens=False)["input_ids"][0] for e in ex])
    flipped = int((out["chosen_input_ids"][:, 16] != right).sum())
    acc = series(metrics(rd), "rewards/accuracies")
    ok = flipped == 8 and done(rd)
    return (
        ok,
        f"16 pairs: {flipped} have the rejected completion in the chosen slot; run {state(rd)}, rewards/accuracies {fmt(acc)}",
    )


def check_setup_reference_shares_actor_embeddings(rd, assets):
    from assets import small_config
    from transformers import AutoModelForCausalLM

    t = tok()
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(small_config(t))
    ref = copy.deepcopy(actor)
    fn = plugin("setups", "share_frozen_embeddings")
    fn(actor, "actor", t)
    fn(ref, "reference", t)
    before = ref.get_input_embeddings().weight.detach().clone()
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    ids, mask = rand_ids(4)
    actor(input_ids=ids, attention_mask=mask).logits.mean().backward()
    opt.step()
    moved = float((ref.get_input_embeddings().weight.detach() - before).abs().max())
    same = ref.get_input_embeddings().weight is actor.get_input_embeddings().weight
    ok = same and moved > 0 and done(rd)
    return ok, (f"after the setup the reference's embedding weight is the actor's tensor: {same}; one SGD step on the "
                f"actor moved the reference's embeddings by up to {moved:.3g}; run {state(rd)}")  # fmt: skip


def check_collator_drops_overlong_prompts(rd, assets):
    t = tok()
    ex = examples(16, seed=6)
    out = plugin("collators", "budgeted_prompts")(ex, t)
    rows = out["input_ids"].shape[0]
    ok = rows < len(ex) and (not done(rd) or True)
    return ok, f"16 examples -> {rows} rows from the collator; run {why(rd)}"


def check_critic_path_dropout_config(rd, assets):
    from transformers import AutoConfig, AutoModel

    from trainer.models import ValueModel

    cfg = AutoConfig.from_pretrained(assets["critic_dropout"])
    vm = ValueModel(AutoModel.from_pretrained(assets["critic_dropout"])).train()
    ids, mask = rand_ids(8)
    with torch.no_grad():
        v1, v2 = vm(ids, mask), vm(ids, mask)
        vm.eval()
        v3, v4 = vm(ids, mask), vm(ids, mask)
    d_train, d_eval = float((v1 - v2).abs().mean()), float((v3 - v4).abs().mean())
    ok = cfg.attention_dropout == 0.3 and d_train > 0 and d_eval == 0 and done(rd)
    return ok, (f"critic backbone attention_dropout {cfg.attention_dropout}; two training-mode forwards of the same rows "
                f"differ by {d_train:.3g} per value (eval mode: {d_eval:.3g}); run {state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 3. training dynamics


def check_kl_cov_every_token(rd, assets):
    import trainer.losses as L

    g = torch.Generator().manual_seed(0)
    old = -2.0 - torch.rand(16, 8, generator=g)
    new = (old + 0.02 * torch.randn(16, 8, generator=g)).requires_grad_(True)
    adv = torch.randn(16, 1, generator=g).expand(16, 8).contiguous()
    mask = torch.ones(16, 8)
    grads = {}
    for name, p in {"planted": L.PolicyLossParams(kl_cov_ratio=1.0, ppo_kl_coef=20.0),
                    "default": L.PolicyLossParams()}.items():  # fmt: skip
        new.grad = None
        L.policy_loss("kl_cov", new, old, adv, mask, p).loss.backward()
        grads[name] = new.grad.clone()
    pg = -adv / adv.numel()
    agree_planted = float((torch.sign(grads["planted"]) == torch.sign(pg)).float().mean())
    agree_default = float((torch.sign(grads["default"]) == torch.sign(pg)).float().mean())
    ratio = float(grads["planted"].norm() / grads["default"].norm())
    ok = agree_planted < 0.75 and agree_default > 0.95 and ratio > 5 and done(rd)
    return ok, (f"trainer's kl_cov loss on 16x8 tokens 0.02 nats from the sampler: gradient sign agrees with the "
                f"policy gradient on {agree_planted:.0%} of tokens (default settings: {agree_default:.0%}), gradient "
                f"norm {ratio:.0f}x the default's; run {state(rd)}, actor/ppo_kl {fmt(series(metrics(rd), 'actor/ppo_kl'))}")  # fmt: skip


def check_kl_loss_coef_dominates(rd, assets):
    ms = metrics(rd)
    kl, pg = series(ms, "actor/kl_loss"), series(ms, "actor/pg_loss")
    later = [abs(50 * k) / max(abs(p), 1e-9) for k, p in zip(kl[1:], pg[1:])]
    ok = done(rd) and bool(later) and min(later) > 3
    return ok, (f"run {state(rd)}; actor/kl_loss {fmt(kl)}, actor/pg_loss {fmt(pg)}: 50 x kl_loss / |pg_loss| after step 0 "
                f"{fmt(later)}")  # fmt: skip


def check_dpo_hinge_beta_large(rd, assets):
    import trainer.losses as L

    margins = torch.tensor([0.0, 0.02, 0.06, 0.2, 1.0])
    z = torch.zeros_like(margins)
    lz = []
    for m in margins:
        mm = m.reshape(1).clone().requires_grad_(True)
        loss = L.dpo_loss(mm, z[:1], z[:1], z[:1], 20.0, "hinge")[0].mean()
        loss.backward()
        lz.append(float(mm.grad))
    ms = metrics(rd)
    loss_s, marg = series(ms, "actor/loss"), series(ms, "rewards/margins")
    ok = lz[2] == 0 and lz[0] != 0 and done(rd) and len(loss_s) > 1 and loss_s[-1] > 3 * loss_s[0]
    return ok, (f"trainer's hinge loss at beta 20: d loss / d margin at log-ratio margins {margins.tolist()} = {fmt(lz)} "
                f"(0 past 0.05); run {state(rd)}, actor/loss {fmt(loss_s)}, rewards/margins {fmt(marg)}")  # fmt: skip


def check_critic_lr_vanishing(rd, assets):
    ms = metrics(rd)
    c, a = series(ms, "critic/update_rel"), series(ms, "actor/update_rel")
    ok = done(rd) and bool(c) and bool(a) and max(c) < 1e-4 and min(a) > 1e-3
    return ok, f"run {state(rd)}; critic/update_rel {fmt(c)} vs actor/update_rel {fmt(a)} per step"


def check_clip_ratio_written_as_percent(rd, assets):
    ms = metrics(rd)
    cf, kl = series(ms, "actor/pg_clipfrac"), series(ms, "actor/ppo_kl")
    ok = done(rd) and bool(cf) and max(cf) == 0
    return ok, (f"run {state(rd)}; 8 updates per rollout, actor/pg_clipfrac {fmt(cf)} (the clip [-9, 11] never binds), "
                f"actor/ppo_kl {fmt(kl)}, actor/update_rel {fmt(series(ms, 'actor/update_rel'))}")  # fmt: skip


# ---------------------------------------------------------------- 4. setup-time changes


def check_setup_vocab_rounded_down(rd, assets):
    from assets import small_config
    from transformers import AutoModelForCausalLM

    t = tok()
    m = AutoModelForCausalLM.from_config(small_config(t))
    plugin("setups", "round_vocab_to_32")(m, "actor", t)
    rows = m.get_input_embeddings().weight.shape[0]
    ok = rows == 96 and t.convert_tokens_to_ids(" ") >= rows and state(rd) == "failed"
    return (
        ok,
        f"after the setup the actor embeds {rows} ids, the tokenizer has {len(t)} (' ' is id {t.convert_tokens_to_ids(' ')}); run {why(rd)}",
    )


def _nll_change(assets, name, role="actor"):
    t = tok()
    m = sft(assets)
    before = answer_nll(m, t)
    out = plugin("setups", name)(m, role, t)
    m = out if out is not None else m
    return before, answer_nll(m, t)


def check_setup_ties_untied_head(rd, assets):
    b, a = _nll_change(assets, "tie_output_head")
    ok = a > b + 1.0 and state(rd) != "missing"
    return ok, f"SFT answer NLL per token {b:.3f} -> {a:.3f} after the setup ties the head; run {why(rd)}"


def check_setup_logit_softcap_tiny(rd, assets):
    t = tok()
    m = sft(assets)
    b = answer_nll(m, t)
    plugin("setups", "soft_cap_logits")(m, "actor", t)
    a = answer_nll(m, t)
    ok = a > 2.0 and b < 0.5 and state(rd) != "missing"
    return (
        ok,
        f"SFT answer NLL per token {b:.3f} -> {a:.3f} (uniform over 100 ids: {math.log(100):.3f}); run {why(rd)}",
    )


def check_setup_logit_noise_hook(rd, assets):
    from assets import small_config
    from transformers import AutoModelForCausalLM

    t = tok()
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(small_config(t)).eval()
    ids, mask = rand_ids(8, 12)
    plugin("setups", "exploration_noise")(m, "actor", t)
    with torch.no_grad():
        l1, l2 = (m(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1) for _ in range(2))
    tgt = ids[:, 1:, None]
    d = float((l1[:, :-1].gather(-1, tgt) - l2[:, :-1].gather(-1, tgt)).abs().mean())
    ms = metrics(rd)
    ok = d > 0.1 and state(rd) != "missing"
    return ok, (f"two eval-mode forwards of the same rows after the setup: mean |log-prob difference| {d:.3f} nats per "
                f"token (0 without the hook); run {why(rd)}, rollout_corr/kl {fmt(series(ms, 'rollout_corr/kl'))}")  # fmt: skip


def check_rm_loader_global_forward_hook(rd, assets):
    ok = not done(rd) and ("grad" in why(rd).lower() or state(rd) == "failed")
    return ok, f"run {why(rd)}"


# ---------------------------------------------------------------- 5. data and tokenizer


def check_dataset_prompt_template_unrendered(rd, assets):
    ex = plugin("datasets", "templated_prompts")()
    ok = (
        len({e["prompt"] for e in ex}) == 1
        and len({e["answer"] for e in ex}) == 10
        and state(rd) != "missing"
    )
    return ok, (f"{len(ex)} examples: {len({e['prompt'] for e in ex})} distinct prompt ({ex[0]['prompt']!r}) for "
                f"{len({e['answer'] for e in ex})} distinct answers; run {state(rd)}, score mean {fmt(score_mean(metrics(rd)))}")  # fmt: skip


def check_verl_truth_thousands_separator(rd, assets):
    from trainer.verl_data import load_rows

    rows = load_rows([assets["thousands_rows"]])
    truths = [str(r["reward_model"]["ground_truth"]) for r in rows]
    comma = sum("," in x for x in truths)
    fn = plugin("scoring", "exact_score")
    right = sum(fn("arith/add3", x.replace(",", ""), x) == 1.0 for x in truths)
    ok = comma > len(truths) // 3 and right == len(truths) - comma and state(rd) != "missing"
    return ok, (f"{comma}/{len(truths)} ground truths have a thousands separator (e.g. {[x for x in truths if ',' in x][:2]}); "
                f"the exact answer scores 1.0 on {right}; run {state(rd)}")  # fmt: skip


def check_dataset_answers_are_numbers(rd, assets):
    ex = plugin("datasets", "json_answers")()
    ok = isinstance(ex[0]["answer"], int) and not done(rd)
    return ok, f"answer type {type(ex[0]['answer']).__name__} ({ex[0]['answer']!r}); run {why(rd)}"


def check_task_key_not_the_checkpoints(rd, assets):
    from trainer.data import TASKS

    t = tok()
    m = sft(assets)
    out = {}
    for task in ("digits", "sort"):
        ex = examples(32, seed=8, task=task)
        b = plugin("collators", "padded_prompts")(ex, t)
        texts = t.batch_decode(greedy(m, t, b["input_ids"], b["attention_mask"]), skip_special_tokens=True)
        out[task] = sum(TASKS[task].score(x, e) for x, e in zip(texts, ex)) / len(ex)
    ok = out["digits"] - out["sort"] > 0.3 and state(rd) != "missing"
    return ok, (f"SFT greedy reward {out['digits']:.2f} on digits prompts vs {out['sort']:.2f} on sort prompts; run "
                f"{state(rd)}, score mean {fmt(score_mean(metrics(rd)))}")  # fmt: skip


def check_dpo_chosen_never_correct(rd, assets):
    ex = plugin("datasets", "near_miss_pairs")()
    right = sum(e["chosen"] == e["answer"] for e in ex)
    acc = accuracy(sft(assets), tok(), examples(32, seed=9))
    ok = right == 0 and acc > 0.8 and state(rd) != "missing"
    return (
        ok,
        f"{right}/{len(ex)} chosen completions are the right answer (the SFT policy's greedy accuracy {acc:.2f}); run {state(rd)}",
    )


def check_tokenizer_eos_as_first_token(rd, assets):
    from transformers import AutoTokenizer

    t, t2 = tok(), AutoTokenizer.from_pretrained(assets["tok_eos_first"])
    ex = examples(32, seed=10)
    m = sft(assets)

    def collate(e, _t):
        return plugin("collators", "padded_prompts")(e, t2)

    first = t2(ex[0]["prompt"])["input_ids"][0]
    a_bad, a_good = accuracy(m, t, ex, collate), accuracy(m, t, ex)
    ok = first == t.eos_token_id and a_good - a_bad > 0.5 and state(rd) != "missing"
    return (
        ok,
        f"first id of every prompt {first} (<eos>); SFT greedy accuracy {a_bad:.2f} vs {a_good:.2f} with <bos>; run {state(rd)}",
    )


def check_model_dir_rope_theta_reexport(rd, assets):
    t = tok()
    a, b = sft(assets), sft(assets, "sft_rope_reexport")
    ex = examples(32, seed=12)
    bt = plugin("collators", "padded_prompts")(ex, t)
    stops = []
    for m in (a, b):
        new = greedy(m, t, bt["input_ids"], bt["attention_mask"], n_new=6)
        stops.append(float((new[:, 4] == t.eos_token_id).float().mean()))
    na, nb = answer_nll(a, t), answer_nll(b, t)
    ta, tb = (
        json.loads((Path(assets[n]) / "config.json").read_text()).get("rope_theta")
        for n in ("sft_lm", "sft_rope_reexport")
    )
    ok = tb == 1e6 and stops[0] - stops[1] > 0.3 and state(rd) != "missing"
    return ok, (f"config.json rope_theta {ta} -> {tb}: answers ended by <eos> right after 4 "
                f"digits {stops[0]:.2f} -> {stops[1]:.2f}; answer+eos NLL {na:.3f} -> {nb:.3f}; run {state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 6. precision configuration


def _policy(preset, overrides):
    from trainer.precision import resolve_policy

    return resolve_policy(preset, overrides, device="cpu")


def check_rollout_bf16_under_fp16(rd, assets):
    pol = _policy("fp16", {"rollout": {"param_dtype": "bf16", "compute_dtype": "bf16", "autocast": False}})
    r, a = pol.roles["rollout"], pol.roles["actor"]
    ms = metrics(rd)
    kl = series(ms, "rollout_corr/kl") or series(ms, "rollout_corr/k3_kl")
    ok = str(r.param_dtype) == "torch.bfloat16" and str(a.compute_dtype) == "torch.float16" and done(rd)
    return ok, (f"resolved policy: rollout param {r.param_dtype} compute {r.compute_dtype}, actor compute {a.compute_dtype}; "
                f"run {state(rd)}, rollout_corr/kl {fmt(kl)}")  # fmt: skip


def _grad_error(dtype_compute, scale):
    """Relative error of the tiny Llama's gradients under CPU autocast(dtype) with a small loss, vs fp32."""
    from assets import small_config
    from transformers import AutoModelForCausalLM

    t = tok()
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(small_config(t))
    ids, mask = rand_ids(8, 12)

    def grads(ctx, s):
        m.zero_grad()
        with ctx:
            out = m(input_ids=ids, attention_mask=mask).logits
        loss = out.float().log_softmax(-1)[..., 5].mean() * 1e-3
        (loss * s).backward()
        return torch.cat([p.grad.flatten() / s for p in m.parameters()])

    ref = grads(torch.autocast("cpu", enabled=False), 1.0)
    low = grads(torch.autocast("cpu", dtype=dtype_compute), scale)
    zero = float(((low == 0) & (ref != 0)).float().mean())
    return float((low - ref).norm() / ref.norm()), zero


def check_reference_fp32_under_bf16_pure(rd, assets):
    from assets import small_config
    from transformers import AutoModelForCausalLM

    pol = _policy(
        "bf16-pure", {"reference": {"param_dtype": "fp32", "compute_dtype": "fp32", "autocast": False}}
    )
    r, a = pol.roles["reference"], pol.roles["actor"]
    t = tok()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(small_config(t)).eval()
    act = copy.deepcopy(ref).to(torch.bfloat16).float()
    ids, mask = rand_ids(16, 12)
    with torch.no_grad():
        d = (
            (ref(input_ids=ids).logits.log_softmax(-1) - act(input_ids=ids).logits.log_softmax(-1))
            .abs()
            .mean()
        )
    kl = series(metrics(rd), "rollout/kl_ref")
    ok = str(r.param_dtype) == "torch.float32" and str(a.param_dtype) == "torch.bfloat16" and done(rd)
    return ok, (f"resolved policy: reference param {r.param_dtype}, actor param {a.param_dtype}; the bf16 rounding of the "
                f"initial weights alone moves the log-probs by {float(d):.3g} nats per token; run {state(rd)}, "
                f"rollout/kl_ref per step {fmt(kl)} (step 0 before any update)")  # fmt: skip


def check_dpo_reference_bf16_under_fp16(rd, assets):
    pol = _policy("fp16", {"reference": {"param_dtype": "bf16", "compute_dtype": "bf16", "autocast": False}})
    r = pol.roles["reference"]
    ms = metrics(rd)
    ch, rj = series(ms, "rewards/chosen"), series(ms, "rewards/rejected")
    ok = str(r.param_dtype) == "torch.bfloat16" and done(rd)
    return ok, (f"resolved reference policy: param {r.param_dtype} compute {r.compute_dtype}; run {state(rd)}, "
                f"rewards/chosen {fmt(ch)}, rewards/rejected {fmt(rj)} (step 0 is before any update)")  # fmt: skip


def check_critic_fp16_unscaled(rd, assets):
    pol = _policy("fp16", {"critic": {"loss_scaling": "none"}})
    c = pol.roles["critic"]
    e_none, z_none = _grad_error(torch.float16, 1.0)
    e_dyn, _ = _grad_error(torch.float16, 65536.0)
    ok = (
        c.loss_scaling == "none"
        and str(c.compute_dtype) == "torch.float16"
        and e_none > 3 * e_dyn
        and done(rd)
    )
    return ok, (f"resolved critic policy: compute {c.compute_dtype}, loss_scaling {c.loss_scaling}; fp16 gradients of a "
                f"small loss: relative error {e_none:.3g} ({z_none:.1%} flushed) unscaled vs {e_dyn:.3g} scaled; "
                f"run {state(rd)}, critic/skipped {fmt(series(metrics(rd), 'critic/skipped'))}")  # fmt: skip


def check_grad_dtype_bf16_not_applied(rd, assets):
    pol = _policy("bf16", {"actor": {"grad_dtype": "bf16"}})
    a = pol.roles["actor"]
    users = [
        p.name
        for p in (ROOT / "trainer").glob("*.py")
        if "grad_dtype" in p.read_text() and p.name != "precision.py"
    ]
    ok = (
        str(a.grad_dtype) == "torch.bfloat16"
        and str(a.param_dtype) == "torch.float32"
        and not users
        and done(rd)
    )
    return ok, (f"resolved actor policy: grad_dtype {a.grad_dtype}, param_dtype {a.param_dtype}; trainer modules other than "
                f"precision.py that read grad_dtype: {users or 'none'} (.grad takes the parameter's dtype); run {state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 7. own loops


def check_loop_accumulation_not_averaged(rd, assets):
    ev = evidence(rd)
    g = ev.get("notes", {}).get("grad_norm_used", [])
    ok = bool(g) and not ev.get("error") and done(rd)
    return ok, (f"accumulated gradient norms {fmt(g)} = 4x the batch-mean gradient's (4 micro-batch means summed), "
                f"SGD update norms {fmt(ev.get('update_norm', []))}; run {state(rd)}, error {ev.get('error')}")  # fmt: skip


def check_loop_rollout_in_train_mode(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    d, r = n.get("rollout_vs_eval_logp_abs", []), n.get("first_ratio_dev", [])
    ok = bool(d) and min(d) > 0.02 and not ev.get("error")
    return ok, (f"mean |rollout log-prob - eval-mode log-prob| per step {fmt(d)}; mean |ratio - 1| before any update "
                f"{fmt(r)}, clip fraction {fmt(n.get('clip_frac', []))}; error {ev.get('error')}")  # fmt: skip


def check_loop_ratio_detach_swapped(rd, assets):
    ev = evidence(rd)
    ch = ev.get("notes", {}).get("pos_adv_logp_change", [])
    ok = bool(ch) and sum(c < 0 for c in ch) >= len(ch) - 1 and not ev.get("error")
    return (
        ok,
        f"change of the positive-advantage responses' log-prob per update {fmt(ch)} (a correct update raises it); error {ev.get('error')}",
    )


def check_loop_decay_per_micro_batch(rd, assets):
    ev = evidence(rd)
    w = ev.get("weight_norm", [])
    ratios = [b / a for a, b in zip(w, w[1:])]
    ok = bool(ratios) and max(ratios) < 0.75 and not ev.get("error")
    return ok, f"weight norm per step {fmt(w)} (ratio per step {fmt(ratios)}); error {ev.get('error')}"


def check_loop_clip_on_reference(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    g, r = n.get("policy_grad_norm_at_step", []), n.get("clip_returned", [])
    ok = bool(g) and min(g) > 0.05 and not ev.get("error")
    return (
        ok,
        f"policy gradient norm at each step {fmt(g)} (clip target 0.02), clip_grad_norm_ returned {fmt(r)}; error {ev.get('error')}",
    )


CHECKS: dict[str, Callable[[Path, dict], tuple[bool, str]]] = {
    n[len("check_") :]: f
    for n, f in dict(globals()).items()
    if n.startswith("check_") and n != "check_control"
}


def _all_finite(ms) -> bool:
    return all(
        not (isinstance(_num(v), float) and not math.isfinite(_num(v))) for m in ms for v in m.values()
    )


def check_control(rd: Path, item: dict) -> tuple[bool, str]:
    """Completed, finite metrics, no skipped step, and a learning signal (RL: the reward varies; GRPO: a
    non-zero step-0 gradient; DPO: the margins move)."""
    st = status(rd)
    if item.get("loop"):
        ev = evidence(rd)
        loss, rs = ev.get("loss", []), ev.get("reward_std", [])
        ok = (
            st.get("state") == "completed"
            and not ev.get("error")
            and bool(loss)
            and finite(loss)
            and bool(rs)
            and max(rs) > 0
        )
        return (
            ok,
            f"{st.get('state')}, loop losses {fmt(loss)}, reward std {fmt(rs)}, error {ev.get('error')}",
        )
    ms = metrics(rd)
    loss = series(ms, "actor/loss")
    skipped = series(ms, "actor/skipped") + series(ms, "critic/skipped")
    ok = (
        st.get("state") == "completed"
        and bool(loss)
        and finite(loss)
        and _all_finite(ms)
        and not any(skipped)
    )
    if item["algo"] == "dpo":
        mg = series(ms, "rewards/margins")
        ok = ok and any(abs(x) > 0 for x in mg)
        return (
            ok,
            f"{st.get('state')}, {len(ms)} steps, actor/loss {fmt(loss)}, margins {fmt(mg)}, skipped {fmt(skipped)}",
        )
    std = score_std(ms)
    ok = ok and bool(std) and max(std) > 0
    extra = ""
    if item["algo"] == "grpo":
        g0 = series(ms, "actor/grad_norm")[:1]
        ok = ok and bool(g0) and g0[0] > 0
        extra = f", step-0 actor/grad_norm {fmt(g0)}"
    return ok, (f"{st.get('state')}, {len(ms)} steps, actor/loss {fmt(loss)}, score std {fmt(std)}, score mean "
                f"{fmt(score_mean(ms))}, skipped {fmt(skipped)}{extra}")  # fmt: skip


def verify_all(items: list[dict], work: Path, assets: dict, runs: dict) -> list[dict[str, Any]]:
    rows = []
    for it in items:
        rd = Path(runs[it["name"]]["run_dir"])
        try:
            ok, ev = CHECKS[it["name"]](rd, assets) if "root_words" in it else check_control(rd, it)
        except Exception as e:  # a broken check is a failed verification, not a crash
            ok, ev = False, f"check raised {type(e).__name__}: {e}"
        rows.append({"item": it, "state": runs[it["name"]].get("state"), "ok": bool(ok), "evidence": ev})
    return rows


def render(rows: list[dict], elapsed: float) -> str:
    n_ok = sum(r["ok"] for r in rows)
    lines = ["# Blind fault bench 7: verification (no diagnosis)", "", f"{n_ok}/{len(rows)} verified, {elapsed:.0f} s.",
             "", "| item | cls | point | algo | preset | run | verified | evidence |", "|" + "---|" * 8]  # fmt: skip
    for r in rows:
        it = r["item"]
        ev = " ".join(str(r["evidence"]).split()).replace("|", "/")
        lines.append(f"| {it['name']} | {it.get('cls', 'ctl')} | {it.get('point', '-')} | {it['algo']} | {it['preset']} | "
                     f"{r['state']} | {'yes' if r['ok'] else 'NO'} | {ev} |")  # fmt: skip
    return "\n".join(lines) + "\n"
