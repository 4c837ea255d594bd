"""The data's invariants: what the rows must be for the rewards and the losses to mean what they say.

Batch invariants (every collated batch; a few integer reductions, and one tokenisation of the batch's
prompts where the trainer hands the audit its tokenizer):

- row i of a batch is example i (`row_order_findings`): the rewards, the answers they are scored
  against and the groups are read by position, so a collator that sorts, shuffles or dedups its rows
  rewards each response against another prompt's answer. Each example's prompt is tokenised again and
  compared with the attended tokens of every row; a batch whose rows are the examples' prompts, but
  not in their order, is an error naming the collator;
- a prompt holds no end-of-sequence token (`prompt_eos_findings`): one that ends in eos makes the
  policy generate after the end of a document (a tokenizer whose post-processor appends eos, a
  collator that adds it); one in the middle (the literal text of the eos token in the data, which the
  tokenizer turns into the token) tells the model the document ended there. Who put it there is
  named from the evidence: the dataset when its text holds the token's literal text, the tokenizer
  when tokenising the text alone already appends it, else the collator;
- a DPO pair's chosen side is the better one (`pair_order_findings`): where the examples carry the
  builtin task's ``answer``, the task's own scorer must not prefer the rejected side of most pairs;
- the eos that ends a response is in its response mask (`response_eos_findings`): a response mask
  built as ``ids != pad`` with pad == eos drops it, so the policy is never trained (nor scored) on
  stopping. Read per ``*_response_mask`` / ``*_input_ids`` pair (DPO's chosen and rejected sides).

Setup invariants:

- a frozen role (reference, reward) shares no parameter storage with a trained one
  (`shared_role_findings`): a reference that IS the actor (or holds its tensors) moves with every
  update, so KL(actor || reference) is exactly 0 and anchors nothing.

Exercised by `pytest tests/test_invariants_data.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from trainer.precision import FROZEN_ROLES, TRAINABLE_ROLES
from verlaudit import kinds as K
from verlaudit.rundir import Finding


def _spec(data: Mapping[str, Any] | None, key: str) -> str | None:
    v = (data or {}).get(key)
    return str(v) if v else None


def _data_source(data: Mapping[str, Any] | None) -> str:
    """What made the examples, as a key with its spec: the user's dataset, verl's files, or the task."""
    data = data or {}
    if data.get("dataset"):
        return f"data.dataset ({data['dataset']})"
    if data.get("train_files"):
        return f"data.train_files ({data['train_files']})"
    return f"data.task ({data.get('task')})"


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's attended ids, in order."""
    keep = mask.bool()
    return [tuple(ids[i][keep[i]].tolist()) for i in range(ids.shape[0])]


SEQUENCE_KEYS = ("completion_mask", "response_mask", "labels", "loss_mask", "completion_input_ids")
"""Batch keys that say its ``input_ids`` are whole sequences (prompt and completion), not prompts."""


def _prompt_part(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, mask) [B, P] of the batch's prompts: ``input_ids`` of a prompt batch, or the columns of
    ``chosen_input_ids`` before its response mask's width (a DPO batch)."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor):
        if any(k.endswith(SEQUENCE_KEYS) for k in batch):
            return None  # input_ids hold prompt and completion (TRL's collators): no prompt to read apart
    else:
        ids, mask, resp = (batch.get(f"chosen_{f}") for f in ("input_ids", "attention_mask", "response_mask"))
        if not all(isinstance(t, torch.Tensor) for t in (ids, mask, resp)) or resp.dim() != 2:
            return None
        if ids.dim() != 2 or resp.shape[1] >= ids.shape[1]:
            return None
        ids, mask = ids[:, : -resp.shape[1]], mask[:, : -resp.shape[1]]
        if mask.dim() == 2 and bool((mask[:, 1:] < mask[:, :-1]).any()):
            return None  # not a left-padded prompt: the row is packed otherwise (the pair checks name it)
    if ids.dim() != 2 or mask.shape != ids.shape or ids.is_floating_point() or mask.is_floating_point():
        return None
    return ids, mask


def _encode(tokenizer: Any, text: str, special: bool) -> tuple[int, ...] | None:
    try:
        return tuple(tokenizer(text, add_special_tokens=special)["input_ids"])
    except Exception:  # a tokenizer of another call signature: nothing to compare with
        return None


