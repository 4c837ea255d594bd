"""Checks that each planted fault of the sixth blind bench really happens, without diagnosing: the run
directory's status.json and training metrics (metrics.jsonl, the trainer's own keys only: no findings, no
audit/, numerics/, mismatch/, plugin/, dynamics/, setup/ or shadow/ metrics), the own loops' evidence files,
and direct checks of the plug-ins, assets and models on sample input. Called by ``run_blind.py --verify``.

Every check returns ``(ok, evidence)``; controls are checked to have completed with finite metrics, no
skipped step and a reward that varies.
"""

from __future__ import annotations

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
"""Metric prefixes written by the auditor: not read here (they are the tool's own measurements)."""


def plugin(module: str, attr: str) -> Callable:
    key = f"_verify6_{module}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / "plugins" / f"{module}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return getattr(sys.modules[key], attr)


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


def _done(rd: Path) -> bool:
    return _state(rd) == "completed"


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


def _sft(assets, name: str = "sft_lm"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets[name]).eval()


def _generate_accuracy(model, tok, input_ids, attention_mask, ex) -> float:
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    texts = tok.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)
    return sum(t[:4] == e["answer"] for t, e in zip(texts, ex)) / len(ex)


def _greedy_accuracy(model, tok, ex=None, n: int = 32) -> float:
    """Exact-answer rate of greedy decoding on digits prompts (correctly left-padded)."""
    ex = ex or digit_examples(n, seed=5)
    out = plugin("collators", "left_padded_prompts")(ex, tok)
    return _generate_accuracy(model, tok, out["input_ids"], out["attention_mask"], ex)


def _score_mean(ms):
    return series(ms, "critic/score/mean") or series(ms, "reward/mean")


def _score_std(ms):
    return series(ms, "critic/score/std") or series(ms, "reward/std")


def _tiny(seed: int = 0, **kw):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok(), **kw))


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


def _nll_after(assets, setup_name, role="actor"):
    sft = _sft(assets)
    before = _answer_nll(sft, char_tok())
    plugin("model_setup", setup_name)(sft, role, char_tok())
    return before, _answer_nll(sft, char_tok())


def _value_model(seed: int = 0):
    from assets import tiny_config
    from transformers import AutoModel

    from trainer.models import ValueModel

    torch.manual_seed(seed)
    return ValueModel(AutoModel.from_config(tiny_config(char_tok())))


