"""compile --kv-cache (lower/kv_cache.py): a tiny qwen2 built with a float16 KV cache, checked against the float64
oracle with the cache's rounding emulated (graph/kv_rounding.round_kv: q, k, v and the attention output through
float16) over a chunked prefill and greedy decode; the manifest records the type; the block types are refused
before any work. Tolerance REL_TOL (1e-3) as every oracle check: with the rounding emulated only float32's sums
differ. Against the plain oracle the float16 build is off by more than that (asserted too: the emulation is what
makes it agree)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from luce_compile.graph.kv_rounding import round_kv
from luce_compile.graph.oracle import Oracle
from tests.codegen._reference import check_against_oracle, engine_logits, oracle_trace, rel_err

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def f16_build(tmp_path_factory):
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic, preset

    gguf = cached_synthetic(preset("tiny-qwen2"))
    art = compile_model(gguf, "cpu", tmp_path_factory.mktemp("kv") / "f16", precision="f32", kv_cache="f16")
    return gguf, art


def test_f16_cache_matches_the_oracle_with_its_rounding(f16_build):
    from luce_runtime.engine import Engine, EngineOptions

    gguf, art = f16_build
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kernels"]["kv_cache"] == "f16" and manifest["runtime"]["kv_dtype"] == "float16"
    engine = Engine(art, EngineOptions(max_batch=2, max_context=256, prefill_chunk=16))  # 3 chunks: paged kernels
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.vocab_size, 40)]
    emulated = round_kv(Oracle(gguf), "f16")
    check_against_oracle("tiny-qwen2 kv f16", engine, emulated, prompt, steps=12)  # asserts the rows and ids
    plain = oracle_trace(Oracle(gguf), prompt, 12)
    rows = engine_logits(engine, prompt, plain.ids[:12])
    assert max(rel_err(r, o) for r, o in zip(rows, plain.logits, strict=False)) > 1e-3  # the rounding is real


def test_block_types_are_refused_before_any_work(tmp_path):
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic, preset

    with pytest.raises(NotImplementedError, match="q8_0 is not built yet: TVM 0.27's PagedKVCache"):
        compile_model(cached_synthetic(preset("tiny-qwen2")), "cpu", tmp_path / "q8", kv_cache="q8_0")
    assert not (tmp_path / "q8").exists()
