"""Continuous batching through the real server: concurrent streams equal solo runs, disconnects free their pages,
and a bounded load test ends with 0 failures and the KV pool back where it started."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TOPICS = ["the sea", "a cat", "winter", "the moon", "bread", "trains", "music", "a forest"]


def stream_text(oai, model: str, topic: str, max_tokens: int, barrier: threading.Barrier | None = None) -> str:
    if barrier is not None:
        barrier.wait(timeout=60)
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Write about {topic}."}],
                                         max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_concurrent_streams_equal_solo_and_batch(server, oai):
    alone = [stream_text(oai, server.model, t, 16) for t in TOPICS]
    before = server.wait_idle()
    barrier = threading.Barrier(len(TOPICS))
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda t: stream_text(oai, server.model, t, 16, barrier), TOPICS))
    after = server.wait_idle()
    assert together == alone
    assert all(alone)
    assert after["batched_steps"] > before["batched_steps"]
    assert after["max_batch_seen"] >= 2
    assert after["running"] == 0 and after["kv_pages_used"] <= after["kv_prefix_pages"]  # only cached prompts


def test_disconnect_frees_pages(server):
    before = server.wait_idle()
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/chat/completions", json=body,
                                                           headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks: the sequence is running
        assert any(line.startswith("data: ") for line in got)
        mid = server.stats()
        assert mid["running"] == 1 and mid["kv_pages_used"] > 0
    # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 30
    while (s := server.stats())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["running"] == 0 and s["kv_pages_used"] <= s["kv_prefix_pages"]
    assert s["cancelled"] == before["cancelled"] + 1
    assert s["tokens"] - before["tokens"] < 400  # it stopped early: the rest was never generated
    assert s["kv_pages_free"] == before["kv_pages_free"]


def test_bounded_load(server, oai):
    before = server.wait_idle()
    n_requests, clients, max_tokens = 24, 8, 12

    def one(i: int) -> int:
        r = oai.chat.completions.create(model=server.model, max_tokens=max_tokens, temperature=0,
                                        messages=[{"role": "user", "content": f"Say a fact about {TOPICS[i % 8]}."}])
        return r.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: _try(one, i), range(n_requests)))
    elapsed = time.perf_counter() - start
    failures = [r for r in results if isinstance(r, Exception)]
    tokens = sum(r for r in results if isinstance(r, int))
    print(f"\nload: {n_requests} requests, {clients} clients: {n_requests / elapsed:.2f} req/s, "
          f"{tokens / elapsed:.1f} tok/s")
    assert failures == []
    after = server.wait_idle()
    assert after["running"] == 0 and after["waiting"] == 0
    # what the pool still holds belongs to the prompt-prefix cache (kept by design; the pool counts shared pages once)
    assert after["kv_pages_total"] - after["kv_pages_free"] <= after["kv_prefix_pages"]
    assert after["finished"] - before["finished"] == n_requests
    assert after["failed"] == before["failed"]


def _try(fn, i):
    try:
        return fn(i)
    except Exception as e:  # counted as a failure by the test
        return e


def test_n_choices_fork_the_prompt_instead_of_prefilling_it_again(server, oai):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Name three rivers in Europe."}],
              max_tokens=12, temperature=0)
    alone = oai.chat.completions.create(**kw).choices[0].message.content
    before = server.wait_idle()
    r = oai.chat.completions.create(n=4, **kw)
    after = server.wait_idle()
    assert [c.message.content for c in r.choices] == [alone] * 4  # greedy: every fork continues like the original
    assert after["choice_forks"] - before["choice_forks"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == r.usage.prompt_tokens  # prefilled once
    assert after["kv_pages_used"] <= after["kv_prefix_pages"] and after["failed"] == before["failed"]
    assert "luce_choice_forks_total" in server.get("/metrics")
