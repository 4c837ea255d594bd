"""Training forwards over left-padded rows (`trainer.logprobs.attention_inputs`): no attention row is
empty, so an attention kernel that leaves NaN in empty rows (cuDNN's, on Hopper) cannot poison the
gradients; real tokens see exactly what HF's own mask shows them.

Run: ``pytest tests/test_attention_mask.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import ModelConfig
from trainer.logprobs import (
    additive_mask,
    attention_inputs,
    causal_mask_with_self,
    has_left_padding,
    position_ids_from_mask,
    sequence_logprobs,
)
from trainer.models import build_causal_lm, build_critic, load_tokenizer
from trainer.precision import resolve_policy


def _model(attn: str, seed: int = 0):
    cfg = ModelConfig(preset="tiny-llama", attn_implementation=attn)
    pol = resolve_policy("fp32")["actor"]
    return build_causal_lm(cfg, load_tokenizer(cfg), pol, "cpu", seed=seed), cfg


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding of 4, 1 and none
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _naive_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention that returns zeros for an empty row but NaN gradients through it (softmax over all
    -inf, hidden behind a ``where``): finite forward, poisoned backward, as seen with cuDNN's."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        t, u = s.shape[-2:]
        attn_mask = torch.ones(t, u, dtype=torch.bool).tril()
    if attn_mask is None:
        return s.softmax(-1) @ v
    if attn_mask.dtype != torch.bool:
        attn_mask = attn_mask == 0
    out = s.masked_fill(~attn_mask, float("-inf")).softmax(-1) @ v
    return torch.where(attn_mask.any(-1, keepdim=True), out, 0.0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_real_tokens_see_what_hf_shows_them(attn):
    model, _ = _model(attn)
    ids, mask = _batch()
    kw = attention_inputs(model, mask)
    assert kw["attention_mask"].dim() == 4
    visible = kw["attention_mask"] if attn == "sdpa" else kw["attention_mask"] == 0
    assert visible.any(-1).all()  # no empty query row
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False, **kw).logits
        hf = model(
            input_ids=ids, attention_mask=mask, position_ids=kw["position_ids"], use_cache=False
        ).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], hf[real], rtol=1e-5, atol=1e-5)


def test_without_left_padding_the_mask_passes_through():
    model, _ = _model("sdpa")
    ids, mask = _batch()
    right = mask.flip(-1)  # right padding only: every query row still sees a real token
    assert attention_inputs(model, right)["attention_mask"] is right
    assert attention_inputs(model, torch.ones_like(mask))["attention_mask"].dim() == 2


def test_empty_row_nan_kernel_no_longer_poisons_gradients(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _naive_sdpa)
    ids, mask = _batch()

    def grads(fix: bool):
        model, _ = _model("sdpa")
        model.train()
        if fix:
            lp, _ = sequence_logprobs(model, ids, mask, 4)
        else:  # HF's own 2-D mask path: padding queries of row 0 and 1 see nothing
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            lp = logits[:, -5:-1].float().log_softmax(-1).gather(-1, ids[:, -4:, None]).squeeze(-1)
        assert torch.isfinite(lp).all()  # the loss itself is finite either way
        lp.sum().backward()
        return [p.grad for p in model.parameters()]

    assert not all(torch.isfinite(g).all() for g in grads(fix=False))  # the failure the fix is for
    assert all(torch.isfinite(g).all() for g in grads(fix=True))


def test_critic_takes_the_same_mask():
    cfg = ModelConfig(preset="tiny-llama")
    tok = load_tokenizer(cfg)
    critic = build_critic(cfg, tok, resolve_policy("fp32")["critic"], "cpu", seed=0)
    ids, mask = _batch()
    with torch.no_grad():
        v = critic(ids, mask)
        kw = attention_inputs(critic.backbone, mask)
        ref = critic.value_head(
            critic.backbone(
                input_ids=ids, attention_mask=mask, position_ids=kw["position_ids"]
            ).last_hidden_state
        ).squeeze(-1)
    torch.testing.assert_close(v[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-5)


class _HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value back to the host (`.item()`, `bool(t)`): on a GPU each is
    a device sync. They all reach aten._local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _before(model, attention_mask):
    """attention_inputs as it was before the flag was kept per mask: one host read per call."""
    out = {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}
    attn = model.config._attn_implementation
    if attn not in ("sdpa", "eager") or attention_mask.dim() != 2 or bool((attention_mask[:, 0] != 0).all()):
        return out
    mask = causal_mask_with_self(attention_mask.bool(), attention_mask.shape[1])
    if attn == "eager":
        mask = additive_mask(mask, next(model.parameters()).dtype)
    out["attention_mask"] = mask
    return out


def _masks():
    _, mask = _batch()
    return {"left-padded": mask, "unpadded": torch.ones_like(mask), "right-padded": mask.flip(-1)}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_masks_and_logprobs_are_bitwise_what_they_were(attn):
    model, _ = _model(attn)
    ids, _ = _batch()
    for name, mask in _masks().items():
        old = _before(model, mask)
        padded = name == "left-padded"
        for new in (attention_inputs(model, mask), attention_inputs(model, mask, left_padded=padded)):
            assert new.keys() == old.keys()
            assert all(torch.equal(new[k], old[k]) for k in old), name
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, mask, 4)
            lp_flag, _ = sequence_logprobs(model, ids, mask, 4, left_padded=padded)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=5, **old).logits[:, :-1]
        want = logits.float().log_softmax(-1).gather(-1, ids[:, -4:, None]).squeeze(-1)
        assert torch.equal(lp, want) and torch.equal(lp_flag, want), name


def test_left_padding_is_read_once_per_mask():
    model, _ = _model("sdpa")
    _, mask = _batch()
    with _HostReads() as reads:
        for _ in range(3):  # one step's forwards over the rollout's mask: old, reference, values
            assert attention_inputs(model, mask)["attention_mask"].dim() == 4
    assert reads.n == 1
    with _HostReads() as reads:
        attention_inputs(model, mask, left_padded=True)
        attention_inputs(model, torch.ones_like(mask), left_padded=False)
    assert reads.n == 0  # the caller knew: nothing read
    with _HostReads() as reads:
        attention_inputs(model, mask.clone())  # another tensor (a micro-batch): read again
    assert reads.n == 1
    # an in-place change is seen (the version counter moves): read again, new answer
    ones = torch.ones_like(mask)
    assert attention_inputs(model, ones)["attention_mask"] is ones
    ones[0, :2] = 0
    with _HostReads() as reads:
        assert attention_inputs(model, ones)["attention_mask"].dim() == 4
    assert reads.n == 1


def test_three_forwards_over_one_mask_read_it_once():
    # HF's own mask code may read the mask too (it does on its 2-D path): compare with the caller
    # passing the flag, so only attention_inputs' reads are counted
    model, _ = _model("sdpa")
    ids, mask = _batch()

    def reads(**kw):
        m = mask.clone()  # a fresh tensor: nothing kept from an earlier test
        with _HostReads() as r, torch.no_grad():
            for _ in range(3):
                sequence_logprobs(model, ids, m, 4, **kw)
        return r.n

    assert reads() - reads(left_padded=True) == 1


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4),
    flip=st.integers(0, 3),
)
def test_kept_answer_follows_the_mask(rows, flip):
    # rows: (left pad, right pad) of each row of a length-6 mask; then one row's first entry flipped
    # in place: the kept answer must follow, as a fresh read of the first column would
    mask = torch.ones(len(rows), 6, dtype=torch.long)
    for i, (left, right) in enumerate(rows):
        mask[i, :left] = 0
        mask[i, 6 - right :] = 0
    assert has_left_padding(mask) == bool((mask[:, 0] == 0).any())
    i = flip % len(rows)
    mask[i, 0] = 1 - mask[i, 0]
    assert has_left_padding(mask) == bool((mask[:, 0] == 0).any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["bf16", "bf16-pure"])
def test_cuda_left_padded_gradients_are_finite(preset, capsys):
    """On the GPU's own SDPA kernels (cuDNN on Hopper for masked attention): every gradient finite
    through `attention_inputs`; HF's 2-D mask path is run beside it and only reported."""
    cfg = ModelConfig(
        preset="tiny-llama",
        overrides={
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 512,
        },
    )
    pol = resolve_policy(preset)["actor"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (8, 320), generator=g)
    mask = torch.ones_like(ids)
    for i in range(8):
        mask[i, : 5 * i + 1] = 0  # every row starts with padding
    ids, mask = ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()
    finite = {}
    for fix in (True, False):
        model = build_causal_lm(cfg, load_tokenizer(cfg), pol, "cuda", seed=0)
        model.train()
        with pol.autocast_ctx("cuda"):
            if fix:
                lp, _ = sequence_logprobs(model, ids, mask, 256)
            else:
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                lp = out[:, -257:-1].float().log_softmax(-1).gather(-1, ids[:, -256:, None]).squeeze(-1)
        lp.mean().backward()
        finite[fix] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    with capsys.disabled():
        print(
            f"\n{preset}: gradients finite with attention_inputs: {finite[True]}; with HF's 2-D mask: {finite[False]}"
        )
    assert finite[True]
