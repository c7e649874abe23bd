"""The HTTP server: a FastAPI app over one Engine driven by the token-step Scheduler.

    app = create_app(ServeOptions(artifact="smol.cpu"))   # or serve(options) to run it under uvicorn

Routers: openai_api (/v1/models, /v1/completions, /v1/chat/completions), anthropic_api (/v1/messages,
/v1/messages/count_tokens), responses_api (/v1/responses), and here /, /health and /metrics. Every error is an
ApiError rendered in one place, in Anthropic's shape under /v1/messages and OpenAI's everywhere else; every request
leaves a line in the access log (access.py); events.py turns a request's scheduler events into its answer.

One client must not stall or starve the others: the body is capped (413, body.py) before it is read whole, prompts are
bounded by characters before any tokenizing and tokenized in worker threads (never on the event loop, which
streams every other client's tokens), the waiting queue is bounded (429 with Retry-After), stop strings are
bounded, and a request whose client went away is cancelled, streaming or not.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from luce_runtime import harmony
from luce_runtime.artifact import load_artifact
from luce_runtime.chat import render_prompt
from luce_runtime.engine import Engine, EngineOptions, artifact_device
from luce_runtime.errors import LuceError
from luce_runtime.grammar import Constraint, GrammarBackend
from luce_runtime.kv_memory import KVPlan, plan_kv_pool, weights_bytes
from luce_runtime.sampler import SamplingParams, SamplingParamsError
from luce_runtime.serve import access, reasoning
from luce_runtime.serve.metrics import render_metrics
from luce_runtime.serve.protocol import MAX_STOP_CHARS, ApiError, anthropic_error, openai_error
from luce_runtime.serve.scheduler import GenRequest, Scheduler
from luce_runtime.serve.speculation import Speculation
from luce_runtime.tools import HARMONY, tool_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    artifact: str | Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 0  # sequences decoded together; 0: as many as the KV budget holds at max_context (kv_memory.py)
    max_context: int = 0  # 0: the model's training context, capped at 4096 (EngineOptions); at most the trained one
    kv_memory: int = 0  # bytes the KV pool may take; 0: a quarter of the free memory
    prefix_cache: int = 4  # cached prompt prefixes (forked KV sequences); 0 turns prefix reuse off
    model_name: str | None = None  # the id clients send; default: the GGUF's file name without .gguf
    # a whole 4096-token context is ~20 KB of text; 4 MiB leaves room for token-id lists and long chat histories
    max_body_bytes: int = 4 * 2**20
    max_waiting: int = 0  # requests queued for a batch slot before 429; 0: 4 × max_batch
    spec: str | None = None  # "ngram": speculative decoding by prompt lookup
    draft: str | Path | None = None  # a draft artifact (same vocabulary): speculative decoding with it
    draft_max: int = 8  # most tokens drafted per step
    # True: refuse what a lenient server adjusts (unknown fields 400, unknown model names 404, max_tokens past the
    # context 400); False (default): ignore unknown fields (debug log), answer any model name, clamp max_tokens
    strict: bool = False
    aliases: tuple[str, ...] = ()  # more model ids this server answers to (llama-server's --alias)
    # sampling for requests that do not set it (llama-server's --temp, ...); None: the GGUF's recommendation
    # (general.sampling.*), else the API's default (temperature 1, the rest off)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    log_format: str = "text"  # the access log's lines: "text" or "json"
    # greedy and seeded requests give the same tokens alone or beside others (scheduler.py), at the price of their
    # prefix reuse
    deterministic: bool = False


def kv_plan(options: ServeOptions) -> KVPlan:
    """The KV pool the server makes (kv_memory.plan_kv_pool): the decode batch and context asked for or sized from
    the KV budget, the prefix cache's sequences beside them, at the artifact's KV type."""
    art = load_artifact(options.artifact, verify=False)  # the Engine verifies it right after
    artifact_device(art)  # a GPU artifact on a machine without that GPU: refused before the pool is sized
    runtime = art.manifest.get("runtime") or {}
    return plan_kv_pool(art.config, runtime.get("kv_dtype", "float32"), art.manifest["target"]["kind"],
                        context=options.max_context, sequences=options.max_batch, extra=options.prefix_cache,
                        kv_memory=options.kv_memory, kv_head_dim=runtime.get("kv_head_dim", 0),
                        weights=weights_bytes(art.manifest))


class Service:
    """The engine, its scheduler and the model id; what every route shares."""

    def __init__(self, options: ServeOptions):
        plan = kv_plan(options)
        options = replace(options, max_batch=plan.sequences, max_context=plan.context)
        self.kv = plan
        self.options = options
        # the prefix cache's sequences take Engine slots beyond the decode batch (and their pages in the pool)
        self.engine = Engine(options.artifact, EngineOptions(max_batch=plan.sequences + plan.extra,
                                                             max_context=options.max_context,
                                                             batch_invariant=options.deterministic))
        self.tokenizer = self.engine.tokenizer
        self.max_context = self.engine.max_context
        source = self.engine.artifact.manifest["source"]["file_name"]
        self.model_id = options.model_name or source.removesuffix(".gguf")
        self.model_ids = list(dict.fromkeys((self.model_id, *options.aliases)))
        self._unknown_models: set[str] = set()  # names already logged as answered by this model
        self.scheduler = Scheduler(self.engine, options.max_batch, prefix_cache=options.prefix_cache,
                                   speculation=_speculation(options, self.engine), deterministic=options.deterministic)
        self.tool_format = tool_format(self.tokenizer.chat_template)
        self.thinks = reasoning.thinks(self.tokenizer.chat_template)  # its template writes <think> blocks
        self.sampling_defaults = _sampling_defaults(options, self.engine.artifact.tokenizer_metadata())
        # the grammar backend's token trie (0.15 s for SmolLM2's 49k tokens, 0.5 s for Qwen's 152k) is built now,
        # not by the first request that asks for structured output
        GrammarBackend.of(self.tokenizer)
        log.info("serve: tool calls in the %s format", self.tool_format.name)
        # 4 × the batch: a queued request then waits at most ~4 requests' time for a slot, and a burst of clients
        # arriving together is still absorbed without 429s
        self.max_waiting = options.max_waiting or 4 * options.max_batch
        # a token covers at most the longest vocabulary entry's characters (special tokens included, byte-level
        # BPE entries count one character per byte), so more characters than this cannot fit the context
        self.max_prompt_chars = self.max_context * max(len(t) for t in self.tokenizer.vocab.tokens)
        # tokenizing is pure Python: two at a time (the cores here) so a flood of long prompts queues for these
        # slots instead of taking the GIL from the scheduler thread and the event loop
        self._tokenize_slots = asyncio.Semaphore(2)
        self.rejected = 0  # requests answered 429 (overloaded)
        log.info("serve: at most %d waiting requests, %d bytes a body, %d characters a prompt", self.max_waiting,
                 options.max_body_bytes, self.max_prompt_chars)

    def check_model(self, model: str) -> None:
        """A model name this server does not know: 404 under --strict; otherwise answered by the one model it
        serves, as llama-server does (clients send their own defaults: Claude Code asks for claude-* models), and
        logged once per name."""
        if model in self.model_ids:
            return
        if self.options.strict:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.model_ids)} (see GET /v1/models).",
                           param="model", code="model_not_found")
        if model not in self._unknown_models and len(self._unknown_models) < 64:  # bounded: names are the client's
            self._unknown_models.add(model)
            log.info("serve: model '%s' is not served; answering with '%s' (name it with --alias)", model,
                     self.model_id)

    def check_chars(self, chars: int, param: str) -> None:
        """A cheap bound before tokenizing: a prompt of this many characters surely exceeds the context."""
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                                f"{chars} characters, more than that many tokens can hold. Shorten the prompt.",
                           param=param, code="context_length_exceeded")

    async def tokenize(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """fn(*args) (a tokenizer or chat-template call) in a worker thread: the event loop keeps streaming."""
        async with self._tokenize_slots:
            return await asyncio.to_thread(fn, *args)

    async def encode_chat(self, messages: list[dict[str, Any]], extra: dict[str, Any] | None = None,
                          param: str = "messages", thinking: bool | None = None,
                          effort: str | None = None) -> list[int]:
        """The chat prompt's tokens (as chat.encode_chat; `extra` goes to the template, e.g. tools), bounded by
        characters before rendering and again before tokenizing, both off the event loop. `thinking` turns a
        thinking model's reasoning on or off (the template's enable_thinking); `effort` (the API's name for it) sets
        a harmony model's `Reasoning:` level (its template's reasoning_effort); None: the template's default."""
        self.check_chars(sum(_chars(m.get("content")) for m in messages), param)
        if thinking is not None and self.thinks:
            extra = {**(extra or {}), "enable_thinking": thinking}
        level = harmony.effort(effort) if self.tool_format is HARMONY else None
        if level is not None:
            extra = {**(extra or {}), "reasoning_effort": level}
        return await self.tokenize(self._encode_chat, messages, extra or {}, param)

    def reasoning_mode(self, prompt: list[int]) -> reasoning.Mode:
        """Where a reply to `prompt` may hold its <think> block (reasoning.mode)."""
        if not self.thinks:
            return "off"
        return reasoning.mode(self.tokenizer.chat_template, self.tokenizer.decode(prompt[-8:], special=True))

    def _encode_chat(self, messages: list[dict[str, Any]], extra: dict[str, Any], param: str) -> list[int]:
        text = render_prompt(self.tokenizer, messages, **extra)
        self.check_chars(len(text), param)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

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
            if self.options.strict:
                raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt "
                                    f"({prompt_len}) plus {param} ({max_tokens}) exceed it. Lower {param}.",
                               param=param, code="context_length_exceeded")
            # agents ask for more than any local context holds (Claude Code: 32000): generate what fits; the
            # answer ends with the API's length reason when it is reached
            log.debug("serve: %s %d clamped to %d (the context's room after %d prompt tokens)", param, max_tokens,
                      self.max_context - prompt_len, prompt_len)
            return self.max_context - prompt_len
        return max_tokens

    def submit(self, prompt: list[int], params: SamplingParams, n: int = 1, top_logprobs: int | None = None,
               constraints: Sequence[Constraint] = (), speculative: bool = True
               ) -> tuple[asyncio.Queue, list[GenRequest]]:
        """Queue n sequences of one prompt (choice i seeded seed + i, held to constraints[i] when given); their
        events share one queue. speculative=False keeps them out of speculative decoding."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs = []
        for i in range(n):
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            reqs.append(GenRequest(list(prompt), p, queue, loop, index=i, top_logprobs=top_logprobs,
                                   constraint=constraints[i] if constraints else None,
                                   leader=reqs[0] if reqs else None, speculative=speculative))
        if not self.scheduler.submit(*reqs, max_waiting=self.max_waiting):
            self.rejected += 1
            # Retry-After 1 s: a batch slot frees every few hundred ms while requests stream (SmolLM2 on 2 cores)
            raise ApiError(429, f"The server is overloaded: {self.max_waiting} requests are already waiting for a "
                                "batch slot. Retry after the time in the Retry-After header.",
                           type_="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        return queue, reqs


# SamplingParams field ← (ServeOptions field, the GGUF key llama.cpp writes the model's recommendation under)
_SAMPLING_KEYS = {"temperature": ("temperature", "general.sampling.temp"), "top_p": ("top_p", "general.sampling.top_p"),
                  "top_k": ("top_k", "general.sampling.top_k"), "min_p": ("min_p", "general.sampling.min_p"),
                  "repetition_penalty": ("repeat_penalty", "general.sampling.penalty_repeat")}


def _sampling_defaults(options: ServeOptions, metadata: dict[str, Any]) -> dict[str, Any]:
    """The sampling a request gets for what it leaves out: serve's flags first, then the GGUF's recommended keys
    (carried in the artifact's tokenizer.json); logged once, since agents never send a temperature."""
    out: dict[str, Any] = {}
    for name, (flag, key) in _SAMPLING_KEYS.items():
        value = getattr(options, flag)
        if value is None and key in metadata:
            value = metadata[key]
        if value is not None:
            out[name] = int(value) if name == "top_k" else float(value)
    try:
        SamplingParams(**out)
    except SamplingParamsError as e:
        raise LuceError(f"serve: the default sampling is invalid ({e}); fix the --temperature/--top-p/--top-k/"
                        "--min-p/--repeat-penalty flags.") from None
    log.info("serve: requests that set no sampling get %s",
             ", ".join(f"{k}={v}" for k, v in out.items()) or "the API's defaults (temperature 1)")
    return out


def _speculation(options: ServeOptions, engine: Engine) -> Speculation | None:
    """--spec ngram or --draft DRAFT_ART: the draft engine gets a sequence per batch slot and the target's context."""
    if options.draft:
        draft = Engine(options.draft, EngineOptions(max_batch=options.max_batch, max_context=engine.max_context))
        spec = Speculation.draft_model(draft, engine, options.draft_max)
    elif options.spec == "ngram":
        spec = Speculation.ngram(engine, options.draft_max)
    elif options.spec is None:
        return None
    else:
        raise LuceError(f"serve: unknown speculation {options.spec!r}; use --spec ngram or --draft DRAFT_ART.")
    log.info("serve: speculative decoding with %s, at most %d drafts a step", spec.name, options.draft_max)
    return spec


def _chars(content: str | list[dict[str, Any]] | None) -> int:
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content)
    return len(content or "")


