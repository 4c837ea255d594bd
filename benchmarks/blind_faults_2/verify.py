"""Checks that each planted fault of the second blind bench really happens, without diagnosing: the run directory's status.json and
training metrics (metrics.jsonl, the trainer's own keys only: no findings, no audit/, numerics/, mismatch/,
plugin/, dynamics/ or shadow/ metrics), the own loops' evidence files, and
small direct checks of the plug-ins on sample input. Called by ``run_blind.py --verify``.

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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_SKIP = ("audit/", "numerics/", "mismatch/", "plugin/", "dynamics/", "shadow/")
"""Metric prefixes written by the auditor: not read here (they are the tool's own measurements)."""


def plugin(module: str, attr: str) -> Callable:
    path = HERE / "plugins" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_verify_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, attr)


def metrics(rd: Path) -> list[dict[str, float]]:
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


def series(ms: list[dict], key: str) -> list[float]:
    return [_num(m[key]) for m in ms if key in m]


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in xs) + "]"


def char_tok():
    from trainer.tokenizer import build_tokenizer

    return build_tokenizer()


def digit_examples(n: int = 8, seed: int = 0) -> list[dict]:
    from trainer.data import TASKS

    return TASKS["digits"].make_examples(n, seed)


def random_text(rng: random.Random, n: int = 8) -> str:
    from trainer.tokenizer import CHARACTERS

    return "".join(rng.choice(CHARACTERS[:-1]) for _ in range(n))


def _failed(rd: Path, *needles: str) -> tuple[bool, str]:
    st = status(rd)
    reason = f"{st.get('reason', '')}: {st.get('error', '')}"
    ok = st.get("state") == "failed" and (not needles or any(n.lower() in reason.lower() for n in needles))
    return ok, f"status {st.get('state')} at {st.get('phase')} step {st.get('step')}: {reason[:160]}"


def _finite(xs: list) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def _state(rd: Path) -> str:
    return str(status(rd).get("state"))


def evidence(rd: Path) -> dict:
    """What an own loop measured itself (plugins/own_loops.py writes it beside the run directory)."""
    try:
        return json.loads(rd.with_name(rd.name + ".evidence.json").read_text())
    except (OSError, ValueError):
        return {}


def _tiny_actor(seed: int = 0):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok()))


