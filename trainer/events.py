"""The observer protocol: how the trainer reports what it does, without knowing who listens.

The trainer calls these methods at named boundaries; the default `Observer` does nothing, so a
plain training run pays nothing for them. verlaudit's auditor subclasses `Observer` (the arrow
points from verlaudit to the trainer, never back). The call order below is checked by
`pytest tests/test_train.py -k observer_receives_documented_calls`.

Call order, for every algorithm:

    on_setup(...)                       once, after models, tokenizer and policy exist
    for each step:
        on_step_start(step)
        with phase("rollout"):          generation (PPO, GRPO); DPO has no rollout phase
            on_weight_sync(...)         an engine with its own copy of the weights (vLLM) got the
                                        actor's current ones (none for engines sampling the actor)
            on_batch(...)               after the collator, before any model sees the batch
            on_rollout(...)             tokens and rollout log-probs from the engine (ReMax: twice,
                                        the greedy baseline second, marked as such)
        with phase("reward"):  on_reward(...)   (ReMax: twice, the baseline's scores first)
        with phase("ref"):     on_forward(role="reference", name="ref_logprobs", ...)
        with phase("critic"):  on_forward(role="critic", name="values", ...)
        with phase("actor_update"):     (and "critic_update" for the critic)
            on_forward(role="actor", name="old_logprobs" | "logprobs", ...)
            on_loss(...)                per micro-batch
            on_backward(...)            per micro-batch, gradients populated (still scaled)
            on_before_optimizer_step(...)   per optimizer step, grads unscaled and clipped
            on_optimizer_step(...)      after the step (or the skip)
        on_step_end(step, metrics)      one flat dict, verl-style names

User code at a plug-in point (`PLUGIN_POINTS`: the collator inside "rollout" or before a DPO step,
the reward function or reward model inside "reward") is called through ``plugin_call``, which
returns what the call returned: an observer may watch the call, or repeat it.

Payload tensors are the trainer's own tensors: observers must not modify them in place.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from trainer.precision import PrecisionPolicy

PHASES = ("rollout", "reward", "ref", "critic", "actor_update", "critic_update")
"""Phase names the trainer marks; memory and time are accounted per phase."""

PLUGIN_POINTS = ("collator", "reward_fn", "reward_model")
"""Where the trainer calls code that is not its own: ``data.collator`` (and the built-in collators),
``data.reward_fn`` / verl's ``data.compute_score`` (and the tasks' rule rewards), the forward of
``model.reward_model``."""

T = TypeVar("T")


class Observer:
    """No-op observer. Override the methods you need; each is called with keyword arguments."""

    def on_setup(
        self,
        *,
        config: Mapping[str, Any],
        policy: PrecisionPolicy,
        models: Mapping[str, nn.Module],
        tokenizer_info: Mapping[str, Any],
    ) -> None:
        """Models of every role exist (``actor``, ``critic``, ``reference``, ``reward``; absent
        roles are missing from ``models``). ``config`` is the resolved TrainConfig as plain data;
        ``tokenizer_info`` has ``vocab_size``, ``pad_token_id``, ``eos_token_id``, ``padding_side``,
        and ``overridden``: the settings of the user's checkpoint and tokenizer the trainer replaced
        (`trainer.models.overridden`: ``setting``, ``yours``, ``used``, ``differs``), and ``tokenizer``
        (the tokenizer itself: the audit re-encodes a batch's prompts to check the rows against them)."""

    def on_step_start(self, step: int) -> None:
        """A training step begins (0-based)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks a phase of the step; ``name`` is one of `PHASES`."""
        yield

    def plugin_call(self, point: str, source: str, call: Callable[[], T]) -> T:
        """Makes one call of user code at a plug-in point and returns its result. ``point`` is one of
        `PLUGIN_POINTS`, ``source`` names the code (the collator's or reward function's ``module:attr``,
        ``task:<name>``, ``model:<spec>``); ``call`` takes no arguments (the trainer binds them). An
        observer may run it under a recorder, and call it a second time (``reward_model``: always safe, a
        forward under no_grad; the others may keep state). Default: ``call()``."""
        return call()

    def on_batch(
        self, *, role: str, batch: Mapping[str, Any], source: str, examples: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        """A collated batch, before any model sees it. ``source`` names the collator
        (``"builtin:prompt"``, ``"builtin:pairs"`` or the user's ``module:attr``); ``examples`` are the
        dataset's examples it collated (one row each), as the trainer passed them."""

    def on_rollout(
        self,
        *,
        engine: str,
        engine_dtype: torch.dtype,
        actor_compute_dtype: torch.dtype,
        prompt_ids: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        logprobs: torch.Tensor,
        engine_facts: Mapping[str, Any] | None = None,
        trainer_facts: Mapping[str, Any] | None = None,
    ) -> None:
        """The rollout engine produced responses and the log-probs it sampled them with.

        ``engine_facts`` (the engine's ``facts()``) says what set those probabilities:
        ``weights_dtype``, ``compute_dtype``, ``kv_cache_dtype`` (a torch dtype, or the engine's own
        name for a non-float cache such as ``fp8_e4m3``), ``logprob_dtype`` (of its log-softmax),
        ``temperature``, ``top_k``, ``top_p`` and ``logprobs_mode`` (``processed``: log-probs of the
        distribution sampled from, after temperature / top-k / top-p; ``raw``: before them; vLLM's
        ``raw_logits`` / ``processed_logits``: not log-probs). ``trainer_facts`` says how the trainer
        recomputes them: ``temperature``, ``top_k`` / ``top_p`` (0 / 1.0: the whole vocabulary),
        ``logprob_dtype``, and ``used`` (False for a rollout whose log-probs no loss reads, ReMax's
        greedy baseline). Both may be None from an engine or trainer that does not report them."""

    def on_weight_sync(
        self,
        *,
        engine: str,
        engine_dtype: torch.dtype,
        seconds: float,
        nbytes: int,
        tensors: int,
        cast: Mapping[str, int],
        mismatched: list[Mapping[str, str]],
        probe_tokens: int,
        probe_max_abs_diff: float | None = None,
        probe_mean_abs_diff: float | None = None,
        probe_change: float | None = None,
    ) -> None:
        """The actor's weights were pushed into the rollout engine (before a rollout, so after every
        update): ``seconds`` and ``nbytes`` of the push, ``tensors`` pushed, ``cast`` counts by
        ``"float32->bfloat16"``, ``mismatched`` lists ``{name, reason}`` for parameters that did not
        match the engine by name, shape or dtype. The probe: the engine's teacher-forced log-probs of
        ``probe_tokens`` fixed tokens against the actor's own in the engine dtype (max / mean abs
        difference), and ``probe_change``, how far they moved since the previous push (None at the
        first)."""

    def on_reward(
        self,
        *,
        source: str,
        raw: Any,
        rewards: torch.Tensor,
        expected_shape: tuple[int, ...],
        model: nn.Module | None,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        """``raw`` is exactly what the reward function or reward model returned; ``rewards`` is
        the float32 tensor the trainer uses after converting it. ``source`` is ``"function:<name>"``
        or ``"model:<name>"``; ``model`` is the reward model when there is one. ``context``, what was
        scored: ``responses`` (texts) and ``examples`` for a function; ``input_ids``, ``attention_mask``
        and ``rescore`` (``fn(ids, mask)``: the same reward model call, no_grad and autocast as the
        trainer's) for a model."""

    def on_forward(self, *, role: str, name: str, output: torch.Tensor) -> None:
        """A forward result crossing into the algorithm: ``ref_logprobs``, ``old_logprobs``,
        ``logprobs``, ``values``, ``chosen_logps``, ``rejected_logps`` ..."""

    def on_loss(self, *, role: str, loss: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> None:
        """A micro-batch loss (unscaled) and its named terms, before backward."""

    def on_backward(self, *, role: str, model: nn.Module, loss_scale: float) -> None:
        """Backward of one micro-batch finished; ``.grad`` holds gradients times ``loss_scale``."""

    def on_before_optimizer_step(self, *, role: str, model: nn.Module, optimizer: Any) -> None:
        """Gradients are unscaled and clipped; the optimizer is about to step (or skip)."""

    def on_optimizer_step(
        self,
        *,
        role: str,
        model: nn.Module,
        optimizer: Any,
        scaler_state: Mapping[str, Any],
        skipped: bool,
        grad_norm: float,
    ) -> None:
        """The optimizer stepped, or skipped because gradients were non-finite.
        ``scaler_state`` is `trainer.precision.LossScaler.state()`."""

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        """One flat dict of metrics for the step (``actor/pg_loss``, ``critic/score/mean`` ...)."""


NULL_OBSERVER = Observer()


class Fanout(Observer):
    """Several observers as one, called in list order (the worker's fault injector beside the
    auditor). Every event is spelled out, so an event added to `Observer` without a line here is
    caught by its test (`pytest tests/test_worker.py -k fanout`); phases nest with the LAST observer
    outermost, so an exception raised inside the first one's phase still passes through the others'."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def on_setup(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_setup(**kw)

    def on_step_start(self, step: int) -> None:
        for o in self.observers:
            o.on_step_start(step)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in reversed(self.observers):
                stack.enter_context(o.phase(name))
            yield

    def plugin_call(self, point: str, source: str, call: Callable[[], T]) -> T:
        # nested like phases: the first observer's wrapper innermost, next to the user's call
        for o in self.observers:
            call = functools.partial(o.plugin_call, point, source, call)
        return call()

    def on_batch(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_batch(**kw)

    def on_rollout(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_rollout(**kw)

    def on_weight_sync(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_weight_sync(**kw)

    def on_reward(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_reward(**kw)

    def on_forward(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_forward(**kw)

    def on_loss(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_loss(**kw)

    def on_backward(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_backward(**kw)

    def on_before_optimizer_step(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_before_optimizer_step(**kw)

    def on_optimizer_step(self, **kw: Any) -> None:
        for o in self.observers:
            o.on_optimizer_step(**kw)

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        for o in self.observers:
            o.on_step_end(step, metrics)
