"""GPU kernels for the mixture-of-experts ops of luce_compile.lower.moe: the expert sort and the expert matmuls.

- `expert_sort`: moe.sort_func's counting sort (same signature, same result: stable, tokens in order within an
  expert) as one block with a thread per expert. Each thread counts its expert's rows, one thread turns the counts
  into start offsets, and each thread places its rows in order; the ids pass through shared memory a tile at a time,
  so a thread's scan reads shared memory, never global memory, and no atomics are needed (the order is the CPU's).
  A prompt's P = tokens x used rows cost 2 P shared reads per thread: ~0.5 ms for 16K rows, next to its expert GEMMs.
- `expert_route`: moe.route_func (softmax, top k, renormalized weights) in one kernel, a thread per row: the TE form
  lowers to a kernel per stage, seven launches a layer at decode.
- `ExpertGEMV`: the expert matmuls (lower/moe.expert_matmul, marked EXPERT_ATTR) as the batch-1 GEMV's schedule
  (quant_gemv.py) over every sorted row: a warp reduces one (row, output) pair over K, `rows_per_block` pairs a
  block, the row's expert weights dequantized in registers. A decode step reads only the chosen experts' rows
  (rows that share an expert read it again, from L2). Prompts run the same kernel, one weight row per (row, output)
  from L2: the decode kernel, and a prompt's below GROUPED_ROWS_PER_EXPERT rows an expert.
- `grouped_mmq_gemm`: a prompt's expert matmuls as one grouped GEMM, mmq_gemm.py's 8-bit kernel (llama.cpp's
  mul_mat_id over MMQ) over the sorted rows: a block per tile_m sorted rows × tile_n features; the tile's rows are
  one expert's or a few consecutive experts' (the sort groups them), and the block runs the K loop once per expert
  its rows hold, with that expert's weight rows, storing only that expert's rows (ExpertTile). Each row reads its
  token's quantized input (gate, up: the tokens quantized once) or its own (down). Where the rows average fewer than
  GROUPED_ROWS_PER_EXPERT an expert, the tiles would be mostly other experts' rows: ExpertGEMV takes them.
  ExpertGEMV.apply dispatches between the two on the row count at run time (quant_gemm.dispatch_on_batch).
"""

from __future__ import annotations

import tvm
from luce_schedules.cpu.quant_matmul import MatmulBlocks
from luce_schedules.gpu.base import root_blocks, sm_count
from luce_schedules.gpu.mma_gemm import THREADS
from luce_schedules.gpu.mmq_blocks import quantize_rows
from luce_schedules.gpu.mmq_gemm import (
    TILE_K,
    GemmKernel,
    checked_kernel,
    default_tile,
    flat_views,
    plane_args,
    scratch_args,
)
from luce_schedules.gpu.quant_gemm import Dispatched, dispatch_on_batch, rebound
from luce_schedules.gpu.quant_gemv import QuantGEMV, gemv
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B
from tvm.target import Target

from luce_compile.lower.moe import EXPERT_ATTR, GROUPED_ATTR, grouped_above
from luce_compile.lower.q8_gemm import q8_gemm_format

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


ROUTE_THREADS = 64  # rows a block of expert_route: a thread per row


