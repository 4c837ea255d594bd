"""Data: built-in verifiable tasks, user code loading, collators, batch iteration.

Tasks are small enough that a tiny random-init model measurably improves its reward within a minute
or two of PPO or GRPO on a CPU, and each has a rule reward and DPO pairs. User datasets, collators and
reward functions are named ``module:attr`` or ``path/to/file.py:attr`` and imported, never eval-ed.
Exercised by `pytest tests/test_data.py`.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from trainer.config import DataConfig
from trainer.plugins import resolve_callable  # noqa: F401 - trainer.data.resolve_callable is the old home

# ---------------------------------------------------------------- built-in tasks


def _match_fraction(response: str, answer: str) -> float:
    """Fraction of the answer's characters the response has at the same position. Characters past
    the answer's length are ignored: generation stops at eos or at the response length anyway."""
    if not answer:
        return 0.0
    return sum(a == b for a, b in zip(response, answer)) / len(answer)


class Task:
    """A verifiable task: prompts, exact answers, a rule reward in [0, 1] and DPO pairs."""

    name = ""
    description = ""

    def make_prompt_answer(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def wrong_answer(self, example: dict, rng: random.Random) -> str:
        raise NotImplementedError

    def score(self, response: str, example: dict) -> float:
        return _match_fraction(response, example["answer"])

    def make_examples(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(f"{self.name}:{seed}")
        out = []
        for _ in range(n):
            prompt, answer = self.make_prompt_answer(rng)
            out.append({"prompt": prompt, "answer": answer, "task": self.name})
        return out

    def reward(self, prompts: list[str], responses: list[str], examples: list[dict]) -> list[float]:
        if not (len(prompts) == len(responses) == len(examples)):
            raise ValueError(
                f"task {self.name}: reward got {len(prompts)} prompts, {len(responses)} responses, "
                f"{len(examples)} examples; expected one example per response"
            )
        for i, ex in enumerate(examples):
            if "answer" not in ex:
                keys = ", ".join(repr(k) for k in ex) or "none"
                raise ValueError(
                    f"data.dataset: example {i} has no 'answer' (its fields: {keys}), which the "
                    f"{self.name!r} task's rule reward reads; give every example an 'answer' field, or "
                    "set data.reward_fn or model.reward_model to a reward that reads the fields it has"
                )
        return [self.score(r, ex) for r, ex in zip(responses, examples)]

    def make_pairs(self, examples: list[dict], seed: int) -> list[dict]:
        rng = random.Random(f"{self.name}:pairs:{seed}")
        return [{**ex, "chosen": ex["answer"], "rejected": self.wrong_answer(ex, rng)} for ex in examples]


class DigitsTask(Task):
    """``"4 7 1 9:"`` -> ``"4444"``: repeat the first digit. Partial credit for a wrong digit makes the
    reward dense from the first step: a random model first learns to emit digits (10 of ~100 ids),
    then which digit."""

    name = "digits"
    description = "repeat the prompt's first digit 4 times"
    answer_length = 4

    def make_prompt_answer(self, rng):
        digits = [rng.choice(string.digits) for _ in range(rng.randint(2, 4))]
        return " ".join(digits) + ":", digits[0] * self.answer_length

    def score(self, response, example):
        answer = example["answer"]
        # 1 per correct digit, 0.25 per wrong digit: hand-checked in tests/test_data.py.
        credit = sum(1.0 if r == a else (0.25 if r.isdigit() else 0.0) for r, a in zip(response, answer))
        return credit / len(answer)

    def wrong_answer(self, example, rng):
        other = rng.choice([d for d in string.digits if d != example["answer"][0]])
        return other * self.answer_length


class CopyTask(Task):
    """``"cab>"`` -> ``"cab"``: copy 2-4 lowercase letters."""

    name = "copy"
    description = "copy the letters before '>'"

    def make_prompt_answer(self, rng):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
        return word + ">", word

    def wrong_answer(self, example, rng):
        answer = example["answer"]
        i = rng.randrange(len(answer))
        return answer[:i] + rng.choice([c for c in "abcdefgh" if c != answer[i]]) + answer[i + 1 :]


class SortTask(Task):
    """``"3 1 2|"`` -> ``"123"``: the prompt's digits in ascending order (the hardest built-in)."""

    name = "sort"
    description = "sort the digits before '|' ascending"

    def make_prompt_answer(self, rng):
        digits = [rng.choice(string.digits) for _ in range(rng.randint(2, 4))]
        return " ".join(digits) + "|", "".join(sorted(digits))

    def wrong_answer(self, example, rng):
        answer = example["answer"]
        if len(set(answer)) > 1:
            return answer[::-1]  # descending: same digits, wrong order
        return answer[:-1] + rng.choice([d for d in string.digits if d != answer[-1]])


TASKS: dict[str, Task] = {t.name: t for t in (DigitsTask(), CopyTask(), SortTask())}


def digits_parts(prompts: list[str], responses: list[str], examples: list[dict]) -> list[dict[str, float]]:
    """The ``digits`` reward in parts, one dict per response (verl's ``compute_score`` dict form): ``score``
    (the task's reward), ``correct`` (the fraction of the answer's positions with the right digit) and
    ``digits`` (with any digit), so score = 0.75 correct + 0.25 digits; a ``data.reward_fn`` for GDPO's
    ``gdpo_reward_keys: [correct, digits]`` (benchmarks/learning_curves.py)."""
    scores = TASKS["digits"].reward(prompts, responses, examples)
    out = []
    for score, r, ex in zip(scores, responses, examples):
        pairs = list(zip(r, ex["answer"]))
        n = len(ex["answer"])
        out.append(
            {
                "score": score,
                "correct": sum(a == b for a, b in pairs) / n,
                "digits": sum(a.isdigit() for a, _ in pairs) / n,
            }
        )
    return out


TINY_LEARNING_SETTINGS: dict[str, dict] = {
    "ppo": {"lr": 2e-3, "critic_lr": 2e-3, "batch_size": 16, "mini_batch_size": 8, "micro_batch_size": 8,
            "ppo_epochs": 2},
    "grpo": {"lr": 1e-3, "batch_size": 8, "mini_batch_size": 16, "micro_batch_size": 16, "ppo_epochs": 2},
    "dpo": {"lr": 1e-3, "batch_size": 16, "mini_batch_size": 8, "micro_batch_size": 8},
}  # fmt: skip
"""``algo`` settings at which the tiny-llama preset measurably learns the ``digits`` task on CPU in a few
dozen steps (tests/test_train.py asserts it; benchmarks/learning_curves.py measures it). The config
defaults (lr 1e-4) are sized for real models and barely move a ~100k-parameter one."""
"""Built-in tasks by name (``data.task``)."""


# ---------------------------------------------------------------- loading


def _validate_examples(examples: Any, spec: str, *, pairs: bool) -> list[dict]:
    where = "data.dataset"
    if not isinstance(examples, (list, tuple)):
        raise ValueError(f"{where}: {spec!r} returned {type(examples).__name__}; expected a list of dicts")
    if not examples:
        raise ValueError(f"{where}: {spec!r} returned no examples")
    need = ("prompt", "chosen", "rejected") if pairs else ("prompt",)
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise ValueError(f"{where}: {spec!r} example {i} is a {type(ex).__name__}; expected a dict")
        for key in need:
            if key not in ex:
                raise ValueError(
                    f"{where}: {spec!r} example {i} has no {key!r} key (has: {', '.join(map(str, ex)) or 'none'})"
                    + ("; DPO needs prompt, chosen and rejected" if pairs else "")
                )
            if not isinstance(ex[key], str):
                raise ValueError(
                    f"{where}: {spec!r} example {i}: {key!r} is a {type(ex[key]).__name__}, expected str"
                )
    return list(examples)


def _task(data_cfg: DataConfig) -> Task:
    if data_cfg.task not in TASKS:
        raise ValueError(f"data.task: unknown task {data_cfg.task!r}; expected one of {', '.join(TASKS)}")
    return TASKS[data_cfg.task]


def load_examples(data_cfg: DataConfig, *, seed: int, pairs: bool, tokenizer=None) -> list[dict]:
    """verl's data files (``data.train_files``, rendered with ``tokenizer``), the user's dataset
    (``data.dataset``, called with no arguments) or the task's examples; with ``pairs``, each example
    also has ``chosen`` and ``rejected``."""
    if data_cfg.train_files is not None:
        if pairs:
            raise ValueError(
                "data.train_files: verl's RL format holds prompts only; DPO needs chosen/rejected "
                "pairs: use data.dataset"
            )
        assert tokenizer is not None, "verl prompts are rendered with the model's chat template"
        from trainer import verl_data

        return verl_data.prepare_examples(data_cfg, tokenizer)
    if data_cfg.dataset is not None:
        fn = resolve_callable(data_cfg.dataset, "data.dataset")
        try:
            examples = fn()
        except Exception as e:
            raise ValueError(
                f"data.dataset: calling {data_cfg.dataset!r} failed: {type(e).__name__}: {e}"
            ) from e
        return _validate_examples(examples, data_cfg.dataset, pairs=pairs)
    task = _task(data_cfg)
    examples = task.make_examples(data_cfg.num_examples, seed)
    return task.make_pairs(examples, seed) if pairs else examples


def get_reward_fn(data_cfg: DataConfig) -> tuple[str, Callable]:
    """``(name, fn)``: the user's ``data.reward_fn`` or the task's rule reward ``task:<name>``.
    ``fn(prompts, responses, examples)`` may return a list, a numpy array or a tensor. With
    ``data.train_files`` it is verl's ``compute_score`` behind `trainer.verl_data.VerlReward`."""
    if data_cfg.train_files is not None:
        from trainer import verl_data

        reward = verl_data.build_reward(data_cfg, resolve_callable)
        return f"verl:{reward.name}", reward
    if data_cfg.reward_fn is not None:
        return data_cfg.reward_fn, resolve_callable(data_cfg.reward_fn, "data.reward_fn")
    task = _task(data_cfg)
    return f"task:{task.name}", task.reward


# ---------------------------------------------------------------- collators


def _left_pad(rows: list[list[int]], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[-length:]  # keep the end: the part next to the response
        if row:
            ids[i, length - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, length - len(row) :] = 1
    return ids, mask


def _right_pad(rows: list[list[int]], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:length]
        if row:
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
    return ids, mask


TRUNCATION_KEY = "prompt_truncation"
"""The batch key of the builtin collators' truncation report (`truncation_report`): Long[B, 4], one row
per prompt, so that a user's collator wrapping a builtin one can treat it as any other tensor field.
The audit reads it from ``on_batch``'s batch; the trainers read only the fields they need."""


def truncation_report(rows: list[list[int]], length: int) -> torch.Tensor:
    """What cutting ``rows`` to their last ``length`` ids did, Long[B, 4]: per row its length before
    the cut, the index of the first row with the same ids before the cut, the same after it, and
    ``length``."""
    before: dict[tuple[int, ...], int] = {}
    after: dict[tuple[int, ...], int] = {}
    out = [
        [len(r), before.setdefault(tuple(r), i), after.setdefault(tuple(r[-length:]), i), int(length)]
        for i, r in enumerate(rows)
    ]
    return torch.tensor(out, dtype=torch.long).reshape(len(rows), 4)


def _encode_prompts(tokenizer, examples: list[dict]) -> list[list[int]]:
    return [tokenizer(ex["prompt"], add_special_tokens=True)["input_ids"] for ex in examples]


class PromptCollator:
    """Prompts -> ``input_ids`` / ``attention_mask`` Long[B, P], left-padded to exactly
    ``prompt_length``; longer prompts keep their end (tokenizer settings are not consulted). The batch
    also holds `TRUNCATION_KEY`: what the cut did (`truncation_report`)."""

    def __init__(self, tokenizer, prompt_length: int) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("model.tokenizer: the tokenizer has no pad token; add one or use eos as pad")
        self.tokenizer = tokenizer
        self.prompt_length = int(prompt_length)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = _encode_prompts(self.tokenizer, examples)
        ids, mask = _left_pad(rows, self.prompt_length, self.tokenizer.pad_token_id)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            TRUNCATION_KEY: truncation_report(rows, self.prompt_length),
        }


class PairCollator:
    """DPO pairs -> chosen/rejected ``input_ids`` and ``attention_mask`` Long[B, P+R] (prompt left-padded
    to P, completion + eos right-padded to R, cut at R so eos may be lost on long completions) and
    ``chosen_response_mask`` / ``rejected_response_mask`` Long[B, R]; fits
    ``sequence_logprobs(..., response_length=R)``; the prompts' truncation under `TRUNCATION_KEY`."""

    def __init__(self, tokenizer, prompt_length: int, response_length: int) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("model.tokenizer: DPO pairs need pad and eos tokens")
        self.tokenizer = tokenizer
        self.prompt_length = int(prompt_length)
        self.response_length = int(response_length)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        prompts = _encode_prompts(tok, examples)
        p_ids, p_mask = _left_pad(prompts, self.prompt_length, tok.pad_token_id)
        out: dict[str, torch.Tensor] = {TRUNCATION_KEY: truncation_report(prompts, self.prompt_length)}
        for side in ("chosen", "rejected"):
            rows = [
                tok(ex[side], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for ex in examples
            ]
            r_ids, r_mask = _right_pad(rows, self.response_length, tok.pad_token_id)
            out[f"{side}_input_ids"] = torch.cat([p_ids, r_ids], dim=1)
            out[f"{side}_attention_mask"] = torch.cat([p_mask, r_mask], dim=1)
            out[f"{side}_response_mask"] = r_mask
        return out


def build_collator(data_cfg: DataConfig, tokenizer, *, pairs: bool) -> tuple[str, Callable]:
    """``(source, collator)``: the user's ``data.collator`` (called as ``fn(examples, tokenizer)``;
    source is its spec) or ``builtin:prompt`` / ``builtin:pairs``."""
    if data_cfg.collator is not None:
        spec = data_cfg.collator
        fn = resolve_callable(spec, "data.collator")

        def user_collator(examples: list[dict]) -> dict:
            batch = fn(examples, tokenizer)
            if not isinstance(batch, Mapping):
                raise ValueError(
                    f"data.collator: {spec!r} returned {type(batch).__name__}; expected a dict of tensors"
                )
            return dict(batch)

        return spec, user_collator
    if data_cfg.train_files is not None and not pairs:
        from trainer import verl_data

        return "builtin:verl", verl_data.VerlPromptCollator(tokenizer, data_cfg.prompt_length)
    if pairs:
        return "builtin:pairs", PairCollator(tokenizer, data_cfg.prompt_length, data_cfg.response_length)
    return "builtin:prompt", PromptCollator(tokenizer, data_cfg.prompt_length)


def iterate_batches(examples: list[dict], batch_size: int, *, seed: int) -> Iterator[list[dict]]:
    """Endless batches of exactly ``batch_size`` examples; each epoch is a fresh shuffle, and a batch
    may span two epochs."""
    if not examples:
        raise ValueError("data: no examples to iterate over")
    if batch_size < 1:
        raise ValueError(f"algo.batch_size: must be >= 1, got {batch_size}")
    rng = random.Random(seed)
    batch: list[dict] = []
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in order:
            batch.append(examples[i])
            if len(batch) == batch_size:
                yield batch
                batch = []
