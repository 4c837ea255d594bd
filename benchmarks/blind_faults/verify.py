"""Checks that each planted fault really happens, without diagnosing: the run directory's status.json and
training metrics (metrics.jsonl, the trainer's own keys only: no audit findings or audit numerics), and
small direct checks of the plug-ins on sample input. Called by ``run_blind.py --verify``.

Every check returns ``(ok, evidence)``; controls are checked to have completed with finite losses.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_SKIP = ("audit/", "numerics/", "mismatch/")
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


# ---------------------------------------------------------------- direct checks of the plug-ins


def check_rf_fp16_underflow(rd, assets):
    fn = plugin("rewards", "sequence_likelihood_reward")
    rng = random.Random(0)
    ex = digit_examples(16)
    resp = [random_text(rng) for _ in ex]
    got = fn([e["prompt"] for e in ex], resp, ex)
    # the same products in float64
    ref = []
    for r, e in zip(resp, ex):
        p = 1.0
        for pos, want in enumerate(e["answer"]):
            g = r[pos] if pos < len(r) else ""
            p *= 0.9 if g == want else (0.09 if g.isdigit() else 0.009)
        p *= 0.01 ** max(0, len(r) - len(e["answer"]))
        ref.append(p)
    zeros = int((got == 0).sum())
    distinct = len(set(ref))
    sc = series(metrics(rd), "critic/score/mean")
    ok = zeros == len(ex) and distinct > 1 and all(s == 0 for s in sc) and len(sc) > 0
    return (
        ok,
        (
            f"fp16 rewards all 0 ({zeros}/{len(ex)}); "
            f"float64 gives {distinct} distinct values, e.g. {ref[0]:.3g}; "
            f"run score/mean {_fmt(sc)}"
        ),
    )


def check_rf_bf16_swamped(rd, assets):
    fn = plugin("rewards", "format_bonus_reward")
    ex = [{"prompt": "4 1:", "answer": "4444"}] * 4
    resp = ["4444", "44", "1111", "xyz"]
    got = fn([e["prompt"] for e in ex], resp, ex)
    sd = series(metrics(rd), "critic/score/std")
    ok = bool((got == 1.0).all()) and len(sd) > 0 and all(s == 0 for s in sd)
    return (
        ok,
        (
            f"bf16 rewards of 4, 2, 0(digits), 0 correct digits: {got.tolist()} (fp32 would be 1.008 .. 1.0); "
            f"run score/std {_fmt(sd)}"
        ),
    )


def check_rf_int_rewards(rd, assets):
    fn = plugin("rewards", "graded_digit_reward")
    ex = [{"prompt": "4 1:", "answer": "4444"}] * 4
    got = fn([e["prompt"] for e in ex], ["4444", "444x", "44", "x"], ex)
    sc = series(metrics(rd), "critic/score/mean")
    ok = got.tolist() == [1, 0, 0, 0] and str(got.dtype).startswith("int")
    return (
        ok,
        f"partial credit 1, .75, .5, 0 returned as {got.tolist()} ({got.dtype}); run score/mean {_fmt(sc)}",
    )


def _rm_check(loader: str, dtype, rd):
    fn = plugin("reward_models", loader)
    model = fn(char_tok(), "cpu")
    ids = torch.randint(4, 100, (16, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :6] = 0
    with torch.no_grad():
        low = model(ids, mask)
        high = model.float()(ids, mask)
    bad = int((~torch.isfinite(low)).sum())
    sc = series(metrics(rd), "critic/score/mean")
    ok = (
        low.dtype == dtype
        and bad > 0
        and bool(torch.isfinite(high).all())
        and any(not math.isfinite(s) for s in sc)
    )
    return ok, f"{low.dtype} scores non-finite for {bad}/16 rows, fp32 all finite; run score/mean {_fmt(sc)}"


def check_rm_fp16_exp_overflow(rd, assets):
    return _rm_check("load_attention_pool_rm", torch.float16, rd)


def check_rm_bf16_onepass_norm(rd, assets):
    return _rm_check("load_mean_pool_rm", torch.bfloat16, rd)


def check_collator_bf16_ids(rd, assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["tok_words"])
    tok.padding_side = "left"
    ex = plugin("data_sources", "word_echo_prompts")()[:16]
    batch = plugin("collators", "collate_to_model_dtype")(ex, tok)
    exact = tok([e["prompt"] for e in ex], padding="max_length", max_length=16, return_tensors="pt")[
        "input_ids"
    ]
    changed = int((batch["input_ids"] != exact).sum())
    real = int((exact > 3).sum())
    st = status(rd)
    ok = changed > real // 10
    return (
        ok,
        (
            f"{changed} of {real} prompt token ids changed by the bf16 round trip "
            f"(e.g. {exact[0, -4:].tolist()} -> {batch['input_ids'][0, -4:].tolist()}); "
            f"run {st.get('state')}"
        ),
    )


def check_cs_fp16_length_penalty(rd, assets):
    fn = plugin("verl_scoring", "compute_score")
    short = fn("arith/add", "7", "7")["score"]
    long = fn("arith/add", "x" * 44 + " 7", "7")["score"]
    sc = series(metrics(rd), "critic/score/mean")
    ok = short == 1.0 and math.isnan(long) and any(not math.isfinite(s) for s in sc)
    return ok, f"score('7') = {short}, score(46-char response) = {long}; run score/mean {_fmt(sc)}"


def check_collator_mask_covers_pad(rd, assets):
    tok = char_tok()
    batch = plugin("collators", "pad_prompts")(digit_examples(8), tok)
    pads = batch["input_ids"] == tok.pad_token_id
    covered, n_pad = int((batch["attention_mask"][pads] == 1).sum()), int(pads.sum())
    ev = f"{covered} of {n_pad} pad positions have attention_mask 1; run {status(rd).get('state')}"
    return covered > 0 and covered == n_pad, ev


def check_collator_right_padded(rd, assets):
    tok = char_tok()
    batch = plugin("collators", "fixed_width_prompts")(digit_examples(8), tok)
    m = batch["attention_mask"]
    ok = bool((m[:, 0] == 1).all()) and bool((m[:, -1] == 0).all())
    return (
        ok,
        (
            f"first column of the mask all 1, last column all 0 (padding on the right): {m[0].tolist()}; "
            f"run {status(rd).get('state')}"
        ),
    )


def _dpo_metric_check(rd, examples, what):
    ms = metrics(rd)
    margins, loss = series(ms, "rewards/margins"), series(ms, "actor/loss")
    return margins, loss, f"{what}; run margins {_fmt(margins)}, loss {_fmt(loss)}"


def check_dpo_identical_pairs(rd, assets):
    pairs = plugin("data_sources", "preference_pairs")()
    same = sum(p["chosen"] == p["rejected"] for p in pairs)
    margins, loss, ev = _dpo_metric_check(rd, pairs, f"{same}/{len(pairs)} pairs have chosen == rejected")
    ok = (
        same == len(pairs)
        and margins
        and all(abs(m) < 1e-6 for m in margins)
        and all(abs(x - math.log(2)) < 1e-4 for x in loss)
    )
    return ok, ev


def check_dpo_pairs_cut_identical(rd, assets):
    from trainer.data import PairCollator

    pairs = plugin("data_sources", "reasoned_pairs")()[:32]
    b = PairCollator(char_tok(), 16, 8)(pairs)
    same = int((b["chosen_input_ids"] == b["rejected_input_ids"]).all(-1).sum())
    margins, loss, ev = _dpo_metric_check(
        rd, pairs, f"after the cut to 8 response tokens {same}/32 pairs are token-identical"
    )
    ok = same == 32 and margins and all(abs(m) < 1e-6 for m in margins)
    return ok, ev


def check_prompts_truncated_identical(rd, assets):
    from trainer.data import PromptCollator

    ex = plugin("data_sources", "instructed_prompts")()[:32]
    ids = PromptCollator(char_tok(), 16)(ex)["input_ids"]
    distinct_text = len({e["prompt"] for e in ex})
    distinct_ids = len({tuple(r.tolist()) for r in ids})
    return (
        distinct_ids == 1 and distinct_text > 1,
        (
            f"{distinct_text} distinct prompts collate to {distinct_ids} distinct id rows; "
            f"run {status(rd).get('state')}"
        ),
    )


def _kl_ref(rd, threshold):
    kl = series(metrics(rd), "rollout/kl_ref")
    return (
        bool(kl) and abs(kl[0]) > threshold,
        f"rollout/kl_ref per step {_fmt(kl)} (a reference equal to the actor's start gives 0 at step 0)",
    )


def check_ref_fresh_init(rd, assets):
    return _kl_ref(rd, 1e-2)


def check_actor_dropout_in_config(rd, assets):
    cfg = json.loads((Path(assets["dropout_lm"]) / "config.json").read_text())
    ms = metrics(rd)
    kl, cf = series(ms, "actor/ppo_kl"), series(ms, "actor/pg_clipfrac")
    ok = cfg.get("attention_dropout") == 0.2 and bool(kl) and (abs(kl[0]) > 0 or cf[0] > 0)
    return (
        ok,
        (
            f"config attention_dropout {cfg.get('attention_dropout')}; "
            f"one mini-batch, one epoch: ppo_kl {_fmt(kl)}, clipfrac {_fmt(cf)} (0 without dropout)"
        ),
    )


def check_untied_output_head(rd, assets):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(assets["tied_lm"])
    before = m.lm_head.weight is m.model.embed_tokens.weight
    plugin("model_setup", "separate_output_head")(m, "actor", None)
    after = m.lm_head.weight is m.model.embed_tokens.weight
    ok = before and not after and m.config.tie_word_embeddings
    return (
        ok,
        (
            f"tied before setup: {before}, after: {after}, config.tie_word_embeddings {m.config.tie_word_embeddings}; "
            f"run {status(rd).get('state')}"
        ),
    )


def check_dpo_pairs_misaligned(rd, assets):
    tok = char_tok()
    ex = [{**e, "chosen": e["answer"], "rejected": "1234"} for e in digit_examples(8)]
    b = plugin("collators", "pack_pairs")(ex, tok)
    tail = b["chosen_input_ids"][:, -8:]
    under = tail[b["chosen_response_mask"] == 1]
    pads = int((under == tok.pad_token_id).sum())
    return (
        pads == under.numel() and pads > 0,
        (
            f"{pads} of {under.numel()} response-mask positions hold the pad token; "
            f"run {status(rd).get('state')}"
        ),
    )


def check_reward_scores_prompt(rd, assets):
    fn = plugin("rewards", "answer_match_reward")
    ex = [{"prompt": "4 1:", "answer": "4444"}] * 3
    got = fn([e["prompt"] for e in ex], ["4444", "1111", "zz"], ex)
    ms = metrics(rd)
    adv = series(ms, "critic/advantages/mean")
    ok = len(set(got)) == 1 and bool(adv) and all(a == 0 for a in adv)
    return ok, f"rewards of '4444', '1111', 'zz' for one prompt: {got}; run advantages/mean {_fmt(adv)}"


def check_rm_mc_dropout(rd, assets):
    from trainer.config import ModelConfig
    from trainer.models import build_reward_model
    from trainer.precision import resolve_policy

    tok = char_tok()
    rm = build_reward_model(
        ModelConfig(reward_model="preset:tiny-llama"), tok, resolve_policy("fp32")["reward"], "cpu"
    )
    plugin("model_setup", "mc_dropout_reward")(rm, "reward", tok)
    ids = torch.randint(4, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        b = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    diff = float((a - b).abs().max())
    return (
        diff > 0 and rm.training,
        (
            f"same batch scored twice differs by up to {diff:.3g} (train mode {rm.training}); "
            f"run {status(rd).get('state')}"
        ),
    )


# ---------------------------------------------------------------- training dynamics, from the run


def check_lr_huge(rd, assets):
    ms = metrics(rd)
    ent, loss, skip = series(ms, "actor/entropy"), series(ms, "actor/loss"), series(ms, "actor/skipped")
    gn = series(ms, "actor/grad_norm")
    broke = (
        any(not math.isfinite(x) for x in loss + gn)
        or any(s > 0 for s in skip)
        or (ent and min(ent) < 0.5 * ent[0])
    )
    failed, ev = _failed(rd, "nan", "inf", "finite")
    return (
        bool(ms) and (bool(broke) or failed),
        (
            f"entropy {_fmt(ent)}, loss {_fmt(loss)}, grad_norm {_fmt(gn)}, skipped {_fmt(skip)}; "
            f"{ev if failed else status(rd).get('state')}"
        ),
    )


def check_clip_ratio_tiny(rd, assets):
    cf = series(metrics(rd), "actor/pg_clipfrac")
    return bool(cf) and max(cf) > 0.3, f"actor/pg_clipfrac per step {_fmt(cf)}"


def check_kl_coef_huge(rd, assets):
    ms = metrics(rd)
    pen, coef = series(ms, "actor/reward_kl_penalty"), series(ms, "actor/reward_kl_penalty_coeff")
    sc, rw = series(ms, "critic/score/mean"), series(ms, "critic/rewards/mean")
    ok = bool(rw) and any(abs(r - s) > 3 * max(abs(s), 0.1) for r, s in zip(rw, sc))
    return (
        ok,
        f"score/mean {_fmt(sc)} vs rewards/mean (score - KL) {_fmt(rw)}; kl {_fmt(pen)} x coef {_fmt(coef)}",
    )


def check_minibatch_too_many(rd, assets):
    ms = metrics(rd)
    kl, cf = series(ms, "actor/ppo_kl"), series(ms, "actor/pg_clipfrac")
    return bool(cf) and max(
        cf
    ) > 0.1, f"64 optimizer steps per rollout: ppo_kl {_fmt(kl)}, pg_clipfrac {_fmt(cf)}"


def check_grpo_single_sample(rd, assets):
    ms = metrics(rd)
    adv, sc = series(ms, "critic/advantages/mean"), series(ms, "critic/score/mean")
    ok = bool(adv) and all(a > 0 for a in adv)
    return (
        ok,
        (
            f"advantages/mean {_fmt(adv)} = the raw score/mean {_fmt(sc)} (a group baseline would centre them at 0)"
        ),
    )


def check_static_scale_overflow(rd, assets):
    ms = metrics(rd)
    sk, sc = series(ms, "actor/skipped"), series(ms, "actor/loss_scale")
    return bool(sk) and all(s == 1.0 for s in sk), f"actor/skipped per step {_fmt(sk)}, loss_scale {_fmt(sc)}"


def check_rollout_top_p_offpolicy(rd, assets):
    kl = series(metrics(rd), "rollout_corr/kl")
    return bool(kl) and min(
        kl
    ) > 1e-3, f"rollout_corr/kl (rollout vs trainer log-probs, same tokens) {_fmt(kl)}"


# ---------------------------------------------------------------- setup-time changes


def _tiny_actor(seed=0):
    from assets import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(char_tok()))


def check_setup_critic_half(rd, assets):
    from trainer.models import ValueModel

    critic = ValueModel(_tiny_actor().model)
    plugin("model_setup", "half_critic")(critic, "critic", None)
    dtypes = {p.dtype for p in critic.parameters()}
    ms = metrics(rd)
    vf, gn = series(ms, "critic/vf_loss"), series(ms, "critic/grad_norm")
    return (
        dtypes == {torch.float16},
        (
            f"critic parameters after setup: {dtypes}; "
            f"run critic vf_loss {_fmt(vf)}, grad_norm {_fmt(gn)}, {status(rd).get('state')}"
        ),
    )


def check_setup_policy_bf16_master(rd, assets):
    m = _tiny_actor()
    plugin("model_setup", "bf16_policy")(m, "actor", None)
    params = [p for p in m.parameters()]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    total = sum(p.numel() for p in params)
    same = sum(int((p.detach() == b).sum()) for p, b in zip(params, before))
    return (
        params[0].dtype == torch.bfloat16 and same > total // 2,
        (
            f"actor params {params[0].dtype} after setup; "
            f"one AdamW step at lr 1e-5 leaves {same}/{total} elements unchanged; "
            f"run {status(rd).get('state')}"
        ),
    )


def check_setup_pad_vocab(rd, assets):
    m = _tiny_actor()
    tok = char_tok()
    plugin("model_setup", "pad_vocab")(m, "actor", tok)
    rows = m.get_input_embeddings().num_embeddings
    ok = rows > len(tok)
    ok2, ev = _failed(rd)
    st = status(rd)
    return (
        ok,
        (
            f"embedding rows {rows} vs tokenizer {len(tok)}; "
            f"{ev if st.get('state') == 'failed' else 'run ' + str(st.get('state'))}"
        ),
    )


def check_setup_freeze_inverted(rd, assets):
    m = _tiny_actor()
    plugin("model_setup", "freeze_embeddings")(m, "actor", None)
    train = [n for n, p in m.named_parameters() if p.requires_grad]
    frozen = sum(1 for _, p in m.named_parameters() if not p.requires_grad)
    return train == [
        "model.embed_tokens.weight"
    ], f"trainable after setup: {train}; {frozen} tensors frozen; run {status(rd).get('state')}"


def check_setup_half_norm(rd, assets):
    ok, ev = _failed(rd, "dtype", "half", "float")
    return ok, ev


def check_setup_bf16_hooks(rd, assets):
    m = _tiny_actor()
    ids = torch.randint(4, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = m(input_ids=ids).logits.log_softmax(-1)
        plugin("model_setup", "compress_activations")(m, "actor", None)
        seen = []
        h = m.model.layers[0].register_forward_hook(lambda mod, a, o: seen.append(o.dtype))
        hooked = m(input_ids=ids).logits.log_softmax(-1)
        h.remove()
    diff = float((base - hooked).abs().max())
    return (
        seen[-1] == torch.bfloat16 and diff > 1e-4,
        f"layer output dtype {seen[-1]}; max |log-prob change| {diff:.3g}; run {status(rd).get('state')}",
    )


# ---------------------------------------------------------------- data and tokenizer


def check_collator_byte_ids(rd, assets):
    from trainer.data import TASKS

    tok = char_tok()
    ex = TASKS["copy"].make_examples(16, 0)
    ids = plugin("collators", "byte_collator")(ex, tok)["input_ids"]
    ok1 = int(ids.max()) >= len(tok)
    ok2, ev = _failed(rd, "index", "range")
    return ok1 and ok2, f"max id {int(ids.max())} >= vocab {len(tok)}; {ev}"


def check_collator_float_ids(rd, assets):
    ex = [{**e, "chosen": e["answer"], "rejected": "1234"} for e in digit_examples(4)]
    b = plugin("collators", "pair_collator")(ex, char_tok())
    ok2, ev = _failed(rd)
    dtype = b["chosen_input_ids"].dtype
    return dtype == torch.float32 and ok2, f"chosen_input_ids {dtype}; {ev}"


def check_collator_time_major(rd, assets):
    ex = digit_examples(4)
    b = plugin("collators", "pad_sequence_collator")(ex, char_tok())
    ok2, ev = _failed(rd)
    shape = tuple(b["input_ids"].shape)
    return shape[1] == 4 and shape[0] != 4 and ok2, f"4 prompts collate to input_ids {shape}; {ev}"


def check_dpo_empty_chosen(rd, assets):
    from trainer.data import PairCollator

    pairs = plugin("data_sources", "pairs_from_records")()
    empty = sum(p["chosen"] == "" for p in pairs)
    b = PairCollator(char_tok(), 16, 8)(pairs[:8])
    lens = b["chosen_response_mask"].sum(-1).tolist()
    return (
        empty == len(pairs),
        (
            f"{empty}/{len(pairs)} chosen completions empty; "
            f"collated chosen response lengths {lens} (eos only); "
            f"run {status(rd).get('state')}"
        ),
    )


def check_dataset_missing_answer(rd, assets):
    ex = plugin("data_sources", "graded_prompts")()
    ok2, ev = _failed(rd, "answer")
    return all("answer" not in e for e in ex) and ok2, f"examples' keys {sorted(ex[0])}; {ev}"


def check_tokenizer_eos_mismatch(rd, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(assets["sft_lm"])
    own = AutoTokenizer.from_pretrained(assets["sft_lm"])
    given = AutoTokenizer.from_pretrained(assets["tok_newline_eos"])
    ex = digit_examples(8)
    enc = own([e["prompt"] for e in ex], return_tensors="pt", padding=True)
    lens = {}
    for name, eos in (("model eos", model.config.eos_token_id), ("tokenizer eos", given.eos_token_id)):
        out = model.generate(
            **enc, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=own.pad_token_id
        )
        gen = out[:, enc["input_ids"].shape[1] :]
        stop = (gen == eos).int()
        lens[name] = [int(s.nonzero()[0]) + 1 if s.any() else gen.shape[1] for s in stop]
    rl = series(metrics(rd), "response_length/mean")
    ok = (
        model.config.eos_token_id != given.eos_token_id
        and max(lens["model eos"]) < 8
        and min(lens["tokenizer eos"]) == 8
    )
    return (
        ok,
        (
            f"model eos {model.config.eos_token_id} vs tokenizer eos {given.eos_token_id}; "
            f"greedy response lengths stopping at model eos {lens['model eos']}, at tokenizer eos {lens['tokenizer eos']}; "
            f"run response_length/mean {_fmt(rl)}"
        ),
    )


def check_critic_backbone_small_vocab(rd, assets):
    cfg = json.loads((Path(assets["critic_vocab64"]) / "config.json").read_text())
    ok2, ev = _failed(rd, "index", "range")
    return cfg[
        "vocab_size"
    ] == 64 and ok2, f"critic vocab {cfg['vocab_size']} vs tokenizer {len(char_tok())}; {ev}"


# ---------------------------------------------------------------- precision configuration


def check_reference_bf16_override(rd, assets):
    return _kl_ref(rd, 0.0)


def check_fp16_without_loss_scaling(rd, assets):
    sc = series(metrics(rd), "actor/loss_scale")
    m = _tiny_actor()
    ids = torch.randint(4, 100, (8, 24), generator=torch.Generator().manual_seed(0))
    zero = {}
    for scale in (1.0, 65536.0):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = m(input_ids=ids).logits
        loss = logits.float().log_softmax(-1)[..., 5].mean() * 1e-3
        (loss * scale).backward()
        grads = torch.cat([p.grad.flatten() / scale for p in m.parameters() if p.grad is not None])
        zero[scale] = float((grads == 0).float().mean())
    ok = bool(sc) and all(s == 1.0 for s in sc) and zero[1.0] > zero[65536.0]
    return (
        ok,
        (
            f"run actor/loss_scale {_fmt(sc)}; "
            f"fp16 autocast backward of a small loss: {zero[1.0]:.1%} zero gradient elements unscaled vs {zero[65536.0]:.1%} at scale 65536"
        ),
    )


def check_fp16_master_weights(rd, assets):
    ms = metrics(rd)
    loss, gn, sk = series(ms, "actor/loss"), series(ms, "actor/grad_norm"), series(ms, "actor/skipped")
    m = _tiny_actor().half()
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    bad = sum(int((~torch.isfinite(p)).sum()) for p in m.parameters())
    eps16 = float(torch.tensor(1e-8, dtype=torch.float16))
    failed, ev = _failed(rd, "nan", "inf", "finite")
    broke = failed or any(not math.isfinite(x) for x in loss + gn)
    return (
        eps16 == 0.0 and bad > 0 and broke,
        (
            f"AdamW eps 1e-8 in fp16 = {eps16}; "
            f"one fp16 AdamW step with zero gradients leaves {bad} non-finite weights; "
            f"run loss {_fmt(loss)}, grad_norm {_fmt(gn)}, skipped {_fmt(sk)}; "
            f"{ev if failed else status(rd).get('state')}"
        ),
    )


CHECKS: dict[str, Callable[[Path, dict], tuple[bool, str]]] = {
    name[len("check_") :]: fn for name, fn in dict(globals()).items() if name.startswith("check_")
}
CHECKS["lr_huge_fp16"] = CHECKS["lr_huge_bf16"] = check_lr_huge


def check_control(rd: Path) -> tuple[bool, str]:
    st = status(rd)
    ms = metrics(rd)
    loss = series(ms, "actor/loss")
    ok = st.get("state") == "completed" and bool(loss) and all(math.isfinite(x) for x in loss)
    return ok, f"{st.get('state')}, {len(ms)} steps, actor/loss {_fmt(loss)}"


def verify_all(items: list[dict], work: Path, assets: dict, runs: dict) -> list[dict[str, Any]]:
    rows = []
    for it in items:
        rd = Path(runs[it["name"]]["run_dir"])
        try:
            if "root_words" in it:
                ok, ev = CHECKS[it["name"]](rd, assets)
            else:
                ok, ev = check_control(rd)
        except Exception as e:  # a broken check is a failed verification, not a crash
            ok, ev = False, f"check raised {type(e).__name__}: {e}"
        rows.append({"item": it, "state": runs[it["name"]].get("state"), "ok": bool(ok), "evidence": ev})
    return rows


def render(rows: list[dict], elapsed: float) -> str:
    n_ok = sum(r["ok"] for r in rows)
    lines = ["# Blind fault bench: verification (no diagnosis)", "",
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