def sampling(service: Service, *, max_tokens: int, stop: Sequence[str] | str | None, max_stop: int,
             stop_param: str, **kw: Any) -> SamplingParams:
    """The request's SamplingParams: what it sets (kw values that are not None) over the server's defaults."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > max_stop:
        raise ApiError(400, f"At most {max_stop} stop sequences are allowed, got {len(stops)}.", param=stop_param)
    if any(not s for s in stops):
        raise ApiError(400, "Stop sequences must be non-empty strings.", param=stop_param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"Stop sequences may be at most {MAX_STOP_CHARS} characters long, got "
                            f"{max(len(s) for s in stops)}.", param=stop_param)
    given = {k: v for k, v in kw.items() if v is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stops), **{**service.sampling_defaults, **given})
    except SamplingParamsError as e:
        raise ApiError(400, str(e)) from None


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _error_response(request: Request, e: ApiError) -> JSONResponse:
    record = access.current()
    if record is not None:
        record.error = e.message
    if e.status >= 500:
        log.warning("serve: %s %s answered %d: %s", request.method, request.url.path, e.status, e.message)
    body = anthropic_error(e) if _is_anthropic(request) else openai_error(e)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


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


class _ApiKey:
    """Requires the API key on /v1/*. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would pipe every
    streamed chunk of every client through an extra task and memory stream."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        request = Request(scope)
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")
        # as bytes: compare_digest refuses str with non-ASCII characters, which a client can send (a 500)
        if not given or not secrets.compare_digest(given.encode(), self.api_key.encode()):
            response = _error_response(request, ApiError(401, "Incorrect or missing API key: send "
                                                              "'Authorization: Bearer <key>' (or 'x-api-key').",
                                                         type_="authentication_error", code="invalid_api_key"))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(options: ServeOptions, service: Service | None = None) -> FastAPI:
    """The app; the engine loads now, the scheduler thread runs while the app is up (its lifespan)."""
    from luce_runtime.serve import anthropic_api, openai_api, responses_api

    service = service or Service(options)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.scheduler.start()
        yield
        service.scheduler.stop()

    app = FastAPI(title="luce-compile", lifespan=lifespan)
    app.state.service = service
    app.state.responses = responses_api.ResponseStore()  # the Responses API's stored responses (store true)
    _install_errors(app)
    if options.api_key:
        app.add_middleware(_ApiKey, api_key=options.api_key)
    app.add_middleware(access.AccessLog)  # the outermost: it sees the 401s too
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> dict[str, Any]:  # Claude Code sends HEAD / before its first request
        return {"status": "ok", "model": service.model_id}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_id, "scheduler": service.scheduler.stats()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(service.scheduler, service.rejected),
                                 media_type="text/plain; version=0.0.4")

    return app


def serve(options: ServeOptions) -> None:
    """Run the server under uvicorn until interrupted."""
    import uvicorn

    access.configure(options.log_format)
    app = create_app(options)
    log.info("serve: %s on http://%s:%d", app.state.service.model_id, options.host, options.port)
    uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
