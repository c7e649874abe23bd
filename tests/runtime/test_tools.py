"""Tool calls: the streaming parser (any split of the text gives the same calls; invalid calls are reported, never
dropped), the prompt for templates with and without tools, and the grammars on a real vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from luce_runtime.chat import render_chat
from luce_runtime.tools import Tool, ToolCallParser, prepare_chat, tool_format, tool_grammar

GENERIC = tool_format(None)
QWEN_LIKE = tool_format("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>")
WEATHER = Tool("get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"]})
REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is {x}"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def _run(text: str, cuts: list[int], names: tuple[str, ...] = ("get_weather",)) -> tuple[str, list, list, dict]:
    p = ToolCallParser(GENERIC, names)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += p.feed(text[a:b])
    events += p.finish()
    content = "".join(e.text for e in events if e.kind == "text")
    calls = [(e.call.name, e.call.arguments) for e in events if e.kind == "end"]
    invalid = [e.text for e in events if e.kind == "invalid"]
    streamed: dict[int, str] = {}
    for e in events:
        if e.kind == "args":
            streamed[e.index] = streamed.get(e.index, "") + e.text
    return content, calls, invalid, streamed


@pytest.mark.unit
def test_any_split_gives_the_same_calls_and_streams_exact_arguments():
    whole = _run(REPLY, [])
    assert whole[0] == "Let me look.\n"
    assert whole[1] == [("get_weather", '{"city": "Par\\"is {x}"}'), ("get_weather", '{"city": "Rome"}')]
    assert whole[2] == [] and whole[3] == {0: whole[1][0][1], 1: whole[1][1][1]}
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = sorted(set(rng.integers(1, len(REPLY), size=int(rng.integers(1, 30))).tolist()))
        assert _run(REPLY, cuts) == whole
    assert _run(REPLY, list(range(1, len(REPLY)))) == whole  # one character at a time


@pytest.mark.unit
@pytest.mark.parametrize("body, why", [
    ('{"name": "get_weather", "arguments": {"city": }', "not valid JSON"),
    ('{"arguments": {}}', "no function name"),
    ('{"name": "launch", "arguments": {}}', "no tool is named"),
    ('{"name": "get_weather", "arguments": [1]}', "not a JSON object"),
])
def test_invalid_calls_are_reported_with_their_text(body, why):
    text = f"ok <tool_call>\n{body}\n</tool_call>"
    p = ToolCallParser(GENERIC, ["get_weather"])
    events = p.feed(text) + p.finish()
    bad = [e for e in events if e.kind == "invalid"]
    assert len(bad) == 1 and bad[0].text == text[3:] and why in bad[0].call.arguments
    assert not p.calls


@pytest.mark.unit
def test_unclosed_call_text_that_only_looks_like_an_opener_and_string_arguments():
    content, calls, invalid, _ = _run('a <tool_c b <tool_call>\n{"name": "get_weather", "arguments": {"ci', [5, 9])
    assert content == "a <tool_c b " and not calls and invalid == ['<tool_call>\n{"name": "get_weather", '
                                                                   '"arguments": {"ci']
    content, calls, _, _ = _run('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
                                '</tool_call>', [])
    assert calls == [("get_weather", '{"city": "Oslo"}')] and content == ""


@pytest.mark.unit
def test_generic_prompt_offers_tools_and_writes_calls_and_results_back():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]}]
    out, extra = prepare_chat(GENERIC, messages, [WEATHER])
    assert extra == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n5 C\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    native, extra = prepare_chat(QWEN_LIKE, messages, [WEATHER])
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # HF templates take objects
    assert render_chat("chatml", out).count("<tool_response>") == 2


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_path: Path):
    from luce_compile.cli import load_tokenizer

    return load_tokenizer(smollm2_path)


def _walk(backend, grammar: str, tok, text: str):
    c = backend.constraint(grammar)
    for t in tok.encode(text, add_special=False, parse_special=True):
        assert c.allowed()[t], (text, tok.token_to_piece(t, True))
        c.consume(t)
    return c


@pytest.mark.slow
@pytest.mark.parametrize("required", [False, True])
def test_tool_grammar_accepts_calls_and_holds_arguments(smol_tokenizer, required):
    from luce_runtime.grammar import GrammarBackend

    tok, backend = smol_tokenizer, GrammarBackend.of(smol_tokenizer)
    g = tool_grammar(GENERIC, [WEATHER], required=required, parallel=True, is_special=backend.is_special)
    text = REPLY.replace('Par\\"is {x}', "Paris")
    c = _walk(backend, g, tok, text if not required else text[text.index("<tool_call>"):])
    assert c.accepting
    # after an opener only the call's JSON may follow, even in auto mode
    c = _walk(backend, g, tok, ("Hi " if not required else "") + "<tool_call>\n")
    allowed = np.flatnonzero(c.allowed())
    assert all(tok.token_to_piece(int(t), True).startswith(b"{") for t in allowed)
    g1 = tool_grammar(GENERIC, [WEATHER], required=True, parallel=False, is_special=backend.is_special)
    c = _walk(backend, g1, tok, text[text.index("<tool_call>"):text.index("</tool_call>") + 12])
    assert c.stopped  # one call only: nothing may follow it


@pytest.mark.slow
def test_schema_grammar_masks_logits(smol_tokenizer):
    from luce_runtime.grammar import GrammarBackend, GrammarError, json_schema_grammar

    backend = GrammarBackend.of(smol_tokenizer)
    c = backend.constraint(json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                                                "required": ["n"], "additionalProperties": False}))
    logits = np.zeros(smol_tokenizer.vocab_size + 7, dtype=np.float32)  # rows past the vocabulary: padded heads
    masked = c.mask(logits)
    ok = np.flatnonzero(np.isfinite(masked))
    assert ok.size and all(smol_tokenizer.token_to_piece(int(t)).startswith(b"{") for t in ok)
    assert np.isneginf(masked[smol_tokenizer.vocab_size:]).all()
    with pytest.raises(GrammarError):
        backend.constraint(json_schema_grammar({"type": "object", "required": 5}))


@pytest.mark.unit
def test_a_bare_call_is_a_call_when_allowed():
    text = ' {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for bare, calls in ((True, [("get_weather", '{"city": "Oslo"}')]), (False, [])):
        p = ToolCallParser(GENERIC, ["get_weather"], bare=bare)
        events = [e for i in range(len(text)) for e in p.feed(text[i])] + p.finish()
        assert [(e.call.name, e.call.arguments) for e in events if e.kind == "end"] == calls
        assert "".join(e.text for e in events if e.kind == "text") == ("" if bare else text)


@pytest.mark.unit
def test_a_fenced_call_is_a_call_when_bare_calls_are_allowed():
    """Qwen2.5-Coder-1.5B at temperature 0 answers a tool offer with the call in a ```json fence; streamed character
    by character, the fence may only be decided late. A fence around code that is not a call stays text."""
    text = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    p = ToolCallParser(GENERIC, ["get_weather"], bare=True)
    events = [e for i in range(len(text)) for e in p.feed(text[i])] + p.finish()
    assert [(e.call.name, e.call.arguments) for e in events if e.kind == "end"] == [("get_weather", '{"city": "Oslo"}')]
    assert not [e for e in events if e.kind in ("text", "invalid")]
    for other in ("```python\nprint(1)\n```", "``not a fence", "```json\n[1, 2]\n```"):
        p = ToolCallParser(GENERIC, ["get_weather"], bare=True)
        events = [e for i in range(len(other)) for e in p.feed(other[i])] + p.finish()
        assert "".join(e.text for e in events if e.kind == "text") == other and not p.calls
    unclosed = '```json\n{"name": "nope", "arguments": {}}'  # names no tool: reported, never dropped
    p = ToolCallParser(GENERIC, ["get_weather"], bare=True)
    events = p.feed(unclosed) + p.finish()
    assert events[-1].kind == "invalid" and events[-1].text == unclosed and not p.calls


@pytest.mark.slow
def test_tool_grammar_holds_a_fenced_call_to_its_schema(smol_tokenizer):
    from luce_runtime.grammar import GrammarBackend

    tok, backend = smol_tokenizer, GrammarBackend.of(smol_tokenizer)
    g = tool_grammar(GENERIC, [WEATHER], required=False, parallel=False, is_special=backend.is_special)
    c = _walk(backend, g, tok, '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```')
    assert c.accepting
    c = _walk(backend, g, tok, '```json\n{"name": "')  # only a tool's name may follow
    assert not c.allowed()[tok.encode("nope", add_special=False)[0]]
    assert _walk(backend, g, tok, "```python\nprint(1)\n```").accepting  # other code fences stay free text
