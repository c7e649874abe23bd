"""GPU schedule for the batch-1 fused dequantize + matmul (decode: the hot path) of lower/quant_matmul.py.

y[n] = Σ_k x[k] · dequant(W)[n, k], W read in its packed planes (`qs` uint32 words of 8 nibbles, `qh`, scales):

- `rows_per_block` output rows per thread block (threadIdx.y), each row reduced by `threads` threads
  (threadIdx.x; one warp by default, so the final sum is warp shuffles only);
- each thread takes `vector` consecutive k per step: vector/8 consecutive `qs` words in one vector load
  (uint2/uint4; Q8_0's int8 `qs` as char8/char16), and the matching x in float4 loads; consecutive threads
  take consecutive chunks, so a warp reads one contiguous run of the row (coalesced);
- the dequantization is inlined (no float copy of W exists), accumulation is float32 in a register per thread,
  the k loop is unrolled `unroll` steps deep; a row whose length is not a multiple of threads × vector gets a
  bounds check on the last step only.

DEFAULTS are a starting point (untuned; luce_compile/tune searches SPACE per target). Measured on the H200
(sm_90, runtime only): a 28672×4096 Q4_1 GEMV (73 MB, past the 60 MB L2) in 41.5 µs = 1.77 TB/s, dlight's
GEMV rule 132 µs; Q4_K 47.5 µs vs 184 µs. SmolLM2's small matrices take ~3.5 µs either way (launch-bound).
"""

from __future__ import annotations

from typing import ClassVar

from luce_schedules.cpu.quant_matmul import MatmulBlocks, match_matmul
from luce_schedules.gpu.base import GPURule, fit, max_threads, warp_size
from tvm import s_tir
from tvm.target import Target


class QuantGEMV(GPURule):
    name = "gpu.quant_gemv"
    DEFAULTS: ClassVar[dict[str, int]] = {"rows_per_block": 4, "threads": 32, "vector": 8, "unroll": 4}
    SPACE: ClassVar[dict[str, tuple[int, ...]]] = {
        "rows_per_block": (1, 2, 4, 8),
        "threads": (32, 64, 128),
        "vector": (8, 16, 32),
        "unroll": (1, 2, 4, 8),
    }

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        blocks = match_matmul(sch)
        if blocks is None or not (isinstance(blocks.batch, int) and blocks.batch == 1):
            return False
        gemv(sch, blocks, target, knobs)
        return True


def gemv(sch: s_tir.Schedule, blocks: MatmulBlocks, target: Target, knobs: dict[str, int]) -> None:
    """The schedule of the module docstring on a matmul's blocks, over every (row, output) of its batch loop."""
    threads = min(knobs["threads"], max_threads(target))
    threads -= threads % warp_size(target) or 0
    rows = fit(blocks.n_out, max(1, min(knobs["rows_per_block"], max_threads(target) // threads)))
    vector = fit(blocks.n_in, knobs["vector"])
    if blocks.dequant is not None:
        sch.compute_inline(blocks.dequant)
    rf = _per_thread_sums(sch, blocks, threads, vector, rows, knobs["unroll"])
    _vector_loads(sch, rf, vector)
    _final_sum(sch, blocks, rows)


def _per_thread_sums(sch: s_tir.Schedule, blocks: MatmulBlocks, threads: int, vector: int, rows: int,
                     unroll: int) -> s_tir.schedule.SBlockRV:
    """rfactor the thread lanes: each (row, thread) accumulates its strided share of k in a register."""
    b, n, k = sch.get_loops(blocks.matmul)
    ko, tx, kv = sch.split(k, [None, threads, vector])
    rf = sch.rfactor(tx, factor_axis=0)
    b, n, ko, tx, kv = sch.get_loops(rf)
    bx, ty = sch.split(sch.fuse(b, n), [None, rows])
    sch.reorder(bx, ty, tx, ko, kv)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(kv)
    sch.annotate(ko, "pragma_auto_unroll_max_step", unroll * vector)
    sch.annotate(ko, "pragma_unroll_explicit", 1)
    sch.set_scope(rf, 0, "local")
    sch.decompose_reduction(rf, ko)
    return rf


def _vector_loads(sch: s_tir.Schedule, rf: s_tir.schedule.SBlockRV, vector: int) -> None:
    """Stage each step's packed words and x values in registers with vector loads (uint2/uint4, float4)."""
    ko = sch.get_loops(rf)[3]
    reads = [r.source for r in sch.get(rf).reads]
    for index, buf in enumerate(reads):
        width = _load_width(buf.name, str(buf.dtype), vector)
        if width <= 1:
            continue
        cache = sch.cache_read(rf, index, "local")
        sch.compute_at(cache, ko, preserve_unit_loops=True)
        inner = sch.get_loops(cache)[-1]
        sch.vectorize(sch.split(inner, [None, width])[-1])


def _load_width(name: str, dtype: str, vector: int) -> int:
    """Elements per vector load for one step's slice of a buffer (≤ 16 bytes: the widest load there is)."""
    if name == "qs" and dtype == "uint32" and vector % 8 == 0:
        return min(vector // 8, 4)  # 8 nibbles a word: uint2/uint4 loads for vector 16/32
    if name == "qs" and dtype == "int8":
        return min(vector, 16)  # Q8_0 keeps one byte per element: char8/char16 loads
    if name == "x" and dtype == "float32" and vector % 4 == 0:
        return 4
    return 1


def _final_sum(sch: s_tir.Schedule, blocks: MatmulBlocks, rows: int) -> None:
    """Sum the per-thread partials of each row across threadIdx.x (warp shuffles), then the epilogue if any."""
    bx = sch.get_loops(sch.get_producers(blocks.matmul)[0])[0]
    sch.reverse_compute_at(blocks.matmul, bx, preserve_unit_loops=True)
    tx, *rows_loops = sch.get_loops(blocks.matmul)[1:]  # (lanes, batch, row) under bx: the block's iter order
    ty = sch.fuse(*rows_loops)
    sch.reorder(ty, tx)
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    if blocks.epilogue is not None:
        sch.set_scope(blocks.matmul, 0, "local")
        sch.reverse_compute_at(blocks.epilogue, bx, preserve_unit_loops=True)
        sch.bind(sch.fuse(*sch.get_loops(blocks.epilogue)[1:]), "threadIdx.y")
