"""The KV cache's roundings on the oracle (compile --kv-cache; llama.cpp's -ctk/-ctv), so that a build with a rounded
cache is checked against the oracle with the same rounding emulated, and a KV type's accuracy can be measured
without a kernel for it."""

from __future__ import annotations

import numpy as np

from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import f16, q8_0


def q4_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref and back: per 32 values, d = max / -8 (max: the value of largest magnitude, the
    first of equals), q = min(15, trunc(x / d + 8.5)) in float32, x ≈ (q - 8) · fp16(d)."""
    b = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    top = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    d = top / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(np.float32(15), np.trunc(b * inv + np.float32(8.5)))
    return ((q - 8) * f16(d)).reshape(x.shape)


# The KV cache's roundings (compile --kv-cache; llama.cpp's -ctk/-ctv): (stored keys and values, the queries as the
# attention takes them, its output). f16 is this project's CPU build (lower/kv_cache.py: q, k, v and the output
# pass through float16, sums in float32); q8_0 and q4_0 are llama.cpp's CPU flash attention, which stores K and V in
# the block type and converts Q to the K type's vec_dot_type (q8_0 for both) before the dot products.
KV_ROUNDING = {
    "f16": (f16, f16, f16),
    "q8_0": (q8_0, q8_0, None),
    "q4_0": (q4_0, q8_0, None),
}


def round_kv(oracle: Oracle, kv_cache: str) -> Oracle:
    """`oracle` (any Oracle) with its KV cache rounded as `kv_cache` stores it (KV_ROUNDING; "f32" leaves it): every
    key and value is rounded as it is appended, so later steps read the rounded ones, as the compiled cache does."""
    if kv_cache == "f32":
        return oracle
    if kv_cache not in KV_ROUNDING:
        raise ValueError(f"rounding: no KV rounding {kv_cache!r}; known: f32, {', '.join(KV_ROUNDING)}")
    kv, query, output = KV_ROUNDING[kv_cache]
    plain, plain_sinks = oracle._attention, oracle._sinks

    def attention(op, q, k, v, positions):  # noqa: ANN001, ANN202  (Oracle._attention's signature)
        out = plain(op, query(q), kv(k), kv(v), positions)
        return output(out) if output else out

    oracle._attention = attention
    if kv_cache == "f16":  # attention sinks ride in the cache's query rows (lower/attention_sinks.py): float16 too
        oracle._sinks = lambda op: None if (s := plain_sinks(op)) is None else f16(s)
    return oracle
