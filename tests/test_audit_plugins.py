"""Inside the plug-ins (verlaudit/audit/plugins.py): the auditor's `plugin_call` watches a reward function,
a reward model and a collator on audited steps, names the op and line that made a NaN/inf or rounded the
result, and re-runs a reward model in fp32 (a reward function only with ``audit.rerun_plugins``). Each fault
has a clean control with no finding. Plus the trainer's event (`Observer.plugin_call`, `Fanout`) and the
rules that make these findings the root of what they cause.

Run: `pytest tests/test_audit_plugins.py`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from trainer.events import Fanout, Observer
from trainer.models import score_with_reward_model
from verlaudit import kinds as K
from verlaudit.audit import plugins
from verlaudit.audit.auditor import Auditor
from verlaudit.audit.settings import AuditSettings

RESPONSES = [f"{i} " * (3 + i) for i in range(8)]


def fp16_softmax_reward(prompts, responses, examples):
    """A reward weighting responses by exp(length), in fp16: exp(2 * 12) is past fp16's maximum."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float16)
    w = torch.exp(lengths * 2.0)  # the overflowing line
    return (w / w.sum()).tolist()


def fp32_softmax_reward(prompts, responses, examples):
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    return torch.softmax(lengths * 0.1, 0).tolist()


def fp16_rounding_reward(prompts, responses, examples):
    """No overflow: the lengths' scores rounded in fp16 (spacing 0.25 at 300)."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    return (300.0 + (lengths * 0.01).half()).tolist()


class NormalisingRM(nn.Module):
    """A reward model that normalises its scores in ``norm_dtype``, around 48 (bf16's spacing there: 0.25)."""

    def __init__(self, norm_dtype: torch.dtype) -> None:
        super().__init__()
        self.head = nn.Linear(1, 1)
        self.norm_dtype = norm_dtype
        with torch.no_grad():
            self.head.weight.fill_(1.0)
            self.head.bias.zero_()

    def forward(self, input_ids, attention_mask):
        x = self.head((input_ids.float() * attention_mask).sum(-1, keepdim=True))[:, 0]
        s = x.to(self.norm_dtype)
        return (s - s.mean()) / s.std() * 0.3 + 48.0  # the normalisation


def rm_inputs(n=12):
    ids = torch.arange(n)[:, None] * 3 + torch.arange(4)[None, :]
    return ids, torch.ones_like(ids)


def bf16_id_collator(examples, tokenizer):
    """Shifts ids into a reserved range in bf16 (float math on ids): above 256 bf16 rounds them."""
    ids = torch.tensor([[3, 5, 7, 11, 13]] * len(examples))
    shifted = (ids.to(torch.bfloat16) + 1000).long() - 1000  # the rounding line
    return {"input_ids": shifted, "attention_mask": torch.ones_like(ids)}


def clean_collator(examples, tokenizer):
    ids = torch.tensor([[3, 5, 7, 11, 13]] * len(examples))
    return {"input_ids": ids + 1000 - 1000, "attention_mask": torch.ones_like(ids)}


def audited(**settings) -> Auditor:
    a = Auditor(settings=AuditSettings(level="full", **settings))
    a.on_step_start(0)
    a.context.phase = "reward"
    return a


def kinds(a: Auditor) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in a.findings.all():
        out.setdefault(f.kind, []).append(f)
    return out


def test_fp16_reward_function_overflow_is_named_with_its_line():
    a = audited()
    call = functools.partial(fp16_softmax_reward, [""] * 8, RESPONSES * 2, [{}] * 8)
    out = a.plugin_call("reward_fn", "function:tests.test_audit_plugins:fp16_softmax_reward", call)
    assert any(v != v for v in out)  # the real result went through untouched (NaN from inf / inf)
    found = kinds(a)
    (nan,) = found[K.PLUGIN_NONFINITE_OP]
    assert nan.observed["op"] == "exp" and nan.observed["dtype"] == "fp16"
    assert "test_audit_plugins.py:" in nan.observed["line"] and "fp16_softmax_reward" in nan.observed["line"]
    assert "fp32" in nan.fix and nan.observed["line"] in nan.fix
    assert K.PLUGIN_LOW_PRECISION in found  # the fp16 ops, with the same line
    assert K.PLUGIN_PRECISION_LOSS not in found  # no second call without the opt-in


def test_rerun_opt_in_compares_a_reward_function_in_fp64():
    a = audited(rerun_plugins=True)
    calls = []

    def counted(*args):
        calls.append(1)
        return fp16_rounding_reward(*args)

    a.plugin_call("reward_fn", "function:r", functools.partial(counted, [""] * 8, RESPONSES, [{}] * 8))
    assert len(calls) == 2
    (loss,) = kinds(a)[K.PLUGIN_PRECISION_LOSS]
    assert loss.observed["distinct_high"] == 8 and loss.observed["distinct"] < 8
    assert "fp64" in loss.message and "test_audit_plugins.py" in loss.fix


def test_reward_model_bf16_normalisation_collapses_scores_found_by_the_fp32_rerun():
    a = audited()
    ids, mask = rm_inputs()
    with torch.no_grad():
        out = a.plugin_call(
            "reward_model",
            "model:rm",
            functools.partial(score_with_reward_model, NormalisingRM(torch.bfloat16), ids, mask),
        )
    assert out.dtype == torch.bfloat16
    (loss,) = kinds(a)[K.PLUGIN_PRECISION_LOSS]
    c = loss.observed
    assert c["distinct_high"] == 12 and c["distinct"] <= 6 and c["spacing"] == 0.25
    assert "spacing 0.25 at magnitude 48" in loss.message and "12 distinct values" in loss.message
    assert "test_audit_plugins.py" in loss.fix and "forward" in loss.fix


def test_collator_float_math_on_ids_is_found():
    a = audited()
    a.context.phase = "rollout"
    batch = a.plugin_call(
        "collator", "tests:bf16_id_collator", functools.partial(bf16_id_collator, [{}] * 2, None)
    )
    assert batch["input_ids"].tolist()[0] != [3, 5, 7, 11, 13]  # the fault is real
    found = kinds(a)
    (ints,) = found[K.PLUGIN_INT_PRECISION]
    assert ints.severity == "error" and ints.observed["dtype"] == "bf16" and ints.observed["limit"] == 256
    assert "bf16_id_collator" in ints.observed["line"] and "torch.long" in ints.fix
    assert K.PLUGIN_LOW_PRECISION in found


@pytest.mark.parametrize(
    "point,call",
    [
        ("reward_fn", functools.partial(fp32_softmax_reward, [""] * 8, RESPONSES, [{}] * 8)),
        ("collator", functools.partial(clean_collator, [{}] * 2, None)),
        (
            "reward_model",
            functools.partial(score_with_reward_model, NormalisingRM(torch.float32), *rm_inputs()),
        ),
    ],
)
@pytest.mark.parametrize("rerun", [False, True])
def test_clean_controls_have_no_finding(point, call, rerun):
    # the recorder's controls: fp32_softmax_reward normalises over the batch, which the forked contract
    # probes (audit.probe_plugins, tests/test_probes_fork.py) rightly call batch-dependent
    a = audited(rerun_plugins=rerun, probe_plugins=False)
    with torch.no_grad():
        a.plugin_call(point, "clean", call)
    assert a.findings.all() == []


def test_bf16_reward_model_of_distinct_scores_is_clean():
    class Spread(NormalisingRM):
        def forward(self, input_ids, attention_mask):
            return self.head((input_ids.float() * attention_mask).sum(-1, keepdim=True))[:, 0]

    a = audited()
    rm = Spread(torch.bfloat16).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a.plugin_call(
            "reward_model", "model:rm", functools.partial(score_with_reward_model, rm, *rm_inputs())
        )
    assert a.findings.all() == []


def test_unaudited_steps_are_not_watched_and_the_rng_is_restored():
    a = Auditor(settings=AuditSettings(level="full", full_steps=0, every=0))
    a.on_step_start(3)
    assert (
        a.plugin_call("reward_fn", "f", lambda: fp16_softmax_reward([], RESPONSES * 2, []))
        and not a.findings.all()
    )
    b = audited()
    rm = NormalisingRM(torch.bfloat16)
    rm.drop = nn.Dropout(0.5)
    torch.manual_seed(0)
    b.plugin_call("reward_model", "m", lambda: rm.drop(torch.ones(4)).sum())
    after = torch.rand(1)
    torch.manual_seed(0)
    rm.drop(torch.ones(4))
    assert torch.equal(torch.rand(1), after)  # the fp32 re-run drew nothing from the run's generator


def test_observer_default_and_fanout_pass_the_call_on():
    assert Observer().plugin_call("collator", "s", lambda: 7) == 7
    heard = []

    class Log(Observer):
        def __init__(self, name):
            self.name = name

        def plugin_call(self, point, source, call):
            heard.append((self.name, "enter", point))
            out = call()
            heard.append((self.name, "exit", point))
            return out

    assert "plugin_call" in vars(Fanout)
    assert Fanout([Log("a"), Log("b")]).plugin_call("reward_fn", "s", lambda: heard.append("call") or 5) == 5
    assert heard == [("b", "enter", "reward_fn"), ("a", "enter", "reward_fn"), "call",
                     ("a", "exit", "reward_fn"), ("b", "exit", "reward_fn")]  # fmt: skip


def test_spacing_and_exact_integers():
    assert plugins.spacing(torch.bfloat16, 48.0) == 0.25
    assert plugins.exact_int_limit(torch.bfloat16) == 256 and plugins.exact_int_limit(torch.float16) == 2048


def fp16_exp_reward(prompts, responses, examples):
    """exp(4 * length) in fp16 (past 65504 from a length of 3), normalised: inf / inf is NaN."""
    lengths = torch.tensor([len(r) + 3 for r in responses], dtype=torch.float16)
    w = torch.exp(lengths * 4.0)
    return (w / w.sum()).tolist()


def test_end_to_end_the_plugin_op_is_the_root_of_the_nan_reward(tmp_path):
    from tests.diagnose_runs import causes, make_run
    from tests.test_root_cause import TINY
    from trainer.config import TrainConfig
    from trainer.train import train

    data = {**TINY, "data": {**TINY["data"], "reward_fn": "tests.test_audit_plugins:fp16_exp_reward"}}
    a = Auditor(settings=AuditSettings(level="full", full_steps=1, every=0))
    try:
        with a:
            train(TrainConfig.from_dict(data), a)
    except Exception:
        assert a.failure is not None
    (op,) = a.findings.find(K.PLUGIN_NONFINITE_OP)
    assert op.observed["op"] == "exp" and "fp16_exp_reward" in op.observed["line"] and op.phase == "reward"
    assert a.findings.find(K.REWARD_NONFINITE)
    d = causes(make_run(tmp_path / "run", steps=1, findings=a.findings.all()))
    first = d.causes[0]
    assert first.kind == f"finding:{K.PLUGIN_NONFINITE_OP}", [(c.kind, c.title) for c in d.causes]
    assert "test_audit_plugins.py" in str(first.fixes[0]) and "fp32" in str(first.fixes[0])
    nan = [c for c in d.causes if c.kind == f"finding:{K.REWARD_NONFINITE}"]
    assert nan and all(c.consequence_of == first.title for c in nan), [
        (c.kind, c.consequence_of) for c in d.causes
    ]


def fp16_product_reward(prompts, responses, examples):
    """A product of per-character probabilities in fp16: 0.01 per character underflows below 6e-8."""
    r = torch.ones(len(responses), dtype=torch.float16)
    for i, text in enumerate(responses):
        for _ in text:
            r[i] = r[i] * 0.01  # the underflowing line
    return r


def fp16_small_product_reward(prompts, responses, examples):
    """The same product over at most two characters: 1e-4 is an fp16 normal, nothing flushes."""
    r = torch.ones(len(responses), dtype=torch.float16)
    for i, text in enumerate(responses):
        for _ in text[:2]:
            r[i] = r[i] * 0.01
    return r


def test_fp16_underflow_to_zero_is_named_with_its_line():
    a = audited()
    out = a.plugin_call(
        "reward_fn", "function:p", functools.partial(fp16_product_reward, [""] * 8, RESPONSES, [])
    )
    assert (out == 0).all()  # the fault is real: every score flushed to 0
    (under,) = kinds(a)[K.PLUGIN_UNDERFLOW]
    assert under.severity == "error" and under.observed["op"] == "mul" and under.observed["dtype"] == "fp16"
    assert "fp16_product_reward" in under.observed["line"] and under.observed["zero_scores"] == [8, 8]
    assert "underflowed" in under.message and "log" in under.fix and under.observed["line"] in under.fix
    clean = audited()
    clean.plugin_call("reward_fn", "f", functools.partial(fp16_small_product_reward, [""] * 8, RESPONSES, []))
    assert K.PLUGIN_UNDERFLOW not in kinds(clean) and K.PLUGIN_LOW_PRECISION in kinds(clean)


def test_a_collator_in_the_uncounted_rollout_phase_is_still_watched():
    # the rollout phase suspends op counting; the recorder entered inside it still sees the call
    from verlaudit.audit import opcount

    a = audited()
    a.context.phase = "rollout"
    with opcount.suspended():
        a.plugin_call(
            "collator", "tests:bf16_id_collator", functools.partial(bf16_id_collator, [{}] * 2, None)
        )
    assert K.PLUGIN_INT_PRECISION in kinds(a)
