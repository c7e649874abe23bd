"""Prefill attention on tensor cores: a drop-in for TVM's ragged prefill kernel (batch_prefill_ragged_kv in
relax/frontend/nn/llm/_prefill_kernels.py), the kernel a prefill from an empty cache spends its attention in.

TVM's kernel runs its two products as float32 SIMT loops, 1.6 TFLOPS on the H200, 80% of a 2048-token prefill of
Llama-1B (ncu, benchmarks/results/h200/2026-12-01-prefill.md), with 16 blocks a KV head whatever the GPU's size and
every key tile visited under the causal mask. This one is flash attention (FlashAttention-2's split: each warp owns
16 query rows, no reduction across warps) on WMMA 16×16×16:
- a block takes TQ = 16·warps query rows of one KV head; a row is (token, query head of the KV head's group), as in
  TVM's kernel, so a group's heads share every key and value load;
- Q goes to float16 through K's shared buffer, `keys` rows at a time, into each warp's WMMA fragments, which it keeps
  for the whole tile;
- per step of `keys` keys: the block stages K and V in shared memory (rounded to float16); each warp computes its
  16 × keys scores into shared memory (float32); the online softmax runs in registers, two lanes a row (the row's
  running max and sum, the lane's half of the row's O, all float32), and writes P in float16; the step's P·V goes
  through the score buffer in passes of up to 64 columns into the lanes' O;
- under the causal mask a tile stops at its last row's last visible key, and the heaviest tiles (the last rows)
  are taken first; blocks walk tiles over the batch (tile += blocks) as TVM's kernel does, the KV head as blockIdx.x.
- every buffer is static shared memory (48 KiB): the largest tile of TILES that fits, 4 warps × 64 keys at head
  dim 64, 4 × 32 at 128, 2 × 32 at 256.
Same signature, same outputs (O, and the base-2 log-sum-exp the cache merges partial states with), same masked
score handling (-5e4 start, no NaN for a row with no visible key). `rotary_mode` is ignored: luce-compile applies
RoPE in the graph (RopeMode.NONE), so the cache never asks for inline rotation.

Precision: Q, K, V and P are rounded to float16 before the float32-accumulated products: the same operand rounding
as the float16 GEMMs (tensor_gemm.py), so it is used only with `--precision` f16 (auto on CUDA); f32 keeps TVM's
kernel. scripts/device_check.py checks it against float64 numpy with that rounding emulated (`attention`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from luce_schedules.gpu.tensor_gemm import DEFAULT_SHARED_BYTES
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as B

FRAG = 16  # WMMA m16n16k16
F16, F32 = "float16", "float32"
MASKED = -5e4  # TVM's start value for the running max: finite, so exp2(m_old - m_new) is never inf - inf
PAD_F32, PAD_F16 = 4, 8  # row padding of the shared tiles: WMMA's ldm rule (16 bytes) and fewer bank conflicts


@dataclass(frozen=True)
class PrefillTile:
    warps: int  # each warp owns 16 query rows: TQ = 16·warps
    keys: int  # keys per step, a multiple of 16
    blocks_per_sm: int = 4  # blocks a KV head gets: blocks_per_sm · SMs / KV heads (at least one per SM in all)

    @property
    def rows(self) -> int:
        return FRAG * self.warps


def pv_width(keys: int, d_v: int) -> int:
    """Columns of P·V a pass: the step's P·V leaves through the score buffer, in passes of this width: the widest
    multiple of 16 that divides d_v and fits the buffer's max(keys, 64) columns (48 at head dim 96, 16 at 80)."""
    return max(w for w in range(FRAG, min(d_v, max(keys, 64)) + 1, FRAG) if d_v % w == 0)


def shared_bytes(tile: PrefillTile, d: int, d_v: int) -> int:
    """Shared memory of one block: K (Q staged through it first), V, P (float16), and the scores, then a step's P·V
    in passes of pv_width columns (float32)."""
    tq, tk = tile.rows, tile.keys
    halves = tk * d + tk * (d_v + PAD_F16) + tq * (tk + PAD_F16)
    return 2 * halves + 4 * tq * (max(tk, pv_width(tk, d_v)) + PAD_F32)


# Static shared memory only: TVM's sync planner treats every dynamic shared buffer as one (the merge pass may overlap
# them), so with them it puts a barrier between any two accesses. Best first; the first that fits is taken: 4×64 at
# head dim 64 (44 KiB), 4×32 at 128 (39 KiB), 2×32 at 256 (44 KiB).
TILES = (PrefillTile(4, 64), PrefillTile(4, 32), PrefillTile(2, 32), PrefillTile(2, 16), PrefillTile(1, 16))