def _matches(row: tuple[int, ...], encodings: Sequence[tuple[int, ...] | None], width: int) -> bool:
    """Whether a row's attended ids are one of an example's encodings, whole or cut to the prompt width
    (either end kept)."""
    for e in encodings:
        if not e:
            continue
        if row == e or (
            len(row) >= min(len(e), width)
            and len(row) < len(e)
            and (e[-len(row) :] == row or e[: len(row)] == row)
        ):
            return True
    return False


def row_order_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``boundary/rows_reordered`` when the batch's rows are the examples' prompts out of their order."""
    tok = tokenizer_info.get("tokenizer")
    part = _prompt_part(batch)
    if tok is None or part is None or len(examples) != part[0].shape[0] or len(examples) < 2:
        return []
    prompts = [ex.get("prompt") if isinstance(ex, Mapping) else None for ex in examples]
    if not all(isinstance(p, str) for p in prompts):
        return []
    ids, mask = part
    rows = _rows(ids, mask)
    width = int(ids.shape[1])
    b = len(rows)
    plain = {p: _encode(tok, p, True) for p in set(prompts)}  # one encoding per prompt on the clean path
    if all(_matches(rows[i], [plain[p]], width) for i, p in enumerate(prompts)):
        return []
    bare = {p: _encode(tok, p, False) for p in plain}  # a collator may encode without special tokens
    enc = [[plain[p], bare[p]] for p in prompts]
    own = [_matches(rows[i], enc[i], width) for i in range(b)]
    if all(own):
        return []
    other = [
        not own[i] and any(_matches(rows[i], enc[j], width) for j in range(b) if j != i) for i in range(b)
    ]
    moved = sum(other)
    placed = sum(own) + moved
    if (
        not moved or 2 * placed < b
    ):  # rows that are no example's prompt: the collator formats them, no order to read
        return []
    return [
        Finding(
            severity="error",
            kind=K.ROWS_REORDERED,
            where=f"{where}.input_ids",
            message=f"{moved} of {b} rows of the batch hold another example's prompt than the example at "
            "their position (the rows are the examples' prompts in another order: the collator sorted, "
            "shuffled or regrouped them): each response is rewarded against the answer of the example at its "
            "position, another prompt's, so the rewards do not score the responses they are given to",
            observed={"rows_out_of_order": moved, "rows_in_order": sum(own), "batch": b},
            expected="row i of every field is example i",
            fix=f"return the rows in the examples' order from {where.removeprefix('collator:')}: row i must be "
            "example i (sort or bucket the examples before they are collated, not the rows after)",
            **ctx,
        )
    ]


def _special_text(tok: Any, token_id: int) -> str | None:
    try:
        text = tok.convert_ids_to_tokens(token_id)
    except Exception:  # no vocabulary lookup: the literal cannot be searched for
        return None
    return text if isinstance(text, str) and text else None


def _eos_culprit(
    *, end: bool, has_literal: int, texts: int, appends: bool, literal, tok, data, source: str, where: str
) -> tuple[str, str, str]:
    """(where, who put the eos there, fix) from the evidence: the dataset when its text holds the token's
    literal, the tokenizer when encoding the text alone appends it, else the collator."""
    if has_literal and (not end or not appends):
        at = _data_source(data)
        who = (
            f"the prompt text holds the literal {literal!r} in {has_literal} of {texts} examples, "
            "which the tokenizer turns into the eos token"
        )
        fix = (
            f"{at}: join the parts of a prompt with a plain separator (a newline '\\n'), not the eos token's "
            "text, or tokenize with split_special_tokens=True so that text stays text"
        )
        return at, who, fix
    if end and appends:
        path = getattr(tok, "name_or_path", None)
        at = f"model.tokenizer ({path})" if isinstance(path, str) and path else "model.tokenizer"
        who = "the tokenizer itself appends eos to every encoding (its post-processor, or add_eos_token=True)"
        fix = (
            "model.tokenizer: turn off the appended eos for prompts (add_eos_token=False, or drop eos from the "
            "tokenizer.json post_processor's TemplateProcessing), or encode prompts with add_special_tokens=False"
        )
        return at, who, fix
    who = f"the collator {source} put it there (the text and the tokenizer alone do not)"
    return where, who, f"{source}: end each prompt with its last text token; eos belongs after the response"


def prompt_eos_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    data: Mapping[str, Any] | None,
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``boundary/prompt_eos`` when attended prompt tokens are the eos id: at a prompt's end (an error:
    generation starts after an end of sequence) or inside it (a warning: a chat template may put an
    end-of-turn token there on purpose, a literal in the text does not)."""
    eos = tokenizer_info.get("eos_token_id")
    part = _prompt_part(batch)
    if not isinstance(eos, int) or part is None or not part[0].numel():
        return []
    ids, mask = part
    rows = _rows(ids, mask)
    at_end = [i for i, r in enumerate(rows) if r and r[-1] == eos]
    inside = [i for i, r in enumerate(rows) if eos in r[:-1]]
    if not at_end and not inside:
        return []
    b = len(rows)
    tok = tokenizer_info.get("tokenizer")
    literal = _special_text(tok, eos) if tok is not None else None
    template = getattr(tok, "chat_template", None)
    if (data or {}).get("train_files") or (literal and isinstance(template, str) and literal in template):
        inside = []  # a chat template writes this token between turns: inside a multi-turn prompt by design
    texts = [ex.get("prompt") for ex in examples if isinstance(ex, Mapping)] if len(examples) == b else []
    texts = [t for t in texts if isinstance(t, str)]
    has_literal = [t for t in texts if literal and literal in t]
    appends = False
    if tok is not None and texts:
        e = _encode(tok, texts[0], True)
        appends = bool(e) and e[-1] == eos and not (literal and texts[0].rstrip().endswith(literal))
    out = []
    for rows_hit, end in ((at_end, True), (inside, False)):
        if not rows_hit:
            continue
        n = len(rows_hit)
        name = f"eos (id {eos}{f', {literal!r}' if literal else ''})"
        at, who, fix = _eos_culprit(
            end=end, has_literal=len(has_literal), texts=len(texts), appends=appends, literal=literal,
            tok=tok, data=data, source=source, where=where,
        )  # fmt: skip
        if end:
            msg = (
                f"{n} of {b} prompts end with {name}: {who}; the policy generates after an end of sequence, "
                "which it learned ends a document, so its responses start from a state it never saw in training"
            )
        else:
            msg = (
                f"{n} of {b} prompts hold {name} before their end: {who}; the model reads an end of sequence "
                "in the middle of the prompt and what precedes it as another document"
            )
        out.append(
            Finding(
                severity="error" if end or has_literal else "warning",
                kind=K.PROMPT_EOS,
                where=at,
                message=msg,
                observed={"rows": n, "batch": b, "at_end": end, "eos_token_id": eos},
                expected="no eos inside a prompt",
                fix=fix,
                **ctx,
            )
        )
    return out


