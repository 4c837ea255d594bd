"""Rollout: sample responses from the actor with Hugging Face ``generate`` in the rollout role's dtype.

The engine records, for every sampled token, its log-prob under the distribution it was actually
sampled from (after temperature and top-k), in fp32, one step at a time: ``output_scores`` would keep
a [B, V] fp32 tensor per generated token (gigabytes for a 7B rollout batch). Temperature and top-k
are applied by our own logits processors placed last, followed by a recorder that sees the final
scores; HF's own warpers are switched off so nothing runs after the recorder.
Exercised by `pytest tests/test_rollout.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

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
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"algo.temperature: must be > 0 for sampling, got {temperature}")
        if top_k < 0:
            raise ValueError(f"algo.top_k: must be >= 0 (0 disables), got {top_k}")
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.device = torch.device(device)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_k = int(top_k)
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
        tok = self.tokenizer
        pad, eos = tok.pad_token_id, tok.eos_token_id
        prompt_ids = prompt_ids.to(self.device).repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.to(self.device).repeat_interleave(num_samples, dim=0)
        width = prompt_ids.shape[1]
        recorder = _LogprobRecorder(width)
        processors = LogitsProcessorList()
        if self.temperature != 1.0:
            processors.append(_Temperature(self.temperature))
        if self.top_k > 0:
            processors.append(_TopK(self.top_k))
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
            bos_token_id=tok.bos_token_id,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with self._rng(generator_seed), self._autocast_ctx():
                out = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=gen_cfg,
                    logits_processor=processors,
                )
        finally:
            self.model.train(was_training)
        sequences = out.sequences if hasattr(out, "sequences") else out
        generated = sequences[:, width:]
        logprobs = recorder.finish(generated)
        return _to_rollout(prompt_ids, prompt_mask, generated, logprobs, self.max_new_tokens, pad, eos)


def _to_rollout(prompt_ids, prompt_mask, generated, logprobs, r: int, pad: int, eos: int) -> Rollout:
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
    )
