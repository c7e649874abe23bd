"""benchmarks/profile_step.py on a compiled tiny model: every decode-step callee is timed, the attention builtin and
the matmul kernels among them, and their times add up to about the step (the hook's own cost apart)."""

from __future__ import annotations

import pytest

from tests.bench._load import load_benchmark_module

pytestmark = pytest.mark.e2e


def test_profile_names_the_step_callees_and_sums_to_the_step(tiny):
    profile = load_benchmark_module("profile_step")
    out = profile.profile_decode(str(tiny("tiny-llama").artifact), context=24, batch=2, steps=4)
    symbols = {c["symbol"] for c in out["callees"]}
    assert any("attention" in s for s in symbols), symbols  # the paged-KV cache builtin
    assert any("embed" in s for s in symbols), symbols
    assert any(s.startswith(("gemm_", "gemv_", "int8_gemv_", "matmul")) for s in symbols), symbols
    assert sum(c["share"] for c in out["callees"]) == pytest.approx(1.0, abs=1e-3)
    assert all(c["calls_per_step"] > 0 and c["us_per_step"] >= 0 for c in out["callees"])
    assert out["step_us_in_calls"] > 0 and out["step_us_unprofiled"] > 0
