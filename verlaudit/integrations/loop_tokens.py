"""Which tokens does an own loop's loss read, and at which positions? Read from the loss's own gradient.

A policy-gradient (or any RL) loss on a causal LM reads, at each logit position ``t`` of the response,
the log-probability of the token at ``t + 1`` (the one position ``t`` predicts), and nothing at the
prompt's or the padding's positions. Whatever the loop's code looks like, both show in the gradient of
the loss with respect to the logits the trained model returned, which `verlaudit.watch` reads through a
tensor hook on that output (the first `CHECKED` forwards with gradients of each trained role, then
off):

* **The loss reads only response tokens.** Positions whose gradient is non-zero are the positions the
  loss reads (a masked or sliced-away position gets exactly 0). When the forward's ids start with the
  prompts the loop passed (`Watch.batch`'s ``input_ids``, or `Watch.rollout`'s ``prompt_ids``), every
  position that predicts a prompt token, a padding token (attention mask 0) or nothing at all (the
  last) must have a zero gradient (the prompts are also read from the prefill forward of a ``generate``
  on the trained model, so a loop that passes none is checked too): a loss averaged over the whole sequence, a mask of the wrong length
  or side, or an off-by-one in the mask puts gradient there (`LOOP_LOSS_OUTSIDE_RESPONSE`); an off-by-one
  the other way leaves the first response token with no gradient in every row (`LOOP_LOSS_SKIPS_FIRST_TOKEN`).
* **The log-probs are aligned with the tokens.** The gradient of ``log_softmax(logits[t])[y]`` with
  respect to ``logits[t]`` is ``e_y - softmax``: its largest entry (in magnitude) is at ``y``, the token
  whose log-prob the loss read there, and it holds half the row's absolute sum. Where the gradient is
  peaked like that, ``y`` must be ``ids[t + 1]``; a loss that reads ``ids[t]`` (``logits[:, P:]``
  gathered at ``ids[:, P:]``), ``ids[t + 2]``, or other ids at most positions has its log-probs shifted
  against the tokens (`LOOP_LOGPROBS_MISALIGNED`), said with the offset. Losses over whole distributions
  (a full KL, distillation) are not peaked and are left alone.

Exact zeros and argmaxes, no threshold on a value, so a correct loop (masked, sliced, accumulated, under
autocast, LoRA) stays clean. Cost: two reductions over one backward's logit gradient, for `CHECKED`
forwards per role. Exercised by `pytest tests/test_loop_tokens.py`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.integrations import loop_calls
from verlaudit.integrations.loop_calls import at_line as _at
from verlaudit.integrations.loop_checks import output_tensor
from verlaudit.rundir import Finding

CHECKED = 4
"""Forwards with gradients whose logit gradient is read, per trained role."""
ALIGNED = 0.8
"""Share of the read positions whose peak is at one token offset for that offset to be what the loss reads."""
PEAKED = 0.4
"""A position's gradient is one token's log-prob when its largest entry holds this share of its absolute sum
(exactly one half for ``e_y - softmax``)."""

_W = torch.randint(1, 2**31 - 1, (4096,), generator=torch.Generator().manual_seed(12345), dtype=torch.int64)


def _hash_rows(ids: torch.Tensor) -> list[int]:
    """A hash per row of integer ids (the same rows give the same numbers; int64 arithmetic wraps)."""
    n = ids.shape[1]
    w = _W[:n] if n <= _W.numel() else _W.repeat(n // _W.numel() + 1)[:n]
    return (ids.long() * w.to(ids.device)[None, :]).sum(-1).tolist()


def _in_generate(depth: int = 40) -> bool:
    """Whether a ``generate`` (transformers' GenerationMixin, or a loop's own of that name) is on the stack."""
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name == "generate":
            return True
        f = f.f_back
    return False


def _span(cols: torch.Tensor) -> str:
    """``a..b`` of the column indices a row reads."""
    idx = cols.nonzero().flatten().tolist()
    if not idx:
        return "none"
    return f"{idx[0]}..{idx[-1]}" if len(idx) > 1 else str(idx[0])


class TokenAudit:
    """The token checks of one trained role. ``add(finding)`` records; ``where()`` gives the step and
    phase; ``loss_line()`` the user's line of the backward that is running."""

    def __init__(
        self,
        role: str,
        *,
        add: Callable[[Finding | None], None],
        where: Callable[[], dict],
        loss_line: Callable[[], str | None],
    ) -> None:
        self.role, self.add, self.where, self.loss_line = role, add, where, loss_line
        self.prompts: dict[int, set[int]] = {}
        """prompt width -> the hashes of the prompt rows last seen at that width."""
        self.checked = 0
        self.reported: set[str] = set()

    @property
    def done(self) -> bool:
        return self.checked >= CHECKED or bool(self.reported)

    def on_prompts(self, ids: Any) -> None:
        """The prompts the loop generates from (ids, left-padded to one width): the latest of each width."""
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() and ids.shape[1]:
            width = int(ids.shape[1])
            self.prompts.pop(width, None)
            self.prompts[width] = set(_hash_rows(ids.detach()))
            while len(self.prompts) > 4:
                self.prompts.pop(next(iter(self.prompts)))

    def _prompt_width(self, ids: torch.Tensor) -> int | None:
        """The widest known prompt width below the forward's whose prompts start every row, else None (a
        forward on the prompts themselves, an SFT loop: no response to tell)."""
        for width in sorted((w for w in self.prompts if w < ids.shape[1]), reverse=True):
            if all(h in self.prompts[width] for h in _hash_rows(ids[:, :width])):
                return width
        return None

    def on_forward(self, module: Any, args: Any, kwargs: dict, output: Any, line: str | None) -> None:
        """A forward of the trained model: hooks the gradient of its logits (with gradients); a
        generation's prefill (no gradients, inside ``generate``) gives the prompts."""
        if self.done:
            return
        if not torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1 and _in_generate():
                self.on_prompts(ids)
            return
        if "decoder_input_ids" in kwargs or getattr(
            getattr(module, "config", None), "is_encoder_decoder", False
        ):
            return  # the logits are the decoder's, the input ids the encoder's
        logits = output_tensor(output)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if logits is None or logits.dim() != 3 or not logits.requires_grad:
            return
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            return
        if tuple(logits.shape[:2]) != tuple(ids.shape) or ids.shape[1] < 3 or logits.shape[-1] < 2:
            return
        if int(ids.min()) < 0 or int(ids.max()) >= logits.shape[-1]:
            return  # not a language model's logits over these ids (a value head, a tagger)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            mask = None
        self.checked += 1
        width = self._prompt_width(ids)
        hook = functools.partial(
            self._on_grad, ids.detach(), None if mask is None else mask.detach(), width, line
        )
        logits.register_hook(hook)

    def _on_grad(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        width: int | None,
        line: str | None,
        g: torch.Tensor,
    ) -> None:
        if loop_calls.GRAD_DEPTH[0]:
            return  # a torch.autograd.grad (the loop's own, or a check's second derivative): not the loss's backward
        try:
            with torch.no_grad():
                finding = self._read(ids, mask, width, line, g.detach())
        except Exception:  # noqa: BLE001 -- a check must never break the user's backward
            return
        self.add(finding)

    def _read(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        width: int | None,
        line: str | None,
        g: torch.Tensor,
    ) -> Finding | None:
        if tuple(g.shape[:2]) != tuple(ids.shape):
            return None
        a = g.abs()
        peak, top = a.max(-1)
        if not bool(torch.isfinite(peak).all()):
            return None  # NaN gradients are another check's
        read = peak > 0
        n_read = int(read.sum())
        if not n_read:
            return None
        ids = ids.to(top.device)
        T = ids.shape[1]
        peaked = read & (peak >= PEAKED * a.sum(-1))
        n_peaked = int(peaked.sum())
        loss_line = self.loss_line()
        # which token each peaked position reads: offset 1 is the next token (right), 0 its own, 2 the one after
        share = {}
        for d in (0, 1, 2):
            cols = T - d
            hit = (top[:, :cols] == ids[:, d:]) & peaked[:, :cols]
            share[d] = int(hit.sum()) / n_peaked if n_peaked else 0.0
        if (
            K.LOOP_LOGPROBS_MISALIGNED not in self.reported
            and n_peaked >= max(4, ALIGNED * n_read)
            and share[1] < 1 - ALIGNED
        ):
            off = max((0, 2), key=lambda d: share[d])
            self.reported.add(K.LOOP_LOGPROBS_MISALIGNED)
            return _misaligned_finding(
                self.role, off if share[off] >= ALIGNED else None, share, n_peaked, read, width, loss_line, line,
                self.where(),
            )  # fmt: skip
        if width is None or self.reported:
            return None  # a misalignment puts the read positions off too: one fault, one finding
        tgt_pad = torch.zeros_like(read)
        if mask is not None:
            tgt_pad[:, :-1] = mask.to(read.device)[:, 1:] == 0
        prompt = read.clone()
        prompt[:, width - 1 :] = False
        pads = read & tgt_pad
        last = read[:, -1]
        if prompt.any() or pads.any() or last.any():
            self.reported.add(K.LOOP_LOSS_OUTSIDE_RESPONSE)
            return _outside_finding(self.role, read, prompt, pads, last, width, loss_line, line, self.where())
        # the other end: the first response token (predicted at width - 1) left out of every row that reads
        rows = read.any(-1)
        if width + 1 < T and int(rows.sum()) >= 2 and (mask is None or bool((mask[rows, width] != 0).all())):
            if not bool(read[rows, width - 1].any()) and bool(read[rows, width].all()):
                self.reported.add(K.LOOP_LOSS_SKIPS_FIRST_TOKEN)
                return _first_token_finding(self.role, read, width, loss_line, line, self.where())
        return None


