"""Checks that each planted fault of the fourth blind bench really happens, without diagnosing: the run
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
    spec = importlib.util.spec_from_file_location(f"_verify4_{module}", path)
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


def _score_mean(ms):
    return series(ms, "critic/score/mean") or series(ms, "reward/mean")


def _score_std(ms):
    return series(ms, "critic/score/std") or series(ms, "reward/std")


def check_rm_int8_absmax_outlier(rd, assets):
    tok = char_tok()
    q = plugin("reward_models", "load_int8_scorer")(tok, "cpu")
    f = plugin("reward_models", "load_float_scorer")(tok, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (32, 12), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        sq, sf = q(ids, mask), f(ids, mask)
    dq, df = torch.unique(sq).numel(), torch.unique(sf).numel()
    std = _score_std(metrics(rd))
    ok = dq == 1 and df >= 16 and bool(std) and all(s == 0 for s in std) and _state(rd) == "completed"
    return ok, (f"32 random responses: {dq} distinct int8 scores vs {df} unquantised; run {_state(rd)}, "
                f"score std {_fmt(std)}")  # fmt: skip


def check_cs_float32_truth_equality(rd, assets):
    fn = plugin("verl_scoring", "decimal_score")
    truths = [f"0.{k}" for k in range(2, 9)]
    right = {t: fn("arith/decimal", t, t) for t in truths}
    zero = sum(v == 0.0 for v in right.values())
    ok = zero >= 6 and _state(rd) == "completed"
    return ok, f"exact right answers scored {right}; {zero}/7 score 0; run {_state(rd)}"


def check_dataset_g_format_answers(rd, assets):
    rows = plugin("data_sources", "seven_digit_answers")()
    wrong = [r for r in rows if r["answer"] != r["prompt"][0] * 7]
    ok = len(wrong) == len(rows) and _state(rd) == "completed"
    return ok, f"{len(wrong)}/{len(rows)} answers are not the digit x7, e.g. {sorted({r['answer'] for r in wrong})[:4]}; run {_state(rd)}"


def check_dataset_fp16_rating_ties(rd, assets):
    rows = plugin("data_sources", "rated_pairs")()
    wrong = sum(r["chosen"] != r["answer"] for r in rows)
    ok = wrong / len(rows) > 0.25 and _state(rd) == "completed"
    return ok, f"{wrong}/{len(rows)} pairs choose the wrong answer; run {_state(rd)}"


# ---------------------------------------------------------------- 2. violated run invariants


def check_rf_running_max_normaliser(rd, assets):
    mod_fn = plugin("rewards", "running_max_normalised_reward")
    ex = digit_examples(4, seed=9)
    weak = ["1", "zz", "2", "zz"]
    first = list(mod_fn(None, weak, ex))
    mod_fn(None, [e["answer"] for e in ex], ex)  # a batch with exact answers in between
    again = list(mod_fn(None, weak, ex))
    ok = first != again and _state(rd) == "completed"
    return ok, f"same 4 responses scored {_fmt(first)} then {_fmt(again)} after one better batch; run {_state(rd)}"


def check_rf_judge_batch_limit(rd, assets):
    fn = plugin("rewards", "judge_endpoint_reward")
    ex = digit_examples(16, seed=4)
    r = fn(None, [e["answer"] for e in ex], ex)
    ok = r[:8] == [1.0] * 8 and r[8:] == [0.0] * 8 and _state(rd) == "completed"
    return ok, f"16 exact answers scored {r}; run {_state(rd)}"


def check_rf_group_reshape_transposed(rd, assets):
    fn = plugin("rewards", "group_relative_bonus_reward")
    ex = [e for e in digit_examples(4, seed=8) for _ in range(4)]  # the trainer's repeat-interleaved rows
    resp = [e["answer"] if i % 2 == 0 else "zz" for i, e in enumerate(ex)]
    a = fn(None, resp, ex)
    resp2 = list(resp)
    for i in range(4, 16):  # only the responses to the other prompts change
        resp2[i] = "zz" if resp2[i] != "zz" else ex[i]["answer"]
    b = fn(None, resp2, ex)
    ok = abs(a[0] - b[0]) > 1e-6 and _state(rd) == "completed"
    return ok, f"row 0's reward {a[0]:.3f} -> {b[0]:.3f} when only the other prompts' responses change; run {_state(rd)}"


def check_rf_pops_answer(rd, assets):
    fn = plugin("rewards", "answer_popping_reward")
    e = digit_examples(1, seed=12)[0]
    group = [e] * 4
    r = fn(None, [e.get("answer")] * 4, group)
    ms = metrics(rd)
    ok = r[0] == 1.0 and r[1:] == [0.0, 0.0, 0.0] and _state(rd) == "completed"
    return ok, f"4 exact answers to one example (one dict, as GRPO repeats it) scored {r}; run {_state(rd)}, score/mean {_fmt(_score_mean(ms))}"


def check_rf_mean_of_empty_nan(rd, assets):
    fn = plugin("rewards", "per_digit_mean_reward")
    ex = digit_examples(4, seed=13)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = fn(None, ["ab", ex[1]["answer"], "", "x:"], ex)
    n_nan = sum(math.isnan(x) for x in r)
    score = _score_mean(metrics(rd))
    ok = n_nan == 3 and (not _finite(score) or _state(rd) == "failed")
    return ok, f"plug-in on 3 digit-less responses and one exact: {r}; run {_status_text(rd)}, score/mean {_fmt(score)}"


# ---------------------------------------------------------------- 3. training dynamics


def _keys(ms, *parts):
    return sorted({k for m in ms for k in m if all(p in k for p in parts)})


def check_kl_in_reward_and_loss(rd, assets):
    ms = metrics(rd)
    kl_loss = series(ms, "actor/kl_loss")
    kl_rew = {k: series(ms, k) for k in _keys(ms, "kl") if k != "actor/kl_loss"}
    ok = bool(kl_loss) and any(v for v in kl_rew.values()) and _state(rd) == "completed"
    return ok, f"actor/kl_loss {_fmt(kl_loss)}; reward-side KL metrics {', '.join(f'{k} {_fmt(v)}' for k, v in kl_rew.items())[:200]}; run {_state(rd)}"


def check_dpo_robust_eps_near_half(rd, assets):
    ms = metrics(rd)
    loss, margin = series(ms, "actor/loss"), series(ms, "rewards/margins")
    # plain sigmoid DPO near margin 0: loss = log 2 - margin / 2 (slope 0.5 in beta-scaled margins, less in raw)
    slopes = [abs(lo - math.log(2)) / abs(m) for lo, m in zip(loss, margin) if abs(m) > 1e-4]
    ok = bool(slopes) and min(slopes) > 2.5 and _state(rd) == "completed"
    return ok, (f"actor/loss {_fmt(loss)}, rewards/margins {_fmt(margin)}: |loss - log 2| / |margin| {_fmt(slopes)} "
                f"(plain DPO: ~0.5; the DPO controls here 0.45-0.61); run {_state(rd)}")  # fmt: skip


def check_grpo_std_norm_tiebreak(rd, assets):
    ms = metrics(rd)
    std, score = _score_std(ms), _score_mean(ms)
    adv = {k: series(ms, k) for k in _keys(ms, "adv")}
    ok = bool(std) and max(std) < 2e-3 and _state(rd) == "completed"
    return ok, f"score/mean {_fmt(score)}, score std {_fmt(std)}, advantage metrics {', '.join(f'{k} {_fmt(v)}' for k, v in adv.items())[:200]}; run {_state(rd)}"


def check_clip_ratio_low_zero(rd, assets):
    ms = metrics(rd)
    clip = {k: series(ms, k) for k in _keys(ms, "clipfrac")}
    ok = any(v and max(v) > 0.05 for v in clip.values()) and _state(rd) == "completed"
    return ok, f"clip fractions {', '.join(f'{k} {_fmt(v)}' for k, v in clip.items())[:250]}; run {_state(rd)}"


def check_ipo_tau_tiny(rd, assets):
    ms = metrics(rd)
    loss, margin = series(ms, "actor/loss"), series(ms, "rewards/margins")
    ok = bool(loss) and loss[0] > 1000 and _state(rd) == "completed"
    return ok, f"actor/loss {_fmt(loss)}, rewards/margins {_fmt(margin)}; run {_state(rd)}"


# ---------------------------------------------------------------- 4. setup-time changes


def _tiny(seed: int = 0):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok()))


def check_setup_critic_shares_actor_trunk(rd, assets):
    from trainer.models import ValueModel
    from transformers import AutoModel

    from assets import tiny_config

    fn = plugin("model_setup", "shared_trunk")
    actor = _tiny()
    critic = ValueModel(AutoModel.from_config(tiny_config(char_tok())))
    fn(actor, "actor", char_tok())
    fn(critic, "critic", char_tok())
    shared = {id(p) for p in actor.parameters()} & {id(p) for p in critic.parameters()}
    ok = len(shared) > 0 and _state(rd) in ("completed", "failed")
    return ok, f"direct (roles in the trainer's order): {len(shared)} parameter tensors shared by actor and critic; run {_status_text(rd)}"


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


def check_setup_norm_eps_inflated(rd, assets):
    sft = _sft(assets)
    nll_s = _answer_nll(sft, char_tok())
    plugin("model_setup", "stable_norm_eps")(sft, "actor", char_tok())
    nll_m = _answer_nll(sft, char_tok())
    ok = nll_m > 3 * nll_s + 0.05 and _state(rd) == "completed"
    return ok, f"answer NLL/token {nll_m:.3f} after the setup vs {nll_s:.3f} as trained; run {_state(rd)}"


def check_setup_wrapper_without_generate(rd, assets):
    st = status(rd)
    ok = st.get("state") == "failed" and "generate" in str(st.get("error", ""))
    return ok, f"run {_status_text(rd)}"


def check_setup_reward_clamp_saturates(rd, assets):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(assets["positive_rm"], num_labels=1).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (32, 20), generator=g)
    with torch.no_grad():
        raw = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0]
        plugin("model_setup", "calibrated_reward_range")(rm, "reward", char_tok())
        hooked = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0]
    std = _score_std(metrics(rd))
    ok = torch.unique(hooked).numel() == 1 and torch.unique(raw).numel() > 16 and _state(rd) == "completed"
    return ok, (f"32 random responses: raw scores {float(raw.min()):.4f}..{float(raw.max()):.4f}, after the setup's hook "
                f"{sorted(set(hooked.tolist()))}; run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_setup_lora_b_random(rd, assets):
    tok = char_tok()
    m = _tiny().eval()
    ids = torch.randint(4, 100, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = m(input_ids=ids).logits.float().log_softmax(-1)
        plugin("model_setup", "lora_policy")(m, "actor", tok)
        after = m(input_ids=ids).logits.float().log_softmax(-1)
    kl = float((before.exp() * (before - after)).sum(-1).mean())
    ms = metrics(rd)
    klm = series(ms, "actor/kl_loss")
    ok = kl > 1e-3 and bool(klm) and klm[0] > 1e-3 and _state(rd) == "completed"
    return ok, (f"direct: KL(built model || after setup) {kl:.3g} per token; run {_state(rd)}, actor/kl_loss "
                f"{_fmt(klm)} (the first before any update)")  # fmt: skip


# ---------------------------------------------------------------- 5. data and tokenizer


def check_dataset_answers_shifted(rd, assets):
    rows = plugin("data_sources", "two_file_examples")()
    wrong = sum(r["answer"] != r["prompt"][0] * 4 for r in rows)
    ok = wrong / len(rows) > 0.8 and _state(rd) == "completed"
    return ok, f"{wrong}/{len(rows)} answers are not the prompt's first digit x4; run {_state(rd)}"


def check_dataset_float_answer_text(rd, assets):
    rows = plugin("data_sources", "csv_answers")()
    bad = sum(r["answer"].endswith(".0") for r in rows)
    ok = bad == len(rows) and _state(rd) == "completed"
    return ok, f"{bad}/{len(rows)} answers end in '.0', e.g. {rows[0]['answer']!r}; run {_state(rd)}"


def check_tokenizer_strips_spaces(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_strip_spaces"])
    text = tok.decode(tok("4 7 1 9:")["input_ids"], skip_special_tokens=True)
    sft = _sft(assets)
    acc, acc_own = _greedy_accuracy(sft, tok), _greedy_accuracy(sft, char_tok())
    ok = text == "4719:" and acc < acc_own and _state(rd) == "completed"
    return ok, f"'4 7 1 9:' encodes as {text!r}; SFT greedy accuracy {acc:.2f} with it vs {acc_own:.2f} with its own tokenizer; run {_state(rd)}"


def check_dataset_fullwidth_digits(rd, assets):
    rows = plugin("data_sources", "forum_prompts")()
    tok = char_tok()
    ids = [tok(r["prompt"])["input_ids"] for r in rows[:64]]
    unk = sum(i == tok.unk_token_id for r in ids for i in r)
    prompts = {tuple(r) for r in ids}
    ok = unk > 0 and len(prompts) < 10 and _state(rd) == "completed"
    return ok, f"64 prompts: {unk} <unk> ids, {len(prompts)} distinct id sequences; run {_state(rd)}"


def check_tokenizer_template_ignores_generation_prompt(rd, assets):
    from transformers import AutoTokenizer

    from trainer.verl_data import render_prompt

    tok = AutoTokenizer.from_pretrained(assets["tok_chat_no_gen_prompt"])
    text = render_prompt(tok, [{"role": "user", "content": "3+4="}], {})[0]
    ok = "assistant" not in text and _state(rd) == "completed"
    return ok, f"rendered prompt {text!r} (no assistant header); run {_state(rd)}"


def check_dataset_answer_leading_space(rd, assets):
    rows = plugin("data_sources", "solved_lines")()
    from trainer.data import TASKS

    sp = sum(r["answer"].startswith(" ") for r in rows)
    exact = TASKS["digits"].score(rows[0]["answer"].strip(), rows[0])
    ok = sp == len(rows) and exact < 1.0 and _state(rd) == "completed"
    return ok, f"{sp}/{len(rows)} answers start with a space; the exact answer scores {exact:.2f}; run {_state(rd)}"


def check_verl_ground_truth_int(rd, assets):
    from trainer.verl_data import load_rows

    gt = load_rows([assets["int_truth_rows"]])[0]["reward_model"]["ground_truth"]  # as the trainer reads it
    fn = plugin("verl_scoring", "strict_score")
    s = fn("arith/add", str(gt), gt)
    score = _score_mean(metrics(rd))
    ok = not isinstance(gt, str) and s == 0.0 and _state(rd) == "completed"
    return ok, f"ground_truth read back as {type(gt).__name__} {gt!r}; the exact answer scores {s}; run {_state(rd)}, score/mean {_fmt(score)}"


def check_collator_double_bos(rd, assets):
    tok = char_tok()
    out = plugin("collators", "bos_prefixed_prompts")(digit_examples(8), tok)
    ids = out["input_ids"]
    n2 = int((ids == tok.bos_token_id).sum(-1).eq(2).sum())
    sft = _sft(assets)
    with torch.no_grad():
        gen = sft.generate(input_ids=ids, attention_mask=out["attention_mask"], max_new_tokens=6, do_sample=False,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    texts = tok.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
    acc = sum(t[:4] == e["answer"] for t, e in zip(texts, digit_examples(8))) / 8
    own = _greedy_accuracy(sft, tok)
    ok = n2 == 8 and acc < own and _state(rd) == "completed"
    return ok, f"{n2}/8 collated prompts start <bos><bos>; SFT greedy accuracy on them {acc:.2f} (own collation: {own:.2f}); run {_state(rd)}"


# ---------------------------------------------------------------- 6. precision configuration via suite keys


def _rm_scores(path: str, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (32, 24), generator=g)
    with torch.no_grad():
        return rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0].float()


def check_reward_role_fp16_underflow(rd, assets):
    s32, s16 = _rm_scores(assets["tiny_scale_rm"], torch.float32), _rm_scores(assets["tiny_scale_rm"], torch.float16)
    std = _score_std(metrics(rd))
    ok = bool((s16 == 0).all()) and torch.unique(s32).numel() >= 16 and _state(rd) == "completed"
    return ok, (f"32 random sequences: fp32 scores {float(s32.min()):.3g}..{float(s32.max()):.3g} ({torch.unique(s32).numel()} distinct), "
                f"fp16 {sorted(set(s16.tolist()))}; run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_critic_bf16_offset_returns(rd, assets):
    from trainer.models import ValueModel
    from transformers import AutoModel

    from assets import tiny_config

    torch.manual_seed(0)
    critic = ValueModel(AutoModel.from_config(tiny_config(char_tok())))
    plugin("model_setup", "value_bias_at_mean_return")(critic, "critic", char_tok())
    ids = torch.randint(4, 100, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        v32 = critic(ids, torch.ones_like(ids))
        v16 = critic.to(torch.bfloat16)(ids, torch.ones_like(ids))
    err = float((v16.float() - v32).abs().max())
    ms = metrics(rd)
    v, ret = series(ms, "critic/values/mean"), series(ms, "critic/returns/mean")
    ok = err > 0.05 and bool(v) and min(v) > 40 and bool(ret) and min(ret) > 40 and _state(rd) == "completed"
    return ok, (f"direct: the critic's values ({float(v32.min()):.3f}..{float(v32.max()):.3f} in fp32) in bf16 differ by up to "
                f"{err:.3f} ({torch.unique(v16.float()).numel()} distinct vs {torch.unique(v32).numel()}); run {_state(rd)}, "
                f"values/mean {_fmt(v)}, returns/mean {_fmt(ret)}")  # fmt: skip


def check_fp16_token_sum_overflow(rd, assets):
    ms = metrics(rd)
    sk, sc, loss = series(ms, "actor/skipped"), series(ms, "actor/loss_scale"), series(ms, "actor/loss")
    ok = sum(bool(x) for x in sk) >= 1
    return ok, f"actor/skipped {_fmt(sk)}, loss_scale {_fmt(sc)}, actor/loss {_fmt(loss)}; run {_state(rd)}"


def check_bf16_rollout_low_temperature(rd, assets):
    ms = metrics(rd)
    keys = ["rollout_corr/log_ppl_abs_diff", "rollout_corr/kl", "rollout_corr/token_ratio_max"]
    found = {k: series(ms, k) for k in keys}
    d = found["rollout_corr/log_ppl_abs_diff"]
    m = _tiny(3).eval()
    ids = torch.randint(4, 100, (8, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        l32 = m(input_ids=ids).logits.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            l16 = m(input_ids=ids).logits.float()
    gap = {t: float(((l16 / t).log_softmax(-1) - (l32 / t).log_softmax(-1)).abs().mean()) for t in (1.0, 0.1)}
    ok = gap[0.1] > 5 * gap[1.0] and bool(d) and _state(rd) == "completed"
    return ok, (f"direct: mean |bf16 - fp32 token log-prob| {gap[1.0]:.3g} at temperature 1, {gap[0.1]:.3g} at 0.1; run "
                f"{', '.join(f'{k} {_fmt(v)}' for k, v in found.items())}; run {_state(rd)}")  # fmt: skip


# ---------------------------------------------------------------- 7. own loops


def check_loop_never_zero_grad(rd, assets):
    ev = evidence(rd)
    g = ev.get("notes", {}).get("grad_norm_before_backward", [])
    ok = len(g) >= 2 and max(g) > 0 and not ev.get("error")
    return ok, (f"grad norm left in .grad before each backward {_fmt(g)} (non-zero: the previous steps' gradients; "
                f"steps with all-equal rewards have none to leave); error {ev.get('error')}")  # fmt: skip


def check_loop_logprobs_shifted(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    a, b = n.get("loop_vs_rollout_logp_abs", []), n.get("aligned_vs_rollout_logp_abs", [])
    c = n.get("loop_vs_aligned_logp_abs", [])
    ok = bool(a) and all(x > y for x, y in zip(a, b)) and bool(c) and min(c) > 0.05
    return ok, (f"mean |loop logp - aligned logp| {_fmt(c)}; the sampler's own log-probs are farther from the loop's "
                f"({_fmt(a)}) than from the aligned ones ({_fmt(b)})")  # fmt: skip


def check_loop_head_replaced_after_optimizer(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    ch, gn = n.get("head_change", []), n.get("head_grad_norm", [])
    ok = bool(ch) and all(x == 0 for x in ch) and max(gn or [0]) > 0 and n.get("head_in_optimizer") is False
    return ok, f"head in optimizer {n.get('head_in_optimizer')}, head grad norms {_fmt(gn)}, head change {_fmt(ch)}, total change {ev.get('total_change')}"


def check_loop_clip_after_step(rd, assets):
    ev = evidence(rd)
    g = ev.get("notes", {}).get("grad_norm_at_step", [])
    up = ev.get("update_norm", [])
    ok = bool(g) and max(g) > 0.05 and max(up) > 0.5 * 0.05 * 1.01
    return ok, f"grad norm when optimizer.step() runs {_fmt(g)} (bound 0.05), update norms {_fmt(up)} (lr 0.5)"


def check_loop_loss_over_whole_sequence(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    ok = n.get("loss_tokens_per_row", 0) > n.get("response_tokens_per_row", 1) and max(n.get("pad_tokens_in_loss", [0])) > 0
    return ok, f"loss tokens per row {n.get('loss_tokens_per_row')} vs response tokens {n.get('response_tokens_per_row')}; pad tokens in the loss {n.get('pad_tokens_in_loss')}"


def check_loop_step_per_micro_batch(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    st, ad = n.get("optimizer_steps", []), n.get("adam_step_count", [])
    ok = bool(st) and all(x == 4 for x in st) and bool(ad) and ad[-1] == 4 * len(st)
    return ok, f"optimizer steps per batch {_fmt(st)}, Adam step count {_fmt(ad)}"


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
    lines = ["# Blind fault bench 4: verification (no diagnosis)", "",
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
