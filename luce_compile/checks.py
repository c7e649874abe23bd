"""The bars a compiled artifact is held to against the float64 oracle, in one place: the end-to-end tests, the GPU
machine's checks (scripts/device_check.py, scripts/megakernel_check.py) and the committed records' tests read them
here. Every error is relative to the row's largest logit: max|got − want| / max|want|.

Why these numbers:
- REL_TOL: the kernels compute in float32 from the same quantized blocks the oracle dequantizes, so the only
  differences are float32 rounding of dot products of length n_embd/n_ff (~1e-6 relative per matmul, measured
  1e-6 – 4e-6 end to end); 1e-3 leaves room for 30 layers of growth while a wrong block format, scale or rope layout
  shows up as 1e-1 or more.
- NEAR_TIE: greedy ids are compared only where the oracle's top-2 margin is at least this; below it float32
  rounding may legitimately pick the other token.
- BATCH_TOL: a sequence's logits in a batch against alone: other kernels (GEMM vs GEMV) or another summation order,
  float32 rounding only.
- REL_TOL_F16 (precision f16: tensor-core prefill with float16 operands) against the emulating oracle: measured
  1.3-1.5e-3 on the four H200 workloads (2026-12-01); no tighter bound means anything at the model level: rounding to
  float16 is discontinuous, and the oracle's own logits move 3.3e-3 when its inputs are perturbed by 1e-6 before the
  rounding (SmolLM2 shape, random weights). The GEMM kernels alone are held to 1e-5 of the emulation (device_check
  gemm: at most 1.2e-5 measured, k = 8192).
- REL_TOL_Q8: the megakernel's 8-bit matvecs against the oracle with their rounding emulated, and against the per-op
  path (float activations): float32 arithmetic puts some activations on the other side of an 8-bit rounding
  boundary than float64 does, each such flip moving later logits by ~1e-2 (perturbing every matmul input by 1e-6
  moved tiny models' logits by up to 1.7e-2, by 1e-5 up to 3.4e-2, 2026-12-02); the per-op path differs by the
  rounding itself (4-5e-2 on tiny models). A wrong dot product is O(1) off. The same bar, for the same reason, holds
  a --prefill-gemm q8 build (8-bit activations in the matmuls of more than 8 rows, lower/q8_gemm.py) against the
  oracle with those matmuls' rounding emulated (scripts/device_check.py prepare): its prefill quantizes float32
  activations that the float64 oracle has a few ulps apart, and every one that lands on the other side of an 8-bit
  boundary moves the logits by ~1e-2 (not measured on this kernel yet: the first GPU run says).
- REL_TOL_Q8_GEMM: the 8-bit prefill GEMM alone (device_check gemm) against float64 with its activations rounded as
  the oracle rounds them. Its quantizer is the emulation's arithmetic in float32 (IEEE division and product, rint),
  so on the same float32 input both round every value the same way and only the GEMM's float32 sums are left:
  measured here in its numpy emulation at 1e-7 (tests/schedules/test_gpu_mmq_gemm.py); 1e-5, as the CPU int8 build
  where no activation sits on a boundary, leaves room for K = 14,336.
- REL_TOL_GEMV: a float32 GEMV kernel alone (the gathered expert GEMV, scripts/moe_gemm_check.py) against float64
  on the same dequantized weights: only float32 sums over K (measured 9e-8 at K = 512 on the H100, 2026-12-07).
- REL_TOL_TF32: the megakernel's tf32 matvecs (F16/BF16 weights) against the per-op path (float32 inputs): tf32 keeps
  10 of float32's 23 mantissa bits of every input; the float64 oracle moved 1.3-1.6e-3 on tiny models when those
  inputs were rounded so (2026-12-04). A check against the oracle emulates the rounding and keeps REL_TOL.
- REL_TOL_INT8_FIRST, REL_TOL_INT8: the CPU int8 build (8-bit activations, llama.cpp's vec_dot arithmetic) against
  the oracle with those roundings emulated (graph/rounding.GgmlRounding). Where no activation lies within float32 noise
  of an 8-bit rounding boundary (a prompt and the first decode step, chosen so), only float32 rounding is left:
  measured 1.5e-7-4.3e-7 for every weight type (2026-12-06, issue 40's five types included), held to 1e-5, where the
  plain oracle is already 1.4e-2-3e-2 off. Later steps and long prompts put some activation on a boundary, each flip
  moving the logits by ~1e-3 (tests/schedules/test_cpu_int8_model.py): 5e-2; a wrong block format is O(1).
- MEGAKERNEL_REL_TOL, MEGAKERNEL_BATCH_TOL: the standalone megakernel check (scripts/megakernel_check.py) decodes
  with a float16 KV cache and float32 everything else; batched is the same kernel's arithmetic as alone.
"""

from __future__ import annotations

import numpy as np

REL_TOL = 1e-3
NEAR_TIE = 0.05
BATCH_TOL = 1e-4
REL_TOL_F16 = 1e-2
REL_TOL_Q8 = 0.1
REL_TOL_Q8_GEMM = 1e-5
REL_TOL_GEMV = 1e-4
REL_TOL_TF32 = 1e-2
REL_TOL_INT8_FIRST = 1e-5
REL_TOL_INT8 = 5e-2
MEGAKERNEL_REL_TOL = 2e-3
MEGAKERNEL_BATCH_TOL = 1e-5


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max|got − want| / max|want|, in float64."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


def top2_margin(row: np.ndarray) -> float:
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def near_tie(row: np.ndarray, tol: float = 0.0) -> bool:
    """The best two logits of a reference row closer than NEAR_TIE, or than `tol` of the row's largest (the
    check's tolerance): its greedy id is not a fair check."""
    gap = top2_margin(row)
    return gap < NEAR_TIE or gap < tol * float(np.abs(row).max())
