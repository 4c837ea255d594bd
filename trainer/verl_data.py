"""verl's RL data and reward functions as they are: parquet / JSONL rows, chat templates, ``compute_score``.

A verl dataset row has ``prompt`` (chat messages, a list of ``{role, content}``), ``data_source``,
``reward_model: {ground_truth, style}`` and ``extra_info``. `load_rows` reads the files with pyarrow;
`prepare_examples` renders each prompt with the tokenizer's chat template (``add_generation_prompt``,
then tokenised without special tokens, as verl does), drops overlong prompts when
``filter_overlong_prompts`` is on and truncates the rest as ``truncation`` says (``error`` refuses
them here, before training starts, where verl raises when the row is first drawn). `VerlPromptCollator`
left-pads to ``prompt_length``. `VerlReward` calls a verl ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` per response and hands the trainer one float per response, so the
reward boundary checks every reward gets apply; the other keys of a dict result become
``reward_extra/<key>/mean`` step metrics. `gsm8k_score` is our GSM8K rule scorer for
``data_source: openai/gsm8k``. Exercised by `pytest tests/test_verl_data.py`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainer.config import DataConfig

PLAIN_TEXT_NOTE = (
    "the tokenizer has no chat template: verl prompts are rendered as plain text, one 'role: content' line "
    "per message followed by 'assistant: ', and tokenised with the tokenizer's special tokens (BOS)"
)
"""Printed once when a tokenizer without ``chat_template`` renders verl prompts."""

GSM8K_SOURCES = ("openai/gsm8k",)


# ---------------------------------------------------------------- reading


def _read_file(path: str, where: str) -> list[dict]:
    """Rows of one parquet / JSONL / JSON file as plain Python dicts (nested structs become dicts)."""
    if not os.path.isfile(path):
        raise ValueError(
            f"{where}: {path!r} not found (relative to {os.getcwd()}); verl's data files are read "
            "from local disk, nothing is downloaded"
        )
    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if lower.endswith((".jsonl", ".json")):
            import pyarrow as pa
            import pyarrow.json as pj

            try:
                return pj.read_json(path).to_pylist()  # JSON Lines, what verl's json loader reads
            except pa.ArrowInvalid:
                if lower.endswith(".jsonl"):
                    raise
                import pandas as pd

                return pd.read_json(path, dtype=False, convert_dates=False).to_dict("records")  # a JSON array
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{where}: reading {path!r} failed: {type(e).__name__}: {e}") from e
    raise ValueError(f"{where}: {path!r}: unsupported file type; verl reads .parquet, .jsonl and .json")


def load_rows(files: Sequence[str], where: str = "data.train_files") -> list[dict]:
    """Every row of ``files`` in order, each tagged with ``_file`` and ``_row`` for error messages."""
    rows: list[dict] = []
    for path in files:
        for i, row in enumerate(_read_file(path, where)):
            rows.append({**row, "_file": path, "_row": i})
    if not rows:
        raise ValueError(f"{where}: {', '.join(files)} hold no rows")
    return rows


def count_rows(files: Sequence[str]) -> int | None:
    """Rows in ``files`` without reading them whole (parquet metadata, JSONL lines); None if unreadable."""
    total = 0
    try:
        for path in files:
            if path.lower().endswith(".parquet"):
                import pyarrow.parquet as pq

                total += pq.ParquetFile(path).metadata.num_rows
            else:
                total += len(_read_file(path, "data.train_files"))
    except (OSError, ValueError):
        return None
    return total


def _row_where(row: Mapping[str, Any]) -> str:
    return f"{row.get('_file')} row {row.get('_row')}"


def _messages(row: Mapping[str, Any], prompt_key: str) -> list[dict]:
    if prompt_key not in row:
        have = ", ".join(k for k in row if not k.startswith("_"))
        raise ValueError(
            f"data.prompt_key: {_row_where(row)} has no {prompt_key!r} column (has: {have}); "
            "set data.prompt_key (verl data.prompt_key) to the column of chat messages"
        )
    msgs = row[prompt_key]
    if hasattr(msgs, "tolist"):  # numpy object arrays from pandas
        msgs = msgs.tolist()
    ok = (
        isinstance(msgs, (list, tuple))
        and msgs
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs
        )
    )
    if not ok:
        raise ValueError(
            f"data.train_files: {_row_where(row)}: {prompt_key!r} is {str(msgs)[:80]!r}; verl's RL "
            "format has a non-empty list of chat messages {role: str, content: str} there"
        )
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _check_reward_columns(row: Mapping[str, Any], reward_fn_key: str) -> None:
    rm = row.get("reward_model")
    if (
        not isinstance(rm, Mapping) or rm.get("ground_truth") is None
    ):  # parquet fills a missing field with None
        raise ValueError(
            f"data.train_files: {_row_where(row)} has no reward_model.ground_truth (got "
            f"{str(rm)[:60]!r}); verl's reward functions are called with it"
        )
    if reward_fn_key not in row:
        raise ValueError(
            f"data.reward_fn_key: {_row_where(row)} has no {reward_fn_key!r} column; verl passes it "
            "to compute_score as data_source"
        )


# ---------------------------------------------------------------- prompts


def render_prompt(
    tokenizer, messages: list[dict], chat_template_kwargs: Mapping[str, Any]
) -> tuple[str, bool]:
    """``(text, templated)``: the chat template's rendering with the generation prompt, or the plain-text
    fallback (`PLAIN_TEXT_NOTE`) when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(chat_template_kwargs)
        )
        return text, True
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ", False


