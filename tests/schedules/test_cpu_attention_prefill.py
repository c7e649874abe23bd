"""schedules/cpu/attention_prefill.py: the CPU ragged and paged prefill attention against a float64 numpy
reference (fresh random inputs each run: several ragged sequences, head dims 64/128/256, GQA; pages in random order,
sliding windows with sinks), TVM's signatures, and the swap in lower/relax_model.py (llvm only, restored after).
Tolerance 2e-5: float32 sums over at most a few hundred keys (seen: ~2e-6, as TVM's own kernels), far below the
1e-3 the model tests allow."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.attention_prefill import paged_prefill_cpu, ragged_prefill_cpu, supports
from tvm.relax.frontend.nn.llm import _prefill_kernels, kv_cache
from tvm.target import Target

from luce_compile.lower.relax_model import cpu_attention
from tests.schedules._signature import assert_same_signature

pytestmark = pytest.mark.unit
TOL = 2e-5
CPU = Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})


def _build(func: tvm.tirx.PrimFunc) -> tvm.runtime.Module:
    with CPU:
        return tvm.compile(tvm.IRModule({"main": func}), target=CPU)


def reference(q: np.ndarray, q_ptr: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray], scale: float,
              causal: bool, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention per sequence and head over each sequence's keys/values (S_kv, H_kv, D); the base-2
    log-sum-exp of scale·q·k, as TVM's kernels return it. Causal is end-aligned (the last query sees every key);
    with a window, TVM's sliding mask under causal: row i sees the last window - i - 1 keys."""
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    group = q.shape[1] // keys[0].shape[1]
    for b in range(len(q_ptr) - 1):
        rows = slice(q_ptr[b], q_ptr[b + 1])
        qb, kb, vb = q[rows].astype(np.float64), keys[b].astype(np.float64), values[b].astype(np.float64)
        i, j = np.arange(len(qb))[:, None], np.arange(len(kb))[None]  # (S_q, 1), (1, S_kv)
        if causal and window:
            visible = j >= np.maximum(len(kb) - np.maximum(window - i - 1, 0), 0)
        else:
            visible = (j <= i + len(kb) - len(qb)) if causal else np.ones((len(qb), len(kb)), bool)
        for h in range(q.shape[1]):
            s = np.where(visible, qb[:, h] @ kb[:, h // group].T * scale, -np.inf)  # (S_q, S_kv)
            top = s.max(axis=1, keepdims=True)
            p = np.exp(s - top)
            out[rows, h] = p / p.sum(axis=1, keepdims=True) @ vb[:, h // group]
            lse[rows, h] = (top[:, 0] + np.log(p.sum(axis=1))) / np.log(2)
    return out, lse


def _run(lib: tvm.runtime.Module, q, k, v, q_ptr, kv_ptr, scale: float, causal: bool,
         out_dtype: type = np.float32) -> tuple[np.ndarray, ...]:
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, out_dtype), dev)
    lse = tvm.runtime.tensor(np.full(q.shape[:2], np.nan, np.float32), dev)
    zeros_q, zeros_b = np.zeros(len(q), np.int32), np.zeros(len(q_ptr) - 1, np.int32)  # rope positions: unused
    args = [q, q_ptr.astype(np.int32), k, v, kv_ptr.astype(np.int32), zeros_q, zeros_b]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, int(causal), 0, 1.0, 1e4, scale)
    return out.numpy(), lse.numpy()


