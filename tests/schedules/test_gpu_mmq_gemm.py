"""schedules/gpu/mmq_gemm.py and mmq_blocks.py: the prefill GEMM with 8-bit activations on integer tensor cores
(--prefill-gemm q8), checked as far as a machine without a GPU can.

1. The arithmetic: mmq_blocks.emulate (the kernel's operations in numpy: exact int32 block dots, then the float32
   scale and minimum terms in the kernel's order) against float64 with only the activations' 8-bit rounding
   emulated, the formula the emulating oracle uses (graph/rounding.gpu_q8_matmul), on fresh random weights of every
   type. Bound: each block adds one term d_w·d_x·C (C exact; fl(C·d_w) and the fma round once each; two for the
   types with a scale per 16 values) and, with a minimum, one term m_w·s_x (one rounding; Q2_K two, m_w·d_x·S per 16
   values): recursive float32 summation of T·K/32 terms (T = 2, Q2_K 3), each with ≤ 2 roundings, errs by at most
   (T·K/32 + 2)·u·Σ|terms| (Higham §3.1, u = 2⁻²⁴); every output is held to twice that. A wrong scale, offset,
   minimum, sub-block or bit moves y by ~|y|/√(K/32), far above (the last tests of the section show it).
2. The statements of kernel 1 (quantize), of the weight unpacking and of a whole K step's staging into shared
   memory run on the CPU: the same TIR the GPU kernel is made of (quantize_block, WeightBlock, GemmKernel's
   load_step and store_step), in llvm loops, bit for bit against the emulation's values and the layout the mma.sync
   side reads (what only the GPU runs: ldmatrix and mma.sync, whose addressing is mma_gemm.py's).
3. The GPU kernel's CUDA (no GPU, no nvcc): its instruction counts, barriers, signature; its sm_90 build (nvcc,
   ptxas) at the 8B's default tiles: registers, spills, shared memory.
What only a GPU can check (scripts/device_check.py gemm, benchmarks/README.md "An 8-bit prefill GEMM"): the kernel's
results against float64 with the rounding emulated, and its speed beside mma_gemm.py's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from luce_schedules.gpu import mma_gemm, mmq_blocks, mmq_gemm
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B
from tvm.sym import Analyzer
from tvm.target import Target

from luce_compile.codegen.gpu_toolchain import find_tool
from luce_compile.gguf.quants import dequantize, quantize
from luce_compile.graph.rounding import block_minimums, gpu_q8_matmul, q8_blocks
from luce_compile.lower.cpu_int8 import Q8Format
from luce_compile.lower.q8_gemm import Q8_GEMM_ACTIVATIONS, q8_gemm_format, q8_gemm_matmul
from luce_compile.lower.quant_layout import plane_specs, repack

TYPES = sorted(Q8_GEMM_ACTIVATIONS)
TARGET = Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                 "max_threads_per_block": 1024, "thread_warp_size": 32})
CPU = tvm.target.Target({"kind": "llvm", "num-cores": 1})
U = 2.0**-24


# the fp16 fields (d, dmin) of the types whose random weights are random blocks: the project's quantizer leaves parts
# of their formats unused (Q3_K's level −4 and its negative scales), random bytes cover every bit
RAW_FP16 = {"Q2_K": (80, 82), "Q3_K": (108,)}


def random_weights(qtype: str, n_out: int, n_in: int, rng: np.random.Generator):
    """(raw GGUF rows, repacked planes, float64 dequantized W): random weights, the project's quantizer (RAW_FP16's
    types: random blocks, each fp16 field ±(0.5..2)·10⁻³)."""
    ggml = GGMLQuantizationType[qtype]
    if qtype in RAW_FP16:
        block, size = GGML_QUANT_SIZES[ggml]
        raw = rng.integers(0, 256, (n_out, n_in // block, size), dtype=np.uint8)
        for at in RAW_FP16[qtype]:
            scale = rng.uniform(0.5e-3, 2e-3, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
            raw[..., at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
        raw = raw.reshape(n_out, -1)
    else:
        w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
        raw = quantize(w, ggml).reshape(n_out, -1)
    return raw, repack(raw, qtype), dequantize(raw, ggml).reshape(n_out, n_in).astype(np.float64)


def activations(rng: np.random.Generator, rows: int, n_in: int) -> np.ndarray:
    """A varied scale per 32-value block (2⁻⁶..2⁵) and one all-zero block (amax 0: d = 0, q = 0)."""
    x = rng.standard_normal((rows, n_in)) * 2.0 ** rng.integers(-6, 6, (rows, n_in // 32)).repeat(32, axis=1)
    x[0, 32:64] = 0.0
    return x.astype(np.float32)


def q2_k_minimums(raw: np.ndarray) -> np.ndarray:
    """Q2_K rows → −dmin·mn of each 16 values (n, K/16) float64, from the GGUF blocks (scales[16]: the minimum in the
    high nibble; dmin, fp16 at byte 82)."""
    blocks = raw.reshape(raw.shape[0], -1, 84)
    dmin = blocks[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float64)
    return -(dmin[..., None] * (blocks[..., 0:16] >> 4)).reshape(raw.shape[0], -1)


def reference(qtype: str, raw: np.ndarray, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): float64 with the activations' rounding emulated as the oracle does, and each output's bound."""
    k, terms = w.shape[1], 3 if qtype in mmq_blocks.SUMS16_TYPES else 2
    q, d = q8_blocks(x)
    xr = (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)  # what q8_0 gives
    magnitude = np.abs(xr) @ np.abs(w).T
    if Q8_GEMM_ACTIVATIONS[qtype] == "Q8_1":  # the scale part and the minimum part are summed apart
        m = block_minimums(raw, qtype, w.shape)
        s = (d[..., 0] * q.sum(-1)).astype(np.float16).astype(np.float64)
        magnitude = np.abs(xr) @ np.abs(w - np.repeat(m, 32, axis=1)).T + np.abs(s) @ np.abs(m).T
    if qtype == "Q2_K":  # likewise, per 16 values
        m = q2_k_minimums(raw)
        magnitude = np.abs(xr) @ (np.abs(w - np.repeat(m, 16, axis=1)) + np.abs(np.repeat(m, 16, axis=1))).T
    return gpu_q8_matmul(x, w, qtype, raw), 2 * (terms * k // 32 + 2) * U * magnitude


# ---- 1. the arithmetic -----------------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("qtype", TYPES)
def test_emulation_is_float64_with_the_8_bit_rounding(qtype, rng):
    raw, planes, w = random_weights(qtype, 40, 768, rng)
    x = activations(rng, 24, 768)
    got = mmq_blocks.emulate(qtype, planes, x)
    want, bound = reference(qtype, raw, w, x)
    assert got.dtype == np.float32 and np.all(np.abs(got - want) <= bound)
    # the 8-bit rounding is what the emulation is about: float64 without it is a thousand times further off
    plain = x.astype(np.float64) @ w.T
    assert np.abs(got - plain).max() > 1000 * np.abs(got - want).max()


def _swapped(plane: np.ndarray) -> np.ndarray:
    """The two 16-value sub-blocks' fields of every 32-value block swapped."""
    return plane.reshape(plane.shape[0], -1, 2)[..., ::-1].reshape(plane.shape).copy()


def _flipped(plane: np.ndarray, bit: int) -> np.ndarray:
    """Bit `bit` of every word of a plane flipped."""
    return plane ^ np.uint32(1 << bit)


@pytest.mark.unit
@pytest.mark.parametrize(("qtype", "plane", "wrong"), [
    ("Q6_K", "sc", _swapped), ("Q3_K", "sc", _swapped), ("Q2_K", "sc", _swapped), ("Q2_K", "mn", _swapped),
    ("Q3_K", "qh", lambda p: _flipped(p, 5)),  # one element's third bit a block
    ("Q3_K", "qs", lambda p: _flipped(p, 12)), ("Q2_K", "qs", lambda p: _flipped(p, 12)),  # a low bit a 16 values
])
def test_a_wrong_sub_block_scale_or_bit_breaks_the_bound(qtype, plane, wrong, rng):
    """The 16-value sub-blocks' scales (Q2_K's minima) swapped in every block, or one bit flipped: the bound above
    catches it."""
    raw, planes, w = random_weights(qtype, 40, 768, rng)
    x = activations(rng, 24, 768)
    want, bound = reference(qtype, raw, w, x)
    assert np.all(np.abs(mmq_blocks.emulate(qtype, planes, x) - want) <= bound)
    assert np.any(np.abs(mmq_blocks.emulate(qtype, dict(planes, **{plane: wrong(planes[plane])}), x) - want) > bound)


# ---- 2. kernel 1 and the weight unpacking, on the CPU ----------------------------------------------------------------
def _run_cpu(func: tirx.PrimFunc, *arrays: np.ndarray) -> list[np.ndarray]:
    ex = tvm.compile(tvm.IRModule({"main": func}), target=CPU)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]
    ex["main"](*args)
    return [a.numpy() for a in args]


