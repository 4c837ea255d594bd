"""What the full audit level's module probes cost, counted in dispatched ops (on a GPU, each is a
kernel launch; the count does not depend on the CPU), and that the cheaper maxima mean the same:
each tensor reduced once per step, a call's new tensors in one launch, NaN still NaN.

Run: `pytest tests/test_audit_probe_cost.py`.
"""

from __future__ import annotations

import gc
import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.precision import resolve_policy
from verlaudit.audit.context import StepContext
from verlaudit.audit.module_numerics import Provenance
from verlaudit.audit.probes import Maxima, ModuleProbe, _read


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view:
            self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_maxima_once_per_tensor_one_reduction_each():
    m = Maxima()
    a, b = torch.tensor([1.0, -3.0]), torch.tensor([[2.0, float("nan")]], dtype=torch.bfloat16)
    empty = torch.empty(0)
    with Ops() as ops:
        first = m.of([a, b, empty])
        again = m.of([a, a.view_as(a), a.view(2, 1), b])  # the same tensors and whole views of them
        part = m.of([a[:1]])  # a view of part of a: its own maximum
    assert ops.count == Counter({"linalg_vector_norm": 3})  # a, b and the part of a: once each
    assert first[2] is None and all(x is first[0] for x in again[:3]) and again[3] is first[1]
    three, nan, one = _read([first[0], first[1], part[0]])
    assert (three, one) == (3.0, 1.0) and math.isnan(nan)  # NaN propagates, like amax
    assert first[1].dtype == torch.bfloat16  # converted only when read


def test_a_freed_tensor_is_not_mistaken_for_a_new_one():
    m = Maxima()
    m.of([torch.full((4,), 7.0)])
    gc.collect()
    fresh = torch.full((4,), 2.0)  # may reuse the freed tensor's id: the weak reference tells them apart
    (got,) = m.of([fresh])
    assert _read([got]) == [2.0]


def test_read_mixes_dtypes_in_order():
    xs = [
        torch.tensor(1.5),
        torch.tensor(2.0, dtype=torch.bfloat16),
        torch.tensor(-3.0, dtype=torch.float16),
        torch.tensor(4.0),
    ]
    assert _read(xs) == [1.5, 2.0, -3.0, 4.0]


def test_probe_ops_per_step_on_a_tiny_llama():
    """The probe's own ops for one forward and backward of a 2-layer Llama: one absolute-maximum
    reduction per distinct tensor it sees (an input that is another module's output is not reduced
    again); before the maxima were shared it took abs + amax + a cast per input, output and gradient:
    242 ops here in fp32, 363 in bf16 with the cast."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=20,
        max_position_embeddings=32,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.arange(12).reshape(2, 6) % 20

    def step(probe_on):
        model.zero_grad(set_to_none=True)  # else the second backward accumulates into .grad (add_)
        ctx = StepContext(step=0, phase="actor_update")
        probe = ModuleProbe(
            {"actor": model}, policy=resolve_policy("fp32"), context=ctx, sink=[], provenance=Provenance()
        )
        with Ops() as ops:
            if probe_on:
                probe.__enter__()
            model(input_ids=ids, labels=ids).loss.backward()
            if probe_on:
                probe.__exit__(None, None, None)
        return ops.count, probe

    plain, _ = step(False)
    hooked, probe = step(True)
    extra = hooked - plain
    calls = len(list(model.modules()))
    assert set(extra) == {"linalg_vector_norm"}
    assert extra["linalg_vector_norm"] <= 3 * calls  # forward output + received and produced gradient
    assert extra["linalg_vector_norm"] < 150
