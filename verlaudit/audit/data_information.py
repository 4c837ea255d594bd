"""The information a dataset carries: the data reaches the trainer intact but says less than it looks.

Read from the examples ``on_batch`` receives (one per prompt or pair, before GRPO repeats them) and, where
the data contract reloaded it (`data_contract.ConflictWatch.reload`), from the whole dataset; each kind
found once per run:

- targets vary with the prompts (`InformationWatch`, ``data/constant_targets``): every example of a
  dataset with many distinct prompts carries the same answer / ground truth / label (a generator that
  re-creates its random source with one seed for every example, a column read once): the policy is
  rewarded for one constant output whatever the prompt, and a correct reading of the prompt earns nothing;
- the dataset holds more prompts than one batch (``data/few_prompts``): distinct prompts fewer than the
  rows of a batch (``data.num_examples`` left from a smoke test, a dataset function that returns a
  handful) repeat the same prompts in every batch, and the policy memorises their answers;
- a preference pair says something about the answer (`pair_form_findings`, ``data/pairs_format_only``):
  chosen and rejected that are the same text after normalisation (whitespace, case, punctuation, unicode
  form), as the dataset gives them or as the collator's rows decode, teach the formatting, not the answer;
- a pair's two sides follow one prompt (`pair_prompt_findings`, ``data/pair_prompt_mismatch``): the prompt
  tokens of a collated chosen row and of its rejected row differ (a collator that builds one side from
  the examples shifted or shuffled), so the preference compares answers to different questions;
- the prompts have the form the policy knows (`prompt_form_findings`, ``data/prompt_form``): where most
  prompts carry a whitespace form (a trailing or leading space or newline, doubled spaces) the policy
  is measured on it: the log-prob of the examples' own targets after each prompt as given and after the
  same prompt without that form. Named only when the policy knows the targets in the plain form and
  finds them much less likely in the given one (a never-trained model knows neither: no finding).

Cost: string sets over the examples; the prompt-form probe is two no-grad forwards of at most
`FORM_ROWS` short rows, once, and only when the prompts carry such a form. Exercised by
`pytest tests/test_data_information.py`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.audit.invariants_data import _data_source
from verlaudit.rundir import Finding

MIN_PROMPTS = 8
"""Distinct prompts a dataset needs before one target value for all of them is a finding."""
TARGET_FIELDS = ("answer", "ground_truth", "label", "target", "solution")
"""Example fields the reward reads as the prompt's target."""
PAIR_SHARE = 0.5
"""Share of a batch's pairs (at least `MIN_PAIRS`) from which a pair property is the data's, not one odd pair."""
MIN_PAIRS = 4
FORM_SHARE = 0.9
"""Share of a batch's prompts that must carry a whitespace form before the policy is measured on it."""
FORM_ROWS = 8
"""Prompts the prompt-form probe reads."""
FORM_KNOWN = -1.0
"""Mean log-prob per target token, after the plain prompts, from which the policy knows the targets."""
FORM_DROP = 2.0
"""Mean drop (nats) of a target's whole log-prob, the given form against the plain one, that is a finding."""


def _text(ex: Any, key: str) -> str | None:
    v = ex.get(key) if isinstance(ex, Mapping) else None
    return v if isinstance(v, str) else None


def _target(ex: Any) -> tuple[str, str] | None:
    """(field, value as text) of the example's target: its answer-like field, or verl's ground truth."""
    if not isinstance(ex, Mapping):
        return None
    for key in TARGET_FIELDS:
        v = ex.get(key)
        if isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
            return key, str(v)
    rm = ex.get("reward_model")
    if isinstance(rm, Mapping) and isinstance(rm.get("ground_truth"), (str, int, float)):
        return "reward_model.ground_truth", str(rm["ground_truth"])
    return None


def _prompt(ex: Any) -> str | None:
    p = _text(ex, "prompt")
    if p is not None:
        return p
    msgs = ex.get("prompt") if isinstance(ex, Mapping) else None
    msgs = msgs.tolist() if hasattr(msgs, "tolist") else msgs
    if isinstance(msgs, (list, tuple)):
        return "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, Mapping))
    return None


def _show(s: str) -> str:
    return repr(s if len(s) <= 40 else s[:37] + "...")


def _where(data: Mapping[str, Any]) -> str:
    if not data.get("dataset") and not data.get("train_files"):
        return f"data.num_examples ({data.get('num_examples')}, data.task {data.get('task')})"
    return _data_source(data)