def default_tile(d: int, d_v: int) -> PrefillTile | None:
    """The first tile of TILES that fits static shared memory; None when none does (TVM's kernel stays)."""
    return next((tile for tile in TILES if shared_bytes(tile, d, d_v) <= DEFAULT_SHARED_BYTES), None)


# A lane holds half its row's O and a warp its rows' Q fragments in registers: at head dim 256 that is ~250 registers
# (ptxas: 255, 48 bytes spilled); past it the kernel would live in local memory, and TVM's kernel serves.
MAX_HEAD_DIM = 256


def supports(d: int, d_v: int, dtype: str) -> bool:
    """WMMA tiles the head dims, they fit the registers and a tile fits, and the cache is float32 or float16."""
    return (d % FRAG == 0 and d_v % FRAG == 0 and max(d, d_v) <= MAX_HEAD_DIM and dtype in (F32, F16)
            and default_tile(d, d_v) is not None)


def ragged_prefill(h_kv: int, h_q: int, d: int, d_v: int, dtype: str, *, tile: PrefillTile,
                   sm_count: int) -> tirx.PrimFunc:
    """batch_prefill_ragged_kv(q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, output, lse,
    causal, rotary_mode, rope_scale, rope_theta, sm_scale): TVM's signature and buffer declarations."""
    if not supports(d, d_v, dtype):
        raise ValueError(f"tensor-core prefill attention: head dims {d}/{d_v} with a {dtype} cache are not taken "
                         f"(multiples of {FRAG} up to {MAX_HEAD_DIM}); TVM's kernel serves them")
    return _RaggedPrefill(h_kv, h_q, d, d_v, dtype, tile, sm_count).build()


def _i32(v: int) -> tirx.IntImm:
    return tirx.const(v, "int32")


def _f32(v: float) -> tirx.FloatImm:
    return tirx.const(v, F32)


def _store(buf: tirx.Buffer, idx, value) -> None:
    B.buffer_store(buf, value, idx if isinstance(idx, list) else [idx])


def _sync(scope: str = "shared") -> None:
    B.evaluate(T.tvm_storage_sync(scope))


def _ptr(buf: tirx.Buffer, offset, mode: str):
    return buf.access_ptr(mode, ptr_type=buf.dtype, offset=offset)


