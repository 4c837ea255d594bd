"""The examples' invariants: what the rows a dataset returns must be before any reward reads them.

Read from the examples of every collated batch (the list ``on_batch`` receives: one per prompt or
pair, before GRPO repeats them), each found once per run. String comparisons and, where the trainer
hands the audit its tokenizer, one tokenisation of the batch's answers:

- a prompt is not empty (`empty_prompt_findings`): an example whose prompt is blank (a parser that
  missed its pattern and returned ``""``) is generated from the bos token alone and rewarded against
  an answer the policy cannot know;
- distinct rows are distinct examples (`duplicate_findings`): a batch whose rows are mostly one
  example, the same dict object at every position (``[{}] * n`` filled in place) or copies of one
  text, trains on one example ``n`` times;
- a preference completion does not repeat its prompt (`completion_prompt_findings`): chosen and
  rejected that start with the prompt (the whole conversation exported as the completion) put the
  prompt twice in every sequence and spend the response length on the copy;
- the prompt the policy sees does not hold the answer (`answer_leak_findings`): the answer's tokens
  inside the collated prompt rows, where the examples' own prompt texts do not hold them (a collator
  that renders ``prompt + answer``), or inside the prompt texts where the builtin task's own prompts
  never do (the dataset);
- responses can hold the answers (`response_length_findings`): ``data.response_length`` below the
  token count of most answers plus the eos that ends them cuts every response before it is complete;
- numeric answers were not rounded through a low-precision float (`LowPrecisionAnswers`): integer
  answers above fp16's (bf16's) exact range that all lie on its grid (3333 -> 3332) are pooled over
  batches until the chance that the grid holds them all by accident is below `GRID_CHANCE`.

Exercised by `pytest tests/test_invariants_examples.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.audit import data_contract, data_information
from verlaudit.audit.invariants_data import _data_source, _prompt_part, _rows, builtin_task
from verlaudit.rundir import Finding

DUPLICATE_SHARE = 0.25
"""Distinct examples per row of a batch at or below which the batch is mostly one example: a clean
dataset shuffled into batches has (nearly) every row distinct; one aliased dict has one in ``n``."""
MIN_ROWS = 4
"""Rows a batch needs before shares of it are judged."""
LEAK_SHARE = 0.5
"""Share of a batch's rows whose prompt holds the answer from which the answers leaked."""
SHORT_SHARE = 0.5
"""Share of answers longer (in tokens, plus eos) than ``data.response_length`` from which it is a finding."""
GRID_CHANCE = 2.0**-12
"""Chance, under answers spread evenly over the integers, that every distinct large answer lies on the
low-precision grid, below which they were rounded to it (each answer at magnitude ``v`` lands on a grid
of spacing ``s`` with chance ``1/s``)."""
GRID_MIN_VALUES = 6
"""Distinct answers beyond the float's exact range the grid test needs."""


def _text(ex: Any, key: str) -> str | None:
    v = ex.get(key) if isinstance(ex, Mapping) else None
    return v if isinstance(v, str) else None


