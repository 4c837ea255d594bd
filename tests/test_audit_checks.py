"""Pure audit checks on hand-made records: dtype contract, boundaries, error parsing, finding folding.

Run: `pytest tests/test_audit_checks.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.precision import cast_model, resolve_policy
from verlaudit.audit import AuditSettings
from verlaudit.audit import boundaries as B
from verlaudit.audit import dtype_checks as D
from verlaudit.audit import errors as E
from verlaudit.audit.findings import FindingLog
from verlaudit.rundir import Finding

F32, F16, BF16, I64 = torch.float32, torch.float16, torch.bfloat16, torch.int64
BF16_POLICY = resolve_policy("bf16")
PURE = resolve_policy("bf16-pure")
FP32 = resolve_policy("fp32")
TOK = {"vocab_size": 10, "pad_token_id": 0, "eos_token_id": 1, "padding_side": "left"}


def call(
    kind="linear", params=(BF16,), autocast=None, inputs=(("arg0", F32),), outputs=(BF16,), name="m.q_proj"
):
    return D.ModuleCall(
        role="actor",
        name=name,
        kind=kind,
        param_dtypes=params,
        autocast=autocast,
        inputs=inputs,
        outputs=outputs,
    )


def kinds(findings):
    return sorted((f.severity, f.kind) for f in findings)


def test_fp32_activation_into_bf16_module_outside_autocast_is_an_error():
    f = D.check_module_call(call(), PURE["actor"], step=3, phase="actor_update")
    assert kinds(f) == [("error", "dtype/module_input")]
    assert (f[0].observed, f[0].expected, f[0].where, f[0].step) == ("fp32", "bf16", "m.q_proj", 3)


def test_fp32_weights_under_autocast_are_the_contract_not_a_finding():
    # bf16 preset: fp32 master weights, fp32 residual stream, autocast(bf16) casts per op
    c = call(params=(F32,), autocast=BF16, inputs=(("arg0", F32),), outputs=(BF16,))
    assert D.check_module_call(c, BF16_POLICY["actor"], step=0, phase=None) == []
    # the same module run outside autocast computes in fp32: the policy promised bf16
    c = call(params=(F32,), autocast=None, outputs=(F32,))
    assert kinds(D.check_module_call(c, BF16_POLICY["actor"], step=0, phase=None)) == [
        ("warning", "dtype/compute")
    ]


def test_a_frozen_role_computing_in_fp32_under_a_bf16_policy_is_information():
    # a user's fp32 reward model run outside autocast: slower than the policy asks, never less precise
    c = dataclasses.replace(call(params=(F32,), autocast=None, outputs=(F32,)), role="reward")
    assert kinds(D.check_module_call(c, BF16_POLICY["reward"], step=0, phase="reward")) == [
        ("info", "dtype/compute")
    ]
    # another low precision than the policy's stays an error on a frozen role too
    c = dataclasses.replace(
        call(params=(F16,), autocast=None, inputs=(("arg0", F16),), outputs=(F16,)), role="reward"
    )
    assert kinds(D.check_module_call(c, BF16_POLICY["reward"], step=0, phase="reward")) == [
        ("error", "dtype/compute")
    ]


def test_float_token_ids_into_embedding_and_mixed_params():
    c = call(
        kind="embedding", params=(F32,), inputs=(("arg0", F32),), outputs=(F32,), name="model.embed_tokens"
    )
    assert kinds(D.check_module_call(c, FP32["actor"], step=0, phase=None)) == [
        ("error", "dtype/int_became_float")
    ]
    c = call(params=(F32, BF16), autocast=None, inputs=(("arg0", F32),), outputs=(F32,))
    assert ("warning", "dtype/mixed_params") in kinds(
        D.check_module_call(c, FP32["actor"], step=0, phase=None)
    )


def test_norm_island_only_flagged_when_the_norm_ran_in_bf16_under_autocast():
    ok = call(kind="norm", params=(F32,), autocast=BF16, outputs=(F32,), name="model.norm")
    bad = call(
        kind="norm",
        params=(BF16,),
        autocast=BF16,
        inputs=(("arg0", BF16),),
        outputs=(BF16,),
        name="model.norm",
    )
    assert D.check_module_call(ok, BF16_POLICY["actor"], step=0, phase=None) == []
    assert kinds(D.check_module_call(bad, BF16_POLICY["actor"], step=0, phase=None)) == [
        ("warning", "dtype/island")
    ]
    # pre/post split: inputs before the forward runs, outputs after
    assert D.check_module_call(bad, BF16_POLICY["actor"], step=0, phase=None, stage="pre") == []


def test_logprobs_island():
    assert (
        D.check_boundary_output(
            "actor", "logprobs", torch.zeros(2, 3), BF16_POLICY["actor"], step=0, phase=None
        )
        == []
    )
    f = D.check_boundary_output(
        "actor", "logprobs", torch.zeros(2, 3, dtype=BF16), BF16_POLICY["actor"], step=0, phase=None
    )
    assert kinds(f) == [("error", "dtype/island")] and f[0].observed == "bf16"
    f = D.check_boundary_output(
        "actor", "logprobs", torch.zeros(2, 3, dtype=I64), BF16_POLICY["actor"], step=0, phase=None
    )
    assert kinds(f) == [("error", "dtype/island_not_float")]


def tiny_llama():
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=10,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def test_a_frozen_role_stored_wider_than_the_policy_is_information_not_a_fault():
    # a user's fp32 reward model or reference under a bf16 policy loses no precision (memory only); the same
    # width on a trained role, or a narrower one on a frozen role, stays an error
    bf16 = resolve_policy("bf16-pure")
    m = tiny_llama()
    for role in ("reward", "reference"):
        (f,) = D.check_param_storage(role, m, bf16[role], kind="boundary/reward_model")
        assert f.severity == "info" and "wider" in f.message
    (f,) = D.check_param_storage("actor", m, bf16["actor"])
    assert f.severity == "error"
    m.to(F16)
    (f,) = D.check_param_storage("reward", m, FP32["reward"], kind="boundary/reward_model")
    assert f.severity == "error"


def test_param_storage_and_rotary_buffers():
    m = tiny_llama()
    assert D.check_param_storage("actor", m, FP32["actor"]) == []
    m.to(F16)
    f = D.check_param_storage("reward", m, FP32["reward"], kind="boundary/reward_model")
    assert kinds(f) == [("error", "boundary/reward_model")]
    assert f[0].observed == {"fp16": sum(p.numel() for p in m.parameters())} and f[0].expected == "fp32"
    m.to(BF16)
    # the bf16 preset promises an fp32 rotary island; bf16-pure does not (info only)
    assert kinds(D.check_buffers("reference", m, BF16_POLICY["reference"])) == [
        ("warning", "dtype/buffer_precision")
    ]
    assert kinds(D.check_buffers("actor", m, PURE["actor"])) == [("info", "dtype/buffer_precision")]
    assert D.check_buffers("reference", m, BF16_POLICY["reference"])[0].where == "model.rotary_emb"


@pytest.mark.parametrize("preset", ["fp16", "bf16-pure"])
def test_cast_model_keeps_the_rotary_island_in_fp32(preset):
    m = tiny_llama()
    before = m.model.rotary_emb.inv_freq.clone()
    persistent = set(m.state_dict())
    policy = resolve_policy(preset)["reference"]  # fp16 / bf16 storage in both presets
    cast_model(m, policy)
    assert {p.dtype for p in m.parameters()} == {policy.param_dtype}
    inv = m.model.rotary_emb.inv_freq
    # bit-identical, not a round trip: inv_freq = 10000 ** (-2i / 8) = 1, 0.1, 0.01, 0.001 (head_dim 8),
    # and 0.1 has no exact fp16 / bf16 value (0.09998 / 0.1001), so a round trip would show
    assert inv.dtype == F32 and torch.equal(inv, before)
    assert before[1].to(policy.param_dtype).float() != before[1]
    assert set(m.state_dict()) == persistent  # non-persistent buffers stay out of the checkpoint
    assert D.check_buffers("actor", m, BF16_POLICY["actor"]) == []
    m.model.rotary_emb.inv_freq = inv.to(BF16)  # the check still fires on a deliberately cast buffer
    assert kinds(D.check_buffers("actor", m, BF16_POLICY["actor"])) == [("warning", "dtype/buffer_precision")]


def batch(ids, mask):
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def test_batch_boundary():
    good = batch([[0, 3, 4], [2, 3, 4]], [[0, 1, 1], [1, 1, 1]])
    assert B.check_batch(good, role="actor", source="builtin:prompt", tokenizer_info=TOK) == []
    fl = {k: v.float() for k, v in good.items()}
    f = B.check_batch(fl, role="actor", source="x", tokenizer_info=TOK)
    assert kinds(f) == [("error", "boundary/collator_float_ids")] * 2 and {x.where for x in f} == {
        "collator:x.input_ids",
        "collator:x.attention_mask",
    }
    oov = batch([[0, 3, 12]], [[0, 1, 1]])  # 12 >= vocab 10
    f = B.check_batch(oov, role="actor", source="x", tokenizer_info=TOK)
    assert kinds(f) == [("error", "boundary/collator_id_range")] and f[0].observed == [0, 12]
    right = batch([[3, 4, 0]], [[1, 1, 0]])
    f = B.check_batch(right, role="actor", source="x", tokenizer_info=TOK)
    assert kinds(f) == [("error", "boundary/padding_side")] and f[0].observed == "right"
    ragged = {"input_ids": torch.zeros(2, 3, dtype=I64), "attention_mask": torch.ones(3, 3, dtype=I64)}
    assert ("error", "boundary/collator_shape") in kinds(
        B.check_batch(ragged, role="actor", source="x", tokenizer_info=TOK)
    )


def test_reward_boundary():
    kw = {"source": "function:r", "expected_shape": (2,), "train_device": "cpu"}
    assert B.check_reward(torch.tensor([0.5, 1.0]), None, **kw) == []
    assert kinds(B.check_reward(torch.tensor([0.5, 1.0], dtype=torch.float64), None, **kw)) == [
        ("warning", "boundary/reward_dtype")
    ]
    assert kinds(B.check_reward(np.array([0.5, 1.0]), None, **kw)) == [("warning", "boundary/reward_dtype")]
    assert kinds(B.check_reward([0.5, 1.0], None, **kw)) == [("info", "boundary/reward_list")]
    assert kinds(B.check_reward(torch.tensor([1, 0]), None, **kw)) == [("info", "boundary/reward_dtype")]
    assert ("error", "boundary/reward_not_numbers") in kinds(B.check_reward(["a", "b"], None, **kw))
    # a CPU tensor while training on a GPU: the device check with a fake training device
    f = B.check_reward(torch.tensor([0.5, 1.0]), None, **{**kw, "train_device": "cuda:0"})
    assert kinds(f) == [("warning", "boundary/reward_device")] and f[0].observed == "cpu"
    # fp64 on the CPU: two problems, two kinds (one kind would fold the second into the first)
    f = B.check_reward(
        torch.tensor([0.5, 1.0], dtype=torch.float64), None, **{**kw, "train_device": "cuda:0"}
    )
    assert kinds(f) == [("warning", "boundary/reward_device"), ("warning", "boundary/reward_dtype")]
    f = B.check_reward(torch.tensor([[0.5], [1.0]]), None, **kw)
    assert kinds(f) == [("error", "boundary/reward_shape")] and f[0].observed == [2, 1]
    f = B.check_reward(torch.tensor([float("nan"), 1.0]), None, **kw)
    assert kinds(f) == [("error", "boundary/reward_nonfinite")] and "1 of 2" in f[0].message


def test_rollout_boundary():
    ids = torch.ones(2, 3, dtype=I64)
    kw = {
        "engine": "hf-generate",
        "prompt_ids": ids,
        "response_ids": ids,
        "response_mask": ids,
        "vocab_size": 10,
    }
    assert (
        B.check_rollout(engine_dtype=BF16, actor_compute_dtype=BF16, logprobs=torch.zeros(2, 3), **kw) == []
    )
    f = B.check_rollout(engine_dtype=BF16, actor_compute_dtype=F32, logprobs=torch.zeros(2, 3), **kw)
    assert kinds(f) == [("warning", "boundary/rollout_dtype")]
    assert (
        "rollout/train precision mismatch" in f[0].message and "actor_rollout_ref.rollout.dtype" in f[0].fix
    )
    f = B.check_rollout(
        engine_dtype=BF16, actor_compute_dtype=BF16, logprobs=torch.zeros(2, 3, dtype=BF16), **kw
    )
    assert kinds(f) == [("error", "dtype/island")]
    f = B.check_rollout(engine_dtype=BF16, actor_compute_dtype=BF16, logprobs=torch.zeros(2, 2), **kw)
    assert kinds(f) == [("error", "boundary/rollout_shape")]


@pytest.mark.parametrize(
    "message, observed, expected",
    [
        ("expected scalar type BFloat16 but found Float", "fp32", "bf16"),
        ("mat1 and mat2 must have the same dtype, but got Float and BFloat16", "fp32", "bf16"),
        ("expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16", "fp32", "bf16"),
        (
            "Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) should be the same",
            "fp32",
            "fp16",
        ),
        (
            "Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; "
            "but got torch.FloatTensor instead (while checking arguments for embedding)",
            "fp32",
            "int64",
        ),
    ],
)
def test_parse_dtype_errors(message, observed, expected):
    p = E.parse_dtype_error(message)
    assert (p["observed"], p["expected"]) == (observed, expected)
    assert E.classify(RuntimeError(message)) == "dtype_error"


def test_classify_and_innermost_module():
    assert E.classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "oom"
    assert E.classify(KeyboardInterrupt()) == "interrupted"
    assert E.classify(RuntimeError("something else")) == "exception"
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4).to(BF16)))
    names = {id(x): ("actor", n) for n, x in m.named_modules()}
    with pytest.raises(RuntimeError) as info:
        m(torch.zeros(1, 4))
    assert E.innermost_module(info.value.__traceback__, names) == ("actor", "1.0")


def test_finding_log_folds_repeats_and_keeps_the_first():
    log = FindingLog()
    for step in (2, 5, 7):
        log.add(
            Finding(
                severity="error", kind="dtype/module_input", role="actor", where="a", step=step, message="m"
            )
        )
    log.add(
        Finding(severity="error", kind="dtype/module_input", role="actor", where="b", step=3, message="m")
    )
    # role-wide kinds fold over modules: one finding names the first module seen
    log.add(Finding(severity="warning", kind="dtype/compute", role="actor", where="x", step=1, message="m"))
    log.add(Finding(severity="warning", kind="dtype/compute", role="actor", where="y", step=1, message="m"))
    got = {(f.kind, f.where): (f.step, f.count) for f in log.all()}
    assert got == {
        ("dtype/module_input", "a"): (2, 3),
        ("dtype/module_input", "b"): (3, 1),
        ("dtype/compute", "x"): (1, 2),
    }
    assert log.take_step_counts() == {"error": 2, "warning": 1, "info": 0}
    assert log.take_step_counts() == {"error": 0, "warning": 0, "info": 0}


def test_audit_settings_sampling_and_errors():
    s = AuditSettings(level="full", full_steps=2, every=5)
    assert [k for k in range(12) if s.is_full(k)] == [0, 1, 5, 10]
    assert not any(AuditSettings(level="boundary").is_full(k) for k in range(5))
    with pytest.raises(ValueError, match="audit.level: 'loud'"):
        AuditSettings(level="loud")
    with pytest.raises(ValueError, match="audit.every"):
        AuditSettings(every=-1)


def test_rollout_ids_against_model_and_tokenizer_vocabularies():
    # Found on the 2 x H200 run: the llama2-7b preset has 32000 embedding rows, the project's tokenizer 100.
    # Ids in [100, 32000) are valid for the model but undecodable -> warning; ids >= 32000 -> error.
    base = dict(
        engine="static-decode",
        engine_dtype=BF16,
        actor_compute_dtype=BF16,
        response_mask=torch.ones(1, 2, dtype=I64),
        logprobs=torch.zeros(1, 2),
    )
    prompt = torch.tensor([[5, 7]])
    ok = B.check_rollout(
        prompt_ids=prompt,
        response_ids=torch.tensor([[3, 99]]),
        vocab_size=100,
        model_vocab_size=32000,
        **base,
    )
    assert ok == []
    f = B.check_rollout(
        prompt_ids=prompt,
        response_ids=torch.tensor([[3, 31994]]),
        vocab_size=100,
        model_vocab_size=32000,
        **base,
    )
    assert kinds(f) == [("warning", "boundary/vocab_mismatch")] and f[0].observed == [3, 31994]
    f = B.check_rollout(
        prompt_ids=prompt,
        response_ids=torch.tensor([[3, 32000]]),
        vocab_size=100,
        model_vocab_size=32000,
        **base,
    )
    assert kinds(f) == [("error", "boundary/rollout_token_range")]
    # without a model size, the tokenizer's vocabulary is the limit (the old behaviour)
    f = B.check_rollout(prompt_ids=prompt, response_ids=torch.tensor([[3, 150]]), vocab_size=100, **base)
    assert kinds(f) == [("error", "boundary/rollout_token_range")]


def test_an_error_is_not_folded_into_an_earlier_info_of_the_same_place():
    # a reward function returning a Python list with a NaN: the boundary check gives an info (a list,
    # converted) and an error (1 of 2 non-finite) at the same (kind, role, where); the error must stay
    raw = [1.0, float("nan")]
    found = B.check_reward(
        raw,
        torch.tensor(raw),
        source="function:f",
        expected_shape=(2,),
        train_device=torch.device("cpu"),
        step=0,
        phase="reward",
    )
    assert sorted(f.severity for f in found) == ["error", "info"]
    log = FindingLog()
    log.extend(found)
    assert sorted(f.severity for f in log.all()) == ["error", "info"]
    # repeats of the same severity still fold into one record with a count
    log.extend(found)
    assert sorted((f.severity, f.count) for f in log.all()) == [("error", 2), ("info", 2)]


def test_relabelled_findings_keep_later_errors_apart():
    log = FindingLog()
    err = Finding(severity="error", kind="numerics/overflow", role="actor", where="m", step=1, message="x")
    log.add(err)
    assert log.relabel(lambda f: f.step == 1, "warning", "handled") == 1
    # a later overflow at the same module that nobody handled is a new error record, not a repeat
    assert log.add(dataclasses.replace(err, step=5)) is True
    assert sorted((f.severity, f.step) for f in log.all()) == [("error", 5), ("warning", 1)]


def test_integer_rewards_all_one_value_are_a_warning():
    kw = {"source": "function:r", "expected_shape": (3,), "train_device": "cpu"}
    truncated = np.array([0.5, 0.75, 0.25]).astype(int)  # partial credit written into an int array: 0, 0, 0
    f = B.check_reward(truncated, None, **kw)
    assert kinds(f) == [("warning", "boundary/reward_integer")] and "truncated" in f[0].message
    assert "float" in f[0].fix and f[0].observed["values"] == [0.0]
    assert kinds(B.check_reward(torch.zeros(3, dtype=torch.long), None, **kw)) == [
        ("info", "boundary/reward_dtype"),
        ("warning", "boundary/reward_integer"),
    ]
    assert B.check_reward(np.array([1, 0, 1]), None, **kw) == []  # 0/1 rewards that vary: fine


def test_batch_rows_must_be_the_examples():
    ids = torch.tensor([[3, 4, 5], [3, 4, 5]], dtype=I64)
    good = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert B.check_batch(good, role="actor", source="x", tokenizer_info=TOK, rows=2) == []
    # pad_sequence without batch_first: [length, batch] for 2 examples
    t = {k: v.T.contiguous() for k, v in good.items()}
    t["attention_mask"][0, :] = 0  # the transposed mask's zeros are no padding side: not reported
    f = B.check_batch(t, role="actor", source="c.py:col", tokenizer_info=TOK, rows=2)
    assert kinds(f) == [("error", "boundary/collator_shape")] and "time-major" in f[0].message
    assert "batch_first=True" in f[0].fix and f[0].where == "collator:c.py:col.input_ids"


class _Cfg:
    def __init__(self, eos):
        self.eos_token_id = eos


class _Model:
    def __init__(self, eos, recorded=None):
        self.config = _Cfg(eos)
        self.overridden_settings = recorded or []


def test_tokenizer_eos_against_the_model_config():
    cfg = {"model": {"path": "/m", "tokenizer": "/tok"}}
    f = B.check_tokenizer_eos(cfg, _Model(2), {"eos_token_id": 99})
    assert kinds(f) == [("error", "model/tokenizer_special_ids")] and f[0].where == "model.tokenizer (/tok)"
    assert "eos_token_id 99" in f[0].message and "model.tokenizer: /m" in f[0].fix
    assert B.check_tokenizer_eos(cfg, _Model(2), {"eos_token_id": 2}) == []
    assert B.check_tokenizer_eos(cfg, _Model([1, 7]), {"eos_token_id": 7}) == []  # one of several eos
    # the checkpoint's generation config ends with the tokenizer's eos (the trainer recorded it): fine
    gen = [{"setting": "model.path generation_config.eos_token_id", "yours": 9, "used": 9}]
    assert B.check_tokenizer_eos(cfg, _Model(2, gen), {"eos_token_id": 9}) == []
    assert B.check_tokenizer_eos(cfg, _Model(None), {"eos_token_id": 9}) == []
