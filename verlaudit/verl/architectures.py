"""Known model names -> their architecture, for a verl job whose weights are not on this machine.

verl scripts name a model by hub id or local path (``Qwen/Qwen2.5-0.5B-Instruct``,
``$HOME/models/Llama-2-7b-hf``). When that is not a local directory, ``from-verl`` builds the same
shape with random weights (enough for memory, speed and numerics in each precision): a model preset
of `trainer.models` with the ``model.overrides`` below (LlamaConfig fields). Nothing is downloaded.
Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_QWEN_NOTE = (
    "Qwen2's q/k/v projection biases are left out (LlamaConfig can only add a bias to o_proj as well); "
    "the rest of the shape is Qwen2's"
)
_LLAMA3_NOTE = "Llama-3.1's rope scaling is left out (sequences here are far shorter than 8192)"


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    preset: str
    """`trainer.models.PRESETS` key the overrides start from."""
    overrides: Mapping[str, Any]
    note: str = ""


def _qwen2(
    name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool
) -> Architecture:
    return Architecture(name, "llama2-7b", {
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
    }, _QWEN_NOTE)  # fmt: skip


_LLAMA3 = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # fmt: skip

_TABLE = (
    (("Qwen2.5-0.5B", "Qwen2.5-0.5B-Instruct", "Qwen2-0.5B", "Qwen2-0.5B-Instruct"),
     _qwen2("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True)),
    (("Qwen2.5-1.5B", "Qwen2.5-1.5B-Instruct", "Qwen2-1.5B", "Qwen2-1.5B-Instruct"),
     _qwen2("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True)),
    (("Qwen2.5-3B", "Qwen2.5-3B-Instruct"), _qwen2("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True)),
    (("Qwen2.5-7B", "Qwen2.5-7B-Instruct", "Qwen2-7B", "Qwen2-7B-Instruct"),
     _qwen2("Qwen2-7B", 3584, 18944, 28, 28, 4, 152064, False)),
    (("Llama-2-7b", "Llama-2-7b-hf", "Llama-2-7b-chat-hf", "Llama-2-7b-chat"),
     Architecture("Llama-2-7B", "llama2-7b", {})),
    (("Meta-Llama-3-8B", "Meta-Llama-3-8B-Instruct", "Llama-3.1-8B", "Llama-3.1-8B-Instruct",
      "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct"), Architecture("Llama-3-8B", "llama2-7b", _LLAMA3, _LLAMA3_NOTE)),
    (("deepseek-llm-7b-chat", "deepseek-llm-7b-base"),
     Architecture("deepseek-llm-7b", "llama2-7b", {"num_hidden_layers": 30, "vocab_size": 102400,
                                                    "rms_norm_eps": 1e-6})),
)  # fmt: skip

KNOWN: dict[str, Architecture] = {alias.lower(): arch for aliases, arch in _TABLE for alias in aliases}
"""Lower-cased model name (the last path component) -> its architecture."""


def lookup(model: str) -> Architecture | None:
    """The architecture of ``model`` (a hub id or a path: its last component is matched, any case)."""
    return KNOWN.get(model.rstrip("/").rsplit("/", 1)[-1].lower())