def _empty_rows(batch, texts, *, tokenizer_info, where, source, ctx) -> list[Finding]:
    """Prompt rows with no attended token but special ones (pad, bos, eos) where the example's text is not
    empty: the collator dropped the text."""
    part = _prompt_part(batch)
    if part is None or part[0].shape[0] != len(texts):
        return []
    special = {tokenizer_info.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")} - {None}
    bare = [i for i, r in enumerate(_rows(*part)) if not [t for t in r if t not in special]]
    if not bare:
        return []
    b = len(texts)
    return [
        Finding(
            severity="error",
            kind=K.EMPTY_PROMPTS,
            where=where,
            message=f"{len(bare)} of {b} prompt rows the collator {source} returned hold no token of their text (only "
            "padding or special tokens attended) although the examples' prompts are not empty: those responses are "
            "generated from nothing and rewarded against an answer the policy cannot know",
            observed={"empty_rows": len(bare), "batch": b, "first_row": bare[0]},
            expected="every prompt row holds its example's tokens",
            fix=f"{source}: encode each example's prompt into its row (check the field it reads and the cut that "
            "keeps prompt_length tokens: keep the prompt's tokens, not the padding)",
            **ctx,
        )
    ]


def empty_prompt_findings(
    examples: Sequence[Mapping[str, Any]],
    *,
    data: Mapping[str, Any],
    ctx: Mapping[str, Any],
    batch: Mapping[str, Any] | None = None,
    tokenizer_info: Mapping[str, Any] | None = None,
    source: str = "the collator",
) -> list[Finding]:
    """``data/empty_prompts`` when examples of the batch carry a blank prompt text (the dataset), or their
    collated rows hold none of their tokens (the collator)."""
    where = f"collator:{source}"
    tokenizer_info = tokenizer_info or {}
    batch = batch or {}
    texts = [_text(ex, "prompt") for ex in examples]
    if not examples or any(t is None for t in texts):
        return []
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if not empty:
        return _empty_rows(batch, texts, tokenizer_info=tokenizer_info, where=where, source=source, ctx=ctx)
    if len(empty) == len(texts) and len(texts) < MIN_ROWS:
        return []
    at = _data_source(data)
    b = len(texts)
    return [
        Finding(
            severity="error",
            kind=K.EMPTY_PROMPTS,
            where=at,
            message=f"{len(empty)} of the batch's {b} examples have an empty prompt ({'' if len(empty) == b else 'others have text; '}"
            "the dataset returned '' for them: a parse or regex that did not match, a missing field read with a "
            "default): those examples are generated from the bos token alone and rewarded against an answer the "
            "policy cannot know from its input",
            observed={"empty_prompts": len(empty), "batch": b, "first_row": empty[0]},
            expected="a non-empty prompt in every example",
            fix=f"{at}: fix the parse that produced the empty prompts (a regex that misses a variant of the "
            "format: 'Q:' without a space), or filter out / drop the examples whose prompt is empty",
            **ctx,
        )
    ]


def _content_key(ex: Mapping[str, Any]) -> tuple:
    return tuple(sorted((str(k), repr(v)) for k, v in ex.items()))


def duplicate_findings(
    examples: Sequence[Mapping[str, Any]], *, data: Mapping[str, Any], ctx: Mapping[str, Any]
) -> list[Finding]:
    """``data/duplicate_rows`` when a batch of `MIN_ROWS`+ holds `DUPLICATE_SHARE` distinct examples per row
    or fewer."""
    b = len(examples)
    if b < MIN_ROWS or not all(isinstance(ex, Mapping) for ex in examples):
        return []
    distinct = len({_content_key(ex) for ex in examples})
    if distinct > DUPLICATE_SHARE * b:
        return []
    objects = len({id(ex) for ex in examples})
    at = _data_source(data)
    aliased = objects <= distinct
    how = (
        f"the {b} rows are {objects} dict object{'s' if objects > 1 else ''} (one dict aliased at every position: "
        "a list built as [{}] * n, or one dict filled and appended in a loop, so every row holds what the last "
        "write put there)"
        if aliased
        else f"the {b} rows are distinct objects holding copies of {distinct} text{'s' if distinct > 1 else ''}"
    )
    fix = (
        f"{at}: build a new dict per row ([{{}} for _ in range(n)], a dict literal or comprehension inside the "
        "loop, or copy.copy each row) instead of filling one dict object in place"
        if aliased
        else f"{at}: de-duplicate the rows (or check how they are generated: the same example written many times)"
    )
    return [
        Finding(
            severity="error",
            kind=K.DUPLICATE_ROWS,
            where=at,
            message=f"the batch's {b} rows are only {distinct} distinct example{'s' if distinct > 1 else ''}: {how}; "
            "the run trains on one example many times instead of the dataset",
            observed={"rows": b, "distinct_examples": distinct, "distinct_objects": objects},
            expected="distinct examples in distinct rows",
            fix=fix,
            **ctx,
        )
    ]


def completion_prompt_findings(
    examples: Sequence[Mapping[str, Any]], *, data: Mapping[str, Any], ctx: Mapping[str, Any]
) -> list[Finding]:
    """``data/completion_repeats_prompt`` when most pairs' chosen and rejected both start with their
    prompt."""
    rows = [(_text(ex, "prompt"), _text(ex, "chosen"), _text(ex, "rejected")) for ex in examples]
    rows = [r for r in rows if all(t is not None for t in r)]
    if len(rows) < MIN_ROWS:
        return []
    hit = [
        (p, c, r)
        for p, c, r in rows
        if len(p.strip()) >= 2
        and c.startswith(p)
        and r.startswith(p)
        and (len(c) > len(p) or len(r) > len(p))
    ]
    if len(hit) < LEAK_SHARE * len(rows):
        return []
    at = _data_source(data)
    p, c, _ = hit[0]
    rl = (data or {}).get("response_length")
    cut = f" (data.response_length {rl} is spent on the copy)" if rl else ""
    return [
        Finding(
            severity="error",
            kind=K.COMPLETION_REPEATS_PROMPT,
            where=at,
            message=f"in {len(hit)} of {len(rows)} preference pairs chosen and rejected both start with the prompt "
            f"itself (prompt {p!r}, chosen {c!r}): the completions hold the whole conversation, so the prompt is "
            f"repeated inside each response{cut} and the preference is learnt on a copy of the prompt, not on "
            "the completions that differ",
            observed={"pairs_repeating_prompt": len(hit), "pairs": len(rows)},
            expected="chosen / rejected that hold the completion only",
            fix=f"{at}: strip the prompt from chosen and rejected (keep only the completion after the prompt: "
            "chosen[len(prompt):]), so the collator does not put the prompt in the response",
            **ctx,
        )
    ]


def _encode(tok: Any, text: str) -> tuple[int, ...] | None:
    try:
        return tuple(tok(text, add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer of another call signature: nothing to compare with
        return None


def _holds(row: Sequence[int], part: Sequence[int]) -> bool:
    n = len(part)
    return any(tuple(row[i : i + n]) == tuple(part) for i in range(len(row) - n + 1))


def _task_share(task: Any) -> float:
    """Share of the builtin task's own prompts that hold their answer's text (a copy task: all)."""
    try:
        own = task.make_examples(64, 0)
        return sum(ex["answer"] in ex["prompt"] for ex in own) / max(len(own), 1)
    except Exception:  # a task that cannot make examples: no reference
        return 1.0


def answer_leak_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/prompt_has_answer`` when most prompt rows hold their example's answer tokens: named on the
    collator when the prompt texts do not hold it, on the dataset when they do and the task's own
    prompts do not."""
    answers = [_text(ex, "answer") for ex in examples]
    prompts = [_text(ex, "prompt") for ex in examples]
    b = len(examples)
    if b < MIN_ROWS or any(a is None or not a.strip() for a in answers) or any(p is None for p in prompts):
        return []
    task = builtin_task(data)
    if any(_text(ex, "chosen") is not None for ex in examples):
        return _chosen_leak(examples, data=data, task=task, ctx=ctx)
    texts = sum(a in p for a, p in zip(answers, prompts))
    tok = tokenizer_info.get("tokenizer")
    part = _prompt_part(batch)
    rows_hit = 0
    if tok is not None and part is not None and part[0].shape[0] == b:
        rows = _rows(*part)
        enc = [_encode(tok, a) for a in answers]
        if all(e is not None and len(e) >= 2 for e in enc):
            rows_hit = sum(_holds(r, e) for r, e in zip(rows, enc))
    collator = rows_hit >= LEAK_SHARE * b and texts < 0.1 * b
    dataset = texts >= LEAK_SHARE * b and task is not None and _task_share(task) < 0.1
    if not (collator or dataset):
        return []
    ex = next((i for i in range(b) if answers[i] in prompts[i]), 0)
    if collator:
        at, n = where, rows_hit
        who = (
            f"the examples' prompt texts do not hold it ({texts} of {b}): the collator {source} writes the answer "
            "into the prompt rows (a formatting function that renders prompt + answer, an SFT template)"
        )
        fix = (
            f"{source}: collate ex['prompt'] alone into input_ids; the answer belongs to the reward (ex['answer']), "
            "not the prompt: remove it from the prompt format"
        )
    else:
        at, n = _data_source(data), texts
        who = (
            f"the dataset's prompt texts already hold it (e.g. {prompts[ex]!r} with answer {answers[ex]!r}), "
            f"which the {task.name} task's own prompts never do"
        )
        fix = f"{at}: build each prompt without its answer (remove the answer / target from the prompt text)"
    return [
        Finding(
            severity="error",
            kind=K.PROMPT_HAS_ANSWER,
            where=at,
            message=f"{n} of {b} prompts the policy sees hold their example's answer (the target the reward checks): "
            f"{who}; the policy is rewarded for copying a leaked target from its input, not for solving the task",
            observed={"rows_with_answer": rows_hit, "texts_with_answer": texts, "batch": b},
            expected="prompts that do not contain the answer",
            fix=fix,
            **ctx,
        )
    ]


def _chosen_leak(examples, *, data, task, ctx) -> list[Finding]:
    """A DPO pair whose prompt text holds its chosen completion (and not its rejected one): the preferred
    side is readable from the input, where the task's own prompts never hold their answer."""
    rows = [(_text(ex, "prompt"), _text(ex, "chosen"), _text(ex, "rejected")) for ex in examples]
    if any(t is None for r in rows for t in r) or task is None or _task_share(task) >= 0.1:
        return []
    hit = [
        r for r in rows if len(r[1].strip()) >= 2 and r[1] in r[0] and r[2] not in r[0] and r[1] not in r[2]
    ]
    if len(hit) < LEAK_SHARE * len(rows):
        return []
    at = _data_source(data)
    return [
        Finding(
            severity="error",
            kind=K.PROMPT_HAS_ANSWER,
            where=at,
            message=f"{len(hit)} of {len(rows)} preference pairs hold their chosen completion inside the prompt "
            f"(prompt {hit[0][0]!r}, chosen {hit[0][1]!r}) and not the rejected one: the preferred answer is "
            "leaked in the input, so the preference is learnt as 'copy the prompt', not as the task",
            observed={"pairs_with_chosen_in_prompt": len(hit), "pairs": len(rows)},
            expected="prompts that do not contain the chosen completion",
            fix=f"{at}: build each prompt without its answer / chosen completion (remove it from the prompt text)",
            **ctx,
        )
    ]


def response_length_findings(
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/response_shorter_than_answer`` when most answers need more tokens (plus eos) than
    ``data.response_length`` allows."""
    rl = (data or {}).get("response_length")
    tok = tokenizer_info.get("tokenizer")
    answers = [_text(ex, "answer") for ex in examples]
    if not isinstance(rl, int) or tok is None or len(answers) < MIN_ROWS or any(a is None for a in answers):
        return []
    if any(_text(ex, "chosen") is not None for ex in examples):
        return []  # DPO's responses are the pairs' texts: the pair checks read their cut
    enc = [_encode(tok, a) for a in answers if a.strip()]
    if len(enc) < MIN_ROWS or any(e is None for e in enc):
        return []
    need = [len(e) + 1 for e in enc]  # the answer and the eos that ends it
    over = sum(n > rl for n in need)
    if over < SHORT_SHARE * len(need):
        return []
    longest = max(need)
    return [
        Finding(
            severity="warning",
            kind=K.RESPONSE_SHORTER_THAN_ANSWER,
            where=f"data.response_length ({rl})",
            message=f"data.response_length is {rl} tokens, but {over} of {len(need)} answers need more (the answer's "
            f"tokens plus eos: up to {longest}): every such response is truncated before it can be complete or end "
            "with eos, so the reward cannot reach its maximum and the policy never learns to stop",
            observed={
                "response_length": rl,
                "answers_longer": over,
                "answers": len(need),
                "longest_needed": longest,
            },
            expected=f"data.response_length >= {longest}",
            fix=f"data.response_length: set it to at least {longest} (the longest answer in tokens plus eos; "
            f"it is {rl}), so a response can hold the whole answer and its eos",
            **ctx,
        )
    ]


_GRIDS = (("bf16", 8, 2**8), ("fp16", 11, 2**11))
"""(name, significand bits, largest integer below which every integer is exact)."""


def _spacing_bits(v: int, bits: int) -> int:
    """log2 of the float's spacing at integer magnitude ``v`` (0 inside its exact range)."""
    return max(0, abs(v).bit_length() - bits)


class LowPrecisionAnswers:
    """Integer answers pooled over batches: all of the distinct ones beyond a low-precision float's exact
    range on its grid, with a chance below `GRID_CHANCE` (``data/answers_low_precision``)."""

    def __init__(self) -> None:
        self.values: set[int] = set()
        self.off: set[str] = set()
        self.done = False

    def observe(
        self, examples: Sequence[Mapping[str, Any]], *, data: Mapping[str, Any], ctx: Mapping[str, Any]
    ) -> list[Finding]:
        if self.done:
            return []
        for ex in examples:
            a = _text(ex, "answer")
            if a is None or not a.strip().lstrip("-").isdigit():
                continue
            try:
                self.values.add(int(a))
            except ValueError:  # digits int() does not read (superscripts): not a number column
                continue
        for name, bits, exact in _GRIDS:
            if name in self.off:
                continue
            big = sorted(v for v in self.values if abs(v) > exact)
            on = [v for v in big if v % (1 << _spacing_bits(v, bits)) == 0]
            if len(on) < len(big):
                self.off.add(name)  # one answer off the grid: this float did not round them
                continue
            chance_bits = sum(_spacing_bits(v, bits) for v in big)
            if len(big) < GRID_MIN_VALUES or 2.0**-chance_bits > GRID_CHANCE:
                continue
            self.done = True
            at = _data_source(data)
            shown = ", ".join(str(v) for v in big[:6])
            return [
                Finding(
                    severity="error",
                    kind=K.ANSWERS_LOW_PRECISION,
                    where=at,
                    message=f"all {len(big)} distinct numeric answers above {exact} lie on {name}'s grid ({shown}, "
                    f"each a multiple of {name}'s spacing at its magnitude; integers beyond {exact} spread evenly "
                    f"would land there by chance once in {2**chance_bits:.0f}): the answers were stored in a "
                    f"{name} array and rounded (3333 -> 3332 in fp16), so the reward checks responses against "
                    "wrong answers",
                    observed={"grid": name, "values_on_grid": len(big), "chance": 2.0**-chance_bits},
                    expected=f"answers kept exactly (not rounded to {name})",
                    fix=f"{at}: keep the answers as Python int / str (or an int64 / float64 / object column), not "
                    f"a {name} array",
                    **ctx,
                )
            ]
        return []


class ExampleWatch:
    """The examples' invariants over a run, each kind found once."""

    def __init__(self, *, reload: bool = True) -> None:
        self.found: set[str] = set()
        self.grid = LowPrecisionAnswers()
        self.conflicts = data_contract.ConflictWatch()  # data12: one prompt, two ground truths
        self.reload = reload
        """Whether the conflict check may call ``data.dataset`` once more to read the whole dataset."""
        self.information = data_information.InformationWatch()  # data13: what the dataset says

    def findings(
        self,
        batch: Mapping[str, Any],
        *,
        examples: Sequence[Mapping[str, Any]],
        tokenizer_info: Mapping[str, Any],
        data: Mapping[str, Any] | None,
        source: str,
        ctx: Mapping[str, Any],
    ) -> list[Finding]:
        if examples and (data or {}).get("train_files"):
            return self._verl(examples, data=dict(data or {}), ctx=ctx)
        if not examples:
            return []
        data = dict(data or {})
        where = f"collator:{source}"
        out: list[Finding] = []
        checks = {
            K.EMPTY_PROMPTS: lambda: empty_prompt_findings(
                examples, data=data, ctx=ctx, batch=batch, tokenizer_info=tokenizer_info, source=source
            ),
            K.DUPLICATE_ROWS: lambda: duplicate_findings(examples, data=data, ctx=ctx),
            K.COMPLETION_REPEATS_PROMPT: lambda: completion_prompt_findings(examples, data=data, ctx=ctx),
            K.PROMPT_HAS_ANSWER: lambda: answer_leak_findings(
                batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, where=where, ctx=ctx
            ),
            K.RESPONSE_SHORTER_THAN_ANSWER: lambda: response_length_findings(
                examples, tokenizer_info=tokenizer_info, data=data, ctx=ctx
            ),
            K.ANSWERS_LOW_PRECISION: lambda: self.grid.observe(examples, data=data, ctx=ctx),
            **self._contract(
                batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, ctx=ctx
            ),
        }
        for f in self._information(examples, data=data, ctx=ctx) + data_contract.guarded(
            lambda: (
                data_information.pair_form_findings(
                    batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, ctx=ctx
                )
                + data_information.pair_prompt_findings(
                    batch, tokenizer_info=tokenizer_info, source=source, ctx=ctx
                )
            )
        ):
            if f.kind not in self.found:
                self.found.add(f.kind)
                out.append(f)
        for kind, check in checks.items():
            if kind not in self.found:
                for f in check():  # a check may report a related kind (data12's): each kind once per run
                    if f.kind not in self.found:
                        self.found.add(f.kind)
                        out.append(f)
        return out

    def _verl(self, examples, *, data, ctx) -> list[Finding]:
        """verl's rows are rendered from files by the trainer (their own checks read the rows): of the examples'
        invariants only the ground truths' (data12), read from the messages and ``reward_model.ground_truth``."""
        plain = data_contract.guarded(lambda: [data_contract.verl_plain(ex) for ex in examples])
        data_contract.guarded(lambda: self.conflicts.add(plain) or self.conflicts.reload(data, allowed=True))
        out = []
        for f in [
            *data_contract.guarded(lambda: self.conflicts.findings(data=data, ctx=ctx)),
            *data_contract.guarded(lambda: data_contract.notation_findings(plain, data=data, ctx=ctx)),
            *self._information(plain, data=data, ctx=ctx),
        ]:
            if f.kind not in self.found:
                self.found.add(f.kind)
                out.append(f)
        return out

    def _information(self, examples, *, data, ctx) -> list[Finding]:
        """data13: what the dataset says (`verlaudit.audit.data_information`): after the data contract's
        reload (in `_contract` / `_verl`), read over the whole dataset."""
        self.information.observe(examples)
        return data_contract.guarded(
            lambda: self.information.findings(data=data, dataset=self.conflicts.dataset, ctx=ctx)
        )

    def _contract(self, batch, examples, *, tokenizer_info, data, source, ctx) -> dict:
        """data12: the data contract's checks (`verlaudit.audit.data_contract`), by the kind each reports."""
        where = f"collator:{source}"
        g = data_contract.guarded  # a bug of these checks is the audit's: never the user's run's end
        g(lambda: self.conflicts.add(examples) or self.conflicts.reload(data, allowed=self.reload))
        trip = lambda: data_contract.round_trip_findings(  # noqa: E731
            batch, examples, tokenizer_info=tokenizer_info, data=data, source=source, where=where, ctx=ctx
        )
        conflicts = lambda: self.conflicts.findings(data=data, ctx=ctx)  # noqa: E731
        return {
            K.PROMPT_REWRITTEN: lambda: g(trip),
            K.SPECIAL_TOKEN_CONTENT: lambda: g(
                lambda: data_contract.special_content_findings(
                    examples, tokenizer_info=tokenizer_info, ctx=ctx
                )
            ),
            K.ANSWER_UNREACHABLE: lambda: g(
                lambda: data_contract.unreachable_findings(
                    examples, tokenizer_info=tokenizer_info, data=data, ctx=ctx
                )
            ),
            K.ANSWER_NOTATION: lambda: g(
                lambda: data_contract.notation_findings(examples, data=data, ctx=ctx)
            ),
            K.CONFLICTING_ANSWERS: lambda: g(conflicts),
            K.COMPLETION_REWRITTEN: lambda: g(
                lambda: data_contract.completion_round_trip_findings(
                    batch, examples, tokenizer_info=tokenizer_info, source=source, where=where, ctx=ctx
                )
            ),
        }
