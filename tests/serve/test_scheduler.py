"""The scheduler in-process on SmolLM2's CPU artifact: chunked prefill interleaved with running decodes, and
prompt-prefix reuse by forked KV sequences, each checked against the same request run alone."""

from __future__ import annotations

import asyncio

import pytest

# the runtime is imported inside the tests: smol_artifact compiles first, and the compiler needs TVM's full library
# (importing the engine first would load only TVM's runtime library in this process)

pytestmark = pytest.mark.slow

CHUNK = 16  # small prefill chunks so a ~100-token prompt takes several steps


@pytest.fixture(scope="module")
def make_scheduler(smol_artifact):
    """Schedulers over fresh engines on the artifact (prefix_cache: cached prompts), stopped after the module."""
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.serve.scheduler import Scheduler

    made = []

    def make(prefix_cache: int):
        engine = Engine(smol_artifact, EngineOptions(max_batch=4 + prefix_cache, max_context=256,
                                                     prefill_chunk=CHUNK))
        made.append(Scheduler(engine, max_batch=4, prefix_cache=prefix_cache))
        made[-1].start()
        return made[-1]

    yield make
    for s in made:
        s.stop()


async def _generate(s, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from luce_runtime.sampler import SamplingParams
    from luce_runtime.serve.scheduler import GenRequest

    loop, outs = asyncio.get_running_loop(), []
    queues = []
    for p in prompts:
        q: asyncio.Queue = asyncio.Queue()
        s.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=max_tokens), q, loop))
        queues.append(q)
    for q in queues:
        tokens = []
        while (ev := await asyncio.wait_for(q.get(), 120)).kind == "delta":
            tokens.append(ev.token)
        assert ev.kind == "done" and ev.completion_tokens == len(tokens)
        outs.append(tokens)
    return outs


def run(s, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return asyncio.run(_generate(s, prompts, max_tokens))


def test_chunked_prefill_does_not_stall_a_running_stream(make_scheduler):
    scheduler = make_scheduler(prefix_cache=0)  # a cached prompt would skip the chunks this test counts
    tok = scheduler.engine.tokenizer
    short = tok.encode("The capital of France is")
    long = tok.encode("Here is a long list of animals: " + ", ".join(["cat", "dog", "horse", "cow"] * 25) + ".")
    assert len(long) > 6 * CHUNK
    alone = run(scheduler, [short], 24) + run(scheduler, [long], 8)
    before = dict(scheduler.stats())
    together = run(scheduler, [short, long], 24)
    after = scheduler.stats()
    assert together[0] == alone[0] and together[1][:8] == alone[1]
    # the long prompt went in ≥ 6 chunks while the short one decoded: steps with both a chunk and a decode
    assert after["prefill_calls"] - before["prefill_calls"] >= 6
    assert after["batched_steps"] > before["batched_steps"]
    assert after["kv_pages_used"] == 0  # the pool's own count (no prefix cache here)


def test_prefix_reuse_forks_the_shared_system_prompt(make_scheduler):
    scheduler = make_scheduler(prefix_cache=2)
    tok = scheduler.engine.tokenizer
    system = tok.encode("You are a terse assistant. Answer every question with one short sentence and nothing "
                        "more, no greetings, no lists. ")
    q1 = system + tok.encode("Question: what is water made of? Answer:", add_special=False)
    q2 = system + tok.encode("Question: what colour is the sky? Answer:", add_special=False)
    before = dict(scheduler.stats())
    first = run(scheduler, [q1], 10)
    second = run(scheduler, [q2], 10)
    after = scheduler.stats()
    assert after["prefix_hits"] - before["prefix_hits"] >= 1
    assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] >= len(system) - 2
    # the same prompts on a scheduler without a prefix cache give the same tokens
    plain = make_scheduler(prefix_cache=0)
    assert run(plain, [q1], 10) == first and run(plain, [q2], 10) == second
    assert plain.stats()["prefix_hits"] == 0
    assert 0 < scheduler.stats()["kv_pages_used"] <= scheduler.stats()["kv_prefix_pages"]  # the cached prompts
    assert plain.stats()["kv_pages_used"] == 0