# ---------------------------------------------------------------- the findings


def _row_reads(read: torch.Tensor) -> str:
    row = int(read.any(-1).nonzero().flatten()[0])
    return _span(read[row])


def _misaligned_finding(
    role: str,
    off: int | None,
    share: dict[int, float],
    n: int,
    read: torch.Tensor,
    width: int | None,
    loss_line: str | None,
    fwd_line: str | None,
    where: dict,
) -> Finding:
    T = read.shape[1]
    reads = _row_reads(read)
    if off == 0:
        what = (
            "the log-prob of token t itself (the token the model was given at t), not of token t+1 (the one "
            "position t predicts): shifted by one position"
        )
        shift = "+1 (logits one position too late, e.g. logits[:, P:] for the response ids[:, P:])"
    elif off == 2:
        what = "the log-prob of token t+2, not of token t+1: shifted by one position the other way"
        shift = "-1 (logits one position too early, e.g. logits[:, P - 2 : -2] for ids[:, P:])"
    else:
        what = (
            "the log-prob of another token than t+1 (neither t nor t+2): the ids gathered are not the sequence's "
            "next tokens"
        )
        shift = "unknown (other ids gathered)"
    last = bool(read[:, -1].any())
    expect = f"{width - 1}..{T - 2}" if width is not None else f"..{T - 2}"
    return Finding(
        severity="error",
        kind=K.LOOP_LOGPROBS_MISALIGNED,
        message=f"log-probs misaligned with the tokens (shift {shift.split(' ')[0]}): the loss at {_at(loss_line)} "
        f"reads at each logit position t {what}. Its gradient w.r.t. the logits of the forward at {_at(fwd_line)} "
        f"peaks at ids[t] at {share[0]:.0%}, at ids[t+1] at {share[1]:.0%}, at ids[t+2] at {share[2]:.0%} of the "
        f"{n} positions it reaches; a row's read positions are {reads}"
        + (f" (position {T - 1}, the last, predicts no token)" if last else "")
        + f", where the response's log-probs are read at {expect}",
        role=role,
        where=f"token log-probs of the loss at {_at(loss_line)}",
        observed={
            "peak_at_offset": {str(d - 1): round(v, 3) for d, v in share.items()},
            "positions_read": n,
            "reads_last_position": last,
            "prompt_width": width,
            "shift": shift,
        },
        expected="the log-prob of token t+1 read from the logits at t (logits[:, :-1] gathered at ids[:, 1:])",
        fix=f"at {_at(loss_line)}: align the log-probs -- the logits at position t predict token t+1, so take "
        "logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]); for the response, logits[:, P - 1 : -1] "
        "gathered at ids[:, P:]" + (f" (P = {width}, the prompt width)" if width is not None else ""),
        **where,
    )


