"""Rollout: sample responses from the actor with Hugging Face ``generate`` in the rollout role's dtype.

The engine records, for every sampled token, its log-prob under the distribution it was actually
sampled from (after temperature, top-k and top-p), in fp32, one step at a time: ``output_scores``
would keep a [B, V] fp32 tensor per generated token (gigabytes for a 7B rollout batch). Temperature,
top-k and top-p are applied by our own logits processors placed last, followed by a recorder that
sees the final scores; HF's own warpers are switched off so nothing runs after the recorder.

`StaticDecodeEngine` is the fast path: our own decode loop over the same HF model with a
preallocated KV cache, sampling on device with the same ops in the same order as HF's sampler (same
seed, same logits -> same tokens); optionally the whole decode step (forward, sampling, bookkeeping)
captured once as a CUDA graph and replayed, and the single-token forward compiled by torch.compile
(prefill stays eager). `trainer.engines.build_engine` picks one from the ``rollout`` options
(vLLM's, `trainer.vllm_engine.VLLMEngine`, included).
Under several ranks (torchrun + FSDP2) both engines keep decoding until every rank's rows have
ended, since each forward all-gathers parameter shards with the other ranks -- except with
``rollout.engine: fused``, whose snapshot is gathered once per rollout, so its decode steps have no
collectives (and may be compiled and captured as CUDA graphs under FSDP2 too).
Exercised by `pytest tests/test_rollout.py tests/test_rollout_fast.py` and, on a GPU,
`python benchmarks/rollout_bench.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache, StaticLayer

from trainer import fused_decode
from trainer.logprobs import additive_mask, causal_mask_with_self, has_left_padding
from trainer.precision import RolePolicy, dtype_name


@dataclasses.dataclass
class Rollout:
    """One batch of sampled responses; every row is one (prompt, response)."""

    prompt_ids: torch.Tensor
    """Long[B, P], left-padded."""
    prompt_mask: torch.Tensor
    """Long[B, P]."""
    response_ids: torch.Tensor
    """Long[B, R], pad after the first eos; R is always the engine's ``max_new_tokens``."""
    response_mask: torch.Tensor
    """Long[B, R]: 1 up to and including the first eos."""
    logprobs: torch.Tensor
    """fp32[B, R]: log-prob of each sampled token under the sampling distribution (0 where masked)."""
    input_ids: torch.Tensor
    """Long[B, P+R]: prompt then response."""
    attention_mask: torch.Tensor
    """Long[B, P+R]: prompt mask then response mask."""
    left_padded: bool | None = None
    """Whether any row starts with padding (a left-padded prompt), read from the prompt mask once per
    rollout: the training forwards over its rows pass it on instead of reading each micro-batch's
    mask back from the device (`trainer.logprobs.attention_inputs`). None: not known."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Numbers the engine reports with this rollout (a weight sync's ``rollout/weight_sync_*``);
    the recipe merges them into the step's metrics."""

    def responses_text(self, tokenizer) -> list[str]:
        """Decoded responses, special tokens (eos) and padding dropped."""
        return [
            tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(self.response_ids, self.response_mask)
        ]


class _Temperature(LogitsProcessor):
    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores / self.temperature


