"""schedules/cpu/attention_decode.py: the CPU decode attention against the float64 reference of the prefill tests
(fresh random pages in random order each run; GQA groups of 1, 3, 4 and 8 query heads, head dims 64 to 256, one
sequence of a single key, sliding windows with sinks), TVM's signature, and the swap in lower/relax_model.py.
Tolerance as the prefill kernels' (2e-5: float32 sums over at most a few hundred keys)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.attention_decode import paged_decode_cpu, rows_per_block
from tvm.relax.frontend.nn.llm import kv_cache

from luce_compile.lower.relax_model import cpu_attention
from tests.schedules._signature import assert_same_signature
from tests.schedules.test_cpu_attention_prefill import CPU, TOL, _build, _pages, reference

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "h_kv,h_q,d,kv_lens,window",
    [
        (3, 9, 64, [50, 33, 1], 0),  # SmolLM2's heads; partial last pages, a sequence with its first key only
        (8, 16, 128, [64, 200], 0),  # Qwen3's: whole pages
        (2, 16, 64, [17], 0),  # a group of 8
        (4, 4, 64, [90], 0),  # no grouping
        (1, 4, 256, [40, 70], 32),  # sliding window 32: sinks 4 and 0, windows starting at 3 and 17
    ],
)
def test_decode_matches_float64_reference(h_kv, h_q, d, kv_lens, window):
    rng = np.random.default_rng()
    sinks, offsets = ([4, 0], [3, 17]) if window else (None, None)
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, h_kv, d, kv_lens, sinks, offsets)
    batch = len(kv_lens)
    q = rng.standard_normal((batch, h_q, d)).astype(np.float32)
    scale = float(1 / np.sqrt(d))
    lib = _build(paged_decode_cpu(h_kv, h_q, d, bool(window)))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float32), dev)
    lse = tvm.runtime.tensor(np.full(q.shape[:2], np.nan, np.float32), dev)
    args = [q, pool, page_ptr, page_ids, info, np.zeros(batch, np.int32), np.zeros(batch, np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, 0, 1.0, 1e4, scale)
    want_out, want_lse = reference(q, np.arange(batch + 1), keys, values, scale, causal=False)
    np.testing.assert_allclose(out.numpy(), want_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=TOL * 10, rtol=TOL)


def test_float16_pages():
    """--kv-cache f16: float16 q, pages and output; sums in float32 (the prefill test's tolerance: F16_TOL)."""
    from tests.schedules.test_cpu_attention_prefill import F16_TOL

    rng = np.random.default_rng()
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, 2, 64, [70, 9], None, None)
    q = rng.standard_normal((2, 14, 64)).astype(np.float16)  # Qwen2.5-0.5B's heads: 14 over 2
    scale = float(1 / np.sqrt(64))
    lib = _build(paged_decode_cpu(2, 14, 64, False, dtype="float16"))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float16), dev)
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32), dev)
    args = [q, pool.astype(np.float16), page_ptr, page_ids, info, np.zeros(2, np.int32), np.zeros(2, np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, 0, 1.0, 1e4, scale)
    want_out, want_lse = reference(q, np.arange(3), [k.astype(np.float16) for k in keys],
                                   [v.astype(np.float16) for v in values], scale, causal=False)
    np.testing.assert_allclose(out.numpy().astype(np.float64), want_out, atol=F16_TOL, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("sliding", [False, True])
def test_signature_is_tvms(sliding):
    ours = paged_decode_cpu(3, 9, 64, sliding)
    theirs = kv_cache._attention_decode_cpu(3, 9, 64, "float32", sliding, {})
    assert ours.attrs["global_symbol"] == theirs.attrs["global_symbol"]
    assert_same_signature(ours, theirs)


def test_rows_share_loads_without_waste():
    assert [rows_per_block(g) for g in (1, 2, 3, 4, 6, 7, 8)] == [1, 2, 3, 4, 3, 1, 4]


def test_swapped_only_for_llvm_and_restored():
    original = kv_cache._attention_decode_cpu
    with cpu_attention(tvm.target.Target({"kind": "cuda", "arch": "sm_90"})):
        assert kv_cache._attention_decode_cpu is original
    with cpu_attention(CPU):
        decode = kv_cache._attention_decode_cpu
        assert decode is not original
        assert "T.parallel(" in decode(3, 9, 64, "float32", False, {}).script()
        assert "T.parallel(" not in decode(3, 9, 72, "float32", False, {}).script()  # TVM's, for what we decline
    assert kv_cache._attention_decode_cpu is original