def _first_token_finding(
    role: str, read: torch.Tensor, width: int, loss_line: str | None, fwd_line: str | None, where: dict
) -> Finding:
    T = read.shape[1]
    return Finding(
        severity="error",
        kind=K.LOOP_LOSS_SKIPS_FIRST_TOKEN,
        message=f"the loss at {_at(loss_line)} leaves out the first response token of every row: its gradient w.r.t. "
        f"the logits of the forward at {_at(fwd_line)} is zero at position {width - 1} (which predicts the first "
        f"response token, ids[{width}]) and non-zero from {width} on (a row reads {_row_reads(read)} of the "
        f"response positions {width - 1}..{T - 2}): a response mask or slice off by one, so the first token of "
        "each response is never trained",
        role=role,
        where=f"response mask of the loss at {_at(loss_line)}",
        observed={"prompt_width": width, "sequence_length": T, "first_response_position_read": False},
        expected=f"a gradient at every response position {width - 1}..{T - 2}",
        fix=f"at {_at(loss_line)}: the response's log-probs are logits[:, P - 1 : -1] gathered at ids[:, P:] (P = "
        f"{width}), and the response mask is the mask of ids[:, P:] (attention_mask[:, P:]): align the mask with "
        "the log-probs it multiplies",
        **where,
    )


