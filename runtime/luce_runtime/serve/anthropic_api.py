"""Anthropic routes: /v1/messages (JSON, or the SSE events message_start … message_stop) and count_tokens, with
tools: `tool_use` / `tool_result` content blocks, and `input_json_delta` events while a call's input streams; a
thinking model's reasoning as `thinking` blocks when the request turns thinking on (gpt-oss always reasons: its
analysis channel is always a thinking block, and `thinking` or output_config.effort set its Reasoning level).

What Claude Code sends is taken as it comes: `role: "system"` turns join the system prompt, server tools (web
search, ...) are dropped, `thinking`, `output_config` (its `format` is held by the grammar) and
`context_management` are accepted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from luce_runtime.serve.app import Service, sampling
from luce_runtime.serve.body import parse_body
from luce_runtime.serve.events import collect, new_id, sse, stream_events
from luce_runtime.serve.protocol import (
    MAX_STOP_ANTHROPIC,
    AnthropicText,
    AnthropicThinking,
    AnthropicToolResult,
    AnthropicToolUse,
    ApiError,
    CountTokensRequest,
    MessagesRequest,
)
from luce_runtime.serve.scheduler import Event
from luce_runtime.serve.structured import Op, OutputPlan, StreamSplitter, output_plan, split_output
from luce_runtime.tools import Tool, prepare_chat

log = logging.getLogger(__name__)
router = APIRouter()
# Claude Code 2.1 drops a stream that sent no event but pings for 300 s (CLAUDE_STREAM_IDLE_TIMEOUT_MS; its loop skips
# pings before resetting its watchdog) and sends the request again: while a long prompt prefills, every this many
# seconds the keep-alive is also a message_delta that changes nothing (stop_reason still null). The API allows
# several message_delta events; the SDKs' accumulators take it as a usage update.
QUIET_DELTA_S = 60.0
# Claude Code's first system block: a per-request hash ("x-anthropic-billing-header: cc_version=...; cch=...;"). At
# the prompt's very start it would make every request's prompt new to the prefix cache; it tells the model nothing.
BILLING_HEADER = "x-anthropic-billing-header:"


def _text(content: str | list[Any]) -> str:
    """A content's text blocks, one per line (as llama.cpp's server joins text parts)."""
    return content if isinstance(content, str) else "\n".join(b.text for b in content if isinstance(b, AnthropicText))


def _system(body: CountTokensRequest) -> str:
    """The system prompt: `system` and then every `role: "system"` turn, in order, one block a line; the billing
    header block left out."""
    blocks = [body.system] if isinstance(body.system, str) else [b.text for b in body.system or []]
    blocks += [_text(m.content) for m in body.messages if m.role == "system"]
    return "\n".join(b for b in blocks if b and not b.startswith(BILLING_HEADER))


def _openai_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic turns as the OpenAI-shaped messages the chat templates and prepare_chat take: tool_use blocks
    become an assistant turn's tool_calls, each tool_result block a `tool` message (before the turn's text), thinking
    blocks its reasoning_content (the templates of thinking models read it)."""
    system = _system(body)
    out = [{"role": "system", "content": system}] if system else []
    for m in body.messages:
        if m.role == "system":
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        for b in m.content:
            if isinstance(b, AnthropicToolResult):
                result = b.content if isinstance(b.content, str) else _text(b.content or [])
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": ("Error: " if b.is_error else "") + result})
        text = _text(m.content)
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in m.content if isinstance(b, AnthropicToolUse)]
        thought = "\n".join(b.thinking for b in m.content if isinstance(b, AnthropicThinking))
        turn = {"reasoning_content": thought} if thought else {}
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls, **turn})
        elif text or not any(isinstance(b, AnthropicToolResult) for b in m.content):
            out.append({"role": m.role, "content": text, **turn})
    return out


def _tools(body: CountTokensRequest) -> list[Tool]:
    """The client tools; server tools (web_search_20250305, code_execution, ...) are dropped with a log line: the
    model is not offered them, and a tool_choice that names one is refused."""
    out = []
    for i, t in enumerate(body.tools or []):
        if t.type not in (None, "custom"):
            log.info("messages: dropped the server tool %r of type %r: this server runs client tools only", t.name,
                     t.type)
            if body.tool_choice is not None and body.tool_choice.name == t.name:
                raise ApiError(400, f"tool_choice names {t.name!r}, a server tool of type {t.type!r}, which this "
                                    "server cannot run.", param="tool_choice.name")
            continue
        if t.input_schema is None:
            raise ApiError(400, f"tools.{i}.input_schema is required for a custom tool.", param=f"tools.{i}")
        out.append(Tool(t.name, t.description or "", t.input_schema))
    return out


def _plan(svc: Service, body: CountTokensRequest) -> OutputPlan:
    tools = _tools(body)
    tc = body.tool_choice
    choice: Any = None
    parallel = not (tc and tc.disable_parallel_tool_use)
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise ApiError(400, "tool_choice of type 'tool' needs the tool's name.", param="tool_choice.name")
            choice = ("tool", tc.name)
        else:
            choice = {"any": "required"}.get(tc.type, tc.type)
    fmt = body.output_config.format if body.output_config else None
    return output_plan(svc, tools, choice, parallel, None if fmt is None else fmt.schema_,
                       format_param="output_config.format")


def _thinking(body: CountTokensRequest) -> bool:
    """Anthropic's default is no thinking; "enabled" and "adaptive" (Claude Code's) turn it on."""
    return body.thinking is not None and body.thinking.type != "disabled"


