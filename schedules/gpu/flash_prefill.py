"""Prefill attention on mma.sync tensor cores, FlashAttention-2 style: the ragged kernel (a prefill from an empty
cache, batch_prefill_ragged_kv) and the paged one (a later chunk against its cached pages, batch_prefill_paged_kv),
drop-ins for TVM's kernels of those names (relax/frontend/nn/llm/_prefill_kernels.py). For attention sinks (gpt-oss:
lower/attention_sinks.py) the ragged kernel folds each row's sink in, and the same tile serves TVM's decode signature
(paged_decode: a query token a sequence, several warps sharing each step's keys, merged at the end), which folds it
where its pages end at the query's own key.

Why a second kernel beside attention_prefill.py (WMMA 16×16×16, 48 KiB static shared memory, 4 warps × 32 keys at
head dim 128): on an H100 the 8B's 32K prefill spent ~8.4 s of 13.1 in it (~34 TFLOP/s, issue 38). Here:
- a block is `warps` warps, each owning 16 query rows (TQ = 16·warps rows of one KV head; a row is (token, query
  head of the group), as attention_prefill.py: a group's heads share every key and value load), and walks the keys
  `keys` at a time: 8 warps × 64 keys at head dims up to 128;
- Q, K and V are float16 in global memory (the cache's type) and reach shared memory by cp.async (16 bytes a copy,
  rows past the sequence zero-filled by the copy's source size); K and V are double-buffered: the next step's copies
  are in flight while this step's mma.sync run. Q goes through the second stage's buffer once per tile, then lives
  in registers (ldmatrix.x4) for the whole tile;
- S = Q·Kᵀ: mma.sync m16n8k16 (mma_gemm.MMA), K's rows as the "col" B operand (ldmatrix.x4); the online softmax
  runs on the accumulators in registers (a row's 4 lanes reduce by shuffles); P, rounded to float16, goes straight
  from the S accumulators into A fragments (the m16n8 C layout of two adjacent key octets is the m16k16 A layout);
  O += P·V with V through ldmatrix.x4.trans. O, the running max and sum stay in registers; one pass to global memory
  at the end of the tile;
- causal: a tile walks keys up to its last row's last visible key (the tiles above the diagonal are never visited);
  the per-key mask is applied on every step (the cost is a compare a score); the heaviest tiles go first; one block
  per (KV head, tile), the GPU balances them (grid: KV heads × an upper bound of the tiles; blocks past the last
  tile return);
- shared memory: 2 stages × (K + V) tiles, rows padded by 16 bytes (8 row addresses of an ldmatrix in 8 distinct
  bank groups), as dynamic shared memory (68 KiB at head dim 128: fits sm_86/sm_120's 99 KiB). TVM's sync planner
  does not see cp.async or ldmatrix as shared accesses: every barrier here is written out, two a step.

The tile schedule (which tiles, which keys a tile walks, which keys a row sees) is the functions below, written
once over Python ints or TIR expressions; tests/schedules/flash_emulation.py runs the same functions in numpy with
the kernel's float16 roundings and float32 online softmax, against float64.

Precision: Q, K, V are float16 (the cache's) and P is rounded to float16 before P·V; S, O, the running max and sum
are float32. Same outputs as TVM's kernels (O, and the base-2 log-sum-exp the cache merges partial states with),
same start (-5e4, sum 1: a row with no visible key gets O = 0). `rotary_mode` is ignored (RoPE is the graph's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from luce_schedules.gpu.mma_gemm import LDMATRIX, MMA, _guard, _pack_half
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as B

from luce_compile.lower.attention_sinks import KEY_POSITION, QUERY_POSITION, SINK

F16, F32 = "float16", "float32"
MASKED = -5e4  # TVM's start value for the running max (attention_prefill.MASKED)
PAD = 8  # float16 values of padding a shared row: 16 bytes
CHUNK = 8  # float16 values a cp.async moves (16 bytes)
LDMATRIX_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
MAX_DYNAMIC_SHARED = 99 * 1024  # sm_86 and sm_120's opt-in limit a block (sm_90: 227 KiB): one kernel for all
MAX_HEAD_DIM = 128  # Q fragments (d/4 words) + O (d_v/2) + S (keys/2) a lane: ~170 registers at 128


@dataclass(frozen=True)
class FlashTile:
    warps: int = 8  # each warp owns 16 query rows: TQ = 16·warps
    keys: int = 64  # keys a step, a multiple of 16
    splits: int = 1  # warps sharing a row's keys (decode): each takes keys / splits of a step, merged at the end

    @property
    def rows(self) -> int:
        return 16 * self.warps

    @property
    def warp_keys(self) -> int:
        return self.keys // self.splits


def stage_elems(tile: FlashTile, d: int, d_v: int) -> int:
    """float16 values of one stage: K (keys × d) and V (keys × d_v), rows padded."""
    return tile.keys * (d + PAD) + tile.keys * (d_v + PAD)


def shared_bytes(tile: FlashTile, d: int, d_v: int) -> int:
    """Two stages; Q (TQ × d) is staged from the second stage's start and may reach past it."""
    stage = stage_elems(tile, d, d_v)
    return 2 * max(2 * stage, stage + tile.rows * (d + PAD))


