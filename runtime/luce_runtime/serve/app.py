"""The HTTP server: a FastAPI app over one Engine driven by the token-step Scheduler.

    app = create_app(ServeOptions(artifact="smol.cpu"))   # or serve(options) to run it under uvicorn

Routers: openai_api (/v1/models, /v1/completions, /v1/chat/completions), anthropic_api (/v1/messages,
/v1/messages/count_tokens), and here /health and /metrics. Every error is an ApiError rendered in one place, in
Anthropic's shape under /v1/messages and OpenAI's everywhere else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from luce_runtime.artifact import load_artifact
from luce_runtime.engine import Engine, EngineOptions, kv_bytes_per_token, max_batch_for_memory
from luce_runtime.errors import LuceError
from luce_runtime.sampler import SamplingParams, SamplingParamsError
from luce_runtime.serve.metrics import render_metrics
from luce_runtime.serve.protocol import UNSUPPORTED, ApiError, anthropic_error, openai_error
from luce_runtime.serve.scheduler import Event, GenRequest, Scheduler

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServeOptions:
    artifact: str | Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 0  # sequences decoded together; 0: as many as a quarter of the free memory holds at max_context
    max_context: int = 0  # 0: the model's training context, capped at 4096 (EngineOptions)
    prefix_cache: int = 4  # cached prompt prefixes (forked KV sequences); 0 turns prefix reuse off
    model_name: str | None = None  # the id clients send; default: the GGUF's file name without .gguf


def _max_batch_from_memory(options: ServeOptions) -> int:
    art = load_artifact(options.artifact, verify=False)  # the Engine verifies it right after
    config, kind = art.config, art.manifest["target"]["kind"]
    context = options.max_context or min(int(config["n_ctx_train"]), 4096)
    batch = min(64, max_batch_for_memory(config, kind, context))
    log.info("KV pool sized from memory: %d sequences of %d tokens (%.1f MiB per sequence)", batch, context,
             kv_bytes_per_token(config) * context / 2**20)
    return batch


class Service:
    """The engine, its scheduler and the model id; what every route shares."""

    def __init__(self, options: ServeOptions):
        if not options.max_batch:
            options = replace(options, max_batch=_max_batch_from_memory(options))
        self.options = options
        # the prefix cache's sequences take Engine slots beyond the decode batch (and their pages in the pool)
        self.engine = Engine(options.artifact, EngineOptions(max_batch=options.max_batch + options.prefix_cache,
                                                             max_context=options.max_context))
        self.tokenizer = self.engine.tokenizer
        self.max_context = self.engine.max_context
        source = self.engine.artifact.manifest["source"]["file_name"]
        self.model_id = options.model_name or source.removesuffix(".gguf")
        self.scheduler = Scheduler(self.engine, options.max_batch, prefix_cache=options.prefix_cache)

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_id}' "
                                "(see GET /v1/models).", param="model", code="model_not_found")

    def check_budget(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """max_tokens, filled in and checked against the context (OpenAI's context_length_exceeded)."""
        if prompt_len == 0:
            raise ApiError(400, "The prompt is empty; give at least one token.", param="prompt")
        if prompt_len >= self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                                f"{prompt_len}. Shorten the prompt.", param="messages",
                           code="context_length_exceeded")
        if max_tokens is None:
            return self.max_context - prompt_len
        if max_tokens <= 0:
            raise ApiError(400, f"{param} must be at least 1, got {max_tokens}.", param=param,
                           code="invalid_value")
        if prompt_len + max_tokens > self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt "
                                f"({prompt_len}) plus {param} ({max_tokens}) exceed it. Lower {param}.",
                           param=param, code="context_length_exceeded")
        return max_tokens

    def submit(self, prompt: list[int], params: SamplingParams, n: int = 1,
               top_logprobs: int | None = None) -> tuple[asyncio.Queue, list[GenRequest]]:
        """Queue n sequences of one prompt (choice i seeded seed + i); their events share one queue."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs = []
        for i in range(n):
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            reqs.append(GenRequest(list(prompt), p, queue, loop, index=i, top_logprobs=top_logprobs))
        for r in reqs:
            self.scheduler.submit(r)
        return queue, reqs


def sampling(service: Service, *, max_tokens: int, stop: Sequence[str] | str | None, max_stop: int,
             stop_param: str, **kw: Any) -> SamplingParams:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > max_stop:
        raise ApiError(400, f"At most {max_stop} stop sequences are allowed, got {len(stops)}.", param=stop_param)
    if any(not s for s in stops):
        raise ApiError(400, "Stop sequences must be non-empty strings.", param=stop_param)
    try:
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stops), **kw)
    except SamplingParamsError as e:
        raise ApiError(400, str(e)) from None


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body validated as `model`; every failure is a 400 naming the field."""
    raw = await request.body()
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
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        kind = "Unrecognized request argument" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, f"{kind}: '{param}'" + ("" if err["type"] == "extra_forbidden" else
                                                   f" (got {json.dumps(err.get('input'), default=str)[:80]})"),
                       param=param) from None


async def events(queue: asyncio.Queue, reqs: list[GenRequest]) -> AsyncIterator[Event]:
    """Events of reqs until each one is done; cancels whatever is unfinished when the consumer goes away."""
    open_ = len(reqs)
    try:
        while open_:
            ev: Event = await queue.get()
            if ev.kind == "error":
                raise ApiError(500, ev.text, type_="server_error")
            if ev.kind == "done":
                open_ -= 1
            yield ev
    finally:
        for r in reqs:
            r.cancel()


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _error_response(request: Request, e: ApiError) -> JSONResponse:
    body = anthropic_error(e) if _is_anthropic(request) else openai_error(e)
    return JSONResponse(body, status_code=e.status)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, e: ApiError) -> JSONResponse:
        return _error_response(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                 type_="not_found_error" if e.status_code == 404 else
                                                 "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(request, ApiError(400, str(e)))

    @app.exception_handler(LuceError)
    async def _luce(request: Request, e: LuceError) -> JSONResponse:  # tokenizer/template errors are the client's
        return _error_response(request, ApiError(400, str(e)))

    @app.exception_handler(Exception)
    async def _any(request: Request, e: Exception) -> JSONResponse:
        log.exception("serve: unexpected error")
        return _error_response(request, ApiError(500, f"internal error: {type(e).__name__}", type_="server_error"))


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path in ("/health", "/metrics"):
            return await call_next(request)
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not given or not secrets.compare_digest(given, api_key):
            return _error_response(request, ApiError(401, "Incorrect or missing API key: send "
                                                          "'Authorization: Bearer <key>' (or 'x-api-key').",
                                                     type_="authentication_error", code="invalid_api_key"))
        return await call_next(request)


def create_app(options: ServeOptions, service: Service | None = None) -> FastAPI:
    """The app; the engine loads now, the scheduler thread runs while the app is up (its lifespan)."""
    from luce_runtime.serve import anthropic_api, openai_api

    service = service or Service(options)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.scheduler.start()
        yield
        service.scheduler.stop()

    app = FastAPI(title="luce-compile", lifespan=lifespan)
    app.state.service = service
    _install_errors(app)
    _install_auth(app, options.api_key)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_id, "scheduler": service.scheduler.stats()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(service.scheduler), media_type="text/plain; version=0.0.4")

    return app


def serve(options: ServeOptions) -> None:
    """Run the server under uvicorn until interrupted."""
    import uvicorn

    app = create_app(options)
    log.info("serve: %s on http://%s:%d", app.state.service.model_id, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