# thinking budgets onto effort levels (a harmony model's Reasoning line): below 4K tokens low, below 16K medium
_BUDGET_EFFORT = ((4096, "low"), (16384, "medium"))


def _effort(body: CountTokensRequest) -> str | None:
    """How hard a model that always reasons (harmony) should: output_config.effort when given, else from
    `thinking`: off (Anthropic's default) is the least, a budget by its size, adaptive the model's default."""
    if body.output_config and body.output_config.effort:
        return body.output_config.effort
    if not _thinking(body):
        return "low"
    budget = body.thinking.budget_tokens
    if body.thinking.type == "adaptive" or budget is None:
        return None
    return next((level for limit, level in _BUDGET_EFFORT if budget < limit), "high")


async def _prompt(svc: Service, body: CountTokensRequest, plan: OutputPlan) -> list[int]:
    svc.check_model(body.model)
    prompt = await svc.encode_chat(*prepare_chat(svc.tool_format, _openai_messages(body), plan.offered),
                                   thinking=_thinking(body), effort=_effort(body))
    plan.reasoning = svc.reasoning_mode(prompt)
    return prompt


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    body = await parse_body(request, CountTokensRequest)
    svc = request.app.state.service
    return {"input_tokens": len(await _prompt(svc, body, _plan(svc, body)))}


def _stop_reason(ev: Event, called: bool) -> str:
    if ev.stop_string is not None:
        return "stop_sequence"
    if ev.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if called else "end_turn"


@router.post("/v1/messages")
async def messages(request: Request):
    svc: Service = request.app.state.service
    body = await parse_body(request, MessagesRequest)
    plan = _plan(svc, body)
    prompt = await _prompt(svc, body, plan)
    limit = svc.check_budget(len(prompt), body.max_tokens, "max_tokens")
    params = sampling(svc, max_tokens=limit, stop=body.stop_sequences, max_stop=MAX_STOP_ANTHROPIC,
                      stop_param="stop_sequences", temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k)
    queue, reqs = svc.submit(prompt, params, constraints=await plan.constraints(svc, 1),
                             speculative=body.speculative)
    message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": svc.model_id}
    if body.stream:
        return StreamingResponse(_stream(stream_events(queue, reqs), message, len(prompt), plan),
                                 media_type="text/event-stream")
    text, last = await collect(queue, reqs, request)
    out = split_output(plan, text)
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": out.reasoning, "signature": ""}] \
        if out.reasoning else []
    content += [{"type": "text", "text": out.content}] if out.content or not out.calls else []
    content += [{"type": "tool_use", "id": c.id.replace("call_", "toolu_"), "name": c.name,
                 "input": json.loads(c.arguments)} for c in out.calls]
    return {**message, "content": content, "stop_reason": _stop_reason(last, bool(out.calls)),
            "stop_sequence": last.stop_string,
            "usage": {"input_tokens": len(prompt), "output_tokens": last.completion_tokens}}


class _Blocks:
    """Anthropic's content blocks over a stream of Ops: a thinking block opens on the first reasoning, a text block
    on the first text, a tool_use block on a call's start (closing whatever block was open), with increasing
    indices."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # the open block: "thinking" | "text" | "tool_use" | None

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index, self.open = self.index + 1, kind
        return out + [sse({"type": "content_block_start", "index": self.index, "content_block": block},
                          "content_block_start")]

    def ops(self, ops: list[Op]) -> list[str]:
        out: list[str] = []
        for op in ops:
            if op.kind == "reasoning" and op.text:
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(sse({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "thinking_delta", "thinking": op.text}}, "content_block_delta"))
            elif op.kind == "content" and op.text:
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(sse({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "text_delta", "text": op.text}}, "content_block_delta"))
            elif op.kind == "call":
                out += self._start("tool_use", {"type": "tool_use", "id": op.call.id.replace("call_", "toolu_"),
                                                "name": op.call.name, "input": {}})
            elif op.kind == "args":
                out.append(sse({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "input_json_delta", "partial_json": op.text}},
                               "content_block_delta"))
            elif op.kind in ("done", "broken"):
                out += self._close()
        return out

    def end(self) -> list[str]:
        # every message has at least one block: an empty reply is one empty text block
        out = self._start("text", {"type": "text", "text": ""}) if self.index < 0 else []
        return out + self._close()


async def _stream(evs: AsyncIterator[Event], message: dict[str, Any], prompt_len: int,
                  plan: OutputPlan) -> AsyncIterator[str]:
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt_len, "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "ping"}, "ping")
    splitter, blocks = StreamSplitter(plan), _Blocks()
    spoke = time.monotonic()  # the last event other than a ping
    try:
        async for ev in evs:
            if ev.kind == "ping":  # Anthropic's keep-alive event
                yield sse({"type": "ping"}, "ping")
                if time.monotonic() - spoke >= QUIET_DELTA_S:
                    spoke = time.monotonic()
                    yield sse({"type": "message_delta", "delta": {"stop_reason": None, "stop_sequence": None},
                               "usage": {"output_tokens": 0}}, "message_delta")
                continue
            spoke = time.monotonic()
            if ev.kind == "delta":
                for part in blocks.ops(splitter.feed(ev.text)):
                    yield part
                continue
            for part in blocks.ops(splitter.finish()):
                yield part
            for part in blocks.end():
                yield part
            yield sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(ev, bool(splitter.calls)),
                                                          "stop_sequence": ev.stop_string},
                       "usage": {"output_tokens": ev.completion_tokens}}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
    except ApiError as e:  # after the headers went out an error can only be an event
        yield sse({"type": "error", "error": {"type": "api_error", "message": e.message}}, "error")
