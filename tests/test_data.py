"""Tasks, user-code loading, collators, batch iteration: `pytest tests/test_data.py`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import DataConfig
from trainer.data import (
    TASKS,
    PairCollator,
    PromptCollator,
    build_collator,
    get_reward_fn,
    iterate_batches,
    load_examples,
    resolve_callable,
)
from trainer.tokenizer import build_tokenizer

TOK = build_tokenizer()


# ---------------------------------------------------------------- tasks


def test_digits_reward_hand_checked():
    ex = {"prompt": "4 7 1:", "answer": "4444"}
    reward = TASKS["digits"].reward
    # exact: 4/4; "4x45": 1 + 0 + 1 + 0.25 (wrong digit) = 2.25/4; "99": 0.25 + 0.25 = 0.5/4;
    # "" nothing; "44444444": extra characters past the answer are ignored -> 1
    got = reward(["p"] * 5, ["4444", "4x45", "99", "", "44444444"], [ex] * 5)
    assert got == [1.0, 0.5625, 0.125, 0.0, 1.0]


def test_copy_and_sort_rewards_hand_checked():
    assert TASKS["copy"].reward(["abc>"] * 3, ["abc", "abd", "b"], [{"answer": "abc"}] * 3) == [
        1.0,
        2 / 3,
        0.0,
    ]
    # "3 1 2|" -> "123"; "132": positions 0 ok, 1 and 2 swapped -> 1/3
    assert TASKS["sort"].reward(["3 1 2|"] * 2, ["123", "132"], [{"answer": "123"}] * 2) == [1.0, 1 / 3]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_examples_are_correct_and_pairs_differ(name):
    task = TASKS[name]
    examples = task.make_examples(50, seed=1)
    assert examples == task.make_examples(50, seed=1) and examples != task.make_examples(50, seed=2)
    # the exact answer earns full reward; the rejected one strictly less
    assert (
        task.reward([e["prompt"] for e in examples], [e["answer"] for e in examples], examples) == [1.0] * 50
    )
    pairs = task.make_pairs(examples, seed=0)
    rej = task.reward([p["prompt"] for p in pairs], [p["rejected"] for p in pairs], pairs)
    assert all(p["chosen"] == p["answer"] != p["rejected"] for p in pairs)
    assert max(rej) < 1.0
    # everything the task emits is in the tokenizer's alphabet (no <unk>)
    for e in pairs[:10]:
        for text in (e["prompt"], e["chosen"], e["rejected"]):
            assert TOK.unk_token_id not in TOK(text)["input_ids"]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(TASKS)), st.text(alphabet="0123456789abcdefgh", max_size=8), st.integers(0, 99))
def test_rewards_in_unit_interval(name, response, seed):
    ex = TASKS[name].make_examples(1, seed)
    (r,) = TASKS[name].reward([ex[0]["prompt"]], [response], ex)
    assert 0.0 <= r <= 1.0


def test_reward_argument_errors():
    with pytest.raises(ValueError, match="reward got 1 prompts, 2 responses, 1 examples"):
        TASKS["digits"].reward(["a"], ["1", "2"], [{"answer": "1111"}])
    with pytest.raises(
        ValueError,
        match=r"data.dataset: example 0 has no 'answer' \(its fields: 'prompt'\).*set data.reward_fn or model",
    ):
        TASKS["digits"].reward(["a"], ["1"], [{"prompt": "a"}])


# ---------------------------------------------------------------- user code


USER = """
import numpy as np
import torch
NOT_CALLABLE = 3
def dataset():
    return [{"prompt": "1 2:", "chosen": "1111", "rejected": "2222"}, {"prompt": "3:", "chosen": "3333", "rejected": "0000"}]
def no_prompt():
    return [{"text": "x"}]
def not_list():
    return "abc"
def rewards_np(prompts, responses, examples):
    return np.ones(len(responses))
def collate(examples, tokenizer):
    return {"input_ids": torch.zeros(len(examples), 3, dtype=torch.long)}
def collate_bad(examples, tokenizer):
    return [1, 2]
class Box:
    @staticmethod
    def make():
        return dataset()
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_code.py"
    path.write_text(USER)
    return str(path)


def test_resolve_callable_ok(user_file):
    assert resolve_callable(f"{user_file}:dataset", "data.dataset")()[0]["prompt"] == "1 2:"
    assert resolve_callable(f"{user_file}:Box.make", "data.dataset")()[1]["chosen"] == "3333"
    assert resolve_callable("os.path:join", "data.dataset")("a", "b") == "a/b"


def test_resolve_callable_errors(tmp_path, user_file):
    where = "data.reward_fn"
    cases = [
        ("no_colon_here", r"data.reward_fn: 'no_colon_here' has no ':'; expected 'package.module:attr'"),
        ("os.path:", r"data.reward_fn: 'os.path:' is not of the form 'package.module:attr'"),
        (
            "some/dir/mod:fn",
            r"data.reward_fn: 'some/dir/mod:fn': 'some/dir/mod' is neither a module name nor a .py",
        ),
        ("missing/file.py:fn", r"data.reward_fn: 'missing/file.py:fn': file 'missing/file.py' not found"),
        (
            "no_such_pkg_xyz.mod:fn",
            r"importing no_such_pkg_xyz.mod failed: ModuleNotFoundError: No module named",
        ),
        (f"{user_file}:absent", r"user_code.py has no attribute 'absent'"),
        (f"{user_file}:NOT_CALLABLE", r"NOT_CALLABLE is a int, not callable"),
    ]
    for spec, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            resolve_callable(spec, where)
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\n")
    with pytest.raises(
        ValueError, match=r"data.reward_fn: .*broken.py:f': importing .* failed: ZeroDivisionError"
    ):
        resolve_callable(f"{broken}:f", where)


