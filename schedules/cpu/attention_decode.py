"""Decode attention on the CPU: a drop-in for TVM's CPU decode kernel (relax/frontend/nn/llm/_kernel_common's
`_attention_decode_cpu`, batch_decode_paged_kv_cpu and its sliding-window variant): one new query token per
sequence against every key in the sequence's pages, the new token's key and value already appended.

TVM's kernel walks (sequence, query head, key, dimension) in serial loops on one thread, scalar, reading each key
once per query head: profiled on this machine (benchmarks/profile_step.py), SmolLM2-135M's decode step at a
128-token context spent 18% of its time in it, and its cost grows with the context. This one is the paged prefill
kernel's flash-attention tile (schedules/cpu/attention_prefill.py) with one query token a task: a parallel task per
(sequence, KV head), the KV head's group of query heads as the tile's rows sharing every key and value load, keys
16 at a time in vector lanes, the online softmax in base 2 with the vectorized exp2. A decode query sees every key
(no mask: the cache holds exactly the visible ones; a sliding window's sink and ring are read as TVM's kernel reads
them), so it is the paged prefill's causal-0 case, and its outputs are TVM's: O and the base-2 log-sum-exp.
"""

from __future__ import annotations

from luce_schedules.cpu.attention_prefill import RB, _tile_macro, owns_key_check, page_gather, supports
from tvm import tirx
from tvm.relax.frontend.nn.llm._kernel_common import _declare_length_info, _get_kv_chunk_len
from tvm.script import tirx as T

__all__ = ["paged_decode_cpu", "supports"]


def rows_per_block(group: int) -> int:
    """Rows sharing each K and V load: the largest of RB, 3, 2, 1 that divides the group (a task has one token, so
    its rows are the group's heads; a divisor wastes no row)."""
    return next(r for r in (RB, 3, 2, 1) if group % r == 0)


def paged_decode_cpu(h_kv: int, h_q: int, d: int, sliding_window: bool, page_size: int = 16,
                     dtype: str = "float32", d_att: int | None = None, sink: bool = False) -> tirx.PrimFunc:
    """TVM's batch_decode_paged_kv_cpu(_sliding_window) (a dtype of attention_prefill.DTYPES; same signature and
    outputs); `d_att`, `sink`: attention sinks, folded in where the pages hold the query's own key
    (attention_prefill's module docstring)."""
    global_symbol = "batch_decode_paged_kv_cpu" + ("_sliding_window" if sliding_window else "")
    group = h_q // h_kv
    cols = d if d_att is None else d_att
    tile = _tile_macro(group, d, 1, page_gather(cols, page_size), 0, rows_per_block(group), d_att=d_att, sink=sink,
                       owns_key=owns_key_check(cols, page_size) if sink else None)

    # fmt: off  (the parameters are named as TVM's)
    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_cpu(  # noqa: N803, N806
        Q_handle: T.handle,  # (batch_size, h_q, d)
        pages_handle: T.handle,  # (max_num_pages, 2, h_kv, page_size, d)
        page_table_indptr_handle: T.handle,  # (batch_size + 1,)
        page_table_values_handle: T.handle,  # (nnz_pages,)
        var_length_info: T.handle,  # (batch_size,): last page length; sliding: (3, batch_size) (TVM's comment)
        k_rope_pos_offset_handle: T.handle,  # (batch_size,): unused (rotary_mode 0)
        q_rope_position_handle: T.handle,  # (batch_size,): unused
        output_handle: T.handle,  # (batch_size, h_q, d)
        lse_handle: T.handle,  # (batch_size, h_q)
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": global_symbol, "tirx.noalias": True, "tirx.is_scheduled": True})
        batch_size = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (batch_size, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (batch_size + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (batch_size,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (batch_size, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch_size, h_q), "float32")
        length_info = _declare_length_info(var_length_info, batch_size, sliding_window, length_info_elem_offset)

        assert rotary_mode == 0, "luce-compile's CPU decode attention takes keys with RoPE applied (RopeMode.NONE)"
        for task in T.parallel(batch_size * h_kv):
            b = task // h_kv
            page0 = page_table_indptr[b]
            n_pages = page_table_indptr[b + 1] - page0
            n_kv = T.if_then_else(n_pages > 0, _get_kv_chunk_len(n_pages, page_size, b, length_info, sliding_window), 0)
            sink = length_info[2, b] if sliding_window else n_kv
            offset = length_info[1, b] if sliding_window else 0
            tile(Q, output, lse, 0, sm_scale, b, 1, n_kv, 0, task % h_kv, pages, page_table_values, page0, sink,
                 offset)
    # fmt: on

    return batch_decode_paged_kv_cpu
