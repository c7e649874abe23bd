"""Request models of the OpenAI and Anthropic APIs (the subset served), and both APIs' error bodies.

Requests are validated strictly (a string where a number belongs is a 400, not a silent conversion). Fields a model
does not know are dropped and noted for the server's debug log (real clients send fields of newer API versions:
Claude Code, Codex, OpenCode), or refused with their name when the server runs with --strict: the validation
context decides (`context={"ignored": set()}` drops). Parameters that are part of the APIs but would change the answer
if ignored (logit_bias, the legacy functions, ...) are named in UNSUPPORTED and refused with their name either way.
The Responses API's input items are checked in responses_api (their shapes vary by type; the SDK sends back the
output items it received, with fields a request model would have to list one by one).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

log = logging.getLogger(__name__)

# OpenAI documents at most 4 stop sequences; Anthropic no limit, so ours is a bound on per-token stop matching work
MAX_STOP_OPENAI = 4
MAX_STOP_ANTHROPIC = 16
# Neither API documents a length limit. Each token re-checks the held-back tail (up to the longest stop), so the
# length bounds that work; 256 characters is far beyond any stop marker seen in practice (vLLM and llama.cpp users
# send role markers and delimiters of a few to a few dozen characters).
MAX_STOP_CHARS = 256
MAX_N = 8  # choices per request: each one is a live sequence

# API parameters we know but do not implement, whose answer would differ if they were ignored: refused with 400 and
# the parameter's name. Hints that change no text (prediction, container, metadata, ...) are accepted and ignored.
UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix", "echo", "best_of", "audio", "modalities",
               "conversation", "background")
# a tool's name as both APIs restrict it (it is also written into the prompt and the grammar)
TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class ApiError(Exception):
    """A request error with its HTTP status; the app renders it in OpenAI's or Anthropic's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers  # sent with the error response (Retry-After on a 429)


def openai_error(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def anthropic_error(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "invalid_request_error"),
                                       "message": e.message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown(cls, data: Any, info: ValidationInfo) -> Any:
        """Without --strict (the validation context holds an `ignored` set) fields this model does not know are
        dropped and named in that set, for the server's debug log; with it they stay and are refused."""
        ignored = (info.context or {}).get("ignored")
        if ignored is None or not isinstance(data, dict):
            return data
        known = _known_fields(cls)
        if all(k in known for k in data):
            return data
        ignored.update(f"{cls.__name__}.{k}" for k in data if k not in known)
        return {k: v for k, v in data.items() if k in known}


@cache
def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(f.alias or name for name, f in model.model_fields.items())


# ---- OpenAI ------------------------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, as this server returned it
    # what the SDK sends back when a client appends the response's message object as it came
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class FunctionDef(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: str
    max_tokens: int | None = None
    # None: the server's default (serve --temperature, ..., the GGUF's recommendation, else the API's: 1, 1, off)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # llama.cpp's and vLLM's extensions of the OpenAI API
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    speculative: bool = True  # luce extension: false keeps this request out of speculative decoding
    # accepted so that the refusal names them (see UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    audio: Any = None
    modalities: Any = None
    # hints that change no text
    prediction: Any = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None  # "none" turns a thinking model's thinking off
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and llama.cpp's: e.g. {"enable_thinking": false}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


# ---- Anthropic ---------------------------------------------------------------------------------------------------
class AnthropicText(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint for Anthropic's cache; our prefix cache is automatic
    citations: Any = None


class AnthropicToolUse(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: Any = None  # the SDK sends back what the response's block held
    toolset_name: Any = None


class AnthropicToolResult(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicThinking(_Strict):  # an assistant turn's thinking, sent back as this server returned it
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicRedactedThinking(_Strict):
    type: Literal["redacted_thinking"]
    data: str


AnthropicBlock = Annotated[AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinking |
                           AnthropicRedactedThinking, Field(discriminator="type")]


class AnthropicMessage(_Strict):
    # "system": Claude Code sends skill and agent listings as system turns; they join the system prompt, in order
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of custom tools (anthropic_api checks it)
    # None or "custom": a client tool; a server tool's type (web_search_20250305, ...): dropped (anthropic_api)
    type: str | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinkingConfig(_Strict):
    type: str  # "enabled", "adaptive" (Claude Code's default), "disabled"
    budget_tokens: int | None = None  # a hint to the model; not enforced here
    display: str | None = None


class AnthropicOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Strict):
    effort: str | None = None  # low/medium/high: a hint to the model; not enforced here
    format: AnthropicOutputFormat | None = None  # structured output: held to the schema by the grammar


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    # hints that change no text: accepted and ignored
    container: Any = None
    context_management: Any = None
    mcp_servers: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    # None: the server's default (see _OpenAISampling)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    speculative: bool = True  # luce extension: false keeps this request out of speculative decoding
    # the current Anthropic API has no temperature/top_p/top_k (older clients send them; they are served); these
    # request options change nothing about the text, so they are accepted and ignored
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# ---- OpenAI Responses --------------------------------------------------------------------------------------------
class ResponsesTool(FunctionDef):  # chat's function definition, flattened beside its type
    type: Literal["function"]


def runnable_tools(tools: list[Any]) -> list[Any]:
    """A Responses request's tools as the function tools this server runs: a `namespace` tool (Codex groups its
    multi-agent functions so) gives its functions, other types (web_search, file_search, mcp, ...) are dropped with
    a log line: the model is not offered them, so it answers without them."""
    out: list[Any] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            out += runnable_tools(tool["tools"])
        elif kind == "function" or not isinstance(tool, dict):
            out.append(tool)  # validated as a ResponsesTool
        else:
            log.info("responses: dropped a tool of type %r: this server runs function tools only", kind)
    return out


class ResponsesReasoning(_Strict):
    effort: str | None = None  # "none" (or "minimal") turns a thinking model's thinking off
    summary: str | None = None  # "auto", "concise", "detailed": the thinking comes back as a reasoning item
    generate_summary: str | None = None


class ResponsesNamedChoice(NamedFunction):
    type: Literal["function"]


class ResponsesFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Strict):
    format: ResponsesFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]  # items: checked in responses_api
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # None: the server's default (see _OpenAISampling)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    # stored unless false (responses_api.ResponseStore: in memory, the newest kept), continued by id
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    speculative: bool = True  # luce extension: false keeps this request out of speculative decoding
    reasoning: ResponsesReasoning | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's session ids: change no text
    # refused by name (UNSUPPORTED)
    conversation: Any = None
    background: Any = None

    @model_validator(mode="before")
    @classmethod
    def _runnable_tools(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":  # dropping it would change the answer
            raise ApiError(400, f"tool_choice of type {choice.get('type')!r} names a tool this server cannot run; "
                                "it runs function tools only.", param="tool_choice")
        if isinstance(data.get("tools"), list):
            return {**data, "tools": runnable_tools(data["tools"])}
        return data
