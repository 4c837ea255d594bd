"""The rollout's own forward for Llama-family models: weights snapshotted in the rollout dtype with
q/k/v and gate/up fused, attention over the written cache slots only.

What a separate inference engine does when the trainer syncs weights into it (vLLM loads the actor's
weights into its own bf16 model with merged qkv / gate_up projections): `FusedWeights` takes the
actor's weights at one moment, casts them to the rollout's dtype (once per rollout, not once per
decode step as autocast does) and concatenates q/k/v and gate/up, so a decode step runs four weight
GEMMs per layer instead of seven. The forward is the HF model's own, op for op, as if the model
had been loaded in that dtype (RMSNorm in fp32 scaled in the dtype, rotary from the model's own
``rotary_emb``, SiLU-mul, residual adds in the dtype); a decode step's attention is
`trainer.decode_attention.decode_attention`, which reads only the written, valid cache slots.

Supported: Llama, Mistral (no sliding window) and Qwen2 layouts. For another model `unsupported` says
why, and `require_supported` refuses ``rollout.engine: fused`` with that reason (there is no silent fallback
to the HF forward: the user asked for this engine). Exercised by
``pytest tests/test_fused_decode.py`` (logits against the HF forward of the same model in the same
dtype) and, on a GPU, ``benchmarks/rollout_bench.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from trainer.decode_attention import decode_attention

MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary types whose cos/sin depend on the position only (not on the sequence length seen)."""


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor: an FSDP2 (DTensor) shard is all-gathered (every rank calls this in the same
    order, since every rank builds the same snapshot), a plain tensor is returned as it is."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "model", None)


def unsupported_config(cfg: object) -> str | None:
    """Why `FusedWeights` cannot take a model of config ``cfg`` (a transformers config), or None when the
    config allows it (the module layout is checked by `unsupported`)."""
    kind = getattr(cfg, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} (fused decode covers {', '.join(MODEL_TYPES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={cfg.sliding_window})"
    rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}).get(
        "rope_type", "default"
    )
    if rope not in ROPE_TYPES:
        return f"rope_type {rope!r} (its cos/sin depend on the sequence length)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    return None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `FusedWeights` cannot take ``model``, or None when it can."""
    why = unsupported_config(getattr(model, "config", None))
    if why is not None:
        return why
    backbone = _backbone(model)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if backbone is None or any(not hasattr(backbone, n) for n in need) or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} lacks the model.{{{', '.join(need)}}} / lm_head layout"
    for layer in backbone.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or hasattr(attn, "q_norm"):
            return f"{type(layer).__name__} is not a Llama-style decoder layer"
    return None