def expert_route(n_expert: int, used: int, norm_w: bool, name: str, threads: bool = True) -> tirx.PrimFunc:
    """moe.route_func for a GPU in one kernel (the TE form lowers to a kernel per stage: seven launches a layer at
    decode): logits (R, n_expert) float32 → ids (R, used) int32, weights (R, used) float32, a thread per row, no
    shared memory. Per row: the maximum and Σ exp(l − max) in expert order, then the used experts one by one, each
    the most probable after the one before in route_func's order (larger probability first, the lower expert on a
    tie), its probability ex · (1 / Σ) as route_func forms it, renormalized by their sum in pick order when norm_w.
    threads=False: the same statements with a serial loop over rows (a CPU harness: tests hold it to route_func)."""
    i32 = _i32
    with IRBuilder() as ib, B.prim_func():
        B.func_name(name)
        rows = tirx.Var("rows", "int64")
        logits = B.arg("logits", B.buffer((rows, n_expert), "float32"))
        ids = B.arg("ids", B.buffer((rows, used), "int32"))
        weights = B.arg("weights", B.buffer((rows, used), "float32"))
        B.func_attr({"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True})
        n_rows = rows.astype("int32")
        f32 = lambda v: tirx.const(v, "float32")  # noqa: E731

        def body(r: tirx.Expr) -> None:
            top = B.alloc_buffer((1,), "float32", scope="local")
            total = B.alloc_buffer((1,), "float32", scope="local")
            last = B.alloc_buffer((2,), "float32", scope="local")  # the previous pick's probability, its expert
            best = B.alloc_buffer((2,), "float32", scope="local")
            chosen = B.alloc_buffer((used,), "float32", scope="local")
            prob = B.alloc_buffer((1,), "float32", scope="local")
            take = B.alloc_buffer((1,), "int32", scope="local")
            B.buffer_store(top, logits[r, 0], [0])
            with B.serial(1, n_expert) as e:
                B.buffer_store(top, tirx.max(top[0], logits[r, e]), [0])
            B.buffer_store(total, f32(0.0), [0])
            with B.serial(0, n_expert) as e:
                B.buffer_store(total, total[0] + tirx.exp(logits[r, e] - top[0]), [0])
            inv = f32(1.0) / total[0]
            B.buffer_store(last, f32(2.0), [0])  # above any probability: the first pick is the largest
            B.buffer_store(last, f32(-1.0), [1])
            for j in range(used):
                B.buffer_store(best, f32(-1.0), [0])
                B.buffer_store(best, f32(-1.0), [1])
                with B.serial(0, n_expert) as e:
                    B.buffer_store(prob, tirx.exp(logits[r, e] - top[0]) * inv, [0])
                    p, ef = prob[0], e.astype("float32")  # exact: n_expert < 2^24
                    after = (p < last[0]) | ((p == last[0]) & (ef > last[1]))  # below the previous pick
                    better = (p > best[0]) | ((p == best[0]) & (ef < best[1])) | (best[1] < f32(0.0))
                    B.buffer_store(take, tirx.Select(after & better, i32(1), i32(0)), [0])
                    B.buffer_store(best, tirx.Select(take[0] == i32(1), p, best[0]), [0])
                    B.buffer_store(best, tirx.Select(take[0] == i32(1), ef, best[1]), [1])
                B.buffer_store(chosen, best[0], [j])
                B.buffer_store(ids, best[1].astype("int32"), [r, j])
                B.buffer_store(last, best[0], [0])
                B.buffer_store(last, best[1], [1])
            if norm_w:
                norm = chosen[0]
                for j in range(1, used):
                    norm = norm + chosen[j]
                for j in range(used):
                    B.buffer_store(weights, chosen[j] / norm, [r, j])
            else:
                for j in range(used):
                    B.buffer_store(weights, chosen[j], [r, j])

        if threads:
            with B.sblock("root"), B.thread_binding((n_rows + (ROUTE_THREADS - 1)) // ROUTE_THREADS,
                                                     thread="blockIdx.x") as bx, \
                    B.thread_binding(ROUTE_THREADS, thread="threadIdx.x") as tx:
                r = bx * ROUTE_THREADS + tx
                with B.If(r < n_rows), B.Then():
                    body(r)
        else:
            with B.sblock("root"), B.serial(0, n_rows) as r:
                body(r)
    return ib.get()


class ExpertGEMV(QuantGEMV):
    """quant_gemv.py's schedule and knobs, over the sorted rows of an expert matmul (module docstring)."""

    name = "gpu.moe_expert"

    def apply(self, func: tirx.PrimFunc, target: Target, knobs=None) -> s_tir.Schedule | list | None:  # noqa: ANN001
        if not isinstance(func, tirx.PrimFunc) or not func.attrs or EXPERT_ATTR not in func.attrs:
            return None
        if target.kind.name == "rocm":  # its warp sums over the rows' int64 index fail LLVM's verifier (ds.bpermute
            return None  # takes an i32 lane): dlight's rules take the function there
        if GROUPED_ATTR not in func.attrs:
            return super().apply(func, target, knobs)
        # the GEMV (the TE computation, its scratch arguments unused) up to grouped_above rows, the grouped GEMM above
        plain = func.without_attr(GROUPED_ATTR)
        gemv_sch = super().apply(plain, target, knobs)
        if gemv_sch is None:
            return None
        n_expert, gather = (int(v) for v in func.attrs[GROUPED_ATTR])
        qtype = str(func.attrs[EXPERT_ATTR])
        x, y = (func.params[i] for i in (0, -1 - len(q8_gemm_format(qtype).specs(32))))
        n_in, n_out = int(x.shape[1]), int(y.shape[1])
        _, tile_n, tile_k = default_tile(n_out, sm_count(target, 132))
        kernel = grouped_mmq_gemm(qtype, n_expert, n_out, n_in, bool(gather), tile_n=tile_n, tile_k=tile_k)
        grouped = Dispatched(tvm.IRModule({"main": plain.with_body(rebound(kernel, plain))}))
        main = dispatch_on_batch(plain, y.shape[0], {grouped_above(n_expert): gemv_sch}, grouped)
        return [Dispatched(tvm.IRModule({"main": main}))]

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


# rows a tile of the grouped GEMM takes: the smallest of mma_gemm's, since a tile holding several experts' rows runs
# its K loop once per expert (a prompt's rows average a few dozen an expert: 512 tokens x 8 of 128 experts, 32)
GROUPED_TILE_M = 32


class ExpertTile(GemmKernel):
    """GemmKernel over the sorted rows of an expert matmul: tile row r reads its token's quantized row (`tokens`,
    gate and up) or its own (down); the weight rows are expert `expert`'s; only the rows [lo, hi) of the tile, that
    expert's, are stored."""

    tokens: tirx.Buffer | None
    expert: tirx.Expr
    lo: tirx.Expr
    hi: tirx.Expr

    def x_row(self, r: tirx.Expr) -> tirx.Expr:
        q = tirx.min(self.m0 + r, self.rows - 1)
        return q if self.tokens is None else self.tokens[q]

    def weight_row(self, f: tirx.Expr) -> tirx.Expr:
        return self.expert * self.n_out + tirx.min(self.n0 + f, self.n_out - 1)

    def stored(self, y_row: tirx.Expr, feat: tirx.Expr) -> tirx.Expr:
        inside = (self.lo <= y_row) & (y_row < self.hi)
        return inside if self.n_out % self.tile_n == 0 else inside & (feat < self.n_out)


def grouped_mmq_gemm(ggml_type: str, n_expert: int, n_out: int, n_in: int, gather: bool, *,
                     tile_m: int = GROUPED_TILE_M, tile_n: int = 128, tile_k: int = max(TILE_K),
                     name: str = "grouped_mmq_gemm") -> tirx.PrimFunc:
    """PrimFunc(x (X, n_in) float32, experts (P,) int32, [tokens (P,) int32], *planes (n_expert·n_out, …),
    y (P, n_out) float32, xq, xd [, xs] (X rows)) with the signature of lower/moe.expert_matmul's grouped form: x
    quantized into the scratch (mmq_gemm's kernel 1), then y[q] = x[tokens[q] if gather else q] @ W[experts[q]].T
    on integer tensor cores (module docstring). The experts are sorted ascending, as the sort leaves them."""
    qtype, fmt, tile_k = checked_kernel("grouped_mmq_gemm", ggml_type, n_in, tile_m, tile_n, tile_k)
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731
    with IRBuilder() as ib, B.prim_func():
        B.func_name(name)
        p_rows = tirx.Var("rows", "int64")
        x_rows = tirx.Var("tokens", "int64") if gather else p_rows
        x = B.arg("x", B.buffer((x_rows, i64(n_in)), "float32"))
        experts = B.arg("experts", B.buffer((p_rows,), "int32"))
        tokens = B.arg("tokens", B.buffer((p_rows,), "int32")) if gather else None
        planes = plane_args(qtype, n_expert * n_out, n_in)
        y = B.arg("y", B.buffer((p_rows, i64(n_out)), "float32"))
        scratch = scratch_args(fmt, x_rows, n_in)
        B.func_attr({"tirx.noalias": True})
        rows, xr = p_rows.astype("int32"), x_rows.astype("int32")
        views = flat_views(planes, scratch, xr, n_in)
        quantize_rows(B.decl_buffer((xr * n_in,), "float32", data=x.data), views["q8"], xr, n_in, fmt.order)
        y_flat = B.decl_buffer((rows * n_out,), "float32", data=y.data)
        _grouped_kernel(qtype, n_out, n_in, (tile_m, tile_n, tile_k), views, rows, experts, tokens, y_flat,
                        fmt.with_sum)
    return ib.get()


def _grouped_kernel(qtype: str, n_out: int, n_in: int, tile: tuple[int, int, int], views: dict, rows: tirx.Expr,
                    experts: tirx.Buffer, tokens: tirx.Buffer | None, y: tirx.Buffer, sums: bool) -> None:
    """Kernel 2 of grouped_mmq_gemm: a block per tile; per expert from its first row's to its last row's, the rows
    of that expert in the tile (contiguous: sorted), the K loop (none where it has no row), their outputs."""
    tile_m, tile_n, _ = tile
    steps = n_in // tile[2]
    bx, by, tx = B.env_thread("blockIdx.x"), B.env_thread("blockIdx.y"), B.env_thread("threadIdx.x")
    with B.launch_thread(bx, -(-n_out // tile_n)), B.launch_thread(by, (rows + (tile_m - 1)) // tile_m), \
            B.launch_thread(tx, THREADS):
        m0 = by * tile_m
        k = ExpertTile(qtype, n_out, n_in, tile, views, rows, tx, m0, bx * tile_n, sums)
        k.tokens = tokens
        k.alloc_shared()
        acc, magic = k.registers()
        span = B.alloc_buffer((2,), "int32", scope="local")  # the experts of the tile's first and last rows
        B.buffer_store(span, experts[m0], [_i32(0)])
        B.buffer_store(span, experts[tirx.min(m0 + tile_m, rows) - 1], [_i32(1)])
        count = B.alloc_buffer((2,), "int32", scope="local")  # the tile's rows of an expert before it, and up to it
        with B.serial(0, span[1] - span[0] + 1) as seg:
            e = span[0] + seg
            for i in range(2):
                B.buffer_store(count, _i32(0), [_i32(i)])
            with B.serial(0, tile_m) as i:
                row = m0 + i
                seen = B.alloc_buffer((1,), "int32", scope="local")
                B.buffer_store(seen, experts[tirx.min(row, rows - 1)], [_i32(0)])
                B.buffer_store(count, count[0] + tirx.Select((row < rows) & (seen[0] < e), _i32(1), _i32(0)),
                               [_i32(0)])
                B.buffer_store(count, count[1] + tirx.Select((row < rows) & (seen[0] <= e), _i32(1), _i32(0)),
                               [_i32(1)])
            k.expert, k.lo, k.hi = e, m0 + count[0], m0 + count[1]
            # the previous expert's last step read a stage that this one's first step overwrites
            B.evaluate(T.tvm_storage_sync("shared"))
            k.accumulate(acc, magic, pairs=tirx.Select(count[1] > count[0], _i32((steps - 1) // 2), _i32(0)))
            k.epilogue(acc, y)
