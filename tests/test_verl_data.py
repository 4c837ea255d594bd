"""verl's data and reward functions as they are (trainer/verl_data.py): parquet / JSONL rows, chat-template
rendering, truncation and filtering as verl does them, the left-padding collator, compute_score through
VerlReward (dict results, extra metrics, bad returns), the GSM8K rule scorer. Run:
`pytest tests/test_verl_data.py`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.verl_job import CHAT_TEMPLATE, gsm8k_rows, two_rank_extras, write_parquet
from trainer import data as D
from trainer import verl_data as VD
from trainer.common import StepLog
from trainer.config import DataConfig
from trainer.events import NULL_OBSERVER
from trainer.tokenizer import build_tokenizer


def _tok(template: bool = True):
    tok = build_tokenizer()
    if template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def _cfg(files, **kw) -> DataConfig:
    return DataConfig(train_files=files, **kw)


# ---------------------------------------------------------------- reading


def test_parquet_jsonl_and_json_array_give_the_same_rows(tmp_path):
    rows = gsm8k_rows(3)
    pq = write_parquet(tmp_path / "t.parquet", rows)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.json").write_text(json.dumps(rows))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("_")} for r in rs]  # noqa: E731
    for path in (pq, tmp_path / "t.jsonl", tmp_path / "t.json"):
        got = strip(VD.load_rows([str(path)]))
        assert got == rows, path  # nested chat messages and structs come back as lists and dicts
    two = VD.load_rows([str(pq), str(tmp_path / "t.jsonl")])
    assert len(two) == 6 and two[3]["_file"].endswith(".jsonl") and two[3]["_row"] == 0
    assert VD.count_rows([str(pq), str(tmp_path / "t.jsonl")]) == 6


def test_missing_and_unsupported_files_are_located_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data.train_files: '.*nope.parquet' not found"):
        VD.load_rows([str(tmp_path / "nope.parquet")])
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(ValueError, match="unsupported file type; verl reads .parquet, .jsonl and .json"):
        VD.load_rows([str(tmp_path / "x.csv")])


# ---------------------------------------------------------------- prompts


def test_truncation_modes_by_hand():
    ids = list(range(1, 11))
    assert VD.truncate(ids, 4, "left", "w") == [7, 8, 9, 10]
    assert VD.truncate(ids, 4, "right", "w") == [1, 2, 3, 4]
    assert VD.truncate(ids, 4, "middle", "w") == [1, 2, 9, 10]  # 4 // 2 = 2 from the start, 2 from the end
    assert VD.truncate(ids, 5, "middle", "w") == [1, 2, 8, 9, 10]  # 5 // 2 = 2 from the start, 3 from the end
    assert VD.truncate(ids, 10, "error", "w") == ids  # not longer: unchanged
    with pytest.raises(ValueError, match="prompt is 10 tokens, longer than data.prompt_length 9"):
        VD.truncate(ids, 9, "error", "w")


@given(
    st.lists(st.integers(0, 99), max_size=40),
    st.integers(1, 30),
    st.sampled_from(["left", "right", "middle"]),
)
def test_truncation_keeps_a_prefix_and_a_suffix(ids, n, mode):
    out = VD.truncate(ids, n, mode, "w")
    assert len(out) == min(n, len(ids))
    head = {"left": 0, "right": len(out), "middle": len(out) // 2 if len(ids) > n else len(out)}[mode]
    assert out[:head] == ids[:head] and out[head:] == ids[len(ids) - (len(out) - head) :]


def test_prompts_rendered_with_the_chat_template_without_special_tokens(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(2))
    tok = _tok()
    notes: list[str] = []
    ex = VD.prepare_examples(_cfg(str(path), prompt_length=64), tok, log=notes.append)
    text = "<user>" + gsm8k_rows(2)[0]["prompt"][0]["content"] + "\n<assistant>"
    assert ex[0]["prompt"] == text
    assert ex[0]["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert len(ex[0]["prompt_ids"]) == len(text)  # one id per character, no <bos>
    assert ex[0]["reward_model"]["ground_truth"] == gsm8k_rows(2)[0]["reward_model"]["ground_truth"]
    assert ex[0]["messages"] == gsm8k_rows(2)[0]["prompt"] and notes == []


def test_no_chat_template_plain_text_with_a_note(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", gsm8k_rows(1))
    notes: list[str] = []
    ex = VD.prepare_examples(_cfg(str(path), prompt_length=64), _tok(template=False), log=notes.append)
    content = gsm8k_rows(1)[0]["prompt"][0]["content"]
    assert ex[0]["prompt"] == f"user: {content}\nassistant: "
    assert (
        ex[0]["prompt_ids"][0] == build_tokenizer().bos_token_id
        and len(ex[0]["prompt_ids"]) == len(ex[0]["prompt"]) + 1
    )
    assert notes == [f"note: {VD.PLAIN_TEXT_NOTE}"]


def test_overlong_prompts_filtered_truncated_or_refused(tmp_path):
    rows = gsm8k_rows(4)
    rows[1]["prompt"] = [{"role": "user", "content": "x" * 80}]
    path = str(write_parquet(tmp_path / "t.parquet", rows))
    tok = _tok()
    notes: list[str] = []
    kept = VD.prepare_examples(
        _cfg(path, prompt_length=64, filter_overlong_prompts=True), tok, log=notes.append
    )
    assert [e["_row"] for e in kept] == [0, 2, 3]
    assert "kept 3 of 4 prompts (1 longer than 64 tokens)" in notes[-1]
    # "<user>" 6 + 80 x's + "\n" 1 + "<assistant>" 11 = 98 tokens; the others are at most 49
    with pytest.raises(
        ValueError, match=r"t.parquet row 1: the prompt is 98 tokens, longer than data.prompt_length 64"
    ):
        VD.prepare_examples(_cfg(path, prompt_length=64), tok, log=notes.append)
    left = VD.prepare_examples(_cfg(path, prompt_length=64, truncation="left"), tok, log=notes.append)
    assert (
        len(left[1]["prompt_ids"]) == 64 and tok.decode(left[1]["prompt_ids"]) == "x" * 52 + "\n<assistant>"
    )
    assert left[0]["prompt_ids"] == kept[0]["prompt_ids"]  # short prompts untouched
    with pytest.raises(ValueError, match="every one of the 4 prompts is longer than data.prompt_length 5"):
        VD.prepare_examples(_cfg(path, prompt_length=5, filter_overlong_prompts=True), tok, log=notes.append)


def test_row_format_errors_name_the_row(tmp_path):
    rows = gsm8k_rows(2)
    rows[1]["prompt"] = [{"role": "user", "content": "ok"}]
    bad = dict(rows[1], reward_model={"style": "rule"})
    path = str(write_parquet(tmp_path / "t.parquet", [rows[0], bad]))
    with pytest.raises(ValueError, match=r"t.parquet row 1 has no reward_model.ground_truth"):
        VD.prepare_examples(_cfg(path, prompt_length=64), _tok(), log=print)
    with pytest.raises(ValueError, match=r"row 0 has no 'question' column .*set data.prompt_key"):
        VD.prepare_examples(_cfg(path, prompt_length=64, prompt_key="question"), _tok(), log=print)
    (tmp_path / "s.jsonl").write_text(json.dumps(dict(rows[0], prompt="plain string")) + "\n")
    with pytest.raises(ValueError, match="non-empty list of chat messages"):
        VD.prepare_examples(_cfg(str(tmp_path / "s.jsonl"), prompt_length=64), _tok(), log=print)


def test_collator_left_pads_to_prompt_length():
    batch = VD.VerlPromptCollator(build_tokenizer(), 4)(
        [{"prompt_ids": [5, 6]}, {"prompt_ids": [7, 8, 9, 10]}]
    )
    pad = build_tokenizer().pad_token_id
    assert batch["input_ids"].tolist() == [[pad, pad, 5, 6], [7, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch["input_ids"].dtype == torch.long


def test_data_py_hooks_route_verl_files(tmp_path):
    path = str(write_parquet(tmp_path / "t.parquet", gsm8k_rows(3)))
    cfg = _cfg(path, prompt_length=64)
    ex = D.load_examples(cfg, seed=0, pairs=False, tokenizer=_tok())
    assert len(ex) == 3
    source, collate = D.build_collator(cfg, _tok(), pairs=False)
    assert source == "builtin:verl" and collate(ex)["input_ids"].shape == (3, 64)
    name, fn = D.get_reward_fn(cfg)
    assert name.startswith("verl:builtin") and fn(
        [""], ["#### " + ex[0]["reward_model"]["ground_truth"]], ex[:1]
    ) == [1.0]
    with pytest.raises(ValueError, match="verl's RL format holds prompts only; DPO needs"):
        D.load_examples(cfg, seed=0, pairs=True, tokenizer=_tok())


def test_config_checks():
    with pytest.raises(ValueError, match="truncation: 'both'; expected one of error, left, right, middle"):
        DataConfig(train_files="a.parquet", truncation="both")
    with pytest.raises(ValueError, match="compute_score: verl's compute_score needs verl's rows"):
        DataConfig(compute_score="r.py:compute_score")
    with pytest.raises(ValueError, match="set either data.dataset"):
        DataConfig(train_files="a.parquet", dataset="m:f")
    with pytest.raises(ValueError, match="train_files: an empty list"):
        DataConfig.from_dict({"train_files": []}, where="data")
    cfg = DataConfig.from_dict({"train_files": ["a.parquet", "b.jsonl"]}, where="data")
    assert cfg.train_file_list == ("a.parquet", "b.jsonl") and DataConfig(
        train_files="a"
    ).train_file_list == ("a",)


def test_unknown_data_source_without_compute_score(tmp_path):
    rows = [dict(r, data_source="lighteval/MATH") for r in gsm8k_rows(2)]
    path = str(write_parquet(tmp_path / "t.parquet", rows))
    with pytest.raises(ValueError, match="no built-in scorer for data_source 'lighteval/MATH'"):
        VD.prepare_examples(_cfg(path, prompt_length=64), _tok(), log=print)


# ---------------------------------------------------------------- rewards


def _reward(fn, **kw) -> VD.VerlReward:
    return VD.VerlReward(fn, "test", reward_fn_key="data_source", kwargs=kw)


def _examples():
    return [dict(r, _file="f", _row=i) for i, r in enumerate(gsm8k_rows(2))]


def test_compute_score_called_with_verls_arguments():
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        calls.append((data_source, solution_str, ground_truth, dict(extra_info)))
        extra_info["mutated"] = True  # must not reach the dataset's own dict
        return 1 + bonus

    ex = _examples()
    out = _reward(compute_score, bonus=0.5)(["p0", "p1"], ["r0", "r1"], ex)
    assert out == [1.5, 1.5] and all(isinstance(v, float) for v in out)
    assert calls[0] == (
        "openai/gsm8k",
        "r0",
        ex[0]["reward_model"]["ground_truth"],
        {**ex[0]["extra_info"], "num_turns": None},
    )
    assert "mutated" not in ex[0]["extra_info"]


def test_dict_scores_become_step_metrics():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {
            "score": sum(c.isdigit() for c in solution_str) / len(solution_str),
            "acc": solution_str == ground_truth,
            "pred": solution_str,
        }

    ex = _examples()
    gt = ex[0]["reward_model"]["ground_truth"]
    reward = _reward(compute_score)
    log = StepLog(NULL_OBSERVER, 0, sources=(reward,))
    log.start(0)
    scores = reward(["", ""], [gt, "ab"], [ex[0], ex[0]])
    out = log.end(0, {"actor/loss": 0.0})
    # all digits; no digit. A dict result comes back as one dict per response (GDPO's components), its
    # numeric keys only
    assert scores == [{"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}]
    assert out["reward_extra/acc/mean"] == 0.5  # True, False
    assert "reward_extra/pred/mean" not in out and "reward_extra/score/mean" not in out
    log.start(1)
    assert "reward_extra/acc/mean" not in log.end(1, {})  # a step without a reward call has none


def test_bad_returns_are_located_errors_and_nan_passes_through():
    ex = _examples()
    with pytest.raises(ValueError, match=r"returned a dict without 'score' \(keys: acc\)"):
        _reward(lambda **k: {"acc": 1})([""], ["r"], ex[:1])
    with pytest.raises(ValueError, match="returned NoneType 'None' for response 0; expected a number"):
        _reward(lambda **k: None)([""], ["r"], ex[:1])
    with pytest.raises(ValueError, match=r"raised ZeroDivisionError: .* \(response 1, f row 1\)"):
        _reward(lambda **k: 1 / 0 if k["solution_str"] == "b" else 1.0)(["", ""], ["a", "b"], ex)
    out = _reward(lambda **k: float("nan"))([""], ["r"], ex[:1])
    assert math.isnan(out[0])  # the reward boundary check reports it; nothing here hides it
    assert _reward(lambda **k: torch.tensor(0.25))([""], ["r"], ex[:1]) == [0.25]


def test_reward_shape_errors_name_the_compute_score_function():
    from types import SimpleNamespace

    from trainer.ppo import score_responses

    cfg = SimpleNamespace(data=_cfg("train.parquet", compute_score="rewards/math.py:compute_score"))
    setup = SimpleNamespace(models={}, config=cfg, device=torch.device("cpu"), tokenizer=None)
    rollout = SimpleNamespace(response_ids=torch.zeros(2, 3), responses_text=lambda tok: ["a", "b"])
    one_score = lambda prompts, responses, examples: [1.0]  # noqa: E731 (two responses, one score)
    with pytest.raises(
        ValueError, match=r"^data\.compute_score \(rewards/math\.py:compute_score\): returned shape \(1,\)"
    ):
        score_responses(
            setup, NULL_OBSERVER, rollout, _examples(), one_score, "verl:rewards/math.py:compute_score"
        )


def test_gsm8k_score_by_hand():
    s = VD.gsm8k_score
    assert s("openai/gsm8k", "so 1,000 + 234 = #### 1,234", "1234") == 1.0
    assert s("openai/gsm8k", "#### 12 then #### 13", "13") == 1.0  # the last answer counts
    assert s("openai/gsm8k", "#### 12", "13") == 0.0
    assert s("openai/gsm8k", "#### 12", "13", format_score=0.1) == 0.1  # an answer, but wrong
    assert s("openai/gsm8k", "the answer is 42.", "42") == 0.0  # strict: no ####
    assert s("openai/gsm8k", "the answer is 42.", "42", method="flexible") == 1.0
    assert s("openai/gsm8k", "#### -3.5", "-3.5") == 1.0


def test_extra_metrics_are_averaged_over_ranks_with_different_keys(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(two_rank_extras, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    got = [json.loads(Path(f"{tmp_path / 'out'}.{r}").read_text()) for r in (0, 1)]
    assert (
        got[0]["reward_extra/acc/mean"] == got[1]["reward_extra/acc/mean"] == pytest.approx(2 / 3)
    )  # (1+0+1)/3
    assert got[0]["reward_extra/len/mean"] == got[1]["reward_extra/len/mean"] == 4.0  # only rank 1 had it
    assert got[0]["actor/loss"] == 0.5  # the recipe's own metrics are still averaged as before