def response_eos_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``boundary/response_eos_masked`` when, in every row whose response holds an eos id, the first
    one is outside the response mask (the eos that ends the response is never trained on)."""
    eos = tokenizer_info.get("eos_token_id")
    if not isinstance(eos, int):
        return []
    out = []
    for k, resp in batch.items():
        if not (k.endswith("response_mask") and isinstance(resp, torch.Tensor)) or resp.dim() != 2:
            continue
        side = k[: -len("response_mask")]
        ids = batch.get(f"{side}input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < resp.shape[1]:
            continue
        if ids.is_floating_point() or resp.is_floating_point() or not resp.numel():
            continue
        r = ids[:, -resp.shape[1] :]
        is_eos = r == eos
        has = is_eos.any(dim=1)
        if int(has.sum()) < 2:
            continue
        first = is_eos.int().argmax(dim=1)
        kept = resp.gather(1, first.unsqueeze(1)).squeeze(1).bool()
        dropped = int((has & ~kept).sum())
        if dropped < int(has.sum()):
            continue
        pad = tokenizer_info.get("pad_token_id")
        why = (
            " (pad == eos: a mask built as ids != pad_token_id drops the real eos with the padding)"
            if pad == eos
            else ""
        )
        out.append(
            Finding(
                severity="error",
                kind=K.RESPONSE_EOS_MASKED,
                where=f"{where}.{k}",
                message=f"{k} is 0 on the eos that ends the response in all {dropped} rows that have one{why}: "
                "the loss never sees the policy end a response, so it is never trained to stop (and a "
                "preference between two lengths is not learnt)",
                observed={
                    "rows_eos_masked": dropped,
                    "rows_with_eos": int(has.sum()),
                    "batch": int(r.shape[0]),
                },
                expected="the response's first eos inside its response mask",
                fix=f"{source}: build {k} from each response's length including its eos (1 on the response's "
                "tokens and the eos that ends it), not as ids != pad_token_id when pad is eos",
                **ctx,
            )
        )
    return out


PAIR_ORDER_MIN = 4
"""Pairs the task's scorer must tell apart before their order is judged."""
PAIR_ORDER_FRAC = 0.8
"""Share of those pairs whose rejected side the task scores higher from which the pairs are inverted: a
dataset unrelated to the task's scorer orders its pairs at random (about half each way), a correct one
prefers the task's answers (a clean control: 0 of its pairs inverted)."""