def _outside_finding(
    role: str,
    read: torch.Tensor,
    prompt: torch.Tensor,
    pads: torch.Tensor,
    last: torch.Tensor,
    width: int,
    loss_line: str | None,
    fwd_line: str | None,
    where: dict,
) -> Finding:
    T = read.shape[1]
    rows = max(1, int(read.any(-1).sum()))
    parts = []
    in_prompt = pads.clone()
    in_prompt[:, width - 1 :] = False
    later = pads & ~in_prompt
    if prompt.any():
        padded = (
            f"; {int(in_prompt.sum())} of the {int(prompt.sum())} read are padding" if in_prompt.any() else ""
        )
        parts.append(
            f"{int(prompt.sum()) / rows:.0f} prompt position(s) per row (positions {_row_reads(prompt)} predict prompt "
            f"tokens{padded})"
        )
    if later.any():
        parts.append(f"{int(later.sum())} response padding position(s) (attention mask 0)")
    if last.any():
        parts.append(f"the last position {T - 1}, which predicts no token")
    return Finding(
        severity="error",
        kind=K.LOOP_LOSS_OUTSIDE_RESPONSE,
        message=f"the loss at {_at(loss_line)} reads tokens outside the response: its gradient w.r.t. the logits of "
        f"the forward at {_at(fwd_line)} is non-zero at {'; '.join(parts)}, besides the response positions "
        f"{width - 1}..{T - 2}: the prompt's (and padding's) log-probs are pushed up or down with the advantage, "
        "as if the model had generated them (a loss over the whole sequence, or a response mask of the wrong "
        "length or side)",
        role=role,
        where=f"loss at {_at(loss_line)}: prompt / padding tokens in the loss",
        observed={
            "prompt_positions_read": int(prompt.sum()),
            "padding_positions_read": int(pads.sum()),
            "last_position_read": int(last.sum()),
            "positions_read": int(read.sum()),
            "prompt_width": width,
            "sequence_length": T,
        },
        expected=f"a gradient only at the response's positions {width - 1}..{T - 2}",
        fix=f"at {_at(loss_line)}: restrict the loss to the response tokens -- logits[:, P - 1 : -1] gathered at "
        f"ids[:, P:] (P = {width}, the prompt width), or multiply the per-token terms by a response mask (1 on "
        "the response's tokens, 0 on the prompt and padding) and average over that mask",
        **where,
    )
