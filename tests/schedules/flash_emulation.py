"""schedules/gpu/flash_prefill.py's tile schedule run in numpy: the same block → (sequence, tile) scan, the same
tiles_of / block_order / kv_steps / row_limit functions the kernel is built from, the same start state (-5e4, sum 1),
the same online softmax in float32 (scores scaled by sm_scale·log2 e, exp2), Q, K, V in float16 and P rounded to
float16 before P·V. What it cannot reproduce: the order of the float32 additions inside an mma.sync and across a
row's 4 lanes (≲ 1e-6 relative; the float16 rounding of P is 2⁻¹¹).

Inputs are the kernel's: ragged (q_lens, kv_lens), q (Σq, h_q, d), k / v (Σkv, h_kv, d) float16."""

from __future__ import annotations

import math

import numpy as np
from luce_schedules.gpu.flash_prefill import MASKED, FlashTile, block_order, kv_steps, row_limit, tile_bound, tiles_of

F32 = np.float32


def locate(order: int, n_tiles: list[int]) -> tuple[int, int] | None:
    """The kernel's scan: block `order` takes (sequence, tile), or nothing past the batch's tiles."""
    before = 0
    for b, n in enumerate(n_tiles):
        if order < before + n:
            return b, block_order(n, order - before)
        before += n
    return None


def emulate(q, k, v, q_lens, kv_lens, causal: bool, sm_scale: float, h_kv: int, tile: FlashTile, sink_at=None):
    """(output float16 (Σq, h_q, d_v), lse float32 (Σq, h_q), tiles visited by every block in launch order).
    `sink_at`: the query rows' column holding their sink logit (attention sinks, the kernel's d_att + SINK): each row
    starts from it (base 2) with sum 1 instead of (-5e4, 1), as the ragged kernel with d_att does."""
    h_q = q.shape[1]
    d_v, group, rows, keys = v.shape[2], h_q // h_kv, tile.rows, tile.keys
    out = np.full((q.shape[0], h_q, d_v), np.nan, np.float16)
    lse = np.full(q.shape[:2], np.nan, F32)
    q_ptr, kv_ptr = np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(kv_lens)])
    n_tiles = [tiles_of(int(n), group, rows) for n in q_lens]
    scale = F32(F32(sm_scale) * F32(math.log2(math.e)))
    visited = []
    for order in range(tile_bound(int(q.shape[0]), len(q_lens), group, rows)):
        where = locate(order, n_tiles)
        if where is None:
            continue
        visited.append(where)
        b, t = where
        q0, qo_n, kv0, kv_n = int(q_ptr[b]), int(q_lens[b]), int(kv_ptr[b]), int(kv_lens[b])
        rr = t * rows + np.arange(rows)
        tok, head_in_group = rr // group, rr % group
        limit = np.array([row_limit(int(x), qo_n, kv_n, causal) for x in tok])
        steps = kv_steps(t, qo_n, kv_n, causal, group, tile)
        for by in range(h_kv):
            heads = by * group + head_in_group
            qt = np.where((tok < qo_n)[:, None], q[q0 + np.minimum(tok, qo_n - 1), heads], 0).astype(F32)  # (rows, d)
            states = []  # each warp's split of a step's keys (tile.splits; 1: the step's keys), merged below
            for split in range(tile.splits):
                m, total, o = np.full(rows, F32(MASKED)), np.ones(rows, F32), np.zeros((rows, d_v), F32)
                if sink_at is not None and split == 0:
                    m = q[q0 + np.minimum(tok, qo_n - 1), heads, sink_at].astype(F32) * F32(math.log2(math.e))
                for step in range(steps):
                    key = step * keys + split * tile.warp_keys + np.arange(tile.warp_keys)
                    inside = (key < kv_n)[:, None]
                    kt = np.where(inside, k[kv0 + np.minimum(key, kv_n - 1), by], 0).astype(F32)  # (keys, d)
                    vt = np.where(inside, v[kv0 + np.minimum(key, kv_n - 1), by], 0).astype(F32)
                    valid = key[None, :] < limit[:, None]  # (rows, keys)
                    s = np.where(valid, (qt @ kt.T) * scale, F32(MASKED))
                    m_new = np.maximum(m, s.max(axis=1))
                    p = np.where(valid, np.exp2(s - m_new[:, None]), F32(0))
                    alpha = np.exp2(m - m_new)
                    total = total * alpha + p.sum(axis=1, dtype=F32)
                    m = m_new
                    o = o * alpha[:, None] + p.astype(np.float16).astype(F32) @ vt
                states.append((m, total, o))
            m = np.max([st[0] for st in states], axis=0)  # the kernel's merge_splits
            weights = [np.exp2(st[0] - m) for st in states]
            total = sum(st[1] * w for st, w in zip(states, weights, strict=True))
            o = sum(st[2] * w[:, None] for st, w in zip(states, weights, strict=True))
            seen = tok < qo_n
            out[q0 + tok[seen], heads[seen]] = (o / total[:, None])[seen].astype(np.float16)
            lse[q0 + tok[seen], heads[seen]] = (m + np.log2(total))[seen]
    return out, lse, visited


def reference(q, k, v, q_lens, kv_lens, causal: bool, sm_scale: float, sinks=None):
    """float64 attention of the float16 inputs: per sequence, the query tokens the last of its keys. `sinks`
    ((Σq, h_q), natural log): one more key per row of that score and value 0 (attention sinks)."""
    h_q, h_kv = q.shape[1], k.shape[1]
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    out, lse = np.zeros(q.shape[:2] + (v.shape[2],)), np.zeros(q.shape[:2])
    qs = ks = 0
    for qn, kn in zip(q_lens, kv_lens, strict=True):
        for h in range(h_q):
            s = q[qs:qs + qn, h] @ k[ks:ks + kn, h // (h_q // h_kv)].T * sm_scale
            if causal:
                s = np.where(np.arange(kn)[None, :] <= np.arange(qn)[:, None] + kn - qn, s, -np.inf)
            sink = np.full(qn, -np.inf) if sinks is None else sinks[qs:qs + qn, h].astype(np.float64)
            mx = np.maximum(s.max(axis=1), sink)[:, None]
            p = np.exp(s - mx)
            total = p.sum(axis=1) + np.exp(sink - mx[:, 0])
            out[qs:qs + qn, h] = p @ v[ks:ks + kn, h // (h_q // h_kv)] / total[:, None]
            lse[qs:qs + qn, h] = (mx[:, 0] + np.log(total)) / np.log(2)
        qs, ks = qs + qn, ks + kn
    return out, lse
