"""A request's body: read with a size cap (413) and validated against its API's request model (400 naming the
field), unknown fields dropped with a debug log line unless the server runs with --strict (protocol._Strict)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from luce_runtime.serve.protocol import UNSUPPORTED, ApiError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The request body is {size} bytes or more; this server takes at most {limit}.",
                    type_="invalid_request_error", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes: by its Content-Length before reading anything, and while
    reading, for chunked bodies and for clients that send more than they declared."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}.")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


# JSON parsing and validation of a body this large would hold the event loop for several ms: a worker thread does it
_PARSE_IN_THREAD_BYTES = 64 * 2**10


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as `model`; every failure is a 400 naming the field (413 when too large). Fields the
    model does not know are dropped with a debug log line, or refused under --strict."""
    options = request.app.state.service.options
    raw = await read_body(request, options.max_body_bytes)
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(_parse, raw, model, options.strict)
    return _parse(raw, model, options.strict)


def _parse(raw: bytes, model: type[M], strict: bool = True) -> M:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"The parameter '{name}' is not supported by this server.", param=name,
                           code="unsupported_parameter")
    ignored: set[str] | None = None if strict else set()
    try:
        body = model.model_validate(data, context={"ignored": ignored})
        if ignored:
            log.debug("serve: ignored unknown fields %s", ", ".join(sorted(ignored)))
        return body
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        kind = "Unrecognized request argument" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, f"{kind}: '{param}'" + ("" if err["type"] == "extra_forbidden" else
                                                   f" (got {json.dumps(err.get('input'), default=str)[:80]})"),
                       param=param) from None
