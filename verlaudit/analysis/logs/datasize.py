"""A dataset too small for the batch it is asked for (logs12 branch, issue 25): the data loader yields no batch, or
fewer batches than one optimizer step takes, so the trainer divides by zero steps, samples from nothing or refuses
to plan a schedule. The messages each library prints for it, not the item that showed it:

- PyTorch's sampler over an empty dataset: ``num_samples should be a positive integer value, but got num_samples=0``;
- the trainer planning its schedule: a ``ZeroDivisionError`` raised in the training loop's or the scheduler's own frames
  (``num_update_steps_per_epoch = len(dataloader) // gradient_accumulation_steps`` is 0; a linear schedule over 0
  training steps);
- a plain message saying so: ``dataset is empty``, ``batch size (N) is larger than the dataset (M)``, ``not enough
  samples``.

The cause is an ``exception`` whose fix is the arithmetic: samples >= per-device batch x gradient accumulation x
data-parallel size (with ``drop_last`` every partial batch is dropped), or a dataset that filtering (a length
limit, a wrong split or column) left empty. Exercised by ``pytest tests/test_log_families12.py -k data``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, failure_signal, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_MESSAGES = re.compile(
    r"num_samples should be a positive integer value, but got num_samples=0"
    r"|\b(?:the )?(?:train(?:ing)? )?dataset is empty\b|\bempty (?:train(?:ing)? )?dataset\b"
    r"|batch[ _]size \(?\d+\)? (?:is )?(?:larger|greater|bigger) than (?:the )?(?:number of samples|dataset|len)"
    r"|not enough (?:samples|data|examples) (?:in the dataset )?(?:to|for) (?:form|fill|make) (?:a |one )?(?:batch|step)",
    re.I,
)
_HAS = hints("num_samples", "mpty", "atch size", "atch_size", "not enough")
# the frames where a zero step count divides: the trainers' training loops and schedule set-up, the schedulers
_LOOP = re.compile(
    r"_inner_training_loop|_get_train_sampler|get_\w*schedule\w*|lr_lambda|num_update_steps|"
    r"create_scheduler|create_optimizer_and_scheduler|_setup_training|num_training_steps|total_training_steps"
)


def detect(line: LogLine) -> list[Hit]:
    text = line.text
    # only where the line reports a failure: "Validation dataset is empty, skipping evaluation" is a note
    if _HAS(text) and (m := _MESSAGES.search(text)) and failure_signal(line) is not None:
        return [Hit("data_too_small", line, {"said": m[0]})]
    return []


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    h = facts.first("data_too_small") or _zero_steps(facts)
    if h is None:
        return []
    pl = place(facts, h.line)
    return [
        Cause(
            "error",
            "exception",
            "The dataset is too small for one batch / one optimizer step: " + h.line.text.strip()[:140],
            "The data loader yields no batch, or fewer batches than one optimizer step takes: the dataset (after "
            "filtering) has fewer samples than per-device batch size x gradient accumulation steps x data-parallel "
            "size, so the trainer plans zero update steps (a division by zero, an empty sampler, no schedule). "
            "Nothing is wrong with the model; the sizes do not fit.",
            evidence=[quote(h.line)] + pl.evidence(),
            fixes=fixes(
                ctx,
                advice(
                    "make samples >= per_device_train_batch_size x gradient_accumulation_steps x the number of "
                    "data-parallel ranks (with drop_last a partial batch is dropped): lower gradient_accumulation_steps "
                    "or the batch size, or give it more data"
                ),
                advice(
                    "check that the dataset is not empty after loading and filtering: the split and column names, and "
                    "length filters (max_prompt_length / max_length / filter_overlong_prompts) that drop every sample"
                ),
            ),
            where="dataset size vs batch size x gradient accumulation x data-parallel ranks"
            + (f" ({at})" if (at := pl.culprit()) else ""),
            phase=pl.phase or "init",
            rank=pl.rank,
            line=h.no,
            score=36.0,
        )
    ]


def _zero_steps(facts: LogFacts) -> Hit | None:
    """A ZeroDivisionError whose innermost frames are a training loop's or a learning-rate schedule's own."""
    for h in facts.of("exception_line"):
        if not h.fields.get("type", "").endswith("ZeroDivisionError"):
            continue
        tb = facts.traceback_near(h.no, h.line.rank)
        inner = tb.frames[-2:] if tb and tb.frames else []
        if any(_LOOP.search(f"{f.func} {f.code or ''}") for f in inner):
            return h
    return None
