"""OpenAI Responses API: POST /v1/responses (JSON, or its typed stream events), as the `openai` SDK's
`client.responses` sends and reads it: input items (messages, function_call, function_call_output), instructions,
function tools, tool_choice, text.format (json_object / json_schema, grammar-constrained), streaming events. A
thinking model's reasoning comes back as a `reasoning` item: its summary when the request asks for one
(`reasoning.summary`, as Codex does), else its `reasoning_text` content; reasoning items sent back go with their
turn as its reasoning_content, which the template shows or drops (gpt-oss's keeps a tool loop's).
Tools of types the server cannot run are dropped and `namespace` tools flattened (protocol.runnable_tools).

Responses are stored unless the request says `store: false` (OpenAI's default), in memory and for this server's
life only, the newest STORED_RESPONSES of them: `previous_response_id` continues one (its conversation, its
output included, goes before the new input; its instructions do not carry over, as OpenAI documents), GET
/v1/responses/{id} returns one and DELETE forgets it. A client may as well send the whole conversation as input
items, as the SDK's tool loop does with `input += response.output`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from luce_runtime.serve.app import Service, sampling
from luce_runtime.serve.body import parse_body
from luce_runtime.serve.events import collect, new_id, sse, stream_events
from luce_runtime.serve.protocol import ApiError, ResponsesFormat, ResponsesRequest
from luce_runtime.serve.scheduler import Event
from luce_runtime.serve.structured import ANY_JSON, Op, OutputPlan, StreamSplitter, output_plan, split_output
from luce_runtime.tools import Tool, ToolCall, prepare_chat

router = APIRouter()
_TEXT_PARTS = ("input_text", "output_text", "text")
STORED_RESPONSES = 1024  # the newest responses kept for previous_response_id and GET (each is its conversation)


class ResponseStore:
    """id → (the response, its conversation as chat messages with its output appended), the newest kept."""

    def __init__(self, limit: int = STORED_RESPONSES):
        self.limit = limit
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if response_id not in self._items:
            raise ApiError(404, f"Response with id '{response_id}' not found: this server keeps the newest "
                                f"{self.limit} responses stored (store true) in memory, for its life only; send the "
                                "conversation as input items instead.", param=param, code="not_found")
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses  # made with the app (serve/app.create_app)


def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}] of type {kind!r} is not supported: this server takes text "
                                f"parts ({', '.join(_TEXT_PARTS)}).", param=f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def _item_message(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}.",
                           param=f"{where}.role")
        text = _part_text(item.get("content", ""), where)
        if role == "assistant" and out and _reasoning_only(out[-1]):  # the answer after its reasoning: one turn
            out[-1]["content"] = text
            return
        out.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise ApiError(400, f"{where}: a function_call item needs call_id, name and arguments (strings).",
                           param=where)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:  # parallel calls: one turn
            out[-1]["tool_calls"].append(call)
        elif out and out[-1]["role"] == "assistant":  # the text the model wrote before its calls
            out[-1]["tool_calls"] = [call]
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":  # its turn's reasoning_content; the template decides what to show (gpt-oss keeps a
        # tool loop's, chat.py's templates drop answered turns'); a turn of reasoning alone is dropped (_messages)
        parts = item.get("content") or item.get("summary") or []
        text = "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        if text:
            out.append({"role": "assistant", "content": None, "reasoning_content": text})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"{where}: a function_call_output item needs its call_id.", param=where)
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _part_text(item.get("output", ""),
                                                                                            where)})
    else:
        raise ApiError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                            "function_call_output and reasoning are).", param=where)


def _messages(body: ResponsesRequest, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request: its instructions, then `before` (a previous response's conversation), then
    its input."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    out += [dict(m) for m in before]
    start = len(out)
    if isinstance(body.input, str):
        return [m for m in out if not _reasoning_only(m)] + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        _item_message(item, f"input[{i}]", out)
    if len(out) == start:
        raise ApiError(400, "input is empty; give a string or at least one item.", param="input")
    return [m for m in out if not _reasoning_only(m)]


def _reasoning_only(message: dict[str, Any]) -> bool:
    """An assistant turn that has reasoning and nothing else (yet): a reasoning item not followed by its output."""
    return message["role"] == "assistant" and "reasoning_content" in message and message.get("content") is None \
        and not message.get("tool_calls")


def _conversation(messages: list[dict[str, Any]], instructions: str | None,
                  output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a later previous_response_id continues: the messages without this request's instructions, then the
    output items as the assistant's turn."""
    out = messages[1:] if instructions else list(messages)
    for i, item in enumerate(output):
        _item_message(item, f"output[{i}]", out)
    return out


