"""The access log: one line per HTTP request (method, path, status, prompt and completion tokens, time to first
token, total time, and the reason of an error answer), as text or as one JSON object a line (`--log-format json`).

    POST /v1/messages 200 prompt=18775 completion=212 ttft=41.20s total=49.75s
    POST /v1/chat/completions 400 total=0.004s error="Unrecognized request argument: 'frobnicate'"

The middleware opens a Record for each request and puts it in a context variable; the route's events (events.events)
fill in the tokens and the first token's time, the error handler the reason. A streamed answer's line is written
when its last byte went out. Answered probes of /health and /metrics are left out (a load balancer or a test
polls them every few seconds). The scheduler's prefill progress goes to the same log (`log_progress`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

ACCESS_LOGGER = "luce_runtime.serve.access"
_PROBES = ("/health", "/metrics")
log = logging.getLogger(ACCESS_LOGGER)


@dataclass
class Record:
    method: str
    path: str
    start: float
    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    first_token: float | None = None  # perf_counter of the first generated token
    error: str | None = None

    def fields(self) -> dict[str, Any]:
        end = time.perf_counter()
        out: dict[str, Any] = {"method": self.method, "path": self.path, "status": self.status}
        if self.prompt_tokens is not None:
            out.update(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)
        if self.first_token is not None:
            out["ttft_s"] = round(self.first_token - self.start, 3)
        out["total_s"] = round(end - self.start, 3)
        if self.error is not None:
            out["error"] = self.error
        return out


RECORD: ContextVar[Record | None] = ContextVar("luce_access_record", default=None)


def current() -> Record | None:
    """This request's record (None outside a request, e.g. in unit tests that call handlers directly)."""
    return RECORD.get()


def _text(f: dict[str, Any]) -> str:
    line = f"{f['method']} {f['path']} {f['status']}"
    if "prompt_tokens" in f:
        line += f" prompt={f['prompt_tokens']} completion={f['completion_tokens']}"
    if "ttft_s" in f:
        line += f" ttft={f['ttft_s']:.2f}s"
    line += f" total={f['total_s']:.3f}s"
    if "error" in f:
        line += f" error={json.dumps(f['error'], ensure_ascii=False)}"
    return line


class AccessLog:
    """ASGI middleware: a Record per HTTP request, logged when the response is over (streamed ones included)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = Record(scope["method"], scope["path"], time.perf_counter())
        token = RECORD.set(record)

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException:
            record.status = record.status or 500  # the server's error handler answers it
            raise
        finally:
            RECORD.reset(token)
            if record.status >= 300 or record.path not in _PROBES:
                fields = record.fields()
                log.info(_text(fields), extra={"fields": fields})


def log_progress(message: str, **fields: Any) -> None:
    """A line about a request's progress (the scheduler's prefill), in the access log's format."""
    log.info(message, extra={"fields": {"event": "progress", **fields}})


class JsonFormatter(logging.Formatter):
    """One JSON object a line: the record's fields (an access line's) or its message."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {"message": record.getMessage()}
        return json.dumps({"time": round(record.created, 3), "level": record.levelname.lower(),
                           "logger": record.name, **fields}, ensure_ascii=False)


def configure(log_format: str) -> None:
    """The access log on stderr at INFO whatever the root level (-v or not), as text or JSON lines; with JSON, the
    rest of the server's log lines are JSON too."""
    if log_format not in ("text", "json"):
        raise ValueError(f"serve: --log-format {log_format!r}; use text or json")
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter("%(asctime)s %(message)s",
                                                                                 "%H:%M:%S")
    handler.setFormatter(formatter)
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    if log_format == "json":
        for h in logging.getLogger().handlers:
            h.setFormatter(formatter)
