"""Dtype names and PyTorch's dtype-error messages, understood the same way live and from a log.

`dtype_name(x)` turns anything that names a dtype (``torch.bfloat16``, ``"c10::Half"``,
``"struct c10::Half"``, ``"torch.cuda.FloatTensor"``, ``"CPUBFloat16Type"``, ``"long int"``,
``"Float"``) into the short names the run directory uses (``bf16``, ``fp16``, ``fp32``, ``int64``...);
for a torch.dtype it agrees with `trainer.precision.dtype_name`. `parse_dtype_message(text)` finds the
first dtype error PyTorch raises in ``text`` (one wording table, `WORDINGS`, each entry naming the
PyTorch source that emits it) and says which operand's dtype was observed and which was expected.
The Auditor classifies a failed run with it (`verlaudit.audit.errors`) and `verlaudit diagnose`
reads logs and a run's recorded traceback with it (`verlaudit.analysis.logs.exceptions`). This module
imports nothing from verlaudit (and not torch). Exercised by `pytest tests/test_dtypes.py`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# lower-cased spellings -> short name. Sources of spellings: torch.dtype str (``torch.float32``),
# c10::ScalarType names (``Float``, ``BFloat16``), caffe2::TypeMeta names printed by ``tensor.dtype()``
# in C++ messages (``float``, ``c10::Half``, ``long int``, MSVC's ``struct c10::Half`` / ``__int64``),
# legacy tensor type names (``torch.cuda.HalfTensor``, ``CPUBFloat16Type``) and cuBLAS's cudaDataType.
_NAMES = {
    "fp32": ("float", "float32", "fp32", "cuda_r_32f"),
    "fp16": ("half", "float16", "fp16", "cuda_r_16f"),
    "bf16": ("bfloat16", "bf16", "cuda_r_16bf"),
    "fp64": ("double", "float64", "fp64", "cuda_r_64f"),
    "int64": ("long", "int64", "long int", "long long", "long long int", "__int64"),
    "int32": ("int", "int32"),
    "int16": ("short", "int16", "short int"),
    "int8": ("char", "int8", "signed char"),
    "uint8": ("byte", "uint8", "unsigned char"),
    "bool": ("bool",),
    "complex64": ("complex64", "complexfloat", "complex<float>"),
    "complex128": ("complex128", "complexdouble", "complex<double>"),
}
_SHORT = {spelling: short for short, spellings in _NAMES.items() for spelling in spellings}
_DECOR = re.compile(r"^(?:(?:struct|class) )?(?:torch\.)?(?:cuda\.)?(?:c10::)?")
_LEGACY = re.compile(r"^(?:cpu|cuda|xpu|mps|hip)(\w+?)type$")  # CPUBFloat16Type, CUDAHalfType


def dtype_name(value: Any) -> str | None:
    """The short name of a dtype given as a torch.dtype or as any spelling PyTorch prints; an
    unrecognised spelling comes back lower-cased without its decorations, None stays None."""
    if value is None:
        return None
    word = str(value).strip().strip("'\"`,.:;()").lower()
    word = _DECOR.sub("", word)
    legacy = _LEGACY.match(word)
    if legacy:
        word = legacy[1]
    elif word.endswith("tensor") and word != "tensor":
        word = word[: -len("tensor")]
    return _SHORT.get(word, word) or None


@dataclasses.dataclass(frozen=True)
class Wording:
    """One dtype-error message PyTorch emits: where it comes from and how to read it."""

    name: str
    hint: str
    """Text every message of this wording contains: a cheap `in` test before the regex (a log of
    hundreds of megabytes is searched for every wording)."""
    source: str
    """The PyTorch file that raises it (aten/src/ATen/... or torch/...)."""
    pattern: re.Pattern[str]
    """Named groups ``obs`` / ``exp`` hold the observed / expected dtype where the message gives them."""
    what: str
    """What the message means, in one sentence."""
    expected: str | None = None
    """The expected dtype when the message implies one without naming it."""
    observed: str | None = None
    """The observed dtype when the message implies one without naming it."""


# A type as PyTorch prints it: a word with namespaces, dots or template brackets, optionally
# preceded by one of the C++ words a TypeMeta name may carry ("long int", "struct c10::Half").
_T = r"(?:(?:struct|class|signed|unsigned|long|short) )?[\w:.<>]+"
_MISMATCH = "An op received operands (or input and weights) of different dtypes outside autocast."
# The operand named first in a message is reported as observed and the second as expected: for a
# linear layer that is the activation (mat1 / input / query) against the weight (mat2 / key).
WORDINGS: tuple[Wording, ...] = (
    Wording(
        "scalar_type",
        "expected scalar type ",
        "aten/src/ATen/templates/TensorMethods.cpp (Tensor::data_ptr<T>'s check; also at::where)",
        re.compile(rf"expected scalar type (?P<exp>{_T}) but found (?P<obs>{_T})"),
        _MISMATCH,
    ),
    Wording(
        "mat1_mat2",
        " and mat2 must have the same dtype",
        "aten/src/ATen/native/LinearAlgebra.cpp (addmm / mm meta functions)",
        re.compile(
            rf"\b(?:mat1|self) and mat2 must have the same dtype(?:, but got (?P<obs>{_T}) and (?P<exp>{_T}))?"
        ),
        _MISMATCH,
    ),
    Wording(
        "cpu_addmm",
        "expected m1 and m2 to have the same dtype",
        "aten/src/ATen/native/LinearAlgebra.cpp (addmm_impl_cpu_: the CPU / oneDNN matmul path)",
        re.compile(rf"expected m1 and m2 to have the same dtype, but got:? (?P<obs>{_T}) != (?P<exp>{_T})"),
        _MISMATCH,
    ),
    Wording(
        "cuda_addmm",
        "expected mat1 and mat2 to have the same dtype",
        "aten/src/ATen/native/cuda/Blas.cpp (addmm_out_cuda_impl; XPU: aten/src/ATen/native/mkldnn/xpu/Blas.cpp)",
        re.compile(
            rf"expected mat1 and mat2 to have the same dtype, but got:? (?P<obs>{_T}) != (?P<exp>{_T})"
        ),
        _MISMATCH,
    ),
    Wording(
        "conv_input_weight",
        ") should be the same",
        "aten/src/ATen/native/Convolution.cpp (check_input_same_type_as_parameters; cuDNN path too)",
        re.compile(
            r"Input type \((?P<obs>[^)]+)\) and (?:weight|bias) type \((?P<exp>[^)]+)\) should be the same"
        ),
        _MISMATCH,
    ),
    Wording(
        "sdpa_qkv",
        "key, and value to have the same dtype",
        "aten/src/ATen/native/transformers/attention.cpp (validate_sdpa_input)",
        re.compile(
            rf"Expected query, key, and value to have the same dtype, but got query\.dtype: (?P<obs>{_T}),? "
            rf"key\.dtype: (?P<exp>{_T})"
        ),
        "scaled_dot_product_attention received query, key and value of different dtypes (a KV cache or a "
        "rotary output kept in another dtype than the projections).",
    ),
    Wording(
        "sdpa_mask",
        "Expected attn_mask dtype",
        "aten/src/ATen/native/transformers/attention.cpp (validate_sdpa_input)",
        re.compile(
            rf"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            rf"attn_mask\.dtype: (?P<obs>{_T}),? and +query\.dtype: (?P<exp>{_T})"
        ),
        "The attention mask is neither bool nor the query's dtype (an integer padding mask passed as attn_mask).",
    ),
    Wording(
        "dot",
        "expected both vectors to have same dtype",
        "aten/src/ATen/native/LinearAlgebra.cpp and aten/src/ATen/native/cuda/Blas.cpp (dot_check)",
        re.compile(rf"expected both vectors to have same dtype, but found (?P<obs>{_T}) and (?P<exp>{_T})"),
        _MISMATCH,
    ),
    Wording(
        "index_put",
        "Index put requires the source and destination dtypes match",
        "aten/src/ATen/native/TensorAdvancedIndexing.cpp (index_put_; autocast outputs written into fp32 buffers)",
        re.compile(
            rf"Index put requires the source and destination dtypes match, got (?P<exp>{_T}) for the "
            rf"destination and (?P<obs>{_T}) for the source"
        ),
        "An indexed assignment wrote a tensor of another dtype into a buffer: typically an autocast output "
        "(bf16/fp16) stored into an fp32 tensor.",
    ),
    Wording(
        "scatter",
        "(): Expected self.dtype to be equal to src.dtype",
        "aten/src/ATen/native/ScatterGatherChecks.h (scatter_gather_dtype_check)",
        re.compile(r"\(\): Expected self\.dtype to be equal to src\.dtype"),
        "A scatter wrote values of another dtype than its destination (often an autocast output).",
    ),
    Wording(
        "result_type",
        "can't be cast to the desired output type",
        "aten/src/ATen/TensorIterator.cpp (compute_types: an in-place or out= result that cannot hold the result)",
        re.compile(rf"result type (?P<obs>{_T}) can't be cast to the desired output type (?P<exp>{_T})"),
        "An in-place or out= op would have to store its result in a narrower dtype (a float into an "
        "integer tensor, or fp32 into a low-precision one).",
    ),
    Wording(
        "mixed_norm",
        "mixed dtype (CPU): expect parameter",
        "aten/src/ATen/native/mixed_type.h (check_mixed_data_type: layer/group/batch norm on CPU)",
        re.compile(r"mixed dtype \(CPU\): expect parameter to have scalar type of (?P<exp>\w+)"),
        "A normalisation layer got low-precision input with parameters that are neither the input's dtype "
        "nor fp32.",
    ),
    Wording(
        "indices",
        "Expected tensor for argument #",
        "aten/src/ATen/TensorUtils.cpp (checkScalarTypes / checkScalarType: embedding indices)",
        re.compile(
            rf"Expected tensor for argument #\d+ '\w+' to have (?:one of the following scalar types: |scalar "
            rf"type )(?P<exp>\w+)[^;]*; but got (?P<obs>{_T}) instead"
        ),
        "Token ids (or other indices) reached an embedding / lookup as a floating tensor: ids must stay "
        "integer (torch.long).",
    ),
    Wording(
        "gather_index",
        " for index",
        "aten/src/ATen/native/ScatterGatherChecks.h (gather / scatter index dtype check)",
        re.compile(r"\(\): Expected dtype int(?:32/int)?64 for index"),
        "A gather / scatter index is not an integer tensor (token ids cast to float before gathering log-probs).",
        expected="int64",
    ),
    Wording(
        "index_tensor",
        "tensors used as indices must be",
        "aten/src/ATen/native/IndexingUtils.h (expandTensors: advanced indexing)",
        re.compile(r"tensors used as indices must be long, int, byte or bool tensors"),
        "A tensor used as an index is floating: indices and masks must be integer or bool.",
        expected="int64",
    ),
    Wording(
        "nll_target",
        "expected target dtype to be",
        "aten/src/ATen/native/LossNLL.cpp (nll_loss / cross_entropy target check)",
        re.compile(rf"expected target dtype to be Long or Byte, but got (?P<obs>{_T})"),
        "The targets of a cross-entropy / NLL loss are floating: class targets must be integer ids.",
        expected="int64",
    ),
    Wording(
        "numpy",
        "Got unsupported ScalarType",
        "torch/csrc/utils/tensor_numpy.cpp (aten_to_numpy_dtype: Tensor.numpy(), np.asarray)",
        re.compile(r"Got unsupported ScalarType (?P<obs>\w+)"),
        "NumPy has no such dtype: a .numpy() / np.asarray on a bf16 (or fp8) tensor fails.",
        expected="fp32",
    ),
    Wording(
        "not_implemented",
        "\" not implemented for '",
        "aten/src/ATen/Dispatch.h (AT_DISPATCH's default case; torch/headeronly/core/Dispatch.h)",
        re.compile(r"\"(?P<op>\w+)\" not implemented for '(?P<obs>[\w:]+)'"),
        "The op has no kernel for this dtype on this device (fp16 on CPU, bf16 on an old GPU, an integer "
        "tensor where a float one was meant).",
    ),
    Wording(
        "cublas_unsupported",
        "CUBLAS_STATUS_NOT_SUPPORTED",
        "aten/src/ATen/cuda/CUDABlas.cpp (TORCH_CUDABLAS_CHECK, aten/src/ATen/cuda/Exceptions.h)",
        re.compile(
            r"CUBLAS_STATUS_NOT_SUPPORTED when calling `cublas\w*\([^`]*?\b(?P<obs>CUDA_R_(?:16BF|16F))\b"
        ),
        "cuBLAS on this GPU has no GEMM for this dtype (bf16 before Ampere, or a CUDA build without it).",
    ),
    Wording(
        "autocast_bce",
        "unsafe to autocast",
        "aten/src/ATen/autocast_mode.cpp (binary_cross_entropy_banned)",
        re.compile(r"binary_cross_entropy and torch\.nn\.BCELoss are unsafe to autocast"),
        "binary_cross_entropy is banned under autocast: its fp16/bf16 input (a sigmoid output) loses the "
        "precision the loss needs; use binary_cross_entropy_with_logits on the logits.",
        expected="fp32",
    ),
    Wording(
        "autocast_bf16_device",
        "does not support bfloat16",
        "torch/amp/autocast_mode.py (autocast.__init__)",
        re.compile(r"Current CUDA Device does not support bfloat16\. Please switch dtype to float16"),
        "autocast was asked for bf16 on a GPU without bf16 support.",
        expected="fp16",
        observed="bf16",
    ),
    Wording(
        "grad_dtype",
        "to a tensor with grad_dtype",
        "torch/csrc/autograd (the accumulate-grad check of Tensor.grad_dtype, which FSDP2's mixed precision sets)",
        re.compile(
            r"assign a gradient with dtype '?(?P<obs>[\w:.]+)'? to a tensor with grad_dtype '?(?P<exp>[\w:.]+)'?"
        ),
        "autograd produced a gradient in another dtype than the parameter's grad_dtype allows (FSDP2's "
        "MixedPrecisionPolicy fixes each parameter's gradient dtype when it initialises, lazily at the first "
        "forward; a parameter frozen or unfrozen after that gets gradients in the compute dtype).",
    ),
    # logsg branch: any kernel's check that two named operands share one dtype, in the shape every such check
    # takes ("query and key must have the same dtype" of flash-attn's varlen forward, "x and weight must have
    # the same dtype", "q and k should be the same dtype"); after the specific wordings, which win a tie
    Wording(
        "same_dtype",
        "same dtype",
        "any kernel's operand check (flash-attn csrc/flash_attn/flash_api.cpp TORCH_CHECK(q_dtype == k_dtype); "
        "fused kernels' TORCH_CHECKs of the same shape)",
        re.compile(
            rf"\b(?P<a>[A-Za-z_]\w*) and (?P<b>[A-Za-z_]\w*) (?:must|should|to) (?:have|be) (?:the )?same dtypes?"
            rf"(?:,? but (?:got|found):? (?P<obs>{_T})(?: and | != | vs\.? )(?P<exp>{_T}))?"
        ),
        "A kernel received two operands it needs in one dtype in different dtypes (a tensor kept or cast in "
        "another dtype than the ones it meets: a KV cache, a LoRA-merged or upcast weight, a rotary output).",
    ),
)
_BY_NAME = {w.name: w for w in WORDINGS}


@dataclasses.dataclass(frozen=True)
class DtypeMessage:
    """A dtype error found in a message or a log."""

    wording: str
    """The `Wording` name that matched."""
    observed: str | None
    """Short name of the odd operand's dtype (the activation / source / index), when the message says."""
    expected: str | None
    """Short name of the dtype it should have had (the weight's, the destination's), when known."""
    message: str
    """The matched text."""
    start: int
    """Where the match starts in the searched text."""
    op: str | None = None
    """The op named by a not-implemented message (``addmm_impl_cpu_``)."""

    @property
    def what(self) -> str:
        return _BY_NAME[self.wording].what

    def to_dict(self) -> dict[str, str | None]:
        return {"observed": self.observed, "expected": self.expected, "pattern": self.wording}


def _from_match(w: Wording, m: re.Match[str]) -> DtypeMessage:
    groups = m.groupdict()
    observed = dtype_name(groups.get("obs")) or w.observed
    expected = dtype_name(groups.get("exp")) or w.expected
    return DtypeMessage(w.name, observed, expected, m[0], m.start(), op=groups.get("op"))


def find_dtype_messages(text: str, pos: int = 0) -> list[DtypeMessage]:
    """The first match of every wording found in ``text`` from ``pos`` on, in the order they appear."""
    found = []
    for w in WORDINGS:
        m = w.pattern.search(text, pos) if w.hint in text else None
        if m:
            found.append(_from_match(w, m))
    return sorted(found, key=lambda d: d.start)


def parse_dtype_message(text: str) -> DtypeMessage | None:
    """The first dtype error in ``text`` (an exception message, a traceback or a log), or None."""
    found = find_dtype_messages(text)
    return found[0] if found else None
