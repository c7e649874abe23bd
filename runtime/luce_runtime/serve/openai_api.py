"""OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions (JSON, or SSE chunks ending `data: [DONE]`),
with tools (`tool_calls` in messages and streamed deltas) and response_format (grammar-constrained)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from luce_runtime.grammar import Constraint
from luce_runtime.sampler import TokenLogprobs
from luce_runtime.serve.app import Service, sampling
from luce_runtime.serve.body import parse_body
from luce_runtime.serve.events import events, new_id, sse, stream_events
from luce_runtime.serve.protocol import (
    MAX_STOP_OPENAI,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
)
from luce_runtime.serve.scheduler import Event
from luce_runtime.serve.structured import ANY_JSON, Op, OutputPlan, StreamSplitter, output_plan, split_output
from luce_runtime.tools import Tool, ToolCall, prepare_chat

router = APIRouter()


def _service(request: Request) -> Service:
    return request.app.state.service


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    svc = _service(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "luce-compile",
                                        "max_model_len": svc.max_context} for name in svc.model_ids]}


def _piece(svc: Service, token: int) -> str:
    return svc.tokenizer.token_to_piece(token, special=True).decode("utf-8", errors="replace")


def _chat_logprob(svc: Service, lp: TokenLogprobs) -> dict[str, Any]:
    def entry(tid: int, value: float) -> dict[str, Any]:
        piece = _piece(svc, tid)
        return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prepare(svc: Service, body: ChatCompletionRequest | CompletionRequest, prompt: list[int],
             max_param: str, max_tokens: int | None, top_logprobs: int | None,
             constraints: list[Constraint] | None = None):
    limit = svc.check_budget(len(prompt), max_tokens, max_param)
    params = sampling(svc, max_tokens=limit, stop=body.stop, max_stop=MAX_STOP_OPENAI, stop_param="stop",
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                      repetition_penalty=body.repetition_penalty, seed=body.seed,
                      presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    return svc.submit(prompt, params, body.n, top_logprobs, constraints or (), speculative=body.speculative)


def _response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | object | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_JSON
    if fmt.json_schema is None:
        raise ApiError(400, "response_format of type json_schema needs a json_schema object with a name and a "
                            "schema.", param="response_format.json_schema")
    return fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}


def _chat_plan(svc: Service, body: ChatCompletionRequest) -> OutputPlan:
    tools = [Tool(t.function.name, t.function.description or "",
                  t.function.parameters or {"type": "object", "properties": {}}) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = ("tool", choice.function.name)
    return output_plan(svc, tools, choice, body.parallel_tool_calls, _response_schema(body.response_format))


def _thinking(body: ChatCompletionRequest) -> bool | None:
    """A thinking model's thinking on or off, as vLLM and llama.cpp take it: chat_template_kwargs.enable_thinking,
    or reasoning_effort "none"; None: the template's default."""
    kwargs = body.chat_template_kwargs or {}
    if isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"]
    return False if body.reasoning_effort == "none" else None


# The keep-alive is a chunk that adds nothing (an empty delta), not an SSE comment: clients time out on events, and
# their SSE parsers drop comments before the timer sees them (Codex's "idle timeout waiting for SSE")


