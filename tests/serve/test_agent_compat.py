"""Issue 37 without a server: what real agent clients send is parsed (unknown fields dropped unless strict, tools
flattened, system turns merged), thinking models' replies are split, streams keep alive, the access log's lines."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

pytestmark = pytest.mark.unit


# ---- unknown fields: dropped and named, or refused under --strict -------------------------------------------------
def test_unknown_fields_are_dropped_and_named_unless_strict():
    from luce_runtime.serve.body import _parse
    from luce_runtime.serve.protocol import ApiError, ChatCompletionRequest

    body = {"model": "m", "frobnicate": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]}
    raw = json.dumps(body).encode()
    with pytest.raises(ApiError) as e:
        _parse(json.dumps({**body, "messages": [{"role": "user", "content": "hi"}]}).encode(), ChatCompletionRequest,
               strict=True)
    assert e.value.status == 400 and e.value.param == "frobnicate"
    with pytest.raises(ApiError):  # a nested unknown field as well
        _parse(raw, ChatCompletionRequest, strict=True)
    req = _parse(raw, ChatCompletionRequest, strict=False)
    assert req.messages[0].content[0].text == "hi" and not hasattr(req, "frobnicate")
    # a known field with a wrong type is a 400 either way
    with pytest.raises(ApiError):
        _parse(json.dumps({**body, "temperature": "hot"}).encode(), ChatCompletionRequest, strict=False)


def test_refused_parameters_stay_refused_when_lenient():
    from luce_runtime.serve.body import _parse
    from luce_runtime.serve.protocol import ApiError, ChatCompletionRequest

    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}).encode()
    with pytest.raises(ApiError) as e:
        _parse(raw, ChatCompletionRequest, strict=False)
    assert e.value.param == "logit_bias"


def test_responses_tools_flatten_namespaces_and_drop_what_cannot_run(caplog):
    from luce_runtime.serve.body import _parse
    from luce_runtime.serve.protocol import ApiError, ResponsesRequest

    fn = {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False}
    ns = {"type": "namespace", "name": "agents", "description": "multi-agent",
          "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}
    body = {"model": "m", "input": "hi", "tools": [fn, ns, {"type": "web_search", "external_web_access": False}],
            "client_metadata": {"session": "x"}, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "store": False, "prompt_cache_key": "k"}
    with caplog.at_level(logging.INFO):
        req = _parse(json.dumps(body).encode(), ResponsesRequest, strict=True)
    assert [t.name for t in req.tools] == ["shell", "spawn"]
    assert req.reasoning.summary == "auto" and req.client_metadata == {"session": "x"}
    assert "web_search" in caplog.text
    with pytest.raises(ApiError) as e:  # forcing a tool the server cannot run would change the answer
        _parse(json.dumps({**body, "tool_choice": {"type": "web_search"}}).encode(), ResponsesRequest, strict=False)
    assert e.value.status == 400 and e.value.param == "tool_choice" and "'web_search'" in e.value.message


def test_claude_code_request_shape_parses():
    """The keys Claude Code 2.1 sends on every request (notes/agents.md), strict: none of them is unknown."""
    from luce_runtime.serve.body import _parse
    from luce_runtime.serve.protocol import MessagesRequest

    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
                       {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                                      {"type": "text", "text": "Fix the bug."}]},
                         {"role": "system", "content": "Available agents: none."},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                           {"type": "text", "text": "ok"}]}],
            "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
            "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    # strict refuses only max_uses (a server tool's own field); lenient drops it
    req = _parse(json.dumps(body).encode(), MessagesRequest, strict=False)
    from luce_runtime.serve.anthropic_api import _openai_messages, _system, _thinking, _tools

    assert _system(req) == "You are Claude Code.\nAvailable agents: none."
    assert _thinking(req) is True
    assert [t.name for t in _tools(req)] == ["Bash"]
    msgs = _openai_messages(req)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "<system-reminder>r</system-reminder>\nFix the bug."
    assert msgs[2]["reasoning_content"] == "hm"


# ---- thinking models' replies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_reasoning_splits_alike_whole_and_streamed(step):
    from luce_runtime.serve.reasoning import ReasoningSplitter, split

    text = "<think>\nI think so.\n\n</think>\n\nThe answer </think> is 4."
    assert split("start", text) == ("I think so.", "The answer </think> is 4.")
    s, parts = ReasoningSplitter("start"), []
    for i in range(0, len(text), step):
        parts += s.feed(text[i:i + step])
    parts += s.finish()
    assert "".join(t for k, t in parts if k == "reasoning") == "I think so."
    assert "".join(t for k, t in parts if k == "content") == "The answer </think> is 4."


def test_reasoning_modes():
    from luce_runtime.serve.reasoning import mode, split

    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert mode("plain template", "<|im_start|>assistant\n") == "off"
    assert mode(qwen3, "<|im_start|>assistant\n") == "start"
    assert mode(qwen3, "<|im_start|>assistant\n<think>\n") == "inside"
    assert split("inside", "\nwhy\n</think>\n\nbecause") == ("why", "because")
    assert split("start", "  <thi") == ("", "  <thi")  # no block opened: all of it is the answer
    assert split("off", "<think>x</think>y") == ("", "<think>x</think>y")


# ---- keep-alive and the access log ---------------------------------------------------------------------------------
class _Req:
    def cancel(self) -> None:
        pass


def test_a_silent_stream_gets_pings_then_its_events():
    from luce_runtime.serve.events import events
    from luce_runtime.serve.scheduler import Event

    async def run() -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, queue.put_nowait, Event("delta", text="a"))
        loop.call_later(0.25, queue.put_nowait, Event("done", finish_reason="stop"))
        return [ev.kind async for ev in events(queue, [_Req()], keepalive=0.05)]

    kinds = asyncio.run(run())
    assert kinds[-2:] == ["delta", "done"] and kinds.count("ping") >= 2
    assert set(kinds[:-2]) == {"ping"}


def test_access_lines_text_and_json():
    from luce_runtime.serve.access import JsonFormatter, Record, _text

    r = Record("POST", "/v1/messages", 0.0, status=400, error='Unrecognized request argument: "x"')
    f = r.fields()
    line = _text(f)
    assert line.startswith("POST /v1/messages 400 total=") and 'error="Unrecognized request argument: \\"x\\""' in line
    r2 = Record("POST", "/v1/chat/completions", 0.0, status=200, prompt_tokens=12, completion_tokens=3)
    r2.first_token = 0.5
    assert "prompt=12 completion=3 ttft=0.50s" in _text(r2.fields())
    rec = logging.LogRecord("luce_runtime.serve.access", logging.INFO, __file__, 1, _text(f), None, None)
    rec.fields = f
    out = json.loads(JsonFormatter().format(rec))
    assert out["status"] == 400 and out["path"] == "/v1/messages" and out["error"].startswith("Unrecognized")


# ---- sampling defaults ----------------------------------------------------------------------------------------------
def test_sampling_defaults_flags_over_gguf_keys():
    from luce_runtime.errors import LuceError
    from luce_runtime.serve.app import ServeOptions, _sampling_defaults

    gguf = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "general.sampling.top_p": 0.8,
            "tokenizer.ggml.model": "gpt2"}
    got = _sampling_defaults(ServeOptions("a", temperature=0.2, min_p=0.05), gguf)
    assert got == {"temperature": 0.2, "top_p": 0.8, "top_k": 20, "min_p": 0.05}
    assert _sampling_defaults(ServeOptions("a"), {}) == {}
    with pytest.raises(LuceError, match="--temperature"):
        _sampling_defaults(ServeOptions("a", temperature=-1), {})


def test_compiled_artifacts_carry_the_gguf_sampling_keys():
    from types import SimpleNamespace

    from luce_compile.codegen.compile import _tokenizer_metadata

    gguf = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20, "tokenizer.ggml.model": "gpt2",
            "general.name": "m", "llama.block_count": 2, "general.license": "mit"}
    assert _tokenizer_metadata(SimpleNamespace(metadata=gguf)) == {
        "general.sampling.temp": 0.7, "general.sampling.top_k": 20, "tokenizer.ggml.model": "gpt2", "general.name": "m"}


def test_anthropic_keep_alive_also_resets_claude_codes_watchdog(monkeypatch):
    """Pings, and after QUIET_DELTA_S without another event a message_delta that changes nothing; the real
    message_delta still ends the message with its stop reason."""
    from luce_runtime.serve import anthropic_api
    from luce_runtime.serve.scheduler import Event
    from luce_runtime.serve.structured import OutputPlan

    monkeypatch.setattr(anthropic_api, "QUIET_DELTA_S", 0.0)

    async def evs():
        for ev in (Event("ping"), Event("ping"), Event("delta", text="Hi"),
                   Event("done", finish_reason="stop", completion_tokens=1)):
            yield ev

    async def collect() -> list[tuple[str, dict]]:
        out = []
        async for part in anthropic_api._stream(evs(), {"id": "msg_1"}, 5, OutputPlan(None)):
            name, data = part.split("\n")[:2]
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        return out

    events = asyncio.run(collect())
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names.count("ping") == 3
    deltas = [d for n, d in events if n == "message_delta"]
    assert len(deltas) == 3 and [d["delta"]["stop_reason"] for d in deltas] == [None, None, "end_turn"]
    assert names[-1] == "message_stop"


def test_access_log_has_every_request_but_answered_probes(caplog):
    from luce_runtime.serve.access import AccessLog

    async def app(scope, receive, send):
        status = 503 if scope["path"] == "/metrics" else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        pass

    async def receive():
        return {"type": "http.request"}

    middleware = AccessLog(app)
    with caplog.at_level(logging.INFO, logger="luce_runtime.serve.access"):
        for path in ("/health", "/v1/models", "/metrics"):
            asyncio.run(middleware({"type": "http", "method": "GET", "path": path}, receive, send))
    assert "GET /v1/models 200" in caplog.text and "GET /metrics 503" in caplog.text
    assert "/health" not in caplog.text


def test_openai_and_responses_keep_alives_are_events_that_change_nothing():
    """Clients time out on events (Codex's SSE parser drops comments before its idle timer sees them)."""
    from luce_runtime.serve import openai_api, responses_api
    from luce_runtime.serve.scheduler import Event
    from luce_runtime.serve.structured import OutputPlan

    async def evs():
        for ev in (Event("ping"), Event("delta", text="Hi"), Event("done", finish_reason="stop", completion_tokens=1)):
            yield ev

    async def collect(stream) -> list[dict]:
        return [json.loads(part.split("data: ", 1)[1]) async for part in stream if "data: {" in part]

    chat = asyncio.run(collect(openai_api._chat_stream(None, evs(), {"id": "c"}, 1, False, False, OutputPlan(None))))
    assert chat[1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat) == "Hi"
    base = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    events = asyncio.run(collect(responses_api._stream(evs(), base, 3, OutputPlan(None), lambda final: None, False)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in events] == list(range(len(events)))