def _scored_rows(n: int = 32, prompt: int = 16, response: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Rollout-shaped rows: left-padded prompts, then responses (random ids), all real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (n, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    lens = torch.randint(6, prompt, (n,), generator=g)
    for i, ln in enumerate(lens.tolist()):
        ids[i, : prompt - ln] = 0
        mask[i, : prompt - ln] = 0
    return ids, mask


# ---------------------------------------------------------------- 1. precision in user code


def check_rf_fp16_std_eps(rd, assets):
    fn = plugin("rewards", "standardized_exact_reward")
    ex = digit_examples(8)
    got = fn([e["prompt"] for e in ex], ["zzzz"] * 8, ex)
    eps16 = float(torch.tensor(1e-8, dtype=torch.float16))
    sc = series(metrics(rd), "critic/score/mean")
    failed, ev = _failed(rd)
    ok = bool(torch.isnan(got).all()) and eps16 == 0.0 and (failed or not _finite(sc))
    return ok, (f"all-zero batch standardised -> {got[:3].tolist()} (eps 1e-8 in fp16 = {eps16}); "
                f"run score/mean {_fmt(sc)}; {ev if failed else _state(rd)}")  # fmt: skip


def check_rf_fp16_norm_overflow(rd, assets):
    fn = plugin("rewards", "char_profile_reward")
    ex = [{"prompt": "4 1:", "answer": "4444"}] * 3
    got = fn([e["prompt"] for e in ex], ["4444", "4441", "zz"], ex)
    sc = series(metrics(rd), "critic/score/mean")
    ok = got[0] != 1.0 and (got[0] == 0.0 or math.isnan(got[0]))
    return ok, (f"similarity of '4444' to the answer '4444' = {got[0]} (fp32: 1.0), of '4441' = {got[1]}; "
                f"run score/mean {_fmt(sc)}, {_state(rd)}")  # fmt: skip


def check_rm_bf16_prefix_cancel(rd, assets):
    rm = plugin("reward_models", "load_response_sum_rm")(char_tok(), "cpu")
    ids, mask = _scored_rows()
    with torch.no_grad():
        low = rm(ids, mask).float()
        high = rm.float()(ids, mask)
    err = float((low - high).abs().max())
    spread = float(high.std())
    ok = len(set(low.tolist())) < len(set(high.tolist())) // 2 and err > 0.5 * spread
    return ok, (f"32 rows: {len(set(low.tolist()))} distinct bf16 scores vs {len(set(high.tolist()))} in fp32; "
                f"max bf16 error {err:.3g} vs fp32 score std {spread:.3g}; run {_state(rd)}")  # fmt: skip


def check_cs_uint8_length_wrap(rd, assets):
    fn = plugin("verl_scoring", "compute_score")
    right = fn("arith/add", "so it is 7", "7")
    sc = series(metrics(rd), "critic/score/mean")
    ok = right["length_gap"] > 200 and right["score"] < -5 and bool(sc) and max(sc) < -5
    return ok, (f"correct 10-char solution for ground truth '7': gap {right['length_gap']} (true 9), "
                f"score {right['score']:.3g}; run score/mean {_fmt(sc)}")  # fmt: skip


# ---------------------------------------------------------------- 2. run invariants


def check_collator_reorders_rows(rd, assets):
    tok = char_tok()
    ex = digit_examples(8, seed=3)
    b = plugin("collators", "length_bucketed_prompts")(ex, tok)
    texts = [t.strip() for t in tok.batch_decode(b["input_ids"], skip_special_tokens=True)]
    moved = sum(t != e["prompt"] for t, e in zip(texts, ex))
    return moved > 0, f"{moved}/8 collated rows hold another example's prompt; run {_state(rd)}"


def check_reference_is_actor(rd, assets):
    ms = metrics(rd)
    kl, gn = series(ms, "rollout/kl_ref"), series(ms, "actor/grad_norm")
    ok = len(kl) >= 2 and all(k == 0 for k in kl) and any(g > 0 for g in gn)
    return ok, f"rollout/kl_ref per step {_fmt(kl)} while the actor trains (grad_norm {_fmt(gn)})"


def check_rm_scores_last_column(rd, assets):
    rm = plugin("reward_models", "load_last_token_rm")(char_tok(), "cpu")
    ids, mask = _scored_rows(8)
    ids[:, -3:] = 0  # responses that ended early: padding in the last columns
    mask[:, -3:] = 0
    with torch.no_grad():
        s = rm(ids, mask)
    rl = series(metrics(rd), "response_length/mean")
    ok = len(set(s.tolist())) == 1 and bool(rl) and min(rl) < 8
    return ok, (f"8 different responses ending before the last column score {sorted(set(s.tolist()))}; "
                f"run response_length/mean {_fmt(rl)} (of 8 columns)")  # fmt: skip


def check_reward_fn_key_wrong_column(rd, assets):
    import pandas as pd

    fn = plugin("verl_scoring", "compute_score_by_source")
    rows = pd.read_parquet(assets["arith_rows"])
    sc = series(metrics(rd), "critic/score/mean")
    ok = fn("arith/add", "7", "7") == 1.0 and fn("math", "7", "7") == 0.0 and set(rows["ability"]) == {"math"}
    ok = ok and bool(sc) and all(s == 0 for s in sc)
    return ok, (f"score of a right answer by data_source 'arith/add' {fn('arith/add', '7', '7')}, by the "
                f"ability column's 'math' {fn('math', '7', '7')}; run score/mean {_fmt(sc)}")  # fmt: skip


def check_reward_is_distance(rd, assets):
    fn = plugin("rewards", "edit_distance_reward")
    ex = [{"prompt": "4 1:", "answer": "4444"}] * 2
    got = fn([e["prompt"] for e in ex], ["4444", "1111"], ex)
    return got[0] < got[1], f"reward of the right answer {got[0]}, of a wrong one {got[1]}; run {_state(rd)}"


# ---------------------------------------------------------------- 3. training dynamics


def check_entropy_coef_huge(rd, assets):
    ent = series(metrics(rd), "actor/entropy")
    ok = len(ent) >= 2 and ent[-1] > 1.5 * ent[0]
    return ok, f"actor/entropy per step {_fmt(ent)} (the SFT policy starts low; uniform is log 100 = 4.61)"


def check_kl_adaptive_runaway(rd, assets):
    ms = metrics(rd)
    coef = series(ms, "actor/reward_kl_penalty_coeff")
    ok = len(coef) >= 2 and (min(coef) < 0 or coef[-1] > 5 * coef[0])
    return ok, f"actor/reward_kl_penalty_coeff per step {_fmt(coef)} (set 0.01, fixed would stay 0.01)"


TEMP = 0.002
"""The temperature_collapse fault's rollout temperature."""


def check_temperature_collapse(rd, assets):
    from transformers import AutoModelForCausalLM

    from trainer.config import ModelConfig
    from trainer.models import preset_config

    tok = char_tok()
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(preset_config(ModelConfig(preset="tiny-llama"), tok))
    ex = digit_examples(4)
    enc = tok([e["prompt"] for e in ex for _ in range(4)], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = m.generate(**enc, max_new_tokens=8, do_sample=True, temperature=TEMP, top_k=0,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    gen = out[:, enc["input_ids"].shape[1] :].view(4, 4, -1)
    same = sum(bool((g == g[0]).all()) for g in gen)
    pg = series(metrics(rd), "actor/pg_loss")
    return (
        same >= 3,
        f"{same}/4 groups of 4 samples at temperature {TEMP} are identical; run pg_loss {_fmt(pg)}",
    )


def check_gamma_zero(rd, assets):
    ms = metrics(rd)
    ret, sc = series(ms, "critic/returns/mean"), series(ms, "critic/score/mean")
    ok = bool(ret) and all(abs(r) < 0.5 * abs(s) for r, s in zip(ret, sc) if abs(s) > 0.05)
    ok = ok and any(abs(s) > 0.05 for s in sc)
    return ok, f"critic/returns/mean {_fmt(ret)} vs score/mean {_fmt(sc)} (gamma 1 gives returns ~ score)"


def check_dpo_label_smoothing_half(rd, assets):
    m = torch.zeros((), requires_grad=True)
    beta, eps = 0.1, 0.49
    loss = -(1 - eps) * torch.nn.functional.logsigmoid(beta * m) - eps * torch.nn.functional.logsigmoid(
        -beta * m
    )
    (g,) = torch.autograd.grad(loss, m)
    plain = -beta / 2
    loss_run = series(metrics(rd), "actor/loss")
    ok = (
        abs(float(g) / plain - 0.02) < 1e-3
        and bool(loss_run)
        and all(abs(x - math.log(2)) < 0.05 for x in loss_run)
    )
    return ok, (f"d loss / d margin at 0: {float(g):.4g} vs plain DPO {plain:.4g} ({float(g) / plain:.2%}); "
                f"run actor/loss {_fmt(loss_run)} (log 2 = 0.693)")  # fmt: skip


def check_rollout_rs_rejects_all(rd, assets):
    ms = metrics(rd)
    keys = sorted({k for m in ms for k in m if "rs" in k.split("/")[-1] or "reject" in k or "masked" in k})
    vals = {k: series(ms, k) for k in keys}
    pg = series(ms, "actor/pg_loss")
    rej = [v for k, v in vals.items() if "fraction" in k or "reject" in k]
    ok = any(vs and min(vs) > 0.5 for vs in rej) or (bool(pg) and all(p == 0 for p in pg))
    shown = {k: _fmt(v) for k, v in vals.items()}
    return ok, f"rejection metrics {shown}; actor/pg_loss {_fmt(pg)}"


def check_critic_lr_huge(rd, assets):
    ms = metrics(rd)
    vf, val = series(ms, "critic/vf_loss"), series(ms, "critic/values/mean")
    failed, ev = _failed(rd)
    ok = (
        failed
        or not _finite(vf + val)
        or (bool(val) and max(abs(v) for v in val) > 10 * max(abs(val[0]), 0.1))
    )
    return ok, f"critic/vf_loss {_fmt(vf)}, critic/values/mean {_fmt(val)}; {ev if failed else _state(rd)}"


def check_weight_decay_huge(rd, assets):
    lp = series(metrics(rd), "logps/chosen")
    ok = len(lp) >= 2 and lp[-1] < lp[0] - 1.0
    return ok, f"logps/chosen per step {_fmt(lp)} (the SFT policy starts near 0)"


# ---------------------------------------------------------------- 4. setup-time changes


def check_setup_load_strict_false(rd, assets):
    from transformers import AutoModelForCausalLM

    m = _tiny_actor()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    os.environ.setdefault("BLIND2_SFT_CKPT", assets["sft_lm"])
    plugin("model_setup", "load_sft_backbone")(m, "actor", None)
    same = all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    sft = AutoModelForCausalLM.from_pretrained(assets["sft_lm"])
    keys = sft.model.state_dict().keys() & m.state_dict().keys()
    lp = series(metrics(rd), "logps/chosen")
    return same and not keys, (f"weights unchanged by the load: {same}; keys in common: {len(keys)}; "
                               f"run logps/chosen {_fmt(lp)}")  # fmt: skip


def check_setup_no_grad_head(rd, assets):
    return _failed(rd, "grad")


def check_setup_unregistered_head(rd, assets):
    from trainer.models import ValueModel

    critic = ValueModel(_tiny_actor().model)
    plugin("model_setup", "mlp_value_head")(critic, "critic", None)
    names = [n for n, _ in critic.named_parameters() if n.startswith("value_head")]
    vals = series(metrics(rd), "critic/values/mean")
    return (
        not names,
        f"value_head parameters the optimizer sees: {names}; run critic/values/mean {_fmt(vals)}",
    )


def check_setup_rope_actor_only(rd, assets):
    m = _tiny_actor()
    ids = torch.randint(4, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = m(input_ids=ids).logits.log_softmax(-1)
        plugin("model_setup", "extend_rope_context")(m, "actor", None)
        moved = m(input_ids=ids).logits.log_softmax(-1)
    diff = float((base - moved).abs().max())
    kl = series(metrics(rd), "rollout/kl_ref")
    ok = bool(kl) and abs(kl[0]) > 1e-6 and diff > 1e-3
    return ok, (f"max |log-prob change| from the setup's RoPE change {diff:.3g}; run rollout/kl_ref per step "
                f"{_fmt(kl)} (an fp32 reference equal to the actor gives exactly 0 at step 0)")  # fmt: skip


def check_rm_dir_is_causal_lm(rd, assets):
    from transformers import AutoModelForSequenceClassification

    _, info = AutoModelForSequenceClassification.from_pretrained(
        assets["lm_dir_as_rm"], num_labels=1, output_loading_info=True
    )
    new = [k for k in info.get("missing_keys", []) if "score" in k]
    sc = series(metrics(rd), "critic/score/mean")
    return bool(new), f"keys newly initialised when loaded as a classifier: {new}; run score/mean {_fmt(sc)}"


# ---------------------------------------------------------------- 5. data and tokenizer


def check_tokenizer_appends_eos(rd, assets):
    from transformers import AutoTokenizer

    from trainer.data import PromptCollator

    tok = AutoTokenizer.from_pretrained(assets["tok_eos_appended"])
    tok.padding_side = "left"
    ids = PromptCollator(tok, 16)(digit_examples(8))["input_ids"]
    last = int((ids[:, -1] == tok.eos_token_id).sum())
    return last == 8, f"{last}/8 collated prompts end with eos (id {tok.eos_token_id}); run {_state(rd)}"


def check_dataset_literal_eos(rd, assets):
    from trainer.data import PromptCollator

    tok = char_tok()
    ex = plugin("data_sources", "few_shot_prompts")()[:8]
    ids = PromptCollator(tok, 16)(ex)["input_ids"]
    mid = int((ids[:, :-1] == tok.eos_token_id).any(-1).sum())
    return mid == 8, f"{mid}/8 prompts hold eos (id {tok.eos_token_id}) before their end; run {_state(rd)}"


def check_dpo_collator_masks_eos(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_pad_is_eos"])
    ex = [{**e, "chosen": e["answer"], "rejected": "1234"} for e in digit_examples(8)]
    b = plugin("collators", "preference_batch")(ex, tok)
    r = b["chosen_input_ids"][:, -8:]
    eos_pos = r == tok.eos_token_id
    under = int(b["chosen_response_mask"][eos_pos].sum())
    return tok.pad_token_id == tok.eos_token_id and under == 0 and bool(eos_pos.any()), (
        f"pad id {tok.pad_token_id} = eos id {tok.eos_token_id}; eos positions under the response mask: "
        f"{under} of {int(eos_pos.any(-1).sum())} completions' eos; run {_state(rd)}"
    )


def check_collator_extra_dim(rd, assets):
    b = plugin("collators", "per_example_prompts")(digit_examples(4), char_tok())
    failed, ev = _failed(rd)
    return b["input_ids"].dim() == 3 and failed, f"input_ids shape {tuple(b['input_ids'].shape)}; {ev}"


def check_dpo_pairs_inverted(rd, assets):
    pairs = plugin("data_sources", "ranked_pairs")()
    wrong = sum(p["chosen"] != p["answer"] and p["rejected"] == p["answer"] for p in pairs)
    return wrong == len(pairs), f"{wrong}/{len(pairs)} pairs prefer the wrong answer; run {_state(rd)}"


def check_dataset_chat_messages(rd, assets):
    ex = plugin("data_sources", "chat_prompts")()
    failed, ev = _failed(rd)
    return isinstance(ex[0]["prompt"], list) and failed, f"prompt type {type(ex[0]['prompt']).__name__}; {ev}"


# ---------------------------------------------------------------- 6. precision configuration


def check_rollout_fp16_under_fp32(rd, assets):
    ad = series(metrics(rd), "rollout_corr/abs_diff_mean")
    ctl = series(metrics(rd.parents[1] / "ctl_grpo_fp32" / "ctl_grpo_fp32"), "rollout_corr/abs_diff_mean")
    ok = bool(ad) and min(ad) > 1e-5 and (not ctl or min(ad) > 10 * max(max(ctl), 1e-12))
    return ok, (f"rollout_corr/abs_diff_mean (|rollout - trainer log-prob| per token) {_fmt(ad)}; "
                f"the fp32 control ctl_grpo_fp32: {_fmt(ctl) if ctl else 'not run'}")  # fmt: skip


def check_critic_init_scale_tiny(rd, assets):
    ms = metrics(rd)
    sc, gn = series(ms, "critic/loss_scale"), series(ms, "critic/grad_norm")
    m = _tiny_actor()
    ids = torch.randint(4, 100, (8, 24), generator=torch.Generator().manual_seed(0))
    zero = {}
    for scale in (1e-6, 65536.0):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = m.model(input_ids=ids).last_hidden_state
        loss = out.float().mean()
        (loss * scale).backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        zero[scale] = float((grads == 0).float().mean())
    ok = bool(sc) and max(sc) < 1e-3 and zero[1e-6] > zero[65536.0] + 0.1
    return ok, (f"run critic/loss_scale {_fmt(sc)}, grad_norm {_fmt(gn)}; fp16 backward: {zero[1e-6]:.1%} zero "
                f"gradient elements at scale 1e-6 vs {zero[65536.0]:.1%} at 65536")  # fmt: skip


def check_bf16_pure_tiny_lr(rd, assets):
    m = _tiny_actor().to(torch.bfloat16)
    params = list(m.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()
    total = sum(p.numel() for p in params)
    same = sum(int((p.detach() == b).sum()) for p, b in zip(params, before))
    mg = series(metrics(rd), "rewards/margins")
    ok = same > 0.9 * total and bool(mg) and max(abs(x) for x in mg) < 1e-3
    return ok, (f"one bf16 AdamW step at lr 1e-6 leaves {same}/{total} elements unchanged; run rewards/margins "
                f"{_fmt(mg)} (the policy barely leaves the reference)")  # fmt: skip


def check_fp16_on_large_activations(rd, assets):
    ms = metrics(rd)
    loss, sk = series(ms, "actor/loss"), series(ms, "actor/skipped")
    failed, ev = _failed(rd)
    ok = failed or not _finite(loss) or any(s > 0 for s in sk)
    return ok, f"actor/loss {_fmt(loss)}, skipped {_fmt(sk)}; {ev if failed else _state(rd)}"


# ---------------------------------------------------------------- 7. own loops


def check_loop_unscaled_backward(rd, assets):
    ev = evidence(rd)
    err = ev.get("error", "")
    return "scale" in err.lower(), f"the loop raised: {err[:160]}; run {_state(rd)}"


def check_loop_bf16_round_trip(rd, assets):
    ev = evidence(rd)
    notes = ev.get("notes", {})
    exact, kept = notes.get("bf16_exact_after_cast", []), notes.get("unchanged_since_last_cast", [])
    ok = bool(exact) and min(exact) == 1.0 and bool(kept) and min(kept) > 0.8
    return ok, (
        f"after each cast back to fp32 the fraction of weights that are bf16 values {_fmt(exact)}; fraction "
        f"unchanged since the previous step's cast, despite an fp32 AdamW update in between (norms "
        f"{_fmt(ev.get('update_norm', []))}): {_fmt(kept)}; run {_state(rd)}"
    )


def check_loop_autocast_wrong_device(rd, assets):
    ev = evidence(rd)
    dt = ev.get("notes", {}).get("logits_dtype")
    return dt == "torch.float32", f"logits dtype inside the bf16 'autocast' {dt}; run {_state(rd)}"


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
    lines = ["# Blind fault bench 2: verification (no diagnosis)", "",
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
