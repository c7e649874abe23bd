"""schedules/cpu/attention_prefill.py: the CPU ragged prefill attention against a float64 numpy reference (fresh
random inputs each run: several ragged sequences, head dims 64/128/256, GQA), TVM's signature, and the swap in
lower/relax_model.py (llvm only, restored after). Tolerance 2e-5: float32 sums over at most a few hundred keys
(seen: ~2e-6, as TVM's own kernel), far below the 1e-3 the model tests allow."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.attention_prefill import ragged_prefill_cpu, supports
from tvm.relax.frontend.nn.llm import _prefill_kernels, kv_cache
from tvm.target import Target

from luce_compile.lower.relax_model import cpu_prefill_attention

pytestmark = pytest.mark.unit
TOL = 2e-5
CPU = Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})


def _build(func: tvm.tirx.PrimFunc) -> tvm.runtime.Module:
    with CPU:
        return tvm.compile(tvm.IRModule({"main": func}), target=CPU)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_ptr: np.ndarray, kv_ptr: np.ndarray, scale: float,
              causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention per sequence and head; the base-2 log-sum-exp of scale·q·k, as TVM's kernel returns it."""
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    group = q.shape[1] // k.shape[1]
    for b in range(len(q_ptr) - 1):
        rows, keys = slice(q_ptr[b], q_ptr[b + 1]), slice(kv_ptr[b], kv_ptr[b + 1])
        qb, kb, vb = (x.astype(np.float64) for x in (q[rows], k[keys], v[keys]))
        n_q, n_kv = len(qb), len(kb)
        visible = np.arange(n_kv)[None] <= np.arange(n_q)[:, None] + n_kv - n_q  # (S_q, S_kv): causal, end-aligned
        for h in range(q.shape[1]):
            s = qb[:, h] @ kb[:, h // group].T * scale  # (S_q, S_kv)
            if causal:
                s = np.where(visible, s, -np.inf)
            top = s.max(axis=1, keepdims=True)
            p = np.exp(s - top)
            out[rows, h] = p / p.sum(axis=1, keepdims=True) @ vb[:, h // group]
            lse[rows, h] = (top[:, 0] + np.log(p.sum(axis=1))) / np.log(2)
    return out, lse


def _run(lib: tvm.runtime.Module, q, k, v, q_ptr, kv_ptr, scale: float, causal: bool) -> tuple[np.ndarray, ...]:
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float32), dev)
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
def test_matches_float64_reference(h_kv, h_q, d, q_lens, kv_extra, causal):
    rng = np.random.default_rng()  # fresh inputs each run
    q_ptr = np.concatenate([[0], np.cumsum(q_lens)])
    kv_ptr = np.concatenate([[0], np.cumsum(np.add(q_lens, kv_extra))])
    q = rng.standard_normal((q_ptr[-1], h_q, d)).astype(np.float32)
    k = rng.standard_normal((kv_ptr[-1], h_kv, d)).astype(np.float32)
    v = rng.standard_normal((kv_ptr[-1], h_kv, d)).astype(np.float32)
    scale = float(rng.uniform(0.5, 2.0) / np.sqrt(d))  # sm_scale is an argument: not only 1/sqrt(d)
    out, lse = _run(_build(ragged_prefill_cpu(h_kv, h_q, d)), q, k, v, q_ptr, kv_ptr, scale, causal)
    want_out, want_lse = reference(q, k, v, q_ptr, kv_ptr, scale, causal)
    np.testing.assert_allclose(out, want_out, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=TOL * 10, rtol=TOL)  # |lse| ~ 10-100: relative


def test_signature_is_tvms():
    ours = ragged_prefill_cpu(3, 9, 64)
    theirs = _prefill_kernels._attention_prefill_ragged_cpu(3, 9, 64, 64, "float32", {})
    assert [p.name for p in ours.params] == [p.name for p in theirs.params]
    for mine, their in zip(ours.params, theirs.params, strict=True):
        a, b = mine.ty, their.ty  # a buffer parameter's type is its buffer (TVM 0.27)
        if hasattr(b, "shape"):
            assert a.dtype == b.dtype and len(a.shape) == len(b.shape), their.name
            # the cache passes views into its aux arrays: a zero-offset declaration would reject them
            assert (str(a.elem_offset) == "0") == (str(b.elem_offset) == "0"), their.name
        else:
            assert str(a) == str(b), their.name


def test_is_parallel_vectorized_and_left_alone_by_the_schedule_rules():
    script = ragged_prefill_cpu(3, 9, 64).script()
    assert "T.parallel(" in script and "T.vectorized(" in script
    assert '"tirx.is_scheduled": True' in script


@pytest.mark.parametrize("d_qk,d_v,dtype", [(64, 64, "float16"), (128, 64, "float32"), (72, 72, "float32")])
def test_declines_what_it_does_not_take(d_qk, d_v, dtype):
    assert not supports(d_qk, d_v, dtype)
    assert supports(64, 64, "float32") and supports(256, 256, "float32")


def test_swapped_only_for_llvm_and_restored():
    original = kv_cache._attention_prefill_ragged_cpu
    with cpu_prefill_attention(Target({"kind": "cuda", "arch": "sm_90"})):
        assert kv_cache._attention_prefill_ragged_cpu is original
    with cpu_prefill_attention(CPU):
        swapped = kv_cache._attention_prefill_ragged_cpu
        assert swapped is not original
        assert "T.parallel(" in swapped(3, 9, 64, 64, "float32", {}).script()
        assert "T.parallel(" not in swapped(3, 9, 64, 64, "float16", {}).script()  # TVM's, for what we decline
    assert kv_cache._attention_prefill_ragged_cpu is original
    with pytest.raises(RuntimeError), cpu_prefill_attention(CPU):
        raise RuntimeError("restored even so")
    assert kv_cache._attention_prefill_ragged_cpu is original
