"""A thinking model's reasoning, split from its answer: the text between `<think>` and `</think>` (Qwen3, DeepSeek-R1,
QwQ), which each API returns in its own shape (OpenAI chat `reasoning_content`, Anthropic `thinking` blocks,
Responses `reasoning` items), as llama.cpp's and vLLM's reasoning parsers do.

A model thinks when its chat template writes `<think>`. Its reply then either opens with `<think>` (Qwen3), or starts
inside the block when the generation prompt already opened it (DeepSeek-R1, Qwen3-Thinking-2507): `mode(...)` tells
which from the prompt's last tokens. A reply that does not open a block is all answer. gpt-oss's reasoning is its
harmony analysis channel instead, read with its calls by luce_runtime.harmony (serve/structured.py uses either).
"""

from __future__ import annotations

from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
Mode = Literal["off", "start", "inside"]  # not a thinking model | the reply may open a block | it starts inside one
Part = tuple[Literal["reasoning", "content"], str]


def thinks(chat_template: str | None) -> bool:
    return OPEN in (chat_template or "")


def mode(chat_template: str | None, prompt_tail: str) -> Mode:
    """The splitter's start for a reply to a prompt ending in `prompt_tail` (its last few tokens' text)."""
    if not thinks(chat_template):
        return "off"
    tail = prompt_tail.rstrip()
    if tail.endswith(OPEN):
        return "inside"
    return "start"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (held back until the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Text deltas in, (kind, text) parts out: reasoning while inside the block, content after it. Whitespace
    between the markers and the text they enclose or precede is dropped, as the templates write it."""

    def __init__(self, start: Mode):
        self.state = {"off": "content", "start": "start", "inside": "inside"}[start]
        self.buf = ""
        self.started = False  # reasoning text went out: its leading whitespace is behind us

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[Part]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            before = self.state
            out += self._step(final)
            if self.state == before:
                return [p for p in out if p[1]]

    def _step(self, final: bool) -> list[Part]:
        if self.state == "content":
            text, self.buf = self.buf, ""
            return [("content", text)]
        if self.state == "start":  # before the reply's first visible text: a block may open
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.state, self.buf = "inside", head[len(OPEN):]
            elif final or (head and not OPEN.startswith(head)):
                self.state = "content"
            return []
        if self.state == "inside":
            if not self.started:
                self.buf = self.buf.lstrip()
            at = self.buf.find(CLOSE)
            if at >= 0:
                text, self.buf, self.state = self.buf[:at].rstrip(), self.buf[at + len(CLOSE):], "after"
                return [("reasoning", text)]
            # hold back what could start the closing marker, and trailing whitespace (dropped if the marker follows)
            cut = len(self.buf) if final else len(self.buf) - _held(self.buf, CLOSE)
            while cut and self.buf[cut - 1].isspace() and not final:
                cut -= 1
            text, self.buf = self.buf[:cut], self.buf[cut:]
            self.started = self.started or bool(text)
            return [("reasoning", text)]
        # after the block: the answer starts at its first visible character
        self.buf = self.buf.lstrip()
        if self.buf or final:
            self.state = "content"
        return []


def split(start: Mode, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    s = ReasoningSplitter(start)
    parts = s.feed(text) + s.finish()
    return ("".join(t for k, t in parts if k == "reasoning").strip(),
            "".join(t for k, t in parts if k == "content"))