class _TopK(LogitsProcessor):
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = min(self.k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        return scores.masked_fill(scores < kth, float("-inf"))


class _TopP(LogitsProcessor):
    """Nucleus sampling as HF's ``TopPLogitsWarper`` and vLLM's top-p do it: sort ascending, drop the
    tokens whose cumulative probability stays <= 1 - p, always keep the most probable one."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ordered, index = scores.sort(dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - self.p
        drop[..., -1] = False
        return scores.masked_fill(torch.zeros_like(drop).scatter(-1, index, drop), float("-inf"))


def sampling_processors(temperature: float, top_k: int, top_p: float) -> list[LogitsProcessor]:
    """What every engine applies to the fp32 logits before sampling, in HF's and vLLM's order."""
    out: list[LogitsProcessor] = []
    if temperature != 1.0:
        out.append(_Temperature(temperature))
    if top_k > 0:
        out.append(_TopK(top_k))
    if top_p < 1.0:
        out.append(_TopP(top_p))
    return out


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the config field for sampling options no engine can honour."""
    if temperature <= 0:
        raise ValueError(f"algo.temperature: must be > 0 for sampling, got {temperature}")
    if top_k < 0:
        raise ValueError(f"algo.top_k: must be >= 0 (0 disables), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"rollout.top_p: must be in (0, 1] (1 disables), got {top_p}")


class _LogprobRecorder(LogitsProcessor):
    """Runs last. At step t it sees the final scores of step t and, at the end of ``input_ids``, the
    token sampled at step t-1: it gathers that token's log-prob from step t-1's log-softmax and keeps
    only step t's log-softmax ([B, V] fp32, one step's worth)."""

    def __init__(self, prompt_width: int) -> None:
        self.prompt_width = prompt_width
        self.last: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []

    def _take(self, token: torch.Tensor) -> None:
        assert self.last is not None
        self.logprobs.append(self.last.gather(-1, token[:, None]).squeeze(-1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_width:
            self._take(input_ids[:, -1])
        self.last = scores.float().log_softmax(-1)
        return scores

    def finish(self, response: torch.Tensor) -> torch.Tensor:
        """fp32[B, n] log-probs of the n generated columns of ``response``."""
        n = response.shape[1]
        if len(self.logprobs) < n:
            self._take(response[:, len(self.logprobs)])
        self.last = None
        assert len(self.logprobs) >= n, (len(self.logprobs), n)
        if n == 0:
            return torch.zeros(response.shape[0], 0, device=response.device)
        return torch.stack(self.logprobs[:n], dim=1)


class HFGenerateEngine:
    """Samples with ``model.generate`` (KV cache on, dropout off), in the rollout role's compute dtype.

    When the rollout role computes in a lower precision than the weights are stored in (a bf16
    rollout of an fp32-master actor) generation runs under ``torch.autocast(compute_dtype)``, so the
    rollout really samples from bf16 matmuls, as a separate bf16 inference engine would.
    """

    name = "hf-generate"

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
    ) -> None:
        check_sampling(temperature, top_k, top_p)
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.device = torch.device(device)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        weights = next(model.parameters()).dtype
        if policy.autocast or policy.compute_dtype == weights:
            self.engine_dtype = policy.compute_dtype
            self.dtype_reason = policy.reasons.get("compute_dtype", "rollout policy")
            self._autocast = policy.autocast
        elif policy.compute_dtype in (torch.float16, torch.bfloat16):
            self.engine_dtype = policy.compute_dtype
            self.dtype_reason = (
                f"rollout computes in {dtype_name(policy.compute_dtype)} while the actor's weights are "
                f"{dtype_name(weights)}: generate under torch.autocast({dtype_name(policy.compute_dtype)})"
            )
            self._autocast = True
        else:
            # autocast cannot upcast: an fp32 rollout of low-precision weights computes in the weights' dtype
            self.engine_dtype = weights
            self.dtype_reason = (
                f"rollout asks for {dtype_name(policy.compute_dtype)} but the actor's weights are "
                f"{dtype_name(weights)} and autocast cannot upcast: generating in {dtype_name(weights)}"
            )
            self._autocast = False

    def facts(self) -> dict[str, Any]:
        """What sets the probabilities this engine records (``engine_facts`` of
        `trainer.events.Observer.on_rollout`): the dtypes of the weights it reads, of its matmuls, of its
        KV cache and of its log-softmax, and the sampling processing its log-probs include
        (``processed``: those of the distribution sampled from, after temperature, top-k and top-p)."""
        return {
            "weights_dtype": self._weights_dtype(),
            "compute_dtype": self.engine_dtype,
            # under autocast the k/v projections return the compute dtype, and the cache keeps what they return
            "kv_cache_dtype": self.engine_dtype,
            "logprob_dtype": torch.float32,  # the recorder's and the static loop's log_softmax of .float() scores
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "logprobs_mode": "processed",
        }

    def _weights_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def sync_weights(self) -> dict | None:
        """Nothing to push: this engine samples with the actor's own parameters. (vLLM's engine holds a
        copy and returns a record of the push, `trainer.vllm_engine.VLLMEngine.sync_weights`.)"""
        return None

    def _autocast_ctx(self) -> contextlib.AbstractContextManager:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.engine_dtype)

    def _rng(self, seed: int | None) -> contextlib.AbstractContextManager:
        if seed is None:
            return contextlib.nullcontext()
        devices = [self.device] if self.device.type == "cuda" else []
        ctx = torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda")

        @contextlib.contextmanager
        def seeded():
            with ctx:
                torch.manual_seed(seed)
                yield

        return seeded()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        num_samples: int = 1,
        generator_seed: int | None = None,
    ) -> Rollout:
        """Samples ``num_samples`` responses per prompt (rows repeat each prompt consecutively)."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        # one read per rollout, on the collator's CPU mask when that is what came in
        left_padded = has_left_padding(prompt_mask) if prompt_mask.numel() else False
        prompt_ids = prompt_ids.to(self.device).repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.to(self.device).repeat_interleave(num_samples, dim=0)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._rng(generator_seed):
                generated, logprobs = self._decode(prompt_ids, prompt_mask, pad, eos)
        finally:
            self.model.train(was_training)
        return _to_rollout(
            prompt_ids,
            prompt_mask,
            generated,
            logprobs,
            self.max_new_tokens,
            pad,
            eos,
            left_padded=left_padded,
        )

    def _decode(self, prompt_ids, prompt_mask, pad: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated columns [B, n] and their log-probs, through ``model.generate``."""
        recorder = _LogprobRecorder(prompt_ids.shape[1])
        processors = LogitsProcessorList(sampling_processors(self.temperature, self.top_k, self.top_p))
        processors.append(recorder)
        # A fresh config: nothing from the model's generation_config (repetition penalty, top_k=50 ...)
        # may change the sampling distribution behind the recorder's back.
        gen_cfg = GenerationConfig(
            do_sample=True,
            max_new_tokens=self.max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            use_cache=True,
            pad_token_id=pad,
            eos_token_id=eos,
            bos_token_id=self.tokenizer.bos_token_id,
        )
        with self._autocast_ctx():
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=gen_cfg,
                logits_processor=processors,
                # several ranks: a rank whose rows all ended keeps running dummy forwards, since
                # FSDP2's per-layer all-gathers need every rank in every forward
                synced_gpus=_several_ranks(),
            )
        sequences = out.sequences if hasattr(out, "sequences") else out
        generated = sequences[:, prompt_ids.shape[1] :]
        return generated, recorder.finish(generated)


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _any_rank(unfinished: torch.Tensor) -> bool:
    """Whether any row of any rank is still generating. Under several ranks every rank must run
    the same number of decode steps (each forward all-gathers FSDP2 shards), so the local flag is
    all-reduced (MAX) before a rank may stop."""
    flag = unfinished.any().to(torch.int32).reshape(1)
    if _several_ranks():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def _to_rollout(
    prompt_ids, prompt_mask, generated, logprobs, r: int, pad: int, eos: int, left_padded: bool | None = None
) -> Rollout:
    """Pads the generated columns to exactly ``r``, masks everything after the first eos."""
    b, n = generated.shape
    response = torch.full((b, r), pad, dtype=torch.long, device=generated.device)
    response[:, :n] = generated[:, :r]
    lp = torch.zeros((b, r), dtype=torch.float32, device=generated.device)
    lp[:, :n] = logprobs[:, :r].float()
    is_eos = response == eos
    # eos positions strictly before this one: the token is kept while none came earlier
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (eos_before == 0).long()
    mask[:, n:] = 0
    response = response.masked_fill(mask == 0, pad)
    lp = lp.masked_fill(mask == 0, 0.0)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response,
        response_mask=mask,
        logprobs=lp,
        input_ids=torch.cat([prompt_ids, response], dim=1),
        attention_mask=torch.cat([prompt_mask.long(), mask], dim=1),
        left_padded=left_padded,
    )


