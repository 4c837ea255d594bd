"""The model part a message names (logs12 branch, issue 25): a module or parameter path such as
``model.vision_tower.post_layernorm.weight`` or ``model.layers.3.mlp.gate_proj`` in an error line or the lines that
continue it (a state-dict size mismatch, "The above error occurred in module ..."), kept as ``module_path`` hits for
the culprit of a dtype error and of an unrecognised failure. A library's own dotted names (``torch.nn.functional``,
``transformers.models.x.configuration_x``) are not model parts. Exercised by ``pytest tests/test_log_families12.py -k
model_part``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts


def detect(line: LogLine) -> list[Hit]:
    text = line.text
    if _PART_HINTS(text) and (mp := _MODULE_PATH.search(text)) and _is_module_path(mp[1]):
        return [Hit("module_path", line, {"path": mp[1]})]
    return []


# a model's module or parameter path a message names (`model.vision_tower.post_layernorm.weight`,
# `model.layers.3.mlp.gate_proj`): dotted, three parts or more, with a layer index, a parameter leaf or a model part
_MODULE_PATH = re.compile(r"(?<![\w./])([A-Za-z_]\w*\.(?:(?:[A-Za-z_]\w*|\d+)\.)+[A-Za-z_0-9]\w*)(?![\w(/])")
_MODEL_PART = re.compile(
    r"\.\d+\.|\.(?:weight|bias)$|(?:^|\.)(?:model|layers?|blocks?|encoder|decoder|vision_tower|vision_model|visual|"
    r"language_model|lm_head|embed_tokens|mlp|self_attn|attn|experts|projector|\w+_proj|\w*norm\w*)(?:\.|$)"
)
_NOT_MODULE = frozenset({"torch", "transformers", "vllm", "sglang", "trl", "verl", "deepspeed", "accelerate", "ray",
                         "numpy", "np", "os", "sys", "peft", "megatron", "nemo_rl", "openrlhf", "self", "cls"})  # fmt: skip


_PART_HINTS = hints(
    "model.",
    "layers.",
    "layer.",
    "blocks.",
    "encoder.",
    "decoder.",
    "vision",
    "visual.",
    "lm_head",
    "embed_tokens",
    "mlp.",
    "attn.",
    "experts.",
    "projector",
    "_proj",
    "norm.",
    ".weight",
    ".bias",
)


def with_part(where: str | None, facts: LogFacts, no: int) -> str | None:
    """``where`` with the model part a line next to the error names (`module_path`), if it does not already."""
    part = next((h.fields["path"] for h in facts.of("module_path") if abs(h.no - no) <= 4), None)
    if part is None or part in (where or ""):
        return where
    return f"{part} / {where}" if where else part


def _is_module_path(path: str) -> bool:
    head = path.split(".", 1)[0]
    return (
        head not in _NOT_MODULE
        and not re.search(r"configuration_|modeling_|\.py$|\.(?:json|yaml|so|com|org|io)$", path)
        and bool(_MODEL_PART.search(path))
    )
