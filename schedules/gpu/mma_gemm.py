"""The prefill GEMM on tensor cores, written out: mma.sync.m16n8k16 (float16 × float16 → float32) fed by ldmatrix, for
the float16 twin of lower/quant_matmul.py (precision f16, CUDA) and every weight type the front end reads.

Why not a schedule of the twin: dlight's WMMA form (tensor_gemm.py) gathers each of a granule's scales and quant
words once per 4 weights (12 scalar loads where 3 do), gives each of 16 warps a 32×32 tile (one fragment load per
mma), indexes in int64, and cannot widen W's loads without widening x's (benchmarks/README.md, "Prefill GEMM: what
the WMMA kernel does"). Here every choice is explicit:

- a block of 8 warps (2 × 4) computes a tile_m × tile_n tile of y (rows of x × output features); a warp owns
  (tile_m/2) × (tile_n/4) of it as 16×8 float32 accumulator fragments;
- K advances tile_k (32, 64 or 128) values a step. Each step's tiles of x and W are loaded into registers while the
  previous step's mma.sync run (x as 16-byte words; W one 8-value granule at a time, each distinct word of its
  planes once: a Q4_1 granule is 3 loads), then rounded to float16 and stored to the other of two shared-memory
  buffers: one barrier a step;
- shared rows are padded by 16 bytes (80, 144 or 272 bytes a row), so the 8 row addresses of an ldmatrix fall in 8
  distinct 16-byte bank groups; above 48 KiB the buffers are dynamic shared memory (TVM's launch opts in);
- why tile_k matters (seen on an H100 on 2026-12-05 in a run whose record was lost): at tile_k 32 a step took ~1 µs
  whatever the tile, the latency of its loads, so the time grew with K alone; a fatter step puts more bytes in
  flight per latency;
- the dequantization is `quant_matmul.dequant_expr` itself, in the same float32 operation order, then rounded to
  float16: the values are the twin's to the bit, and the twin's oracle (scripts/device_check.py, REL_TOL_F16) holds;
- indices are int32 (the largest plane, 151,936 × 4,096 BF16, has 6.2e8 elements), rows past the batch and
  features past n_out are clamped on load and never stored.

Fragment layouts (PTX ISA, mma.m16n8k16 with .f16 A/B): lane = 4·group + tig. A (16×16, row-major) a0..a3 = rows
group / group + 8 × k 2·tig.. / 8 + 2·tig..; ldmatrix.x4 of four 8×8 matrices gives exactly these when lanes 0-7,
8-15, 16-23, 24-31 pass the rows of (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15). B (16×8, "col")
is W's own layout (feature-major, k contiguous): b0, b1 = k 2·tig.., 8 + 2·tig.. of feature `group`, one
ldmatrix.x4 for two 8-feature fragments. C: c0, c1 row group, columns 2·tig, 2·tig + 1; c2, c3 row group + 8.
"""

from __future__ import annotations

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B
from tvm.sym import Analyzer

from luce_compile.lower.quant_layout import as_ggml_type, plane_specs
from luce_compile.lower.quant_matmul import dequant_expr, exact_int_to_float

WARPS_M, WARPS_N = 2, 4
THREADS = 32 * WARPS_M * WARPS_N
GRANULE = 8
TILE_M = (32, 64, 128)  # rows of x per block: a warp takes half, in 16-row fragments
TILE_N = (64, 128)  # output features per block: a warp takes a quarter, in pairs of 8-feature fragments
TILE_K = (32, 64, 128)  # K values a step stages (a K that is no multiple of the knob takes the largest that fits)
STATIC_SHARED = 48 * 1024  # bytes of static shared memory a block may have; above it, dynamic


def row_words(tile_k: int) -> int:
    """32-bit words of one staged row: tile_k float16 values, then 4 words of padding."""
    return tile_k // 2 + 4


def step_for(n_in: int, tile_k: int) -> int:
    """The K step actually taken: the largest of TILE_K up to tile_k that divides n_in (0: none does)."""
    return max((k for k in TILE_K if k <= tile_k and n_in % k == 0), default=0)


MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"


