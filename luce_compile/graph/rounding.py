"""The float64 oracle with llama.cpp's activation roundings emulated, for checks of kernels that quantize
activations as llama.cpp does (the CPU int8 build, the megakernel's q8_activations) and against llama.cpp itself.

Before a matmul with a quantized weight, ggml rounds the activations to 8 bits (ggml-cpu.c, type_traits_cpu[].
vec_dot_type): Q8_0 blocks for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4 weights, Q8_1 (the same values plus an fp16 block sum
used against the weight's block minimum) for Q4_1/Q5_1, Q8_K for K-quants and IQ4_XS; for F16 weights it rounds
them to fp16. Its CPU GELU reads a table indexed by the input rounded to fp16 (ggml-cpu/vec.h, GGML_GELU_FP16).
`GgmlRounding` adds exactly those roundings to the oracle, for the weight types it is given (all of them by
default), and the megakernel's tf32 rounding of the inputs of F16/BF16 matvecs on tensor cores (float_mma) for the
types given as `tf32_types`.
The megakernel's 8-bit matvecs round as llama.cpp's CUDA mmvq does, q8_1 blocks of 32 for every type, K-quants too
(`GPU_Q8_1_TYPES`: Q4_K's and Q5_K's d·sc and −dmin·mn per 32 values are a Q4_1/Q5_1 block's d and m; Q6_K, with no
minimum, takes their q8_0 values), where the CPU takes q8_K.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from luce_compile.gguf.quants import k_quant_minimums
from luce_compile.gguf.reader import GGUFFile
from luce_compile.graph.ir import Graph
from luce_compile.graph.oracle import Oracle, gelu_tanh
from luce_compile.graph.rope_pairs import graph_raw


def f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to tf32 as the megakernel's float_mma rounds its inputs (emit_cuda.tf32: float32, then the 13 low
    mantissa bits rounded off to nearest, ties away from zero; cvt.rna.tf32.f32)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's x86 quantize_row_q8_0/q8_1: q = rint(x · 127/amax) per 32 values, d = amax/127 (float32)."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.rint(b * inv), amax / np.float32(127)


def q8_0(x: np.ndarray) -> np.ndarray:
    q, d = q8_blocks(x)
    return (q * f16(d)).reshape(x.shape)  # the block scale is stored as f16


def q8_k_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: per 256 values, iscale = -127/max (max: the first value of largest magnitude),
    q = min(127, rint(iscale · x)), d = 1/iscale (kept as float32). Returns q (..., nb, 256), d (..., nb, 1)."""
    b = x.reshape(*x.shape[:-1], -1, 256).astype(np.float32)
    top = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    iscale = np.divide(np.float32(-127), top, out=np.zeros_like(top), where=top != 0)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return np.minimum(np.rint(iscale * b), 127), d


def q8_k(x: np.ndarray) -> np.ndarray:
    q, d = q8_k_blocks(x)
    return (q * d.astype(np.float64)).reshape(x.shape)


ACTIVATION_ROUNDING = {
    "F16": f16,
    "Q8_0": q8_0,
    "Q4_0": q8_0,
    "Q5_0": q8_0,
    "Q4_K": q8_k,
    "Q5_K": q8_k,
    "Q6_K": q8_k,
    "Q2_K": q8_k,
    "Q3_K": q8_k,
    "IQ4_XS": q8_k,
    "IQ4_NL": q8_0,
    "MXFP4": q8_0,
}
Q8_1_TYPES = ("Q4_1", "Q5_1")  # Q8_1 activations: q8_0's values plus s = fp16(d · Σq) against the block minimum
GPU_Q8_1_TYPES = ("Q4_K", "Q5_K")  # with gpu_q8_1: q8_1 activations against their per-32 minimum (the megakernel)
# with gpu_q8_1: q8_1 blocks of 32 whose sums no minimum takes, i.e. q8_0's values (llama.cpp's CUDA forms of the
# 256-value types without a minimum; IQ4_XS under the megakernel's q8_codebooks; Q3_K in the 8-bit prefill GEMM), and
# Q2_K, whose minimum per 16 values takes the sum of those 16 quants times d (an integer sum: llama.cpp's mmvq
# dp4a's it against 4 × m, the 8-bit GEMM by an mma against ones), i.e. the same q8_0 values exactly
GPU_Q8_0_TYPES = ("Q6_K", "IQ4_XS", "Q3_K", "Q2_K")


