"""Which tokens an own loop's loss reads, from the gradient of its logits (`verlaudit.integrations.loop_tokens`):
a loss over the whole sequence, over unmasked padding, log-probs shifted one way or the other, each in a tiny
REINFORCE loop of its own, beside correct loops that must stay clean (masked, sliced, accumulated, under bf16
autocast, with a GradScaler in fp16, a full-distribution loss). Run: `pytest tests/test_loop_tokens.py`."""

from __future__ import annotations

import torch
from torch import nn

import verlaudit
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.rundir import read_run

VOCAB, PROMPT, LENGTH, ROWS, PAD = 12, 4, 10, 8, 0


def kinds(path, severity=("warning", "error")):
    return sorted({f.kind for f in read_run(path).findings if f.severity in severity})


def found(path, kind):
    return [f for f in read_run(path).findings if f.kind == kind]


class TinyLM(nn.Module):
    """A causal LM small enough for a test: embeddings, a running mean over the prefix, a head."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
        return self.head(torch.tanh(h.cumsum(1) / steps))


def batch(step, *, response_pad=False):
    """Left-padded prompts (rows 0-3 start with two pads), responses, masks (``response_pad``: the last two
    response tokens of rows 4-7 are padding, mask 0)."""
    g = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    seq[:4, :2], mask[:4, :2] = PAD, 0
    if response_pad:
        seq[4:, -2:], mask[4:, -2:] = PAD, 0
    return seq, mask


def right_logp(logits, seq, mask):
    lp = logits[:, PROMPT - 1 : -1].float().log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)
    return lp, mask[:, PROMPT:].float()


def whole_logp(logits, seq, mask):  # the LM-loss shift over every token, prompt and padding included
    return logits[:, :-1].float().log_softmax(-1).gather(-1, seq[:, 1:, None]).squeeze(-1), None


def late_logp(logits, seq, mask):  # each token's log-prob from its own position
    return logits[:, PROMPT:].float().log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1), None


def early_logp(logits, seq, mask):  # each token's log-prob from two positions before it
    return logits[:, PROMPT - 2 : -2].float().log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(
        -1
    ), None


def unmasked_logp(logits, seq, mask):  # the right positions, but the response's padding not masked out
    return right_logp(logits, seq, mask)[0], None


def generate(model, prompts, mask):
    """A loop's own sampling: one no-grad forward on the prompts (its prefill), then the batch's responses."""
    with torch.no_grad():
        model(input_ids=prompts, attention_mask=mask)


def rl_loop(path, logp_fn, *, steps=3, micro=1, autocast=None, scaler=None, response_pad=False, prompts=True,
            precision="fp32", sample=False):  # fmt: skip
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with verlaudit.watch(model, opt, scaler=scaler, out_dir=path, precision=precision) as w:
        for step in range(steps):
            seq, mask = batch(step, response_pad=response_pad)
            if prompts:
                w.batch({"input_ids": seq[:, :PROMPT], "attention_mask": mask[:, :PROMPT]})
            if sample:
                generate(model, seq[:, :PROMPT], mask[:, :PROMPT])
            rewards = w.reward((seq[:, PROMPT:] == 3).float().mean(-1) + 0.1 * torch.arange(ROWS) / ROWS)
            adv = rewards - rewards.mean()
            opt.zero_grad()
            n = ROWS // micro
            with w.phase("actor_update"):
                for k in range(micro):
                    sl = slice(k * n, (k + 1) * n)
                    if autocast is not None:
                        with torch.autocast("cpu", dtype=autocast):
                            logits = model(input_ids=seq[sl], attention_mask=mask[sl])
                    else:
                        logits = model(input_ids=seq[sl], attention_mask=mask[sl])
                    logp, m = logp_fn(logits, seq[sl], mask[sl])
                    m = torch.ones_like(logp) if m is None else m
                    loss = -((adv[sl, None] * logp * m).sum() / m.sum()) / micro
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            w.log({"actor/loss": loss})


def test_a_loss_over_the_whole_sequence_reads_the_prompt_and_its_padding(tmp_path):
    rl_loop(tmp_path / "run", whole_logp)
    (f,) = found(tmp_path / "run", "loop/loss_outside_response")
    assert f.severity == "error" and f.observed["prompt_positions_read"] == ROWS * (PROMPT - 1)
    assert f.observed["last_position_read"] == 0 and "test_loop_tokens.py" in f.where
    assert "4 of the 24 read are padding" in f.message and "P - 1" in f.fix and "response mask" in f.fix
    (d,) = diagnose_path(tmp_path / "run")
    assert d.causes[0].kind == "finding:loop/loss_outside_response", [c.title for c in d.causes]


def test_without_the_prompts_passed_a_generate_prefill_gives_them(tmp_path):
    rl_loop(tmp_path / "run", whole_logp, prompts=False, sample=True)
    (f,) = found(tmp_path / "run", "loop/loss_outside_response")
    assert f.observed["prompt_width"] == PROMPT
    rl_loop(tmp_path / "clean", right_logp, prompts=False, sample=True)
    assert kinds(tmp_path / "clean") == []
    rl_loop(tmp_path / "unknown", whole_logp, prompts=False)  # no prompts known: no position to tell
    assert kinds(tmp_path / "unknown") == []


def test_unmasked_response_padding_is_read_and_the_masked_loss_is_clean(tmp_path):
    rl_loop(tmp_path / "pads", unmasked_logp, response_pad=True)
    (f,) = found(tmp_path / "pads", "loop/loss_outside_response")
    assert f.observed["prompt_positions_read"] == 0 and f.observed["padding_positions_read"] == 4 * 2
    assert "response padding" in f.message
    rl_loop(tmp_path / "masked", right_logp, response_pad=True)
    assert kinds(tmp_path / "masked") == []


def test_log_probs_read_at_the_tokens_own_position_are_a_shift_by_one(tmp_path):
    rl_loop(tmp_path / "late", late_logp)
    (f,) = found(tmp_path / "late", "loop/logprobs_misaligned")
    assert (
        f.severity == "error" and f.observed["shift"].startswith("+1") and f.observed["reads_last_position"]
    )
    assert f.observed["peak_at_offset"]["-1"] >= 0.8 and "logits[:, P - 1 : -1]" in f.fix
    assert "loop/loss_outside_response" not in kinds(tmp_path / "late")  # one fault, one finding
    (d,) = diagnose_path(tmp_path / "late")
    assert d.causes[0].kind == "finding:loop/logprobs_misaligned"


def test_log_probs_read_two_positions_early_are_a_shift_the_other_way_even_without_prompts(tmp_path):
    rl_loop(tmp_path / "early", early_logp, prompts=False)
    (f,) = found(tmp_path / "early", "loop/logprobs_misaligned")
    assert f.observed["shift"].startswith("-1") and f.observed["prompt_width"] is None


def test_a_mask_one_token_late_leaves_out_the_first_response_token(tmp_path):
    def late_mask(
        logits, seq, mask
    ):  # the right log-probs, multiplied by the mask of the positions after them
        lp, m = right_logp(logits, seq, mask)
        return lp, torch.cat([torch.zeros(m.shape[0], 1), m[:, :-1]], 1)

    rl_loop(tmp_path / "run", late_mask)
    (f,) = found(tmp_path / "run", "loop/loss_skips_first_token")
    assert f.observed["prompt_width"] == PROMPT and "attention_mask[:, P:]" in f.fix


def test_log_probs_gathered_at_other_rows_ids_are_misaligned_with_no_shift_to_name(tmp_path):
    def other_rows(logits, seq, mask):  # each row's log-probs gathered at the next row's response
        lp = logits[:, PROMPT - 1 : -1].float().log_softmax(-1)
        return lp.gather(-1, seq.roll(1, 0)[:, PROMPT:, None]).squeeze(-1), mask[:, PROMPT:].float()

    rl_loop(tmp_path / "run", other_rows)
    (f,) = found(tmp_path / "run", "loop/logprobs_misaligned")
    assert f.observed["shift"].startswith("unknown") and f.observed["peak_at_offset"]["0"] < 0.2


def test_correct_loops_stay_clean(tmp_path):
    rl_loop(tmp_path / "plain", right_logp)
    rl_loop(tmp_path / "accumulated", right_logp, micro=2)
    rl_loop(tmp_path / "bf16", right_logp, autocast=torch.bfloat16, precision="bf16")
    scaler = torch.amp.GradScaler("cpu")
    rl_loop(tmp_path / "fp16", right_logp, autocast=torch.float16, scaler=scaler, precision="fp16")
    for name in ("plain", "accumulated", "bf16", "fp16"):
        assert kinds(tmp_path / name) == [], name


def test_a_loss_over_whole_distributions_is_not_taken_for_a_misalignment(tmp_path):
    target = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)), -1)

    def kl_logp(logits, seq, mask):  # -KL(target || policy) per response position: no single token read
        lp = logits[:, PROMPT - 1 : -1].float().log_softmax(-1)
        return (target * lp).sum(-1), mask[:, PROMPT:].float()

    rl_loop(tmp_path / "kl", kl_logp)
    assert kinds(tmp_path / "kl") == []


def test_the_check_is_removed_when_the_hook_is(tmp_path, monkeypatch):
    from verlaudit.integrations import loop_tokens

    monkeypatch.setattr(loop_tokens.TokenAudit, "on_forward", lambda *a, **k: None)
    rl_loop(tmp_path / "run", whole_logp)
    assert kinds(tmp_path / "run") == []  # nothing else sees a whole-sequence loss