def truncate(ids: list[int], max_length: int, mode: str, where: str) -> list[int]:
    """verl's prompt truncation: ``left`` keeps the last ``max_length`` ids, ``right`` the first,
    ``middle`` the first ``max_length // 2`` and the last ``max_length - max_length // 2``; ``error``
    raises a ValueError naming ``where``. Shorter prompts come back unchanged."""
    if len(ids) <= max_length:
        return list(ids)
    if mode == "left":
        return list(ids[-max_length:])
    if mode == "right":
        return list(ids[:max_length])
    if mode == "middle":
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head) :])
    raise ValueError(
        f"data.truncation: {where}: the prompt is {len(ids)} tokens, longer than data.prompt_length "
        f"{max_length} (verl max_prompt_length); raise it, set data.filter_overlong_prompts: true, "
        "or truncation: left / right / middle"
    )


def prepare_examples(data_cfg: DataConfig, tokenizer, *, log: Callable[[str], None] = print) -> list[dict]:
    """verl rows -> training examples: ``prompt`` (the rendered text), ``prompt_ids`` (truncated token
    ids), the row's ``data_source``, ``reward_model``, ``extra_info`` and other columns as they are."""
    rows = load_rows(data_cfg.train_file_list)
    max_len = data_cfg.prompt_length
    examples, dropped, plain = [], 0, False
    for row in rows:
        messages = _messages(row, data_cfg.prompt_key)
        _check_reward_columns(row, data_cfg.reward_fn_key)
        text, templated = render_prompt(tokenizer, messages, data_cfg.chat_template_kwargs)
        plain = plain or not templated
        ids = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
        if data_cfg.filter_overlong_prompts and len(ids) > max_len:
            dropped += 1
            continue
        ids = truncate(ids, max_len, data_cfg.truncation, _row_where(row))
        ex = {k: v for k, v in row.items() if k != data_cfg.prompt_key}
        ex.update(prompt=text, prompt_ids=ids, messages=messages)
        examples.append(ex)
    if data_cfg.compute_score is None:
        check_builtin_scorers(examples, data_cfg.reward_fn_key)
    if plain:
        log(f"note: {PLAIN_TEXT_NOTE}")
    if data_cfg.filter_overlong_prompts:
        log(
            f"note: data.filter_overlong_prompts: kept {len(examples)} of {len(rows)} prompts "
            f"({dropped} longer than {max_len} tokens)"
        )
    if not examples:
        raise ValueError(
            f"data.filter_overlong_prompts: every one of the {len(rows)} prompts is longer than "
            f"data.prompt_length {max_len} tokens; raise data.prompt_length"
        )
    return examples


