"""Every dtype-error wording PyTorch emits on the backends our users meet is understood the same way
by the live auditor (a run that fails) and by the log reader (`verlaudit diagnose train.log`), and
every spelling of a dtype gets one short name. The messages are fed as strings or raised by a fake
module, never produced by this CPU's kernels (which wording a matmul raises depends on the CPU).

Run: `pytest tests/test_dtypes.py`.
"""

from __future__ import annotations

import copy
import re
import traceback

import pytest
import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.events import Fanout, Observer
from trainer.precision import dtype_name as trainer_dtype_name
from trainer.train import train
from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.audit import Auditor, AuditSettings, errors
from verlaudit.dtypes import WORDINGS, dtype_name, parse_dtype_message

# (message as PyTorch prints it, wording, observed, expected). The source of each wording is the
# `source` of its entry in verlaudit.dtypes.WORDINGS; the file is repeated here for the reader.
MESSAGES = [
    # aten/src/ATen/templates/TensorMethods.cpp: Tensor::data_ptr<T>()
    ("expected scalar type BFloat16 but found Float", "scalar_type", "fp32", "bf16"),
    # the same check printed through TypeMeta (at::where) and by MSVC builds
    ("expected scalar type float but found c10::Half", "scalar_type", "fp16", "fp32"),
    # aten/src/ATen/native/LinearAlgebra.cpp: the addmm / mm meta functions (F.linear with a bias)
    ("mat1 and mat2 must have the same dtype, but got Float and BFloat16", "mat1_mat2", "fp32", "bf16"),
    ("self and mat2 must have the same dtype, but got Float and Half", "mat1_mat2", "fp32", "fp16"),
    # aten/src/ATen/native/LinearAlgebra.cpp: addmm_impl_cpu_ (CPU and oneDNN; an AMX / AVX512-FP16 Xeon
    # raised exactly this in tests/test_worker.py)
    ("expected m1 and m2 to have the same dtype, but got: float != c10::Half", "cpu_addmm", "fp32", "fp16"),
    ("expected m1 and m2 to have the same dtype, but got: long int != float", "cpu_addmm", "int64", "fp32"),
    # ... as a Windows (MSVC) build prints the TypeMeta name
    ("expected m1 and m2 to have the same dtype, but got: struct c10::Half != float", "cpu_addmm", "fp16", "fp32"),
    # aten/src/ATen/native/cuda/Blas.cpp: addmm_out_cuda_impl (cuBLAS / cuBLASLt addmm)
    ("expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16", "cuda_addmm", "fp32", "bf16"),
    # aten/src/ATen/native/Convolution.cpp: check_input_same_type_as_parameters (CUDA / cuDNN, CPU)
    ("Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same",
     "conv_input_weight", "fp16", "fp32"),
    ("Input type (CPUBFloat16Type) and bias type (torch.FloatTensor) should be the same",
     "conv_input_weight", "bf16", "fp32"),
    # aten/src/ATen/native/transformers/attention.cpp: validate_sdpa_input
    ("Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: c10::Half "
     "and value.dtype: c10::Half instead.", "sdpa_qkv", "fp32", "fp16"),
    ("Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: long int "
     "and  query.dtype: float instead.", "sdpa_mask", "int64", "fp32"),
    # aten/src/ATen/native/LinearAlgebra.cpp, cuda/Blas.cpp: dot_check
    ("dot : expected both vectors to have same dtype, but found Float and Half", "dot", "fp32", "fp16"),
    # aten/src/ATen/native/TensorAdvancedIndexing.cpp: index_put_ (an autocast output stored in an fp32 buffer)
    ("Index put requires the source and destination dtypes match, got Float for the destination and "
     "BFloat16 for the source.", "index_put", "bf16", "fp32"),
    # aten/src/ATen/native/ScatterGatherChecks.h
    ("scatter(): Expected self.dtype to be equal to src.dtype", "scatter", None, None),
    ("gather(): Expected dtype int64 for index", "gather_index", None, "int64"),
    # aten/src/ATen/TensorIterator.cpp: compute_types
    ("result type Float can't be cast to the desired output type Long", "result_type", "fp32", "int64"),
    # aten/src/ATen/native/mixed_type.h: layer / group norm on CPU
    ("mixed dtype (CPU): expect parameter to have scalar type of Float", "mixed_norm", None, "fp32"),
    # aten/src/ATen/TensorUtils.cpp: checkScalarTypes (embedding indices)
    ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; but got "
     "torch.FloatTensor instead (while checking arguments for embedding)", "indices", "fp32", "int64"),
    ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; but got "
     "CPUBFloat16Type instead (while checking arguments for embedding)", "indices", "bf16", "int64"),
    # aten/src/ATen/native/IndexingUtils.h
    ("tensors used as indices must be long, int, byte or bool tensors", "index_tensor", None, "int64"),
    # aten/src/ATen/native/LossNLL.cpp
    ("expected target dtype to be Long or Byte, but got Float", "nll_target", "fp32", "int64"),
    # torch/csrc/utils/tensor_numpy.cpp: aten_to_numpy_dtype (Tensor.numpy() of a bf16 tensor)
    ("Got unsupported ScalarType BFloat16", "numpy", "bf16", "fp32"),
    # aten/src/ATen/Dispatch.h: AT_DISPATCH's default case
    ("\"addmm_impl_cpu_\" not implemented for 'Half'", "not_implemented", "fp16", None),
    # aten/src/ATen/cuda/CUDABlas.cpp: TORCH_CUDABLAS_CHECK (bf16 GEMM on a GPU before Ampere)
    ("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmStridedBatchedEx(handle, opa, opb, "
     "(int)m, (int)n, (int)k, (void*)&falpha, a, CUDA_R_16BF, (int)lda, stridea, b, CUDA_R_16BF, (int)ldb, "
     "strideb, (void*)&fbeta, c, CUDA_R_16BF, (int)ldc, stridec, (int)num_batches, compute_type, "
     "CUBLAS_GEMM_DEFAULT_TENSOR_OP)`", "cublas_unsupported", "bf16", None),
    # aten/src/ATen/autocast_mode.cpp: binary_cross_entropy_banned
    ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\nMany models use "
     "a sigmoid layer right before the binary cross entropy layer.", "autocast_bce", None, "fp32"),
    # torch/amp/autocast_mode.py: autocast.__init__
    ("Current CUDA Device does not support bfloat16. Please switch dtype to float16.", "autocast_bf16_device",
     "bf16", "fp16"),
    # torch/csrc/autograd: a gradient outside the parameter's grad_dtype (FSDP2 mixed precision sets it)
    ("attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'.",
     "grad_dtype", "bf16", "fp32"),
    # logsg branch: any kernel's "A and B must have the same dtype" check (flash-attn's varlen forward)
    ("query and key must have the same dtype", "same_dtype", None, None),
    ("x and weight should be the same dtype, but got Half and Float", "same_dtype", "fp16", "fp32"),
]  # fmt: skip
IDS = [f"{w}-{i}" for i, (_, w, _, _) in enumerate(MESSAGES)]


