"""The rollout engine the ``rollout`` options ask for: our engines (`trainer.rollout`) or vLLM's
(`trainer.vllm_engine`), which itself builds on `trainer.rollout`, hence this module of its own.
Exercised by `pytest tests/test_rollout_fast.py -k build_engine` and `tests/test_vllm_engine.py`.
"""

from __future__ import annotations

import torch

from trainer.config import resolve_engine
from trainer.precision import RolePolicy
from trainer.rollout import HFGenerateEngine, StaticDecodeEngine


def build_engine(
    model: torch.nn.Module,
    tokenizer,
    policy: RolePolicy,
    *,
    device: str | torch.device,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    engine: str = "hf",
    cuda_graphs: bool = False,
    compile: bool = False,
    vllm: dict | None = None,
):
    """The rollout engine the ``rollout`` options ask for: ``rollout.engine``, ``rollout.cuda_graphs``,
    ``rollout.compile``; ``vllm`` holds
    `trainer.vllm_engine.VLLMEngine`'s own keyword arguments (KV-cache size, model length, probe)."""
    name = resolve_engine(engine, cuda_graphs=cuda_graphs, compile=compile)
    kwargs = dict(
        device=device, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p
    )
    if name == "hf":
        return HFGenerateEngine(model, tokenizer, policy, **kwargs)
    if name == "vllm":
        from trainer.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, policy, **kwargs, **(vllm or {}))
    return StaticDecodeEngine(
        model, tokenizer, policy, cuda_graphs=cuda_graphs, compile=compile, fused=name == "fused", **kwargs
    )