class _SlotLayer(StaticLayer):
    """One layer's preallocated K/V ``[B, H, P+R, D]``. ``update`` writes the new states at the cache
    slots the engine put in ``slots[0]`` (a device tensor), not at a position counted on the host, so
    a captured decode step writes wherever the replayed step's slot tensor points."""

    def __init__(self, max_cache_len: int, slots: list[torch.Tensor]) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self._slots = slots
        self._ready = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # *args/**kwargs: transformers passes cache_position/rotary kwargs here (the signature moved
        # between 5.17 and 5.24); the slot tensor already says where to write.
        if not self._ready:
            b, h, _, dk = key_states.shape
            self.keys = key_states.new_zeros((b, h, self.max_cache_len, dk))
            self.values = value_states.new_zeros((b, h, self.max_cache_len, value_states.shape[-1]))
            self.device = key_states.device
            self.is_initialized = self._ready = True
        self.keys.index_copy_(2, self._slots[0], key_states)
        self.values.index_copy_(2, self._slots[0], value_states)
        return self.keys, self.values


def _slot_cache(model: torch.nn.Module, max_len: int, slots: list[torch.Tensor]) -> Cache:
    n = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[_SlotLayer(max_len, slots) for _ in range(n)])


class StaticDecodeEngine(HFGenerateEngine):
    """Our own decode loop over the HF model: one eager prefill into a preallocated KV cache of
    ``prompt + max_new_tokens`` slots, then one single-token forward per new token, sampling on the
    device with HF's sampling ops in HF's order (``logits.float()``, temperature, top-k, top-p, ``softmax``,
    the draw of ``multinomial``, finished rows forced to pad). The model sees explicit position ids
    (HF's: attention-mask cumsum) and an explicit 4D mask, so its forward has no host-side shape or
    data-dependent branch.

    One decode step (``step`` in `_decode`) is the whole token: advance position and cache slot, forward,
    sample, write the token and its log-prob at a column index held on the device, update the
    unfinished rows. It reads and writes only static buffers, so with ``cuda_graphs`` it is captured
    once per call as a `torch.cuda.CUDAGraph` and the host loop only replays it (and checks "every row
    has ended" every `check_every` steps); without, the same step runs eagerly. With ``compile`` the
    single-token forward goes through ``torch.compile`` (Inductor fuses the norms, rotary, SiLU-mul and
    residual adds between the GEMMs), compiled once per process and shape, captured like the eager one.

    Same seed and same logits give the same tokens and log-probs as `HFGenerateEngine`; the logits
    themselves can differ in the last bits (attention reduces over the padded cache; compiled kernels
    reduce in another order), which is the only documented difference (`tests/test_rollout_fast.py`).
    """

    name = "static-decode"
    check_every = 8
    """Decode steps between host checks of "every row has ended" (each check is a device sync)."""

    def __init__(
        self,
        model,
        tokenizer,
        policy,
        *,
        cuda_graphs: bool = False,
        compile: bool = False,
        fused: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(model, tokenizer, policy, **kwargs)
        attn = getattr(model.config, "_attn_implementation", "eager")
        if fused:
            fused_decode.require_supported(model)  # at construction, not at the first rollout
        if attn not in ("sdpa", "eager") and not fused:
            raise ValueError(
                f"rollout.engine: static passes an explicit 4D attention mask, which {attn!r} attention does "
                "not take; set model.attn_implementation: sdpa (or rollout.engine: hf)"
            )
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(
                f"rollout.cuda_graphs: CUDA graphs need a CUDA device, the rollout runs on {self.device.type}; "
                "set rollout.cuda_graphs: false"
            )
        self.cuda_graphs = bool(cuda_graphs)
        self.compile = bool(compile)
        self.fused = bool(fused)
        self.name = (
            "static-decode"
            + ("+fused" if self.fused else "")
            + ("+compile" if self.compile else "")
            + ("+cuda-graphs" if self.cuda_graphs else "")
        )
        self._bool_mask = attn == "sdpa"
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed past_key_values -> cache (the old name still works, with a warning)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._pass_cache_position = "cache_position" in params
        self._pass_logits_to_keep = "logits_to_keep" in params
        # dynamic=False: one specialised graph per (batch, cache length); the prefill stays eager.
        # No Inductor cudagraphs (mode default): with cuda_graphs we capture the whole step ourselves.
        # The eager forward is an object of its own holding the model, not the bound method self._forward:
        # a bound method of this engine stored on it (or inside the compiled wrapper) makes engine ->
        # method -> engine a reference cycle, which kept a finished run's model allocated until the cycle
        # collector ran (25 GiB on the 7B H200 GRPO suite: benchmarks/release_check.py).
        self._slot_forward = _SlotForward(
            model,
            cache_kw=self._cache_kw,
            cache_position=self._pass_cache_position,
            logits_to_keep=self._pass_logits_to_keep,
            additive_mask_dtype=None if self._bool_mask else self.engine_dtype,
        )
        target = fused_decode.forward if self.fused else self._slot_forward
        self._decode_forward = (
            torch.compile(target, fullgraph=True, dynamic=False) if self.compile else target
        )

    def _weights_dtype(self) -> torch.dtype:
        # the fused forward reads a snapshot of the actor's weights cast to the rollout dtype
        return self.engine_dtype if self.fused else super()._weights_dtype()

    def _forward(self, ids, positions, mask, cache, slots) -> torch.Tensor:
        """Last-position logits of one forward that writes its K/V at ``slots``."""
        return self._slot_forward(ids, positions, mask, cache, slots)

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's ``_sample`` step: returns the sampled tokens and the log-softmax they were drawn from."""
        scores = logits.float()
        for processor in sampling_processors(self.temperature, self.top_k, self.top_p):
            scores = processor(None, scores)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        # This is torch.multinomial(probs, 1) op for op (its one-sample path: q ~ Exp(1) shaped like
        # probs from the same generator, then argmax(probs / q)), so the same seed draws the same
        # tokens as HF's sampler. multinomial itself first checks probs on the host (.item()), which a
        # CUDA graph cannot capture; `_decode` makes that check once at the end instead.
        q = torch.empty_like(probs).exponential_(1)
        return (probs / q).argmax(-1), scores.log_softmax(-1)

    def _write(self, st: dict[str, torch.Tensor], logits: torch.Tensor, pad: int, eos: int) -> None:
        """Samples from ``logits`` into column ``st["col"]`` and advances it; device ops only."""
        nxt, logsm = self._sample(logits)
        unfinished = st["unfinished"]
        nxt = nxt * unfinished + pad * (1 - unfinished)  # rows that have ended get pad, as in HF
        st["tokens"].index_copy_(1, st["col"], nxt[:, None])
        st["logprobs"].index_copy_(1, st["col"], logsm.gather(-1, nxt[:, None]))
        unfinished.mul_((nxt != eos).long())
        st["tok"].copy_(nxt[:, None])
        st["col"].add_(1)

    def _capture(self, step) -> torch.cuda.CUDAGraph:
        """Captures ``step`` (which reads and advances only the static buffers). CUDA graphs need a
        warm-up run on a side stream; it is the first decode step itself (compiling it when
        ``compile``), so the first replay is the second step. Random draws inside the graph take their
        philox offset from the default generator at each replay, so replay k draws what the k-th eager
        step would have drawn."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except RuntimeError as e:
            raise RuntimeError(
                f"rollout.cuda_graphs: capturing the decode step of {type(self.model).__name__} failed ({e}); "
                "set rollout.cuda_graphs: false"
            ) from e
        return graph

    def _any_row(self, unfinished: torch.Tensor) -> bool:
        # the fused forward runs on a gathered snapshot, without collectives: each rank may stop alone
        return bool(unfinished.any()) if self.fused else _any_rank(unfinished)

    def _step_autocast(self) -> contextlib.AbstractContextManager:
        # autocast's weight-cast cache does not survive capture: cast inside the step on every run
        # (eagerly too: each step enters its own autocast, so the cache never outlived a step anyway)
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.engine_dtype, cache_enabled=False)

    def _prefill(self, prompt_ids, prompt_mask, backend) -> tuple[torch.Tensor, dict]:
        """The prompt's forward into the cache; returns its last logits and the decode step's static
        buffers, positioned just before the first decode step."""
        b, p = prompt_ids.shape
        r, dev = self.max_new_tokens, self.device
        # valid[b, j]: cache slot j holds a real token of row b (prompt padding never does)
        valid = torch.cat([prompt_mask.bool(), torch.zeros(b, r, dtype=torch.bool, device=dev)], dim=1)
        # HF's position ids: attention-mask cumsum, 0 on padding; new tokens continue from the last one
        positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        logits = backend.prefill(prompt_ids, positions, causal_mask_with_self(valid, p))
        st = {
            "tok": torch.zeros(b, 1, dtype=torch.long, device=dev),  # the token the next step feeds
            "pos": positions[:, -1:].clone(),  # position and cache slot of the last token fed
            "slot": torch.full((1,), p - 1, dtype=torch.long, device=dev),
            "col": torch.zeros(1, dtype=torch.long, device=dev),  # response column written next
            "valid": valid,
            "tokens": torch.full((b, r), self.tokenizer.pad_token_id, dtype=torch.long, device=dev),
            "logprobs": torch.zeros(b, r, dtype=torch.float32, device=dev),
            "unfinished": torch.ones(b, dtype=torch.long, device=dev),
        }
        return logits, st

    def _decode(self, prompt_ids, prompt_mask, pad: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
        (b, p), r = prompt_ids.shape, self.max_new_tokens
        backend = (_FusedForward if self.fused else _HFForward)(self, b, p, r)
        logits, st = self._prefill(prompt_ids, prompt_mask, backend)
        self._write(st, logits, pad, eos)  # column 0 from the prefill's logits

        def step() -> None:
            st["pos"].add_(1)
            st["slot"].add_(1)
            st["valid"].index_fill_(1, st["slot"], True)
            logits = backend.decode(self._decode_forward, st["tok"], st["pos"], st["valid"], st["slot"])
            self._write(st, logits, pad, eos)

        n = self._decode_loop(step, st, r)
        backend = None  # the cache (and a fused snapshot) go with the call
        tokens, logprobs = st["tokens"][:, :n], st["logprobs"][:, :n]
        if bool(torch.isnan(logprobs).any()):
            # what torch.multinomial's own check would have raised (verlaudit's diagnose matches it)
            raise RuntimeError(
                "probability tensor contains either `inf`, `nan` or element < 0 (rollout: non-finite logits "
                "in the static decode loop)"
            )
        return tokens, logprobs

    def _decode_loop(self, step, st: dict[str, torch.Tensor], r: int) -> int:
        """Decode steps 1 .. r-1: eagerly, or the first one captured as a CUDA graph (its warm-up runs
        the step) and the rest replayed. Returns the columns written: fewer than ``r`` when every row
        (of every rank) ended early, checked every `check_every` steps."""
        graph = None
        for t in range(1, r):
            if not self.cuda_graphs:
                step()
            elif graph is None:
                graph = self._capture(step)  # runs step t = 1 (the warm-up) and records it
            else:
                graph.replay()
            if t == 1:
                self._decode_ready(graph.replay if graph is not None else step, st)
            if (t + 1) % self.check_every == 0 and t + 1 < r and not self._any_row(st["unfinished"]):
                return t + 1  # HF's generate stops here too
        return r

    def _decode_ready(self, replay, state: dict[str, torch.Tensor]) -> None:
        """Called once per `generate`, after the first decode step; nothing here. A subclass may run
        ``replay()`` (one more decode step: the graph's replay, or the eager step) provided it restores
        ``state``, the static buffers the step advances (benchmarks/rollout_bench.py times steps so)."""


class _SlotForward:
    """The HF model's last-position logits of one forward that writes its K/V at ``slots`` (explicit
    position ids and 4D mask; the keyword names this transformers version takes)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cache_kw: str,
        cache_position: bool,
        logits_to_keep: bool,
        additive_mask_dtype: torch.dtype | None,
    ) -> None:
        self.model = model
        self.cache_kw = cache_kw
        self.cache_position = cache_position
        self.logits_to_keep = logits_to_keep
        self.additive_mask_dtype = additive_mask_dtype
        """None: sdpa takes the boolean mask; else eager attention adds the mask, in this dtype, to the scores."""

    def __call__(self, ids, positions, mask, cache, slots) -> torch.Tensor:
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if self.cache_position:
            kwargs["cache_position"] = slots
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if self.additive_mask_dtype is not None:
            mask = additive_mask(mask, self.additive_mask_dtype)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
        return out.logits[:, -1]


