"""Checks that each planted fault of the third blind bench really happens, without diagnosing: the run
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
    spec = importlib.util.spec_from_file_location(f"_verify3_{module}", path)
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


# ---------------------------------------------------------------- 1. precision in user code


def check_rf_fp16_log_sigmoid(rd, assets):
    fn = plugin("rewards", "judge_log_likelihood_reward")
    rng = random.Random(0)
    ex = digit_examples(16)
    r = fn(None, [random_text(rng) for _ in ex], ex)
    n_inf = int(torch.isinf(r).sum())
    ms = metrics(rd)
    score = series(ms, "critic/score/mean") or series(ms, "reward/mean")
    ok = n_inf > 0 and (not _finite(score) or _state(rd) == "failed")
    return (
        ok,
        f"plug-in on 16 random responses: {n_inf} -inf rewards; run {_state(rd)}, score/mean {_fmt(score)}",
    )


def check_collator_uint8_bitwise_not(rd, assets):
    fn = plugin("collators", "compact_mask_prompts")
    out = fn(digit_examples(8), char_tok())
    m = out["attention_mask"]
    vals = sorted(set(m.flatten().tolist()))
    ok = m.dtype == torch.uint8 and vals == [254, 255] and _state(rd) in ("completed", "failed")
    return ok, f"collator mask dtype {m.dtype}, values {vals}; run {_state(rd)}"


def check_cs_numpy_bool_sum(rd, assets):
    fn = plugin("verl_scoring", "compute_score")
    right = fn("arith/add", "7", "7")  # all three checks pass: 3/3 meant
    two = fn("arith/add", "3", "7")  # two pass: 2/3 meant
    values = sorted({round(fn("arith/add", s, "7"), 4) for s in ["7", "3", "abc", "12 5", "x7", "ab 9 cd"]})
    ok = abs(right - 1 / 3) < 1e-9 and abs(two - 1 / 3) < 1e-9 and _state(rd) == "completed"
    return (
        ok,
        f"score('7' vs 7) = {right:.4f} (meant 1), score('3' vs 7) = {two:.4f} (meant 2/3); values {values}; run {_state(rd)}",
    )


def check_dataset_fp16_answers(rd, assets):
    rows = plugin("data_sources", "numeric_answer_table")()
    wrong = [r for r in rows if r["answer"] != r["prompt"][0] * 4]
    sample = sorted({(r["prompt"][0] * 4, r["answer"]) for r in wrong})[:6]
    ok = len(wrong) / len(rows) > 0.4 and _state(rd) == "completed"
    return ok, f"{len(wrong)}/{len(rows)} answers differ from the digit x4, e.g. {sample}; run {_state(rd)}"


# ---------------------------------------------------------------- 2. violated run invariants


def check_rf_memoised_per_prompt(rd, assets):
    fn = plugin("rewards", "memoised_credit_reward")
    ex = digit_examples(1, seed=99) * 4
    r = fn([ex[0]["prompt"]] * 4, [ex[0]["answer"], "zzzz", "1", ""], ex)
    ms = metrics(rd)
    std = series(ms, "critic/score/std") or series(ms, "reward/std")
    ok = len(set(r)) == 1 and _state(rd) == "completed"
    return (
        ok,
        f"plug-in: exact, garbage and empty responses to one prompt score {r}; run {_state(rd)}, score std {_fmt(std)}",
    )


def check_rf_returns_sorted(rd, assets):
    fn = plugin("rewards", "winsorised_credit_reward")
    ex = digit_examples(8, seed=3)
    resp = [e["answer"] if i % 2 == 0 else "zz" for i, e in enumerate(ex)]
    r = [float(x) for x in fn(None, resp, ex)]
    meant = [1.0 if i % 2 == 0 else 0.0 for i in range(8)]
    ok = r == sorted(r) and r != meant and _state(rd) == "completed"
    return (
        ok,
        f"plug-in on alternating right / wrong responses: {r} (per response: {meant}); run {_state(rd)}",
    )


def check_rf_swallowed_key_error(rd, assets):
    fn = plugin("rewards", "robust_solution_reward")
    ex = digit_examples(8)
    r = fn(None, [e["answer"] for e in ex], ex)
    ms = metrics(rd)
    score = series(ms, "critic/score/mean") or series(ms, "reward/mean")
    ok = all(x == 0.0 for x in r) and bool(score) and all(s == 0 for s in score)
    return ok, f"plug-in on exact answers: {r}; run {_state(rd)}, score/mean {_fmt(score)}"


def check_rm_softmax_over_batch(rd, assets):
    rm = plugin("reward_models", "load_good_bad_classifier")(char_tok(), "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (8, 24), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a = rm(ids, mask)
        ids2 = ids.clone()
        ids2[1:] = torch.randint(4, 100, (7, 24), generator=g)
        b = rm(ids2, mask)
    ok = abs(float(a.sum()) - 1.0) < 1e-5 and abs(float(a[0] - b[0])) > 1e-4 and _state(rd) == "completed"
    return ok, (f"scores sum to {float(a.sum()):.4f}; row 0's score {float(a[0]):.4f} -> {float(b[0]):.4f} when only "
                f"the other rows change; run {_state(rd)}")  # fmt: skip


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


def check_model_dir_head_dropped_tied(rd, assets):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(assets["sft_head_dropped"]).eval()
    tied = torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)
    nll_m, nll_s = _answer_nll(m, char_tok()), _answer_nll(_sft(assets), char_tok())
    ok = tied and nll_m > 3 * nll_s + 0.05 and _state(rd) == "completed"
    return ok, (f"loaded lm_head is the embedding matrix: {tied}; answer NLL/token {nll_m:.3f} as loaded vs "
                f"{nll_s:.3f} as trained; run {_state(rd)}")  # fmt: skip


def check_collator_prompt_has_answer(rd, assets):
    fn = plugin("collators", "formatted_prompts")
    tok = char_tok()
    ex = digit_examples(8)
    out = fn(ex, tok)
    texts = tok.batch_decode(out["input_ids"], skip_special_tokens=True)
    n = sum(t.endswith(e["answer"]) for t, e in zip(texts, ex))
    ok = n == len(ex) and _state(rd) == "completed"
    return ok, f"{n}/{len(ex)} collated prompts end with their answer, e.g. {texts[0]!r}; run {_state(rd)}"


# ---------------------------------------------------------------- 3. training dynamics


def check_vf_coef_zero(rd, assets):
    ms = metrics(rd)
    gn, vl = series(ms, "critic/grad_norm"), series(ms, "critic/vf_loss")
    vals = series(ms, "critic/values/mean")
    ok = bool(gn) and all(g == 0 for g in gn) and any(v > 0 for v in vl)
    return (
        ok,
        f"critic/grad_norm {_fmt(gn)}, critic/vf_loss {_fmt(vl)}, values/mean {_fmt(vals)}; run {_state(rd)}",
    )


def check_dpo_beta_huge(rd, assets):
    ms = metrics(rd)
    loss, margin, gn = series(ms, "actor/loss"), series(ms, "rewards/margins"), series(ms, "actor/grad_norm")
    ok = len(loss) >= 3 and loss[-1] > 10 * loss[0] and margin[-1] < 0
    return (
        ok,
        f"actor/loss {_fmt(loss)}, rewards/margins {_fmt(margin)}, grad_norm {_fmt(gn)}; run {_state(rd)}",
    )


def check_rollout_is_threshold_tiny(rd, assets):
    ms = metrics(rd)
    keys = sorted({k for m in ms for k in m if "is_" in k or "weight" in k})
    found = {k: series(ms, k) for k in keys}
    w = next((v for k, v in found.items() if "mean" in k and ("weight" in k or "is_" in k)), [])
    ok = bool(w) and all(abs(x - 0.01) < 1e-3 for x in w) and _state(rd) == "completed"
    return (
        ok,
        f"importance-weight metrics {', '.join(f'{k} {_fmt(v)}' for k, v in found.items())[:300]}; run {_state(rd)}",
    )


def check_response_length_below_answer(rd, assets):
    ms = metrics(rd)
    ln, score = series(ms, "response_length/mean"), series(ms, "critic/score/mean")
    ok = bool(ln) and all(x <= 3 for x in ln) and all(s <= 0.75 for s in score) and _state(rd) == "completed"
    return (
        ok,
        f"response_length/mean {_fmt(ln)} (an answer is 5 tokens), score/mean {_fmt(score)}; run {_state(rd)}",
    )


def check_loss_scale_factor_tiny(rd, assets):
    ms = metrics(rd)
    sk, sc, loss = series(ms, "actor/skipped"), series(ms, "actor/loss_scale"), series(ms, "actor/loss")
    ok = sum(bool(x) for x in sk) >= 1
    return ok, f"actor/skipped {_fmt(sk)}, loss_scale {_fmt(sc)}, actor/loss {_fmt(loss)}; run {_state(rd)}"


# ---------------------------------------------------------------- 4. setup-time changes


def _tiny(seed: int = 0):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok()))


def _lm_backward(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (4, 12), generator=g)
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def check_setup_lora_zero_init(rd, assets):
    m = _tiny()
    plugin("model_setup", "lora_adapters")(m, "actor", char_tok())
    _lm_backward(m)
    lora = [p for n, p in m.named_parameters() if "lora_" in n]
    gmax = max(float(p.grad.abs().max()) for p in lora)
    ms = metrics(rd)
    gn = series(ms, "actor/grad_norm")
    ok = gmax == 0.0 and bool(gn) and all(x == 0 for x in gn)
    return (
        ok,
        f"direct: {len(lora)} LoRA factors, max |grad| {gmax}; run {_state(rd)}, actor/grad_norm {_fmt(gn)}",
    )


def check_setup_reference_temperature_hook(rd, assets):
    ms = metrics(rd)
    kl = series(ms, "actor/kl_loss") or series(ms, "rollout/kl_ref")
    ok = bool(kl) and kl[0] > 1e-3 and _state(rd) == "completed"
    return ok, f"KL to the reference from step 1 (before any update): {_fmt(kl)}; run {_state(rd)}"


def check_setup_value_bias_huge(rd, assets):
    ms = metrics(rd)
    v, vl, ret = (
        series(ms, "critic/values/mean"),
        series(ms, "critic/vf_loss"),
        series(ms, "critic/returns/mean"),
    )
    ok = bool(v) and v[0] > 10 and _state(rd) == "completed"
    return ok, f"critic/values/mean {_fmt(v)}, returns/mean {_fmt(ret)}, vf_loss {_fmt(vl)}; run {_state(rd)}"


def check_setup_layers_loaded_reversed(rd, assets):
    os.environ.setdefault("BLIND3_SFT_CKPT", assets["sft_lm"])
    m = _tiny()
    plugin("model_setup", "load_converted_sft")(m, "actor", char_tok())
    sft = _sft(assets)
    same = torch.equal(m.model.layers[0].mlp.gate_proj.weight, sft.model.layers[-1].mlp.gate_proj.weight)
    nll_m, nll_s = _answer_nll(m.eval(), char_tok()), _answer_nll(sft, char_tok())
    ok = same and nll_m > 3 * nll_s + 0.05 and _state(rd) == "completed"
    return (
        ok,
        f"loaded layer 0 == SFT's last layer: {same}; answer NLL/token {nll_m:.3f} loaded vs {nll_s:.3f} SFT; run {_state(rd)}",
    )


def check_setup_hook_drops_attention_mask(rd, assets):
    tok = char_tok()
    m = _tiny().eval()
    enc = tok(["1 2:", "3 4 5 6:"], padding=True, return_tensors="pt")
    with torch.no_grad():
        masked = m(**enc).logits[0, -1]
        plugin("model_setup", "mask_free_attention")(m, "actor", tok)
        hooked = m(**enc).logits[0, -1]
        m._forward_pre_hooks.clear()
        unmasked = m(input_ids=enc["input_ids"]).logits[0, -1]
    ok = (
        torch.allclose(hooked, unmasked)
        and not torch.allclose(hooked, masked, atol=1e-4)
        and _state(rd) == "completed"
    )
    return ok, (f"padded row's last logits: hooked == no mask {torch.allclose(hooked, unmasked)}, max |hooked - masked| "
                f"{float((hooked - masked).abs().max()):.3g}; run {_state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 5. data and tokenizer


def check_dataset_aliased_rows(rd, assets):
    rows = plugin("data_sources", "templated_rows")()
    distinct = {(r["prompt"], r["chosen"], r["rejected"]) for r in rows}
    ok = len(distinct) == 1 and len(rows) == 512
    return ok, f"{len(rows)} rows, {len(distinct)} distinct: {sorted(distinct)[:1]}; run {_state(rd)}"


def check_dpo_completions_repeat_prompt(rd, assets):
    rows = plugin("data_sources", "conversation_pairs")()
    tok = char_tok()
    starts = sum(r["chosen"].startswith(r["prompt"]) for r in rows)
    cut = [(tok(r["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:8] for r in rows]
    cut_r = [
        (tok(r["rejected"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:8] for r in rows
    ]
    same = sum(a == b for a, b in zip(cut, cut_r))
    ok = starts == len(rows) and same > 0
    return (
        ok,
        f"{starts}/{len(rows)} chosen start with the prompt; {same} pairs identical in their first 8 tokens; run {_state(rd)}",
    )


def check_tokenizer_other_vocab_order(rd, assets):
    from transformers import AutoTokenizer

    other, own = AutoTokenizer.from_pretrained(assets["tok_sorted_vocab"]), char_tok()
    moved = sum(other.convert_tokens_to_ids(c) != own.convert_tokens_to_ids(c) for c in "0123456789 :")
    sft = _sft(assets)
    acc_other, acc_own = _greedy_accuracy(sft, other), _greedy_accuracy(sft, own)
    ok = len(other) == len(own) and moved >= 10 and acc_other < 0.5 * acc_own and _state(rd) == "completed"
    return ok, (f"same size {len(other)}; {moved}/12 of the task's characters have other ids; SFT greedy accuracy "
                f"{acc_other:.2f} with it vs {acc_own:.2f} with its own tokenizer; run {_state(rd)}")  # fmt: skip


def check_dataset_empty_prompts(rd, assets):
    rows = plugin("data_sources", "parsed_dump_prompts")()
    empty = sum(r["prompt"] == "" for r in rows)
    ok = empty == len(rows) // 4 and _state(rd) in ("completed", "failed")
    return ok, f"{empty}/{len(rows)} prompts empty; run {_status_text(rd)}"


def check_tokenizer_chat_template_field(rd, assets):
    from transformers import AutoTokenizer

    from trainer.verl_data import render_prompt

    tok = AutoTokenizer.from_pretrained(assets["tok_chat_text_field"])
    texts = {
        render_prompt(tok, [{"role": "user", "content": f"{a}+{b}="}], {})[0]
        for a in range(3)
        for b in range(3)
    }
    ok = (
        len(texts) == 1
        and not any(ch.isdigit() for ch in next(iter(texts)))
        and _state(rd) in ("completed", "failed")
    )
    return ok, f"9 different questions render as {len(texts)} prompt(s): {sorted(texts)!r}; run {_state(rd)}"


def check_tokenizer_spaced_decoder(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_spaced_decoder"])
    ids = tok("4444", add_special_tokens=False)["input_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    ms = metrics(rd)
    score = series(ms, "critic/score/mean") or series(ms, "reward/mean")
    ok = text == "4 4 4 4" and _state(rd) == "completed"
    return ok, f"decode(encode('4444')) = {text!r}; run {_state(rd)}, score/mean {_fmt(score)}"


# ---------------------------------------------------------------- 6. precision configuration via suite keys


def check_fp16_growth_interval_one(rd, assets):
    ms = metrics(rd)
    sk, sc = series(ms, "actor/skipped"), series(ms, "actor/loss_scale")
    grew = sum(b > a for a, b in zip(sc, sc[1:]))
    ok = sum(bool(x) for x in sk) >= 1 and grew >= 2
    return ok, f"actor/loss_scale {_fmt(sc)}, actor/skipped {_fmt(sk)}; run {_state(rd)}"


def _rm_scores(path: str, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (32, 24), generator=g)
    with torch.no_grad():
        return rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0].float()


def check_reward_role_bf16_offset_rm(rd, assets):
    s32, s16 = _rm_scores(assets["offset_rm"], torch.float32), _rm_scores(assets["offset_rm"], torch.bfloat16)
    d32, d16 = torch.unique(s32).numel(), torch.unique(s16).numel()
    ms = metrics(rd)
    std = series(ms, "critic/score/std") or series(ms, "reward/std")
    ok = d16 <= 3 and d32 >= 16 and bool(std) and all(s == 0 for s in std) and _state(rd) == "completed"
    return ok, (f"32 random sequences: {d32} distinct scores in fp32 (mean {float(s32.mean()):.3f}, std "
                f"{float(s32.std()):.3g}), {d16} in bf16 {sorted(set(s16.tolist()))}; run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_reward_role_fp16_big_activations(rd, assets):
    s16 = _rm_scores(assets["big_act_rm"], torch.float16)
    s32 = _rm_scores(assets["big_act_rm"], torch.float32)
    ms = metrics(rd)
    score = series(ms, "critic/score/mean") or series(ms, "reward/mean")
    ok = not bool(torch.isfinite(s16).any()) and bool(torch.isfinite(s32).all()) and (
        not _finite(score) or _state(rd) == "failed")  # fmt: skip
    return ok, (f"direct: {int(torch.isfinite(s16).sum())}/32 finite fp16 scores, {int(torch.isfinite(s32).sum())}/32 "
                f"in fp32; run {_status_text(rd)}, score/mean {_fmt(score)}")  # fmt: skip


# ---------------------------------------------------------------- 7. own loops


def check_loop_zero_grad_late(rd, assets):
    ev = evidence(rd)
    g = ev.get("notes", {}).get("grad_norm_after_backward", [])
    ok = bool(g) and max(g) > 0 and ev.get("total_change") == 0.0
    return (
        ok,
        f"grad norm after backward {_fmt(g)}, total weight change {ev.get('total_change')}, error {ev.get('error')}",
    )


def check_loop_clip_scaled_grads(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    pre, sc = n.get("clip_input_norm", []), n.get("loss_scale", [])
    ok = (
        bool(pre)
        and max(pre) > 1000
        and bool(sc)
        and sc[0] >= 1024
        and max(ev.get("update_norm", [1])) < 1e-3
    )
    return (
        ok,
        f"norm clipped (scaled) {_fmt(pre)}, loss scale {_fmt(sc)}, update norms {_fmt(ev.get('update_norm', []))}",
    )


def check_loop_scaler_never_updated(rd, assets):
    ev = evidence(rd)
    err = ev.get("error") or ""
    ok = "update" in err.lower() and len(ev.get("loss", [])) >= 1
    return ok, f"steps done {len(ev.get('loss', []))}, error {err[:160]}"


def check_loop_bf16_logprobs(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    ok = n.get("logp_dtype") == "torch.bfloat16" and max(n.get("logp_vs_fp32_max_abs", [0])) > 1e-3
    return ok, (f"logp dtype {n.get('logp_dtype')}, max |bf16 - fp32 logp| {_fmt(n.get('logp_vs_fp32_max_abs', []))}, "
                f"distinct fraction {_fmt(n.get('logp_distinct_fraction', []))}")  # fmt: skip


def check_loop_scheduler_per_micro_batch(rd, assets):
    ev = evidence(rd)
    lr = ev.get("notes", {}).get("lr_at_step", [])
    ok = bool(lr) and all(x == 0 for x in lr)
    return ok, f"lr when optimizer.step() runs {_fmt(lr)}, update norms {_fmt(ev.get('update_norm', []))}"


def check_loop_rollout_logprobs_as_policy(rd, assets):
    ev = evidence(rd)
    err = ev.get("error") or ""
    ok = "grad" in err.lower() and ev.get("notes", {}).get("rollout_logp_requires_grad") is False
    return (
        ok,
        f"rollout log-probs require grad: {ev.get('notes', {}).get('rollout_logp_requires_grad')}; error {err[:140]}",
    )


def check_loop_loss_sign_flipped(rd, assets):
    ev = evidence(rd)
    ch = ev.get("notes", {}).get("positive_adv_logp_change", [])
    ok = bool(ch) and all(x < 0 for x in ch) and not ev.get("error")
    return ok, f"sequence log-prob change of the positive-advantage responses after each step {_fmt(ch)}"


CHECKS: dict[str, Callable[[Path, dict], tuple[bool, str]]] = {
    name[len("check_") :]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


def check_control(rd: Path, item: dict) -> tuple[bool, str]:
    st = status(rd)
    if item.get("loop"):
        ev = evidence(rd)
        loss = ev.get("loss", [])
        ok = st.get("state") == "completed" and not ev.get("error") and bool(loss) and _finite(loss)
        return ok, f"{st.get('state')}, loop losses {_fmt(loss)}, error {ev.get('error')}"
    ms = metrics(rd)
    loss = series(ms, "actor/loss")
    ok = st.get("state") == "completed" and bool(loss) and _finite(loss)
    return ok, f"{st.get('state')}, {len(ms)} steps, actor/loss {_fmt(loss)}"


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
    lines = ["# Blind fault bench 3: verification (no diagnosis)", "",
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
