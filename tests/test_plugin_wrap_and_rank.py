"""Integer arithmetic that wraps inside a plug-in, a collator's extra dimension, a reward model's
cancellation, and an fp16 activation overflow named as such (verlaudit/audit/plugins.py,
verlaudit/analysis/diagnose/diagnosis.py). Each planted variant is another way than the blind bench's
(an int16 running count, a uint8 cumsum, an int8 numpy scalar product, a [B, P, 1] batch, a bf16 prefix
sum of a reward model), each with a clean twin that must give no finding.
Run: `pytest tests/test_plugin_wrap_and_rank.py`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.models import score_with_reward_model
from trainer.precision import resolve_policy
from verlaudit import kinds as K
from verlaudit.analysis.diagnose.diagnosis import diagnose_run
from verlaudit.audit.auditor import Auditor
from verlaudit.audit.settings import AuditSettings
from verlaudit.rundir import Finding, RunDir

RESPONSES = [f"{i} " * (3 + 4 * i) for i in range(8)]


def audited() -> Auditor:
    a = Auditor(settings=AuditSettings(level="full"))
    a.on_step_start(0)
    a.context.phase = "reward"
    return a


def found(a: Auditor, kind: str) -> list[Finding]:
    return [f for f in a.findings.all() if f.kind == kind]


def call(a: Auditor, fn) -> object:
    return a.plugin_call(
        "reward_fn", f"function:{fn.__name__}", functools.partial(fn, [""] * 8, RESPONSES, [{}] * 8)
    )


# ---------------------------------------------------------------- integers that wrap


def int16_running_count(prompts, responses, examples):
    """Characters seen so far, kept in int16: up to 62 chars x 600 passes pass 32767."""
    seen = torch.zeros(len(responses), dtype=torch.int16)
    for _ in range(600):
        seen += torch.tensor([len(r) for r in responses], dtype=torch.int16)  # the wrapping line
    return (seen.float() / 1e4).tolist()


def uint8_cumsum_bonus(prompts, responses, examples):
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.uint8)
    return (torch.cumsum(lengths, 0, dtype=torch.uint8).float() / 100).tolist()  # wraps past 255


def int8_numpy_product(prompts, responses, examples):
    out = []
    for r in responses:
        words = np.int8(len(r.split()))
        out.append(float(words * np.int8(9)) / 100)  # int8 scalar: 15 * 9 wraps
    return out


def wide_counts(prompts, responses, examples):
    seen = torch.zeros(len(responses), dtype=torch.int64)
    for _ in range(100):
        seen += torch.tensor([len(r) for r in responses])
    small = torch.tensor([len(r) for r in responses], dtype=torch.uint8) // 2  # fits: no wrap
    words = [int(np.int8(len(r.split()))) * 9 for r in responses]  # Python ints: no wrap
    return (seen.float() / 1e4 + small.float() + torch.tensor(words) / 100).tolist()


def test_a_torch_narrow_integer_op_that_wraps_is_named_with_its_line():
    for fn, op, dtype in ((int16_running_count, "add", "int16"), (uint8_cumsum_bonus, "cumsum", "uint8")):
        a = audited()
        call(a, fn)
        (f,) = found(a, K.PLUGIN_INT_WRAP)
        assert (
            f.observed["op"].rstrip("_") == op and f.observed["dtype"] == dtype and f.observed["elements"] > 0
        )
        assert f"({fn.__name__})" in f.observed["line"] and "int64" in f.fix, f


def test_a_numpy_integer_scalar_that_overflows_is_named_with_its_dtype():
    a = audited()
    call(a, int8_numpy_product)
    (f,) = found(a, K.PLUGIN_INT_WRAP)
    assert f.observed["source"] == "numpy" and "(int8_numpy_product)" in f.observed["line"]
    assert any("int8" in n for n in f.observed["narrow"]) and "int8" in f.fix


def test_wide_or_fitting_integer_arithmetic_is_clean():
    a = audited()
    call(a, wide_counts)
    assert found(a, K.PLUGIN_INT_WRAP) == []
    assert np.geterr()["over"] == "warn"  # numpy's error state is back as it was


# ---------------------------------------------------------------- a batch of another rank


def test_collator_ids_with_an_extra_dimension_are_an_error_naming_the_collator():
    a = audited()
    ids = torch.randint(4, 50, (4, 12))
    a.on_batch(role="actor", batch={"input_ids": ids[..., None], "attention_mask": torch.ones(4, 12, 1)},
               source="my.py:collate", examples=[{}] * 4)  # fmt: skip
    (f,) = found(a, K.COLLATOR_SHAPE)
    assert (
        f.severity == "error"
        and f.observed["shapes"]["input_ids"] == [4, 12, 1]
        and "my.py:collate" in f.where
    )
    assert ".squeeze(2)" in f.fix
    clean = audited()
    clean.on_batch(role="actor", batch={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                   source="my.py:collate", examples=[{}] * 4)  # fmt: skip
    assert found(clean, K.COLLATOR_SHAPE) == []


# ---------------------------------------------------------------- cancellation in a reward model


class PrefixSumRM(nn.Module):
    """Scores a sequence as the mean of its last 4 tokens' scores, from a running sum in its dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.score = nn.Embedding(64, 1).to(dtype)

    def forward(self, input_ids, attention_mask):
        per = self.score(input_ids).squeeze(-1) + 200.0  # positive offset: the running sum grows
        run = torch.cumsum(per, dim=1)
        return (run[:, -1] - run[:, -5]) / 4 - 200.0


