"""scripts/device_check.py's window_prefill check (issue 40.3: Gemma 3's prompts past the window on a GPU), run here
on the CPU build of tiny-gemma3 (window 8), whose own prefill kernels window the cached keys: the check must pass
there and fail a prefill whose chunks attend past the window, before a device call is spent on it."""

from __future__ import annotations

import pytest

from tests.bench._load import load_script

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("wide", [False, True], ids=["windowed", "chunks-past-the-window"])
def test_window_prefill_passes_windowed_chunks_and_fails_chunks_that_see_past_the_window(tiny, wide):
    from luce_runtime.engine import Engine, EngineOptions

    check = load_script("device_check")
    model = tiny("tiny-gemma3")
    engines = {name: Engine(model.artifact, EngineOptions(max_batch=2, max_context=512, prefill_chunk=64,
                                                          megakernel=False, sliding_prefill_chunks=chunks))
               for name, chunks in (("chunks", True), ("token", False))}
    assert engines["chunks"].sliding_window == 8
    if wide:  # chunks of 64: the in-chunk (ragged) attention takes no window, so a row sees 63 keys, not 8
        engines["chunks"].sliding_window = 64
    result = check.check_window_prefill(engines, tol=1e-4, past=100, steps=4)
    assert result["chunk_past_window"] == {"chunks": 64 if wide else 8, "token": 1}
    assert result["ok"] != wide, result
    if not wide:  # the same float32 kernels on both routes
        assert result["max_rel_diff"] <= 1e-5
    else:
        assert result["max_rel_diff"] > 1e-2
