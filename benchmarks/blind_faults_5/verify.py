"""Checks that each planted fault of the fifth blind bench really happens, without diagnosing: the run
directory's status.json and training metrics (metrics.jsonl, the trainer's own keys only: no findings, no
audit/, numerics/, mismatch/, plugin/, dynamics/, setup/ or shadow/ metrics), the own loops' evidence files,
and direct checks of the plug-ins, assets and models on sample input. Called by ``run_blind.py --verify``.

Every check returns ``(ok, evidence)``; controls are checked to have completed with finite losses.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
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
"""Metric prefixes written by the auditor: not read here (they are the tool's own measurements)."""


def plugin(module: str, attr: str) -> Callable:
    path = HERE / "plugins" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_verify5_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, attr)


def metrics(rd: Path) -> list[dict[str, Any]]:
    out = []
    p = rd / "metrics.jsonl"
    if not p.is_file():
        return out
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


def _num(v: Any) -> Any:
    if isinstance(v, str):  # non-finite values are written as strings ("NaN", "Infinity")
        try:
            return float(v)
        except ValueError:
            return v
    return v


def series(ms: list[dict], key: str) -> list[Any]:
    return [_num(m[key]) for m in ms if key in m]


def _fmt(xs: list) -> str:
    return "[" + ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in xs) + "]"


def _finite(xs: list) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def _state(rd: Path) -> str:
    return str(status(rd).get("state"))


def _status_text(rd: Path) -> str:
    st = status(rd)
    return f"status {st.get('state')} at {st.get('phase')} step {st.get('step')}: {st.get('reason', '')} {st.get('error', '')}"[
        :220
    ]


def evidence(rd: Path) -> dict:
    """What an own loop measured itself (plugins/own_loops.py writes it beside the run directory)."""
    try:
        return json.loads(rd.with_name(rd.name + ".evidence.json").read_text())
    except (OSError, ValueError):
        return {}


def char_tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def digit_examples(n: int = 16, seed: int = 0) -> list[dict]:
    from trainer.data import TASKS

    return TASKS["digits"].make_examples(n, seed)


def random_text(rng: random.Random, n: int = 8) -> str:
    from trainer.tokenizer import CHARACTERS

    return "".join(rng.choice(CHARACTERS[:-1]) for _ in range(n))


def _sft(assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets["sft_lm"]).eval()


def _greedy_accuracy(model, tok, n: int = 32) -> float:
    """Exact-answer rate of greedy decoding on digits prompts, decoded with ``tok``."""
    ex = digit_examples(n, seed=5)
    enc = tok([e["prompt"] for e in ex], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)  # fmt: skip
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t[:4] == e["answer"] for t, e in zip(texts, ex)) / n


# ---------------------------------------------------------------- shared


def _score_mean(ms):
    return series(ms, "critic/score/mean") or series(ms, "reward/mean")


def _score_std(ms):
    return series(ms, "critic/score/std") or series(ms, "reward/std")


def _keys(ms, *parts):
    return sorted({k for m in ms for k in m if all(p in k for p in parts)})


def _tiny(seed: int = 0):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok()))


def _rand_batch(n: int = 32, width: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (n, width), generator=g)
    return ids, torch.ones_like(ids)