def builtin_task(data: Mapping[str, Any] | None):
    """The builtin task whose scorer grades the examples' ``answer`` field, or None (verl files)."""
    data = data or {}
    if data.get("train_files"):
        return None
    from trainer.data import TASKS  # verlaudit reads the trainer's tasks; the trainer never imports us

    return TASKS.get(str(data.get("task") or "digits"))


def pair_order_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    data: Mapping[str, Any] | None,
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """``reward/inverted`` when the task's own scorer (the examples carry its ``answer``) prefers the
    rejected side of most pairs it tells apart: the preference is the wrong way round. The dataset is
    named when its texts are inverted; the collator when the texts are right but its chosen rows hold
    the rejected text."""
    task = builtin_task(data)
    if task is None or not examples or not all(isinstance(ex, Mapping) for ex in examples):
        return []
    if not all(isinstance(ex.get(f), str) for ex in examples for f in ("answer", "chosen", "rejected")):
        return []
    try:
        scored = [(task.score(ex["chosen"], ex), task.score(ex["rejected"], ex)) for ex in examples]
    except Exception:  # fields the scorer cannot read: the task does not grade this dataset
        return []
    # a side with no text is the empty-response check's (`invariants.pair_findings`), not an order
    full = [bool(ex["chosen"].strip()) and bool(ex["rejected"].strip()) for ex in examples]
    scored = [(c, r) if ok else (0.0, 0.0) for (c, r), ok in zip(scored, full)]
    told = [c != r for c, r in scored]
    inverted = sum(r > c for c, r in scored)
    n = sum(told)
    swapped = _collator_swapped(batch, tokenizer_info, examples)
    if swapped is not None and n >= PAIR_ORDER_MIN and swapped >= PAIR_ORDER_FRAC * len(examples):
        inverted, at = n - inverted, f"{where}.chosen_input_ids"  # the batch's sides: the texts' swapped
        who = f"the collator {source} puts each pair's rejected text in chosen_input_ids ({swapped} of {len(examples)} rows)"
        fix = f"{source}: collate ex['chosen'] into chosen_* and ex['rejected'] into rejected_* (the two are swapped)"
    else:
        at = _data_source(data)
        who = "the dataset's chosen and rejected texts are the wrong way round"
        fix = (
            f"{at}: swap chosen and rejected where the pairs are built (read which response the rater "
            "preferred the right way round: the 'preferred' label, the sign of a score difference)"
        )
    if n < PAIR_ORDER_MIN or inverted < PAIR_ORDER_FRAC * n:
        return []
    return [
        Finding(
            severity="error",
            kind=K.REWARD_INVERTED,
            where=at,
            message=f"the task's own scorer ({task.name}: the examples' 'answer') rates the rejected response above "
            f"the chosen one in {inverted} of the {n} pairs it tells apart: {who}; DPO trains the policy towards "
            "the responses the preference meant to reject",
            observed={"inverted": inverted, "pairs_told_apart": n, "batch": len(examples)},
            expected="chosen rated at least as high as rejected",
            fix=fix,
            **ctx,
        )
    ]