class InformationWatch:
    """Distinct prompts and targets over the run's batches and, once reloaded, the whole dataset."""

    def __init__(self) -> None:
        self.prompts: set[str] = set()
        self.targets: dict[str, set[str]] = {}
        self.pairs: set[tuple[str, str]] = set()
        self.rows = 0
        self.batch = 0
        self.found: set[str] = set()

    def observe(self, examples: Sequence[Mapping[str, Any]]) -> None:
        self.batch = max(self.batch, len(examples))
        for ex in examples:
            p = _prompt(ex)
            if p is None:
                continue
            self.rows += 1
            self.prompts.add(p)
            c, r = _text(ex, "chosen"), _text(ex, "rejected")
            if c is not None and r is not None:
                self.pairs.add((c, r))
            t = _target(ex)
            if t is not None:
                self.targets.setdefault(t[0], set()).add(t[1])

    def findings(
        self,
        *,
        data: Mapping[str, Any],
        dataset: Sequence[Mapping[str, Any]] | None,
        ctx: Mapping[str, Any],
    ) -> list[Finding]:
        """``dataset``: the whole dataset's examples when the data contract reloaded it (else the batches)."""
        data = dict(data or {})
        whole = InformationWatch()
        if dataset:
            whole.observe(dataset)
        pool = whole if dataset else self
        out = []
        if K.CONSTANT_TARGETS not in self.found:
            out += self._constant(pool, whole=bool(dataset), data=data, ctx=ctx)
        if K.FEW_PROMPTS not in self.found:
            out += self._few(pool, whole=bool(dataset), data=data, ctx=ctx)
        self.found |= {f.kind for f in out}
        return out

    def _constant(self, pool, *, whole, data, ctx) -> list[Finding]:
        n = len(pool.prompts)
        if n < MIN_PROMPTS:
            return []
        at = (
            _where(data)
            if data.get("dataset") or data.get("train_files")
            else f"data.task ({data.get('task')})"
        )
        for field, values in pool.targets.items():
            if len(values) != 1:
                continue
            value = next(iter(values))
            return [self._constant_finding(field, value, n, whole=whole, at=at, ctx=ctx)]
        chosen = {c for c, _ in pool.pairs}
        rejected = {r for _, r in pool.pairs}
        if len(pool.pairs) and len(chosen) == 1 and len(rejected) == 1:
            value = f"{next(iter(chosen))!r} over {next(iter(rejected))!r}"
            return [self._constant_finding("chosen / rejected", value, n, whole=whole, at=at, ctx=ctx)]
        return []

    @staticmethod
    def _constant_finding(field, value, n, *, whole, at, ctx) -> Finding:
        scope = "the whole dataset" if whole else "the batches read so far"
        return Finding(
            severity="error",
            kind=K.CONSTANT_TARGETS,
            where=at,
            message=f"every example's target {field} is the same value, {_show(value)}, across {n} distinct prompts "
            f"({scope}): the answers (labels) carry no information about the prompt, so the policy is rewarded "
            "for one constant output whatever the prompt says, and reading the prompt earns nothing",
            observed={
                "field": field,
                "distinct_targets": 1,
                "distinct_prompts": n,
                "value": value,
                "whole": whole,
            },
            expected="targets that vary with the prompts (one per prompt's question)",
            fix=f"{at}: build each example's {field} from its own prompt; a random generator re-created with the "
            "same seed for every example (random.Random(seed) inside the loop) draws the same value each time: "
            "create one rng outside the loop and draw from it (or seed each example with seed + i); a value "
            "read once outside the loop or a default for a missing column does the same",
            **ctx,
        )

    def _few(self, pool, *, whole, data, ctx) -> list[Finding]:
        b = self.batch
        n = len(pool.prompts)
        size = data.get("num_examples") if not (data.get("dataset") or data.get("train_files")) else None
        if isinstance(size, int) and size < b:
            n = min(n, size) if n else size
        elif not whole and self.rows < 2 * b:
            return []  # the batches alone say nothing before two of them repeat their prompts
        if b < 2 or n == 0 or n >= b:
            return []
        at = _where(data)
        key = "data.num_examples" if at.startswith("data.num_examples") else at
        return [
            Finding(
                severity="warning",
                kind=K.FEW_PROMPTS,
                where=at,
                message=f"the dataset holds {n} distinct prompt{'s' if n != 1 else ''}, fewer than the {b} examples "
                f"of one batch: every batch repeats the same {n} prompt{'s' if n != 1 else ''} (duplicates within "
                "the batch), so the run trains on a handful of examples and the policy memorises their answers "
                "instead of learning the task (a dataset size left from a smoke test?)",
                observed={"distinct_prompts": n, "batch_examples": b, "rows_seen": self.rows, "whole": whole},
                expected=f"at least {b} distinct prompts (many more than one batch)",
                fix=f"{key}: use the full dataset (raise data.num_examples well above algo.batch_size, or remove the "
                "smoke-test limit on the examples the dataset returns)"
                if key == "data.num_examples"
                else f"{key}: return the full dataset (remove the smoke-test limit / slice on the examples), "
                "well above algo.batch_size distinct prompts",
                **ctx,
            )
        ]


