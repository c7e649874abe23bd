"""The int8 GEMV rule: numbers against llama.cpp's arithmetic, the code it emits, and when it declines. Run on every
byte dot this CPU has (its own best, and AVX2's forced where it has VNNI); the others are built and inspected.

Reference and tolerance: tests/lower/test_cpu_int8.py (rounded activations, exact float64 dot, per-output bound
for float32 summation of the block terms).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.int8_gemv import Int8GEMV, e8m0_times, int8_gemv
from luce_schedules.cpu.quant_matmul import QuantGEMV

from luce_compile.gguf.quants import e8m0_half
from luce_compile.lower.cpu_int8 import INT8_FORMATS, int8_format, int8_isa, int8_matmul, quantize_q8
from luce_compile.lower.quant_layout import repack
from luce_compile.lower.quant_matmul import quant_matmul
from tests.lower.test_cpu_int8 import (
    HOST,
    INT8_IDS,
    INT8_TARGETS,
    activations,
    emulated_activations,
    quantized_inputs,
    reference_gemv,
    run,
)
from tests.lower.test_quant_matmul import random_raw

pytestmark = pytest.mark.unit
TYPES = [t.name for t in INT8_FORMATS]
each_int8_target = pytest.mark.parametrize("target", INT8_TARGETS, ids=INT8_IDS)
# a CPU of each byte dot (cpu_int8.INT8_ISAS): what the kernel is built for, run or not
ISA_TARGETS = {"avx512vnni": "znver4", "avxvnni": "alderlake", "avx2": "haswell"}


def scheduled(kind: str, n_out: int, n_in: int, knobs: dict | None = None, target=HOST) -> tvm.tirx.PrimFunc:
    sch = Int8GEMV().apply(int8_matmul(kind, n_out, n_in), target, knobs)
    assert sch is not None
    return sch.mod["main"]


@each_int8_target
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize(
    "n_out,n_in,knobs",
    [
        (96, 512, None),
        (70, 96, {"rows": 4, "chunk": 4}),
        (64, 128, {"rows": 1, "chunk": 1, "unroll": 1}),
        (32, 896, {"rows": 2, "chunk": 2}),
        (16, 64, None),
        (24, 128, {"ahead": 0}),
        (12, 64, {"ahead": 16, "rows": 2, "chunk": 2}),  # prefetches past the last row stay on it
    ],
)
def test_int8_gemv_matches_reference(kind, n_out, n_in, knobs, target, rng):
    """Several shapes and knobs: rows that do not divide by the defaults, one row per task, and every width of
    the 32-value types' block groups (16, 3, 4, 28 and 2 blocks: groups of 8, 1, 4 (7 of them, one chain), 2).
    The K-quants take n_in in super-blocks (4864 = 19·256 is Qwen2.5-0.5B's ffn_down, a prime count)."""
    if int8_format(kind).with_bsums:
        n_in = {512: 4864, 96: 768, 128: 256, 896: 512, 64: 1024}[n_in]
    raw = random_raw(kind, n_out, n_in, rng)
    x = activations(rng, n_in)
    (y,) = run(
        scheduled(kind, n_out, n_in, knobs, target),
        *quantized_inputs(x, kind),
        *repack(raw, kind).values(),
        outs=[((1, n_out), "float32")],
    )
    want, bound = reference_gemv(raw, kind, emulated_activations(x, kind))
    assert np.all(np.abs(y - want) <= bound), np.abs(y - want).max()


def call(ex: tvm.runtime.Executable, *arrays: np.ndarray, outs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """`run` for a function compiled once: called on numpy inputs, returns the outputs."""
    results = [tvm.runtime.tensor(np.zeros(shape, dtype)) for shape, dtype in outs]
    ex["main"](*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays), *results)
    return [r.numpy() for r in results]


@each_int8_target
@pytest.mark.parametrize("kind", TYPES)
def test_batched_kernel_rows_equal_the_gemv_bit_for_bit(kind, target, rng):
    """The batched decode's and verify's kernel at 1 to 16 rows (one tile of 16 rows shares each unpacked weight
    group), on fresh random activations per row count: every row is the GEMV's result for that row alone, to the
    bit (a lone and a batched sequence get the same numbers), and within the reference's bound (llama.cpp's
    activation rounding emulated, float64 dot). Past 16 rows the kernel takes int8_gemm's body
    (tests/schedules/test_cpu_int8_gemm.py): same integers, float sums in another order."""
    n_out, n_in = 48, 1024 if int8_format(kind).with_bsums else 320
    fmt = int8_format(kind)
    raw = random_raw(kind, n_out, n_in, rng)
    planes = list(repack(raw, kind).values())
    sch = Int8GEMV().apply(int8_matmul(kind, n_out, n_in, batch="dynamic"), target)
    assert sch is not None and "llvm.x86." in sch.mod["main"].script()
    batched = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)
    gemv = tvm.compile(tvm.IRModule({"main": scheduled(kind, n_out, n_in, target=target)}), target=target)
    quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(n_in, fmt, batch="dynamic")}), target=target)
    for rows in range(1, 17):
        x = np.concatenate([activations(rng, n_in) for _ in range(rows)])
        quantized = call(quantize, x, outs=list(fmt.specs(n_in, rows).values()))
        (y,) = call(batched, *quantized, *planes, outs=[((rows, n_out), "float32")])
        for r in range(rows):
            (alone,) = call(gemv, *(q[r : r + 1] for q in quantized), *planes, outs=[((1, n_out), "float32")])
            np.testing.assert_array_equal(y[r : r + 1], alone, err_msg=f"{rows} rows: row {r}")
            want, bound = reference_gemv(raw, kind, emulated_activations(x[r : r + 1], kind))
            assert np.all(np.abs(alone - want) <= bound), (rows, r, np.abs(alone - want).max())