def _openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    svc = _service(request)
    body = await parse_body(request, ChatCompletionRequest)
    svc.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    plan = _chat_plan(svc, body)
    messages = [m.model_dump(exclude_none=True, by_alias=True) for m in body.messages]
    for m in messages:  # the templates know "system"; OpenAI's newer name for it is "developer"
        m["role"] = "system" if m["role"] == "developer" else m["role"]
    prompt = await svc.encode_chat(*prepare_chat(svc.tool_format, messages, plan.offered), thinking=_thinking(body),
                                   effort=body.reasoning_effort)
    plan.reasoning = svc.reasoning_mode(prompt)
    constraints = await plan.constraints(svc, body.n)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    k = (body.top_logprobs or 0) if body.logprobs else None
    queue, reqs = _prepare(svc, body, prompt, param, max_tokens, k, constraints)
    meta = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": svc.model_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _chat_stream(svc, stream_events(queue, reqs), meta, body.n, include_usage, k is not None, plan)
        return StreamingResponse(_guard(stream), media_type="text/event-stream")
    texts = [""] * body.n
    choices: list[dict[str, Any]] = [{"index": i, "message": {"role": "assistant", "content": ""},
                                      "logprobs": {"content": []} if k is not None else None,
                                      "finish_reason": None} for i in range(body.n)]
    completion = 0
    async for ev in events(queue, reqs, request):
        c = choices[ev.index]
        if ev.kind == "delta":
            texts[ev.index] += ev.text
            if ev.logprob is not None:
                c["logprobs"]["content"].append(_chat_logprob(svc, ev.logprob))
        else:
            c["finish_reason"] = ev.finish_reason
            completion += ev.completion_tokens
    for c, text in zip(choices, texts, strict=True):
        out = split_output(plan, text)
        c["message"]["content"] = out.content if out.content or not out.calls else None
        if out.reasoning:
            c["message"]["reasoning_content"] = out.reasoning  # DeepSeek's field, as vLLM and llama.cpp return it
        if out.calls:
            c["message"]["tool_calls"] = _openai_calls(out.calls)
            c["finish_reason"] = "tool_calls" if c["finish_reason"] == "stop" else c["finish_reason"]
    return {**meta, "object": "chat.completion", "choices": choices, "usage": _usage(len(prompt), completion)}


def _tool_delta(op: Op) -> dict[str, Any] | None:
    """An OpenAI tool_calls delta for a streamed Op (None: the Op adds nothing to the calls)."""
    if op.kind == "call":
        return {"index": op.call.index, "id": op.call.id, "type": "function",
                "function": {"name": op.call.name, "arguments": ""}}
    if op.kind == "args":
        return {"index": op.call.index, "function": {"arguments": op.text}}
    return None


async def _chat_stream(svc: Service, evs: AsyncIterator[Event], meta: dict[str, Any], n: int,
                       include_usage: bool, with_logprobs: bool, plan: OutputPlan) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        out = {**meta, "object": "chat.completion.chunk", "choices": choices}
        if include_usage:
            out["usage"] = usage
        return sse(out)

    def deltas(i: int, ops: list[Op], lp: dict[str, Any] | None) -> list[str]:
        out = []
        for op in ops:
            if op.kind in ("content", "reasoning"):
                field = "content" if op.kind == "content" else "reasoning_content"
                out.append(chunk([{"index": i, "delta": {field: op.text}, "logprobs": lp, "finish_reason": None}]))
                lp = None
            elif (tool := _tool_delta(op)) is not None:
                out.append(chunk([{"index": i, "delta": {"tool_calls": [tool]}, "logprobs": None,
                                   "finish_reason": None}]))
        return out

    splitters = [StreamSplitter(plan) for _ in range(n)]
    for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    prompt = completion = 0
    async for ev in evs:
        if ev.kind == "ping":
            yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}])
            continue
        s = splitters[ev.index]
        if ev.kind == "delta":
            lp = {"content": [_chat_logprob(svc, ev.logprob)]} if with_logprobs and ev.logprob else None
            for part in deltas(ev.index, s.feed(ev.text), lp):
                yield part
        else:
            for part in deltas(ev.index, s.finish(), None):
                yield part
            prompt, completion = ev.prompt_tokens, completion + ev.completion_tokens
            finish = "tool_calls" if s.calls and ev.finish_reason == "stop" else ev.finish_reason
            yield chunk([{"index": ev.index, "delta": {}, "logprobs": None, "finish_reason": finish}])
    if include_usage:
        yield chunk([], _usage(prompt, completion))
    yield "data: [DONE]\n\n"