def test_load_examples_task_and_user(user_file):
    ex = load_examples(DataConfig(task="sort", num_examples=7), seed=0, pairs=False)
    assert len(ex) == 7 and "chosen" not in ex[0] and ex[0]["task"] == "sort"
    pairs = load_examples(DataConfig(num_examples=5), seed=0, pairs=True)
    assert all({"prompt", "chosen", "rejected"} <= set(p) for p in pairs)
    user = load_examples(DataConfig(dataset=f"{user_file}:dataset"), seed=0, pairs=True)
    assert [u["chosen"] for u in user] == ["1111", "3333"]
    with pytest.raises(ValueError, match=r"data.dataset: .*example 0 has no 'prompt' key \(has: text\)"):
        load_examples(DataConfig(dataset=f"{user_file}:no_prompt"), seed=0, pairs=False)
    with pytest.raises(ValueError, match=r"data.dataset: .*not_list' returned str; expected a list of dicts"):
        load_examples(DataConfig(dataset=f"{user_file}:not_list"), seed=0, pairs=False)
    with pytest.raises(
        ValueError, match=r"data.task: unknown task 'mul'; expected one of digits, copy, sort"
    ):
        load_examples(DataConfig(task="mul"), seed=0, pairs=False)


def test_get_reward_fn(user_file):
    name, fn = get_reward_fn(DataConfig(task="copy"))
    assert name == "task:copy" and fn(["ab>"], ["ab"], [{"answer": "ab"}]) == [1.0]
    name, fn = get_reward_fn(DataConfig(reward_fn=f"{user_file}:rewards_np"))
    assert name.endswith(":rewards_np") and isinstance(fn(["a"], ["b"], [{}]), np.ndarray)


# ---------------------------------------------------------------- collators


def test_prompt_collator_left_pads_and_keeps_the_end():
    collate = PromptCollator(TOK, 5)
    batch = collate([{"prompt": "12"}, {"prompt": "123456"}])
    # "12" -> <bos> 1 2 = [1, 5, 6], left-padded with <pad>=0 to 5
    # "123456" -> [1, 5..10] (7 ids) truncated from the left: the last 5 = [6, 7, 8, 9, 10]
    assert batch["input_ids"].tolist() == [[0, 0, 1, 5, 6], [6, 7, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["input_ids"].dtype == torch.int64 and batch["attention_mask"].dtype == torch.int64


def test_pair_collator_layout():
    collate = PairCollator(TOK, 4, 3)
    batch = collate([{"prompt": "1", "chosen": "2", "rejected": "345"}])
    # prompt <bos> 1 -> [0, 0, 1, 5]; chosen "2"+eos -> [6, 2, pad]; rejected "345"+eos cut at R=3 -> [7, 8, 9]
    assert batch["chosen_input_ids"].tolist() == [[0, 0, 1, 5, 6, 2, 0]]
    assert batch["chosen_attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0]]
    assert batch["chosen_response_mask"].tolist() == [[1, 1, 0]]
    assert batch["rejected_input_ids"].tolist() == [[0, 0, 1, 5, 7, 8, 9]]
    assert batch["rejected_response_mask"].tolist() == [[1, 1, 1]]
    assert all(v.dtype == torch.int64 for v in batch.values())


def test_build_collator_sources(user_file):
    src, c = build_collator(DataConfig(prompt_length=6), TOK, pairs=False)
    assert src == "builtin:prompt" and c([{"prompt": "1"}])["input_ids"].shape == (1, 6)
    src, c = build_collator(DataConfig(prompt_length=6, response_length=2), TOK, pairs=True)
    assert src == "builtin:pairs" and c([{"prompt": "1", "chosen": "2", "rejected": "3"}])[
        "chosen_input_ids"
    ].shape == (1, 8)
    src, c = build_collator(DataConfig(collator=f"{user_file}:collate"), TOK, pairs=False)
    assert src == f"{user_file}:collate" and c([{}, {}])["input_ids"].shape == (2, 3)
    _, bad = build_collator(DataConfig(collator=f"{user_file}:collate_bad"), TOK, pairs=False)
    with pytest.raises(ValueError, match=r"data.collator: .*collate_bad' returned list; expected a dict"):
        bad([{}])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 9), batch_size=st.integers(1, 7), seed=st.integers(0, 50))
def test_iterate_batches_covers_each_epoch(n, batch_size, seed):
    examples = [{"prompt": str(i), "id": i} for i in range(n)]
    batches = list(itertools.islice(iterate_batches(examples, batch_size, seed=seed), 3 * n))
    assert all(len(b) == batch_size for b in batches)
    stream = [e["id"] for b in batches for e in b]
    # every full epoch of the stream is a permutation of all examples
    for k in range(len(stream) // n):
        assert sorted(stream[k * n : (k + 1) * n]) == list(range(n))
    again = [
        e["id"] for b in itertools.islice(iterate_batches(examples, batch_size, seed=seed), 3 * n) for e in b
    ]
    assert stream == again


def test_iterate_batches_errors():
    with pytest.raises(ValueError, match="no examples"):
        next(iterate_batches([], 2, seed=0))
