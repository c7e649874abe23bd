"""Issue 37 against a real server (SmolLM2 on the CPU): requests shaped as Claude Code, Codex and OpenCode send them
are answered 2xx by a default server, and every request leaves one access-log line (the reason of a 4xx in it)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.serve.conftest import ALIAS, API_KEY
from tests.serve.test_errors import post

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def stream(server, path: str, body: dict) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE message, comments as (None, the comment)."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    out, name = [], None
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                out.append((None, line))
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, line[6:]))
                name = None
    return out


def test_unknown_fields_and_model_names_are_answered(server):
    code, r = post(server, "/v1/chat/completions", {"model": "some-other-model", "frobnicate": 1, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200 and r["choices"][0]["finish_reason"] in ("length", "stop"), r
    req = urllib.request.Request(server.url + "/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        models = [m["id"] for m in json.loads(r.read())["data"]]
    assert models == [server.model, ALIAS]


def test_head_root_answers(server):  # Claude Code's first request
    req = urllib.request.Request(server.url + "/", method="HEAD", headers={"authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def test_max_tokens_past_the_context_is_clamped(server):
    prompt = [28] * 505  # 7 tokens of room in the 512-token context
    code, r = post(server, "/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 32000,
                                               "temperature": 0})
    assert code == 200, r
    assert r["usage"]["completion_tokens"] <= 7
    assert r["choices"][0]["finish_reason"] == "length" or r["usage"]["completion_tokens"] < 7


CLAUDE_CODE = {
    "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"}, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=1234;"},
               {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "system", "content": "The user is in France."},
                 {"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]}],
    "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
    "temperature": 0,
}


def test_claude_code_shaped_stream(server):
    events = stream(server, "/v1/messages?beta=true", {**CLAUDE_CODE, "model": "claude-sonnet-4-5"})
    names = [n for n, _ in events if n]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "ping" in names
    delta = json.loads(next(d for n, d in events if n == "message_delta"))
    assert delta["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")


def test_system_turns_join_the_system_prompt(server):
    base = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}]}
    joined = {**base, "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}]}
    turns = {**base, "system": "A.", "messages": [{"role": "system", "content": "B."}, *base["messages"]]}
    header = {**joined, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=9;"}, *joined["system"]]}
    plain = {**base, "system": "A.\nB."}
    counts = [post(server, "/v1/messages/count_tokens", b)[1]["input_tokens"] for b in (joined, turns, header, plain)]
    assert len(set(counts)) == 1, counts


def test_codex_shaped_responses_stream(server):
    body = {"model": "gpt-5-codex", "stream": True, "store": False, "instructions": "Answer in one word.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of "
                                                                                                      "France?"}]}],
            "client_metadata": {"x-codex-session": "s"}, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "tool_choice": "auto",
            "parallel_tool_calls": False, "max_output_tokens": 16, "temperature": 0,
            "tools": [{"type": "function", "name": "shell", "strict": False,
                       "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
                      {"type": "namespace", "name": "agents", "description": "d", "tools": [
                          {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
                      {"type": "web_search", "external_web_access": False}]}
    events = stream(server, "/v1/responses", body)
    names = [n for n, _ in events if n]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names


def test_opencode_shaped_chat_stream(server):
    body = {"model": "luce/smol", "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto",
            "max_tokens": 4096, "temperature": 0, "messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                                        "parameters": {"type": "object"}}}]}
    events = stream(server, "/v1/chat/completions", body)
    assert events[-1] == (None, "[DONE]")
    usage = json.loads(events[-2][1])["usage"]
    assert usage["prompt_tokens"] > 10


def test_access_log_has_a_line_per_request_with_4xx_reasons(server):
    code, _ = post(server, "/v1/chat/completions", {"model": server.model, "temperature": "hot",
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert code == 400
    code, _ = post(server, "/v1/chat/completions", {"model": server.model, "max_tokens": 3, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200
    time.sleep(0.2)  # the line is written as the response ends
    lines = [line for line in server.log_lines() if " POST /v1/chat/completions " in line]  # after the time
    bad = [line for line in lines if " 400 " in line and "temperature" in line and "error=" in line]
    good = [line for line in lines if " 200 " in line and "prompt=" in line and "ttft=" in line]
    assert bad and good, lines[-5:]