class _RaggedPrefill:
    """The kernel's builder. TVM's sync planner (ThreadSync) puts a block barrier between any write and read of one
    shared buffer at different indices, loop iterations included: so each loop here only reads or only writes
    shared memory, and what a lane keeps across steps (its row's running max and sum, its share of O) stays in
    registers."""

    def __init__(self, h_kv: int, h_q: int, d: int, d_v: int, dtype: str, tile: PrefillTile, sm_count: int):
        self.h_kv, self.h_q, self.d, self.d_v, self.dtype = h_kv, h_q, d, d_v, dtype
        self.group = h_q // h_kv
        self.tq, self.tk, self.warps = tile.rows, tile.keys, tile.warps
        self.threads = 32 * tile.warps
        self.blocks = max(1, -(-tile.blocks_per_sm * sm_count // h_kv))
        self.pv = pv_width(self.tk, d_v)
        self.ld_s, self.ld_p, self.ld_v = max(self.tk, self.pv) + PAD_F32, self.tk + PAD_F16, d_v + PAD_F16

    def args(self) -> None:
        h_kv, h_q, d, d_v, dtype = self.h_kv, self.h_q, self.d, self.d_v, self.dtype
        batch_size, qo_len, kv_len = (tirx.Var(n, "int32") for n in ("batch_size", "qo_len", "kv_len"))
        offs = [tirx.Var(n, "int32") for n in ("q_indptr_elem_offset", "kv_indptr_elem_offset",
                                               "q_rope_position_elem_offset", "k_rope_pos_offset_elem_offset")]
        self.batch_size = batch_size
        self.q = B.arg("q", B.buffer((qo_len, h_q, d), dtype))
        self.q_indptr = B.arg("q_indptr", B.buffer((batch_size + 1,), "int32", elem_offset=offs[0]))
        self.k = B.arg("k", B.buffer((kv_len, h_kv, d), dtype))
        self.v = B.arg("v", B.buffer((kv_len, h_kv, d_v), dtype))
        self.kv_indptr = B.arg("kv_indptr", B.buffer((batch_size + 1,), "int32", elem_offset=offs[1]))
        B.arg("q_rope_position", B.buffer((qo_len,), "int32", elem_offset=offs[2]))
        B.arg("k_rope_pos_offset", B.buffer((batch_size,), "int32", elem_offset=offs[3]))
        self.output = B.arg("output", B.buffer((qo_len, h_q, d_v), dtype))
        self.lse = B.arg("lse", B.buffer((qo_len, h_q), F32))
        self.causal = B.arg("causal", tirx.Var("causal", "int32"))
        B.arg("rotary_mode", tirx.Var("rotary_mode", "int32"))  # ignored: RoPE is the graph's (module docstring)
        B.arg("rope_scale", tirx.Var("rope_scale", F32))
        B.arg("rope_theta", tirx.Var("rope_theta", F32))
        self.sm_scale = B.arg("sm_scale", tirx.Var("sm_scale", F32))

    def buffers(self) -> None:
        tq, tk, d, d_v = self.tq, self.tk, self.d, self.d_v
        self.k_s = B.alloc_buffer((tk, d), F16, scope="shared")
        self.v_s = B.alloc_buffer((tk, self.ld_v), F16, scope="shared")
        self.p_s = B.alloc_buffer((tq, self.ld_p), F16, scope="shared")
        self.s_s = B.alloc_buffer((tq, self.ld_s), F32, scope="shared")  # the scores, then the step's P·V
        self.q_frag = B.alloc_buffer((d // FRAG * FRAG, FRAG), F16, scope="wmma.matrix_a")
        self.k_frag = B.alloc_buffer((FRAG, FRAG), F16, scope="wmma.matrix_b")
        self.p_frag = B.alloc_buffer((tk // FRAG * FRAG, FRAG), F16, scope="wmma.matrix_a")
        self.v_frag = B.alloc_buffer((FRAG, FRAG), F16, scope="wmma.matrix_b")
        self.acc = B.alloc_buffer((FRAG, FRAG), F32, scope="wmma.accumulator")
        # a lane's registers: its row's scores (then probabilities), its half of the row's O, running max and sum
        self.sv = B.alloc_buffer((tk // 2,), F32, scope="local")
        self.o_reg = B.alloc_buffer((d_v // 2,), F32, scope="local")
        self.m_run = B.alloc_buffer((1,), F32, scope="local")
        self.d_run = B.alloc_buffer((1,), F32, scope="local")
        self.m_new = B.alloc_buffer((1,), F32, scope="local")
        self.total = B.alloc_buffer((1,), F32, scope="local")
        self.alpha = B.alloc_buffer((1,), F32, scope="local")

    def build(self) -> tirx.PrimFunc:
        with IRBuilder() as ib, B.prim_func():
            B.func_name("batch_prefill_ragged_kv")
            self.args()
            # the KV head is blockIdx.x: consecutive blocks (which the GPU deals round-robin to its SMs) are the
            # heads' first walkers, so the busy blocks spread over every SM. With the walker as x, an SM's blocks
            # were all busy or all idle (measured 1.3-1.45x slower at 512 tokens with 4 blocks a head per SM).
            head, walker, tx = B.env_thread("blockIdx.x"), B.env_thread("blockIdx.y"), B.env_thread("threadIdx.x")
            with B.launch_thread(head, self.h_kv), B.launch_thread(walker, self.blocks), \
                    B.launch_thread(tx, self.threads):
                self.by, self.tx, self.warp, self.lane = head, tx, tx // 32, tx % 32
                # a lane's row in the tile (two lanes a row) and which of the row's interleaved columns it owns
                self.row, self.half = self.warp * FRAG + self.lane // 2, self.lane % 2
                self.buffers()
                tile_id, b_idx, before = (B.alloc_buffer((1,), "int32", scope="local") for _ in range(3))
                _store(tile_id, 0, walker)
                _store(b_idx, 0, _i32(0))
                _store(before, 0, _i32(0))
                with B.While(T.tvm_thread_invariant(b_idx[0] < self.batch_size)):
                    b = b_idx[0]
                    n_tiles = tirx.floordiv((self.q_indptr[b + 1] - self.q_indptr[b]) * self.group + self.tq - 1,
                                            self.tq)
                    # (two ifs, no else: the sync planner takes only an if's condition as thread-invariant)
                    with B.If(T.tvm_thread_invariant(tile_id[0] < before[0] + n_tiles)), B.Then():
                        # the last rows see the most keys under the causal mask: they go first
                        self.tile(b, (n_tiles - 1 - (tile_id[0] - before[0])) * self.tq)
                        _store(tile_id, 0, tile_id[0] + self.blocks)
                    with B.If(T.tvm_thread_invariant(tile_id[0] >= before[0] + n_tiles)), B.Then():
                        _store(before, 0, before[0] + n_tiles)
                        _store(b_idx, 0, b_idx[0] + 1)
        return ib.get().with_attr("tirx.is_scheduled", True)

    def rows_of(self, i):
        """A tile row's (token within the sequence, query head)."""
        return i // self.group, self.by * self.group + i % self.group

    def tile(self, b, row0) -> None:
        tq, tk, d, d_v, threads, tx = self.tq, self.tk, self.d, self.d_v, self.threads, self.tx
        q0, kv0 = self.q_indptr[b], self.kv_indptr[b]
        qo_n, kv_n = self.q_indptr[b + 1] - q0, self.kv_indptr[b + 1] - kv0
        _store(self.m_run, 0, _f32(MASKED))  # TVM's start: a row without a visible key ends with O = 0
        _store(self.d_run, 0, _f32(1.0))
        with B.serial(0, d_v // 2) as c:
            _store(self.o_reg, c, _f32(0.0))
        # Q, rounded to float16, staged through K's buffer `tk` rows at a time into the warps' fragments (held for
        # the whole tile); rows past the sequence are zeros (computed, never stored)
        chunks = -(-tq // tk)
        for chunk in range(chunks):
            if chunk:
                _sync()  # the previous chunk's warps have their fragments
            with B.serial(0, -(-tk * d // threads)) as e:
                idx = e * threads + tx
                i, j = idx // d, idx % d
                with B.If(tirx.all(idx < tk * d, chunk * tk + i < tq)), B.Then():
                    tok, head = self.rows_of(row0 + chunk * tk + i)
                    _store(self.k_s, [i, j], tirx.Cast(F16, tirx.if_then_else(
                        tok < qo_n, self.q[q0 + tirx.min(tok, qo_n - 1), head, j], tirx.const(0, self.dtype))))
            _sync()
            r0 = self.warp * FRAG - chunk * tk  # the warp's first row within the chunk
            with contextlib.ExitStack() as only_the_chunks_warps:
                if chunks > 1:
                    only_the_chunks_warps.enter_context(B.If(self.warp // (tk // FRAG) == chunk))
                    only_the_chunks_warps.enter_context(B.Then())
                for kk in range(d // FRAG):
                    B.evaluate(T.tvm_load_matrix_sync(self.q_frag.data, FRAG, FRAG, FRAG, kk,
                                                      _ptr(self.k_s, r0 * d + kk * FRAG, "r"), d, "row_major"))
        # keys a tile needs: under the causal mask, up to its last row's last visible key
        last_tok = tirx.min(qo_n - 1, (row0 + tq - 1) // self.group)
        kv_end = tirx.if_then_else(self.causal > 0, tirx.min(kv_n, last_tok + kv_n - qo_n + 1), kv_n)
        # the lane's row: keys at or past `limit` are masked (causal, or past the sequence)
        tok = (row0 + self.row) // self.group
        limit = tirx.if_then_else(self.causal > 0, tirx.min(kv_n, tok + kv_n - qo_n + 1), kv_n)
        with B.serial(0, tirx.floordiv(kv_end + tk - 1, tk)) as step:
            self.step(step * tk, kv0, kv_n, limit - step * tk)
        self.epilogue(row0, q0, qo_n)

    def step(self, k_start, kv0, kv_n, limit) -> None:
        tk, d, d_v, threads, tx = self.tk, self.d, self.d_v, self.threads, self.tx
        r0, i, half = self.warp * FRAG, self.row, self.half
        _sync()  # every warp is done with the last step's K and V
        # K and V of `tk` keys, rounded to float16 (zeros past the sequence)
        for buf, src, width in ((self.k_s, self.k, d), (self.v_s, self.v, d_v)):
            with B.serial(0, -(-tk * width // threads)) as e:
                idx = e * threads + tx
                with B.If(idx < tk * width), B.Then():
                    row, j = idx // width, idx % width
                    key = k_start + row
                    _store(buf, [row, j], tirx.Cast(F16, tirx.if_then_else(
                        key < kv_n, src[kv0 + tirx.min(key, kv_n - 1), self.by, j], tirx.const(0, self.dtype))))
        _sync()
        # S = Q Kᵀ for the warp's 16 rows
        for jn in range(tk // FRAG):
            B.evaluate(T.tvm_fill_fragment(self.acc.data, FRAG, FRAG, FRAG, 0, _f32(0.0)))
            for kk in range(d // FRAG):
                B.evaluate(T.tvm_load_matrix_sync(self.k_frag.data, FRAG, FRAG, FRAG, 0,
                                                  _ptr(self.k_s, jn * FRAG * d + kk * FRAG, "r"), d, "col_major"))
                B.evaluate(T.tvm_mma_sync(self.acc.data, 0, self.q_frag.data, kk, self.k_frag.data, 0,
                                          self.acc.data, 0))
            B.evaluate(T.tvm_store_matrix_sync(self.acc.data, FRAG, FRAG, FRAG, 0,
                                               _ptr(self.s_s, r0 * self.ld_s + jn * FRAG, "w"), self.ld_s,
                                               "row_major"))
        _sync()
        # online softmax in registers, two lanes a row (interleaved columns: fewer bank conflicts)
        scale = self.sm_scale * _f32(math.log2(math.e))
        sv, m_new, total = self.sv, self.m_new, self.total
        _store(m_new, 0, self.m_run[0])
        with B.serial(0, tk // 2) as c:
            _store(sv, c, tirx.if_then_else(c * 2 + half < limit, self.s_s[i, c * 2 + half] * scale, _f32(MASKED)))
            _store(m_new, 0, tirx.max(m_new[0], sv[c]))
        _store(m_new, 0, T.cuda.warp_reduce(m_new[0], "max", 2))
        _store(total, 0, _f32(0.0))
        with B.serial(0, tk // 2) as c:
            _store(sv, c, tirx.if_then_else(c * 2 + half < limit, tirx.exp2(sv[c] - m_new[0]), _f32(0.0)))
            _store(total, 0, total[0] + sv[c])
        with B.serial(0, tk // 2) as c:
            _store(self.p_s, [i, c * 2 + half], tirx.Cast(F16, sv[c]))
        alpha = self.alpha  # a register: the expression would read m_run after its update below
        _store(alpha, 0, tirx.exp2(self.m_run[0] - m_new[0]))
        _store(self.d_run, 0, self.d_run[0] * alpha[0] + T.cuda.warp_reduce(total[0], "sum", 2))
        _store(self.m_run, 0, m_new[0])
        with B.serial(0, d_v // 2) as c:
            _store(self.o_reg, c, self.o_reg[c] * alpha[0])
        _sync()
        # this step's P·V into shared memory, then into the lanes' O
        for kk in range(tk // FRAG):
            B.evaluate(T.tvm_load_matrix_sync(self.p_frag.data, FRAG, FRAG, FRAG, kk,
                                              _ptr(self.p_s, r0 * self.ld_p + kk * FRAG, "r"), self.ld_p,
                                              "row_major"))
        pv = self.pv
        for pc in range(d_v // pv):  # passes of pv columns through the score buffer
            if pc:
                _sync()  # every lane has read the last pass
            for jd in range(pv // FRAG):
                B.evaluate(T.tvm_fill_fragment(self.acc.data, FRAG, FRAG, FRAG, 0, _f32(0.0)))
                for kk in range(tk // FRAG):
                    B.evaluate(T.tvm_load_matrix_sync(
                        self.v_frag.data, FRAG, FRAG, FRAG, 0,
                        _ptr(self.v_s, kk * FRAG * self.ld_v + pc * pv + jd * FRAG, "r"), self.ld_v, "row_major"))
                    B.evaluate(T.tvm_mma_sync(self.acc.data, 0, self.p_frag.data, kk, self.v_frag.data, 0,
                                              self.acc.data, 0))
                B.evaluate(T.tvm_store_matrix_sync(self.acc.data, FRAG, FRAG, FRAG, 0,
                                                   _ptr(self.s_s, r0 * self.ld_s + jd * FRAG, "w"), self.ld_s,
                                                   "row_major"))
            self._pv_into_registers(pc)

    def _pv_into_registers(self, pc: int) -> None:
        pv, i, half = self.pv, self.row, self.half
        _sync()
        with B.serial(0, pv // 2) as c:
            _store(self.o_reg, pc * (pv // 2) + c, self.o_reg[pc * (pv // 2) + c] + self.s_s[i, c * 2 + half])

    def epilogue(self, row0, q0, qo_n) -> None:
        tok, head = self.rows_of(row0 + self.row)
        with B.If(tok < qo_n), B.Then():
            half_pass = self.pv // 2  # o_reg[c]: pass c // half_pass, column 2·(c % half_pass) + half within it
            with B.serial(0, self.d_v // 2) as c:
                col = c // half_pass * self.pv + c % half_pass * 2 + self.half
                _store(self.output, [q0 + tok, head, col], tirx.Cast(self.dtype, self.o_reg[c] / self.d_run[0]))
            _store(self.lse, [q0 + tok, head], self.m_run[0] + tirx.log2(self.d_run[0]))
        _sync()  # the next tile overwrites the shared tiles