def test_a_reward_models_prefix_sum_cancellation_is_named_as_such():
    ids = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(0))
    for dtype, expect in ((torch.bfloat16, True), (torch.float32, False)):
        a = audited()
        with torch.no_grad():
            a.plugin_call("reward_model", "model:rm", functools.partial(
                score_with_reward_model, PrefixSumRM(dtype), ids, torch.ones_like(ids)))  # fmt: skip
        losses = found(a, K.PLUGIN_PRECISION_LOSS)
        assert bool(losses) == expect, dtype
        if expect:
            assert "cancellation" in losses[0].message and "cumsum" in losses[0].message


# ---------------------------------------------------------------- fp16 activation overflow


def test_an_fp16_activation_overflow_is_titled_fp16_with_the_preset_and_bf16_first():
    cfg = TrainConfig.from_dict({"algo": {"name": "ppo"}, "precision": {"preset": "fp16"}, "steps": 3})
    over = Finding(severity="error", kind=K.OVERFLOW, role="rollout", where="model.layers.0.mlp.down_proj",
                   step=0, phase="rollout", message="produced inf from finite inputs (fp16 max is 65504)",
                   observed={"value": "inf", "dtype": "fp16", "input_absmax": 371.0}, expected="finite",
                   fix="run this module in bf16 or fp32 (precision.preset: bf16) or rescale it")  # fmt: skip
    run = RunDir(path=Path("/nonexistent/run"), manifest={"config": cfg.to_dict(),
                 "policy": resolve_policy("fp16").to_dict()}, metrics=[], findings=[over], events=[],
                 status={"state": "failed", "reason": "exception", "step": 0, "phase": "rollout",
                         "error": "RuntimeError: probability tensor contains either inf, nan or element < 0"})  # fmt: skip
    first = diagnose_run(run).causes[0]
    assert first.title.startswith("fp16 overflow from step 0") and re.search(
        r"precision\.preset:? fp16", first.title
    )
    assert "bf16" in first.fixes[0].why and "loss scale" not in first.fixes[0].why


# ---------------------------------------------------------------- values rounded by a cast down and back up


def bf16_rounded_reward(prompts, responses, examples):
    scores = torch.tensor([len(r) / 7 for r in responses])
    return scores.to(torch.bfloat16).to(torch.float32).tolist()  # "to save memory": only rounds


def fp32_reward_with_a_bf16_copy(prompts, responses, examples):
    scores = torch.tensor([len(r) / 7 for r in responses])
    _ = scores.to(torch.bfloat16)  # a copy for logging; the scores stay fp32
    return scores.tolist()


def test_a_cast_down_and_straight_back_up_in_a_reward_function_is_named():
    a = audited()
    call(a, bf16_rounded_reward)
    (f,) = found(a, K.PLUGIN_ROUND_TRIP)
    t = f.observed[0]
    assert (t["high"], t["low"]) == ("fp32", "bf16") and "(bf16_rounded_reward)" in t["down"]
    clean = audited()
    call(clean, fp32_reward_with_a_bf16_copy)
    assert found(clean, K.PLUGIN_ROUND_TRIP) == []
