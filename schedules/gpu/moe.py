"""GPU kernels for the mixture-of-experts ops of luce_compile.lower.moe: the expert sort and the expert matmuls.

- `expert_sort`: moe.sort_func's counting sort (same signature, same result: stable, tokens in order within an
  expert) as one block with a thread per expert. Each thread counts its expert's rows, one thread turns the counts
  into start offsets, and each thread places its rows in order; the ids pass through shared memory a tile at a time,
  so a thread's scan reads shared memory, never global memory, and no atomics are needed (the order is the CPU's).
  A prompt's P = tokens x used rows cost 2 P shared reads per thread: ~0.5 ms for 16K rows, next to its expert GEMMs.
- `ExpertGEMV`: the expert matmuls (lower/moe.expert_matmul, marked EXPERT_ATTR) as the batch-1 GEMV's schedule
  (quant_gemv.py) over every sorted row: a warp reduces one (row, output) pair over K, `rows_per_block` pairs a
  block, the row's expert weights dequantized in registers. A decode step reads only the chosen experts' rows
  (rows that share an expert read it again, from L2). Prompts run the same kernel, one weight row per (row, output)
  from L2: correct, not a grouped GEMM (issue 40's prefill kernel is still to write).
"""

from __future__ import annotations

from luce_schedules.cpu.quant_matmul import MatmulBlocks
from luce_schedules.gpu.base import root_blocks
from luce_schedules.gpu.quant_gemv import QuantGEMV, gemv
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B
from tvm.target import Target

from luce_compile.lower.moe import EXPERT_ATTR

SORT_TILE = 1024  # ids staged in shared memory per pass (4 KiB)


def _i32(v: int) -> tirx.IntImm:
    return tirx.IntImm("int32", v)


def expert_sort(n_expert: int, used: int, name: str) -> tirx.PrimFunc:
    """moe.sort_func for a GPU: ids (P,) int32 → experts, tokens, inverse (P,) int32, one block of
    n_expert threads rounded up to a warp (module docstring)."""
    threads = -(-n_expert // 32) * 32
    if threads > 1024:
        raise ValueError(f"expert_sort: {n_expert} experts need more than a block's 1024 threads")
    with IRBuilder() as ib, B.prim_func():
        B.func_name(name)
        rows = tirx.Var("rows", "int64")
        ids, experts, tokens, inverse = (B.arg(n, B.buffer((rows,), "int32"))
                                         for n in ("ids", "experts", "tokens", "inverse"))
        B.func_attr({"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True})
        p_rows = rows.astype("int32")
        per_thread = max(1, SORT_TILE // threads)
        tile_rows = threads * per_thread  # a multiple of the threads: every thread stores per_thread ids a pass
        tiles = (p_rows + (tile_rows - 1)) // tile_rows
        sync = lambda: B.evaluate(T.tvm_storage_sync("shared"))  # noqa: E731
        # a root block, as Relax's pattern analysis wants; the buffers' scopes place them (shared: the block's). No
        # shared store sits under a condition (TVM's sync planner refuses those): ids past the rows are stored as -1
        with B.sblock("root"), B.thread_binding(1, thread="blockIdx.x"), \
                B.thread_binding(threads, thread="threadIdx.x") as tx:
            tile = B.alloc_buffer((tile_rows,), "int32", scope="shared")
            counts = B.alloc_buffer((threads,), "int32", scope="shared")
            mine = B.alloc_buffer((1,), "int32", scope="local")
            seen = B.alloc_buffer((1,), "int32", scope="local")  # a shared value is read into a register before a test

            def over_ids(body) -> None:  # noqa: ANN001  (body(row, its expert) for every row, in order)
                with B.serial(0, tiles) as t:
                    with B.serial(0, per_thread) as j:
                        i = t * tile_rows + j * threads + tx
                        B.buffer_store(tile, tirx.Select(i < p_rows, ids[tirx.min(i, p_rows - 1)], _i32(-1)),
                                       [j * threads + tx])
                    sync()
                    with B.serial(0, tirx.min(_i32(tile_rows), p_rows - t * tile_rows)) as k:
                        B.buffer_store(seen, tile[k], [0])
                        body(t * tile_rows + k, seen[0])  # threads past n_expert match no id
                    sync()

            B.buffer_store(mine, _i32(0), [0])
            over_ids(lambda i, e: B.buffer_store(mine, mine[0] + tirx.Select(e == tx, _i32(1), _i32(0)), [0]))
            B.buffer_store(counts, mine[0], [tx])
            sync()
            B.buffer_store(mine, _i32(0), [0])  # this expert's start: the rows of the experts before it
            with B.serial(0, threads) as e:
                B.buffer_store(seen, counts[e], [0])
                B.buffer_store(mine, mine[0] + tirx.Select(e < tx, seen[0], _i32(0)), [0])

            def place(i: tirx.Expr, e: tirx.Expr) -> None:
                with B.If(e == tx), B.Then():
                    q = mine[0]
                    B.buffer_store(experts, e, [q])
                    B.buffer_store(tokens, i // used, [q])
                    B.buffer_store(inverse, q, [i])
                    B.buffer_store(mine, q + 1, [0])

            over_ids(place)
    return ib.get()


class ExpertGEMV(QuantGEMV):
    """quant_gemv.py's schedule and knobs, over the sorted rows of an expert matmul (module docstring)."""

    name = "gpu.moe_expert"

    def apply(self, func: tirx.PrimFunc, target: Target, knobs=None) -> s_tir.Schedule | None:  # noqa: ANN001
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or EXPERT_ATTR not in func.attrs:
            return None
        if target.kind.name == "rocm":  # its warp sums over the rows' int64 index fail LLVM's verifier (ds.bpermute
            return None  # takes an i32 lane): dlight's rules take the function there
        return super().apply(func, target, knobs)

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        blocks = root_blocks(sch)
        if blocks is None or len(blocks) != 1:  # expert_matmul: one block, the dequantization inline
            return False
        block = sch.get(blocks[0])
        if len(block.iter_vars) != 3:
            return False
        batch, n_out, n_in = (iv.dom.extent for iv in block.iter_vars)
        gemv(sch, MatmulBlocks(blocks[0], None, None, batch, int(n_out), int(n_in)), target, knobs)
        return True