def default_tile(n_out: int, sm_count: int) -> tuple[int, int, int]:
    """(tile_m, tile_n, tile_k) before tuning: the largest tile that still gives every SM a block at 512 rows (a
    prompt's first chunk), 64 × 64 where none does (the k/v projections of small models), and the fattest step."""
    for tile_m, tile_n in ((128, 128), (64, 128), (128, 64), (64, 64)):
        if -(-512 // tile_m) * -(-n_out // tile_n) >= sm_count:
            return tile_m, tile_n, max(TILE_K)
    return 64, 64, max(TILE_K)


def supports(ggml_type: str, n_in: int) -> bool:
    """K must fill whole steps (every quantized type's block is 32 or 256 values; F32/F16/BF16 may not)."""
    as_ggml_type(ggml_type)
    return step_for(n_in, max(TILE_K)) > 0


def i32(v: int) -> tirx.IntImm:
    return tirx.const(v, "int32")


def u32(v: int) -> tirx.IntImm:
    return tirx.const(v, "uint32")


class _GranuleLoads:
    """The planes of W while one granule (8 consecutive values of a row) is loaded: each distinct word goes into a
    register once, when dequant_expr first asks for it, so that the loads are issued where this object is used
    and the arithmetic (the float expressions dequant_expr returns, over those registers) can run later. Planes of
    8- and 16-bit values indexed per element (Q8_0's quants, F16/BF16 values) are loaded as one 8- or 16-byte word
    vector per granule, and each element is cut out of it."""

    def __init__(self, planes: dict[str, tirx.Buffer], words: dict[str, tirx.Buffer], n: tirx.Expr, g: tirx.Expr,
                 analyzer: Analyzer):
        self.planes, self.words, self.n, self.g, self.analyzer = planes, words, n, g, analyzer
        self.cache: dict[tuple, tirx.Buffer] = {}

    def __getitem__(self, name: str) -> _PlaneView:
        return _PlaneView(self, name)

    def load(self, name: str, idx: tirx.Expr) -> tirx.Expr:
        buf = self.planes[name]
        per_row = int(buf.shape[1])
        idx = self.analyzer.simplify(idx)
        if per_row != self.row_values:  # a scale, a min, a word of quants or high bits: one load per distinct index
            key = (name, str(idx))
            if key not in self.cache:
                reg = B.alloc_buffer((1,), buf.dtype, scope="local")
                B.buffer_store(reg, self.words[f"{name}:flat"][self.n * per_row + idx], [i32(0)])
                self.cache[key] = reg
            return self.cache[key][0]
        # one value per element: the granule's words, loaded once as 8- to 16-byte vectors
        bits = DataType(buf.dtype).bits
        key = (name, "granule")
        n_words = GRANULE * bits // 32
        if key not in self.cache:
            reg = B.alloc_buffer((n_words,), "uint32", scope="local")
            first = (self.n * per_row + self.g * GRANULE) * bits // 32
            for h in range(0, n_words, 4):
                lanes = min(4, n_words - h)
                B.buffer_store(reg, self.words[name].vload([first + h], f"uint32x{lanes}"),
                               [tirx.Ramp(i32(h), i32(1), lanes)])
            self.cache[key] = reg
        j = self.analyzer.simplify(idx - self.g * GRANULE)
        if not isinstance(j, tirx.IntImm) or not 0 <= int(j) < GRANULE:
            raise AssertionError(f"mma_gemm: {name}[{idx}] is not an element of granule {self.g}")
        per_word = 32 // bits
        word = self.cache[key][int(j) // per_word]
        shift = bits * (int(j) % per_word)
        if bits == 32:
            return tirx.reinterpret(buf.dtype, word)
        if buf.dtype == "int8":  # sign-extend the byte: shift it to the top, then back arithmetically
            return (tirx.reinterpret("int32", word << u32(24 - shift)) >> i32(24)).astype("int8")
        field = ((word >> u32(shift)) & u32((1 << bits) - 1)).astype(f"uint{bits}")
        return field if str(buf.dtype) == f"uint{bits}" else tirx.reinterpret(buf.dtype, field)

    row_values = 0  # set per weight: n_in (a plane with that many columns holds one value per element)


class _PlaneView:
    def __init__(self, loads: _GranuleLoads, name: str):
        self.loads, self.name = loads, name

    def __getitem__(self, idx):
        _row, col = idx  # the row is the granule's (dequant_expr passes the n it was given)
        return self.loads.load(self.name, col)


def mma_gemm(ggml_type: str, n_out: int, n_in: int, *, x_dtype: str = "float32", out_dtype: str = "float32",
             tile_m: int = 128, tile_n: int = 128, tile_k: int = 32, name: str = "mma_gemm") -> tirx.PrimFunc:
    """PrimFunc(x (batch, n_in), *planes, y (batch, n_out)) with quant_matmul's signature (int64 shapes, a symbolic
    batch): y = float16(x) @ float16(dequant(W))ᵀ in float32, on tensor cores."""
    qtype = as_ggml_type(ggml_type).name
    tile_k = step_for(n_in, tile_k)
    if tile_m not in TILE_M or tile_n not in TILE_N or not tile_k:
        raise ValueError(f"mma_gemm: tile {tile_m}x{tile_n} or K={n_in} not supported (tiles {TILE_M} x {TILE_N}, "
                         f"K a multiple of {min(TILE_K)})")
    row = row_words(tile_k)
    warp_m, warp_n = tile_m // WARPS_M, tile_n // WARPS_N
    frags_m, frags_n = warp_m // 16, warp_n // 8
    steps = n_in // tile_k
    granules_row = tile_k // GRANULE
    analyzer = Analyzer()
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    with IRBuilder() as ib, B.prim_func():
        B.func_name(name)
        batch = tirx.Var("batch", "int64")
        x = B.arg("x", B.buffer((batch, i64(n_in)), x_dtype))
        planes = {pl: B.arg(pl, B.buffer(tuple(i64(d) for d in shape), dt))
                  for pl, (shape, dt) in plane_specs(qtype, n_out, n_in).items()}
        y = B.arg("y", B.buffer((batch, i64(n_out)), out_dtype))
        B.func_attr({"tirx.noalias": True})
        rows = batch.astype("int32")
        bx, by, tx = B.env_thread("blockIdx.x"), B.env_thread("blockIdx.y"), B.env_thread("threadIdx.x")
        with B.launch_thread(bx, -(-n_out // tile_n)), \
                B.launch_thread(by, (rows + (tile_m - 1)) // tile_m), B.launch_thread(tx, THREADS):
            warp, lane = tx // 32, tx % 32
            group, tig = lane // 4, lane % 4
            wm, wn = warp // WARPS_N, warp % WARPS_N
            m0, n0 = by * tile_m, bx * tile_n
            # flat int32-indexed views of every argument (the 2-D int64 buffers only name the arguments)
            x_bits = DataType(x_dtype).bits
            x_words = B.decl_buffer((rows * (n_in * x_bits // 32),), "uint32", data=x.data)
            y_flat = B.decl_buffer((rows * n_out,), out_dtype, data=y.data)
            views: dict[str, tirx.Buffer] = {}
            for pl, buf in planes.items():
                count = int(buf.shape[0]) * int(buf.shape[1])
                views[f"{pl}:flat"] = B.decl_buffer((count,), buf.dtype, data=buf.data)
                if int(buf.shape[1]) == n_in:  # one value per element: read as words (_GranuleLoads)
                    views[pl] = B.decl_buffer((count * DataType(buf.dtype).bits // 32,), "uint32", data=buf.data)
            scope = "shared" if 2 * (tile_m + tile_n) * row * 4 <= STATIC_SHARED else "shared.dyn"
            a_smem = B.alloc_buffer((2 * tile_m * row,), "uint32", scope=scope)
            b_smem = B.alloc_buffer((2 * tile_n * row,), "uint32", scope=scope)
            acc = B.alloc_buffer((frags_m * frags_n * 4,), "float32", scope="local")
            for i in range(frags_m * frags_n * 4):
                B.buffer_store(acc, tirx.const(0.0, "float32"), [i32(i)])

            def granule_slots(count: int):
                """(slot, linear index) of the granules this thread stages out of `count` a step."""
                for s in range(-(-count // THREADS)):
                    yield s, tx + s * THREADS

            def load_step(step: tirx.Expr):
                """Issue this thread's loads of step `step`; returns what store_step needs to finish them."""
                a_regs = []
                for _s, idx in granule_slots(tile_m * granules_row):
                    x_row = tirx.min(m0 + idx // granules_row, rows - 1)
                    k = step * tile_k + (idx % granules_row) * GRANULE
                    n_words = GRANULE * x_bits // 32
                    reg = B.alloc_buffer((n_words,), "uint32", scope="local")
                    with _guard(idx < tile_m * granules_row, tile_m * granules_row % THREADS == 0):
                        for h in range(n_words // 4):
                            B.buffer_store(reg, x_words.vload([(x_row * n_in + k) * x_bits // 32 + 4 * h], "uint32x4"),
                                           [tirx.Ramp(i32(4 * h), i32(1), 4)])
                    a_regs.append(reg)
                b_vals = []
                for _s, idx in granule_slots(tile_n * granules_row):
                    n = tirx.min(n0 + idx // granules_row, n_out - 1)
                    g = step * granules_row + idx % granules_row
                    loads = _GranuleLoads(planes, views, n, g, analyzer)
                    loads.row_values = n_in
                    with _guard(idx < tile_n * granules_row, tile_n * granules_row % THREADS == 0):
                        vals = [dequant_expr(qtype, loads, n, g * GRANULE + i, exact_int_to_float)
                                for i in range(GRANULE)]
                    b_vals.append([analyzer.simplify(v) for v in vals])
                return a_regs, b_vals

            def store_step(buffer: tirx.Expr, staged) -> None:
                a_regs, b_vals = staged
                for (_s, idx), reg in zip(granule_slots(tile_m * granules_row), a_regs, strict=True):
                    at = buffer * (tile_m * row) + (idx // granules_row) * row + (idx % granules_row) * 4
                    with _guard(idx < tile_m * granules_row, tile_m * granules_row % THREADS == 0):
                        if x_dtype == "float16":
                            words = reg
                        else:
                            words = B.alloc_buffer((4,), "uint32", scope="local")
                            for w in range(4):
                                lo, hi = (tirx.reinterpret("float32", reg[2 * w + h]) for h in range(2))
                                B.buffer_store(words, _pack_half(lo, hi), [i32(w)])
                        B.buffer_store(a_smem, words.vload([i32(0)], "uint32x4"), [tirx.Ramp(at, i32(1), 4)])
                for (_s, idx), vals in zip(granule_slots(tile_n * granules_row), b_vals, strict=True):
                    at = buffer * (tile_n * row) + (idx // granules_row) * row + (idx % granules_row) * 4
                    with _guard(idx < tile_n * granules_row, tile_n * granules_row % THREADS == 0):
                        words = B.alloc_buffer((4,), "uint32", scope="local")
                        for w in range(4):
                            B.buffer_store(words, _pack_half(vals[2 * w], vals[2 * w + 1]), [i32(w)])
                        B.buffer_store(b_smem, words.vload([i32(0)], "uint32x4"), [tirx.Ramp(at, i32(1), 4)])

            def compute_step(buffer: tirx.Expr) -> None:
                for kk in range(tile_k // 16):
                    a = B.alloc_buffer((frags_m * 4,), "uint32", scope="local")
                    b = B.alloc_buffer((frags_n * 2,), "uint32", scope="local")
                    for fm in range(frags_m):
                        r = wm * warp_m + fm * 16 + lane % 8 + 8 * ((lane // 8) % 2)
                        at = buffer * (tile_m * row) + r * row + kk * 8 + 4 * (lane // 16)
                        B.evaluate(T.ptx[LDMATRIX](*(a[fm * 4 + r] for r in range(4)), T.address_of(a_smem[at])))
                    for p in range(frags_n // 2):
                        feat = wn * warp_n + p * 16 + lane % 8 + 8 * (lane // 16)
                        at = buffer * (tile_n * row) + feat * row + kk * 8 + 4 * ((lane // 8) % 2)
                        B.evaluate(T.ptx[LDMATRIX](*(b[p * 4 + r] for r in range(4)), T.address_of(b_smem[at])))
                    for fm in range(frags_m):
                        for fn in range(frags_n):
                            d = [acc[(fm * frags_n + fn) * 4 + r] for r in range(4)]
                            B.evaluate(T.ptx[MMA](*d, *(a[fm * 4 + r] for r in range(4)), b[fn * 2], b[fn * 2 + 1],
                                                  *d))

            sync = lambda: B.evaluate(T.tvm_storage_sync("shared"))  # noqa: E731
            store_step(i32(0), load_step(i32(0)))
            sync()
            with B.serial(0, steps - 1) as s:
                staged = load_step(s + 1)  # in flight while this step's mma.sync run
                compute_step(s % 2)
                store_step((s + 1) % 2, staged)
                sync()
            compute_step(i32((steps - 1) % 2))
            # y: each fragment's c0, c1 (row group) and c2, c3 (row group + 8), adjacent features
            for fm in range(frags_m):
                for fn in range(frags_n):
                    feat = n0 + wn * warp_n + fn * 8 + 2 * tig
                    for half in range(2):
                        y_row = m0 + wm * warp_m + fm * 16 + group + 8 * half
                        for c in range(2):
                            value = acc[(fm * frags_n + fn) * 4 + 2 * half + c]
                            inside = (y_row < rows) if n_out % tile_n == 0 else (y_row < rows) & (feat + c < n_out)
                            with B.If(inside), B.Then():
                                B.buffer_store(y_flat, value.astype(out_dtype) if out_dtype != "float32" else value,
                                               [y_row * n_out + feat + c])
    return ib.get()


def _pack_half(lo: tirx.Expr, hi: tirx.Expr) -> tirx.Expr:
    """Two float32 values rounded to float16 (to nearest even, as numpy's astype), as one 32-bit word: lo in the low
    half (the element with the lower k, as ldmatrix and mma expect)."""
    bits = [tirx.reinterpret("uint16", v.astype("float16")).astype("uint32") for v in (lo, hi)]
    return bits[0] | (bits[1] << u32(16))


class _guard:
    """`if cond:` around a block of statements, or nothing where cond holds for every thread (`always`)."""

    def __init__(self, cond: tirx.Expr, always: bool):
        self.cond, self.always, self.frames = cond, always, []

    def __enter__(self):
        if not self.always:
            self.frames = [B.If(self.cond), B.Then()]
            for f in self.frames:
                f.__enter__()

    def __exit__(self, *exc):
        for f in reversed(self.frames):
            f.__exit__(*exc)
