"""The CPU attention kernels with attention sinks (gpt-oss; lower/attention_sinks.py): rows D + 16 wide, the head's
D columns attended, the query's sink logit and position and the keys' positions in the padding. Against the
prefill tests' float64 reference with one more softmax term (the sink: a logit of value 0), fresh random inputs each
run, the prefill tests' tolerance (2e-5). The padding is filled with noise where the kernels must not read it.

- ragged: every query row takes its sink (the step's own keys are always in its call);
- decode: the sink where the call's last key is at the query's position (the cache appended the query's key before
  attending), not where it is not (an earlier fork depth, or the prefix before a ragged call);
- merged as TVM's cache merges calls by log-sum-exp, a prefix call without the sink and a ragged call with it give
  attention over every key with the sink counted once.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.attention_decode import paged_decode_cpu
from luce_schedules.cpu.attention_prefill import paged_prefill_cpu, ragged_prefill_cpu

from luce_compile.lower.attention_sinks import KEY_POSITION, POSITION_RADIX, QUERY_POSITION, SINK, SINK_COLUMNS
from tests.schedules.test_cpu_attention_prefill import TOL, _build, _pages, _run, reference

pytestmark = pytest.mark.unit


def _with_sinks(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Attention (out, base-2 lse) over some keys, with one more key of score `sinks[h]` (unscaled) and value 0."""
    sink2 = sinks[None] / np.log(2)  # (1, H) base 2
    total = np.logaddexp2(lse, sink2)
    return out * np.exp2(lse - total)[..., None], total


