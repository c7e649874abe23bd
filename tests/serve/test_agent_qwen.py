"""Agent loops on the model issue 15 names: the official `openai` and `anthropic` SDKs, unmodified, against
`luce-compile serve qwen2.5-coder-1.5b` as a user types it (the registry name, compiled for this CPU with the
defaults). Qwen2.5-Coder-1.5B-Instruct was trained on its template's `<tool_call>` blocks, so these check the
model's own calls (the grammar holds their arguments to the schemas) and that it answers from a tool's result: the
reply after the result must carry the result's number, which the prompt never gives."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serve.conftest import API_KEY
from tests.serve.process import serve_process
from tests.serve.test_tools import CLAUDE_TOOLS, OAI_TOOLS, RESP_TOOLS, _check_call

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "qwen2.5-coder-1.5b"
ASK = "What is the weather in Paris right now? Use celsius."
RESULT = {"temperature": 23, "unit": "celsius", "sky": "sunny"}
# what an agent's system prompt says; without one this model at temperature 0 answers a tool's result by writing
# the call again with the result inside it (llama.cpp gives the same text on the same prompt)
SYSTEM = ("You are a helpful assistant. Call a tool when you need data; once a tool has returned, answer the user "
          "in plain sentences, without JSON.")
ROUNDS = 3  # tool rounds an agent allows before it gives up on an answer


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    import anthropic
    import openai

    from luce_compile.cli import compile_into_cache

    # compiled here first (minutes on 2 cores, logged to this test's output), so that `serve` below, given the same
    # name, takes the build from the compile cache and answers /health within the process helper's wait
    compile_into_cache(MODEL, "cpu", "serve")
    with serve_process(["serve", MODEL, "--api-key", API_KEY, "--max-batch", "2", "--ctx", "2048"],
                       timeout=600) as (url, _, health):
        yield (health["model"], openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=600),
               anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=600))


def _weather_call(name: str, arguments: str | dict) -> None:
    assert name == "get_weather"
    assert _check_call(name, arguments)["city"].lower() == "paris"


def test_chat_tool_loop_streamed_and_answered_from_the_result(agent):
    model, oai, _ = agent
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    kw = dict(model=model, tools=OAI_TOOLS, max_tokens=80, temperature=0)
    r = oai.chat.completions.create(messages=messages, **kw)  # tool_choice auto: the model decides to call
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
    _weather_call(msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments)
    streamed: dict[int, dict] = {}
    for chunk in oai.chat.completions.create(messages=messages, stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    for _ in range(ROUNDS):  # the agent's loop: every call answered, until the model answers in text
        messages += [msg, *({"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}
                            for call in msg.tool_calls)]
        c = oai.chat.completions.create(messages=messages, **kw).choices[0]
        msg = c.message
        if not msg.tool_calls:
            break
        _weather_call(msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments)
    assert c.finish_reason == "stop" and not c.message.tool_calls and "23" in c.message.content, c.message


def test_responses_tool_loop_answered_from_the_result(agent):
    model, oai, _ = agent
    inputs: list = [{"role": "user", "content": ASK}]
    r = oai.responses.create(model=model, input=inputs, instructions=SYSTEM, tools=RESP_TOOLS, max_output_tokens=80,
                             temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    _weather_call(calls[0].name, calls[0].arguments)
    for _ in range(ROUNDS):
        inputs += r.output  # the SDK's output items, sent back as they came
        inputs += [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps(RESULT)}
                   for c in r.output if c.type == "function_call"]
        with oai.responses.stream(model=model, input=inputs, instructions=SYSTEM, tools=RESP_TOOLS,
                                  max_output_tokens=80, temperature=0) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            r = final = stream.get_final_response()
        if not [o for o in r.output if o.type == "function_call"]:
            break
    assert final.status == "completed" and final.output_text == text and "23" in text, final.output


def test_anthropic_tool_loop_streamed_and_answered_from_the_result(agent):
    model, _, claude = agent
    greedy = {"extra_body": {"temperature": 0}}
    messages: list = [{"role": "user", "content": ASK}]
    with claude.messages.stream(model=model, max_tokens=80, system=SYSTEM, tools=CLAUDE_TOOLS, messages=messages,
                                **greedy) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        first = stream.get_final_message()
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1, first.content
    _weather_call(uses[0].name, uses[0].input)
    assert json.loads(partial) == uses[0].input
    final = first
    for _ in range(ROUNDS):
        messages += [{"role": "assistant", "content": final.content},  # the SDK's blocks, sent back as they came
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": json.dumps(RESULT)}
                                                  for b in final.content if b.type == "tool_use"]}]
        final = claude.messages.create(model=model, max_tokens=80, system=SYSTEM, tools=CLAUDE_TOOLS,
                                       messages=messages, **greedy)
        if final.stop_reason != "tool_use":
            break
    text = "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason == "end_turn" and "23" in text, final.content


def test_response_format_json_schema_holds(agent):
    model, oai, _ = agent
    schema = {"type": "object", "properties": {
        "language": {"type": "string", "maxLength": 20},
        "typed": {"type": "boolean"},
        "first_release_year": {"type": "integer", "minimum": 1950, "maximum": 2030}},
        "required": ["language", "typed", "first_release_year"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe the Python programming language."}],
        max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "lang", "schema": schema, "strict": True}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert "python" in answer["language"].lower()
