"""gpt-oss's harmony format: its reply split into reasoning, answer and tool calls, and the grammar that holds it.

After the generation prompt `<|start|>assistant` a gpt-oss reply is one or more messages, each a header and a body:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER                               (then <|return|>)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}    (then <|call|>)

The recipient may also sit in the role part (`<|start|>assistant to=functions.NAME<|channel|>commentary json`, as
the chat template writes earlier calls), and a commentary message without a recipient is a preamble for the user.
`<|return|>` and `<|call|>` end generation, so at most one call comes per reply; the other markers reach the text
(llama.cpp's gpt-oss rules make them print, tokenizer/vocab.py). HarmonyParser reads them as ToolCallParser reads
hermes blocks, and gives the same events plus `reasoning`, so serve/structured.py streams both one way; as llama.cpp's
parser (common/parsers/gpt-oss.cpp): analysis is reasoning, final and preambles are content, a call to a tool that
was not offered (builtin `browser.*`, `python`) is no call: its raw text stays in the content, as an invalid call
does in the other formats.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from luce_runtime.grammar import lark_grammar, lark_json
from luce_runtime.tools import ParseEvent, Tool, ToolCall, _is_json, _partial_suffix, _value_end

log = logging.getLogger(__name__)

CHANNEL, MESSAGE, START, END, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"
_BOUNDARIES = (END, START, CHANNEL)  # each ends the message being read
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
# a header is a few tokens: text that runs this long without <|message|> was no header, and is content
MAX_HEADER = 256
EFFORTS = ("low", "medium", "high")
# the APIs' effort names onto harmony's three; gpt-oss always reasons, so "none" is its least
_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high",
           "max": "high"}


def effort(value: str | None) -> str | None:
    """harmony's `Reasoning:` level for an API's effort (OpenAI's none..xhigh, Anthropic's low..max); None for None
    or an unknown name, logged: the template's default (medium) then applies."""
    if value is None:
        return None
    level = _EFFORT.get(value.lower())
    if level is None:
        log.info("harmony: reasoning effort %r is not one of %s; using the template's default", value,
                 ", ".join(_EFFORT))
    return level


