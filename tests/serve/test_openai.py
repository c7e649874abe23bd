"""The official `openai` client, unmodified, against a real server process (SmolLM2 on the CPU)."""

from __future__ import annotations

import pytest

from tests.serve.conftest import ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 20."}]


def test_models_and_health(server, oai):
    ids = [m.id for m in oai.models.list()]
    assert ids == [server.model, ALIAS]  # the model's own id, then the server's --alias
    assert oai.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=1).model == server.model
    health = server.get("/health")
    assert health["status"] == "ok" and health["scheduler"]["kv_pages_total"] > 0


def test_chat_greedy(server, oai):
    r = oai.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(server, oai):
    plain = oai.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12, temperature=0,
                                        max_completion_tokens=12)
    stream = oai.chat.completions.create(model=server.model, messages=QUESTION, max_completion_tokens=12,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_length_and_stop(server, oai):
    long = oai.chat.completions.create(model=server.model, messages=COUNT,
                                       max_tokens=40, temperature=0)
    text = long.choices[0].message.content
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 40
    stop = text[len(text) // 2:][:3].strip() or text[5:8]
    cut = oai.chat.completions.create(model=server.model, messages=COUNT,
                                      max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]


def test_n_and_seed(server, oai):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
              temperature=1.0, seed=7)
    a = oai.chat.completions.create(n=3, **kw)
    b = oai.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded: replayable
    assert len({c.message.content for c in a.choices}) > 1  # choice i is seeded seed + i


def test_chat_logprobs(server, oai):
    r = oai.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=6, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy picks the most probable token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob


def test_completions(server, oai):
    r = oai.completions.create(model=server.model, prompt="The capital of France is", max_tokens=4, temperature=0,
                               logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(" Paris")
    assert c.logprobs.tokens[0] == " Paris" and len(c.logprobs.top_logprobs[0]) == 2
    assert c.logprobs.text_offset[0] == 0 and r.usage.completion_tokens == 4 and c.finish_reason == "length"
    stream = oai.completions.create(model=server.model, prompt="The capital of France is", max_tokens=4,
                                    temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text


def test_metrics(server, oai):
    oai.completions.create(model=server.model, prompt="Hello", max_tokens=2, temperature=0)
    text = server.get("/metrics")
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    for name in ("luce_requests_total", "luce_generation_tokens_total", "luce_running_sequences",
                 "luce_waiting_sequences", "luce_kv_pages_used", "luce_time_to_first_token_seconds_count"):
        assert name in values
    assert values["luce_requests_total"] >= 1 and values["luce_generation_tokens_total"] >= 2
    assert values["luce_time_to_first_token_seconds_count"] >= 1
