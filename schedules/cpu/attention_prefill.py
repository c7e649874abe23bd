"""Prefill attention on the CPU: drop-ins for TVM's CPU prefill kernels (relax/frontend/nn/llm/_prefill_kernels.py):
the ragged one (`_attention_prefill_ragged_cpu`, batch_prefill_ragged_kv: a prefill's queries against its own new
keys, causal; all of a prompt from an empty cache) and the paged one (`_attention_prefill_cpu`,
batch_prefill_paged_kv_cpu and its sliding-window variant: the same queries against the keys already in the cache's
pages, causal 0; the cache merges the two by their log-sum-exps).

TVM's CPU kernels walk every (sequence, query, key, head) in serial loops on one thread, scalar, with libm's exp2
per score: perf put 29% of SmolLM2-135M's pp512 samples in it on the main thread alone while the pool's second
thread sat in sched_yield (~1.5 of 2.5 s, benchmarks/README.md, issue 13). This one is flash attention on the
CPU, float32 throughout:
- a parallel task takes TQ query tokens of one sequence and one KV head; its rows are (token, query head of the KV
  head's group), so the group's heads share every key and value load (GQA);
- Q·Kᵀ runs with the lanes along keys: a block of KB keys is gathered (from the ragged K or the pages) and
  transposed once into a local (D, KB) buffer, its values into a (KB, D) one; then RB rows at a time take D
  broadcast FMAs each (RB accumulators in registers, one K load per RB FMAs);
- the online softmax works in base 2 (Q is scaled by sm_scale·log2 e when it is staged), with a vectorized
  polynomial exp2 (libm's is scalar: one call per score was TVM's kernel's second cost);
- P·V runs with the lanes along the head dimension: per 16 columns, RB rows of O accumulate KB value rows;
- under the causal mask a tile stops at its last row's last visible key;
- tasks are numbered tile-major in zigzag order (0, n-1, 1, n-2, ...): TVM splits a parallel loop into one
  contiguous range per thread, and the late (causal: heavy) tiles would otherwise all fall to the last thread.
Same signatures and outputs as TVM's kernels: O and the base-2 log-sum-exp (in units of sm_scale·log2 e scores) that
the cache merges partial states with when a prefix is already cached. `rotary_mode` must be 0: luce-compile
applies RoPE in the graph (RopeMode.NONE), so the cache never asks for inline rotation (asserted in the kernel).

Attention sinks (gpt-oss; lower/attention_sinks.py says how the rows carry them): the cache's rows are the head's
`d_att` columns and a few more; only those d_att are loaded and multiplied, the others written 0 in O. With `sink`,
a row's online softmax takes one more term at its end, the query row's sink logit (column d_att + SINK) as a key of
value 0,
in the call that holds the query's own key: the ragged kernel always (its keys are the step's new tokens, causal),
the decode kernel where the last key's position (the key's padding columns KEY_POSITION, + 1: position mod 1024 and
// 1024) is the query's (its QUERY_POSITION, + 1). So the sink is counted once per query however
TVM's cache splits its keys between calls (ragged, then paged per fork depth; or, decoding, paged only) and merges
them by log-sum-exp.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info, _get_kv_chunk_len
from tvm.script import tirx as T

from luce_compile.lower.attention_sinks import KEY_POSITION, QUERY_POSITION, SINK

LANES = 16  # float32 lanes of one AVX-512 register; LLVM splits them on narrower machines
KB = LANES  # keys per block: one score vector per row
RB = 4  # rows whose scores (and O columns) are computed together: RB accumulators, one K or V load per RB FMAs
TQ = 16  # query tokens per task: at SmolLM2's 3 KV heads, 96 tasks for a 512-token prompt on 2 threads
MASKED = -1.0e30  # a masked score: its weight is exp2(MASKED - max) = 2^-125 (_exp2's clamp), nothing beside 1
# the running max before any key: above MASKED, so that a row whose first block is all masked (only when a sequence
# has fewer keys than queries) sums 2^-125s, not 2^0s; below any real score
EMPTY = -1.0e29
LOG2E = math.log2(math.e)
# 2^f = e^(f ln 2) for f in [-0.5, 0.5] by its Taylor series to degree 7: truncation error (ln2/2)^8/8! = 5e-9,
# below float32's rounding; coefficients (ln 2)^i / i!, highest first for Horner
EXP2_COEFFS = tuple(math.log(2) ** i / math.factorial(i) for i in range(7, -1, -1))


# the cache dtypes taken: float32 (the CPU build's default) and float16 (--kv-cache f16: half the bytes a token);
# float16 values are widened to float32 as they are loaded, and every sum is float32 either way
DTYPES = ("float32", "float16")


def supports(d_qk: int, d_v: int, dtype: str) -> bool:
    """A cache dtype of DTYPES, one head size for keys and values, whole 16-lane column vectors."""
    return dtype in DTYPES and d_qk == d_v and d_qk % LANES == 0


def f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """x widened to float32 where it is a float16 load (the cache's keys, values and queries under --kv-cache f16;
    a float32 load's cast is an identity the lowering drops)."""
    return T.Cast("float32", x)


def _exp2(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """2^x for x <= 0, vectorizable: x = n + f with n = round(x), 2^f by polynomial, 2^n added to its exponent bits.
    x is clamped at -125 so that the exponent stays normal (2^-125 in place of 0: nothing next to a visible key's
    weight >= 2^0 = 1 at the running max)."""
    x = T.max(x, T.float32(-125.0))
    n = T.round(x)
    f = x - n
    p = T.float32(EXP2_COEFFS[0])
    for c in EXP2_COEFFS[1:]:
        p = p * f + T.float32(c)
    bits = T.reinterpret("int32", p) + T.shift_left(T.Cast("int32", n), 23)
    return T.reinterpret("float32", bits)


def _tile_macro(group: int, d: int, tile_q: int, gather: object, window: int, rb: int = RB, d_att: int | None = None,
                sink: bool = False, owns_key: object = None) -> object:
    """One task's work: TQ query tokens x the `group` query heads of KV head hk (module docstring). `gather` is the
    kernel's own macro that fills a key block, transposed (kt), and its value rows (vb) from where the keys live;
    src1..src5 are its arguments. `window` > 0: TVM's sliding-window mask under causal (the paged kernel's). `rb`
    rows share each K and V load (RB; decode, with one token a task, takes a divisor of the group). `d_att`: the
    columns attended (d: all); `sink`: fold each query row's sink logit (column d_att + SINK) in; `owns_key`: a macro
    that clears flag[0] where this call does not hold the query's own key (decode; None: it always does, ragged)."""
    RB = rb  # noqa: N806  (the module constant's name, as the docstring uses it)
    rows = tile_q * group  # score rows of a task: (token, head of the group), token-major
    assert rows % RB == 0, "TQ·group must be a multiple of RB"
    d_att = d if d_att is None else d_att
    assert d_att % LANES == 0 and d_att + (QUERY_POSITION + 2) * sink <= d, \
        "the attended columns are whole vectors, the sink after them"
    chunks = d_att // LANES

    @T.macro
    def tile(q, output, lse, causal, sm_scale, q0, n_q, n_kv, r0, hk, src1, src2, src3, src4, src5):  # noqa: ANN001
        qs = T.decl_buffer((rows, d_att), "float32", scope="local")  # Q · sm_scale · log2 e
        kt = T.decl_buffer((d_att, KB), "float32", scope="local")  # the key block, transposed
        vb = T.decl_buffer((KB, d_att), "float32", scope="local")  # its value rows
        s = T.decl_buffer((RB, KB), "float32", scope="local")  # scores, then probabilities
        acc = T.decl_buffer((RB, LANES), "float32", scope="local")
        o = T.decl_buffer((rows, d_att), "float32", scope="local")
        m = T.decl_buffer((rows,), "float32", scope="local")  # running max (base 2)
        den = T.decl_buffer((rows,), "float32", scope="local")  # running sum of 2^(score - m)
        red = T.decl_buffer((RB, 2), "float32", scope="local")  # a row's block max, then its new max and scale
        n_rows = T.min(tile_q, n_q - r0)
        diag = n_kv - n_q  # causal: query row i sees keys 0 .. i + diag
        sliding = causal > 0 and T.int32(window) > 0  # TVM's sliding mask: keys [n_kv - (window - i - 1), n_kv)
        kv_end = T.if_then_else(causal > 0 and not sliding, T.min(n_kv, r0 + n_rows + diag), n_kv)
        scale = sm_scale * T.float32(LOG2E)
        for r in T.serial(rows):
            m[r] = T.float32(EMPTY)
            den[r] = T.float32(0)
            for c in T.vectorized(d_att):
                o[r, c] = T.float32(0)
                qs[r, c] = T.if_then_else(
                    r // group < n_rows, f32(q[q0 + r0 + r // group, hk * group + r % group, c]) * scale, T.float32(0))
        for kb in T.serial((kv_end + KB - 1) // KB):
            n_keys = T.min(KB, n_kv - kb * KB)
            gather(kt, vb, kb, n_keys, hk, src1, src2, src3, src4, src5)
            for rb in T.serial(rows // RB):
                # scores of RB rows: one K vector per RB broadcast FMAs
                for i in T.unroll(RB):
                    for j in T.vectorized(KB):
                        s[i, j] = T.float32(0)
                for c in T.serial(d_att):
                    for i in T.unroll(RB):
                        for j in T.vectorized(KB):
                            s[i, j] = s[i, j] + qs[rb * RB + i, c] * kt[c, j]
                for i in T.unroll(RB):
                    row = r0 + (rb * RB + i) // group
                    # the row's visible keys [low, high): causal, sliding (paged kernel only) or all of them
                    high = T.if_then_else(causal > 0 and not sliding, T.min(n_kv, row + diag + 1), n_kv)
                    low = T.if_then_else(sliding, T.max(n_kv - T.max(T.int32(window) - row - 1, 0), 0), 0)
                    for j in T.vectorized(KB):
                        s[i, j] = T.if_then_else(kb * KB + j < high and kb * KB + j >= low, s[i, j], T.float32(MASKED))
                    red[i, 0] = m[rb * RB + i]
                    for j in T.serial(KB):
                        red[i, 0] = T.max(red[i, 0], s[i, j])
                    red[i, 1] = T.exp2(m[rb * RB + i] - red[i, 0])  # rescales what was summed under the old max
                    m[rb * RB + i] = red[i, 0]
                    for j in T.vectorized(KB):
                        s[i, j] = _exp2(s[i, j] - red[i, 0])
                    den[rb * RB + i] = den[rb * RB + i] * red[i, 1]
                    for j in T.serial(KB):
                        den[rb * RB + i] = den[rb * RB + i] + s[i, j]
                # P·V: per 16 columns, RB rows of O accumulate the block's value rows (only the keys that exist)
                for cc in T.serial(chunks):
                    for i in T.unroll(RB):
                        for c in T.vectorized(LANES):
                            acc[i, c] = o[rb * RB + i, cc * LANES + c] * red[i, 1]
                    for j in T.serial(n_keys):
                        for i in T.unroll(RB):
                            for c in T.vectorized(LANES):
                                acc[i, c] = acc[i, c] + s[i, j] * vb[j, cc * LANES + c]
                    for i in T.unroll(RB):
                        for c in T.vectorized(LANES):
                            o[rb * RB + i, cc * LANES + c] = acc[i, c]
        if sink:  # one more key per row, score the sink logit (base 2), value 0 (module docstring)
            flag = T.decl_buffer((1,), "int32", scope="local")
            flag[0] = 1
            if owns_key is not None:
                owns_key(flag, q, q0 + r0, n_kv, hk, src1, src2, src3, src4, src5)
            if flag[0] > 0:
                for r in T.serial(n_rows * group):
                    red[0, 0] = f32(q[q0 + r0 + r // group, hk * group + r % group, d_att + SINK]) * T.float32(LOG2E)
                    red[0, 1] = T.max(m[r], red[0, 0])
                    scale_old = _exp2(m[r] - red[0, 1])
                    den[r] = den[r] * scale_old + _exp2(red[0, 0] - red[0, 1])
                    m[r] = red[0, 1]
                    for c in T.vectorized(d_att):
                        o[r, c] = o[r, c] * scale_old
        for r in T.serial(n_rows * group):
            # a row with no key at all (an empty sequence's keys) writes 0 and a log-sum-exp that merges as weight 0
            for c in T.vectorized(d_att):
                output[q0 + r0 + r // group, hk * group + r % group, c] = T.Cast(output.dtype, T.if_then_else(
                    den[r] > T.float32(0), o[r, c] / den[r], T.float32(0)))
            for c in T.serial(d - d_att):  # the cache's padding columns (attention sinks)
                output[q0 + r0 + r // group, hk * group + r % group, d_att + c] = T.Cast(output.dtype, 0)
            lse[q0 + r0 + r // group, hk * group + r % group] = T.if_then_else(
                den[r] > T.float32(0), m[r] + T.log2(den[r]), T.float32(EMPTY))

    return tile


@T.macro
def _find_tile(q_indptr, batch_size, slots, zz, tile_q, found):  # noqa: ANN001
    """found = (sequence, its first query row in the tile) of tile slot zz's tile, sequence -1 past the last one.
    Slots go in zigzag order (module docstring)."""
    tile = T.if_then_else(zz % 2 == 0, zz // 2, slots - 1 - zz // 2)
    found[0] = -1
    found[1] = 0
    found[2] = 0  # tiles of the sequences before
    for b in T.serial(batch_size):
        n_tiles = (q_indptr[b + 1] - q_indptr[b] + tile_q - 1) // tile_q
        if found[0] < 0 and tile < found[2] + n_tiles:
            found[0] = b
            found[1] = (tile - found[2]) * tile_q
        found[2] = found[2] + n_tiles


def ragged_prefill_cpu(h_kv: int, h_q: int, d: int, tile_q: int = TQ, dtype: str = "float32",
                       d_att: int | None = None, sink: bool = False) -> tirx.PrimFunc:
    """TVM's batch_prefill_ragged_kv (a dtype of DTYPES, d_qk = d_v = d), multi-threaded and vectorized (module
    docstring); d_att and sink as _tile_macro's (attention sinks)."""
    cols = d if d_att is None else d_att

    @T.macro
    def gather(kt, vb, kb, n_keys, hk, k, v, kv0, _unused1, _unused2):  # noqa: ANN001
        for j in T.serial(KB):
            for c in T.serial(cols):
                kt[c, j] = T.if_then_else(j < n_keys, f32(k[kv0 + kb * KB + j, hk, c]), T.float32(0))
        for j in T.serial(n_keys):
            for c in T.vectorized(cols):
                vb[j, c] = f32(v[kv0 + kb * KB + j, hk, c])

    tile = _tile_macro(h_q // h_kv, d, tile_q, gather, 0, d_att=d_att, sink=sink)

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle,  # (qo_len, h_q, d)
        var_q_indptr: T.handle,  # (batch_size + 1,)
        var_k: T.handle,  # (kv_len, h_kv, d)
        var_v: T.handle,  # (kv_len, h_kv, d)
        var_kv_indptr: T.handle,  # (batch_size + 1,)
        var_q_rope_position: T.handle,  # (qo_len,): unused (rotary_mode 0)
        var_k_rope_pos_offset: T.handle,  # (batch_size,): unused
        var_output: T.handle,  # (qo_len, h_q, d)
        var_lse: T.handle,  # (qo_len, h_q)
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        assert rotary_mode == 0, "luce-compile's CPU prefill attention takes keys with RoPE applied (RopeMode.NONE)"
        # every sequence's tiles fit in ceil(qo_len / TQ) + batch_size slots; the slots past the last tile are empty
        slots = (qo_len + tile_q - 1) // tile_q + batch_size
        for task in T.parallel(slots * h_kv):
            found = T.decl_buffer((3,), "int32", scope="local")
            _find_tile(q_indptr, batch_size, slots, task // h_kv, tile_q, found)
            if found[0] >= 0:
                b = found[0]
                q0 = q_indptr[b]
                kv0 = kv_indptr[b]
                tile(q, output, lse, causal, sm_scale, q0, q_indptr[b + 1] - q0, kv_indptr[b + 1] - kv0, found[1],
                     task % h_kv, k, v, kv0, 0, 0)
    # fmt: on

    return batch_prefill_ragged_kv


def owns_key_check(d_att: int, page_size: int) -> object:
    """The decode kernel's `owns_key` (module docstring): flag[0] = 0 unless the last key of this call sits at the
    position the query's row carries, i.e. the cache appended the query's own key before attending and this call
    reads the pages it went to."""

    @T.macro
    def owns_key(flag, q, row, n_kv, hk, pages, page_values, page0, sink, offset):  # noqa: ANN001
        flag[0] = 0
        if n_kv > 0:
            pos = T.if_then_else(n_kv - 1 < sink, n_kv - 1, n_kv - 1 - sink + offset)  # as page_gather maps it
            page = page_values[page0 + pos // page_size]
            key_at, query_at = d_att + KEY_POSITION, d_att + QUERY_POSITION
            if f32(pages[page, 0, hk, pos % page_size, key_at]) == f32(q[row, 0, query_at]) and \
                    f32(pages[page, 0, hk, pos % page_size, key_at + 1]) == f32(q[row, 0, query_at + 1]):
                flag[0] = 1

    return owns_key


def page_gather(d: int, page_size: int) -> object:
    """The tile's gather from the cache's pages: key block kb of KV head hk, transposed into kt, values into vb (the
    first d columns of each row)."""

    @T.macro
    def gather(kt, vb, kb, n_keys, hk, pages, page_values, page0, sink, offset):  # noqa: ANN001
        # key j of the sequence sits at j, or past the sink at j - sink + offset (the window's start in its pages)
        for j in T.serial(KB):
            pos = T.if_then_else(kb * KB + j < sink, kb * KB + j, kb * KB + j - sink + offset)
            page = page_values[page0 + T.if_then_else(j < n_keys, pos, 0) // page_size]
            for c in T.serial(d):
                kt[c, j] = T.if_then_else(j < n_keys, f32(pages[page, 0, hk, pos % page_size, c]), T.float32(0))
            if j < n_keys:
                for c in T.vectorized(d):
                    vb[j, c] = f32(pages[page, 1, hk, pos % page_size, c])

    return gather


def paged_prefill_cpu(h_kv: int, h_q: int, d: int, sliding_window: bool, page_size: int = 16,
                      sliding_window_size: int = 1024, tile_q: int = TQ, dtype: str = "float32",
                      d_att: int | None = None) -> tirx.PrimFunc:
    """TVM's batch_prefill_paged_kv_cpu(_sliding_window) (a dtype of DTYPES): the queries of a prefill against the keys
    already in the cache's pages (the cache calls it with causal 0 for a prompt after a cached prefix, then merges with
    the ragged kernel's result by the log-sum-exps). Same task split as the ragged kernel; a key block is gathered
    from its pages. The sliding variant reads TVM's length_info (last page length, window offset, sink length) and
    applies TVM's sliding mask under causal, as its kernel does. `d_att`: the columns attended (attention sinks)."""
    global_symbol = "batch_prefill_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    tile = _tile_macro(h_q // h_kv, d, tile_q, page_gather(d if d_att is None else d_att, page_size),
                       sliding_window_size if sliding_window else 0, d_att=d_att)

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle,  # (total_len, h_q, d)
        var_q_indptr: T.handle,  # (batch_size + 1,)
        var_pages: T.handle,  # (max_num_pages, 2, h_kv, page_size, d)
        var_page_indptr: T.handle,  # (batch_size + 1,)
        var_page_values: T.handle,  # (nnz_pages,)
        var_length_info: T.handle,  # (batch_size,): last page length; sliding: (3, batch_size) (TVM's comment)
        var_k_rope_pos_offset: T.handle,  # (batch_size,): unused (rotary_mode 0)
        var_q_rope_position: T.handle,  # (total_len,): unused
        var_output: T.handle,  # (total_len, h_q, d)
        var_lse: T.handle,  # (total_len, h_q)
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": global_symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, sliding_window, length_info_elem_offset)

        assert rotary_mode == 0, "luce-compile's CPU prefill attention takes keys with RoPE applied (RopeMode.NONE)"
        slots = (total_len + tile_q - 1) // tile_q + batch_size
        for task in T.parallel(slots * h_kv):
            found = T.decl_buffer((3,), "int32", scope="local")
            _find_tile(q_indptr, batch_size, slots, task // h_kv, tile_q, found)
            if found[0] >= 0:
                b = found[0]
                q0 = q_indptr[b]
                page0 = page_indptr[b]
                n_pages = page_indptr[b + 1] - page0
                n_kv = T.if_then_else(
                    n_pages > 0, _get_kv_chunk_len(n_pages, page_size, b, length_info, sliding_window), 0)
                sink = length_info[2, b] if sliding_window else n_kv
                offset = length_info[1, b] if sliding_window else 0
                tile(q, output, lse, causal, sm_scale, q0, q_indptr[b + 1] - q0, n_kv, found[1], task % h_kv,
                     pages, page_values, page0, sink, offset)
    # fmt: on

    return batch_prefill_paged_kv_cpu