def test_every_wording_has_a_message_here():
    assert {w.name for w in WORDINGS} == {w for _, w, _, _ in MESSAGES}


@pytest.mark.parametrize("message, wording, observed, expected", MESSAGES, ids=IDS)
def test_the_parser_reads_each_wording(message, wording, observed, expected):
    d = parse_dtype_message(f"RuntimeError: {message}")
    assert (d.wording, d.observed, d.expected) == (wording, observed, expected)


@pytest.mark.parametrize("message, wording, observed, expected", MESSAGES, ids=IDS)
def test_the_log_reader_reads_each_wording(tmp_path, message, wording, observed, expected):
    log = tmp_path / "train.log"
    log.write_text(
        "step:1 - actor/pg_loss:-0.013\nTraceback (most recent call last):\n"
        f'  File "/work/train_grpo.py", line 40, in main\n    loss = model(batch)\nRuntimeError: {message}\n'
    )
    (d,) = diagnose_path(log)
    (c,) = [c for c in d.causes if c.kind == "dtype_error"]
    assert d.verdict == "error" and c.data["observed"] == observed
    assert c.data.get("expected") == (expected if wording != "not_implemented" else None)
    assert any(e.startswith("line 5: ") for e in c.evidence), c.evidence


class Raising(nn.Module):
    """A module whose forward raises a given PyTorch message, as a kernel would."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(self.message)


class PlantRaising(Observer):
    """Replaces one module of the actor by `Raising` at setup, before the audit names the modules."""

    def __init__(self, path: str, message: str) -> None:
        self.path, self.message = path, message

    def on_setup(self, *, config, policy, models, tokenizer_info) -> None:
        parent, _, leaf = self.path.rpartition(".")
        setattr(models["actor"].get_submodule(parent), leaf, Raising(self.message))


TINY = {
    "steps": 1, "device": "cpu", "threads": 1,
    "algo": {"name": "grpo", "batch_size": 2, "mini_batch_size": 4, "micro_batch_size": 4, "group_size": 2},
    "data": {"num_examples": 8, "prompt_length": 8, "response_length": 2},
    "precision": {"preset": "fp32"},
}  # fmt: skip


@pytest.mark.parametrize("message, wording, observed, expected", MESSAGES, ids=IDS)
def test_the_live_auditor_reads_each_wording(message, wording, observed, expected):
    """A real (tiny) run whose actor has a fake module raising the message: the Auditor's failure
    (what the worker writes to status.json) is a dtype error at that module with the dtypes read."""
    module = "model.layers.1.mlp.down_proj"
    auditor = Auditor(settings=AuditSettings(level="boundary", full_steps=0, every=0))
    with pytest.raises(RuntimeError):
        with auditor:
            train(
                TrainConfig.from_dict(copy.deepcopy(TINY)), Fanout([PlantRaising(module, message), auditor])
            )
    f = auditor.failure
    assert (f["reason"], f["role"], f["where"], f["phase"]) == ("dtype_error", "actor", module, "rollout")
    assert (f["observed"], f["expected"]) == (observed, expected)
    assert f["traceback"].startswith("Traceback (most recent call last)")
    (finding,) = auditor.findings.find("runtime/dtype_error")
    assert (finding.where, finding.observed, finding.expected) == (module, observed, expected)


SPELLINGS = {
    "fp32": ["Float", "float", "torch.float32", "torch.FloatTensor", "torch.cuda.FloatTensor", "CPUFloatType", "c10::Float"],
    "fp16": ["Half", "c10::Half", "struct c10::Half", "torch.cuda.HalfTensor", "torch.float16", "half."],
    "bf16": ["BFloat16", "c10::BFloat16", "class c10::BFloat16", "CUDABFloat16Type", "torch.bfloat16", "CUDA_R_16BF"],
    "fp64": ["Double", "double", "torch.float64", "torch.DoubleTensor"],
    "int64": ["Long", "long int", "long long", "__int64", "torch.int64", "torch.cuda.LongTensor"],
    "int32": ["Int", "int", "torch.int32"],
    "int8": ["Char", "signed char", "torch.int8"],
    "uint8": ["Byte", "unsigned char", "torch.uint8"],
    "bool": ["Bool", "bool", "CPUBoolType", "torch.bool"],
    "complex64": ["ComplexFloat", "c10::complex<float>", "torch.complex64"],
}  # fmt: skip


@pytest.mark.parametrize("short, spellings", SPELLINGS.items(), ids=list(SPELLINGS))
def test_every_spelling_of_a_dtype_gets_one_short_name(short, spellings):
    assert {s: dtype_name(s) for s in spellings} == dict.fromkeys(spellings, short)


def test_a_torch_dtype_is_named_as_the_trainer_names_it():
    # the trainer cannot import verlaudit, so it keeps its own dtype_name; both must agree
    dtypes = [getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)]
    assert len(dtypes) > 20
    assert {str(d): dtype_name(d) for d in dtypes} == {str(d): trainer_dtype_name(d) for d in dtypes}
    assert dtype_name(None) is None and dtype_name("Float8_e4m3fn") == trainer_dtype_name(torch.float8_e4m3fn)


def test_a_message_that_is_not_a_dtype_error_is_not_one():
    for text in (
        "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)",
        "CUDA out of memory.",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(... CUDA_R_16BF ...)`",
        "Expected all tensors to be on the same device, but found at least two devices",
    ):
        assert parse_dtype_message(text) is None, text
        assert errors.classify(RuntimeError(text)) != "dtype_error"


# ---- a stored traceback keeps its head and its tail ------------------------------------------------


def _deep(n: int) -> None:
    if n == 0:
        raise RuntimeError("expected m1 and m2 to have the same dtype, but got: float != c10::Half")
    _deeper(n - 1)


def _deeper(n: int) -> None:
    _deep(n)  # two functions calling each other: Python does not fold their frames as repeats


def test_a_long_traceback_keeps_its_head_and_tail():
    with pytest.raises(RuntimeError) as info:
        _deep(100)  # about 200 frames: ~25k characters of traceback
    full = "".join(traceback.format_exception(info.value))
    kept = errors.format_traceback(info.value)
    assert len(full) > 15000 and len(kept) <= errors.TRACEBACK_HEAD + errors.TRACEBACK_TAIL + 100
    assert kept.startswith("Traceback (most recent call last):\n")
    assert kept.endswith(
        "RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::Half\n"
    )
    m = re.search(r"\.\.\. \[(\d+) characters of the traceback cut here\] \.\.\.\n", kept)
    first, last = kept[: m.start()], kept[m.end() :]
    # the head and the tail are the full traceback's own, the number is what was left out
    assert full.startswith(first) and full.endswith(last) and len(first) + int(m[1]) + len(last) == len(full)
    # the cut falls on line ends: the kept parts are whole lines
    assert first.endswith("\n") and full[len(full) - len(last) - 1] == "\n"
    assert len(first) > errors.TRACEBACK_HEAD / 2 and len(last) > errors.TRACEBACK_TAIL / 2


def test_a_short_traceback_is_kept_whole():
    with pytest.raises(RuntimeError) as info:
        _deep(3)
    assert errors.format_traceback(info.value) == "".join(traceback.format_exception(info.value))