def _schema(fmt: ResponsesFormat | None) -> dict[str, Any] | object | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_JSON
    return fmt.schema_ if fmt.schema_ is not None else {}


def _plan(svc: Service, body: ResponsesRequest) -> OutputPlan:
    tools = [Tool(t.name, t.description or "", t.parameters or {"type": "object", "properties": {}})
             for t in body.tools or []]
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = ("tool", choice.name)
    fmt = body.text.format if body.text else None
    return output_plan(svc, tools, choice, body.parallel_tool_calls, _schema(fmt), format_param="text.format")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def _reasoning_item(item_id: str, text: str, summary: bool) -> dict[str, Any]:
    part = [{"type": "summary_text" if summary else "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": part if summary else [], "content": [] if summary else part}


def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": call.id.replace("call_", "fc_"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def _finished(base: dict[str, Any], output: list[dict[str, Any]], last: Event, prompt_len: int) -> dict[str, Any]:
    incomplete = last.finish_reason == "length"
    usage = {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt_len + last.completion_tokens}
    return {**base, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}


@router.post("/v1/responses")
async def responses(request: Request):
    svc: Service = request.app.state.service
    body = await parse_body(request, ResponsesRequest)
    svc.check_model(body.model)
    plan = _plan(svc, body)
    store = _store(request)
    before = [] if body.previous_response_id is None else store.get(body.previous_response_id,
                                                                     "previous_response_id")[1]
    messages = _messages(body, before)
    effort = body.reasoning.effort if body.reasoning else None
    prompt = await svc.encode_chat(*prepare_chat(svc.tool_format, messages, plan.offered), param="input",
                                   thinking=False if effort == "none" else None, effort=effort)
    plan.reasoning = svc.reasoning_mode(prompt)
    summary = bool(body.reasoning and (body.reasoning.summary or body.reasoning.generate_summary))
    limit = svc.check_budget(len(prompt), body.max_output_tokens, "max_output_tokens")
    params = sampling(svc, max_tokens=limit, stop=None, max_stop=0, stop_param="stop",
                      temperature=body.temperature, top_p=body.top_p)
    queue, reqs = svc.submit(prompt, params, constraints=await plan.constraints(svc, 1),
                             speculative=body.speculative)
    base = {"id": new_id("resp_"), "object": "response", "created_at": int(time.time()), "model": svc.model_id,
            "instructions": body.instructions, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": body.parallel_tool_calls, "temperature": params.temperature,
            "top_p": params.top_p, "reasoning": {"effort": effort, "summary": body.reasoning.summary
                                                 if body.reasoning else None},
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "store": body.store is not False, "previous_response_id": body.previous_response_id,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"})},
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None, "usage": None}

    def keep(final: dict[str, Any]) -> None:
        if base["store"]:
            store.put(final, _conversation(messages, body.instructions, final["output"]))

    if body.stream:
        return StreamingResponse(_stream(stream_events(queue, reqs), base, len(prompt), plan, keep, summary),
                                 media_type="text/event-stream")
    text, last = await collect(queue, reqs, request)
    out = split_output(plan, text)
    output = [_reasoning_item(new_id("rs_"), out.reasoning, summary)] if out.reasoning else []
    output += [_message_item(new_id("msg_"), out.content, "completed")] if out.content or not out.calls else []
    output += [_call_item(c, "completed") for c in out.calls]
    final = _finished(base, output, last, len(prompt))
    keep(final)
    return final


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return _store(request).get(response_id)[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class _Items:
    """The Responses stream's events over Ops: an output item (a message or a function call) opens, its content
    streams, it closes with its final form; every event carries the next sequence number."""

    def __init__(self, summary: bool = False) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.msg_id: str | None = None  # the open message item
        self.text = ""
        self.summary = summary  # reasoning streams as a summary (else as reasoning_text)
        self.rs_id: str | None = None  # the open reasoning item
        self.thought = ""

    def _reasoning(self, text: str) -> list[str]:
        i, out = len(self.output), []
        where = {"summary_index": 0} if self.summary else {"content_index": 0}
        kind = "response.reasoning_summary_text" if self.summary else "response.reasoning_text"
        if self.rs_id is None:
            self.rs_id = new_id("rs_")
            out.append(self.event("response.output_item.added", output_index=i,
                                  item=_reasoning_item(self.rs_id, "", self.summary)))
            if self.summary:
                out.append(self.event("response.reasoning_summary_part.added", item_id=self.rs_id, output_index=i,
                                      summary_index=0, part={"type": "summary_text", "text": ""}))
        self.thought += text
        return out + [self.event(f"{kind}.delta", item_id=self.rs_id, output_index=i, **where, delta=text)]

    def _close_reasoning(self) -> list[str]:
        if self.rs_id is None:
            return []
        i, rid, item = len(self.output), self.rs_id, _reasoning_item(self.rs_id, self.thought, self.summary)
        out = []
        if self.summary:
            out += [self.event("response.reasoning_summary_text.done", item_id=rid, output_index=i, summary_index=0,
                               text=self.thought),
                    self.event("response.reasoning_summary_part.done", item_id=rid, output_index=i,
                               summary_index=0, part={"type": "summary_text", "text": self.thought})]
        else:
            out.append(self.event("response.reasoning_text.done", item_id=rid, output_index=i, content_index=0,
                                  text=self.thought))
        self.output.append(item)
        self.rs_id, self.thought = None, ""
        return out + [self.event("response.output_item.done", output_index=i, item=item)]

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def _close_message(self) -> list[str]:
        if self.msg_id is None:
            return []
        i, mid, part = len(self.output), self.msg_id, {"type": "output_text", "text": self.text, "annotations": [],
                                                       "logprobs": []}
        item = _message_item(mid, self.text, "completed")
        self.output.append(item)
        self.msg_id, self.text = None, ""
        return [self.event("response.output_text.done", item_id=mid, output_index=i, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=mid, output_index=i, content_index=0, part=part),
                self.event("response.output_item.done", output_index=i, item=item)]

    def _open_message(self) -> list[str]:
        self.msg_id, i = new_id("msg_"), len(self.output)
        return [self.event("response.output_item.added", output_index=i,
                           item=_message_item(self.msg_id, "", "in_progress")),
                self.event("response.content_part.added", item_id=self.msg_id, output_index=i, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def ops(self, ops: list[Op]) -> list[str]:
        out: list[str] = []
        for op in ops:
            if op.kind == "reasoning":
                out += self._reasoning(op.text)
                continue
            out += self._close_reasoning()
            i = len(self.output)
            if op.kind == "content" and op.text:
                if self.msg_id is None:
                    out += self._open_message()
                self.text += op.text
                out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=i,
                                      content_index=0, delta=op.text, logprobs=[]))
            elif op.kind == "call":
                out += self._close_message()
                i = len(self.output)
                out.append(self.event("response.output_item.added", output_index=i,
                                      item=_call_item(op.call, "in_progress")))
            elif op.kind == "args":
                out.append(self.event("response.function_call_arguments.delta", output_index=i,
                                      item_id=op.call.id.replace("call_", "fc_"), delta=op.text))
            elif op.kind in ("done", "broken"):
                item = _call_item(op.call, "completed" if op.kind == "done" else "incomplete")
                self.output.append(item)
                out += [self.event("response.function_call_arguments.done", output_index=i, item_id=item["id"],
                                   name=op.call.name, arguments=op.call.arguments),
                        self.event("response.output_item.done", output_index=i, item=item)]
        return out

    def end(self) -> list[str]:
        out = self._close_reasoning()
        if self.msg_id is None and all(o["type"] == "reasoning" for o in self.output):
            return out + self._open_message() + self._close_message()  # no answer is one empty message
        return out + self._close_message()


async def _stream(evs: AsyncIterator[Event], base: dict[str, Any], prompt_len: int, plan: OutputPlan,
                  keep, summary: bool) -> AsyncIterator[str]:  # noqa: ANN001  (keep: the final response → None)
    items, splitter = _Items(summary), StreamSplitter(plan)
    yield items.event("response.created", response=base)
    yield items.event("response.in_progress", response=base)
    try:
        async for ev in evs:
            if ev.kind == "ping":  # no ping event in this API: in_progress again, which changes nothing (Codex
                yield items.event("response.in_progress", response=base)  # times out on events, not on bytes)
                continue
            if ev.kind == "delta":
                for part in items.ops(splitter.feed(ev.text)):
                    yield part
                continue
            for part in items.ops(splitter.finish()) + items.end():
                yield part
            final = _finished(base, items.output, ev, prompt_len)
            keep(final)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield items.event(kind, response=final)
    except ApiError as e:  # after the headers went out an error can only be an event
        yield items.event("error", code=e.code, message=e.message, param=e.param)
