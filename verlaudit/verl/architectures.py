"""Known model names -> their architecture, for a verl job whose weights are not on this machine.

verl scripts name a model by hub id or local path (``Qwen/Qwen2.5-0.5B-Instruct``,
``$HOME/models/Llama-2-7b-hf``). When that is not a local directory, ``from-verl`` builds the same
shape with random weights (enough for memory, speed and numerics in each precision): a model preset
of `trainer.models` (``llama2-7b``: LlamaConfig; ``qwen2-7b``: Qwen2Config, with Qwen2's q/k/v biases)
with the ``model.overrides`` below. Nothing is downloaded. Exercised by `pytest tests/test_from_verl.py`.

Every value is the model's published config.json, read from copies vendored in public repositories:
  Qwen2.5-0.5B-Instruct   infinityarpan/qwen-25-api models/Qwen2.5-0.5B-Instruct/config.json
  Qwen2-0.5B              rwth-i6/i6_experiments users/juanola/experiments/e25_11_13_ctc/configurations/
                          qwen2/qwen2_configs.py (max_position_embeddings 131072 there)
  Qwen2.5-1.5B-Instruct   ilyassLambardi/Bilingual-Voice-Ai-Application- models/Qwen2.5-1.5B-Instruct/config.json
  Qwen2.5-3B, Qwen2.5-7B, citsjtu2020/LLM-Prof sglang/Model_Config.md (Qwen2.5-7B base: max_position_embeddings
  Llama-3.1-8B            131072)
  Qwen2.5-7B-Instruct     volcengine/verl tests/utils/test_flops_counter.py (the shape and vocabulary)
  Qwen2-7B-Instruct       Retruth/deontic nlp_models/qwen2/README.md (the printed Qwen2Config, and the modules:
                          q/k/v Linear with bias, o_proj without)
  Llama-2-7b-hf           HPMLL/llm-benchmark models/Llama-2-7b-hf/config.json; the chat model's rms_norm_eps
                          1e-5 also in microsoft/Olive examples/llm/config.py
  Meta-Llama-3-8B-Instruct  ahmedghosaini/crag-meta models/Meta-Llama-3-8B-Instruct/config.json
  deepseek-llm-7b-chat    the LlamaConfig a verl GRPO run on deepseek-ai/deepseek-llm-7b-chat prints
                          ("Model config after override"): 30 layers, vocab 102400, rms_norm_eps 1e-6
A base model and its instruct release share the shape (the one is fine-tuned from the other); where
their max_position_embeddings differ, the instruct release's is used: it sets no weight (the rotary
table is computed for the sequence at hand).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


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
    """A Qwen2 / Qwen2.5 shape on the ``qwen2-7b`` preset (rope_theta 1e6 and rms_norm_eps 1e-6 are
    the preset's, as in every Qwen2 and Qwen2.5 release listed here)."""
    return Architecture(
        name,
        "qwen2-7b",
        {
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": vocab,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": tie,
        },
    )


_LLAMA3 = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # fmt: skip
_LLAMA31 = {**_LLAMA3, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}  # fmt: skip

_TABLE = (
    (("Qwen2.5-0.5B", "Qwen2.5-0.5B-Instruct", "Qwen2-0.5B", "Qwen2-0.5B-Instruct"),
     _qwen2("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True)),
    (("Qwen2.5-1.5B", "Qwen2.5-1.5B-Instruct"), _qwen2("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True)),
    (("Qwen2.5-3B", "Qwen2.5-3B-Instruct"), _qwen2("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True)),
    (("Qwen2.5-7B", "Qwen2.5-7B-Instruct", "Qwen2-7B", "Qwen2-7B-Instruct"),
     _qwen2("Qwen2-7B", 3584, 18944, 28, 28, 4, 152064, False)),
    (("Llama-2-7b", "Llama-2-7b-hf", "Llama-2-7b-chat-hf", "Llama-2-7b-chat"),
     Architecture("Llama-2-7B", "llama2-7b", {"rms_norm_eps": 1e-5})),
    (("Meta-Llama-3-8B", "Meta-Llama-3-8B-Instruct"), Architecture("Llama-3-8B", "llama2-7b", _LLAMA3)),
    (("Llama-3.1-8B", "Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct"),
     Architecture("Llama-3.1-8B", "llama2-7b", _LLAMA31)),
    (("deepseek-llm-7b-chat", "deepseek-llm-7b-base"),
     Architecture("deepseek-llm-7b", "llama2-7b", {"num_hidden_layers": 30, "vocab_size": 102400,
                                                    "rms_norm_eps": 1e-6})),
)  # fmt: skip

KNOWN: dict[str, Architecture] = {alias.lower(): arch for aliases, arch in _TABLE for alias in aliases}
"""Lower-cased model name (the last path component) -> its architecture."""


def lookup(model: str) -> Architecture | None:
    """The architecture of ``model`` (a hub id or a path: its last component is matched, any case)."""
    return KNOWN.get(model.rstrip("/").rsplit("/", 1)[-1].lower())
