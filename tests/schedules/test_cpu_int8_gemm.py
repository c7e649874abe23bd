"""The many-row int8 body (schedules/cpu/int8_gemm.py: prefill, verify and batches past 16 rows) against llama.cpp's
arithmetic, for every weight type the int8 path covers.

Reference and tolerance: tests/lower/test_cpu_int8.py (activations quantized by our TIR quantizer and checked there
bit for bit against the emulation of ggml's rounding; exact float64 dot of the rounded activations with the
dequantized weights; a per-output bound for the float32 summation of the block terms). Fresh random activations per
call (varied block scales and an all-zero block), random weight blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.int8_gemm import strip_vectors, supports
from luce_schedules.cpu.int8_gemv import ROW_TILE, TILE, Int8GEMV

from luce_compile.lower.cpu_int8 import INT8_FORMATS, int8_format, int8_matmul, quantize_q8
from luce_compile.lower.quant_layout import repack
from tests.lower.test_cpu_int8 import HOST, INT8_TARGETS, activations, emulated_activations, reference_gemv
from tests.lower.test_quant_matmul import random_raw
from tests.schedules.test_cpu_int8_gemv import call, each_int8_target

pytestmark = pytest.mark.unit
TYPES = [t.name for t in INT8_FORMATS]
needs_int8 = pytest.mark.skipif(not INT8_TARGETS, reason="this CPU has no AVX2 byte dot")


def compiled(kind: str, n_out: int, n_in: int, target=HOST) -> tvm.runtime.Executable:
    sch = Int8GEMV().apply(int8_matmul(kind, n_out, n_in, batch="dynamic"), target)
    assert sch is not None
    return tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)


@each_int8_target
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("n_out", [48, 40])  # strips of 16 rows (two vectors), and of 8 (one)
def test_many_rows_match_reference(kind, n_out, target, rng):
    """17 rows (the first past TILE), 2·ROW_TILE + 3 more (whole row tiles and a remainder taken one at a time),
    and 64: every row within the reference's bound."""
    fmt = int8_format(kind)
    n_in = 768 if fmt.with_bsums else 320  # 3 super-blocks; 10 blocks of 32
    raw = random_raw(kind, n_out, n_in, rng)
    planes = list(repack(raw, kind).values())
    kernel = compiled(kind, n_out, n_in, target)
    quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(n_in, fmt, batch="dynamic")}), target=target)
    for rows in (TILE + 1, TILE + 2 * ROW_TILE + 3, 64):
        x = np.concatenate([activations(rng, n_in) for _ in range(rows)])
        quantized = call(quantize, x, outs=list(fmt.specs(n_in, rows).values()))
        (y,) = call(kernel, *quantized, *planes, outs=[((rows, n_out), "float32")])
        for r in range(rows):
            want, bound = reference_gemv(raw, kind, emulated_activations(x[r : r + 1], kind))
            assert np.all(np.abs(y[r : r + 1] - want) <= bound), (rows, r, np.abs(y[r : r + 1] - want).max())


@needs_int8
def test_rows_past_the_strip_width_keep_the_tile_kernel(rng):
    """n_out not a multiple of 8: no output-lane body; many rows still go through the 16-row tiles, correctly."""
    assert not supports(36) and supports(40) and strip_vectors(40) == 1 and strip_vectors(48) == 2
    kind, n_out, n_in, rows = "Q4_1", 36, 128, 21
    fmt = int8_format(kind)
    raw = random_raw(kind, n_out, n_in, rng)
    x = np.concatenate([activations(rng, n_in) for _ in range(rows)])
    quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(n_in, fmt, batch="dynamic")}), target=HOST)
    quantized = call(quantize, x, outs=list(fmt.specs(n_in, rows).values()))
    (y,) = call(compiled(kind, n_out, n_in), *quantized, *repack(raw, kind).values(), outs=[((rows, n_out), "float32")])
    for r in range(rows):
        want, bound = reference_gemv(raw, kind, emulated_activations(x[r : r + 1], kind))
        assert np.all(np.abs(y[r : r + 1] - want) <= bound)


@needs_int8
def test_kernel_branches_on_the_row_count_and_broadcasts_activation_quads():
    """The golden facts: a batch kernel holds both bodies behind `rows > 16`; the output-lane body's vpdpbusd takes
    the activation's 4 bytes broadcast to 8 lanes (an int32 broadcast reinterpreted as bytes) and runs in a
    parallel loop over strips; the GEMV (one static row) has no such branch."""
    script = Int8GEMV().apply(int8_matmul("Q4_K", 48, 256, batch="dynamic"), HOST).mod["main"].script()
    assert f"> {TILE}" in script and script.count("T.parallel(") == 2
    assert 'T.reinterpret("int8x32", T.Broadcast(' in script
    gemv = Int8GEMV().apply(int8_matmul("Q4_K", 48, 256), HOST).mod["main"].script()
    assert f"> {TILE}" not in gemv and "T.reinterpret(\"int8x32\", T.Broadcast(" not in gemv
