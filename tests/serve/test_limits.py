"""Issue 10.7 without a server: the cumulative TTFT histogram, incremental stop matching, the body cap, the
queue bound, and the API key from the environment."""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import time

import pytest
from luce_runtime.sampler import find_stop

pytestmark = pytest.mark.unit


# ---- the TTFT histogram is cumulative ----------------------------------------------------------------------------
def _series(text: str, name: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)}


def test_histogram_counts_are_cumulative_and_never_go_down():
    from luce_runtime.serve.metrics import Histogram

    h = Histogram((0.1, 1.0))
    before = None
    # more observations than the old 10k sliding window held: its counts dropped once old ones slid out
    for i in range(10_050):
        h.observe(5.0 if i < 50 else 0.05)
    lines = "\n".join(h.render("t", "ttft"))
    buckets = _series(lines, "t")
    assert buckets == {"0.1": 10_000, "1.0": 10_000, "+Inf": 10_050}
    assert f"t_count {10_050}" in lines and "t_sum 750.000000" in lines
    before = buckets
    h.observe(0.1)  # on a bound: `le` counts it in that bucket
    after = _series("\n".join(h.render("t", "ttft")), "t")
    assert after["0.1"] == before["0.1"] + 1 and all(after[k] >= before[k] for k in before)


def test_histogram_refuses_unsorted_bounds():
    from luce_runtime.serve.metrics import Histogram

    with pytest.raises(ValueError, match="increasing"):
        Histogram((1.0, 0.5))


def test_scheduler_counters_hold_a_histogram():
    from luce_runtime.serve.metrics import Histogram
    from luce_runtime.serve.scheduler import Counters

    c = Counters()
    assert isinstance(c.ttft, Histogram)
    for _ in range(10_001):
        c.ttft.observe(0.01)
    assert c.ttft.count == 10_001  # a window would have capped it at 10 000


# ---- stop strings: incremental, same answers as a whole-text search --------------------------------------------
def _naive(text: str, stop: list[str]) -> tuple[int | None, int]:
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    if hits:
        return min(hits), min(hits)
    held = max((n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)
    return None, len(text) - held


def test_find_stop_streamed_in_pieces_matches_the_whole_text_search():
    rng = random.Random(7)
    for _ in range(300):
        stop = ["".join(rng.choice("ab#") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text, emitted, result = "", 0, (None, 0)
        while len(text) < 60:
            text += "".join(rng.choice("abc#") for _ in range(rng.randint(1, 4)))
            result = find_stop(text, stop, start=emitted)  # as the scheduler calls it: from what it streamed
            assert result == _naive(text, stop), (text, stop, emitted)
            if result[0] is not None:
                break
            emitted = result[1]


def test_find_stop_cost_does_not_grow_with_the_text():
    stop = ["#" * 255 + "!", "END"]  # a long stop whose prefix keeps matching: the worst case for the hold-back

    def per_call(n: int) -> float:
        text = "#" * n
        start = n - 300  # what a streaming caller has already sent
        t = time.perf_counter()
        for _ in range(200):
            assert find_stop(text, stop, start=start)[0] is None
        return (time.perf_counter() - t) / 200

    small, big = min(per_call(1_000) for _ in range(3)), min(per_call(4_000_000) for _ in range(3))
    # a whole-text search scans 4 MB per token (~1 ms); from `start` it scans ~300 characters either way
    assert big < 10 * small + 50e-6, (small, big)


# ---- the body cap ------------------------------------------------------------------------------------------------
def _request(chunks: list[bytes], headers: dict[str, str]):
    from starlette.requests import Request

    sent = iter(chunks)
    received = []

    async def receive() -> dict:
        chunk = next(sent)
        received.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": len(received) < len(chunks)}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), received


def test_body_over_declared_length_is_refused_before_reading():
    from luce_runtime.serve.body import read_body
    from luce_runtime.serve.protocol import ApiError

    request, received = _request([b"x" * 10], {"content-length": str(10 * 2**20)})
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(request, 2**20))
    assert e.value.status == 413 and e.value.code == "request_too_large"
    assert received == []  # nothing was read


def test_chunked_body_is_capped_while_streaming():
    from luce_runtime.serve.body import read_body
    from luce_runtime.serve.protocol import ApiError

    request, received = _request([b"x" * 1000] * 50, {})  # no Content-Length: a chunked upload of 50 kB
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(request, 4000))
    assert e.value.status == 413
    assert len(received) == 5  # it stopped at the first chunk past the limit
    request, _ = _request([b"ab", b"cd"], {"content-length": "4"})
    assert asyncio.run(read_body(request, 4)) == b"abcd"


def test_bad_content_length_is_a_400():
    from luce_runtime.serve.body import read_body
    from luce_runtime.serve.protocol import ApiError

    request, _ = _request([b""], {"content-length": "-5"})
    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(request, 100))
    assert e.value.status == 400


# ---- the API key from the environment ----------------------------------------------------------------------------
def test_api_key_from_the_environment(monkeypatch):
    from luce_compile.cli import build_parser

    monkeypatch.setenv("LUCE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve", "m"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "m", "--api-key", "given"]).api_key == "given"
    monkeypatch.delenv("LUCE_API_KEY")
    assert build_parser().parse_args(["serve", "m"]).api_key is None


def test_serve_help_names_the_variable():
    env = {k: v for k, v in os.environ.items() if k != "LUCE_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "luce_compile.cli", "serve", "--help"], capture_output=True,
                         text=True, env=env, check=True).stdout
    assert "LUCE_API_KEY" in " ".join(out.split())  # argparse wraps the help text
