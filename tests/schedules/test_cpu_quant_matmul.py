"""The CPU rules for dequantize + matmul: numbers for every GGUF type, the IR they produce, and when they decline.

Tolerance: the kernels accumulate in float32 in an order of their own (vector lanes, then across lanes), while the
reference is float64. The dequantized weights are exact (tests/lower/test_quant_matmul.py), so the only error is
the float32 summation of n_in products, bounded for any summation order by (n_in + 1)·u·Σ_k |x_k·w_k| with
u = 2^-24 (Higham, Accuracy and Stability, §3.1); each element is checked against that bound. On random data the
error behaves like √n_in·u·|y|, about 1e-6 of max|y| at n_in = 512, so max error ≤ 1e-5·max|y| is also asserted
(a 10× margin): a misplaced nibble or scale moves y by ~|y|/√n_in, far above both. float16 outputs add one
rounding of y (2^-11 relative).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from luce_schedules.cpu import RULES, QuantGEMM, QuantGEMV
from tvm import te, tirx
from tvm.s_tir import dlight as dl

from luce_compile.errors import UnsupportedError
from luce_compile.lower.quant_layout import SUPPORTED_TYPES, repack
from luce_compile.lower.quant_matmul import quant_matmul
from tests.lower.test_quant_matmul import random_raw, reference_dequant

TYPES = [t.name for t in SUPPORTED_TYPES]
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})
N_OUT, N_IN = 96, 512  # 512: a multiple of every block size (256 for K-quants)


@pytest.fixture(scope="session")
def compiled() -> dict:
    """Compiled kernels by (type, batch, x_dtype, out_dtype, n_out): each is built once per session."""
    return {}


def kernel(
    cache: dict, name: str, batch: int | str, x_dtype: str = "float32", out_dtype: str = "float32", n_out: int = N_OUT
):
    key = (name, batch, x_dtype, out_dtype, n_out)
    if key not in cache:
        func = quant_matmul(name, n_out, N_IN, batch=batch, x_dtype=x_dtype, out_dtype=out_dtype)
        rule = QuantGEMV() if batch == 1 else QuantGEMM()
        sch = rule.apply(func, TARGET)
        assert sch is not None, f"{type(rule).__name__} declined {func.attrs['global_symbol']}"
        with TARGET:
            cache[key] = tvm.compile(sch.mod, target=TARGET)["main"]
    return cache[key]


def check(
    fn,
    name: str,
    rows: int,
    rng: np.random.Generator,
    x_dtype: str = "float32",
    out_dtype: str = "float32",
    n_out: int = N_OUT,
) -> None:
    raw = random_raw(name, n_out, N_IN, rng)
    x = rng.standard_normal((rows, N_IN)).astype(x_dtype)
    y = tvm.runtime.tensor(np.zeros((rows, n_out), out_dtype))
    fn(tvm.runtime.tensor(x), *(tvm.runtime.tensor(p) for p in repack(raw, name).values()), y)
    terms = x.astype(np.float64)[:, None, :] * reference_dequant(raw, name).astype(np.float64)[None, :, :]
    want = terms.sum(-1)
    err = np.abs(y.numpy().astype(np.float64) - want)
    bound = (N_IN + 1) * 2.0**-24 * np.abs(terms).sum(-1)
    if out_dtype == "float16":
        bound += 2.0**-11 * np.abs(want)
    assert (err <= bound).all(), f"{name}: {int((err > bound).sum())} outputs past the summation bound"
    assert err.max() <= (1e-5 if out_dtype == "float32" else 1e-3) * np.abs(want).max(), f"{name}: {err.max()}"


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_gemv_matches_float64_reference(name: str, compiled: dict, rng: np.random.Generator):
    check(kernel(compiled, name, 1), name, 1, rng)


@pytest.mark.unit
@pytest.mark.parametrize("name", TYPES)
def test_gemm_matches_float64_reference_at_any_batch(name: str, compiled: dict, rng: np.random.Generator):
    fn = kernel(compiled, name, "dynamic")
    for rows in (1, 3, 17):  # 3 and 17 leave a partial batch tile
        check(fn, name, rows, rng)


@pytest.mark.unit
@pytest.mark.parametrize("batch", [1, "dynamic"])
def test_float16_activations_and_outputs(batch: int | str, compiled: dict, rng: np.random.Generator):
    fn = kernel(compiled, "Q4_K", batch, x_dtype="float16", out_dtype="float16")
    check(fn, "Q4_K", 1 if batch == 1 else 5, rng, x_dtype="float16", out_dtype="float16")


@pytest.mark.unit
@pytest.mark.parametrize(("batch", "out_dtype"), [(4, "float32"), (6, "float16"), (5, "float32")])
def test_static_batches(batch: int, out_dtype: str, compiled: dict, rng: np.random.Generator):
    """Fixed batch sizes: a multiple of the batch tile needs no padding (own accumulator / cast path), 5 does."""
    check(kernel(compiled, "Q5_0", batch, out_dtype=out_dtype), "Q5_0", batch, rng, out_dtype=out_dtype)


@pytest.mark.unit
def test_row_counts_that_do_not_divide_the_default_tiles(compiled: dict, rng: np.random.Generator):
    """90 rows: the rules fall back to a divisor of n_out (rows=3, then 2) instead of bounds checks."""
    check(kernel(compiled, "Q5_1", 1, n_out=90), "Q5_1", 1, rng, n_out=90)
    check(kernel(compiled, "Q5_1", "dynamic", n_out=90), "Q5_1", 7, rng, n_out=90)


# ---- the IR the rules produce ---------------------------------------------------------------------------------------


def loop_nest(sch: tvm.s_tir.Schedule, block: str) -> list[tuple[str, int]]:
    """(kind, extent) of every loop around `block`, outermost first."""
    loops = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock(block))]
    return [
        (tirx.ForKind(int(lp.kind)).name, int(lp.extent) if isinstance(lp.extent, tirx.IntImm) else -1) for lp in loops
    ]


def block_names(sch: tvm.s_tir.Schedule) -> set[str]:
    return set(re.findall(r'T\.sblock\("(\w+)"\)', sch.mod.script()))


@pytest.mark.unit
def test_gemv_golden_structure():
    sch = QuantGEMV().apply(quant_matmul("Q4_1", 64, 256, batch=1), TARGET)
    # 64 rows = 16 tasks (parallel) · 1 group per task · 4 rows; 256 = 8 steps · unroll 4 · 8 lanes (vectorized)
    assert loop_nest(sch, "matmul_rf_update") == [
        ("PARALLEL", 16),
        ("SERIAL", 1),
        ("SERIAL", 8),
        ("UNROLLED", 4),
        ("UNROLLED", 4),
        ("VECTORIZED", 8),
    ]
    assert "dequantize" not in block_names(sch)  # inlined: the weight is only ever read packed
    assert loop_nest(sch, "matmul")[:2] == [("PARALLEL", 16), ("SERIAL", 1)]  # lanes summed per row group


@pytest.mark.unit
def test_gemm_golden_structure():
    sch = QuantGEMM().apply(quant_matmul("Q4_1", 64, 256), TARGET)
    nest = loop_nest(sch, "matmul_rf_update")
    # 64 rows in tasks of 4 (parallel) · batch tiles of 2 (symbolic count) · 16 steps · unroll 2 · 2 · 4 · 8 lanes
    assert nest == [
        ("PARALLEL", 16),
        ("SERIAL", -1),
        ("SERIAL", 16),
        ("UNROLLED", 2),
        ("UNROLLED", 2),
        ("UNROLLED", 4),
        ("VECTORIZED", 8),
    ]
    # each task dequantizes its 4-row strip once, vectorized along k, before its batch loop
    assert loop_nest(sch, "dequantize") == [
        ("PARALLEL", 16),
        ("SERIAL", 4),
        ("SERIAL", 32),
        ("VECTORIZED", 8),
    ]
    assert {"x_pad", "matmul_pad"} <= block_names(sch)  # padded batch: no bounds checks in the k loop


@pytest.mark.unit
def test_knobs_change_the_schedule_and_unknown_knobs_are_refused():
    knobs = {"rows": 2, "vector": 16, "unroll": 1, "chunk": 4}
    sch = QuantGEMV().apply(quant_matmul("Q8_0", 64, 256, batch=1), TARGET, knobs)
    assert loop_nest(sch, "matmul_rf_update") == [
        ("PARALLEL", 8),
        ("SERIAL", 4),
        ("SERIAL", 16),
        ("UNROLLED", 1),
        ("UNROLLED", 2),
        ("VECTORIZED", 16),
    ]
    with pytest.raises(UnsupportedError, match="tile_k"):
        QuantGEMV().apply(quant_matmul("Q8_0", 64, 256, batch=1), TARGET, {"tile_k": 64})
    for rule in RULES:
        assert set(rule.SPACE) == set(rule.DEFAULTS)
        assert all(rule.DEFAULTS[k] in v for k, v in rule.SPACE.items())


# ---- declining ------------------------------------------------------------------------------------------------------


def row_sum() -> tirx.PrimFunc:
    a = te.placeholder((64, 256), "float32", name="a")
    k = te.reduce_axis((0, 256), name="k")
    return te.create_prim_func([a, te.compute((64,), lambda i: te.sum(a[i, k], axis=k), name="s")])


def elementwise() -> tirx.PrimFunc:
    a = te.placeholder((64, 256), "float32", name="a")
    return te.create_prim_func([a, te.compute((64, 256), lambda i, j: a[i, j] * 2.0, name="b")])


def weight_k_major() -> tirx.PrimFunc:
    """y = x @ W with W stored (n_in, n_out): a matmul, but not the (n_out, n_in) GGUF layout the rules assume."""
    x = te.placeholder((4, 256), "float32", name="x")
    w = te.placeholder((256, 64), "float32", name="w")
    k = te.reduce_axis((0, 256), name="k")
    return te.create_prim_func([x, w, te.compute((4, 64), lambda b, n: te.sum(x[b, k] * w[k, n], axis=k))])


@pytest.mark.unit
def test_gemv_rule_declines_what_is_not_a_batch_1_matmul():
    rule = QuantGEMV()
    assert rule.apply(quant_matmul("Q4_1", 64, 256), TARGET) is None  # dynamic batch: the GEMM's
    assert rule.apply(quant_matmul("Q4_1", 64, 256, batch=8), TARGET) is None
    for func in (row_sum(), elementwise(), weight_k_major()):
        assert rule.apply(func, TARGET) is None
    assert rule.apply(quant_matmul("Q4_1", 64, 256, batch=1), tvm.target.Target({"kind": "cuda"})) is None


@pytest.mark.unit
def test_gemm_rule_declines_what_is_not_a_batched_matmul():
    rule = QuantGEMM()
    assert rule.apply(quant_matmul("Q4_1", 64, 256, batch=1), TARGET) is None  # batch 1: the GEMV's
    for func in (row_sum(), elementwise(), weight_k_major()):
        assert rule.apply(func, TARGET) is None
    assert rule.apply(quant_matmul("Q4_1", 64, 256), tvm.target.Target({"kind": "cuda"})) is None


@pytest.mark.unit
def test_rules_run_inside_dlight_apply_default_schedule():
    """dlight passes `tunable` where our knobs go: the rules then use their defaults."""
    funcs = {"gemv": quant_matmul("Q6_K", 64, 256, batch=1), "gemm": quant_matmul("Q6_K", 64, 256)}
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    with TARGET:
        scheduled = dl.ApplyDefaultSchedule(*RULES)(mod)
    assert all(scheduled[name].attrs["tirx.is_scheduled"] for name in funcs)
