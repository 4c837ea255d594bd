"""Peak device memory of a training step, predicted from shapes and the precision policy (no GPU).

Pure arithmetic over an `Architecture` (exact parameter counts from a Llama-like config), a role's
`trainer.precision.RolePolicy` and a batch shape. Every estimate is a list of `Phase` candidates
(end of forward, top and bottom of backward, optimizer step, rollout, frozen forwards), each a dict
of named components in bytes; the peak is the largest phase, and its components are what the
planner prints. `verlaudit plan SUITE.yaml` (verlaudit/plan/planner.py) composes the phases of a PPO, GRPO
or DPO step; `pytest tests/test_plan.py` checks them against measured H200 peaks.

How the terms are derived (HF Llama decoder layer, per token; h hidden, I intermediate, q/kv the
attention widths, r the residual-stream bytes, c the compute bytes):

* residual stream: the embedding output has the parameter dtype (autocast leaves embeddings alone),
  so under autocast with fp32 masters the residual adds promote to fp32: r = 4, c = 2. Without
  autocast (fp32, bf16-pure, FSDP2 casting parameters itself) r = c.
* saved for backward by one layer: RMSNorm keeps its fp32 input (x itself when r = 4, an fp32 copy
  otherwise: 4h) and the normalised tensor (4h when r = 4, else r h); every linear keeps its input,
  and under autocast each linear casts the fp32 normalised input separately (q, k, v: 3 c h;
  gate, up: 2 c h); SDPA keeps q, k, v and its output (which o_proj's input is a view of); SiLU
  keeps the gate output, the product keeps SiLU's output and up's output, down_proj keeps the
  product (4 c I). A padded batch adds the boolean mask converted to an additive bias per layer
  (c T per token). Autocast with fp32 masters: 30h + 8I bytes; bf16-pure: 24h + 8I; fp32: 36h + 16I
  (plus a few bytes per head), for MHA. Checked against the tensors autograd really saves in
  tests/test_plan.py.
* GQA (fewer kv heads): transformers passes ``enable_gqa`` to SDPA when there is no attention mask
  (an unpadded batch) and k/v are then saved at their own width; with a mask ``repeat_kv`` expands
  them to q's width first. On CUDA an unmasked fp32 GQA layer falls back to torch's math kernel,
  which saves the attention probabilities (c H T per token). `attention_kernel` has the rule.
* autocast caches a low-precision copy of every fp32 weight that requires grad, also under
  ``torch.no_grad`` (not under ``inference_mode``), until the outermost autocast context exits.
  Without checkpointing those copies are also saved for backward; with checkpointing they are
  dropped at autocast exit and one layer's copies come back during its recompute.
* gradient checkpointing keeps each layer's input (r h) and recomputes one layer at a time in
  backward; the bottom of backward (all gradients but layer 0's and the embedding's, plus layer 0's
  recomputed activations) is the usual peak once optimizer state exists.
* compiled layers (``model.compile``): Inductor's partitioner saves fewer tensors and recomputes
  the cheap elementwise ones in backward. Measured with the same saved-tensor hooks on CPU (fp32,
  fp16, bf16 autocast, bf16-pure; hidden 256/512, intermediate 688/1024, 4 and 8 heads): a layer
  saves 3c h + c (2q + 2 kv) + 3c I + r d + 4 n_heads + 8 bytes per token (d the head dim: the
  cos/sin it keeps; kv as in eager, GQA included) plus its own input (r h), in every precision;
  autocast's low-precision weight copies are cast inside the compiled graph, so only kept layers
  hold them past their forward.
* logits: our log-prob island (`trainer.logprobs`) keeps the logits (compute dtype) and one fp32
  number per token; slicing the R response positions out of [B, R+1, V] and flattening copies them,
  once for log-probs and once more for entropies. The HF loss instead upcasts all logits to fp32 and
  keeps the fp32 log-softmax.
* AdamW: two moments in the optimizer-state dtype; the foreach implementation also materialises
  sqrt(exp_avg_sq) for every parameter during the step (one more moment), the fused one does not.
* FSDP2 over W GPUs: parameters, gradients and moments divided by W, plus two layers of gathered
  parameters in the compute dtype (current and prefetched) and one layer of unsharded gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from trainer.precision import RolePolicy

GIB = 1024**3
CONTEXT_BYTES = int(0.5 * GIB)
"""CUDA context, cuBLAS/cuDNN workspaces: memory a process holds outside the caching allocator."""
FRAGMENTATION = 0.03
"""Caching-allocator reserve on top of the allocated peak (block rounding, split blocks)."""


def nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """The shapes that decide memory, read from a Llama-like config (llama, mistral, qwen2)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, cfg: Any, name: str = "") -> Architecture:
        """From a transformers config object or a config.json mapping; ValueError for other families."""
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        model_type = get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"{name or 'model'}: model_type {model_type!r} is not modelled by the planner; "
                "it knows llama, mistral and qwen2 decoder layers"
            )
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        bias = bool(get("attention_bias", False))
        return cls(
            name=name or model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=h,
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", None) or heads),
            head_dim=int(get("head_dim", None) or h // heads),
            intermediate_size=int(get("intermediate_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=bias or model_type == "qwen2",
            o_bias=bias,
            mlp_bias=bool(get("mlp_bias", False)),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights and biases of the seven linears of one layer (what autocast casts)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp

    @property
    def layer_params(self) -> int:
        return self.layer_matmul_params + 2 * self.hidden_size  # two RMSNorm weights

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def backbone_params(self) -> int:
        """Embedding, layers, final norm: the critic's and reward model's trunk."""
        return self.embed_params + self.num_layers * self.layer_params + self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def params(self, kind: str) -> int:
        """``causal_lm`` (actor, reference), ``value`` (critic: head hidden -> 1 with bias) or
        ``seqcls`` (reward model: score head hidden -> 1, no bias)."""
        if kind == "causal_lm":
            return self.backbone_params + self.lm_head_params
        if kind == "value":
            return self.backbone_params + self.hidden_size + 1
        if kind == "seqcls":
            return self.backbone_params + self.hidden_size
        raise ValueError(f"unknown model kind {kind!r}; expected causal_lm, value or seqcls")

    def matmul_params(self, kind: str) -> int:
        """Parameters autocast casts in one forward: every linear, including the LM head (which,
        when tied, casts the embedding matrix)."""
        head = {"causal_lm": self.vocab_size * self.hidden_size, "value": self.hidden_size + 1}
        return self.num_layers * self.layer_matmul_params + head.get(kind, self.hidden_size)


@dataclasses.dataclass(frozen=True)
class ActDtypes:
    """Bytes per element of the residual stream (r) and of matmul inputs/outputs (c); ``casts``:
    autocast casts fp32 activations separately for every linear (and caches weight copies)."""

    r: int
    c: int
    casts: bool

    @classmethod
    def of(cls, policy: RolePolicy, *, sharded: bool = False) -> ActDtypes:
        p, c = nbytes(policy.param_dtype), nbytes(policy.compute_dtype)
        if sharded or not policy.autocast:
            # FSDP2 gathers parameters already cast to the compute dtype; no autocast: one dtype.
            return cls(r=c if sharded else p, c=c if sharded else p, casts=False)
        return cls(r=max(p, c), c=c, casts=p != c)


GQA_SDPA_MAX_HEAD_DIM = 256
"""transformers' ``use_gqa_in_sdpa`` (integrations/sdpa_attention.py, the same rule in 5.17 and 5.24
for CUDA and CPU): SDPA gets ``enable_gqa=True`` only when no attention mask is passed and the k/v
head dim is at most this; otherwise ``repeat_kv`` materialises k and v at the query width first."""


def attention_kernel(arch: Architecture, d: ActDtypes, *, padded: bool, device_type: str = "cuda") -> str:
    """Which SDPA path a training forward of HF's ``sdpa`` attention takes, as far as it decides
    what is saved for backward.

    ``fused``: a fused kernel over k/v at their own width (MHA, or GQA through ``enable_gqa``).
    ``expanded``: a fused kernel over k/v that ``repeat_kv`` expanded to the query width (GQA with
    an attention mask, or a head dim over 256). ``math``: torch's math kernel, which saves the
    attention probabilities (GQA, no mask, fp32 compute, on CUDA).

    Measured on CPU with saved-tensor hooks (tests/test_plan.py, 8 query / 2 kv heads, fp32, fp16 and
    bf16 autocast, bf16-pure, eager and compiled): without a mask k/v are saved at the kv width in
    every precision (CPU's flash kernel takes GQA in all dtypes); with one they are expanded. CUDA is
    modelled from torch's sdp_utils.cpp, not measured here: flash and cuDNN take GQA but only in
    fp16/bf16; memory-efficient attention (the fp32 kernel) rejects differing head counts up to at
    least torch 2.11 (the GPU machine's; pytorch#181528 reports fp32 ``enable_gqa`` on the math
    kernel there), so fp32 falls back to the math kernel. Its saved tensors were measured on CPU
    with ``sdpa_kernel(SDPBackend.MATH)`` (the same composite code on every device), eager and
    compiled alike. The math kernel's [B, H, T, T] scores in a no-grad forward are not modelled.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type {device_type!r}: the planner models cuda and cpu")
    if arch.num_kv_heads == arch.num_heads:
        return "fused"
    if padded or arch.head_dim > GQA_SDPA_MAX_HEAD_DIM:
        return "expanded"
    return "math" if device_type == "cuda" and d.c == 4 else "fused"


def attention_saved_bytes(
    arch: Architecture, d: ActDtypes, *, seq_len: int, padded: bool, device_type: str = "cuda"
) -> dict[str, int]:
    """Bytes per token SDPA saves for backward (eager and compiled layers alike): q, k, v, its
    output (which o_proj's input is a view of in eager) and, by kernel, the fp32 log-sum-exp and the
    mask converted to an additive bias (fused), or the attention probabilities (math)."""
    q, heads = arch.q_dim, arch.num_heads
    kernel = attention_kernel(arch, d, padded=padded, device_type=device_type)
    kv = arch.kv_dim if kernel == "fused" else q
    # SDPA's output is laid out [B, T, H, D] already, so the transpose + contiguous feeding o_proj
    # is a view of it, not a copy; the math kernel's matmul output is not saved, only that copy.
    out = {"attention_qkv": d.c * (q + 2 * kv), "attention_out": d.c * q}
    if kernel == "math":
        # softmax output [B, H, T, T] (the causal mask is added in place, not saved); no lse
        out["attention_probs"] = d.c * heads * seq_len
        return out
    out["attention_out"] += 4 * heads
    if padded:
        out["attention_mask"] = d.c * seq_len
    return out


def layer_saved_bytes(
    arch: Architecture, d: ActDtypes, *, seq_len: int, padded: bool, device_type: str = "cuda"
) -> dict[str, int]:
    """Bytes per token one decoder layer saves for backward, excluding the layer's input tensor
    when it is the fp32 residual itself (``r == 4``: it is the previous layer's output or the
    checkpoint boundary, counted there)."""
    h, i = arch.hidden_size, arch.intermediate_size
    norm_copy = 0 if d.r == 4 else 4 * h  # RMSNorm upcasts a non-fp32 input: the fp32 copy is saved
    normed = 4 * h if d.r == 4 else d.r * h
    return {
        "input_norm": norm_copy + normed + 4,  # + the fp32 rsqrt per token
        "qkv_inputs": 3 * d.c * h if d.casts else d.r * h,
        **attention_saved_bytes(arch, d, seq_len=seq_len, padded=padded, device_type=device_type),
        "post_attention_norm": 4 * h + normed + 4,  # the mid-layer residual is an internal tensor
        "mlp_inputs": 2 * d.c * h if d.casts else d.r * h,
        "mlp": 4 * d.c * i,
    }


def compiled_layer_saved_bytes(
    arch: Architecture, d: ActDtypes, *, seq_len: int, padded: bool, device_type: str = "cuda"
) -> int:
    """Bytes per token a ``torch.compile``-d decoder layer saves for backward, its input included
    (tests/test_selective_ckpt.py measures it against the saved-tensor hooks): three hidden-width
    tensors in the compute dtype (the normalised inputs and the mid-layer residual, as Inductor's
    partitioner picks them; not o_proj's input, measured with q wider than h), SDPA's tensors as in
    eager, three MLP-width tensors, the rotary cos/sin (r d), the two fp32 rsqrt and the input."""
    h, i = arch.hidden_size, arch.intermediate_size
    attention = sum(
        attention_saved_bytes(arch, d, seq_len=seq_len, padded=padded, device_type=device_type).values()
    )
    return 3 * d.c * h + attention + 3 * d.c * i + d.r * arch.head_dim + 8 + d.r * h


def backward_workspace_bytes(arch: Architecture, d: ActDtypes) -> int:
    """Per token, gradients alive inside one layer's backward: the residual gradient in and out,
    and two MLP-width gradients (grad of the product, then of SiLU's output and up's output)."""
    return 2 * d.r * arch.hidden_size + 2 * d.c * arch.intermediate_size


def inference_workspace_bytes(arch: Architecture, d: ActDtypes, seq_len: int, padded: bool) -> int:
    """Per token, the widest point of a no-grad layer: residual in and out, the fp32 norm copies,
    and SiLU's output, up's output and their product alive together."""
    h, i = arch.hidden_size, arch.intermediate_size
    return 2 * d.r * h + 2 * 4 * h + 3 * d.c * i + (d.c * seq_len if padded else 0)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One moment of a step and what is alive then, bytes per GPU by component."""

    name: str
    components: Mapping[str, int]

    @property
    def total(self) -> int:
        return int(sum(self.components.values()))


def _add(parts: dict[str, int], name: str, value: float) -> None:
    if value:
        parts[name] = parts.get(name, 0) + int(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    """The batch one forward/backward sees on one GPU."""

    sequences: int
    """Sequences in one micro-batch (or one frozen forward)."""
    seq_len: int
    """Tokens per sequence (prompt + response)."""
    logit_positions: int
    """Positions per sequence that reach the LM head (``logits_to_keep``); 0 for a value model."""
    padded: bool = True
    """Whether an attention mask is materialised (padding present); False: causal SDPA, no mask."""

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logits:
    """How a training forward turns logits into the loss."""

    island: str = "chunked"
    """``chunked``: trainer.logprobs (keeps compute-dtype logits; flattening the sliced response
    positions copies them). ``hf-loss``: transformers' loss with labels (fp32 upcast, fp32
    log-softmax kept)."""
    entropy: bool = False
    """Entropy computed too (PPO/GRPO update): one more flattened copy and one more gradient."""
    chunk_elements: int = 1 << 26


def logits_bytes(shape: Shape, arch: Architecture, c: int, logits: Logits) -> tuple[int, int, int]:
    """(saved after forward, extra transient at the loss, transient at the top of backward)."""
    n = shape.sequences * shape.logit_positions * arch.vocab_size
    if n == 0:
        return 0, 0, 0
    chunk = min(n, logits.chunk_elements) * 4
    if logits.island == "hf-loss":
        # fp32 copy (transient) -> fp32 log-softmax (saved); the output object keeps the raw logits.
        return n * (c + 4), n * 4, n * (4 + c)
    copies = 1 + int(logits.entropy)
    sliced = n * (shape.logit_positions - 1) // max(shape.logit_positions, 1) if shape.sequences > 1 else 0
    # Forward: raw logits + each flattened copy (raw ones die when sequence_logprobs returns),
    # chunk upcasts (x, log-softmax, product). Backward: one grad per copy, the full-size grad of the
    # slice, and the chunk workspace.
    saved = copies * sliced if sliced else n
    return saved * c, n * c + 3 * chunk, (copies + 1) * n * c + 3 * chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainedModel:
    """A trainable role (actor or critic) as the planner sees it."""

    arch: Architecture
    kind: str
    policy: RolePolicy
    world_size: int = 1
    optimizer: str = "fused"
    """``fused`` AdamW (trainer/common.py on CUDA) or ``foreach`` (torch's default elsewhere)."""
    compiled: bool = False
    """Decoder layers run through ``torch.compile`` (``model.compile``)."""
    device_type: str = "cuda"
    """``cuda`` or ``cpu``: which SDPA kernel an unmasked fp32 GQA layer gets (`attention_kernel`)."""

    @property
    def n(self) -> int:
        return self.arch.params(self.kind)

    def state(self) -> dict[str, int]:
        """Parameters and AdamW moments per GPU."""
        w, p = self.world_size, self.policy
        return {
            "params": math.ceil(self.n * nbytes(p.param_dtype) / w),
            "optimizer moments": math.ceil(2 * self.n * nbytes(p.optim_state_dtype) / w),
        }

    def grads(self, params: int | None = None) -> int:
        n = self.n if params is None else params
        return math.ceil(n * nbytes(self.policy.grad_dtype) / self.world_size)


# long: one phase after another, each phase's components listed where they are sized
def train_phases(
    m: TrainedModel,
    shape: Shape,
    *,
    accumulation: bool,
    resident: Mapping[str, int],
    logits: Logits = Logits(),
    prefix: str = "actor",
) -> list[Phase]:
    """End of forward, top and bottom of backward, optimizer step of one training micro-batch.

    ``accumulation``: an earlier micro-batch already left full gradients. ``resident``: other
    roles' memory alive meanwhile (frozen models, the rollout batch).
    """
    arch, pol, t, w = m.arch, m.policy, shape.tokens, m.world_size
    sharded = w > 1
    d = ActDtypes.of(pol, sharded=sharded)
    # selective checkpointing: the first n_ckpt layers keep only their input, the rest keep activations
    n_ckpt = (
        (arch.num_layers if pol.checkpoint_layers is None else min(pol.checkpoint_layers, arch.num_layers))
        if pol.grad_checkpointing
        else 0
    )
    n_keep = arch.num_layers - n_ckpt
    ckpt = n_ckpt > 0
    base = dict(resident)
    for k, v in m.state().items():
        _add(base, f"{prefix} {k}", v)
    g_full = m.grads()
    sdpa = dict(seq_len=shape.seq_len, padded=shape.padded, device_type=m.device_type)
    layer = sum(layer_saved_bytes(arch, d, **sdpa).values())
    x_in = d.r * arch.hidden_size  # a layer's input: checkpoint boundary, or saved by RMSNorm when fp32
    saved_layer = layer + (x_in if d.r == 4 else 0)
    if m.compiled:
        saved_layer = compiled_layer_saved_bytes(arch, d, **sdpa)
        layer = saved_layer - x_in  # a recomputed layer: its input is the checkpoint boundary
    h_norm = 4 * arch.hidden_size + (4 if d.r == 4 else d.r) * arch.hidden_size  # final RMSNorm
    head_in = (d.c if d.casts else d.r) * arch.hidden_size * shape.sequences * shape.logit_positions
    lg_saved, lg_fwd, lg_bwd = logits_bytes(shape, arch, d.c, logits)
    copies = d.c * m.arch.matmul_params(m.kind) if d.casts else 0
    layer_copies = d.c * arch.layer_matmul_params if d.casts else 0
    head_copy = copies - arch.num_layers * layer_copies
    gathered = 2 * arch.layer_params * d.c if sharded else 0  # current + prefetched layer
    grad_g = arch.layer_params * (d.c + nbytes(pol.reduce_dtype)) if sharded else 0

    def around_backward_start(weight_copies: int, logit_bytes: int) -> dict[str, int]:
        """End of forward and top of backward hold the same things but for the weight copies and
        the log-prob island's transient."""
        parts = dict(base)
        _add(parts, f"{prefix} grads (earlier micro-batches)", g_full if accumulation else 0)
        _add(parts, f"{prefix} autocast weight copies", weight_copies)
        _add(parts, f"{prefix} FSDP gathered layers", gathered)
        _add(parts, f"{prefix} checkpoint boundaries", n_ckpt * x_in * t)
        _add(parts, f"{prefix} activations", n_keep * saved_layer * t)
        _add(parts, f"{prefix} final norm + head input", h_norm * t + head_in)
        _add(parts, f"{prefix} logits + log-prob island", logit_bytes)
        return parts

    kept_copies = head_copy + n_keep * layer_copies
    # Autocast's weight cache holds every copy until autocast exits, then only the copies a kept
    # layer saved for backward remain; compiled layers cast inside their graph (no cache), so only
    # kept layers hold copies past their own forward.
    fwd = around_backward_start(kept_copies if m.compiled else copies, lg_saved + lg_fwd)
    top = around_backward_start(kept_copies, lg_saved + lg_bwd)

    bottom = dict(base)
    pending = m.arch.embed_params + arch.layer_params  # layer 0 and embedding grads not yet written
    _add(bottom, f"{prefix} grads", g_full if accumulation else g_full - m.grads(pending))
    _add(bottom, f"{prefix} autocast weight copies", layer_copies)  # the recomputed / saved layer's
    _add(bottom, f"{prefix} FSDP gathered layers", gathered + grad_g)
    if ckpt:
        _add(bottom, f"{prefix} checkpoint boundary + recomputed layer", (x_in + layer) * t)
    else:
        _add(bottom, f"{prefix} activations", saved_layer * t)
    _add(bottom, f"{prefix} backward workspace", backward_workspace_bytes(arch, d) * t)
    if d.casts:  # the low-precision weight grad before its cast to the master dtype
        _add(bottom, f"{prefix} backward workspace", d.c * arch.hidden_size * arch.intermediate_size)

    step = dict(base)
    _add(step, f"{prefix} grads", g_full)
    if m.optimizer == "foreach":
        _add(step, f"{prefix} optimizer temporaries (foreach sqrt)", m.state()["optimizer moments"] // 2)
    return [
        Phase(f"{prefix}_update: end of forward", fwd),
        Phase(f"{prefix}_update: top of backward", top),
        Phase(f"{prefix}_update: bottom of backward", bottom),
        Phase(f"{prefix}_update: optimizer step", step),
    ]


def frozen_forward_phase(
    name: str,
    arch: Architecture,
    kind: str,
    policy: RolePolicy,
    shape: Shape,
    *,
    resident: Mapping[str, int],
    params_resident: bool,
    world_size: int = 1,
) -> Phase:
    """A no-grad forward (reference/old log-probs, values, reward scores) on top of ``resident``.

    ``params_resident``: the model's parameters are already in ``resident`` (the actor's own
    old-log-prob pass); otherwise they are counted here.
    """
    d = ActDtypes.of(policy, sharded=world_size > 1)
    parts = dict(resident)
    if not params_resident:
        _add(parts, f"{name} params", math.ceil(arch.params(kind) * nbytes(policy.param_dtype) / world_size))
    # no_grad (not inference_mode) still fills autocast's weight cache.
    _add(parts, f"{name} autocast weight copies", d.c * arch.matmul_params(kind) if d.casts else 0)
    _add(parts, f"{name} FSDP gathered layers", 2 * arch.layer_params * d.c if world_size > 1 else 0)
    t = shape.tokens
    _add(
        parts, f"{name} layer workspace", inference_workspace_bytes(arch, d, shape.seq_len, shape.padded) * t
    )
    n_logits = shape.sequences * shape.logit_positions * arch.vocab_size
    # raw logits + their flattened response copy + the fp32 chunk workspace
    _add(parts, f"{name} logits + log-prob island", 2 * n_logits * d.c + 3 * min(n_logits, 1 << 26) * 4)
    return Phase(f"{name}: forward", parts)


def fused_snapshot_bytes(
    arch: Architecture, d: ActDtypes, *, sharded: bool = False, param_bytes: int = 0
) -> int:
    """What `trainer.fused_decode.FusedWeights` holds beyond the model: the concatenated q/k/v and
    gate/up weights (and biases) in the rollout dtype; when the weights are stored in another dtype,
    every other weight of the layers, the final norm and the LM head cast as well (the embedding is
    gathered, then cast, so it is never copied). ``sharded`` (FSDP2): every rank gathers the whole
    model, so all of it is held, the embedding table in its stored dtype (``param_bytes``)."""
    h, i = arch.hidden_size, arch.intermediate_size
    qkv = h * (arch.q_dim + 2 * arch.kv_dim) + (arch.q_dim + 2 * arch.kv_dim if arch.qkv_bias else 0)
    gate_up = 2 * h * i + (2 * i if arch.mlp_bias else 0)
    elems = arch.num_layers * (qkv + gate_up)
    if sharded:
        head = arch.vocab_size * h
        return d.c * (arch.num_layers * arch.layer_params + h + head) + param_bytes * arch.embed_params
    if d.casts:
        rest = arch.layer_params - qkv - gate_up
        elems += arch.num_layers * rest + h + arch.vocab_size * h
    return d.c * elems


def generate_phase(
    arch: Architecture,
    policy: RolePolicy,
    *,
    sequences: int,
    prompt_len: int,
    new_tokens: int,
    resident: Mapping[str, int],
    world_size: int = 1,
    scores_kept: bool = False,
    fused: bool = False,
) -> Phase:
    """HF ``generate`` with a dynamic KV cache, the actor's parameters already in ``resident``; with
    ``fused`` (``rollout.engine: fused``) our decode forward over a snapshot of the weights in the rollout
    dtype instead of autocast's per-forward weight copies (`fused_snapshot_bytes`)."""
    d = ActDtypes.of(policy, sharded=world_size > 1)
    parts = dict(resident)
    total = prompt_len + new_tokens
    kv_layer = 2 * sequences * total * arch.kv_dim * d.c
    if fused:
        snapshot = fused_snapshot_bytes(
            arch, d, sharded=world_size > 1, param_bytes=nbytes(policy.param_dtype)
        )
        _add(parts, "rollout fused weight snapshot", snapshot)
    else:
        _add(parts, "rollout autocast weight copies", d.c * arch.matmul_params("causal_lm") if d.casts else 0)
        _add(parts, "rollout FSDP gathered layers", 2 * arch.layer_params * d.c if world_size > 1 else 0)
    # DynamicCache grows by torch.cat: the layer being extended exists twice for a moment.
    _add(parts, "rollout KV cache", kv_layer * (arch.num_layers + 1))
    prefill = sequences * prompt_len
    _add(parts, "rollout prefill workspace", inference_workspace_bytes(arch, d, prompt_len, True) * prefill)
    _add(parts, "rollout sampling logits (fp32)", 3 * sequences * arch.vocab_size * 4)
    if scores_kept:
        _add(parts, "rollout kept scores (fp32)", new_tokens * sequences * arch.vocab_size * 4)
    return Phase("rollout: generate", parts)


def shadow_bytes(arch: Architecture, *, seq_len: int, rows: int, param_bytes: int) -> dict[str, int]:
    """What the fp32 shadow (`verlaudit.audit.shadow`) adds to a shadowed training step, by part: at
    a block's backward, its fp32 copy and the fp32 and own-precision parameter gradients of the
    largest block with a backward (a decoder layer or the head); the fp32 chain input of every layer
    on ``rows`` rows; one layer's fp32 activations on those rows (norms, q/k/v, MLP); the head's fp32
    logits on those rows, with the log-softmaxes of the log-prob error. Counted on top of the step's
    peak (conservative: its backward peak and the model's are not always the same moment)."""
    block = max(arch.layer_params, arch.lm_head_params or arch.embed_params)
    tokens = rows * seq_len
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "shadow: block copy + param grads": block * (4 + 4 + param_bytes),
        "shadow: chain inputs": arch.num_layers * tokens * h * 4,
        "shadow: one layer's fp32 activations": tokens * (10 * h + 4 * i) * 4,
        "shadow: fp32 logits": 4 * tokens * arch.vocab_size * 4,
    }


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Every phase of a step and the peak among them, per GPU."""

    phases: tuple[Phase, ...]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    def allocator_bytes(self) -> int:
        """What the caching allocator must hold: its reserve on the allocated peak. A memory cap set
        with ``torch.cuda.set_per_process_memory_fraction`` (target emulation) limits this alone."""
        return int(self.peak_bytes * (1 + FRAGMENTATION))

    def device_bytes(self) -> int:
        """What the device must hold: allocator reserve on the allocated peak, plus the context."""
        return self.allocator_bytes() + CONTEXT_BYTES

    def need_bytes(self, *, allocator_cap: bool) -> int:
        """What must fit a capacity: `allocator_bytes` against an allocator cap (the CUDA context
        lives outside it), `device_bytes` against a whole device."""
        return self.allocator_bytes() if allocator_cap else self.device_bytes()

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_phase": self.peak.name,
            "peak_allocated_gib": self.peak_bytes / GIB,
            "device_needed_gib": self.device_bytes() / GIB,
            "components_gib": {k: v / GIB for k, v in self.peak.components.items()},
            "phases_gib": {p.name: p.total / GIB for p in self.phases},
        }
