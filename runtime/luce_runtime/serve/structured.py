"""What the three chat APIs share about tools and structured output: the prompt with the tools in it, the grammar a
request's tokens must follow, and the generated text split back into content and tool calls.

    plan = output_plan(svc, tools, choice, parallel, schema)     # validated; ApiError(400) names what is wrong
    prompt = await svc.encode_chat(*prepare_chat(svc.tool_format, messages, plan.offered))
    constraints = await plan.constraints(svc, n)                  # one grammar state per choice
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from luce_runtime.grammar import Constraint, GrammarBackend, GrammarError, json_object_grammar, json_schema_grammar
from luce_runtime.harmony import HarmonyParser, harmony_grammar
from luce_runtime.serve.protocol import ApiError
from luce_runtime.serve.reasoning import Mode, ReasoningSplitter
from luce_runtime.tools import HARMONY, Tool, ToolCall, ToolCallParser, ToolFormat, tool_grammar

if TYPE_CHECKING:
    from luce_runtime.serve.app import Service

# "any": at least one call (Anthropic's name for required); ("tool", name): that one tool
Choice = Literal["none", "auto", "required"] | tuple[str, str]
ANY_JSON = object()  # response_format json_object: any JSON object


@dataclass
class OutputPlan:
    """How one request's output is held and read: the grammar (None: free text), the tools offered in the prompt,
    and the format to parse (None: the text is all content; harmony: reasoning, answer and calls, tools or not)."""

    grammar: str | None
    offered: list[Tool] = field(default_factory=list)
    fmt: ToolFormat | None = None
    bare: bool = False  # a reply that is a call's JSON alone counts as that call (auto mode without a schema)
    param: str = "response_format"  # what a grammar that does not compile is blamed on
    reasoning: Mode = "off"  # a thinking model's reply: where its <think> block may be (Service.reasoning_mode)

    async def constraints(self, svc: Service, n: int) -> list[Constraint]:
        """n fresh grammar states (off the event loop: a large schema compiles for milliseconds)."""
        if self.grammar is None:
            return []
        backend = await asyncio.to_thread(GrammarBackend.of, svc.tokenizer)
        try:
            return [await asyncio.to_thread(backend.constraint, self.grammar) for _ in range(n)]
        except GrammarError as e:
            raise ApiError(400, f"{e}. Simplify the schema (see the JSON Schema keywords llguidance supports).",
                           param=self.param) from None

    def parser(self) -> ToolCallParser | HarmonyParser | None:
        if self.fmt is None:
            return None
        if self.fmt is HARMONY:
            return HarmonyParser([t.name for t in self.offered])
        return ToolCallParser(self.fmt, [t.name for t in self.offered], bare=self.bare)


def output_plan(svc: Service, tools: list[Tool], choice: Choice | None, parallel: bool,
                schema: dict[str, Any] | object | None, *, tools_param: str = "tools",
                format_param: str = "response_format") -> OutputPlan:
    """The plan for tools under `choice` (OpenAI's default: auto when tools are given) and a response schema
    (ANY_JSON, a JSON schema, or None for free text)."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"Tool names must be unique; got {names}.", param=tools_param)
    choice = choice or ("auto" if tools else "none")
    if isinstance(choice, tuple):
        if choice[1] not in names:
            raise ApiError(400, f"tool_choice names the tool {choice[1]!r}, which is not in {tools_param} "
                                f"({names}).", param="tool_choice")
        tools_held, required, parallel = [t for t in tools if t.name == choice[1]], True, False
    elif choice in ("required", "any"):
        if not tools:
            raise ApiError(400, f"tool_choice '{choice}' needs at least one tool in {tools_param}.",
                           param="tool_choice")
        tools_held, required = tools, True
    else:
        tools_held, required = (tools if choice == "auto" else []), False
    answer = None if schema is None else {"type": "object"} if schema is ANY_JSON else schema
    if svc.tool_format is HARMONY:  # the answer and the calls come after reasoning, in harmony messages
        grammar = None if not tools_held and schema is None else harmony_grammar(
            tools_held, required=required, is_special=GrammarBackend.of(svc.tokenizer).is_special,
            answer_schema=answer)
        return OutputPlan(grammar, tools if tools_held else [], HARMONY,
                          param=tools_param if tools_held else format_param)
    text_grammar = None if schema is None else _schema_grammar(schema, format_param)
    if not tools_held:
        return OutputPlan(text_grammar, param=format_param)
    backend = GrammarBackend.of(svc.tokenizer)
    grammar = tool_grammar(svc.tool_format, tools_held, required=required, parallel=parallel,
                           is_special=backend.is_special, answer_schema=answer)
    return OutputPlan(grammar, tools, svc.tool_format, bare=not required and schema is None, param=tools_param)


def _schema_grammar(schema: dict[str, Any] | object, param: str) -> str:
    try:
        return json_object_grammar() if schema is ANY_JSON else json_schema_grammar(schema)
    except GrammarError as e:
        raise ApiError(400, f"{e}.", param=param) from None


def new_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class SplitOutput:
    """A whole generated text, split: content (invalid calls stay in it, as raw text) and the valid calls."""

    content: str
    calls: list[ToolCall]
    invalid: list[str]
    reasoning: str = ""  # a thinking model's thoughts (reasoning.py)


def split_output(plan: OutputPlan, text: str) -> SplitOutput:
    thoughts = ReasoningSplitter(plan.reasoning)
    parts = thoughts.feed(text) + thoughts.finish()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning").strip()
    text = "".join(t for kind, t in parts if kind == "content")
    parser = plan.parser()
    if parser is None:
        return SplitOutput(text, [], [], reasoning)
    content, calls, invalid = [], [], []
    thoughts = [reasoning] if reasoning else []
    for ev in parser.feed(text) + parser.finish():
        if ev.kind == "text":
            content.append(ev.text)
        elif ev.kind == "reasoning":  # harmony's analysis channel
            thoughts.append(ev.text)
        elif ev.kind == "end":
            calls.append(ev.call)
        elif ev.kind == "invalid":
            content.append(ev.text)  # reported as it was written, never dropped
            invalid.append(ev.call.arguments)
    for c in calls:
        c.id = new_call_id()
    return SplitOutput("".join(content).strip() if calls else "".join(content), calls, invalid,
                       "".join(thoughts).strip())


@dataclass
class Op:
    """One thing to stream: reasoning text, content text, a call that starts (its id and name), argument text, a
    call that is complete, or a call that started streaming and then proved invalid (the client has its partial
    arguments)."""

    kind: Literal["reasoning", "content", "call", "args", "done", "broken"]
    text: str = ""
    call: ToolCall | None = None


class StreamSplitter:
    """The streamed form of split_output: text deltas in, Ops out, calls numbered 0, 1, ... in the order they
    start (the index every API's stream uses), each with its id from the start."""

    def __init__(self, plan: OutputPlan):
        self.thoughts = ReasoningSplitter(plan.reasoning)
        self.parser = plan.parser()
        self.calls: list[ToolCall] = []  # complete and valid
        self._open: dict[int, ToolCall] = {}  # parser index → the call being streamed
        self._started = 0

    def feed(self, text: str) -> list[Op]:
        return self._parts(self.thoughts.feed(text))

    def finish(self) -> list[Op]:
        ops = self._parts(self.thoughts.finish())
        return ops + (self._ops(self.parser.finish()) if self.parser is not None else [])

    def _parts(self, parts: list[tuple[str, str]]) -> list[Op]:
        ops: list[Op] = []
        for kind, text in parts:
            if kind == "reasoning":
                ops.append(Op("reasoning", text))
            elif self.parser is None:
                ops.append(Op("content", text))
            else:
                ops += self._ops(self.parser.feed(text))
        return ops

    def _start(self, index: int, name: str) -> tuple[ToolCall, Op]:
        call = self._open[index] = ToolCall(self._started, name, "", new_call_id())
        self._started += 1
        return call, Op("call", call=call)

    def _ops(self, events: list[Any]) -> list[Op]:
        ops: list[Op] = []
        for ev in events:
            if ev.kind in ("text", "reasoning"):
                ops.append(Op("content" if ev.kind == "text" else "reasoning", ev.text))
            elif ev.kind == "start":
                ops.append(self._start(ev.index, ev.call.name)[1])
            elif ev.kind == "args":
                call = self._open[ev.index]
                call.arguments += ev.text
                ops.append(Op("args", ev.text, call))
            elif ev.kind == "end":
                call = self._open.pop(ev.index, None)
                if call is None:  # its head never matched the streaming pattern: the call goes out whole
                    call, op = self._start(ev.index, ev.call.name)
                    self._open.pop(ev.index)
                    ops.append(op)
                final = ev.call.arguments
                if final.startswith(call.arguments) and len(final) > len(call.arguments):
                    ops.append(Op("args", final[len(call.arguments):], call))
                call.arguments = final
                self.calls.append(call)
                ops.append(Op("done", call=call))
            else:  # invalid: raw text as content when nothing of it went out as a call
                call = self._open.pop(ev.index, None)
                ops.append(Op("content", ev.text) if call is None else Op("broken", ev.call.arguments, call))
        return ops