class VerlPromptCollator:
    """verl examples -> ``input_ids`` / ``attention_mask`` Long[B, prompt_length], left-padded (verl's
    ``postprocess_data`` with ``left_pad=True``) from the ids `prepare_examples` truncated."""

    def __init__(self, tokenizer, prompt_length: int) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("model.tokenizer: the tokenizer has no pad token; add one or use eos as pad")
        self.pad_id = int(tokenizer.pad_token_id)
        self.prompt_length = int(prompt_length)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        p = self.prompt_length
        ids = torch.full((len(examples), p), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), p), dtype=torch.long)
        for i, ex in enumerate(examples):
            row = ex["prompt_ids"]
            assert len(row) <= p, "prepare_examples truncates every prompt to prompt_length"
            if row:
                ids[i, p - len(row) :] = torch.tensor(row, dtype=torch.long)
                mask[i, p - len(row) :] = 1
        return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- rewards


_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: Mapping[str, Any] | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K's rule: the answer is the number after the last ``####`` in the response (``strict``) or
    the last number in it (``flexible``); ``score`` when it equals ``ground_truth`` (commas ignored),
    ``format_score`` when an answer was found but is wrong, 0 when none was found."""
    del data_source, extra_info  # one rule for every row; the signature is verl's
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k_score: method {method!r}; expected strict or flexible")
    found = _GSM8K_ANSWER.findall(solution_str) if method == "strict" else _NUMBER.findall(solution_str)
    if not found:
        return 0.0
    got, want = _number(found[-1]), _number(str(ground_truth))
    return score if got is not None and want is not None and got == want else format_score


BUILTIN_SCORERS: dict[str, Callable[..., Any]] = dict.fromkeys(GSM8K_SOURCES, gsm8k_score)
"""``data_source`` -> our rule scorer, used when ``data.compute_score`` is unset."""


def _by_data_source(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return BUILTIN_SCORERS[data_source](data_source, solution_str, ground_truth, extra_info, **kwargs)


def _as_float(v: Any) -> float | None:
    """A number (Python, numpy or a one-element tensor; bools count as 0/1) as float, else None."""
    if v is None or isinstance(v, (str, bytes, complex)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


class VerlReward:
    """A verl ``compute_score`` as our reward function ``(prompts, responses, examples) -> [float]``.

    Called per response with ``data_source`` (the ``reward_fn_key`` column), ``solution_str`` (the
    response decoded without special tokens), ``reward_model.ground_truth`` and a copy of
    ``extra_info`` (verl adds ``num_turns``; a copy keeps the dataset's own dict unchanged). A dict
    result must have ``score``; its other numeric keys become ``reward_extra/<key>/mean`` step metrics,
    and the call returns one dict per response (``score`` and those keys: GDPO's components,
    `trainer.common.split_reward_parts`) instead of the plain scores."""

    def __init__(self, fn: Callable, name: str, *, reward_fn_key: str, kwargs: Mapping[str, Any]) -> None:
        self.fn, self.name, self.key, self.kwargs = fn, name, reward_fn_key, dict(kwargs)
        self.skipped_keys: set[str] = set()
        self.metrics: dict[str, list[float]] = {}
        """The last call's extra keys: metric name -> one value per response that had the key; their
        sums and counts wait in ``_pending`` until the step's log asks (`take_step_metrics`)."""
        self._pending: dict[str, tuple[float, int]] = {}

    def _one(self, i: int, response: str, ex: Mapping[str, Any]) -> float | dict[str, float]:
        extra = dict(ex.get("extra_info") or {})
        extra.setdefault("num_turns", None)
        try:
            out = self.fn(
                data_source=ex[self.key],
                solution_str=response,
                ground_truth=ex["reward_model"]["ground_truth"],
                extra_info=extra,
                **self.kwargs,
            )
        except Exception as e:  # the user's function: its error becomes a located message
            raise ValueError(
                f"data.compute_score: {self.name} raised {type(e).__name__}: {e} (response {i}, "
                f"{_row_where(ex)})"
            ) from e
        parts: dict[str, float] | None = None
        if isinstance(out, Mapping):
            parts = {}
            if "score" not in out:
                raise ValueError(
                    f"data.compute_score: {self.name} returned a dict without 'score' (keys: "
                    f"{', '.join(map(str, out))}); verl reads the reward from out['score']"
                )
            for key, value in out.items():
                if key == "score":
                    continue
                if (number := _as_float(value)) is not None:
                    self.metrics.setdefault(f"reward_extra/{key}/mean", []).append(number)
                    parts[str(key)] = number
                elif key not in self.skipped_keys:
                    self.skipped_keys.add(key)
                    print(
                        f"note: data.compute_score: {self.name}'s key {key!r} is a {type(value).__name__}, "
                        "not a number: it is kept out of the step metrics"
                    )
            out = out["score"]
        score = _as_float(out)
        if score is None:
            raise ValueError(
                f"data.compute_score: {self.name} returned {type(out).__name__} {str(out)[:40]!r} "
                f"for response {i}; expected a number or a dict with 'score'"
            )
        # NaN stays NaN: the reward boundary check reports it
        return score if parts is None else {"score": score, **parts}

    def __call__(self, prompts: list[str], responses: list[str], examples: list[dict]) -> list:
        del prompts  # verl's signature takes the response only
        self.metrics = {}
        scores = [self._one(i, r, ex) for i, (r, ex) in enumerate(zip(responses, examples))]
        if any(isinstance(s, dict) for s in scores):
            scores = [s if isinstance(s, dict) else {"score": s} for s in scores]
        for k, v in self.metrics.items():
            total, count = self._pending.get(k, (0.0, 0))
            self._pending[k] = (total + math.fsum(v), count + len(v))
        return scores

    def take_step_metrics(self) -> dict[str, tuple[float, int]]:
        """``name -> (sum, count)`` of the extra keys since the last time it was asked (the step's log,
        `trainer.common.StepLog`, asks at every step's start and end), emptied."""
        out, self._pending = self._pending, {}
        return out


def check_builtin_scorers(examples: list[dict], reward_fn_key: str) -> None:
    """ValueError naming the ``data_source`` values that have no built-in scorer (``data.compute_score``
    unset), before training starts."""
    sources = sorted({str(ex[reward_fn_key]) for ex in examples})
    missing = [s for s in sources if s not in BUILTIN_SCORERS]
    if missing:
        raise ValueError(
            f"data.compute_score: unset, and no built-in scorer for data_source "
            f"{', '.join(map(repr, missing))} (built in: {', '.join(BUILTIN_SCORERS)}); set it to "
            "your verl reward function, path/to/file.py:compute_score (verl "
            "custom_reward_function.path / .name)"
        )


def build_reward(data_cfg: DataConfig, resolve: Callable[[str, str], Callable]) -> VerlReward:
    """``data.compute_score`` (resolved with ``resolve``, `trainer.data.resolve_callable`) or the
    built-in scorer of each row's ``data_source`` (`check_builtin_scorers` ran on the rows)."""
    if data_cfg.compute_score is not None:
        fn, name = resolve(data_cfg.compute_score, "data.compute_score"), data_cfg.compute_score
    else:
        fn, name = _by_data_source, "builtin:" + "|".join(BUILTIN_SCORERS)
    return VerlReward(fn, name, reward_fn_key=data_cfg.reward_fn_key, kwargs=data_cfg.compute_score_kwargs)