def _rank_corr(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = x.argsort().argsort().float(), y.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def _control_series(work: Path, name: str, key: str) -> list:
    return series(metrics(work / "runs" / name / name), key)


# ---------------------------------------------------------------- 1. precision in user code


def check_rm_serving_autocast_bf16(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch()
    with torch.no_grad():
        s = plugin("reward_models", "load_serving_scorer")(tok, "cpu")(ids, mask)
        t = plugin("reward_models", "load_plain_scorer")(tok, "cpu")(ids, mask)
    std = _score_std(metrics(rd))
    ok = torch.unique(s).numel() <= 4 and torch.unique(t).numel() >= 16 and _done(rd)
    return ok, (f"32 random responses: {torch.unique(s).numel()} distinct scores {sorted(set(s.tolist()))} under the "
                f"loader's bf16 autocast vs {torch.unique(t).numel()} in fp32 ({float(t.min()):.3f}..{float(t.max()):.3f}); "
                f"run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_rf_score_read_from_log_line(rd, assets):
    ex = digit_examples(16, seed=2)
    rng = random.Random(2)
    resp = [e["answer"] if i % 3 == 0 else (e["answer"][:2] + "xy" if i % 3 == 1 else random_text(rng, 4))
            for i, e in enumerate(ex)]  # fmt: skip
    got = plugin("rewards", "judge_logged_reward")(None, resp, ex)
    raw = [plugin("rewards", "judge_probability")(r, e["answer"]) for r, e in zip(resp, ex)]
    std = _score_std(metrics(rd))
    ok = (
        len(set(got)) == 1
        and len({round(x, 6) for x in raw}) >= 3
        and bool(std)
        and max(std) < 1e-6
        and _done(rd)
    )
    return ok, (f"16 responses (exact / half right / noise): rewards {sorted(set(got))} vs judge probabilities "
                f"{sorted({round(x, 4) for x in raw})}; run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_cs_decimal_context_precision(rd, assets):
    from trainer.verl_data import load_rows

    fn = plugin("verl_scoring", "decimal_score")
    rows = load_rows([assets["three_digit_rows"]])
    truths = [int(r["reward_model"]["ground_truth"]) for r in rows[:32]]
    wrong_ok = [sum(fn("arith/add3", str(t + d), str(t)) == 1.0 for d in range(-30, 31) if d) for t in truths]
    ok = min(wrong_ok) >= 5 and fn("arith/add3", "1199", "1234") == 1.0 and _done(rd)
    return ok, (f"for 32 truths (e.g. {truths[:3]}), wrong answers within +-30 scored 1.0: {min(wrong_ok)}..{max(wrong_ok)} "
                f"of 60 each; '1199' for 1234 scores {fn('arith/add3', '1199', '1234')}; run {_state(rd)}")  # fmt: skip


def check_rm_predicted_label_reward(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch()
    with torch.no_grad():
        s = plugin("reward_models", "load_label_scorer")(tok, "cpu")(ids, mask)
        p = plugin("reward_models", "load_good_probability")(tok, "cpu")(ids, mask)
    std = _score_std(metrics(rd))
    ok = (
        torch.unique(s).tolist() == [1.0]
        and torch.unique(p).numel() >= 16
        and bool(std)
        and max(std) == 0
        and _done(rd)
    )
    return ok, (f"32 random responses: labels {sorted(set(s.tolist()))}, P(good) {float(p.min()):.3f}..{float(p.max()):.3f} "
                f"({torch.unique(p).numel()} distinct); run {_state(rd)}, score std {_fmt(std)}")  # fmt: skip


def check_rm_dynamic_int8_quantized(rd, assets):
    tok = char_tok()
    ids, mask = _rand_batch(64)
    with torch.no_grad():
        q = plugin("reward_models", "load_quantized_scorer")(tok, "cpu")(ids, mask)
        f = plugin("reward_models", "load_offset_scorer")(tok, "cpu")(ids, mask)
    err, spread, corr = float((q - f).abs().mean()), float(f.std()), _rank_corr(q, f)
    ok = err > spread and corr < 0.8 and _done(rd)
    return ok, (f"64 random responses: mean |int8 - fp32 score| {err:.4f} vs the fp32 scores' std {spread:.4f}, rank "
                f"correlation {corr:.2f}; run {_state(rd)}, score std {_fmt(_score_std(metrics(rd)))}")  # fmt: skip


# ---------------------------------------------------------------- 2. violated run invariants


def check_dpo_rejected_prompt_rotated(rd, assets):
    tok = char_tok()
    ex = plugin("data_sources", "clean_pairs")(8, 3)
    out = plugin("collators", "paired_rows")(ex, tok)
    differ = int((out["chosen_input_ids"][:, :16] != out["rejected_input_ids"][:, :16]).any(1).sum())
    ok = differ >= 6 and _done(rd)
    return (
        ok,
        f"8 collated pairs: {differ} have a different prompt on the rejected side than on the chosen side; run {_state(rd)}",
    )


def check_dpo_pairs_format_noise_only(rd, assets):
    rows = plugin("data_sources", "formatting_negative_pairs")()
    same = sum(r["rejected"].strip() == r["chosen"] and r["rejected"] != r["chosen"] for r in rows)
    ok = same == len(rows) and _done(rd)
    return (
        ok,
        f"{same}/{len(rows)} pairs: rejected == chosen + whitespace (e.g. {rows[0]['chosen']!r} vs {rows[0]['rejected']!r}); run {_state(rd)}",
    )


def check_rf_scores_against_first_example(rd, assets):
    ex = [e for e in digit_examples(4, seed=4) for _ in range(4)]
    got = plugin("rewards", "first_answer_reward")(None, [e["answer"] for e in ex], ex)
    wrong = sum(g < 1.0 for g, e in zip(got, ex) if e["answer"] != ex[0]["answer"])
    others = sum(e["answer"] != ex[0]["answer"] for e in ex)
    ok = others > 0 and wrong == others and _done(rd)
    return ok, (f"16 exact answers (4 prompts x 4): {wrong}/{others} of those whose answer differs from examples[0]'s score "
                f"< 1 (rewards {_fmt(got)}); run {_state(rd)}")  # fmt: skip


def check_collator_mask_hides_bos(rd, assets):
    tok = char_tok()
    ex = digit_examples(32, seed=5)
    out = plugin("collators", "character_mask_prompts")(ex, tok)
    ids, mask = out["input_ids"], out["attention_mask"]
    bos_hidden = int(((ids == tok.bos_token_id) & (mask == 0)).sum())
    sft = _sft(assets)
    acc = _generate_accuracy(sft, tok, ids, mask, ex)
    own = _greedy_accuracy(sft, tok, ex)
    ok = bos_hidden == len(ex) and acc < own and _done(rd)
    return ok, (f"32 collated prompts: <bos> masked out in {bos_hidden}; SFT greedy accuracy {acc:.2f} with this mask vs "
                f"{own:.2f} with the mask on every real token; run {_state(rd)}")  # fmt: skip


def check_verl_truncation_right_system_prompt(rd, assets):
    from trainer.config import DataConfig
    from trainer.verl_data import prepare_examples

    cfg = DataConfig(
        train_files=assets["sys_prompt_rows"],
        prompt_length=32,
        truncation="right",
        compute_score=str(HERE / "plugins" / "verl_scoring.py") + ":partial_score",
    )
    ex = prepare_examples(cfg, char_tok(), log=lambda s: None)
    keys = [k for k in ex[0] if "ids" in k or k == "prompt"]
    field = "prompt_ids" if "prompt_ids" in ex[0] else keys[0]
    distinct = len({json.dumps(e[field], default=str) for e in ex})
    ok = distinct == 1 and len(ex) > 100 and _done(rd)
    return (
        ok,
        f"{len(ex)} rows rendered and truncated (right, 32): {distinct} distinct prompt ({field}: {str(ex[0][field])[:70]!r}); run {_state(rd)}",
    )


def check_setup_eval_mode_logit_temperature(rd, assets):
    m = _tiny(1)
    plugin("model_setup", "serving_logits")(m, "actor", char_tok())
    ids, _ = _rand_batch(4, 12, 1)
    with torch.no_grad():
        m.eval()
        a = m(input_ids=ids).logits.float().log_softmax(-1)
        m.train()
        b = m(input_ids=ids).logits.float().log_softmax(-1)
    gap = float((a - b).abs().mean())
    d = series(metrics(rd), "rollout_corr/abs_diff_mean")
    ok = gap > 1e-3 and bool(d) and min(d) > 1e-4 and _done(rd)
    return ok, (f"direct: mean |eval-mode - train-mode log-prob| {gap:.3g}; run {_state(rd)}, fp32 rollout vs trainer "
                f"rollout_corr/abs_diff_mean {_fmt(d)}")  # fmt: skip


# ---------------------------------------------------------------- 3. training dynamics


def _vanilla_grad(ratio: float, adv: float, c: float) -> float:
    from trainer.losses import PolicyLossParams, ppo_policy_loss

    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ppo_policy_loss(lp, torch.zeros(1, 1), torch.full((1, 1), adv), torch.ones(1, 1),
                          PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=c))  # fmt: skip
    out.loss.backward()
    return float(lp.grad.abs().sum())


def check_dual_clip_c_near_one(rd, assets):
    g_bad, g_def = _vanilla_grad(1.05, -1.0, 1.01), _vanilla_grad(1.05, -1.0, 3.0)
    low = series(metrics(rd), "actor/pg_clipfrac_lower")
    ok = g_bad == 0 and g_def > 0 and _done(rd)
    return ok, (f"the trainer's vanilla loss, advantage -1, ratio 1.05: gradient {g_bad:.3g} with clip_ratio_c 1.01 vs "
                f"{g_def:.3g} with 3; run {_state(rd)}, actor/pg_clipfrac_lower {_fmt(low)}")  # fmt: skip


def check_dpo_beta_vanishing(rd, assets):
    ms = metrics(rd)
    loss, lc, lr_ = series(ms, "actor/loss"), series(ms, "logps/chosen"), series(ms, "logps/rejected")
    mg = series(ms, "rewards/margins")
    moved = max(abs(lc[-1] - lc[0]), abs(lr_[-1] - lr_[0])) if lc and lr_ else 0.0
    ok = bool(loss) and max(abs(x - math.log(2)) for x in loss) < 1e-3 and moved > 0.05 and _done(rd)
    return ok, (f"actor/loss {_fmt(loss)} (log 2 = 0.6931), rewards/margins {_fmt(mg)}, logps/chosen {_fmt(lc)}, "
                f"logps/rejected {_fmt(lr_)}; run {_state(rd)}")  # fmt: skip


def check_lr_vanishing(rd, assets):
    ms = metrics(rd)
    kl, lr = series(ms, "actor/kl_loss"), series(ms, "actor/lr")
    ok = len(kl) >= 3 and max(abs(x) for x in kl) < 1e-7 and bool(lr) and max(lr) <= 1e-8 and _done(rd)
    return (
        ok,
        f"actor/lr {_fmt(lr)}, actor/kl_loss (actor vs its starting point) {_fmt(kl)}; run {_state(rd)}",
    )


def check_gae_lambda_zero(rd, assets):
    from trainer.losses import compute_gae

    torch.manual_seed(0)
    values, mask = 0.05 * torch.randn(4, 8), torch.ones(4, 8)
    r0, r1 = torch.zeros(4, 8), torch.zeros(4, 8)
    r1[:, -1] = 1.0
    a0, _ = compute_gae(r0, values, mask, 1.0, 0.0)
    a1, _ = compute_gae(r1, values, mask, 1.0, 0.0)
    b0, _ = compute_gae(r0, values, mask, 1.0, 0.95)
    b1, _ = compute_gae(r1, values, mask, 1.0, 0.95)
    early0, early95 = float((a1 - a0)[:, :-1].abs().max()), float((b1 - b0)[:, :-1].abs().max())
    ok = early0 == 0 and early95 > 0.5 and _done(rd)
    return ok, (f"the trainer's GAE, outcome reward 1 on the last token: change of the first 7 tokens' advantages "
                f"{early0:.3g} with lam 0 vs {early95:.3g} with lam 0.95; run {_state(rd)}")  # fmt: skip


def check_kl_loss_k1_estimator(rd, assets):
    from trainer.losses import kl_penalty

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, generator=g, requires_grad=True)
    ref = torch.randn(20, generator=g)
    p = logits.detach().softmax(-1)
    idx = torch.multinomial(p, 200000, replacement=True, generator=g)
    rlp = ref.log_softmax(-1)
    lp = logits.log_softmax(-1)
    true_kl = (lp.exp() * (lp - rlp)).sum()
    (gt,) = torch.autograd.grad(true_kl, logits)
    out = {}
    for est in ("kl", "low_var_kl"):
        lp = logits.log_softmax(-1)
        est_val = kl_penalty(lp[idx], rlp[idx], est).mean()
        (ge,) = torch.autograd.grad(est_val, logits)
        out[est] = float(torch.nn.functional.cosine_similarity(ge, gt, 0)), float(ge.norm() / gt.norm())
    ok = abs(out["kl"][1]) < 0.1 and out["low_var_kl"][0] > 0.5 and _done(rd)
    return ok, (f"on 200000 samples of a categorical policy: |grad of the k1 ('kl') loss| / |grad of the true KL| "
                f"{out['kl'][1]:.3f}, for low_var_kl {out['low_var_kl'][1]:.2f} (cosine {out['low_var_kl'][0]:.2f}); "
                f"run {_state(rd)}, actor/kl_loss {_fmt(series(metrics(rd), 'actor/kl_loss'))}")  # fmt: skip


# ---------------------------------------------------------------- 4. setup-time changes


def check_setup_prunes_last_layer(rd, assets):
    b, a = _nll_after(assets, "drop_last_layer")
    ok = a > 2 * b + 0.05 and _done(rd)
    return ok, f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}"


def check_setup_freeze_tied_embeddings(rd, assets):
    m = _sft(assets, "sft_tied_lm")
    tied = m.get_output_embeddings().weight is m.get_input_embeddings().weight
    plugin("model_setup", "freeze_input_embeddings")(m, "actor", char_tok())
    head_trains = m.get_output_embeddings().weight.requires_grad
    ok = tied and not head_trains and _done(rd)
    return (
        ok,
        f"tied checkpoint: head is the embedding tensor {tied}; after the setup lm_head requires_grad {head_trains}; run {_state(rd)}",
    )


def check_setup_head_eos_logit_bias(rd, assets):
    b, a = _nll_after(assets, "biased_output_head")
    ch = series(metrics(rd), "rewards/chosen")
    ctl = _control_series(rd.parents[2], "ctl_dpo_fp32", "rewards/chosen")
    ok = a > 5 * b and bool(ch) and bool(ctl) and abs(ch[0]) > 1e-3 and abs(ctl[0]) < 1e-6 and _done(rd)
    return ok, (f"answer NLL/token {a:.3f} after the setup vs {b:.3f} as trained; run {_state(rd)}, rewards/chosen "
                f"{_fmt(ch)}; step 0 is before any update, where the fp32 control has {_fmt(ctl[:1])}")  # fmt: skip


def check_setup_freeze_heads_by_name(rd, assets):
    v = _value_model(2)
    plugin("model_setup", "freeze_heads")(v, "critic", char_tok())
    frozen = [n for n, p in v.named_parameters() if not p.requires_grad]
    ok = any("value_head" in n for n in frozen) and _done(rd)
    return (
        ok,
        f"direct: the critic's frozen parameters after the setup {frozen}; run {_state(rd)}, critic/values/mean {_fmt(series(metrics(rd), 'critic/values/mean'))}",
    )


def check_setup_grad_clamp_hooks(rd, assets):
    m = _tiny(3)
    plugin("model_setup", "clamped_gradients")(m, "actor", char_tok())
    ids, _ = _rand_batch(4, 12, 3)
    (m(input_ids=ids).logits.float().logsumexp(-1).mean() * 65536.0).backward()
    g = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    at = float((g.abs() >= plugin("model_setup", "GRAD_CLAMP") * 0.999).float().mean())
    ok = at > 0.5 and _done(rd)
    return (
        ok,
        f"direct: a loss-scaled (x65536) backward: {at:.2f} of the gradient elements sit at the clamp +-1e-3; run {_state(rd)}",
    )


# ---------------------------------------------------------------- 5. data and tokenizer


def check_dataset_prompt_trailing_space(rd, assets):
    tok = char_tok()
    rows = plugin("data_sources", "spaced_prompts")(32, 9)
    plain = [{**r, "prompt": r["prompt"].rstrip()} for r in rows]
    sft = _sft(assets)
    acc, own = _greedy_accuracy(sft, tok, rows), _greedy_accuracy(sft, tok, plain)
    ok = all(r["prompt"].endswith(": ") for r in rows) and acc < own and _done(rd)
    return (
        ok,
        f"prompts end with ': '; SFT greedy accuracy {acc:.2f} on them vs {own:.2f} without the space; run {_state(rd)}",
    )


def check_dataset_labels_reseeded_constant(rd, assets):
    rows = plugin("data_sources", "relabelled_examples")()
    answers, prompts = {r["answer"] for r in rows}, {r["prompt"] for r in rows}
    ok = len(answers) == 1 and len(prompts) > 100 and _done(rd)
    return (
        ok,
        f"{len(rows)} examples, {len(prompts)} distinct prompts, answers {sorted(answers)}; run {_state(rd)}, score mean {_fmt(_score_mean(metrics(rd)))}",
    )


def check_prompt_length_cuts_first_digit(rd, assets):
    tok = char_tok()
    rows = plugin("data_sources", "long_digit_prompts")()
    cut = 0
    for r in rows:
        ids = tok(r["prompt"])["input_ids"]
        kept = tok.decode(ids[-16:], skip_special_tokens=True)
        cut += len(ids) > 16 and not kept.startswith(r["prompt"][0] + " " + r["prompt"][2])
    ok = cut / len(rows) > 0.5 and _done(rd)
    return (
        ok,
        f"{cut}/{len(rows)} prompts longer than 16 tokens lose <bos> and the first digit when their end is kept; run {_state(rd)}",
    )


def check_tokenizer_max_length_truncation(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_max_len6"])
    ex = digit_examples(32, seed=5)
    out = plugin("collators", "truncating_prompts")(ex, tok)
    texts = tok.batch_decode(out["input_ids"], skip_special_tokens=True)
    longest = int(out["attention_mask"].sum(1).max())
    sft = _sft(assets)
    acc = _generate_accuracy(sft, tok, out["input_ids"], out["attention_mask"], ex)
    own = _greedy_accuracy(sft, char_tok(), ex)
    lost = sum(not t.startswith(e["prompt"][0]) for t, e in zip(texts, ex))
    ok = longest <= 6 and lost >= len(ex) // 4 and acc < own and _done(rd)
    return ok, (f"model_max_length {tok.model_max_length}, side {tok.truncation_side}: collated prompts at most {longest} "
                f"tokens, e.g. {texts[0]!r}, {lost}/{len(ex)} without their first digit; SFT greedy accuracy {acc:.2f} "
                f"vs {own:.2f} on full prompts; run {_state(rd)}")  # fmt: skip


def check_dpo_chosen_cut_before_eos(rd, assets):
    tok = char_tok()
    rows = plugin("data_sources", "rationale_pairs")()
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"]) + 1  # noqa: E731 - with eos
    cut_c, cut_r = sum(n(r["chosen"]) > 8 for r in rows), sum(n(r["rejected"]) > 8 for r in rows)
    ok = cut_c == len(rows) and cut_r == 0 and _done(rd)
    return (
        ok,
        f"completion + eos longer than response_length 8: chosen {cut_c}/{len(rows)}, rejected {cut_r}/{len(rows)}; run {_state(rd)}",
    )


def check_num_examples_smoke_test(rd, assets):
    from trainer.config import DataConfig
    from trainer.data import load_examples

    ex = load_examples(DataConfig(num_examples=2), seed=0, pairs=False)
    ok = len(ex) == 2 and _done(rd)
    return (
        ok,
        f"the trainer's examples with num_examples 2: {len(ex)} ({[e['prompt'] for e in ex]}); run {_state(rd)}",
    )


# ---------------------------------------------------------------- 6. precision configuration via suite keys


def check_critic_bf16_weights_verl_lr(rd, assets):
    v = _value_model(5).to(torch.bfloat16)
    w = torch.cat([p.detach().flatten() for p in v.parameters() if p.dim() == 2])
    stepped = (w.float() - 1e-5 * torch.sign(w.float())).to(torch.bfloat16)
    kept = float((stepped == w).float().mean())
    ok = kept > 0.8 and _done(rd)
    return ok, (f"direct: {kept:.3f} of the bf16 critic weights are unchanged by an Adam-sized step of 1e-5; run {_state(rd)}, "
                f"critic/values/mean {_fmt(series(metrics(rd), 'critic/values/mean'))}")  # fmt: skip


def check_optim_state_bf16_not_applied(rd, assets):
    from trainer.common import make_optimizer
    from trainer.precision import resolve_policy

    pol = resolve_policy("bf16", {"actor": {"optim_state_dtype": "bf16"}})["actor"]
    m = _tiny(8).to(pol.param_dtype)
    opt = make_optimizer(m, 1e-3, 0.0, torch.device("cpu"))
    ids, _ = _rand_batch(2, 8, 8)
    m(input_ids=ids).logits.float().mean().backward()
    opt.step()
    moments = sorted(
        {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k.startswith("exp_avg")}
    )
    ok = pol.optim_state_dtype == torch.bfloat16 and moments == ["torch.float32"] and _done(rd)
    return ok, (f"the policy's actor optim_state_dtype {pol.optim_state_dtype}, param_dtype {pol.param_dtype}; the "
                f"trainer's make_optimizer keeps the AdamW moments in {moments}; run {_state(rd)}")  # fmt: skip


def check_critic_compute_bf16_under_fp32(rd, assets):
    v = _value_model(6).eval()
    ids, mask = _rand_batch(8, 12, 6)
    with torch.no_grad():
        a = v(input_ids=ids, attention_mask=mask)
        a = a if isinstance(a, torch.Tensor) else a[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = v(input_ids=ids, attention_mask=mask)
            b = b if isinstance(b, torch.Tensor) else b[0]
    rel = float((a - b.float()).abs().mean() / a.abs().mean())
    ok = rel > 1e-3 and _done(rd)
    return (
        ok,
        f"direct: critic values under bf16 autocast differ from fp32 by {rel:.3%} on average; run {_state(rd)}",
    )


def check_bf16_pure_grad_accumulation_micro1(rd, assets):
    m = _tiny(7).to(torch.bfloat16)
    n = 64
    ids, _ = _rand_batch(n, 12, 7)
    exact = None
    for i in range(n):
        m.zero_grad()
        (m(input_ids=ids[i : i + 1]).logits.float().logsumexp(-1).mean() / n).backward()
        g = torch.cat([p.grad.float().flatten() for p in m.parameters()])
        exact = g if exact is None else exact + g
    m.zero_grad()
    for i in range(n):
        (m(input_ids=ids[i : i + 1]).logits.float().logsumexp(-1).mean() / n).backward()
    acc = torch.cat([p.grad.float().flatten() for p in m.parameters()])
    once = exact.to(torch.bfloat16).float()
    e_acc = float((acc - exact).norm() / exact.norm())
    e_once = float((once - exact).norm() / exact.norm())
    ok = e_acc > 3 * e_once and _done(rd)
    return ok, (f"direct: {n} micro-batch gradients summed into bf16 .grad: relative error {e_acc:.4f} vs {e_once:.4f} "
                f"for one bf16 rounding of the exact sum; run {_state(rd)}")  # fmt: skip


def check_fp16_init_scale_huge(rd, assets):
    ms = metrics(rd)
    sk, sc = series(ms, "actor/skipped"), series(ms, "actor/loss_scale")
    ok = len(sk) >= 3 and all(bool(x) for x in sk) and _done(rd)
    return ok, f"actor/skipped {_fmt(sk)}, actor/loss_scale {_fmt(sc)}; run {_state(rd)}"


# ---------------------------------------------------------------- 7. own loops


def check_loop_advantage_broadcast_over_tokens(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    cos = n.get("cos_to_intended_grad", [])
    ok = n.get("shapes") == [[8], [8, 8]] and bool(cos) and max(cos) < 0.9 and not ev.get("error")
    return (
        ok,
        f"shapes (advantage, log-probs) {n.get('shapes')}; cosine of the applied gradient to the intended one per step {_fmt(cos)}; error {ev.get('error')}",
    )


def check_loop_update_forward_without_mask(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    a, b = n.get("update_vs_rollout_logp_abs", []), n.get("masked_vs_rollout_logp_abs", [])
    ok = bool(a) and a[0] > 0.02 and a[0] > 3 * b[0] and not ev.get("error")
    return ok, (f"step 0 (same weights): mean |update logp - rollout logp| {_fmt(a[:1])} without the mask vs {_fmt(b[:1])} "
                f"with it; all steps {_fmt(a)}; error {ev.get('error')}")  # fmt: skip


def check_loop_response_slice_off_by_one(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    first, exact = n.get("decoded_first_chars", []), n.get("reward_of_exact_answers", [])
    ok = first == [":"] and bool(exact) and max(exact) < 1.0 and not ev.get("error")
    return (
        ok,
        f"first characters of the decoded responses {first}; reward of the exact answers under the loop's slice {_fmt(exact)}; error {ev.get('error')}",
    )


def check_loop_lr_written_to_wrong_key(rd, assets):
    ev = evidence(rd)
    n = ev.get("notes", {})
    ok = (
        ev.get("lr")
        and max(ev["lr"]) == 0
        and ev.get("total_change") == 0.0
        and min(n.get("grad_norm", [0])) > 0
    )
    return ok, (f"optimizer lr per step {_fmt(ev.get('lr', []))} while the loop's warmup wrote {_fmt(n.get('intended_lr', []))}; "
                f"grad norms {_fmt(n.get('grad_norm', []))}; policy total change {ev.get('total_change')}")  # fmt: skip


def check_loop_double_loss_scaling(rd, assets):
    ev = evidence(rd)
    sk = ev.get("skipped", [])
    ok = len(sk) >= 3 and sum(sk) >= len(sk) - 1 and not ev.get("error")
    return (
        ok,
        f"steps skipped {sk}, scale before each step {_fmt(ev.get('notes', {}).get('scale_before_step', []))}; error {ev.get('error')}",
    )


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
    ok = (
        st.get("state") == "completed"
        and bool(loss)
        and _finite(loss)
        and _all_finite(ms)
        and not any(skipped)
    )
    if item["algo"] == "dpo":
        margin = series(ms, "rewards/margins")
        ok = ok and any(abs(m) > 0 for m in margin)
        return (
            ok,
            f"{st.get('state')}, {len(ms)} steps, actor/loss {_fmt(loss)}, margins {_fmt(margin)}, skipped {_fmt(skipped)}",
        )
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
    lines = ["# Blind fault bench 6: verification (no diagnosis)", "",
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