def _quantizer(rows: int, n_in: int, order: str, sums: bool) -> tirx.PrimFunc:
    """quantize_block over every block of every row, in llvm loops (the GPU runs a thread per block)."""
    with IRBuilder() as ib, B.prim_func():
        B.func_name("quantize")
        x = B.arg("x", B.buffer((rows * n_in,), "float32"))
        out = {"xq": B.arg("xq", B.buffer((rows * n_in // 4,), "uint32")),
               "xd": B.arg("xd", B.buffer((rows * n_in // 32,), "float32"))}
        if sums:
            out["xs"] = B.arg("xs", B.buffer((rows * n_in // 32,), "float32"))
        with B.serial(0, rows) as r, B.serial(0, n_in // 32) as b:
            mmq_blocks.quantize_block(x, out, r, b, n_in, order, div=lambda p, q: p / q)
    return ib.get()


@pytest.mark.unit
@pytest.mark.parametrize(("order", "sums"), [("natural", False), ("nibbles", True)])
def test_the_quantizer_is_the_cpu_builds_rounding_bit_for_bit(order, sums, rng):
    rows, n_in = 5, 256
    x = activations(rng, rows, n_in)
    zeros = [np.zeros(rows * n_in // 4, np.uint32), np.zeros(rows * n_in // 32, np.float32)]
    _, xq, xd, *xs = _run_cpu(_quantizer(rows, n_in, order, sums), x.reshape(-1), *zeros,
                              *([np.zeros(rows * n_in // 32, np.float32)] if sums else []))
    q, d = q8_blocks(x)  # (rows, nb, 32) in element order, float32 d
    fmt = Q8Format("Q8_1" if sums else "Q8_0", order)
    positions = [fmt.position_element(p) for p in range(32)]
    want = q[..., positions].astype(np.int8)  # the order the weights' words give
    assert np.array_equal(xq.view(np.int8).reshape(rows, -1, 32), want)
    assert np.array_equal(xd.reshape(rows, -1), d[..., 0].astype(np.float16).astype(np.float32))
    if sums:
        s = (d[..., 0] * q.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
        assert np.array_equal(xs[0].reshape(rows, -1), s)


def tir_byte_perm(x: tirx.Expr, y: tirx.Expr, s: tirx.Expr) -> tirx.Expr:
    """CUDA's __byte_perm in plain TIR, for the CPU harness (byte i of the result: byte s<4i+2:4i> of y:x, as CUDA
    documents it): the codebook types' lookups run on llvm with it."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    out = u(0)
    for i in range(4):
        sel = (s >> u(4 * i)) & u(7)
        src = tirx.Select(sel < u(4), x, y)
        out = out | (((src >> ((sel & u(3)) * u(8))) & u(0xFF)) << u(8 * i))
    return out


def _unpacker(qtype: str, n_out: int, n_in: int) -> tirx.PrimFunc:
    """WeightBlock's load, words and scales for every block of every row, in llvm loops."""
    groups, minima = mmq_blocks.groups(qtype), max(1, mmq_blocks.minimums(qtype))
    nb = n_in // 32
    with IRBuilder() as ib, B.prim_func():
        B.func_name("unpack")
        planes = {pl: B.arg(pl, B.buffer(tuple(tirx.IntImm("int64", d) for d in shape), dt))
                  for pl, (shape, dt) in plane_specs(qtype, n_out, n_in).items()}
        words = B.arg("words", B.buffer((n_out * nb * 8,), "uint32"))
        dw = B.arg("dw", B.buffer((n_out * nb * groups,), "float32"))
        mw = B.arg("mw", B.buffer((n_out * nb * minima,), "float32"))
        views = mmq_blocks.plane_views(planes)
        with B.serial(0, n_out) as n, B.serial(0, nb) as b:
            unit = mmq_blocks.WeightBlock(qtype, views, n, b, n_in, tir_byte_perm)
            unit.load()
            for s, word in enumerate(unit.words()):
                B.buffer_store(words, word, [(n * nb + b) * 8 + s])
            scales, mins = unit.scales()
            for g, value in enumerate(scales):
                B.buffer_store(dw, value, [(n * nb + b) * groups + g])
            for h, value in enumerate(mins):
                B.buffer_store(mw, value, [(n * nb + b) * minima + h])
    return ib.get()


@pytest.mark.unit
@pytest.mark.parametrize("qtype", TYPES)
def test_the_weight_words_are_the_emulations_integers_in_the_activations_order(qtype, rng):
    """Each block's 8 shared words hold its centred quants (Q2_K's times their scale) in the order of the activations'
    words (Q6_K's and Q3_K's permuted so that bytes 0-15 are their first sub-block), and its scales are the
    emulation's, bit for bit."""
    n_out, n_in = 6, 512
    _, planes, _ = random_weights(qtype, n_out, n_in, rng)
    groups, minima, nb = mmq_blocks.groups(qtype), max(1, mmq_blocks.minimums(qtype)), n_in // 32
    outs = [np.zeros(n_out * nb * 8, np.uint32), np.zeros(n_out * nb * groups, np.float32),
            np.zeros(n_out * nb * minima, np.float32)]
    *_, words, dw, mw = _run_cpu(_unpacker(qtype, n_out, n_in), *planes.values(), *outs)
    q, want_dw, want_mw = mmq_blocks.weight_integers(qtype, planes)
    positions = [q8_gemm_format(qtype).position_element(p) for p in range(32)]
    slots = mmq_blocks.Q6_SLOTS if groups == 2 else tuple(range(8))
    in_order = words.view(np.int8).reshape(n_out, nb, 8, 4)[:, :, list(slots)].reshape(n_out, nb, 32)
    assert np.array_equal(in_order, q.reshape(n_out, nb, 32)[..., positions])
    assert np.array_equal(dw.reshape(n_out, -1), want_dw)
    if want_mw is not None:
        assert np.array_equal(mw.reshape(n_out, -1), want_mw)
    if groups == 2:  # shared bytes 0-15 (slots 0-3) are elements 0-15: what the first m16n8k16 multiplies
        elements = [positions[4 * slots[t // 4] + t % 4] for t in range(16)]
        assert sorted(elements) == list(range(16))
        shared = words.view(np.int8).reshape(n_out, nb, 32)
        assert np.array_equal(shared[..., :16], q.reshape(n_out, nb, 32)[..., elements])


def stager(qtype: str, weight_rows: int, n_in: int, tile: tuple[int, int, int], x_rows: int, kernel, step: int,
           stage: int, tokens: int = 0) -> tirx.PrimFunc:
    """A GEMM kernel's load_step then store_step of K step `step` into `stage`, for every thread in turn (a loop on the
    CPU), the shared buffers being arguments: what the tile's threads leave in shared memory for the mma.sync.
    `kernel(views, tx, tokens)` makes the kernel object (mmq_gemm.GemmKernel, moe.ExpertTile); `tokens` > 0: an int32
    argument of that many rows' token ids after the planes (a grouped tile's gathered rows)."""
    fmt = q8_gemm_format(qtype)
    (tiles, scales), _ = mmq_gemm._shared_words(qtype, tile)
    with IRBuilder() as ib, B.prim_func():
        B.func_name("stage")
        planes = {pl: B.arg(pl, B.buffer(tuple(tirx.IntImm("int64", d) for d in shape), dt))
                  for pl, (shape, dt) in plane_specs(qtype, weight_rows, n_in).items()}
        ids = B.arg("tokens", B.buffer((tokens,), "int32")) if tokens else None
        x = {"xq": B.arg("xq", B.buffer((x_rows * n_in // 4,), "uint32"))}
        for name in ("xd", "xs") if fmt.with_sum else ("xd",):
            x[f"{name}:flat"] = B.arg(name, B.buffer((x_rows * n_in // 32,), "float32"))
        smem = {name: B.arg(name, B.buffer((n,), "uint32")) for name, n in tiles.items()}
        stages = {name: [B.arg(f"{name}{i}", B.buffer((n,), "float32")) for i in range(2)]
                  for name, n in scales.items()}
        views = mmq_blocks.plane_views(planes) | x  # (declared after every argument)
        with B.serial(0, mma_gemm.THREADS) as tx:
            k = kernel(views, tx, ids)
            k.smem, k.stage, k.perm = smem, stages, tir_byte_perm
            k.store_step(stage, k.load_step(tirx.const(step, "int32")))
    return ib.get()


def _stager(qtype: str, n_out: int, n_in: int, tile: tuple[int, int, int], rows: int, origin: tuple[int, int],
            step: int, stage: int) -> tirx.PrimFunc:
    """The dense GEMM's stager (GemmKernel over rows x n_out)."""
    with_sum = q8_gemm_format(qtype).with_sum

    def kernel(views, tx, _tokens):  # noqa: ANN001, ANN202
        return mmq_gemm.GemmKernel(qtype, n_out, n_in, tile, views, rows, tx, origin[0], origin[1], with_sum)

    return stager(qtype, n_out, n_in, tile, rows, kernel, step, stage), mmq_blocks.groups(qtype)


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "Q3_K", "Q2_K"])
def test_a_step_leaves_each_row_and_scale_where_the_mma_reads_it(qtype, rng):
    """The second K step of the tile at rows 64.. of 100 (rows past the batch clamped to its last) and features
    128.. of 200 (clamped to 199), into stage 1: each x row's and weight row's 8 words a block in their slots (Q6_K's
    and Q3_K's permuted), padded rows; d_x [, s_x] at [block][row]; d_w, -MAGIC·d_w at [block][group][feature], m_w
    at [block][minimum][feature]."""
    n_out, n_in, tile, rows, origin, step = 200, 512, (64, 128, 128), 100, (64, 128), 1
    _, planes, _ = random_weights(qtype, n_out, n_in, rng)
    fmt = q8_gemm_format(qtype)
    xq = rng.integers(0, 2**32, rows * n_in // 4, dtype=np.uint32)
    xs = [rng.standard_normal(rows * n_in // 32).astype(np.float32) for _ in range(2 if fmt.with_sum else 1)]
    func, groups = _stager(qtype, n_out, n_in, tile, rows, origin, step, 1)
    (tiles, scales), _ = mmq_gemm._shared_words(qtype, tile)
    outs = [np.zeros(n, np.uint32) for n in tiles.values()] + \
        [np.zeros(n, np.float32) for n in scales.values() for _ in range(2)]
    got = _run_cpu(func, *planes.values(), xq, *xs, *outs)[len(planes) + 1 + len(xs):]
    tile_m, tile_n, tile_k = tile
    nblk, row = tile_k // 32, mmq_gemm.row_words(tile_k)
    slots = list(mmq_blocks.Q6_SLOTS if groups == 2 else range(8))
    blocks = step * nblk + np.arange(nblk)
    x_rows = np.minimum(origin[0] + np.arange(tile_m), rows - 1)
    want_x = xq.reshape(rows, -1, 8)[x_rows][:, blocks][..., slots]  # (tile_m, nblk, 8) words in slot order
    xa = got[0].reshape(2, tile_m, row)[1]
    assert np.array_equal(xa[:, :nblk * 8].reshape(tile_m, nblk, 8), want_x)
    q, dw, mw = mmq_blocks.weight_integers(qtype, planes)
    feats = np.minimum(origin[1] + np.arange(tile_n), n_out - 1)
    positions = [fmt.position_element(p) for p in range(32)]
    # the weights' quants in the activations' order of the 32 values, as words
    in_position = np.ascontiguousarray(q.reshape(n_out, -1, 32)[..., positions].astype(np.int8))
    want_w = in_position.view(np.uint32).reshape(n_out, -1, 8)[feats][:, blocks][..., slots]
    wb = got[1].reshape(2, tile_n, row)[1]
    assert np.array_equal(wb[:, :nblk * 8].reshape(tile_n, nblk, 8), want_w)
    sx = got[2 + 2 * 0 + 1].reshape(nblk, tile_m, len(xs))  # stage 1
    for p, plane in enumerate(xs):
        assert np.array_equal(sx[..., p], plane.reshape(rows, -1)[x_rows][:, blocks].T)
    sw = got[2 + 2 * 1 + 1].reshape(nblk, groups, tile_n, 2)
    want_dw = dw.reshape(n_out, -1, groups)[feats][:, blocks].transpose(1, 2, 0)  # (nblk, groups, tile_n)
    assert np.array_equal(sw[..., 0], want_dw) and np.array_equal(sw[..., 1], want_dw * np.float32(-12582912.0))
    if mw is not None:  # one m_w a block, or Q2_K's two
        minima = mmq_blocks.minimums(qtype)
        want_mw = mw.reshape(n_out, -1, minima)[feats][:, blocks].transpose(1, 2, 0)  # (nblk, minima, tile_n)
        assert np.array_equal(got[2 + 2 * 2 + 1].reshape(nblk, minima, tile_n), want_mw)
    assert not any(a.any() for a in got[2::2])  # stage 0 untouched


# ---- 3. the GPU kernel's code and its sm_90 build -------------------------------------------------------------------
def _source(func: tirx.PrimFunc) -> str:
    from luce_compile.codegen.gpu_toolchain import cuda_source

    return cuda_source(tvm.IRModule({"main": func.with_attr("tirx.is_scheduled", True)}), TARGET)


def _kernels(source: str) -> list[str]:
    """The bodies of the source's __global__ functions, in order (the quantizer, then the GEMM)."""
    starts = [m.start() for m in re.finditer(r'extern "C" __global__ void [^;]*\{', source)]
    return [source[a:b] for a, b in zip(starts, [*starts[1:], len(source)], strict=True)]


@pytest.mark.unit
@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_generates_the_integer_mma_kernel(qtype):
    n_out, n_in, tile = 1000, 768, (64, 64, 64)  # 12 steps: 5 pairs and a lone step in the loop, and the last
    func = mmq_gemm.mmq_gemm(qtype, n_out, n_in, tile_m=tile[0], tile_n=tile[1], tile_k=tile[2])
    lowered = q8_gemm_matmul(qtype, n_out, n_in, name="g")
    assert [(str(p.dtype), [str(d) for d in p.shape]) for p in func.params] == \
        [(str(p.dtype), [str(d) for d in p.shape]) for p in lowered.params]
    quant, gemm = _kernels(_source(func))
    # a thread per block (no shuffles); the divisions IEEE's whatever --use_fast_math (127/amax; amax/127 for d and s)
    assert "__shfl" not in quant and quant.count("nearbyintf") == 32
    assert quant.count("__fdiv_rn(") == (3 if q8_gemm_format(qtype).with_sum else 2)
    steps_in_code = 2 + 1 + 1  # the loop's pair, the lone step after it, the last step's compute
    frags_m, frags = 64 // mma_gemm.WARPS_M // 16, (64 // mma_gemm.WARPS_M // 16) * (64 // mma_gemm.WARPS_N // 8)
    k16 = qtype in ("Q6_K", "Q3_K")
    mma = "m16n8k16_row_col_s32_s8_s8_s32" if k16 else "m16n8k32_row_col_s32_s8_s8_s32"
    # Q2_K: one more per 16 rows, the sums per 16 values (against bytes of 1)
    per_block = frags * (2 if k16 else 1) + (frags_m if qtype == "Q2_K" else 0)
    assert gemm.count(f"mma_int_sync_aligned_{mma}(") == steps_in_code * 2 * per_block
    assert gemm.count("mma_int_sync_aligned_") == steps_in_code * 2 * per_block
    assert ("16843009" in gemm) == (qtype == "Q2_K")  # 0x01010101
    ldmatrix = 64 // mma_gemm.WARPS_M // 16 + 64 // mma_gemm.WARPS_N // 16  # A per 16 rows, B per 16 features
    assert gemm.count("ldmatrix_sync_aligned_m8n8_x4") == steps_in_code * 2 * ldmatrix
    # per element and block: fma(C bits, d_w, −MAGIC·d_w), fma(u, d_x, acc) [, fma(m_w, s_x, acc) | Q2_K's two
    # fma(m_w, t, acc)]
    minima = {"Q4_1": 1, "Q5_1": 1, "Q4_K": 1, "Q5_K": 1, "Q2_K": 2}.get(qtype, 0)
    per = (2 * (2 if k16 else 1) + minima) * frags * 4
    assert gemm.count("__fmaf_rn(") == steps_in_code * 2 * per
    # exactly the written barriers: after the first step's stores, once a step (the pair's two and the lone step's)
    assert gemm.count("__syncthreads()") == 4
    assert "int64_t" not in gemm.split("{", 1)[1]


@pytest.mark.unit
def test_the_q2_k_sums_operand_sums_a_sub_block_by_column_parity():
    """Q2_K's sums per 16 values: the B operand each lane gives the mma against the x fragment (b0 = b1 =
    sums_operand(tig, g): the lane's bytes k = 4·tig.. and 16 + 4·tig.. of column g, PTX's m16n8k32 .s8 layout) is
    1 exactly at the positions of the nibbles order whose elements are sub-block g % 2's, so that output column n
    (c0/c2 at 2·tig, c1/c3 at 2·tig + 1) is S_(n % 2) of its row, what _sums16 and emulate take it for."""
    analyzer = Analyzer()
    ones = np.zeros((32, 8), np.int64)  # B (k, n) as bytes
    for lane in range(32):
        g, tig = lane // 4, lane % 4
        word = int(analyzer.simplify(mmq_gemm.sums_operand(tirx.const(tig, "int32"), tirx.const(g, "int32"))))
        for base in (4 * tig, 16 + 4 * tig):  # b0, b1
            ones[base:base + 4, g] = [(word >> (8 * j)) & 0xFF for j in range(4)]
    fmt = q8_gemm_format("Q2_K")
    sub_block = np.array([fmt.position_element(p) // 16 for p in range(32)])
    for n in range(8):
        assert np.array_equal(ones[:, n], (sub_block == n % 2).astype(np.int64))


@pytest.mark.unit
@pytest.mark.parametrize("tile_m", mma_gemm.TILE_M)
@pytest.mark.parametrize("tile_n", mma_gemm.TILE_N)
@pytest.mark.parametrize("tile_k", mma_gemm.TILE_K)
def test_every_tile_of_the_space_builds(tile_m, tile_n, tile_k):
    _, gemm = _kernels(_source(mmq_gemm.mmq_gemm("Q4_K", 576, 1536, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k)))
    steps = 1536 // tile_k
    in_code = 2 + (1 if (steps - 1) % 2 else 0) + 1
    assert gemm.count("mma_int_sync_aligned_m16n8k32") == in_code * (tile_k // 32) * (tile_m // 32) * (tile_n // 32)


@pytest.mark.unit
def test_default_tile_and_what_it_refuses():
    assert mmq_gemm.default_tile(4096, 132) == (64, 128, 128)  # 8 × 32 blocks at 512 rows
    assert mmq_gemm.default_tile(14336, 132) == (64, 128, 128)
    assert mmq_gemm.default_tile(1024, 132) == (64, 64, 128)  # the k/v projection: 8 × 16
    assert mmq_gemm.supports("Q6_K", 4096) and mmq_gemm.supports("Q3_K", 4096) and mmq_gemm.supports("Q2_K", 4096)
    assert not mmq_gemm.supports("Q4_K", 4096, "float16") and not mmq_gemm.supports("BF16", 4096)
    assert mmq_gemm.supports("MXFP4", 4096) and not mmq_gemm.supports("F16", 4096)
    with pytest.raises(ValueError, match="not supported"):
        mmq_gemm.mmq_gemm("F16", 256, 512)


@pytest.mark.unit
@pytest.mark.skipif(find_tool("nvcc") is None, reason="the sm_90 build needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q3_K", "Q2_K"])
@pytest.mark.parametrize(("n_out", "n_in"), [(4096, 4096), (1024, 4096)])
def test_the_8b_shapes_build_for_sm_90_without_spills(qtype, n_out, n_in, tmp_path):
    """The GEMM kernel at the default tile of the 8B's shapes (64 × 128 and 64 × 64, K steps of 128), through nvcc and
    ptxas: no spills, registers × 256 threads within the SM's 64K (one block an SM above 128), static shared memory
    within 48 KiB (the scales; above it the tiles move to dynamic shared memory). Measured 2026-12-07: Q4_K 209 and
    117 registers, Q6_K 189 and 128; 17,408 / 48,128 and 19,456 / 48,128 bytes static. Issue 40's types (nvcc 13.0,
    sm_90): Q3_K 189 and 128 (Q6_K's), Q2_K 181 and 128; both 19,456 / 48,128 bytes static."""
    from luce_compile.codegen.gpu_toolchain import gpu_toolchain
    from luce_compile.codegen.kernel_resources import check_cuda, library_resources
    from luce_compile.targets import get_target

    info = get_target("sm_90")
    tile = mmq_gemm.default_tile(n_out, info.facts["sm_count"])
    func = mmq_gemm.mmq_gemm(qtype, n_out, n_in, tile_m=tile[0], tile_n=tile[1], tile_k=tile[2], name="g")
    target = info.tvm_target()
    with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
        built = tvm.compile(tvm.IRModule({"g": func.with_attr("tirx.is_scheduled", True)}), target=target)
    built.export_library(str(tmp_path / "g.so"))
    static, dynamic = mmq_gemm.shared_bytes(qtype, tile)
    (quant,) = library_resources(tmp_path / "g.so", info, {"g": (256, 0)})
    (gemm,) = library_resources(tmp_path / "g.so", info, {"g_kernel_1": (256, dynamic)})
    for r in (quant, gemm):
        assert r.arch == "sm_90" and r.spill_bytes == 0 and r.spill_stores == 0, r
        assert not check_cuda(r, info.facts), check_cuda(r, info.facts)
    assert quant.registers <= 64 and gemm.registers <= 255
    assert gemm.static_shared - static in (0, 1024)  # cuobjdump counts 1 KiB sm_90 reserves for the system
