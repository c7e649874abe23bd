"""Anthropic routes: /v1/messages (JSON, or the SSE events message_start … message_stop) and count_tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from luce_runtime.serve.app import Service, events, new_id, parse_body, sampling, sse
from luce_runtime.serve.protocol import MAX_STOP_ANTHROPIC, ApiError, CountTokensRequest, MessagesRequest
from luce_runtime.serve.scheduler import Event

router = APIRouter()


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


async def _prompt(svc: Service, body: CountTokensRequest) -> list[int]:
    svc.check_model(body.model)
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    messages += [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    return await svc.encode_chat(messages)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    body = await parse_body(request, CountTokensRequest)
    return {"input_tokens": len(await _prompt(request.app.state.service, body))}


def _stop_reason(ev: Event) -> str:
    if ev.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if ev.finish_reason == "length" else "end_turn"


@router.post("/v1/messages")
async def messages(request: Request):
    svc: Service = request.app.state.service
    body = await parse_body(request, MessagesRequest)
    prompt = await _prompt(svc, body)
    limit = svc.check_budget(len(prompt), body.max_tokens, "max_tokens")
    params = sampling(svc, max_tokens=limit, stop=body.stop_sequences, max_stop=MAX_STOP_ANTHROPIC,
                      stop_param="stop_sequences", temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    queue, reqs = svc.submit(prompt, params)
    message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": svc.model_id}
    if body.stream:
        return StreamingResponse(_stream(events(queue, reqs), message, len(prompt)), media_type="text/event-stream")
    text, last = "", None
    async for ev in events(queue, reqs, request):
        if ev.kind == "delta":
            text += ev.text
        else:
            last = ev
    return {**message, "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(last),
            "stop_sequence": last.stop_string,
            "usage": {"input_tokens": len(prompt), "output_tokens": last.completion_tokens}}


async def _stream(evs: AsyncIterator[Event], message: dict[str, Any], prompt_len: int) -> AsyncIterator[str]:
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt_len, "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start")
    yield sse({"type": "ping"}, "ping")
    try:
        async for ev in evs:
            if ev.kind == "delta":
                if ev.text:
                    yield sse({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": ev.text}}, "content_block_delta")
                continue
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(ev),
                                                          "stop_sequence": ev.stop_string},
                       "usage": {"output_tokens": ev.completion_tokens}}, "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
    except ApiError as e:  # after the headers went out an error can only be an event
        yield sse({"type": "error", "error": {"type": "api_error", "message": e.message}}, "error")