class _HFForward:
    """The HF model's own forward over `_SlotLayer` caches (in the engine's autocast, if any)."""

    def __init__(self, engine: StaticDecodeEngine, rows: int, prompt: int, new: int) -> None:
        self.engine = engine
        self.slots = [torch.arange(prompt, device=engine.device)]
        self.cache = _slot_cache(engine.model, prompt + new, self.slots)

    def prefill(self, ids, positions, mask) -> torch.Tensor:
        with self.engine._autocast_ctx():
            return self.engine._forward(ids, positions, mask, self.cache, self.slots[0])

    def decode(self, forward, tok, pos, valid, slot) -> torch.Tensor:
        self.slots[0] = slot
        with self.engine._step_autocast():
            return forward(tok, pos, valid[:, None, None, :], self.cache, slot)


class _FusedForward:
    """`trainer.fused_decode`'s forward over a snapshot of the actor's weights in the rollout dtype,
    taken when the rollout starts (so no autocast: the weights are already cast)."""

    def __init__(self, engine: StaticDecodeEngine, rows: int, prompt: int, new: int) -> None:
        self.weights = fused_decode.FusedWeights(engine.model, engine.engine_dtype)
        self.cos, self.sin = self.weights.rotary_table(prompt + new, engine.device)
        self.cache = self.weights.new_cache(rows, prompt + new, engine.device)
        self.prompt_slots = torch.arange(prompt, device=engine.device)

    def prefill(self, ids, positions, mask) -> torch.Tensor:
        w = self.weights
        return fused_decode.forward(
            w.shape, ids, self.cos, self.sin, positions, mask, self.prompt_slots, self.cache, *w.args()
        )

    def decode(self, forward, tok, pos, valid, slot) -> torch.Tensor:
        w = self.weights
        return forward(w.shape, tok, self.cos, self.sin, pos, valid, slot, self.cache, *w.args())
