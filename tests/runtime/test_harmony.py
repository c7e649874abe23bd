"""gpt-oss's harmony replies: the parser on fixed texts (any split of the text, and token by token as the server
decodes tiny-gptoss's tokens, give the same reasoning, content and calls), the prompt side (thinking, effort) and
the grammar on tiny-gptoss's vocabulary (SmolLM2's tokens plus harmony's, synthetic_harmony.py)."""

from __future__ import annotations

import numpy as np
import pytest
from luce_runtime.chat import render_prompt
from luce_runtime.harmony import HarmonyParser, effort, harmony_grammar
from luce_runtime.tokenizer import StreamDecoder, Tokenizer
from luce_runtime.tools import HARMONY, Tool, prepare_chat, tool_format

pytestmark = pytest.mark.unit

WEATHER = Tool("get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"], "additionalProperties": False})
THINK_ANSWER = ("<|channel|>analysis<|message|>The user greets; <|end is no marker.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Hello! {\"a\": 1}")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Par\\\"is {x}\"}")
# the recipient in the role part, as the template writes earlier calls, after a preamble for the user
CALL_IN_ROLE = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
                "<|channel|>commentary json<|message|>{\"city\": \"Rome\"}")


def _merge(events) -> list[tuple]:
    """Events with consecutive text, reasoning and argument pieces joined: the same whatever the split."""
    out: list[tuple] = []
    for e in events:
        if e.kind in ("text", "reasoning", "args") and out and out[-1][0] == e.kind:
            out[-1] = (e.kind, out[-1][1] + e.text)
        elif e.kind in ("text", "reasoning", "args"):
            out.append((e.kind, e.text))
        else:
            out.append((e.kind, e.index, e.call.name, e.call.arguments, e.text))
    return out


def _parse(text: str, cuts: list[int], names=("get_weather",)) -> list[tuple]:
    p = HarmonyParser(names)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += p.feed(text[a:b])
    return _merge(events + p.finish())


@pytest.mark.parametrize(("text", "expected"), [
    (THINK_ANSWER, [("reasoning", "The user greets; <|end is no marker."), ("text", 'Hello! {"a": 1}')]),
    (CALL, [("reasoning", "Need the weather."), ("start", 0, "get_weather", "", ""),
            ("args", '{"city": "Par\\"is {x}"}'), ("end", 0, "get_weather", '{"city": "Par\\"is {x}"}', "")]),
    (CALL_IN_ROLE, [("text", "Checking."), ("start", 0, "get_weather", "", ""), ("args", '{"city": "Rome"}'),
                    ("end", 0, "get_weather", '{"city": "Rome"}', "")]),
    # a model that does not write harmony: all content, headers after it still read
    ("Just text <|start|>assistant<|channel|>final<|message|>then harmony",
     [("text", "Just text then harmony")]),
    # gpt-oss-20b's stray commentary header before the analysis channel
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>Hm.<|end|>", [("reasoning", "Hm.")]),
    # cut by max_tokens inside a header: the half header is dropped, what came before stays
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|chan", [("reasoning", "Hm.")]),
])
def test_any_split_gives_the_same_messages(text, expected):
    assert _parse(text, []) == expected
    for step in (1, 2, 3, 7):
        assert _parse(text, list(range(step, len(text), step))) == expected, step


@pytest.mark.parametrize(("text", "why"), [
    # a builtin tool (never offered: the server runs function tools) is no call; its text stays in the content
    ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}", "no tool is named"),
    ("<|channel|>commentary to=functions.get_time<|message|>{}", "no tool is named 'get_time'"),
    ("<|channel|>commentary to=functions.get_weather<|message|>{\"city\": ", "not valid JSON"),
    ("<|channel|>commentary to=functions.get_weather<|message|>[1]", "not a JSON object"),
])
def test_invalid_calls_are_reported_with_their_text(text, why):
    events = _parse(text, list(range(1, len(text))))
    invalid = [e for e in events if e[0] == "invalid"]
    assert len(invalid) == 1 and why in invalid[0][3] and invalid[0][4] == text


def test_a_header_that_never_ends_is_content():
    text = "<|channel|>" + "x" * 400
    assert _parse(text, list(range(5, len(text), 5))) == [("text", text)]


@pytest.fixture(scope="module")
def gptoss_tokenizer() -> Tokenizer:
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.synthetic import cached_synthetic

    md = read_gguf(cached_synthetic("tiny-gptoss")).metadata
    return Tokenizer.from_metadata({k: v for k, v in md.items() if k.startswith("tokenizer.")})