# Best first. 8 × 64 is FlashAttention-2's 128 × 64 at head dim 128 (one 16-row fragment a warp, so Q, O and S of a
# lane fit registers); 4 × 64 is the fallback where 8 warps' shared memory would not fit.
TILES = (FlashTile(8, 64), FlashTile(4, 64), FlashTile(4, 32))


def default_tile(d: int, d_v: int) -> FlashTile | None:
    return next((t for t in TILES if shared_bytes(t, d, d_v) <= MAX_DYNAMIC_SHARED), None)


def supports(d: int, d_v: int, dtype: str) -> bool:
    """float16 caches (cp.async copies the cache's bytes), head dims multiples of 16 up to MAX_HEAD_DIM."""
    return (dtype == F16 and d % 16 == 0 and d_v % 16 == 0 and max(d, d_v) <= MAX_HEAD_DIM
            and default_tile(d, d_v) is not None)


# ---- the tile schedule: Python ints (the emulation) or TIR expressions (the kernel) -------------------------------
def _is_int(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _min(a, b):
    return min(a, b) if _is_int(a, b) else tirx.min(a, b)


def _select(cond, a, b):
    return (a if cond else b) if isinstance(cond, bool) else tirx.if_then_else(cond, a, b)


def tiles_of(qo_n, group: int, rows: int):
    """Tiles of a sequence of qo_n query tokens: its qo_n · group rows, `rows` at a time."""
    return (qo_n * group + rows - 1) // rows


def tile_bound(qo_len, batch_size, group: int, rows: int):
    """An upper bound of the tiles of a batch (the grid's extent): each sequence adds at most one partial tile."""
    return (qo_len * group + rows - 1) // rows + batch_size


def row_limit(tok, qo_n, kv_n, causal):
    """Keys at or past this index are hidden from query token `tok` (TVM's _causal_mask: the query tokens are the
    last qo_n of the sequence's kv_n)."""
    return _select(causal, _min(kv_n, tok + kv_n - qo_n + 1), kv_n)


def kv_steps(tile, qo_n, kv_n, causal, group: int, tile_shape: FlashTile):
    """Key steps tile `tile` walks: up to its last row's last visible key."""
    last_tok = _min(qo_n - 1, ((tile + 1) * tile_shape.rows - 1) // group)
    return (row_limit(last_tok, qo_n, kv_n, causal) + tile_shape.keys - 1) // tile_shape.keys


def block_order(n_tiles, i):
    """The i-th block of a sequence's n_tiles takes this tile: the last rows (the most keys under the mask) first."""
    return n_tiles - 1 - i


# ---- the kernels ------------------------------------------------------------------------------------------------
def ragged_prefill(h_kv: int, h_q: int, d: int, d_v: int, dtype: str, *, tile: FlashTile | None = None,
                   d_att: int | None = None):
    """batch_prefill_ragged_kv(q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, output, lse, causal,
    rotary_mode, rope_scale, rope_theta, sm_scale): TVM's signature. `d_att`: the rows carry attention sinks after the
    head's d_att columns (lower/attention_sinks.py): every row folds its sink in (a step's own keys: causal, the
    query's own key is always here)."""
    return _Flash(h_kv, h_q, d, d_v, dtype, tile, mode="ragged", d_att=d_att).build()


def paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, *, page_size: int = 16, tile: FlashTile | None = None):
    """batch_prefill_paged_kv(q, q_indptr, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
    q_rope_position, output, lse, causal, rotary_mode, rope_scale, rope_theta, sm_scale): TVM's signature (without
    a sliding window: TVM's kernel keeps those layers)."""
    return _Flash(h_kv, h_q, d, d, dtype, tile, mode="paged", page_size=page_size).build()


# (keys a step, warps sharing them) of the decode kernel, best first: 16 keys a warp; head dims past 80 take 64 keys a
# step (two stages of 128 keys of a head of 128 are 136 KiB, past sm_86/sm_120's 99)
DECODE_STEPS = ((128, 8), (64, 4))
DECODE_NAMES = {"q": "Q", "page_indptr": "page_table_indptr", "page_values": "page_table_values"}  # TVM's


def decode_tile(group: int, d: int) -> FlashTile:
    """One block per (sequence, KV head): the fewest warps whose 16-row fragments hold the group's query heads; where
    that is one warp, several warps take a step's keys between them (a decode has no other parallelism in a block:
    one warp would walk a long context alone): DECODE_STEPS' first whose stages fit head dim d."""
    rows = -(-group // 16)
    tiles = [FlashTile(rows, keys, splits if rows == 1 else 1) for keys, splits in DECODE_STEPS]
    return next((t for t in tiles if shared_bytes(t, d, d) <= MAX_DYNAMIC_SHARED), tiles[-1])


def paged_decode(h_kv: int, h_q: int, d: int, dtype: str, sliding_window: bool, *, page_size: int = 16,
                 d_att: int | None = None):
    """batch_decode_paged_kv(_sliding_window)(q, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
    q_rope_position, output, lse, rotary_mode, rope_scale, rope_theta, sm_scale): TVM's signature, one query token a
    sequence against its pages (the token's own key appended: no mask), a sliding window's sink and ring read as
    TVM's kernel reads them. Written for attention sinks (`d_att`): a row folds its sink in where this call's last key
    is at the query's position (lower/attention_sinks.py), so only models with sinks take it; TVM's kernel keeps the
    others. One block a (sequence, KV head) walks every key, its warps sharing each step's (decode_tile); no split of
    a long context across blocks yet."""
    return _Flash(h_kv, h_q, d, d, dtype, decode_tile(h_q // h_kv, d), mode="decode", page_size=page_size,
                  sliding=sliding_window, d_att=d_att).build()


def _i32(v: int):
    return tirx.const(v, "int32")


def _f32(v: float):
    return tirx.const(v, F32)


def _store(buf, idx, value) -> None:
    B.buffer_store(buf, value, idx if isinstance(idx, list) else [idx])


def _sync() -> None:
    B.evaluate(T.tvm_storage_sync("shared"))


class _Flash:
    def __init__(self, h_kv, h_q, d, d_v, dtype, tile, *, mode: str, page_size: int = 16, sliding: bool = False,
                 d_att: int | None = None):
        if not supports(d, d_v, dtype):
            raise ValueError(f"flash prefill attention: head dims {d}/{d_v} with a {dtype} cache are not taken "
                             f"(float16, multiples of 16 up to {MAX_HEAD_DIM}); attention_prefill.py or TVM's serve")
        self.h_kv, self.h_q, self.d, self.d_v, self.dtype = h_kv, h_q, d, d_v, dtype
        self.group = h_q // h_kv
        self.tile_shape = tile = tile or default_tile(d, d_v)
        if tile.keys % 16 or tile.warp_keys % 16 or shared_bytes(tile, d, d_v) > MAX_DYNAMIC_SHARED or \
                (tile.splits > 1 and mode != "decode"):
            raise ValueError(f"flash prefill attention: tile {tile} does not fit head dims {d}/{d_v} ({mode})")
        self.tq, self.tk, self.threads = tile.rows, tile.keys, 32 * tile.warps * tile.splits
        self.splits, self.wk = tile.splits, tile.warp_keys
        self.mode, self.page_size, self.sliding = mode, page_size, sliding
        self.paged = mode in ("paged", "decode")  # keys from the pages (decode: one query token a sequence)
        if d_att is not None and (mode == "paged" or d_att + QUERY_POSITION + 2 > d):
            raise ValueError(f"flash attention: sinks fold in the ragged and decode kernels, after d_att = {d_att} of "
                             f"{d} columns")
        self.d_att = d_att
        self.ld_k, self.ld_v = d + PAD, d_v + PAD
        self.stage = stage_elems(tile, d, d_v)

    # ---- arguments ----
    def args(self) -> None:
        h_kv, h_q, d, d_v, dtype = self.h_kv, self.h_q, self.d, self.d_v, self.dtype
        batch_size = tirx.Var("batch_size", "int32")
        qo_len = batch_size if self.mode == "decode" else tirx.Var("qo_len", "int32")
        self.batch_size, self.qo_len = batch_size, qo_len
        offset = lambda name: tirx.Var(name, "int32")  # noqa: E731
        # TVM's parameter names: its decode kernel's differ from its prefill kernels'
        name = (lambda n: DECODE_NAMES.get(n, n)) if self.mode == "decode" else (lambda n: n)  # noqa: E731
        self.q = B.arg(name("q"), B.buffer((qo_len, h_q, d), dtype))
        if self.mode != "decode":
            self.q_indptr = B.arg(name("q_indptr"), B.buffer((batch_size + 1,), "int32",
                                                       elem_offset=offset("q_indptr_elem_offset")))
        if self.paged:
            max_pages, nnz = tirx.Var("max_num_pages", "int32"), tirx.Var("nnz_pages", "int32")
            self.pages = B.arg(name("pages"), B.buffer((max_pages, 2, h_kv, self.page_size, d), dtype,
                                                       elem_offset=tirx.Var("pages_elem_offset", "int64")))
            self.page_indptr = B.arg(name("page_indptr"), B.buffer((batch_size + 1,), "int32",
                                                                   elem_offset=offset("page_indptr_elem_offset")))
            self.page_values = B.arg(name("page_values"), B.buffer((nnz,), "int32",
                                                                   elem_offset=offset("page_values_elem_offset")))
            info_shape = (3, batch_size) if self.sliding else (batch_size,)  # TVM's _declare_length_info
            self.length_info = B.arg(name("length_info"), B.buffer(info_shape, "int32",
                                                                   elem_offset=offset("length_info_elem_offset")))
            B.arg(name("k_rope_pos_offset"), B.buffer((batch_size,), "int32",
                                                      elem_offset=offset("k_rope_pos_offset_elem_offset")))
            B.arg(name("q_rope_position"), B.buffer((qo_len,), "int32",
                                                    elem_offset=offset("q_rope_position_elem_offset")))
        else:
            kv_len = tirx.Var("kv_len", "int32")
            self.k = B.arg("k", B.buffer((kv_len, h_kv, d), dtype))
            self.v = B.arg("v", B.buffer((kv_len, h_kv, d_v), dtype))
            self.kv_indptr = B.arg("kv_indptr", B.buffer((batch_size + 1,), "int32",
                                                         elem_offset=offset("kv_indptr_elem_offset")))
            B.arg("q_rope_position", B.buffer((qo_len,), "int32", elem_offset=offset("q_rope_position_elem_offset")))
            B.arg("k_rope_pos_offset", B.buffer((batch_size,), "int32",
                                                elem_offset=offset("k_rope_pos_offset_elem_offset")))
        self.output = B.arg(name("output"), B.buffer((qo_len, h_q, d_v), dtype))
        self.lse = B.arg(name("lse"), B.buffer((qo_len, h_q), F32))
        # decode: the cache holds exactly the keys a token sees (its own appended): no mask
        self.causal = _i32(0) if self.mode == "decode" else B.arg(name("causal"), tirx.Var("causal", "int32"))
        B.arg(name("rotary_mode"), tirx.Var("rotary_mode", "int32"))  # ignored: RoPE is the graph's
        B.arg(name("rope_scale"), tirx.Var("rope_scale", F32))
        B.arg(name("rope_theta"), tirx.Var("rope_theta", F32))
        self.sm_scale = B.arg(name("sm_scale"), tirx.Var("sm_scale", F32))

    def q_span(self, b):
        """(first query row, query tokens) of sequence b."""
        if self.mode == "decode":
            return b, _i32(1)
        return self.q_indptr[b], self.q_indptr[b + 1] - self.q_indptr[b]

    def kv_span(self, b):
        """(first key's row in k/v or 0, keys of sequence b); a sliding window's keys are its sink's and its ring's
        (TVM's _get_kv_chunk_len)."""
        if self.paged:
            pages = self.page_indptr[b + 1] - self.page_indptr[b]
            if self.sliding:
                last, start, sink = self.length_info[0, b], self.length_info[1, b], self.length_info[2, b]
                return _i32(0), tirx.if_then_else(pages > 0, (pages - 1) * self.page_size + last - start + sink, 0)
            return _i32(0), tirx.max(pages - 1, 0) * self.page_size + tirx.if_then_else(
                pages > 0, self.length_info[b], 0)
        return self.kv_indptr[b], self.kv_indptr[b + 1] - self.kv_indptr[b]

    def kv_address(self, b, kv0, key, which: int):
        """Flat element index of key `key`'s row (K: which 0, V: 1) of this block's KV head; key < the sequence's.
        A sliding window's key past its sink sits at key - sink + the window's start (TVM's _get_seq_offset)."""
        if self.paged:
            page0 = self.page_indptr[b] if self.seq is None else self.seq[0]
            if self.sliding:
                start, sink = (self.length_info[1, b], self.length_info[2, b]) if self.seq is None else \
                    (self.seq[1], self.seq[2])
                key = tirx.if_then_else(key < sink, key, key - sink + start)
            page = self.page_values[page0 + key // self.page_size].astype("int64")
            row = ((page * 2 + which) * self.h_kv + self.by) * self.page_size + key % self.page_size
            return row * self.d
        return ((kv0 + key) * self.h_kv + self.by) * (self.d if which == 0 else self.d_v)

    # ---- the kernel ----
    def build(self) -> tirx.PrimFunc:
        with IRBuilder() as ib, B.prim_func():
            B.func_name({"ragged": "batch_prefill_ragged_kv", "paged": "batch_prefill_paged_kv",
                         "decode": "batch_decode_paged_kv" + ("_sliding_window" if self.sliding else "")}[self.mode])
            self.args()
            B.func_attr({"tirx.noalias": True})
            head, order, tx = B.env_thread("blockIdx.x"), B.env_thread("blockIdx.y"), B.env_thread("threadIdx.x")
            with B.launch_thread(head, self.h_kv), \
                    B.launch_thread(order, tile_bound(self.qo_len, self.batch_size, self.group, self.tq)), \
                    B.launch_thread(tx, self.threads):
                self.by, self.tx = head, tx
                lane = tx % 32
                # the warp's 16 rows and its share of each step's keys (splits > 1: every warp the same rows)
                self.warp, self.split = (tx // 32, 0) if self.splits == 1 else (tx // 32 % self.tile_shape.warps,
                                                                                 tx // 32 // self.tile_shape.warps)
                self.lane, self.g, self.t = lane, lane // 4, lane % 4
                self.flat_views()
                self.smem = B.alloc_buffer((shared_bytes(self.tile_shape, self.d, self.d_v) // 2,), F16,
                                           scope="shared.dyn")
                self.registers()
                b_idx, before, n_tiles, hit = (B.alloc_buffer((1,), "int32", scope="local") for _ in range(4))
                _store(b_idx, 0, _i32(0))
                _store(before, 0, _i32(0))
                # which (sequence, tile) this block takes: the sequences' tiles one after another (two ifs, no
                # else: the sync planner takes only an if's condition as thread-invariant; `hit` decided first)
                with B.While(T.tvm_thread_invariant(b_idx[0] < self.batch_size)):
                    b = b_idx[0]  # read again at each use: only where b_idx does not change in between
                    _store(n_tiles, 0, tiles_of(self.q_span(b)[1], self.group, self.tq))
                    _store(hit, 0, tirx.Cast("int32", order < before[0] + n_tiles[0]))
                    with B.If(T.tvm_thread_invariant(hit[0] > 0)), B.Then():
                        self.tile(b, block_order(n_tiles[0], order - before[0]))
                        _store(b_idx, 0, self.batch_size)
                    with B.If(T.tvm_thread_invariant(hit[0] <= 0)), B.Then():
                        _store(before, 0, before[0] + n_tiles[0])
                        _store(b_idx, 0, b_idx[0] + 1)
        return ib.get().with_attr("tirx.is_scheduled", True)

    def flat_views(self) -> None:
        qo_len = self.qo_len
        self.q_flat = B.decl_buffer((qo_len * self.h_q * self.d,), self.dtype, data=self.q.data)
        self.out_flat = B.decl_buffer((qo_len * self.h_q * self.d_v,), self.dtype, data=self.output.data)
        if self.paged:
            n = self.pages.shape[0].astype("int64") * (2 * self.h_kv * self.page_size * self.d)
            self.kv_flat = [B.decl_buffer((n,), self.dtype, data=self.pages.data,
                                          elem_offset=self.pages.elem_offset)] * 2
        else:
            n = self.k.shape[0] * self.h_kv
            self.kv_flat = [B.decl_buffer((n * self.d,), self.dtype, data=self.k.data),
                            B.decl_buffer((n * self.d_v,), self.dtype, data=self.v.data)]

    def registers(self) -> None:
        d, d_v = self.d, self.d_v
        self.q_reg = B.alloc_buffer((d // 16 * 4,), "uint32", scope="local")  # Q's A fragments, the whole tile
        self.s_acc = B.alloc_buffer((self.wk // 8 * 4,), F32, scope="local")  # S, then P (float32), 16 × wk a warp
        self.o_acc = B.alloc_buffer((d_v // 8 * 4,), F32, scope="local")  # O, 16 × d_v a warp
        self.frag = B.alloc_buffer((4,), "uint32", scope="local")  # one ldmatrix.x4
        self.p_frag = B.alloc_buffer((4,), "uint32", scope="local")  # one A fragment of P
        # per row of the lane (h = 0: row g, 1: row g + 8): running max, sum, this step's max, rescale factor
        self.m_run, self.l_run, self.m_new, self.alpha, self.rsum = (
            B.alloc_buffer((2,), F32, scope="local") for _ in range(5))
        self.limit, self.visible = (B.alloc_buffer((2,), "int32", scope="local") for _ in range(2))

    def copy(self, dst, src_buf, src, valid) -> None:
        """One 16-byte cp.async, zero-filled (source size 0) where not valid."""
        size = tirx.if_then_else(valid, tirx.const(16, "uint32"), tirx.const(0, "uint32"))
        B.evaluate(T.ptx.cp.async_.cg.shared.global_(T.address_of(self.smem[dst]), T.address_of(src_buf[src]), 16,
                                                     size))

    def issue_q(self, q0, qo_n, row0) -> None:
        """The tile's TQ rows of Q into the second stage's buffer (rows past the sequence: zeros)."""
        per_row, chunks = self.d // CHUNK, self.tq * (self.d // CHUNK)
        for s in range(-(-chunks // self.threads)):
            idx = self.tx + s * self.threads
            with _guard(idx < chunks, chunks % self.threads == 0):
                r, c = idx // per_row, idx % per_row
                rr = row0 + r
                tok, head = rr // self.group, self.by * self.group + rr % self.group
                src = ((q0 + tirx.min(tok, qo_n - 1)) * self.h_q + head) * self.d + c * CHUNK
                self.copy(self.stage + r * self.ld_k + c * CHUNK, self.q_flat, src, tok < qo_n)

    def issue_kv(self, b, kv0, kv_n, k_start, buf) -> None:
        """The step's keys' K and V rows into stage `buf` (keys past the sequence: zeros)."""
        for which, width, ld, base in ((0, self.d, self.ld_k, 0), (1, self.d_v, self.ld_v, self.tk * self.ld_k)):
            per_row, chunks = width // CHUNK, self.tk * (width // CHUNK)
            for s in range(-(-chunks // self.threads)):
                idx = self.tx + s * self.threads
                with _guard(idx < chunks, chunks % self.threads == 0):
                    r, c = idx // per_row, idx % per_row
                    key = k_start + r
                    src = self.kv_address(b, kv0, tirx.max(tirx.min(key, kv_n - 1), 0), which) + c * CHUNK
                    self.copy(buf * self.stage + base + r * ld + c * CHUNK, self.kv_flat[which], src, key < kv_n)

    def tile(self, b, tile) -> None:
        tq, tk, d = self.tq, self.tk, self.d
        q0, qo_n = self.q_span(b)
        self.seq = None
        if self.paged:  # the sequence's first page and window in registers: every copy's address reads them
            seq = B.alloc_buffer((3,), "int32", scope="local")
            _store(seq, 0, self.page_indptr[b])
            if self.sliding:
                _store(seq, 1, self.length_info[1, b])
                _store(seq, 2, self.length_info[2, b])
            self.seq = seq
        kv0, kv_n = self.kv_span(b)
        row0 = tile * tq
        steps = B.alloc_buffer((1,), "int32", scope="local")  # a register: its expression reads indptrs and pages
        _store(steps, 0, kv_steps(tile, qo_n, kv_n, self.causal > 0, self.group, self.tile_shape))
        self.issue_q(q0, qo_n, row0)
        B.evaluate(T.ptx.cp.async_.commit_group())
        with B.If(T.tvm_thread_invariant(steps[0] > 0)), B.Then():
            self.issue_kv(b, kv0, kv_n, _i32(0), _i32(0))
        B.evaluate(T.ptx.cp.async_.commit_group())
        B.evaluate(T.ptx.cp.async_.wait_group(1))  # Q's copies are done (the first step's may still fly)
        _sync()
        lane = self.lane
        for kk in range(d // 16):  # Q's A fragments (mma_gemm's A addressing)
            r = self.warp * 16 + lane % 8 + 8 * ((lane // 8) % 2)
            at = self.stage + r * self.ld_k + kk * 16 + 8 * (lane // 16)
            B.evaluate(T.ptx[LDMATRIX](*(self.q_reg[kk * 4 + j] for j in range(4)), T.address_of(self.smem[at])))
        self.start_rows(b, q0, qo_n, kv_n, row0)
        for i in range(self.d_v // 8 * 4):
            _store(self.o_acc, i, _f32(0.0))
        _sync()  # every warp has its Q: the second stage is free
        for h in range(2):  # the lane's rows' limits, in registers (the expression reads indptrs)
            _store(self.limit, h, row_limit((row0 + self.warp * 16 + self.g + 8 * h) // self.group, qo_n, kv_n,
                                            self.causal > 0))
        with B.serial(0, steps[0]) as step:
            with B.If(T.tvm_thread_invariant(step + 1 < steps[0])), B.Then():
                self.issue_kv(b, kv0, kv_n, (step + 1) * tk, (step + 1) % 2)
            B.evaluate(T.ptx.cp.async_.commit_group())
            B.evaluate(T.ptx.cp.async_.wait_group(1))  # this step's copies are done
            _sync()
            self.scores(step % 2)
            self.softmax(step * tk + self.split * self.wk)
            self.pv(step % 2)
            _sync()  # every warp is done with this stage before the step after next overwrites it
        if self.splits > 1:
            self.merge_splits()
            with B.If(self.split < 1), B.Then():  # the first warp of each row's splits writes (no barrier inside)
                self.epilogue(q0, qo_n, row0)
        else:
            self.epilogue(q0, qo_n, row0)

    def start_rows(self, b, q0, qo_n, kv_n, row0) -> None:
        """The lane's rows' running max and sum before the first key: TVM's (-5e4, 1), or with attention sinks the
        row's sink logit in base 2 and 1 (the sink as a key of value 0) where this call folds it in: the ragged kernel
        always, the decode kernel where its last key is at the query's position (lower/attention_sinks.py)."""
        if self.d_att is None:
            for h in range(2):
                _store(self.m_run, h, _f32(MASKED))
                _store(self.l_run, h, _f32(1.0))
            return
        owns = B.alloc_buffer((1,), "int32", scope="local")
        if self.mode == "decode":
            key_at = self.kv_address(b, 0, tirx.max(kv_n - 1, 0), 0) + self.d_att + KEY_POSITION
            q_at = (q0 * self.h_q + self.by * self.group) * self.d + self.d_att + QUERY_POSITION
            keys = self.kv_flat[0]
            same = tirx.all(keys[key_at] == self.q_flat[q_at], keys[key_at + 1] == self.q_flat[q_at + 1])
            _store(owns, 0, tirx.if_then_else(kv_n > 0, tirx.Cast("int32", same), _i32(0)))
        else:
            _store(owns, 0, _i32(1))
        for h in range(2):
            rr = row0 + self.warp * 16 + self.g + 8 * h
            tok, head = tirx.min(rr // self.group, qo_n - 1), self.by * self.group + rr % self.group
            sink = self.q_flat[((q0 + tok) * self.h_q + head) * self.d + self.d_att + SINK].astype(F32)
            folds = owns[0] > 0 if self.splits == 1 else tirx.all(owns[0] > 0, self.split < 1)  # once a row
            _store(self.m_run, h, tirx.if_then_else(folds, sink * _f32(math.log2(math.e)), _f32(MASKED)))
            _store(self.l_run, h, _f32(1.0))

    def scores(self, buf) -> None:
        """S = Q·Kᵀ for the warp's 16 rows: per 16 dims, per 16 keys one ldmatrix.x4 of K (two 8-key B fragments)."""
        lane, wk = self.lane, self.wk
        for i in range(wk // 8 * 4):
            _store(self.s_acc, i, _f32(0.0))
        for kk in range(self.d // 16):
            for p in range(wk // 16):
                key = self.split * wk + p * 16 + lane % 8 + 8 * (lane // 16)
                at = buf * self.stage + key * self.ld_k + kk * 16 + 8 * ((lane // 8) % 2)
                B.evaluate(T.ptx[LDMATRIX](*(self.frag[j] for j in range(4)), T.address_of(self.smem[at])))
                for n in range(2):
                    acc = [self.s_acc[(2 * p + n) * 4 + j] for j in range(4)]
                    B.evaluate(T.ptx[MMA](*acc, *(self.q_reg[kk * 4 + j] for j in range(4)), self.frag[2 * n],
                                          self.frag[2 * n + 1], *acc))

    def softmax(self, k_start) -> None:
        """Online softmax on the accumulators: c0, c1 of key octet n are row g's keys 8n + 2t, +1; c2, c3 row g + 8's.
        A row's max and sum are reduced over its 4 lanes (shuffles); O is rescaled by exp2(m_old - m_new)."""
        scale = self.sm_scale * _f32(math.log2(math.e))
        octets = self.wk // 8
        for h in range(2):
            cols = [(n, c) for n in range(octets) for c in range(2)]
            _store(self.visible, h, self.limit[h] - k_start - 2 * self.t)  # the lane's columns below it are seen
            valid = {(n, c): _i32(n * 8 + c) < self.visible[h] for n, c in cols}
            _store(self.m_new, h, self.m_run[h])
            for n, c in cols:
                i = n * 4 + 2 * h + c
                _store(self.s_acc, i, tirx.if_then_else(valid[n, c], self.s_acc[i] * scale, _f32(MASKED)))
                _store(self.m_new, h, tirx.max(self.m_new[h], self.s_acc[i]))
            _store(self.m_new, h, T.cuda.warp_reduce(self.m_new[h], "max", 4))
            _store(self.rsum, h, _f32(0.0))
            for n, c in cols:
                i = n * 4 + 2 * h + c
                _store(self.s_acc, i, tirx.if_then_else(valid[n, c], tirx.exp2(self.s_acc[i] - self.m_new[h]),
                                                        _f32(0.0)))
                _store(self.rsum, h, self.rsum[h] + self.s_acc[i])
            _store(self.alpha, h, tirx.exp2(self.m_run[h] - self.m_new[h]))
            _store(self.l_run, h, self.l_run[h] * self.alpha[h] + T.cuda.warp_reduce(self.rsum[h], "sum", 4))
            _store(self.m_run, h, self.m_new[h])
            for n in range(self.d_v // 8):
                for c in range(2):
                    _store(self.o_acc, n * 4 + 2 * h + c, self.o_acc[n * 4 + 2 * h + c] * self.alpha[h])

    def pv(self, buf) -> None:
        """O += P·V: P's A fragment for keys 16kk.. is S octets 2kk and 2kk + 1 rounded to float16; V through
        ldmatrix.x4.trans (matrices: keys 0-7 / 8-15 × dims 0-7, then × dims 8-15)."""
        lane, s = self.lane, self.s_acc
        for kk in range(self.wk // 16):
            for j, (n, h) in enumerate(((2 * kk, 0), (2 * kk, 1), (2 * kk + 1, 0), (2 * kk + 1, 1))):
                _store(self.p_frag, j, _pack_half(s[n * 4 + 2 * h], s[n * 4 + 2 * h + 1]))
            for p in range(self.d_v // 16):
                m = lane // 8
                key, dim = self.split * self.wk + kk * 16 + 8 * (m % 2) + lane % 8, p * 16 + 8 * (m // 2)
                at = buf * self.stage + self.tk * self.ld_k + key * self.ld_v + dim
                B.evaluate(T.ptx[LDMATRIX_T](*(self.frag[j] for j in range(4)), T.address_of(self.smem[at])))
                for n in range(2):
                    acc = [self.o_acc[(2 * p + n) * 4 + j] for j in range(4)]
                    B.evaluate(T.ptx[MMA](*acc, *(self.p_frag[j] for j in range(4)), self.frag[2 * n],
                                          self.frag[2 * n + 1], *acc))

    def merge_splits(self) -> None:
        """The warps that shared a row's keys merge their states through shared memory into the first one's registers:
        M = max m_s, L = Σ l_s·2^(m_s − M), O = Σ O_s·2^(m_s − M), as the cache merges partial attention."""
        rows, width = self.tq, self.d_v + 2  # a row's O, then its m and l
        # the stages' dynamic shared memory, free after the last step's barrier, as float32 (a static buffer of its
        # own would take 41 KiB more: past sm_86/sm_120's 99 KiB a block)
        assert 4 * self.splits * rows * width <= shared_bytes(self.tile_shape, self.d, self.d_v)
        merge = B.decl_buffer((self.splits * rows * width,), F32, data=self.smem.data, scope="shared.dyn")
        cols = [(n, c) for n in range(self.d_v // 8) for c in range(2)]
        for h in range(2):
            at = (self.split * rows + self.warp * 16 + self.g + 8 * h) * width
            for n, c in cols:
                _store(merge, at + n * 8 + 2 * self.t + c, self.o_acc[n * 4 + 2 * h + c])
            with B.If(self.t < 1), B.Then():
                _store(merge, at + self.d_v, self.m_run[h])
                _store(merge, at + self.d_v + 1, self.l_run[h])
        _sync()
        for h in range(2):
            row = self.warp * 16 + self.g + 8 * h
            at = [(s * rows + row) * width for s in range(self.splits)]
            _store(self.m_new, h, merge[at[0] + self.d_v])
            for a in at[1:]:
                _store(self.m_new, h, tirx.max(self.m_new[h], merge[a + self.d_v]))
            weight = [tirx.exp2(merge[a + self.d_v] - self.m_new[h]) for a in at]
            _store(self.l_run, h, _f32(0.0))
            for a, w in zip(at, weight, strict=True):
                _store(self.l_run, h, self.l_run[h] + merge[a + self.d_v + 1] * w)
            for n, c in cols:
                i, col = n * 4 + 2 * h + c, n * 8 + 2 * self.t + c
                _store(self.o_acc, i, _f32(0.0))
                for a, w in zip(at, weight, strict=True):
                    _store(self.o_acc, i, self.o_acc[i] + merge[a + col] * w)
            _store(self.m_run, h, self.m_new[h])

    def epilogue(self, q0, qo_n, row0) -> None:
        for h in range(2):
            rr = row0 + self.warp * 16 + self.g + 8 * h
            tok, head = rr // self.group, self.by * self.group + rr % self.group
            with B.If(tok < qo_n), B.Then():
                base = ((q0 + tok) * self.h_q + head) * self.d_v + 2 * self.t
                for n in range(self.d_v // 8):
                    for c in range(2):
                        _store(self.out_flat, base + n * 8 + c,
                               (self.o_acc[n * 4 + 2 * h + c] / self.l_run[h]).astype(self.dtype))
                with B.If(self.t < 1), B.Then():
                    _store(self.lse, [q0 + tok, head], self.m_run[h] + tirx.log2(self.l_run[h]))