@pytest.mark.parametrize("isa", list(ISA_TARGETS))
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_each_isa_emits_its_byte_dot_in_a_parallel_loop(isa, kind):
    """The golden facts of the kernel, built (not run) for a CPU of each byte dot: 256-bit vpdpbusd with i8 operands
    (LLVM 22's types) with VNNI, EVEX or VEX encoded; vpmaddubsw + vpmaddwd on AVX2, with vpsignb for the signed
    weights' sign trick; a parallel row loop. The batch kernel of Q8_0 keeps vpdpbusd's offset trick, AVX2's none."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": ISA_TARGETS[isa], "num-cores": 2})
    assert int8_isa(target) == isa
    for batch in (1, "dynamic"):
        func = Int8GEMV().apply(int8_matmul(kind, 64, 128, batch=batch), target).mod["main"]
        script = func.script()
        assert "T.parallel(" in script
        asm = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.inspect_source("asm")
        assert "prefetcht0" in asm, batch  # the weights `ahead` rows on (knob default 8)
        if isa == "avx2":
            assert "vpdpbusd" not in asm and "vpmaddubsw" in asm and "vpmaddwd" in asm, batch
            assert ("vpsignb" in asm) == (kind == "Q8_0"), batch
        else:
            assert 'T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256"' in script
            assert "vpdpbusd" in asm and "ymm" in asm and "vpmaddubsw" not in asm, batch
            assert ("{vex}\tvpdpbusd" in asm) == (isa == "avxvnni"), batch


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_e8m0_times_is_the_rounded_product_for_every_exponent(lanes, rng):
    """MXFP4's block scale times the activations' scale: float32 x · GGML_E8M0_TO_FP32_HALF(e), rounded once, for
    all 256 exponents (e < 2: subnormal factors; high ones: products that overflow) and x from subnormal to large,
    as the kernel computes it without a subnormal factor."""
    from tvm.script import tirx as T

    n = 256 * 64
    e = np.tile(np.arange(256, dtype=np.uint8), 64)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 40, n))).astype(np.float32)
    x[:8] = [0, -0.0, 1, -1, np.float32(1e-45), np.float32(3e38), np.float32(1.2e-38), np.float32(7e-39)]

    @T.prim_func(s_tir=True)
    def times(eb: T.Buffer((n,), "uint8"), xb: T.Buffer((n,), "float32"), yb: T.Buffer((n,), "float32")):
        for i in range(n // lanes):
            yb[T.Ramp(i * lanes, 1, lanes) if lanes > 1 else i] = e8m0_times(
                eb[T.Ramp(i * lanes, 1, lanes) if lanes > 1 else i],
                xb[T.Ramp(i * lanes, 1, lanes) if lanes > 1 else i], lanes)

    (y,) = run(times, e, x, outs=[((n,), "float32")])
    with np.errstate(over="ignore"):
        want = x * e8m0_half(e)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def test_declines_functions_it_does_not_own():
    assert Int8GEMV().apply(quant_matmul("Q4_1", 64, 128, batch=1), HOST) is None


def test_declines_without_avx2():
    sandybridge = tvm.target.Target({"kind": "llvm", "mcpu": "sandybridge"})  # AVX only: the TE definition stays
    assert Int8GEMV().apply(int8_matmul("Q4_1", 64, 128), sandybridge) is None
    assert Int8GEMV().apply(int8_matmul("Q4_1", 64, 128), tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None


@each_int8_target
def test_cpu_rules_take_the_int8_gemv(target):
    """Until Int8GEMV is in luce_schedules.cpu.RULES, QuantGEMV (first in the list) hands these functions to it."""
    sch = QuantGEMV().apply(int8_matmul("Q8_0", 64, 128), target)
    assert sch is not None and "llvm.x86." in sch.mod["main"].script()


def test_kernel_signature_is_the_definitions():
    for kind in TYPES:
        a, b = int8_gemv(kind, 32, 512, 2, 2, 2), int8_matmul(kind, 32, 512)
        shapes = [[(tuple(int(s) for s in p.shape), str(p.dtype)) for p in f.params] for f in (a, b)]
        assert shapes[0] == shapes[1], kind