# ---------------------------------------------------------------- pairs


def _normal(s: str) -> str:
    """``s`` without what carries no answer: unicode form, case, whitespace, punctuation and symbols."""
    s = unicodedata.normalize("NFKC", s).casefold()
    return "".join(
        c for c in s if not unicodedata.category(c).startswith(("Z", "P", "C")) and not c.isspace()
    )


def _how(a: str, b: str) -> str:
    if a.strip() == b.strip():
        return "leading / trailing whitespace"
    if a.split() == b.split():
        return "whitespace"
    if a.casefold() == b.casefold():
        return "case"
    if unicodedata.normalize("NFKC", a) == unicodedata.normalize("NFKC", b):
        return "unicode form"
    if re.sub(r"\W", "", a) == re.sub(r"\W", "", b):
        return "punctuation"
    return "formatting (whitespace, case, punctuation)"


def _format_only(pairs: Sequence[tuple[str, str]]) -> list[tuple[int, str, str]]:
    return [(i, c, r) for i, (c, r) in enumerate(pairs) if c != r and _normal(c) and _normal(c) == _normal(r)]


def pair_form_findings(
    batch: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    source: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/pairs_format_only`` when most pairs' chosen and rejected differ only in formatting: in the
    dataset's texts (named on the dataset) or in the collated rows, decoded (named on the collator)."""
    texts = [
        (c, r)
        for ex in examples
        if (c := _text(ex, "chosen")) is not None and (r := _text(ex, "rejected")) is not None
    ]
    at, what = None, None
    if len(texts) == len(examples) and len(texts) >= MIN_PAIRS:
        same = _format_only(texts)
        if len(same) >= PAIR_SHARE * len(texts):
            at, what = _data_source(data), (same, len(texts), "the dataset's texts")
    if at is None:
        rows = _decoded_sides(batch, tokenizer_info)
        if rows and len(rows) >= MIN_PAIRS:
            same = _format_only(rows)
            if len(same) >= PAIR_SHARE * len(rows):
                at, what = f"collator:{source}", (same, len(rows), f"the rows the collator {source} returned")
    if at is None:
        return []
    same, b, read = what
    i, c, r = same[0]
    how = sorted({_how(c2, r2) for _, c2, r2 in same})
    return [
        Finding(
            severity="error",
            kind=K.PAIRS_FORMAT_ONLY,
            where=at,
            message=f"{len(same)} of {b} preference pairs have a chosen and a rejected side that are the same text up "
            f"to {' / '.join(how)} ({read}; pair {i}: chosen {_show(c)}, rejected {_show(r)}): they differ only "
            "in formatting noise, so the preference carries no information about the answer and DPO learns to "
            "prefer one formatting (a space, a case) instead",
            observed={"format_only_pairs": len(same), "pairs": b, "how": how},
            expected="chosen and rejected that differ in content, not only in whitespace / case / punctuation",
            fix=f"{at}: drop (filter) the pairs whose sides are equal after normalising whitespace, case and "
            "punctuation (strip / casefold / NFKC both and compare), and mine rejected answers that are wrong in "
            "content, not format-noise negatives",
            **ctx,
        )
    ]


def _side(batch: Mapping[str, Any], side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(ids, attention mask, response mask) of a DPO side, or None for another layout."""
    ids, attn, resp = (batch.get(f"{side}_{k}") for k in ("input_ids", "attention_mask", "response_mask"))
    if not all(isinstance(t, torch.Tensor) for t in (ids, attn, resp)):
        return None
    if ids.dim() != 2 or attn.shape != ids.shape or resp.dim() != 2 or resp.shape[1] > ids.shape[1]:
        return None
    if ids.is_floating_point() or resp.shape[0] != ids.shape[0]:
        return None
    return ids, attn, resp


def _decoded_sides(batch: Mapping[str, Any], tokenizer_info: Mapping[str, Any]) -> list[tuple[str, str]]:
    tok = tokenizer_info.get("tokenizer")
    sides = [_side(batch, s) for s in ("chosen", "rejected")]
    if tok is None or None in sides or sides[0][0].shape[0] != sides[1][0].shape[0]:
        return []
    specials = {
        t
        for t in (tokenizer_info.get("pad_token_id"), tokenizer_info.get("eos_token_id"))
        if isinstance(t, int)
    }
    out = []
    for i in range(sides[0][0].shape[0]):
        texts = []
        for ids, _, resp in sides:
            row = [t for t in ids[i, -resp.shape[1] :][resp[i].bool()].tolist() if t not in specials]
            try:
                texts.append(str(tok.decode(row, skip_special_tokens=False)))
            except Exception:  # a tokenizer that cannot decode: nothing to compare
                return []
        out.append((texts[0], texts[1]))
    return out


def _prompt_rows(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor) -> list[tuple[int, ...]]:
    p = ids.shape[1] - resp.shape[1]
    keep = attn[:, :p].bool()
    return [tuple(ids[i, :p][keep[i]].tolist()) for i in range(ids.shape[0])]


def pair_prompt_findings(
    batch: Mapping[str, Any], *, tokenizer_info: Mapping[str, Any], source: str, ctx: Mapping[str, Any]
) -> list[Finding]:
    """``data/pair_prompt_mismatch`` when most collated pairs' chosen and rejected rows hold different prompt
    tokens; a rotation (rejected row i holds chosen row i - k's prompt) is named as such."""
    sides = [_side(batch, s) for s in ("chosen", "rejected")]
    if None in sides or sides[0][0].shape[0] != sides[1][0].shape[0]:
        return []
    chosen, rejected = (_prompt_rows(*s) for s in sides)
    b = len(chosen)
    if b < MIN_PAIRS or not all(chosen) or len(set(chosen)) < 2:
        return []
    differ = [i for i in range(b) if chosen[i] != rejected[i]]
    if len(differ) < PAIR_SHARE * b:
        return []
    shift = next(
        (
            k
            for k in (1, -1, 2, -2, 3, -3)
            if sum(rejected[i] == chosen[(i - k) % b] for i in range(b)) >= 0.75 * b
        ),
        0,
    )
    how = (
        f"rejected row i holds the prompt of chosen row i {'-' if shift > 0 else '+'} {abs(shift)} (the examples "
        f"rotated by {abs(shift)} for one side)"
        if shift
        else "the rejected rows hold other prompts than their chosen rows"
    )
    tok = tokenizer_info.get("tokenizer")
    i = differ[0]
    shown = ""
    if tok is not None:
        try:
            shown = f" (pair {i}: chosen after {_show(tok.decode(list(chosen[i])))}, rejected after {_show(tok.decode(list(rejected[i])))})"
        except Exception:  # a tokenizer that cannot decode: the ids' counts say it
            shown = ""
    return [
        Finding(
            severity="error",
            kind=K.PAIR_PROMPT_MISMATCH,
            where=f"collator:{source}",
            message=f"{len(differ)} of {b} preference pairs the collator {source} returned have a chosen and a rejected "
            f"side that do not share their prompt: {how}{shown}; each pair's preference compares answers to "
            "different questions, so DPO learns which prompt's answer is preferred, not which answer",
            observed={"pairs_prompt_differs": len(differ), "pairs": b, "shift": shift},
            expected="the same prompt tokens in a pair's chosen and rejected rows",
            fix=f"{source}: build both sides of pair i from the same example (examples[i]['prompt'] with "
            "examples[i]['chosen'] and examples[i]['rejected']): no shift, rotation or separate shuffle of one "
            "side, so chosen and rejected keep the same prompt",
            **ctx,
        )
    ]


# ---------------------------------------------------------------- the prompts' form, measured on the policy

_FORMS = (
    (
        "a trailing whitespace",
        lambda p: p.rstrip(),
        lambda p: p != p.rstrip() and p.strip(),
        "prompt.rstrip()",
    ),
    (
        "a leading whitespace",
        lambda p: p.lstrip(),
        lambda p: p != p.lstrip() and p.strip(),
        "prompt.lstrip()",
    ),
    (
        "doubled spaces",
        lambda p: re.sub(r"  +", " ", p),
        lambda p: "  " in p.strip(),
        "one space between words",
    ),
)
"""(what the form is, the prompt without it, whether a prompt carries it, how to remove it)."""


def _encode(tok: Any, text: str, special: bool) -> list[int] | None:
    try:
        return list(tok(text, add_special_tokens=special)["input_ids"])
    except Exception:  # a tokenizer of another call signature: nothing to measure
        return None


def _target_lp(model, tok, prompts, targets, pad: int, device) -> list[float] | None:
    """Per example, the policy's summed log-prob of the target's tokens after the prompt (left-padded rows)."""
    from verlaudit.audit.model_checks import forward

    rows, spans = [], []
    for p, t in zip(prompts, targets):
        pe, te = _encode(tok, p, True), _encode(tok, t, False)
        if not pe or not te:
            return None
        rows.append(pe + te)
        spans.append(len(te))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = forward(model, ids, mask)
    if logits is None or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        return None
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = [float(lp[i, width - 1 - n :].sum()) for i, n in enumerate(spans)]
    return out if all(v == v for v in out) else None


def prompt_form_findings(
    model: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    tokenizer_info: Mapping[str, Any],
    data: Mapping[str, Any],
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``data/prompt_form`` when most prompts carry a whitespace form and the policy finds the examples' own
    targets (answer, or a pair's chosen side) much less likely after them than after the plain prompts."""
    tok = tokenizer_info.get("tokenizer")
    pad = tokenizer_info.get("pad_token_id")
    p0 = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    if tok is None or p0 is None or type(p0).__name__ == "DTensor":
        return []
    pad = pad if isinstance(pad, int) else 0
    pairs = [
        (p, t)
        for ex in examples
        if (p := _text(ex, "prompt")) is not None and (t := _text(ex, "answer") or _text(ex, "chosen"))
    ]
    if len(pairs) < MIN_PAIRS or len(pairs) < FORM_SHARE * len(examples):
        return []
    for name, plain, has, remove in _FORMS:
        marked = [(p, t) for p, t in pairs if has(p)]
        if len(marked) < FORM_SHARE * len(pairs):
            continue
        marked = marked[:FORM_ROWS]
        given = _target_lp(model, tok, [p for p, _ in marked], [t for _, t in marked], pad, p0.device)
        bare = _target_lp(model, tok, [plain(p) for p, _ in marked], [t for _, t in marked], pad, p0.device)
        if given is None or bare is None:
            return []
        tokens = sum(len(_encode(tok, t, False) or [0]) for _, t in marked)
        known = sum(bare) / max(tokens, 1)
        drop = (sum(bare) - sum(given)) / len(marked)
        if known < FORM_KNOWN or drop < FORM_DROP:
            continue
        at = _data_source(data)
        p, t = marked[0]
        return [
            Finding(
                severity="error",
                kind=K.PROMPT_FORM,
                where=at,
                message=f"{len([1 for q, _ in pairs if has(q)])} of {len(pairs)} prompts end in a form the policy does "
                f"not know: {name} (prompt {_show(p)}, without it {_show(plain(p))}); measured on the policy, the "
                f"examples' own targets are {drop:.1f} nats less likely after the prompts as given than after the "
                f"same prompts without {name} (mean log-prob per target token {known:.2f} without it): the "
                "model was trained (SFT) on the plain form, so after this prompt format its answers degrade and "
                "the reward it earns falls for the format's sake, not the task's",
                observed={
                    "form": name,
                    "prompts_with_form": len(marked),
                    "logprob_drop": drop,
                    "plain_logprob_per_token": known,
                },  # fmt: skip
                expected="prompts in the form the policy was trained on",
                fix=f"{at}: build the prompts without {name} ({remove}, or the format the SFT data used: strip "
                "the space), so each prompt has the form the model's training data had",
                **ctx,
            )
        ]
    return []


def form_probe(model: Any, examples: Sequence[Mapping[str, Any]], **kw: Any) -> list[Finding]:
    """`prompt_form_findings` with the model's state kept (`model_checks.kept_state`) and its own errors
    named on stderr, never the run's end (`data_contract.guarded`)."""
    from verlaudit.audit.data_contract import guarded
    from verlaudit.audit.model_checks import kept_state

    def run() -> list[Finding]:
        with kept_state([model]):
            return prompt_form_findings(model, examples, **kw)

    return guarded(run)