def _split(pos: np.ndarray) -> np.ndarray:
    return np.stack([pos % POSITION_RADIX, pos // POSITION_RADIX], -1).astype(np.float32)


@pytest.mark.parametrize("h_kv,h_q,d,q_lens", [(2, 8, 32, [5, 13]), (8, 64, 64, [3]), (1, 4, 64, [20, 1])])
def test_ragged_folds_every_rows_sink(h_kv, h_q, d, q_lens):
    rng = np.random.default_rng()
    q_ptr = np.concatenate([[0], np.cumsum(q_lens)])
    width = d + SINK_COLUMNS
    q = rng.standard_normal((q_ptr[-1], h_q, width)).astype(np.float32)  # noise in the padding, then the sink
    k = rng.standard_normal((q_ptr[-1], h_kv, width)).astype(np.float32)
    v = rng.standard_normal((q_ptr[-1], h_kv, width)).astype(np.float32)
    sinks = (rng.standard_normal(h_q) * 2).astype(np.float32)
    q[:, :, d + SINK] = sinks
    scale = float(1 / np.sqrt(d))
    out, lse = _run(_build(ragged_prefill_cpu(h_kv, h_q, width, d_att=d, sink=True)), q, k, v, q_ptr, q_ptr, scale,
                    True)
    per_seq = [slice(q_ptr[b], q_ptr[b + 1]) for b in range(len(q_lens))]
    plain_out, plain_lse = reference(q[..., :d], q_ptr, [k[x, :, :d] for x in per_seq], [v[x, :, :d] for x in per_seq],
                                     scale, True)
    want_out, want_lse = _with_sinks(plain_out, plain_lse, sinks)
    np.testing.assert_allclose(out[..., :d], want_out, atol=TOL, rtol=0)
    assert (out[..., d:] == 0).all()
    np.testing.assert_allclose(lse, want_lse, atol=TOL * 10, rtol=TOL)
    assert np.abs(want_out - plain_out).max() > 0.05  # the sinks matter at these values


@pytest.mark.parametrize("owns", [True, False], ids=["own-key-last", "prefix-only"])
def test_decode_folds_the_sink_where_it_holds_the_querys_key(owns):
    rng = np.random.default_rng()
    h_kv, h_q, d, kv_lens = 2, 8, 64, [37, 1, 1200]
    width = d + SINK_COLUMNS
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, h_kv, width, kv_lens, None, None)
    batch = len(kv_lens)
    q = rng.standard_normal((batch, h_q, width)).astype(np.float32)
    sinks = (rng.standard_normal(h_q) * 2).astype(np.float32)
    q[:, :, d + SINK] = sinks
    # the query's position; the last key sits there (its own key, appended) or one before it (a prefix)
    q_pos = np.array(kv_lens) - 1 + (0 if owns else 1)
    q[:, :, d + QUERY_POSITION:d + QUERY_POSITION + 2] = _split(q_pos)[:, None]
    for b, n in enumerate(kv_lens):  # the keys' positions, written where the pages hold them (pages of 16)
        for j in range(n):
            at = d + KEY_POSITION
            pool[page_ids[page_ptr[b] + j // 16], 0, :, j % 16, at:at + 2] = _split(np.array(j))
    scale = float(1 / np.sqrt(d))
    lib = _build(paged_decode_cpu(h_kv, h_q, width, False, d_att=d, sink=True))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float32), dev)
    lse = tvm.runtime.tensor(np.full(q.shape[:2], np.nan, np.float32), dev)
    args = [q, pool, page_ptr, page_ids, info, np.zeros(batch, np.int32), np.zeros(batch, np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, 0, 1.0, 1e4, scale)
    want_out, want_lse = reference(q[..., :d], np.arange(batch + 1), [k[..., :d] for k in keys],
                                   [v[..., :d] for v in values], scale, causal=False)
    if owns:
        want_out, want_lse = _with_sinks(want_out, want_lse, sinks)
    np.testing.assert_allclose(out.numpy()[..., :d], want_out, atol=TOL, rtol=0)
    assert (out.numpy()[..., d:] == 0).all()
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=TOL * 10, rtol=TOL)


def test_prefix_and_ragged_calls_merge_to_one_sink():
    """A prompt after a cached prefix: the paged call (no sink) and the ragged call (the sink) merged by their
    log-sum-exps, as TVM's merge_state does, are attention over every key with the sink once."""
    rng = np.random.default_rng()
    h_kv, h_q, d, n_prefix, n_new = 2, 4, 32, 21, 6
    width = d + SINK_COLUMNS
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, h_kv, width, [n_prefix], None, None)
    q = rng.standard_normal((n_new, h_q, width)).astype(np.float32)
    k_new = rng.standard_normal((n_new, h_kv, width)).astype(np.float32)
    v_new = rng.standard_normal((n_new, h_kv, width)).astype(np.float32)
    sinks = (rng.standard_normal(h_q) * 2).astype(np.float32)
    q[:, :, d + SINK] = sinks
    scale = float(1 / np.sqrt(d))
    q_ptr = np.array([0, n_new], np.int32)
    ragged_out, ragged_lse = _run(_build(ragged_prefill_cpu(h_kv, h_q, width, d_att=d, sink=True)), q, k_new, v_new,
                                  q_ptr, q_ptr, scale, True)
    lib = _build(paged_prefill_cpu(h_kv, h_q, width, False, d_att=d))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float32), dev)
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32), dev)
    args = [q, q_ptr, pool, page_ptr, page_ids, info, np.zeros(1, np.int32), np.zeros(n_new, np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, 0, 0, 1.0, 1e4, scale)
    total = np.logaddexp2(ragged_lse, lse.numpy())
    merged = (ragged_out * np.exp2(ragged_lse - total)[..., None] +
              out.numpy() * np.exp2(lse.numpy() - total)[..., None])[..., :d]
    all_k = [np.concatenate([keys[0][..., :d], k_new[..., :d]])]
    all_v = [np.concatenate([values[0][..., :d], v_new[..., :d]])]
    want_out, want_lse = _with_sinks(*reference(q[..., :d], q_ptr, all_k, all_v, scale, True), sinks)
    np.testing.assert_allclose(merged, want_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(total, want_lse, atol=TOL * 10, rtol=TOL)