class HarmonyParser:
    """A harmony reply's text deltas in, ParseEvents out (ToolCallParser's, plus `reasoning`): feed() each delta,
    then finish(). A call's arguments stream as they are generated once its header names an offered tool."""

    def __init__(self, names: Sequence[str] = ()):
        self.names = set(names)
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._state = "between"  # between messages | header (up to <|message|>) | body
        self._first = True  # at the reply's start, where a header may begin with " to=" (the role's recipient)
        self._header = ""
        self._route = "content"  # the open body's kind: reasoning | content | call
        self._name = ""  # the open call's tool
        self._body = ""  # the open call's text so far
        self._started = False  # the open call's start event went out
        self._sent = 0  # characters of its arguments streamed
        self._n = 0  # calls begun (valid or not): the index of the next

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[ParseEvent]:
        """The end of generation (<|return|>, <|call|>, a stop or the limit): held-back text goes out and an open
        call is checked; a header cut short is dropped (it says nothing to the reader)."""
        out: list[ParseEvent] = []
        while self._step(out, final=True):
            pass
        if self._state == "body":
            out += self._close()
        elif self._state == "header":
            log.debug("harmony: a header cut short at the end: %.80r", self._buf)
        elif self._buf:
            out.append(ParseEvent("text", self._buf))
        self._buf = ""
        return out

    def _step(self, out: list[ParseEvent], final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        if self._state == "between":
            return self._between(out, final)
        if self._state == "header":
            return self._header_step(out)
        return self._body_step(out, final)

    def _between(self, out: list[ParseEvent], final: bool) -> bool:
        lead = self._buf.lstrip() if self._first else self._buf
        if lead.startswith((START, CHANNEL)) or (self._first and lead.startswith("to=")):
            self._buf, self._state, self._first = lead, "header", False
            return True
        if not lead or (not final and (any(m.startswith(lead) for m in (START, CHANNEL)) or
                                       (self._first and "to=".startswith(lead)))):
            return False  # undecided: it may still grow into a header
        # text outside any message (a model that does not write harmony): content up to the next header
        self._state, self._route, self._first = "body", "content", False
        return True

    def _header_step(self, out: list[ParseEvent]) -> bool:
        at = self._buf.find(MESSAGE)
        if at < 0:
            if len(self._buf) <= MAX_HEADER:
                return False
            # no header after all: content, up to the next marker (at least its first character: progress)
            nxt = [i for i in (self._buf.find(m, 1) for m in _BOUNDARIES) if i > 0]
            cut = min(nxt) if nxt else len(self._buf)
            out.append(ParseEvent("text", self._buf[:cut]))
            self._buf, self._state = self._buf[cut:], "between"
            return True
        self._header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
        self._open(out)
        return True

    def _open(self, out: list[ParseEvent]) -> None:
        """A message's header is complete: route its body."""
        self._state = "body"
        channels = _CHANNEL_RE.findall(self._header)
        channel = channels[-1] if channels else ""
        recipient = next((r for r in _RECIPIENT_RE.findall(self._header) if r != "assistant"), None)
        if recipient is None:
            self._route = "reasoning" if channel == "analysis" else "content"
            return
        self._route, self._body, self._sent = "call", "", 0
        self._name = recipient.removeprefix("functions.") if recipient.startswith("functions.") else recipient
        self._started = recipient.startswith("functions.") and self._name in self.names
        if self._started:
            out.append(ParseEvent("start", index=self._n, call=ToolCall(self._n, self._name, "")))

    def _body_step(self, out: list[ParseEvent], final: bool) -> bool:
        ends = [i for i in (self._buf.find(m) for m in _BOUNDARIES) if i >= 0]
        at = min(ends) if ends else -1
        if at < 0:
            keep = 0 if final else max(_partial_suffix(self._buf, m) for m in _BOUNDARIES)
            text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            out += self._emit(text)
            return False
        out += self._emit(self._buf[:at])
        self._buf = self._buf[at + len(END):] if self._buf.startswith(END, at) else self._buf[at:]
        out += self._close()
        self._state = "between"
        return True

    def _emit(self, text: str) -> list[ParseEvent]:
        if not text:
            return []
        if self._route != "call":
            return [ParseEvent("reasoning" if self._route == "reasoning" else "text", text)]
        self._body += text
        if not self._started:
            return []
        value = self._body.lstrip()
        upto = _value_end(value)
        if upto <= self._sent:
            return []
        piece, self._sent = value[self._sent:upto], upto
        return [ParseEvent("args", piece, index=self._n)]

    def _close(self) -> list[ParseEvent]:
        """The open message ends: a call is checked (valid JSON object, an offered tool) and reported."""
        if self._route != "call":
            return []
        index, raw = self._n, f"{self._header}{MESSAGE}{self._body}"
        self._n, self._route = self._n + 1, "content"
        if not self._started:
            return [self._invalid(raw, index, f"no tool is named {self._name!r}")]
        value = self._body.strip()
        try:
            args = json.loads(value)
        except json.JSONDecodeError as e:
            return [self._invalid(raw, index, f"not valid JSON ({e})")]
        if not isinstance(args, dict):
            return [self._invalid(raw, index, "the arguments are not a JSON object")]
        streamed = value[:_value_end(value)]
        call = ToolCall(index, self._name, streamed if _is_json(streamed) else json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return [ParseEvent("end", index=index, call=call)]

    @staticmethod
    def _invalid(raw: str, index: int, why: str) -> ParseEvent:
        log.warning("harmony: call %d is invalid: %s: %.200r", index, why, raw)
        return ParseEvent("invalid", raw, index=index, call=ToolCall(index, "", why))


def harmony_grammar(tools: Sequence[Tool], *, required: bool, is_special: Callable[[str], bool],
                    answer_schema: dict[str, Any] | None = None) -> str:
    """A harmony reply: reasoning messages (and preambles, when tools are offered), then a call of one of `tools`
    (arguments held to its schema) or, unless `required`, a final answer (JSON valid against `answer_schema` when
    given), as llama.cpp's gpt-oss grammar allows. Calls are written as OpenAI's harmony guide writes them:
    `<|channel|>commentary to=functions.NAME <|constrain|>json`."""
    ch, msg, start, end, constrain = (tok if is_special(tok) else json.dumps(tok)
                                      for tok in (CHANNEL, MESSAGE, START, END, CONSTRAIN))
    kinds = '("analysis" | "commentary")' if tools else '"analysis"'
    rules = [f"before: {ch} {kinds} {msg} TEXT {end} {start} \"assistant\"", "TEXT: /(?s:.*)/"]
    last = []
    for i, t in enumerate(tools):
        head = json.dumps(f"commentary to=functions.{t.name} ")
        rules.append(f'call{i}: {ch} {head} {constrain} "json" {msg} {lark_json(dict(t.parameters))}')
        last.append(f"call{i}")
    if not required:
        answer = "TEXT" if answer_schema is None else "answer"
        rules.append(f'final: {ch} "final" {msg} {answer}')
        if answer_schema is not None:
            rules.append(f"answer: {lark_json(dict(answer_schema))}")
        last.append("final")
    return lark_grammar("\n".join([f"start: before* ({' | '.join(last)})", *rules]))
