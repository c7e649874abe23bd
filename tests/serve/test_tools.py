"""Tools, structured output and the Responses API through the official `openai` and `anthropic` clients, unmodified,
against a real server (SmolLM2-135M on the CPU, which was never trained on tool use: the grammar is what makes its
calls well-formed, so every call here checks the constraint as much as the protocol)."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
OAI_TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": SCHEMAS[n]}}
             for n, d in (("get_weather", "The weather in a city"), ("add", "Adds two numbers"))]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_chat_tool_choice_required_named_and_none(server, oai):
    # one call: a 135M model that may call in parallel repeats its call until max_tokens
    r = oai.chat.completions.create(model=server.model, messages=ASK, tools=OAI_TOOLS, tool_choice="required",
                                    max_tokens=60, temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        _check_call(call.function.name, call.function.arguments)
    named = oai.chat.completions.create(model=server.model, messages=ASK, tools=OAI_TOOLS, max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    _check_call("add", calls[0].function.arguments)
    none = oai.chat.completions.create(model=server.model, messages=ASK, tools=OAI_TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_chat_streamed_tool_calls_match_the_plain_response(server, oai):
    kw = dict(model=server.model, messages=ASK, tools=OAI_TOOLS, tool_choice="required", max_tokens=60,
              temperature=0, parallel_tool_calls=False)
    plain = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in plain]
    assert len(calls) == 1 and all(c["id"].startswith("call_") for c in calls.values())


def test_chat_multi_turn_tool_loop(server, oai):
    messages = [{"role": "system", "content": "Use the tools."}, *ASK]
    r = oai.chat.completions.create(model=server.model, messages=messages, tools=OAI_TOOLS, max_tokens=60,
                                    tool_choice="required", temperature=0, parallel_tool_calls=False)
    msg = r.choices[0].message
    messages.append(msg)  # the SDK's own message object, sent back as it came
    for call in msg.tool_calls:
        args = _check_call(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True, **args})})
    second = oai.chat.completions.create(model=server.model, messages=messages, tools=OAI_TOOLS, max_tokens=24,
                                         temperature=0)
    c = second.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    for call in c.message.tool_calls or []:
        _check_call(call.function.name, call.function.arguments)


def test_response_format_json_object_and_schema(server, oai):
    r = oai.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Describe a cat."}],
                                    response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    r = oai.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Describe a cat."}],
                                    max_tokens=60, temperature=0.8, seed=3, response_format={
                                        "type": "json_schema",
                                        "json_schema": {"name": "animal", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_bad_schema_and_tool_choice_are_400s(server, oai):
    import openai

    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(model=server.model, messages=ASK, tools=OAI_TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="grammar"):
        oai.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}})


# --- Anthropic ----------------------------------------------------------------------------------------------------
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in OAI_TOOLS]


def test_anthropic_tool_use_loop_and_stream(server, claude):
    greedy = {"extra_body": {"temperature": 0}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    once = {"type": "any", "disable_parallel_tool_use": True}
    r = claude.messages.create(model=server.model, max_tokens=60, tools=CLAUDE_TOOLS, messages=messages,
                               tool_choice=once, **greedy)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses
    for u in uses:
        assert u.id.startswith("toolu_")
        _check_call(u.name, u.input)
    with claude.messages.stream(model=server.model, max_tokens=60, tools=CLAUDE_TOOLS, messages=messages,
                                tool_choice=once, **greedy) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert partial and final.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": r.content},  # the SDK's blocks, sent back as they came
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "18 C, sunny"}
                                              for u in uses]}]
    second = claude.messages.create(model=server.model, max_tokens=24, tools=CLAUDE_TOOLS, messages=messages,
                                    **greedy)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    named = claude.messages.create(model=server.model, max_tokens=60, tools=CLAUDE_TOOLS, messages=messages[:1],
                                   tool_choice={"type": "tool", "name": "add"}, **greedy)
    assert [b.name for b in named.content if b.type == "tool_use"] == ["add"]


# --- Responses ----------------------------------------------------------------------------------------------------
RESP_TOOLS = [{"type": "function", **t["function"]} for t in OAI_TOOLS]


def test_responses_tool_loop(server, oai):
    inputs: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model=server.model, instructions="Use the tools.", input=inputs, tools=RESP_TOOLS,
                             tool_choice="required", max_output_tokens=60, temperature=0, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls
    inputs += r.output  # the SDK's output items, sent back as they came
    for c in calls:
        args = _check_call(c.name, c.arguments)
        inputs.append({"type": "function_call_output", "call_id": c.call_id, "output": json.dumps(args)})
    second = oai.responses.create(model=server.model, input=inputs, tools=RESP_TOOLS, max_output_tokens=24,
                                  temperature=0)
    assert second.output and second.usage.input_tokens > r.usage.input_tokens
    assert second.output_text or any(o.type == "function_call" for o in second.output)


def test_responses_stream_and_text_format(server, oai):
    kw = dict(model=server.model, input="What is the weather in Paris?", tools=RESP_TOOLS, tool_choice="required",
              max_output_tokens=60, temperature=0, parallel_tool_calls=False)
    plain = oai.responses.create(**kw)
    kinds, args = [], ""
    with oai.responses.stream(**kw) as stream:
        for e in stream:
            kinds.append(e.type)
            if e.type == "response.function_call_arguments.delta":
                args += e.delta
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in plain.output]
    assert args == "".join(o.arguments for o in plain.output)
    text = oai.responses.create(model=server.model, input="Say hello.", max_output_tokens=12, temperature=0)
    streamed = ""
    with oai.responses.stream(model=server.model, input="Say hello.", max_output_tokens=12, temperature=0) as s:
        for e in s:
            if e.type == "response.output_text.delta":
                streamed += e.delta
    assert streamed == text.output_text and text.output_text
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 24}},
              "required": ["greeting"], "additionalProperties": False}
    r = oai.responses.create(model=server.model, input="Say hello as JSON.", max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "g", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


# --- Qwen2.5: the chat template renders the tools itself and <tool_call> is one special token ---------------------
@pytest.fixture(scope="module")
def qwen(qwen2_path, tmp_path_factory):
    import openai

    from luce_compile.codegen.compile import compile_model
    from tests.serve.conftest import API_KEY
    from tests.serve.process import serve_process

    art = compile_model(qwen2_path, "cpu", tmp_path_factory.mktemp("qwen") / "qwen.cpu", precision="f32")
    with serve_process(["serve", str(art), "--api-key", API_KEY, "--max-batch", "2", "--ctx", "1024"]) as (url, _, h):
        yield h["model"], openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_qwen_native_template_tool_loop(qwen):
    model, client = qwen
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=OAI_TOOLS, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg  # tool_choice auto: the model chose to call
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"] and not msg.content
    assert _check_call("get_weather", msg.tool_calls[0].function.arguments)["city"] == "Paris"
    messages += [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temperature": 18}'}]
    for _ in range(2):  # a 0.5B model may call again with the result in hand: answer, as an agent loop does
        r = client.chat.completions.create(model=model, messages=messages, tools=OAI_TOOLS, max_tokens=60,
                                           temperature=0)
        msg = r.choices[0].message
        if r.choices[0].finish_reason != "tool_calls":
            break
        messages.append(msg)
        for call in msg.tool_calls:
            _check_call(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'})
    final = client.chat.completions.create(model=model, messages=messages, tools=OAI_TOOLS, tool_choice="none",
                                           max_tokens=40, temperature=0)
    # the 0.5B model tends to repeat its call as text even then (the 1.5B is the one to judge answers with)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content


def test_responses_previous_response_id_continues_a_stored_response(server, oai):
    """A continued response is the response to its whole conversation sent as input items (greedy: the same
    prompt, the same ids); responses are stored unless store is false, fetched by id, and forgotten on delete."""
    import openai

    greedy = dict(model=server.model, max_output_tokens=8, temperature=0)
    first = oai.responses.create(input="My name is Ada. Say hello.", instructions="Be brief.", **greedy)
    assert first.store is True and oai.responses.retrieve(first.id).output_text == first.output_text
    again = oai.responses.create(previous_response_id=first.id, input="Say it again.", **greedy)
    spelled = oai.responses.create(input=[{"role": "user", "content": "My name is Ada. Say hello."}, *first.output,
                                          {"role": "user", "content": "Say it again."}], **greedy)
    assert again.previous_response_id == first.id
    assert again.usage.input_tokens == spelled.usage.input_tokens > first.usage.input_tokens
    assert again.output_text == spelled.output_text
    with oai.responses.stream(previous_response_id=again.id, input="Once more.", **greedy) as stream:
        # 8 tokens usually end incomplete, whose last event is response.incomplete (get_final_response wants completed)
        streamed = [e.response for e in stream if e.type in ("response.completed", "response.incomplete")][-1]
    assert oai.responses.retrieve(streamed.id).output_text == streamed.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(previous_response_id=first.id, input="Hello?", **greedy)
    unstored = oai.responses.create(input="Hi.", store=False, **greedy)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
