"""Tool calling: the model's own call format, the prompt that offers the tools, the grammar that holds calls to
their schemas, and a streaming parser of the calls out of the generated text.

Formats (what each supported model was trained to write; the server reads the format off the chat template):
  hermes   `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block per call, after optional
           text. Qwen2.5 and Qwen3 (their GGUF templates render `tools` and write this), NousResearch Hermes.
           `<tool_call>` is one special token in Qwen's vocabulary, plain text elsewhere.
  generic  the same blocks, for templates that do not render tools (SmolLM2, Gemma 3, or no template at all):
           the tool list and the instruction to answer in that format go into the system message, earlier calls are
           written back as the blocks, and tool results as `<tool_response>` blocks in a user turn, as Qwen's own
           template does. SmolLM2-Instruct's card documents a similar `<tool_call>[...]</tool_call>` list for the
           1.7B model; the 135M and Gemma 3 270M were not trained on tool use, so the grammar is what makes their
           calls well-formed.
  harmony  gpt-oss's messages (`<|channel|>commentary to=functions.NAME ...<|message|>{...}`), read with its
           reasoning and answer by harmony.py; its template renders tools, calls and results.
In auto mode a reply that is a call's JSON alone, or that JSON in a ```json fence (what Qwen2.5-Coder-1.5B writes
at temperature 0 when offered tools), is that call too, held to the schemas by the same grammar.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from luce_runtime.grammar import lark_grammar, lark_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # starts a call
    close: str  # ends a call
    native: bool  # the chat template renders tools, tool calls and tool results itself


HARMONY = ToolFormat("harmony", "<|channel|>", "<|call|>", True)


def tool_format(template: str | None) -> ToolFormat:
    """The call format of a chat template: harmony when it writes harmony messages (gpt-oss: its calls, reasoning and
    answer are read by harmony.py), hermes when it writes <tool_call> blocks, generic otherwise."""
    if template and "<|channel|>" in template and "<|message|>" in template:
        return HARMONY
    native = bool(template) and "tools" in template and "<tool_call>" in template
    return ToolFormat("hermes" if native else "generic", "<tool_call>", "</tool_call>", native)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: name, description and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": fn}


# --- the prompt ---------------------------------------------------------------------------------------------------
def _generic_system(tools: Sequence[Tool]) -> str:
    # Qwen2.5's own wording, so that every model sees the one instruction the hermes format was trained with
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """One call as the model writes it (arguments: a dict, or the JSON text of one)."""
    args = _loads_or_raw(arguments)
    return f"{fmt.open}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{fmt.close}"


def _loads_or_raw(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # written back as the model (or client) gave it
    return arguments


def prepare_chat(fmt: ToolFormat, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Tool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (OpenAI shape: assistant `tool_calls`, `role: tool` results) and extra template variables, ready
    for chat.render_prompt. A native template gets the tools and the calls (arguments as objects, as the HF
    templates expect); otherwise the calls and results become text in the generic format."""
    if fmt.native:
        out = []
        for m in messages:
            m = dict(m)
            if m["role"] == "tool":
                m["content"] = _content_text(m.get("content"))
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"],
                                                      "arguments": _loads_or_raw(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            if fmt is HARMONY:
                _harmony_turn(m)
            out.append(m)
        return out, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    out = []
    for m in messages:
        role, content = m["role"], _content_text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn (as Qwen's)
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_text(fmt, c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + _generic_system(tools)}
        else:
            out.insert(0, {"role": "system", "content": _generic_system(tools)})
    return out, {}


def _harmony_turn(m: dict[str, Any]) -> None:
    """What gpt-oss's template reads, as llama.cpp passes it (common/parsers/gpt-oss.cpp): an assistant turn's
    reasoning as `thinking` (rendered only on a tool-call turn that no final answer follows: earlier reasoning is
    dropped), and no content beside it on a tool-call turn (the template refuses both); no content is "" (the
    template looks for markers in it)."""
    if isinstance(m.get("reasoning_content"), str):
        m["thinking"] = m.pop("reasoning_content")
        if m.get("tool_calls"):
            m.pop("content", None)
    if m.get("content", "") is None:
        m["content"] = ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content or ""


# --- the grammar --------------------------------------------------------------------------------------------------
def _lit(text: str, is_special: Callable[[str], bool]) -> str:
    """A grammar element matching `text`: the special token itself when the vocabulary has one (a string literal
    would never match its 0xff-marked bytes), else a string literal."""
    return text if is_special(text) else json.dumps(text)


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON of one call: {"name": one of the tools, "arguments": that tool's parameters}, name first."""
    variants = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


# any text whose first non-blank character is not "{" (blank text included)
_NO_BRACE = r"(\s*[^{\s](.|\n)*)?\s*"
# a reply that opens with a Markdown fence around a JSON object: a call (ToolCallParser's bare mode), never text
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"
_FENCED_TEXT = r"\s*```(json)?\s*\{(?s:.*)"


def tool_grammar(fmt: ToolFormat, tools: Sequence[Tool], *, required: bool, parallel: bool,
                 is_special: Callable[[str], bool], answer_schema: Mapping[str, Any] | None = None) -> str:
    """The grammar of a reply that calls `tools` in fmt: with `required`, one call (or several with `parallel`)
    and nothing else; otherwise free text, or text followed by calls; with `answer_schema`, JSON valid against
    it or the calls. Arguments are held to their schemas."""
    opener, closer = _lit(fmt.open, is_special), _lit(fmt.close, is_special)
    more = ' ("\\n" call)*' if parallel else ""
    rules = [f"call: {opener} rest", f"rest: \"\\n\" body \"\\n\" {closer}",
             f"body: {lark_json(call_schema(tools))}"]
    if required:
        return lark_grammar("\n".join([f"start: call{more}", *rules]))
    if answer_schema is not None:  # a JSON answer starts with "{" or "[", a call with the opener: no ambiguity
        return lark_grammar("\n".join([f"start: answer | call{more}", f"answer: {lark_json(dict(answer_schema))}",
                                        *rules]))
    # Small models offered tools often answer with the call's JSON alone, without the opener (Qwen2.5-Coder-0.5B
    # does), or in a ```json fence (Qwen2.5-Coder-1.5B at temperature 0 does, llama.cpp's Hermes parser takes it):
    # a reply that starts with "{" or with a fenced "{" must be one valid call (llguidance's Llama 3.1 recipe),
    # and text otherwise may start with neither.
    rules += [f"fenced: {json.dumps(FENCE_OPEN)} body {json.dumps(FENCE_CLOSE)}"]
    if is_special(fmt.open):  # byte-level text never contains the special token: text, then the token
        return lark_grammar("\n".join([f"start: TEXT | TEXT call{more} | body | fenced",
                                        f"TEXT: /{_NO_BRACE}/ & ~/{_FENCED_TEXT}/", *rules]))
    # The opener is text: the reply is text without it, or text up to it (a lazy lexeme: it ends at the first
    # opener, where the text alternative dies) and then the calls. A greedy text lexeme would have to be ended
    # before the opener's first byte, which the lexer cannot know then.
    opener_re = re.escape(fmt.open).replace("/", "\\/")
    return lark_grammar("\n".join([f"start: TEXT | head rest{more} | body | fenced",
                                    f"head[lazy]: /{_NO_BRACE}{opener_re}/ & ~/{_FENCED_TEXT}/",
                                    f"TEXT: /{_NO_BRACE}/ & ~/(?s:.*){opener_re}(?s:.*)|{_FENCED_TEXT}/",
                                    *rules]))


# --- parsing ------------------------------------------------------------------------------------------------------
@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it
    id: str = ""


@dataclass
class ParseEvent:
    """text: content text; start: a call's name is known; args: more argument text of call `index`;
    end: call `index` is complete and valid; invalid: a call that is not valid JSON or names no tool (its raw text
    in `text`, never dropped)."""

    kind: str
    text: str = ""
    index: int = -1
    call: ToolCall | None = None


# a Markdown fence opening a JSON object, and what may still grow into one (held back until it is decided)
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?\s*(?=\{)")
_FENCE_SO_FAR = re.compile(r"`{1,3}|```(?:j|js|jso|json)?[ \t]*\n?\s*")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallParser:
    """Splits generated text into content and tool calls, incrementally: feed() each text delta, then finish().

    Argument text streams as it is generated once a call's head (`{"name": "...", "arguments": `) has been seen:
    the arguments value is scanned for its end (bracket depth outside strings), so what streams is exactly the
    value's text. The call is checked as JSON when its closing tag arrives."""

    def __init__(self, fmt: ToolFormat, names: Sequence[str] = (), *, bare: bool = False):
        """bare: a reply whose first non-blank character is "{", or that opens with a ```json fence around "{", is
        one call without the opener (tool_grammar's auto mode allows exactly that)."""
        self.fmt, self.names, self._bare = fmt, set(names), bare
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet classified
        self._in_call = False
        self._started = False  # this call's start event went out
        self._sent = 0  # characters of this call's arguments streamed
        self._n = 0  # calls begun (valid or not): the index of the next
        self._after_call = False  # whitespace between calls (and after the last) is not content
        self._implicit = False  # in a bare call: it ends with the text
        self._fenced = False  # in a fenced bare call: it ends at the closing fence

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while True:
            if self._bare and not self._in_call:  # undecided until the first non-blank character
                lead = self._buf.lstrip()
                if not lead or _FENCE_SO_FAR.fullmatch(lead):
                    return out
                self._bare = False
                fence = _FENCE.match(lead)
                if lead[0] == "{" or fence:
                    self._buf, self._in_call, self._implicit = lead[fence.end() if fence else 0:], True, True
                    self._fenced, self._started, self._sent = bool(fence), False, 0
            if not self._in_call:
                at = self._buf.find(self.fmt.open)
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    self._after_call = not self._buf
                    at = self._buf.find(self.fmt.open)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.fmt.open)
                    if len(self._buf) > keep:
                        out.append(ParseEvent("text", self._buf[:len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if at:
                    out.append(ParseEvent("text", self._buf[:at]))
                self._buf, self._in_call = self._buf[at + len(self.fmt.open):], True
                self._started, self._sent = False, 0
                continue
            close = "```" if self._fenced else self.fmt.close
            end = -1 if self._implicit and not self._fenced else self._buf.find(close)
            body = self._buf if end < 0 else self._buf[:end]
            out += self._stream_args(body)
            if end < 0:
                return out
            opener = FENCE_OPEN if self._fenced else self.fmt.open
            out.append(self._end_call(body, opener + body + close))
            self._buf, self._in_call, self._fenced = self._buf[end + len(close):], False, False
            self._after_call = True

    def finish(self) -> list[ParseEvent]:
        """The end of generation: held-back text goes out; an unclosed call is reported invalid (with a valid
        JSON body but no closing tag, e.g. at max_tokens, it still counts when its JSON is complete)."""
        out: list[ParseEvent] = []
        if self._in_call:
            body = self._buf
            out += self._stream_args(body)
            opener = FENCE_OPEN if self._fenced else "" if self._implicit else self.fmt.open
            out.append(self._end_call(body, opener + body))
        elif self._buf:
            out.append(ParseEvent("text", self._buf))
        self._buf, self._in_call = "", False
        return out

    def _stream_args(self, body: str) -> list[ParseEvent]:
        head = _HEAD.match(body)
        if head is None:
            return []
        out = []
        if not self._started:
            self._started = True
            out.append(ParseEvent("start", index=self._n, call=ToolCall(self._n, _unescape(head.group(1)), "")))
        value = body[head.end():]
        upto = _value_end(value)
        if upto > self._sent:
            out.append(ParseEvent("args", value[self._sent:upto], index=self._n))
            self._sent = upto
        return out

    def _end_call(self, body: str, raw: str) -> ParseEvent:
        index = self._n
        self._n += 1
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return self._invalid(raw, index, f"not valid JSON ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self._invalid(raw, index, "no function name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _loads_or_raw(args)
        if not isinstance(args, dict):
            return self._invalid(raw, index, "the arguments are not a JSON object")
        if self.names and obj["name"] not in self.names:
            return self._invalid(raw, index, f"no tool is named {obj['name']!r}")
        head = _HEAD.match(body)
        value = body[head.end():][:_value_end(body[head.end():])] if head else ""
        text = value if self._started and _is_json(value) else json.dumps(args, ensure_ascii=False)
        call = ToolCall(index, obj["name"], text)
        self.calls.append(call)
        return ParseEvent("end", index=index, call=call)

    @staticmethod
    def _invalid(raw: str, index: int, why: str) -> ParseEvent:
        log.warning("tools: call %d is invalid: %s: %.200r", index, why, raw)
        return ParseEvent("invalid", raw, index=index, call=ToolCall(index, "", why))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except json.JSONDecodeError:
        return s


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker (held back: it may grow into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _value_end(value: str) -> int:
    """How much of a JSON object's (or array's) text is known to be inside it: all of it while it is open, up to its
    closing bracket once it closes."""
    if not value or value[0] not in "{[":  # a string or bare value is not streamed: its final text may differ
        return 0
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(value):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(value)
