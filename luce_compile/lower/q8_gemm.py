"""The prefill GEMM with 8-bit activations (--prefill-gemm q8): what the lowering needs of it.

llama.cpp's CUDA prompt processing (ggml-cuda/mmq.cuh, "MMQ") quantizes a matmul's input to 8-bit blocks of 32
values, unpacks the weights to int8 and multiplies on integer tensor cores (mma.sync m16n8k32 s8 × s8 → s32), then
scales each 32-value block's int32 sum in float32. schedules/gpu/mmq_gemm.py is that kernel; this module says which
weight types it takes, which activations each pairs with, and gives the function the Relax module calls.

The activations are the CPU int8 build's formats (cpu_int8.Q8Format, quantize_q8's arithmetic, which the emulating
oracle follows: graph/rounding.q8_blocks): per 32 values d = fp16(amax/127), q = rint(x · 127/amax), and for the
types with a weight minimum s = fp16(d · Σq). Which types take the sums is what the emulating oracle's gpu_q8_1
forms say (graph/rounding.GPU_Q8_1_TYPES, Q8_1_TYPES): Q4_1/Q5_1 and the K-quants with a minimum per 32 values take
Q8_1 (a weight's minimum m times s); Q4_0/Q5_0/Q6_K/Q3_K (stored with an offset, centred in the kernel) and Q8_0
take Q8_0, and so does Q2_K, whose minimum per 16 values the kernel multiplies by the exact sum of those 16 rounded
activations, which it takes from the quants themselves (schedules/gpu/mmq_blocks.py's docstring). The order of the
32 values is the CPU's (INT8_FORMATS: "nibbles" for 2-6 bit quants, natural for Q8_0). llama.cpp's CUDA quantizer
rounds half away from zero and keeps Σx (not d·Σq) as the sum; ours are the CPU's (ggml's x86 path), the ones the
megakernel's 8-bit matvecs and the emulating oracle already use: a tie at .5 is the only place the roundings differ.

The quantized input is scratch of the GEMM call: three more output tensors (xq, xd [, xs], fmt.specs) after y that
Relax allocates with the rest of a step's memory, so that a prefill captured as a CUDA graph allocates nothing (a
cudaMalloc during capture fails). compile_model builds it by default for precision f16 on CUDA (--prefill-gemm,
LowerOptions.prefill_gemm), where it replaces the float16 tensor-core GEMM above the low-batch buckets (> 8 rows)
for the types below; the manifest's kernels.prefill_gemm records the choice and the types it served.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType
from tvm import tirx

from luce_compile.lower.cpu_int8 import INT8_FORMATS, Q8Format
from luce_compile.lower.quant_layout import as_ggml_type
from luce_compile.lower.quant_matmul import TENSOR_CORE_TWIN, quant_matmul, with_tensor_core_twin

PREFILL_GEMMS = ("f16", "q8")  # --prefill-gemm: the float16 tensor-core GEMM (mma_gemm.py), or this one
# attr of the float16 twin of a function built for the 8-bit GEMM: schedules/gpu/quant_gemm.py then runs mmq_gemm.py
# above the low-batch buckets (the twin still says the shape and the weight type)
Q8_GEMM_ATTR = "luce.q8_gemm"
# the weight types the kernel takes, and the activations each dots: with the block sums (Q8_1) where the weight has a
# minimum per 32 values, else without (Q8_0; Q2_K's minima per 16 values take sums the GEMM forms from the quants)
Q8_GEMM_ACTIVATIONS: dict[str, str] = {"Q4_0": "Q8_0", "Q4_1": "Q8_1", "Q5_0": "Q8_0", "Q5_1": "Q8_1",
                                       "Q8_0": "Q8_0", "Q4_K": "Q8_1", "Q5_K": "Q8_1", "Q6_K": "Q8_0",
                                       "Q3_K": "Q8_0", "Q2_K": "Q8_0",
                                       "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_0", "MXFP4": "Q8_0"}  # codebooks: int8 values
# what the kernel subtracts from a stored quant before the integer dot (ggml's centring of the signed types; Q3_K's
# 3 bits with the hmask bit as the third: −4..3, as ggml's q3_K dequantizer)
Q8_GEMM_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4}


def q8_gemm_format(ggml_type: GGMLQuantizationType | str) -> Q8Format | None:
    """The activations of the 8-bit GEMM for a weight type, or None where it does not take the type."""
    name = as_ggml_type(ggml_type).name
    if name not in Q8_GEMM_ACTIVATIONS:
        return None
    return Q8Format(Q8_GEMM_ACTIVATIONS[name], INT8_FORMATS[GGMLQuantizationType[name]].order)


def check_prefill_gemm(choice: str) -> str:
    if choice not in PREFILL_GEMMS:
        raise ValueError(f"lower: prefill GEMM {choice!r} is not one of {PREFILL_GEMMS}")
    return choice


def q8_gemm_types(ggml_types, x_dtype: str = "float32") -> list[str]:
    """The names of the types of `ggml_types` the 8-bit GEMM serves (float32 activations only), sorted."""
    if x_dtype != "float32":
        return []
    return sorted({as_ggml_type(t).name for t in ggml_types} & set(Q8_GEMM_ACTIVATIONS))


def q8_gemm_matmul(ggml_type: GGMLQuantizationType | str, n_out: int, n_in: int, *, name: str) -> tirx.PrimFunc:
    """quant_matmul's dynamic-batch function (x (batch, n_in), *planes, y) with the quantized input's scratch as more
    arguments after y (fmt.specs: xq (batch, n_in) int8, xd (batch, n_in/32) float32 [, xs]), and its float16 twin
    marked with Q8_GEMM_ATTR. The float32 computation is the low-batch buckets' (and the exact reference); the
    scratch is written only by the 8-bit kernel above them."""
    fmt = q8_gemm_format(ggml_type)
    if fmt is None:
        raise ValueError(f"lower: the 8-bit GEMM does not take {as_ggml_type(ggml_type).name}; it takes "
                         f"{sorted(Q8_GEMM_ACTIVATIONS)}")
    func = quant_matmul(ggml_type, n_out, n_in, name=name, scratch=scratch_specs(fmt, n_in))
    func = with_tensor_core_twin(func, ggml_type, n_out, n_in)
    return func.with_attr(TENSOR_CORE_TWIN, func.attrs[TENSOR_CORE_TWIN].with_attr(Q8_GEMM_ATTR, True))


def is_q8_gemm(func: tirx.PrimFunc) -> bool:
    """Whether func is q8_gemm_matmul's: its float16 twin carries Q8_GEMM_ATTR."""
    twin = func.attrs.get(TENSOR_CORE_TWIN) if func.attrs else None
    return twin is not None and Q8_GEMM_ATTR in twin.attrs


def scratch_tensors(ggml_type: GGMLQuantizationType | str, n_in: int, rows) -> list:  # noqa: ANN001  (int or Var)
    """The quantized input of `rows` rows as Relax placeholders: the scratch outputs a call to an 8-bit GEMM (dense,
    or the grouped expert form) gives after y."""
    from tvm.relax.frontend import nn

    specs = scratch_specs(q8_gemm_format(ggml_type), n_in, rows)
    return [nn.Tensor.placeholder(shape, dtype) for shape, dtype in specs.values()]


def scratch_specs(fmt: Q8Format, n_in: int, rows: int | str = "batch") -> dict[str, tuple[tuple, str]]:
    """Name → ((rows, columns), dtype) of the quantized input, the GEMM's scratch outputs (`rows` a name: the
    function's batch)."""
    return {name: ((rows, shape[1]), dtype) for name, (shape, dtype) in fmt.specs(n_in).items()}