def _answer_nll(model, tok, n: int = 32) -> float:
    """Mean NLL per answer token (answer + eos) of digits prompts under ``model``."""
    ex = digit_examples(n, seed=6)
    total, count = 0.0, 0
    with torch.no_grad():
        for e in ex:
            p = tok(e["prompt"])["input_ids"]
            a = tok(e["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([p + a])
            lp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            tgt = ids[0, 1:]
            total -= float(lp[len(p) - 1 :].gather(-1, tgt[len(p) - 1 :, None]).sum())
            count += len(a)
    return total / count


# ---------------------------------------------------------------- 1. precision in user code


def check_rm_sigmoid_saturated(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch()
    with torch.no_grad():
        p = plugin("reward_models", "load_probability_scorer")(tok, "cpu")(ids, mask)
        lg = plugin("reward_models", "load_logit_scorer")(tok, "cpu")(ids, mask)
    std = _score_std(metrics(rd))
    ok = torch.unique(p).tolist() == [1.0] and torch.unique(lg).numel() >= 16 and bool(std) and max(std) == 0 \
        and _state(rd) == "completed"
    return ok, (f"32 random responses: P(good) values {sorted(set(p.tolist()))} from logits "
                f"{float(lg.min()):.2f}..{float(lg.max()):.2f} ({torch.unique(lg).numel()} distinct); run {_state(rd)}, "
                f"score std {_fmt(std)}")  # fmt: skip


def check_rm_floor_div_pooling(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch()
    with torch.no_grad():
        s = plugin("reward_models", "load_floor_pooled_scorer")(tok, "cpu")(ids, mask)
        t = plugin("reward_models", "load_mean_pooled_scorer")(tok, "cpu")(ids, mask)
    std = _score_std(metrics(rd))
    ok = torch.unique(s).numel() == 1 and torch.unique(t).numel() >= 16 and bool(std) and max(std) == 0 \
        and _state(rd) == "completed"
    return ok, (f"32 random responses: {torch.unique(s).numel()} distinct scores with // pooling vs "
                f"{torch.unique(t).numel()} with /; run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_cs_isclose_rel_tol(rd, assets):
    fn = plugin("verl_scoring", "lenient_score")
    wrong_right = [(t, t - 1) for t in range(1, 19) if fn("arith/add", str(t - 1), str(t)) == 1.0]
    ok = len(wrong_right) >= 5 and fn("arith/add", "16", "17") == 1.0 and _state(rd) == "completed"
    return ok, (f"off-by-one answers scored 1.0 for truths {[t for t, _ in wrong_right]} (e.g. '16' for 17: "
                f"{fn('arith/add', '16', '17')}); run {_state(rd)}")  # fmt: skip


def check_rows_float_repr_truth(rd, assets):
    from trainer.verl_data import load_rows

    rows = load_rows([assets["float_sum_rows"]])
    bad = [r["reward_model"]["ground_truth"] for r in rows if len(str(r["reward_model"]["ground_truth"])) > 3]
    fn = plugin("verl_scoring", "exact_score")
    right = fn("arith/decimal", "0.3", "0.30000000000000004")
    ok = len(bad) / len(rows) > 0.2 and right == 0.0 and _state(rd) == "completed"
    return ok, (f"{len(bad)}/{len(rows)} ground truths are float reprs, e.g. {sorted(set(bad))[:3]}; the right "
                f"answer '0.3' scores {right} against '0.30000000000000004'; run {_state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 2. violated run invariants


def check_collator_mask_padded_other_side(rd, assets):
    tok = char_tok()
    out = plugin("collators", "padded_prompts_with_lengths")(digit_examples(8), tok)
    ids, mask = out["input_ids"], out["attention_mask"]
    on_pad = int(((ids == tok.pad_token_id) & (mask == 1)).sum())
    off_real = int(((ids != tok.pad_token_id) & (mask == 0)).sum())
    ok = on_pad > 0 and off_real > 0 and _state(rd) == "completed"
    return ok, f"8 collated prompts: mask 1 on {on_pad} pad tokens, 0 on {off_real} real tokens; run {_state(rd)}"


def check_setup_neftune_noise(rd, assets):
    m = _tiny(1)
    plugin("model_setup", "neftune_embeddings")(m, "actor", char_tok())
    ids, _ = _rand_batch(4, 12, 1)
    with torch.no_grad():
        m.eval()
        a = m(input_ids=ids).logits.float().log_softmax(-1)
        m.train()
        b = m(input_ids=ids).logits.float().log_softmax(-1)
    gap = float((a - b).abs().mean())
    ms = metrics(rd)
    d = series(ms, "rollout_corr/abs_diff_mean")
    ok = gap > 1e-3 and bool(d) and min(d) > 1e-4 and _state(rd) == "completed"
    return ok, (f"direct: mean |train-mode - eval-mode log-prob| {gap:.3g}; run {_state(rd)}, fp32 rollout vs trainer "
                f"rollout_corr/abs_diff_mean {_fmt(d)} (the fp32 controls: 0)")  # fmt: skip


def check_dpo_unfiltered_equal_pairs(rd, assets):
    rows = plugin("data_sources", "sampled_pairs")()
    same = sum(r["chosen"] == r["rejected"] for r in rows)
    ok = same / len(rows) > 0.3 and _state(rd) == "completed"
    return ok, f"{same}/{len(rows)} pairs have chosen == rejected; run {_state(rd)}"


def check_rf_dedup_responses(rd, assets):
    fn = plugin("rewards", "unique_response_reward")
    ex = [e for e in digit_examples(4, seed=3) for _ in range(4)]
    resp = [e["answer"] for e in ex]
    r = fn(None, resp, ex)
    st = status(rd)
    ok = len(r) < len(resp) and st.get("state") == "failed"
    return ok, f"16 responses (4 per prompt, the same text within a group) got {len(r)} scores; run {_status_text(rd)}"


def check_rf_as_completed_order(rd, assets):
    fn = plugin("rewards", "judge_pool_reward")
    ex = digit_examples(16, seed=7)
    rng = random.Random(1)
    resp = [e["answer"] if i % 3 == 0 else random_text(rng, 4) for i, e in enumerate(ex)]
    want = [plugin("rewards", "partial_credit")(r, e["answer"]) for r, e in zip(resp, ex)]
    got = fn(None, resp, ex)
    moved = sum(abs(a - b) > 1e-9 for a, b in zip(got, want))
    ok = moved >= 4 and sorted(got) == sorted(want) and _state(rd) == "completed"
    return ok, f"16 rows: {moved} rewards on the wrong row (same multiset); returned {_fmt(got[:6])}... vs per-row {_fmt(want[:6])}...; run {_state(rd)}"


# ---------------------------------------------------------------- 3. training dynamics


def check_max_grad_norm_tiny(rd, assets):
    ms = metrics(rd)
    g, c = series(ms, "actor/grad_norm"), series(ms, "critic/grad_norm")
    ok = bool(g) and min(g) > 100 * 1e-4 and bool(c) and min(c) > 100 * 1e-4 and _state(rd) == "completed"
    return ok, f"pre-clip actor/grad_norm {_fmt(g)}, critic/grad_norm {_fmt(c)} against max_grad_norm 1e-4; run {_state(rd)}"


def check_clip_ratio_high_typo(rd, assets):
    import math as _m

    from trainer.losses import PolicyLossParams, ppo_policy_loss

    def grad_at(ratio: float, high: float) -> float:
        lp = torch.tensor([[_m.log(ratio)]], requires_grad=True)
        out = ppo_policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                              PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=high))  # fmt: skip
        out.loss.backward()
        return float(lp.grad.abs().sum())

    g_typo = {r: grad_at(r, 2.8) for r in (1.5, 3.0)}
    g_meant = {r: grad_at(r, 0.28) for r in (1.5, 3.0)}
    ms = metrics(rd)
    kl = series(ms, "actor/ppo_kl")
    ok = all(g > 0 for g in g_typo.values()) and all(g == 0 for g in g_meant.values()) and _state(rd) == "completed"
    return ok, (f"the trainer's vanilla loss, positive advantage: gradient at ratio 1.5 / 3.0 {g_typo[1.5]:.3g} / "
                f"{g_typo[3.0]:.3g} with clip_ratio_high 2.8 (0 / 0 with 0.28: clipped); run {_state(rd)} over 4 epochs, "
                f"ppo_kl {_fmt(kl)}")  # fmt: skip


def check_cliprange_value_zero(rd, assets):
    ms = metrics(rd)
    vc, vl = series(ms, "critic/vf_clipfrac"), series(ms, "critic/vf_loss")
    ok = bool(vc) and max(vc) > 0.2 and _state(rd) == "completed"
    return ok, f"critic/vf_clipfrac {_fmt(vc)}, vf_loss {_fmt(vl)}; run {_state(rd)}"


def check_dpo_apo_down_good_chosen(rd, assets):
    ms = metrics(rd)
    ch, lc, acc = series(ms, "rewards/chosen"), series(ms, "logps/chosen"), series(ms, "rewards/accuracies")
    ok = len(ch) >= 2 and ch[-1] < 0 and lc[-1] < lc[0] and _state(rd) == "completed"
    return ok, f"rewards/chosen {_fmt(ch)}, logps/chosen {_fmt(lc)}, accuracies {_fmt(acc)}; run {_state(rd)}"


def check_temperature_high_sft(rd, assets):
    tok = char_tok()
    sft = _sft(assets)
    acc = _greedy_accuracy(sft, tok)
    score = _score_mean(metrics(rd))
    ent = series(metrics(rd), "actor/entropy")
    ok = bool(score) and max(score) < 0.5 * acc and _state(rd) == "completed"
    return ok, f"SFT greedy accuracy {acc:.2f}; run score/mean at temperature 4 {_fmt(score)}, actor/entropy {_fmt(ent)}; run {_state(rd)}"


def check_bypass_reinforce_no_trust_region(rd, assets):
    ms = metrics(rd)
    cf, kl = series(ms, "actor/pg_clipfrac"), series(ms, "actor/ppo_kl")
    ok = bool(cf) and max(cf) == 0 and bool(kl) and max(abs(k) for k in kl) > 0 and _state(rd) == "completed"
    return ok, f"actor/pg_clipfrac {_fmt(cf)} (nothing clipped over 8 updates a step), ppo_kl {_fmt(kl)}; run {_state(rd)}"


# ---------------------------------------------------------------- 4. setup-time changes


def _nll_after(assets, setup_name, role="actor"):
    sft = _sft(assets)
    before = _answer_nll(sft, char_tok())
    plugin("model_setup", setup_name)(sft, role, char_tok())
    return before, _answer_nll(sft, char_tok())


def check_setup_head_scaled(rd, assets):
    b, a = _nll_after(assets, "calibrated_head")
    ok = a > 10 * b + 0.2 and _state(rd) == "completed"
    return ok, f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}"


def check_setup_unscaled_attention(rd, assets):
    b, a = _nll_after(assets, "unscaled_attention")
    ok = a > 2 * b + 0.05 and _state(rd) == "completed"
    return ok, f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}"


def check_setup_init_weights_wipes(rd, assets):
    b, a = _nll_after(assets, "fresh_linear_layers")
    kl = series(metrics(rd), "actor/reward_kl_penalty")
    ok = a > 3 * b + 0.5 and _state(rd) == "completed"
    return ok, f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}, actor/reward_kl_penalty {_fmt(kl)}"


def check_setup_reentrant_ckpt_frozen_embed(rd, assets):
    import warnings

    m = _tiny(2)
    plugin("model_setup", "checkpointed_frozen_embeddings")(m, "actor", char_tok())
    m.train()
    ids, _ = _rand_batch(4, 12, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    layer = [p.grad for n, p in m.named_parameters() if ".layers." in n]
    head = m.lm_head.weight.grad
    none = sum(g is None or float(g.abs().sum()) == 0 for g in layer)
    ok = none == len(layer) and head is not None and float(head.abs().sum()) > 0 and _state(rd) == "completed"
    return ok, (f"direct: {none}/{len(layer)} decoder-layer parameters get no gradient, lm_head grad "
                f"{'non-zero' if head is not None and float(head.abs().sum()) > 0 else 'zero'}; run {_state(rd)}")  # fmt: skip


def check_setup_embed_scale_hook(rd, assets):
    b, a = _nll_after(assets, "normalised_embeddings")
    ok = a > 2 * b + 0.05 and _state(rd) == "completed"
    return ok, f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}"


# ---------------------------------------------------------------- 5. data and tokenizer


def check_tokenizer_pad_is_digit(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_pad_is_digit"])
    ids = tok("0000", add_special_tokens=False)["input_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    text2 = tok.decode(tok("1020", add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    ok = tok.pad_token == "0" and text == "" and text2 == "12" and _state(rd) == "completed"
    return ok, f"pad token {tok.pad_token!r}; '0000' decodes (special tokens skipped) as {text!r}, '1020' as {text2!r}; run {_state(rd)}"


def check_tokenizer_no_bos(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_no_bos"])
    ids = tok("4 7 1 9:")["input_ids"]
    sft = _sft(assets)
    acc, own = _greedy_accuracy(sft, tok), _greedy_accuracy(sft, char_tok())
    ok = tok.bos_token_id not in ids and acc < own and _state(rd) == "completed"
    return ok, f"'4 7 1 9:' encodes without <bos> ({ids[:3]}...); SFT greedy accuracy {acc:.2f} with it vs {own:.2f} with its own tokenizer; run {_state(rd)}"


def check_collator_strips_cue(rd, assets):
    tok = char_tok()
    ex = digit_examples(32, seed=5)
    out = plugin("collators", "tidy_prompts")(ex, tok)
    texts = tok.batch_decode(out["input_ids"], skip_special_tokens=True)
    sft = _sft(assets)
    with torch.no_grad():
        gen = sft.generate(input_ids=out["input_ids"], attention_mask=out["attention_mask"], max_new_tokens=6,
                           do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    resp = tok.batch_decode(gen[:, out["input_ids"].shape[1] :], skip_special_tokens=True)
    acc = sum(t[:4] == e["answer"] for t, e in zip(resp, ex)) / len(ex)
    own = _greedy_accuracy(sft, tok)
    ok = not any(t.endswith(":") for t in texts) and acc < own and _state(rd) == "completed"
    return ok, f"collated prompts e.g. {texts[0]!r} (no ':'); SFT greedy accuracy on them {acc:.2f} vs {own:.2f}; run {_state(rd)}"


def check_dataset_case_mismatch(rd, assets):
    rows = plugin("data_sources", "display_copy_examples")()
    bad = sum(r["prompt"][:-1] != r["answer"] for r in rows)
    from trainer.data import TASKS

    copied = TASKS["copy"].score(rows[0]["prompt"][:-1], rows[0])
    ok = bad == len(rows) and copied == 0.0 and _state(rd) == "completed"
    return ok, f"{bad}/{len(rows)} prompts' words differ from their answers (case); copying the prompt scores {copied}; run {_state(rd)}"


def check_dataset_conflicting_duplicates(rd, assets):
    rows = plugin("data_sources", "merged_annotations")()
    by: dict[str, set] = {}
    for r in rows:
        by.setdefault(r["prompt"], set()).add(r["answer"])
    conflict = sum(len(v) > 1 for v in by.values())
    ok = conflict / len(by) > 0.5 and _state(rd) == "completed"
    return ok, f"{conflict}/{len(by)} distinct prompts carry two different answers; run {_state(rd)}"


# ---------------------------------------------------------------- 6. precision configuration via suite keys


def check_actor_compute_bf16_under_fp32(rd, assets):
    d = series(metrics(rd), "rollout_corr/abs_diff_mean")
    ok = bool(d) and min(d) > 1e-4 and _state(rd) == "completed"
    return ok, f"rollout_corr/abs_diff_mean {_fmt(d)} (the fp32 controls: 0); run {_state(rd)}"


def check_bf16_pure_weight_decay_lost(rd, assets):
    m = _tiny(4).to(torch.bfloat16)
    w = torch.cat([p.detach().flatten() for p in m.parameters() if p.dim() == 2])
    decayed = (w * (1 - 1e-3 * 0.01)).to(torch.bfloat16)
    kept = float((decayed == w).float().mean())
    ok = kept > 0.99 and _state(rd) == "completed"
    return ok, f"direct: {kept:.4f} of the bf16 weights are unchanged by one decay step w * (1 - lr x wd); run {_state(rd)}"


def check_fp16_critic_points_reward(rd, assets):
    ms = metrics(rd)
    sk, sc, ret = series(ms, "critic/skipped"), series(ms, "critic/loss_scale"), series(ms, "critic/returns/mean")
    ok = sum(bool(x) for x in sk) >= 1
    return ok, f"critic/skipped {_fmt(sk)}, critic/loss_scale {_fmt(sc)}, returns/mean {_fmt(ret)}; run {_state(rd)}"


def check_reward_override_ignored_by_loader(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch()
    rm = plugin("reward_models", "load_calibrated_probability_scorer")(tok, "cpu")
    dtypes = sorted({str(p.dtype) for p in rm.parameters()})
    with torch.no_grad():
        s32 = rm(ids, mask)
        s16 = rm.half()(ids, mask).float()
    std = _score_std(metrics(rd))
    ok = dtypes == ["torch.float32"] and torch.unique(s16).numel() <= 2 and bool(std) and min(std) > 0 \
        and _state(rd) == "completed"
    return ok, (f"the loader's module holds {dtypes} parameters; 32 random responses: {torch.unique(s32).numel()} distinct "
                f"probabilities in fp32, {sorted(set(s16.tolist()))} in fp16; the run's score std {_fmt(std)} "
                f"(non-zero: the scores were computed in fp32, not the configured fp16); run {_state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 7. own loops


def check_loop_optimizer_on_reference_copy(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    ok = ev.get("total_change") == 0.0 and max(n.get("policy_grad_norm", [0])) > 0 and not ev.get("error")
    return ok, (f"policy total change {ev.get('total_change')} over {len(ev.get('loss', []))} steps while its grad norms "
                f"are {_fmt(n.get('policy_grad_norm', []))} (never cleared); reference change {_fmt(n.get('ref_change', []))} "
                f"(no gradient reaches it); error {ev.get('error')}")  # fmt: skip


def check_loop_double_step(rd, assets):
    ev = evidence(rd)
    st = ev.get("notes", {}).get("adam_step_count", [])
    ok = bool(st) and st[-1] > len(st) and not ev.get("error")
    return ok, f"Adam step count after each of {len(st)} batches {_fmt(st)}; error {ev.get('error')}"


def check_loop_kl_reward_not_detached(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    d = n.get("grad_rel_diff_vs_detached", [])
    ok = n.get("adv_requires_grad") is True and bool(d) and max(d) > 0.01 and not ev.get("error")
    return ok, f"advantage requires grad {n.get('adv_requires_grad')}; |g - g_detached| / |g_detached| per step {_fmt(d)}; error {ev.get('error')}"


def check_loop_stale_rollout_copy(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    d, ch = n.get("policy_vs_sampler_logp_abs", []), n.get("sampler_change", [])
    ok = len(d) >= 3 and d[-1] > 5 * d[0] and max(ch) == 0 and ev.get("total_change", 0) > 0
    return ok, (f"mean |policy logp - sampler logp| per step {_fmt(d)} (step 0: the same weights; the gap there is "
                f"generate's position ids and eos masking); sampler weight change {_fmt(ch)}, policy change "
                f"{ev.get('total_change')}")  # fmt: skip


def check_loop_inference_mode_tensors(rd, assets):
    ev = evidence(rd)
    err = str(ev.get("error", ""))
    ok = "Inference tensors" in err and ev.get("notes", {}).get("seq_is_inference") is True
    return ok, f"loop error: {err[:160]}"


def check_loop_temperature_not_applied(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    a, b, c = n.get("loop_vs_rollout_logp_abs", []), n.get("tempered_vs_rollout_logp_abs", []), n.get("clipped_fraction", [])
    ok = bool(a) and a[0] > 0.05 and a[0] > 5 * b[0] and c[0] > 0.05
    return ok, (f"first update: mean |loop logp - rollout logp| {_fmt(a[:1])} vs {_fmt(b[:1])} at the rollout's temperature; "
                f"clipped fraction before any update {_fmt(c[:1])} (all steps {_fmt(c)})")  # fmt: skip


def check_loop_optimizer_recreated(rd, assets):
    ev = evidence(rd)
    st = ev.get("notes", {}).get("adam_step_count", [])
    ok = len(st) >= 2 and all(s == 1 for s in st) and ev.get("total_change", 0) > 0
    return ok, f"Adam step count after each step {_fmt(st)}, update norms {_fmt(ev.get('update_norm', []))}"


CHECKS: dict[str, Callable[[Path, dict], tuple[bool, str]]] = {
    name[len("check_") :]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


def _all_finite(ms: list[dict]) -> bool:
    """No metric of the trainer's own is non-finite (strings "NaN" / "Infinity") at any step."""
    for m in ms:
        for v in m.values():
            v = _num(v)
            if isinstance(v, float) and not math.isfinite(v):
                return False
    return True


def check_control(rd: Path, item: dict) -> tuple[bool, str]:
    """Completed, finite losses and metrics, no skipped step, and (RL) a reward that varies within the batch
    (GRPO: within the groups) at some step; DPO: the margins move."""
    st = status(rd)
    if item.get("loop"):
        ev = evidence(rd)
        loss, rs = ev.get("loss", []), ev.get("reward_std", [])
        ok = (st.get("state") == "completed" and not ev.get("error") and bool(loss) and _finite(loss)
              and not any(ev.get("skipped", [])) and bool(rs) and max(rs) > 0)  # fmt: skip
        return ok, (f"{st.get('state')}, loop losses {_fmt(loss)}, reward std per step {_fmt(rs)}, skipped "
                    f"{ev.get('skipped')}, error {ev.get('error')}")  # fmt: skip
    ms = metrics(rd)
    loss = series(ms, "actor/loss")
    skipped = series(ms, "actor/skipped") + series(ms, "critic/skipped")
    ok = st.get("state") == "completed" and bool(loss) and _finite(loss) and _all_finite(ms) and not any(skipped)
    if item["algo"] == "dpo":
        margin = series(ms, "rewards/margins")
        ok = ok and any(abs(m) > 0 for m in margin)
        return ok, f"{st.get('state')}, {len(ms)} steps, actor/loss {_fmt(loss)}, margins {_fmt(margin)}, skipped {_fmt(skipped)}"
    std = _score_std(ms)
    ok = ok and bool(std) and max(std) > 0
    extra = ""
    if item["algo"] == "grpo":
        # at step 0 the actor is the reference (KL term and its gradient 0): a non-zero gradient there comes from
        # non-zero group-relative advantages, i.e. rewards that vary within some group
        g0 = series(ms, "actor/grad_norm")[:1]
        ok = ok and bool(g0) and g0[0] > 0
        extra = f", step-0 actor/grad_norm {_fmt(g0)}"
    return ok, (f"{st.get('state')}, {len(ms)} steps, actor/loss {_fmt(loss)}, score std {_fmt(std)}, "
                f"score mean {_fmt(_score_mean(ms))}, skipped {_fmt(skipped)}{extra}")  # fmt: skip


def verify_all(items: list[dict], work: Path, assets: dict, runs: dict) -> list[dict[str, Any]]:
    rows = []
    for it in items:
        rd = Path(runs[it["name"]]["run_dir"])
        try:
            if "root_words" in it:
                ok, ev = CHECKS[it["name"]](rd, assets)
            else:
                ok, ev = check_control(rd, it)
        except Exception as e:  # a broken check is a failed verification, not a crash
            ok, ev = False, f"check raised {type(e).__name__}: {e}"
        rows.append({"item": it, "state": runs[it["name"]].get("state"), "ok": bool(ok), "evidence": ev})
    return rows


def render(rows: list[dict], elapsed: float) -> str:
    n_ok = sum(r["ok"] for r in rows)
    lines = ["# Blind fault bench 5: verification (no diagnosis)", "",
             f"{n_ok}/{len(rows)} verified, {elapsed:.0f} s.", "",
             "| item | cls | point | algo | preset | run | verified | evidence |", "|" + "---|" * 8]  # fmt: skip
    for r in rows:
        it = r["item"]
        ev = " ".join(r["evidence"].split()).replace("|", "/")
        lines.append(
            f"| {it['name']} | {it.get('cls', 'ctl')} | {it.get('point', '-')} | {it['algo']} | {it['preset']} | "
            f"{r['state']} | {'yes' if r['ok'] else 'NO'} | {ev} |"
        )
    return "\n".join(lines) + "\n"