async def _guard(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the headers went out can only be reported in the stream: an error event, then [DONE]."""
    try:
        async for part in stream:
            yield part
    except ApiError as e:
        yield sse({"error": {"message": e.message, "type": e.type, "param": None, "code": None}})
        yield "data: [DONE]\n\n"


async def _completion_prompt(svc: Service, prompt: str | list[int] | list[str]) -> list[int]:
    if prompt and not isinstance(prompt, str) and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, "A list of several prompts is not supported; send one prompt per request.",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        svc.check_chars(len(prompt), "prompt")
        return await svc.tokenize(svc.tokenizer.encode, prompt, True, True)
    if len(prompt) >= svc.max_context:  # before the per-id check below, which is O(len) on the event loop
        raise ApiError(400, f"This model's maximum context length is {svc.max_context} tokens; the prompt has "
                            f"{len(prompt)}. Shorten the prompt.", param="prompt", code="context_length_exceeded")
    if any(not 0 <= t < svc.tokenizer.vocab_size for t in prompt):
        raise ApiError(400, f"Token ids in prompt must lie in [0, {svc.tokenizer.vocab_size}).", param="prompt")
    return list(prompt)


def _completion_logprobs(svc: Service, lps: list[TokenLogprobs], offset0: int) -> dict[str, Any]:
    tokens = [_piece(svc, lp.token_id) for lp in lps]
    offsets, at = [], offset0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_piece(svc, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


@router.post("/v1/completions")
async def completions(request: Request):
    svc = _service(request)
    body = await parse_body(request, CompletionRequest)
    svc.check_model(body.model)
    prompt = await _completion_prompt(svc, body.prompt)
    queue, reqs = _prepare(svc, body, prompt, "max_tokens", body.max_tokens, body.logprobs)
    meta = {"id": new_id("cmpl-"), "created": int(time.time()), "model": svc.model_id}
    with_lp = body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_guard(_completion_stream(svc, stream_events(queue, reqs), meta, include_usage,
                                                           with_lp)),
                                 media_type="text/event-stream")
    texts, lps = [""] * body.n, [[] for _ in range(body.n)]
    finish: list[str | None] = [None] * body.n
    completion = 0
    async for ev in events(queue, reqs, request):
        if ev.kind == "delta":
            texts[ev.index] += ev.text
            if ev.logprob is not None:
                lps[ev.index].append(ev.logprob)
        else:
            finish[ev.index] = ev.finish_reason
            completion += ev.completion_tokens
    choices = [{"index": i, "text": texts[i], "finish_reason": finish[i],
                "logprobs": _completion_logprobs(svc, lps[i], 0) if with_lp else None} for i in range(body.n)]
    return {**meta, "object": "text_completion", "choices": choices, "usage": _usage(len(prompt), completion)}


async def _completion_stream(svc: Service, evs: AsyncIterator[Event], meta: dict[str, Any], include_usage: bool,
                             with_lp: bool) -> AsyncIterator[str]:
    chunk: Callable[..., dict[str, Any]] = lambda choices, usage=None: {  # noqa: E731
        **meta, "object": "text_completion", "choices": choices, **({"usage": usage} if include_usage else {})}
    prompt = completion = 0
    offsets: dict[int, int] = {}
    async for ev in evs:
        if ev.kind == "ping":  # a chunk that adds nothing (see _chat_stream's)
            yield sse(chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]))
        elif ev.kind == "delta":
            lp = _completion_logprobs(svc, [ev.logprob], offsets.get(ev.index, 0)) if with_lp and ev.logprob else None
            offsets[ev.index] = offsets.get(ev.index, 0) + len(ev.text)
            yield sse(chunk([{"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": None}]))
        else:
            prompt, completion = ev.prompt_tokens, completion + ev.completion_tokens
            yield sse(chunk([{"index": ev.index, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}]))
    if include_usage:
        yield sse(chunk([], {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}))
    yield "data: [DONE]\n\n"