def require_supported(model: torch.nn.Module) -> None:
    """Raises the ValueError that names why `FusedWeights` cannot take ``model``."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"rollout.engine: fused: {why}; use rollout.engine: static")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static numbers of the forward (Python constants under torch.compile)."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class FusedWeights:
    """The actor's weights in ``dtype`` at the moment of construction (a copy where the dtype differs
    or the layout is fused, a view otherwise). Per layer: input norm, [q; k; v] weight and bias,
    o weight and bias, post-attention norm, [gate; up] weight and bias, down weight and bias.

    Under FSDP2 every rank gathers the whole model once here (one tensor at a time, cast as it
    arrives), so the decode steps after it run without collectives, as an inference engine holding
    the synced weights would."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        require_supported(model)
        backbone = _backbone(model)
        cfg = model.config
        first = backbone.layers[0]
        self.dtype = dtype
        self.device = backbone.norm.weight.device
        self.shape = Shape(
            heads=cfg.num_attention_heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=first.self_attn.head_dim,
            intermediate=first.mlp.gate_proj.weight.shape[0],
            eps=float(first.input_layernorm.variance_epsilon),
            scale=float(first.self_attn.scaling),
        )
        self._rotary = backbone.rotary_emb
        self._own = {
            (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()
            for t in model.parameters()
        }
        # rows are gathered, then cast: no copy (but the whole table when sharded)
        self.embed = _full(backbone.embed_tokens.weight)
        with torch.no_grad():
            self.layers = [self._layer(layer) for layer in backbone.layers]
            self.norm = self._cast(backbone.norm.weight)
            self.lm_head = self._cast(model.lm_head.weight)
            self.lm_head_bias = self._cast(getattr(model.lm_head, "bias", None))

    def _cast(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else _full(t.detach()).to(self.dtype)

    def _cat(self, *linears: torch.nn.Linear, bias: bool = False) -> torch.Tensor | None:
        parts = [lin.bias if bias else lin.weight for lin in linears]
        if bias and all(p is None for p in parts):
            return None
        parts = [
            p if p is not None else torch.zeros(lin.weight.shape[0], device=self.device)
            for p, lin in zip(parts, linears)
        ]
        return torch.cat([_full(p.detach()).to(self.dtype) for p in parts])

    def _layer(self, layer: torch.nn.Module) -> tuple[torch.Tensor | None, ...]:
        a, m = layer.self_attn, layer.mlp
        return (
            self._cast(layer.input_layernorm.weight),
            self._cat(a.q_proj, a.k_proj, a.v_proj),
            self._cat(a.q_proj, a.k_proj, a.v_proj, bias=True),
            self._cast(a.o_proj.weight),
            self._cast(a.o_proj.bias),
            self._cast(layer.post_attention_layernorm.weight),
            self._cat(m.gate_proj, m.up_proj),
            self._cat(m.gate_proj, m.up_proj, bias=True),
            self._cast(m.down_proj.weight),
            self._cast(m.down_proj.bias),
        )

    def nbytes(self) -> int:
        """Bytes this snapshot holds beyond the model's own tensors."""
        seen, total = set(self._own), 0
        # the embedding is the model's own table, except under FSDP2, where it was gathered
        held = [self.embed, self.norm, self.lm_head, self.lm_head_bias]
        for t in [*held, *(t for layer in self.layers for t in layer)]:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.numel() * t.element_size()
        return total

    def rotary_table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] in the rollout dtype, from the model's own rotary module."""
        probe = torch.empty(1, 1, self.shape.head_dim, dtype=self.dtype, device=device)
        cos, sin = self._rotary(probe, torch.arange(length, device=device)[None])
        return cos[0], sin[0]

    def new_cache(
        self, rows: int, slots: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Empty K/V ``[rows, kv_heads, slots, head_dim]`` per layer."""
        s = self.shape
        return [
            (
                torch.zeros(rows, s.kv_heads, slots, s.head_dim, dtype=self.dtype, device=device),
                torch.zeros(rows, s.kv_heads, slots, s.head_dim, dtype=self.dtype, device=device),
            )
            for _ in self.layers
        ]

    def args(self) -> tuple:
        """The tensors `forward` takes, in its argument order."""
        return self.embed, self.layers, self.norm, self.lm_head, self.lm_head_bias


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm: normalised in fp32, scaled in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward(
    shape: Shape,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    embed: torch.Tensor,
    layers: list[tuple],
    norm: torch.Tensor,
    lm_head: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Last-position logits [B, V] of ``ids`` [B, T], writing each layer's K/V at cache ``slots``.

    ``cos``/``sin`` [L, D] are the rotary tables (`FusedWeights.rotary_table`), read at ``positions``
    [B, T]. Prefill (T > 1):
    ``mask`` is Bool[B, 1, T, S] over the whole cache (SDPA). Decode (T == 1): ``mask`` is the valid
    slots Bool[B, S] and ``slots`` the one slot written; attention reads the written slots only."""
    s = shape
    b, t = ids.shape
    dtype = norm.dtype
    q_w, kv_w = s.heads * s.head_dim, s.kv_heads * s.head_dim
    cos, sin = cos[positions][:, None], sin[positions][:, None]
    h = F.embedding(ids, embed).to(dtype)
    for (k_cache, v_cache), (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b) in zip(
        cache, layers
    ):
        qkv = F.linear(_rms(h, ln1, s.eps), qkv_w, qkv_b)
        q, k, v = qkv.split((q_w, kv_w, kv_w), dim=-1)
        q = _rotate(q.view(b, t, s.heads, s.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        if t == 1:
            attn = decode_attention(q[:, :, 0].contiguous(), k_cache, v_cache, mask, slots, s.scale)[:, None]
        else:
            kk, vv = k_cache, v_cache
            if s.heads != s.kv_heads:
                group = s.heads // s.kv_heads
                kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=s.scale).transpose(1, 2)
        h = h + F.linear(attn.reshape(b, t, q_w), o_w, o_b)
        gate, up = F.linear(_rms(h, ln2, s.eps), gu_w, gu_b).split(s.intermediate, dim=-1)
        h = h + F.linear(F.silu(gate) * up, down_w, down_b)
    return F.linear(_rms(h[:, -1], norm, s.eps), lm_head, lm_head_bias)
