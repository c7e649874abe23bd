"""The server's scheduler under injected faults, on a compiled tiny model: a request that fails gets its own error,
the others finish with the tokens they give without the fault, and every KV page is free afterwards."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.runtime.faults import fails_on_call

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture()
def scheduler(tiny):
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.serve.scheduler import Scheduler

    engine = Engine(tiny("tiny-llama").artifact, EngineOptions(max_batch=3, max_context=128, prefill_chunk=16))
    s = Scheduler(engine, max_batch=3, prefix_cache=0)
    s.start()
    yield s
    s.stop()
    # a stopped scheduler holds nothing: every page is back in the pool
    assert engine.sequences() == {} and engine.free_pages() == engine.total_pages


def run(s, prompts: list[list[int]]) -> list[list[int] | str]:
    """Each prompt's greedy tokens, or its error text."""
    from luce_runtime.sampler import SamplingParams
    from luce_runtime.serve.scheduler import GenRequest

    async def go():
        loop, queues = asyncio.get_running_loop(), []
        for p in prompts:
            q: asyncio.Queue = asyncio.Queue()
            s.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), q, loop))
            queues.append(q)
        outs = []
        for q in queues:
            tokens = []
            while (ev := await asyncio.wait_for(q.get(), 60)).kind == "delta":
                tokens.append(ev.token)
            outs.append(ev.text if ev.kind == "error" else tokens)
        return outs

    return asyncio.run(go())


def settle(s) -> dict:
    """Stats once the scheduler is idle (it refreshes free pages after each step)."""
    import time

    for _ in range(200):
        stats = s.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError("the scheduler did not go idle")


def prompts_for(rng: np.random.Generator, vocab: int, poison: int) -> list[list[int]]:
    ps = [[int(t) for t in rng.integers(0, vocab, n)] for n in (9, 23, 14)]
    return [[t for t in p if t != poison] for p in ps]


def test_a_transient_step_failure_is_retried_per_request(scheduler, rng, monkeypatch):
    engine = scheduler.engine
    prompts = prompts_for(rng, engine.vocab_size, -1)
    want = run(scheduler, prompts)
    assert all(isinstance(w, list) and len(w) > 0 for w in want)
    fails_once = fails_on_call(engine._fns["decode"], 2, "injected transient fault")
    monkeypatch.setitem(engine._fns, "decode", fails_once)
    assert run(scheduler, prompts) == want
    stats = settle(scheduler)
    assert fails_once.calls > 2 and stats["failed"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["kv_pages_used"] == 0


def test_a_failing_request_gets_its_own_error_and_the_others_go_on(scheduler, rng, monkeypatch):
    engine = scheduler.engine
    poison = 777  # a token id only the second prompt holds: every step that carries it fails
    prompts = prompts_for(rng, engine.vocab_size, poison)
    want = run(scheduler, prompts)
    prompts[1] = prompts[1][:5] + [poison] + prompts[1][5:]
    for name in ("prefill", "decode", "decode1"):
        real = engine._fns[name]

        def poisoned(tokens, *rest, real=real):
            if poison in tokens.numpy():
                raise RuntimeError("injected fault on a poisoned token")
            return real(tokens, *rest)

        monkeypatch.setitem(engine._fns, name, poisoned)
    got = run(scheduler, prompts)
    assert isinstance(got[1], str) and "injected fault" in got[1]
    assert got[0] == want[0] and got[2] == want[2]
    stats = settle(scheduler)
    assert stats["failed"] == 1 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_a_request_that_cannot_start_is_answered_not_dropped(scheduler, rng, monkeypatch):
    engine = scheduler.engine
    real, calls = engine.add_sequence, []

    def add_fails_first(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault at admission")
        return real(*args)

    monkeypatch.setattr(engine, "add_sequence", add_fails_first)
    got = run(scheduler, prompts_for(rng, engine.vocab_size, -1))
    assert isinstance(got[0], str) and "injected fault at admission" in got[0]
    assert all(isinstance(g, list) and g for g in got[1:])
    assert settle(scheduler)["kv_pages_free"] == scheduler.total_pages
