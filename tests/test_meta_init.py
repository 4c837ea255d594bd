"""Record a model's initialisation on the meta device, replay it one parameter at a time: the values are
those of a real build from the same seed, bit for bit, and a build that cannot be replayed is refused.

The 2-rank check (each rank's shards of actor, critic and reference equal one process's model) is in
tests/test_distributed.py. Run: `pytest -q tests/test_meta_init.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from trainer.meta_init import copy_shard_, record_init, replay_init

CFG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=3,
)


def _replayed(build, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
    model, record = record_init(build)
    values: dict[str, torch.Tensor] = {}
    peak = replay_init(record, torch.device("cpu"), seed, lambda name, value: values.__setitem__(name, value))
    return model, values, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_gives_the_weights_of_a_real_build(dtype):
    def build():
        return AutoModelForCausalLM.from_config(LlamaConfig(**CFG), dtype=dtype)

    model, values, peak = _replayed(build, seed=5)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated
    torch.manual_seed(5)
    real = dict(build().named_parameters())
    assert list(values) != [] and set(values) == set(real)
    for name, p in real.items():
        assert values[name].dtype == dtype and torch.equal(values[name], p.detach()), name
    # transformers' init pass runs between constructors (each sub-model's post_init): the embedding's
    # final values are drawn before lm_head's constructor draws, and the pad row is zeroed
    assert torch.equal(values["model.embed_tokens.weight"][3], torch.zeros(32, dtype=dtype))
    # one full parameter at a time: the embedding or lm_head (64 x 32), never the model
    largest = max(p.numel() * p.element_size() for p in real.values())
    assert peak == largest < sum(p.numel() * p.element_size() for p in real.values()) / 4


def test_module_built_around_existing_parameters_records_its_own():
    class Head(nn.Module):
        def __init__(self, body: nn.Linear) -> None:
            super().__init__()
            self.body = body
            self.head = nn.Linear(4, 1)
            nn.init.normal_(self.head.weight, std=0.1)
            nn.init.zeros_(self.head.bias)

    with torch.device("meta"):
        body = nn.Linear(4, 4)
    model, values, _ = _replayed(lambda: Head(body), seed=2)
    assert set(values) == {"head.weight", "head.bias"}  # the body's parameters are someone else's
    torch.manual_seed(2)
    real = Head(nn.Linear(4, 4, device="meta")).head  # the same draws: Linear's init, then normal_
    assert torch.equal(values["head.weight"], real.weight.detach())
    assert torch.equal(values["head.bias"], torch.zeros(1))


def test_draws_that_cannot_be_replayed_are_refused():
    class CopiedIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            with torch.no_grad():
                self.w.copy_(torch.ones(3) * 2)  # a computed value: a replay would not know it

    class DrawsATemporary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    with pytest.raises(ValueError, match="w is written by copy_ from a computed tensor"):
        record_init(CopiedIn)
    with pytest.raises(ValueError, match="randn draws into a new tensor"):
        record_init(DrawsATemporary)


def test_copy_shard_into_a_plain_tensor_casts():
    p = torch.zeros(2, 2, dtype=torch.bfloat16)
    copy_shard_(p, torch.full((2, 2), 1.0 + 2**-10))
    assert torch.equal(p, torch.ones(2, 2, dtype=torch.bfloat16))  # rounded like .to(bf16)