def block_minimums(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Each 32-value block's minimum term m (w = d·q + m) of a (…, K) weight's raw GGUF rows, (out, K/32) float64:
    −dmin·mn of each sub-block for GPU_Q8_1_TYPES, the block's own m for Q4_1/Q5_1."""
    if kind in GPU_Q8_1_TYPES:
        return k_quant_minimums(raw, GGMLQuantizationType[kind])
    blocks = raw.reshape(*shape[:-1], shape[-1] // 32, -1)  # block_q4_1 / block_q5_1 start with f16 d, then f16 m
    return blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def q8_1_matmul(x: np.ndarray, w: np.ndarray, m: np.ndarray) -> np.ndarray:
    """x (…, K) rounded to q8_1 blocks times weights w (N, K) whose 32-value blocks have minimum terms m (N, K/32),
    as ggml's vec_dot_q4_1_q8_1 sums it: Σ_blocks d_w·d_x·Σ q_w·q_x + m·s_x, with d·q = w − m and
    s_x = f16(d_x · Σ q_x) from the float32 d_x (float64: only the activations' rounding is emulated)."""
    q, d = q8_blocks(x)
    y = (q * f16(d)).reshape(x.shape) @ (w - np.repeat(m, 32, axis=-1)).T
    return y + f16(d[..., 0] * q.sum(-1)) @ m.T


def gpu_q8_matmul(x: np.ndarray, w: np.ndarray, kind: str, raw: np.ndarray) -> np.ndarray:
    """x (…, K) @ w (N, K)ᵀ in float64 with x rounded as llama.cpp's CUDA kernels round it for weight type `kind` (the
    gpu_q8_1 forms below: the megakernel's 8-bit matvecs, the 8-bit prefill GEMM); `raw` the weight's GGUF rows."""
    if kind in Q8_1_TYPES + GPU_Q8_1_TYPES:
        return q8_1_matmul(x, w, block_minimums(raw, kind, w.shape))
    return (q8_0 if kind in GPU_Q8_0_TYPES else ACTIVATION_ROUNDING[kind])(x) @ w.T


class GgmlRounding(Oracle):
    """The oracle plus llama.cpp's CPU roundings of activations (module docstring). `types`: the weight types whose
    matmul inputs are rounded (None: every type ggml rounds for); `gelu_table`: ggml's fp16 GELU table;
    `tf32_types`: weight types whose matmul inputs are rounded to tf32 instead (the megakernel's float_mma);
    `gpu_q8_1`: K-quants of GPU_Q8_1_TYPES take q8_1 blocks of 32 (the megakernel's 8-bit matvecs), not q8_K."""

    def __init__(self, source: Graph | GGUFFile | str | Path, types: Iterable[str] | None = None,
                 gelu_table: bool = True, tf32_types: Iterable[str] = (), gpu_q8_1: bool = False):
        super().__init__(source)
        self.types = None if types is None else frozenset(types)
        self.tf32_types = frozenset(tf32_types)
        self.gelu_table = gelu_table
        self.gpu_q8_1 = gpu_q8_1
        self.q8_1_types = Q8_1_TYPES + (GPU_Q8_1_TYPES if gpu_q8_1 else ())

    def _block_minimums(self, name: str) -> np.ndarray:
        info = self.gguf.tensor(name)
        return block_minimums(graph_raw(self.graph, self.gguf, name), info.ggml_type.name, info.shape)

    def _matmul(self, op, x):
        kind = self.gguf.tensor(op.weights["weight"]).ggml_type.name
        if kind in self.tf32_types:
            return super()._matmul(op, tf32(x))
        if self.types is not None and kind not in self.types:
            return super()._matmul(op, x)
        return self._rounded_matmul(op, x)

    def _rounded_matmul(self, op, x):
        """The matmul with x rounded as llama.cpp rounds it for the weight's type, whatever `types` says (a caller
        that rounds only some matmuls, scripts/device_check.py's oracle for --prefill-gemm q8, picks them itself)."""
        name = op.weights["weight"]
        kind = self.gguf.tensor(name).ggml_type.name
        if kind not in self.q8_1_types:
            rounding = q8_0 if self.gpu_q8_1 and kind in GPU_Q8_0_TYPES else ACTIVATION_ROUNDING.get(kind)
            return super()._matmul(op, rounding(x) if rounding else x)
        y = q8_1_matmul(x, self.weight(name), self._block_minimums(name))
        return y + self.weight(op.weights["bias"]) if "bias" in op.weights else y

    _lm_head = _matmul

    def _moe_matmul(self, tensor, x, w, expert=None):
        """An expert's (or the router's) matmul: x rounded as for a plain matmul with that weight type."""
        kind = self.gguf.tensor(tensor).ggml_type.name
        if kind in self.tf32_types:
            return super()._moe_matmul(tensor, tf32(x), w, expert)
        if self.types is not None and kind not in self.types:
            return super()._moe_matmul(tensor, x, w, expert)
        return self._rounded_moe_matmul(tensor, x, w, expert)

    def _rounded_moe_matmul(self, tensor, x, w, expert=None):
        """_moe_matmul with x rounded for the weight's type, whatever `types` says (as _rounded_matmul; the grouped
        expert GEMM's rows, scripts/device_check.py): q8_1 types dot their minimums apart (the expert's rows of the
        stacked tensor's)."""
        kind = self.gguf.tensor(tensor).ggml_type.name
        if kind in self.q8_1_types:
            minimums = self._block_minimums(tensor).reshape(-1, w.shape[1] // 32)
            rows = minimums[expert * w.shape[0]:(expert + 1) * w.shape[0]] if expert is not None else minimums
            return q8_1_matmul(x, w, rows)
        rounding = q8_0 if self.gpu_q8_1 and kind in GPU_Q8_0_TYPES else ACTIVATION_ROUNDING.get(kind)
        return super()._moe_matmul(tensor, rounding(x) if rounding else x, w, expert)

    def _glu(self, op, gate, up):
        if not self.gelu_table or op.attrs["activation"] != "gelu_tanh":
            return super()._glu(op, gate, up)
        table = f16(gelu_tanh(f16(gate)))  # ggml_vec_geglu_f32 with GGML_GELU_FP16
        return np.where(gate <= -10, 0.0, np.where(gate >= 10, gate, table)) * up