def _collator_swapped(
    batch: Mapping[str, Any], tokenizer_info: Mapping[str, Any], examples: Sequence[Mapping[str, Any]]
) -> int | None:
    """Rows whose chosen response tokens are the example's rejected text (and not its chosen one); None
    when the batch cannot be read back (no tokenizer, no response mask)."""
    tok = tokenizer_info.get("tokenizer")
    ids, resp = batch.get("chosen_input_ids"), batch.get("chosen_response_mask")
    if tok is None or not isinstance(ids, torch.Tensor) or not isinstance(resp, torch.Tensor):
        return None
    if ids.dim() != 2 or resp.dim() != 2 or ids.shape[0] != len(examples) or resp.shape[1] > ids.shape[1]:
        return None
    eos = tokenizer_info.get("eos_token_id")
    rows = [tuple(t for t in r if t != eos) for r in _rows(ids[:, -resp.shape[1] :], resp)]
    n = 0
    for row, ex in zip(rows, examples):
        c, r = _encode(tok, ex["chosen"], False), _encode(tok, ex["rejected"], False)
        if c is None or r is None:
            return None
        n += int(bool(row) and row != c[: len(row)] and row == r[: len(row)])
    return n


def data_batch_findings(
    batch: Mapping[str, Any],
    *,
    tokenizer_info: Mapping[str, Any],
    examples: Sequence[Mapping[str, Any]],
    data: Mapping[str, Any] | None,
    source: str,
    where: str,
    ctx: Mapping[str, Any],
) -> list[Finding]:
    """The batch invariants of this module (module docstring)."""
    return [
        *row_order_findings(batch, tokenizer_info=tokenizer_info, examples=examples, where=where, ctx=ctx),
        *prompt_eos_findings(
            batch,
            tokenizer_info=tokenizer_info,
            examples=examples,
            data=data,
            source=source,
            where=where,
            ctx=ctx,
        ),
        *response_eos_findings(batch, tokenizer_info=tokenizer_info, source=source, where=where, ctx=ctx),
        *pair_order_findings(
            batch,
            tokenizer_info=tokenizer_info,
            examples=examples,
            data=data,
            source=source,
            where=where,
            ctx=ctx,
        ),
    ]


# ---------------------------------------------------------------- setup: roles that share storage


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or this rank's shard when ``t`` is an FSDP2 DTensor (which many ops cannot index)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storages(model: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        local = local_shard(p)
        if local.is_meta or not local.numel():
            continue
        out.setdefault(local.untyped_storage().data_ptr(), name)
    return out


def shared_role_findings(
    config: Mapping[str, Any], models: Mapping[str, nn.Module], setup_plugin
) -> list[Finding]:
    """``model/frozen_role_shared`` per frozen role that is a trained role's module or holds its
    parameters' storage (``setup_plugin(config, role)`` names the model.setup that ran on it)."""
    out = []
    for frozen in FROZEN_ROLES:
        fm = models.get(frozen)
        if fm is None:
            continue
        for trained in TRAINABLE_ROLES:
            tm = models.get(trained)
            if tm is None:
                continue
            same = fm is tm
            shared: list[str] = []
            if not same:
                mine = _storages(fm)
                theirs = _storages(tm)
                shared = [mine[s] for s in mine if s in theirs]
                if not shared:
                    continue
            total = len(_storages(fm)) or 1
            plugin = setup_plugin(config, frozen) or setup_plugin(config, trained)
            ran = f" ({plugin[0]}: {plugin[1]} ran on it)" if plugin else ""
            what = (
                f"the {frozen} is the {trained} module itself"
                if same
                else f"{len(shared)} of the {frozen}'s {total} parameter tensors are the {trained}'s (shared storage, "
                f"first {shared[0]})"
            )
            effect = (
                "every update moves it with the policy, so KL(actor || reference) is exactly 0 and the KL term "
                "regularises nothing"
                if frozen == "reference"
                else f"the reward model changes as the {trained} trains, so the same response gets another score"
            )
            fix = (
                f"give the {frozen} its own frozen copy of the weights (copy.deepcopy(model), or return None from "
                f"{plugin[0] if plugin else 'model.setup'} for the {frozen} so the trainer's own copy is kept)"
            )
            out.append(
                Finding(
                    severity="error",
                    kind=K.FROZEN_ROLE_SHARED,
                    role=frozen,
                    where=f"{plugin[0]} ({plugin[1]})" if plugin else frozen,
                    message=f"{what}{ran}: {effect}",
                    observed={"same_module": same, "shared_tensors": len(shared) if not same else total},
                    expected=f"a {frozen} that holds its own tensors",
                    fix=fix,
                )
            )
    return out
