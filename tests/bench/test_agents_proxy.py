"""benchmarks/agents/proxy.py's summaries of what agent clients sent and got (no client, no server)."""

from __future__ import annotations

import json

import pytest

from tests.bench._load import load_benchmark_module

pytestmark = pytest.mark.unit


def test_request_summary_keeps_shapes_not_text():
    proxy = load_benchmark_module("agents/proxy")
    body = {"model": "m", "stream": True, "max_tokens": 32000, "system": "secret prompt",
            "messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
            "tools": [{"name": "Bash", "input_schema": {}}, {"type": "web_search_20250305", "name": "w"}]}
    got = proxy.request_summary(json.dumps(body).encode())
    assert got["keys"] == sorted(body) and got["max_tokens"] == 32000
    assert got["tools"] == {"custom": 1, "web_search_20250305": 1} and got["roles"] == {"user": 1, "system": 1}
    assert "secret prompt" not in json.dumps(got)


@pytest.mark.parametrize("text, calls, usage", [
    # Anthropic: a tool_use block, usage in message_start
    ('event: message_start\ndata: {"type": "message_start", "message": {"usage": {"input_tokens": 9}}}\n\n'
     ': keep-alive\n\nevent: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
     '"content_block": {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}}\n\n'
     'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 4}}\n\n', 1,
     {"prompt_tokens": 9, "completion_tokens": 4}),
    # Responses: a function_call item, usage in response.completed
    ('event: response.output_item.added\ndata: {"type": "response.output_item.added", "item": {"type": '
     '"function_call"}}\n\nevent: response.completed\ndata: {"type": "response.completed", "response": {"usage": '
     '{"input_tokens": 7, "output_tokens": 3}}}\n\n', 1, {"prompt_tokens": 7, "completion_tokens": 3}),
    # chat: two tool_calls deltas with ids, usage in the last chunk
    ('data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "a"}]}}]}\n\n'
     'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}\n\n'
     'data: {"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "b"}]}}]}\n\n'
     'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\ndata: [DONE]\n\n', 2,
     {"prompt_tokens": 5, "completion_tokens": 2}),
    # a JSON answer
    ('{"content": [{"type": "text"}, {"type": "tool_use"}], "usage": {"input_tokens": 4, "output_tokens": 1}}', 1,
     {"prompt_tokens": 4, "completion_tokens": 1}),
])
def test_response_summary_counts_calls_and_usage(text, calls, usage):
    proxy = load_benchmark_module("agents/proxy")
    got = proxy.response_summary(text)
    assert got["tool_calls"] == calls and got["usage"] == usage