def test_token_by_token_as_the_server_decodes(gptoss_tokenizer):
    """The server streams each token's text as StreamDecoder gives it (special tokens not printed, except those
    llama.cpp prints for gpt-oss): the parser reads the same messages from those deltas."""
    tok = gptoss_tokenizer
    for text in (THINK_ANSWER, CALL, CALL_IN_ROLE):
        ids = tok.encode(text, add_special=False, parse_special=True)
        assert tok.token_id("<|channel|>") in ids and tok.token_id("<|message|>") in ids
        decoder, parser, events = StreamDecoder(tok, strip_leading_space=False), HarmonyParser(["get_weather"]), []
        for t in ids:
            events += parser.feed(decoder.feed(t))
        events += parser.feed(decoder.flush()) + parser.finish()
        assert _merge(events) == _parse(text, []), text


def test_prompt_keeps_reasoning_only_where_the_template_does(gptoss_tokenizer):
    """reasoning_content becomes the template's `thinking` (as llama.cpp passes it): rendered on a trailing tool-call
    turn, dropped once a final answer follows; `reasoning_effort` sets the Reasoning line."""
    assert tool_format(gptoss_tokenizer.chat_template) is HARMONY
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, extra = prepare_chat(HARMONY, turns, [WEATHER])
    assert messages[1]["thinking"] == "Use the tool." and "content" not in messages[1]
    prompt = render_prompt(gptoss_tokenizer, messages, **extra, reasoning_effort="high")
    assert "Reasoning: high" in prompt and "<|channel|>analysis<|message|>Use the tool.<|end|>" in prompt
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}' \
        '<|call|>' in prompt and prompt.endswith("<|start|>assistant")
    later = turns + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
                     {"role": "user", "content": "Thanks"}]
    messages, extra = prepare_chat(HARMONY, later, [WEATHER])
    prompt = render_prompt(gptoss_tokenizer, messages, **extra)
    assert "Use the tool." not in prompt and "Easy." not in prompt and "Reasoning: medium" in prompt
    assert "<|channel|>final<|message|>Sunny.<|end|>" in prompt


@pytest.mark.parametrize(("value", "level"), [("none", "low"), ("minimal", "low"), ("low", "low"),
                                              ("medium", "medium"), ("HIGH", "high"), ("xhigh", "high"),
                                              ("max", "high"), ("extreme", None), (None, None)])
def test_effort_levels(value, level):
    assert effort(value) == level


def _walk(backend, grammar: str, tok: Tokenizer, text: str):
    c = backend.constraint(grammar)
    for t in tok.encode(text, add_special=False, parse_special=True):
        assert c.allowed()[t], (text, tok.token_to_piece(t, True))
        c.consume(t)
    return c


def _allowed_texts(c, tok: Tokenizer) -> set[str]:
    return {tok.token_to_piece(int(t), True).decode(errors="replace") for t in np.flatnonzero(c.allowed())}


def test_grammar_holds_calls_and_answers_to_their_schemas(gptoss_tokenizer):
    from luce_runtime.grammar import GrammarBackend

    tok = gptoss_tokenizer
    backend = GrammarBackend.of(tok)
    auto = harmony_grammar([WEATHER], required=False, is_special=backend.is_special)
    c = _walk(backend, auto, tok, THINK_ANSWER)
    assert c.accepting and not c.stopped  # an answer may go on until the model ends it
    assert _walk(backend, auto, tok, CALL.replace('Par\\"is {x}', "Paris")).stopped  # <|call|> would follow
    c = _walk(backend, auto, tok, CALL_IN_ROLE.split("<|start|>")[0] + "<|start|>assistant<|channel|>")
    assert not c.accepting  # a preamble, then another message must come
    # the arguments follow the schema: after `{"` only its one property may start
    c = _walk(backend, auto, tok, CALL.split("<|message|>{")[0] + '<|message|>{"')
    assert _allowed_texts(c, tok) and all("city".startswith(t) for t in _allowed_texts(c, tok))
    required = harmony_grammar([WEATHER], required=True, is_special=backend.is_special)
    c = _walk(backend, required, tok, "<|channel|>")
    assert not any(t.startswith("f") for t in _allowed_texts(c, tok))  # no final answer: a call must come
    answer = harmony_grammar([], required=False, is_special=backend.is_special, answer_schema={"type": "object"})
    c = _walk(backend, answer, tok, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>")
    assert not any(t.startswith("c") for t in _allowed_texts(c, tok))  # no preamble without tools
    c = _walk(backend, answer, tok, "<|channel|>final<|message|>")
    assert _allowed_texts(c, tok) and all(t.startswith("{") for t in _allowed_texts(c, tok))
    assert _walk(backend, answer, tok, '<|channel|>final<|message|>{"a": [1]}').stopped