def test_a_prompt_cancelled_mid_prefill_is_resumed_by_the_same_request_again(make_scheduler):
    """Agents drop a connection after minutes without a token and send the request again: what was prefilled is
    cached as a prefix, so the retry starts where the first one stopped (and answers as a plain run)."""
    import time

    from luce_runtime.sampler import SamplingParams
    from luce_runtime.serve.scheduler import GenRequest

    scheduler = make_scheduler(prefix_cache=2)
    tok = scheduler.engine.tokenizer
    prompt = tok.encode("Here is a long list of animals: " + ", ".join(["cat", "dog", "horse", "cow"] * 25) + ".")
    assert 10 * CHUNK < len(prompt) < 240

    async def cancel_mid_prefill() -> int:
        q: asyncio.Queue = asyncio.Queue()
        r = GenRequest(prompt, SamplingParams(temperature=0, max_tokens=4), q, asyncio.get_running_loop())
        scheduler.submit(r)
        deadline = time.monotonic() + 60
        while r.pos < 3 * CHUNK and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        r.cancel()
        while (ev := await asyncio.wait_for(q.get(), 60)).kind == "delta":
            pass
        return ev.prompt_tokens if ev.finish_reason else -1

    before = dict(scheduler.stats())
    assert asyncio.run(cancel_mid_prefill()) == -1  # cancelled, not finished
    again = run(scheduler, [prompt], 4)
    after = scheduler.stats()
    assert after["prefix_hits"] - before["prefix_hits"] == 1
    assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] >= 3 * CHUNK
    assert again == run(make_scheduler(prefix_cache=0), [prompt], 4)


@pytest.fixture(scope="module")
def smol_int8(smollm2_path, tmp_path_factory):
    """SmolLM2 with 8-bit activations (what `auto` picks on this CPU): near ties there turn on ~1e-7 differences."""
    from luce_compile.codegen.compile import compile_model

    return compile_model(smollm2_path, "cpu", tmp_path_factory.mktemp("int8") / "smol.cpu", precision="int8")


def test_greedy_requests_give_the_same_tokens_alone_and_beside_seven_others(smol_int8):
    """Issue 37.5 (serve --deterministic): 8 concurrent greedy requests, with prompts of several chunks that share
    a system prompt, each against itself run alone on a fresh scheduler. Without deterministic, 4 of the 8 differed
    here (forks of the cached system prompt, chunks cut by the step's budget)."""
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.serve.scheduler import Scheduler

    def scheduler():
        engine = Engine(smol_int8, EngineOptions(max_batch=12, max_context=256, prefill_chunk=CHUNK,
                                                 batch_invariant=True))
        # the last 4 start beside running ones, where they could fork the first ones' cached prompts
        s = Scheduler(engine, max_batch=4, prefix_cache=4, deterministic=True)
        s.start()
        return s

    from luce_runtime.chat import encode_chat

    tok = Engine(smol_int8, EngineOptions(max_batch=1, max_context=64)).tokenizer
    system = {"role": "system", "content": "You are a careful assistant. Answer in two sentences, without lists."}
    question = ("Tell me about {}: its history, how it changed over the centuries, what people think of it today, "
                "and why so many like it.")
    prompts = [encode_chat(tok, [system, {"role": "user", "content": question.format(topic)}])
               for topic in ("the sea", "cats", "winter", "the moon", "bread", "trains", "music", "forests")]
    assert all(len(p) > 2 * CHUNK for p in prompts)
    together_s = scheduler()
    try:
        together = run(together_s, prompts, 24)
        stats = together_s.stats()
        assert stats["max_batch_seen"] >= 4 and stats["batched_steps"] > 0
    finally:
        together_s.stop()
    for p, got in zip(prompts, together, strict=True):
        alone_s = scheduler()
        try:
            assert run(alone_s, [p], 24) == [got]
        finally:
            alone_s.stop()
