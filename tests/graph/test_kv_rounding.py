"""graph/kv_rounding.py: the KV cache's roundings bit-exact against gguf-py's reference quantizers (llama.cpp's own
numpy port of quantize_row_*_ref), and round_kv rounding what the cache stores (the oracle's kept keys) while
leaving the plain oracle as it was."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from luce_compile.graph.kv_rounding import q4_0 as kv_q4_0
from luce_compile.graph.kv_rounding import round_kv
from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import q8_0

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rounding,kind", [(kv_q4_0, GGMLQuantizationType.Q4_0), (q8_0, GGMLQuantizationType.Q8_0)])
def test_bit_exact_against_gguf_py(rounding, kind):
    rng = np.random.default_rng()
    x = (rng.standard_normal((6, 2, 64)) * rng.uniform(0.01, 30, (6, 2, 1))).astype(np.float32)  # (S, Hkv, D)
    x[0, 0, :32] = 0  # an all-zero block: scale 0
    want = quants.dequantize(quants.quantize(x.reshape(-1, 64), kind), kind).reshape(x.shape)
    np.testing.assert_array_equal(rounding(x).astype(np.float32), want)


def test_round_kv_rounds_the_stored_keys_and_values(synthetic):
    model = synthetic("tiny-qwen3")  # head size 32: whole blocks of 32 (the block types need them)
    plain, rounded = Oracle(model), round_kv(Oracle(model), "q4_0")
    ids = [5, 17, 3, 9, 44]
    a, b = plain.prefill(ids), rounded.prefill(ids)
    assert not np.allclose(a, b, rtol=1e-6, atol=0)  # 4-bit keys move the logits
    (k, v, _), (k0, v0, _) = rounded._kv[0], plain._kv[0]  # layer 0: the same inputs on both (later ones differ)
    np.testing.assert_array_equal(k, kv_q4_0(k0))
    np.testing.assert_array_equal(v, kv_q4_0(v0))
    assert round_kv(plain, "f32") is plain and plain._attention.__func__ is Oracle._attention
    with pytest.raises(ValueError, match="no KV rounding 'q5_1'"):
        round_kv(plain, "q5_1")


def test_an_f16_cache_rounds_the_sinks_that_ride_in_its_query_rows(synthetic):
    """gpt-oss's sink logits travel in the padding of the cache's query rows (lower/attention_sinks.py), so an f16
    cache rounds them as it rounds the queries; the plain oracle keeps them as the file has them."""
    model = synthetic("tiny-gptoss")
    plain, rounded = Oracle(model), round_kv(Oracle(model), "f16")
    op = next(o for o in plain.graph.ops if "sinks" in o.weights)
    want = plain._sinks(op)
    assert not np.array_equal(want, want.astype(np.float16))  # the file's sinks are not float16 values already
    np.testing.assert_array_equal(rounded._sinks(op), want.astype(np.float16).astype(want.dtype))
    assert round_kv(Oracle(model), "q8_0")._sinks(op) is not None
    np.testing.assert_array_equal(round_kv(Oracle(model), "q8_0")._sinks(op), want)  # llama.cpp's: a float32 tensor
