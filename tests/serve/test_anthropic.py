"""The official `anthropic` client, unmodified, against a real server process (SmolLM2 on the CPU)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# The current Anthropic API has no temperature; the server still serves it, sent as an extra body field for greedy text
GREEDY = {"extra_body": {"temperature": 0}}
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


def test_messages(server, claude):
    r = claude.messages.create(model=server.model, max_tokens=24, **GREEDY, system="Answer in one sentence.",
                               messages=HELLO)
    assert r.type == "message" and r.role == "assistant" and r.model == server.model
    assert "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens < 24


def test_messages_max_tokens_and_stop_sequence(server, claude):
    full = claude.messages.create(model=server.model, max_tokens=30, **GREEDY,
                                  messages=[{"role": "user", "content": "Count from 1 to 20."}])
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 30
    text = full.content[0].text
    stop = text[12:15]
    cut = claude.messages.create(model=server.model, max_tokens=30, **GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Count from 1 to 20."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_messages_stream_events(server, claude):
    plain = claude.messages.create(model=server.model, max_tokens=16, **GREEDY, messages=HELLO)
    kinds, text = [], ""
    with claude.messages.stream(model=server.model, max_tokens=16, **GREEDY, messages=HELLO) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_count_tokens(server, claude):
    n = claude.messages.count_tokens(model=server.model, messages=HELLO).input_tokens
    with_system = claude.messages.count_tokens(model=server.model, system="Be brief.", messages=HELLO).input_tokens
    r = claude.messages.create(model=server.model, max_tokens=1, **GREEDY, messages=HELLO)
    assert n == r.usage.input_tokens > 5
    assert with_system != n