@pytest.mark.parametrize(
    "h_kv,h_q,d,q_lens,kv_extra",
    [
        (3, 9, 64, [70], [0]),  # SmolLM2's heads, one sequence over several tiles
        (8, 16, 128, [1, 33, 17], [0, 0, 0]),  # Qwen3's heads, ragged, a one-token sequence
        (1, 4, 256, [40, 5, 19], [0, 0, 0]),  # Gemma 3's heads, group 4
        (2, 2, 64, [7, 20], [9, 30]),  # no GQA; more keys than queries (a cached prefix: causal end-aligned)
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_matches_float64_reference(h_kv, h_q, d, q_lens, kv_extra, causal):
    rng = np.random.default_rng()  # fresh inputs each run
    q_ptr = np.concatenate([[0], np.cumsum(q_lens)])
    kv_ptr = np.concatenate([[0], np.cumsum(np.add(q_lens, kv_extra))])
    q = rng.standard_normal((q_ptr[-1], h_q, d)).astype(np.float32)
    k = rng.standard_normal((kv_ptr[-1], h_kv, d)).astype(np.float32)
    v = rng.standard_normal((kv_ptr[-1], h_kv, d)).astype(np.float32)
    scale = float(rng.uniform(0.5, 2.0) / np.sqrt(d))  # sm_scale is an argument: not only 1/sqrt(d)
    out, lse = _run(_build(ragged_prefill_cpu(h_kv, h_q, d)), q, k, v, q_ptr, kv_ptr, scale, causal)
    per_seq = [slice(kv_ptr[b], kv_ptr[b + 1]) for b in range(len(q_lens))]
    want_out, want_lse = reference(q, q_ptr, [k[x] for x in per_seq], [v[x] for x in per_seq], scale, causal)
    np.testing.assert_allclose(out, want_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=TOL * 10, rtol=TOL)  # |lse| ~ 10-100: relative


PAGE = 16  # TVM's CPU paged kernel's page size (its factory's default, the one the cache builds)


def _pages(rng: np.random.Generator, h_kv: int, d: int, kv_lens: list[int], sinks: list[int] | None,
           offsets: list[int] | None) -> tuple[list[np.ndarray], ...]:
    """A page pool in random order and each sequence's logical keys/values as the kernel must read them: key j sits
    at slot j, or past the sink at j - sink + offset (sliding: the window's start in the sequence's pages)."""
    stored = [n if sinks is None else (n if n <= s else n - s + o) for n, s, o in
              zip(kv_lens, sinks or kv_lens, offsets or kv_lens, strict=True)]
    n_pages = [-(-n // PAGE) for n in stored]
    pool = rng.standard_normal((sum(n_pages) + 3, 2, h_kv, PAGE, d)).astype(np.float32)  # (P, K/V, H_kv, page, D)
    order = [int(x) for x in rng.permutation(len(pool))]
    indptr, keys, values, last = [0], [], [], []
    for b, n in enumerate(kv_lens):
        ids = order[indptr[-1]:indptr[-1] + n_pages[b]]
        indptr.append(indptr[-1] + n_pages[b])
        last.append(stored[b] - (n_pages[b] - 1) * PAGE if n_pages[b] else 0)
        pos = [j if sinks is None or j < sinks[b] else j - sinks[b] + offsets[b] for j in range(n)]
        keys.append(np.stack([pool[ids[p // PAGE], 0, :, p % PAGE] for p in pos]))
        values.append(np.stack([pool[ids[p // PAGE], 1, :, p % PAGE] for p in pos]))
    info = np.array(last if sinks is None else [last, offsets, sinks], np.int32)  # (B,) or (3, B), as TVM's
    return pool, np.array(order[:indptr[-1]], np.int32), np.array(indptr, np.int32), info, keys, values


@pytest.mark.parametrize(
    "h_kv,h_q,d,q_lens,kv_lens,window",
    [
        (3, 9, 64, [20, 7], [50, 33], 0),  # a cached prefix of 50 and 33 keys, partial last pages
        (8, 16, 128, [40], [64], 0),  # whole pages
        (1, 4, 256, [5, 9], [40, 70], 32),  # sliding window 32: sinks 4 and 0, windows starting at 3 and 17
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_matches_float64_reference(h_kv, h_q, d, q_lens, kv_lens, window, causal):
    rng = np.random.default_rng()
    sinks, offsets = ([4, 0], [3, 17]) if window else (None, None)
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, h_kv, d, kv_lens, sinks, offsets)
    q_ptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((q_ptr[-1], h_q, d)).astype(np.float32)
    scale = float(1 / np.sqrt(d))
    lib = _build(paged_prefill_cpu(h_kv, h_q, d, bool(window), sliding_window_size=window or 1024))
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float32), dev)
    lse = tvm.runtime.tensor(np.full(q.shape[:2], np.nan, np.float32), dev)
    args = [q, q_ptr, pool, page_ptr, page_ids, info, np.zeros(len(q_lens), np.int32), np.zeros(len(q), np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, int(causal), 0, 1.0, 1e4, scale)
    want_out, want_lse = reference(q, q_ptr, keys, values, scale, causal, window)
    np.testing.assert_allclose(out.numpy(), want_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("kind", ["ragged", "paged", "paged sliding"])
def test_signature_is_tvms(kind):
    if kind == "ragged":
        ours = ragged_prefill_cpu(3, 9, 64)
        theirs = _prefill_kernels._attention_prefill_ragged_cpu(3, 9, 64, 64, "float32", {})
    else:
        sliding = kind.endswith("sliding")
        ours = paged_prefill_cpu(3, 9, 64, sliding)
        theirs = _prefill_kernels._attention_prefill_cpu(3, 9, 64, "float32", sliding, {})
        assert ours.attrs["global_symbol"] == theirs.attrs["global_symbol"]
    assert_same_signature(ours, theirs)


def test_is_parallel_vectorized_and_left_alone_by_the_schedule_rules():
    script = ragged_prefill_cpu(3, 9, 64).script()
    assert "T.parallel(" in script and "T.vectorized(" in script
    assert '"tirx.is_scheduled": True' in script


# --kv-cache f16: q, keys, values and the output are float16; the kernel widens each load and sums in float32, so
# the only difference from the float64 reference on the same float16 inputs is the output's float16 rounding
# (2^-11 relative, outputs of random inputs stay below ~4) and float32's sums
F16_TOL = 4 * 2.0**-11


def test_float16_cache_widens_loads_and_rounds_only_the_output():
    rng = np.random.default_rng()
    h_kv, h_q, d, q_lens, kv_lens = 2, 8, 64, [20, 7], [50, 33]
    pool, page_ids, page_ptr, info, keys, values = _pages(rng, h_kv, d, kv_lens, None, None)
    q_ptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((q_ptr[-1], h_q, d)).astype(np.float16)
    scale = float(1 / np.sqrt(d))
    dev = tvm.cpu()
    # the paged kernel over float16 pages (a cached prefix)
    lib = _build(paged_prefill_cpu(h_kv, h_q, d, False, dtype="float16"))
    out = tvm.runtime.tensor(np.zeros(q.shape, np.float16), dev)
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32), dev)
    args = [q, q_ptr, pool.astype(np.float16), page_ptr, page_ids, info, np.zeros(2, np.int32),
            np.zeros(len(q), np.int32)]
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in args), out, lse, 1, 0, 1.0, 1e4, scale)
    f16 = [k.astype(np.float16) for k in keys], [v.astype(np.float16) for v in values]
    want_out, want_lse = reference(q, q_ptr, *f16, scale, causal=True)
    np.testing.assert_allclose(out.numpy().astype(np.float64), want_out, atol=F16_TOL, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=TOL * 10, rtol=TOL)
    # the ragged kernel over a prompt's own float16 keys
    k, v = (rng.standard_normal((q_ptr[-1], h_kv, d)).astype(np.float16) for _ in range(2))
    out, lse = _run(_build(ragged_prefill_cpu(h_kv, h_q, d, dtype="float16")), q, k, v, q_ptr, q_ptr, scale, True,
                    out_dtype=np.float16)
    per_seq = [slice(q_ptr[b], q_ptr[b + 1]) for b in range(2)]
    want_out, want_lse = reference(q, q_ptr, [k[x] for x in per_seq], [v[x] for x in per_seq], scale, True)
    np.testing.assert_allclose(out.astype(np.float64), want_out, atol=F16_TOL, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=TOL * 10, rtol=TOL)


@pytest.mark.parametrize("d_qk,d_v,dtype", [(64, 64, "bfloat16"), (128, 64, "float32"), (72, 72, "float16")])
def test_declines_what_it_does_not_take(d_qk, d_v, dtype):
    assert not supports(d_qk, d_v, dtype)
    assert supports(64, 64, "float32") and supports(256, 256, "float32") and supports(64, 64, "float16")


def test_swapped_only_for_llvm_and_restored():
    originals = kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu
    with cpu_attention(Target({"kind": "cuda", "arch": "sm_90"})):
        assert (kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu) == originals
    with cpu_attention(CPU):
        ragged, paged = kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu
        assert (ragged, paged) != originals
        assert "T.parallel(" in ragged(3, 9, 64, 64, "float32", {}).script()
        assert "T.parallel(" not in ragged(3, 9, 64, 64, "bfloat16", {}).script()  # TVM's, for what we decline
        assert "T.parallel(" in paged(3, 9, 64, "float32", True, {}, sliding_window_size=512).script()
        assert "T.parallel(" not in paged(3, 9, 72, "float32", False, {}).script()
    assert (kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu) == originals
    with pytest.raises(RuntimeError), cpu_attention(CPU):
        raise RuntimeError("restored even so")
    assert (kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu) == originals
