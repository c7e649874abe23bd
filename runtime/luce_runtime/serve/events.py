"""What a request's queue of scheduler Events becomes for its route: the events themselves (with a disconnect
watcher for a non-streaming response, keep-alive pings for a stream, the access log's tokens and first-token time),
a whole text, SSE lines and ids."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from luce_runtime.serve import access
from luce_runtime.serve.protocol import ApiError
from luce_runtime.serve.scheduler import Event, GenRequest

log = logging.getLogger(__name__)


# how often a non-streaming request checks that its client is still there (a streamed one learns it from the send)
DISCONNECT_POLL_S = 0.25
# a stream with nothing to say for this long (a long prompt prefilling, a full queue) sends a keep-alive: Codex and
# OpenCode drop a connection after ~300 s of silence and send the request again
KEEPALIVE_S = 10.0


async def _cancel_when_gone(request: Request, reqs: list[GenRequest]) -> None:
    try:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
    except Exception:  # the server cannot tell any more; the request still ends at its max_tokens
        log.exception("serve: watching %s for a disconnect failed", request.url.path)
        return
    log.info("serve: client of %s went away; cancelling its %d sequence(s)", request.url.path, len(reqs))
    for r in reqs:
        r.cancel()


async def events(queue: asyncio.Queue, reqs: list[GenRequest], request: Request | None = None,
                 keepalive: float | None = None) -> AsyncIterator[Event]:
    """Events of reqs until each one is done; cancels whatever is unfinished when the consumer goes away.

    With `request` (a non-streaming response, which sends nothing until the end) a watcher cancels reqs as soon as
    the client disconnects; the scheduler then ends them with a 'done' event and frees their KV pages. With
    `keepalive` (streams) a 'ping' event comes after that many seconds without another. The access log's record
    learns the tokens and the first token's time here.
    """
    open_ = len(reqs)
    watcher = asyncio.create_task(_cancel_when_gone(request, reqs)) if request is not None else None
    record = access.current()
    try:
        while open_:
            try:
                ev: Event = await asyncio.wait_for(queue.get(), keepalive)
            except TimeoutError:
                yield Event("ping")
                continue
            if ev.kind == "error":
                raise ApiError(500, ev.text, type_="server_error")
            if record is not None:
                record.first_token = record.first_token or time.perf_counter()
                if ev.kind == "done":
                    record.prompt_tokens = ev.prompt_tokens
                    record.completion_tokens += ev.completion_tokens
            if ev.kind == "done":
                open_ -= 1
            yield ev
    finally:
        if watcher is not None:
            watcher.cancel()
        for r in reqs:
            r.cancel()


def stream_events(queue: asyncio.Queue, reqs: list[GenRequest]) -> AsyncIterator[Event]:
    """A streamed response's events, with a 'ping' after KEEPALIVE_S of silence (each API sends its keep-alive)."""
    return events(queue, reqs, keepalive=KEEPALIVE_S)


async def collect(queue: asyncio.Queue, reqs: list[GenRequest], request: Request) -> tuple[str, Event | None]:
    """A one-choice non-streaming response's whole text and its final event."""
    text, last = "", None
    async for ev in events(queue, reqs, request):
        if ev.kind == "delta":
            text += ev.text
        else:
            last = ev
    return text, last


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"
