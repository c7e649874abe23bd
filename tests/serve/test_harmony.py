"""gpt-oss through the server: harmony's analysis channel as each API's reasoning, its final channel as content and
its commentary calls as tool calls, streamed and not, on tiny-gptoss compiled for the CPU (in-process).

tiny-gptoss has random weights, so most tests script the reply: Service.submit is replaced by one that queues the
events the scheduler would send for a fixed harmony reply (each token's text as the server decodes it). Those drive
the routes' real code from the request to the answer, and the prompts they render are kept for the effort and
history checks. The last test lets the model generate and checks the answers' shape only."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ANSWER = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
          "<|message|>Hello there!")
CALL = ("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather of a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gptoss_artifact(tmp_path_factory):
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    return compile_model(cached_synthetic("tiny-gptoss"), "cpu", tmp_path_factory.mktemp("gptoss") / "gptoss.cpu")


@pytest.fixture(scope="module")
def served(gptoss_artifact):
    from fastapi.testclient import TestClient
    from luce_runtime.serve.app import ServeOptions, Service, create_app

    options = ServeOptions(artifact=gptoss_artifact, max_batch=2, max_context=1024, temperature=0.0)
    service = Service(options)
    with TestClient(create_app(options, service)) as c:
        yield c, service


class _Done:
    """A scripted request: already finished, so cancelling it does nothing."""

    def cancel(self) -> None:
        pass


@pytest.fixture
def scripted(served, monkeypatch):
    """(client, prompts, set_reply): the service answers every request with the reply set last."""
    from luce_runtime.serve.scheduler import Event
    from luce_runtime.tokenizer import StreamDecoder

    client, service = served
    tok, prompts, reply = service.tokenizer, [], {"text": ANSWER}

    def submit(prompt, params, n=1, top_logprobs=None, constraints=(), speculative=True):
        prompts.append(tok.decode(prompt, special=True))
        ids = tok.encode(reply["text"], add_special=False, parse_special=True)
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(n):
            decoder = StreamDecoder(tok, strip_leading_space=False)
            for t in ids:
                queue.put_nowait(Event("delta", i, decoder.feed(t), token=t))
            queue.put_nowait(Event("delta", i, decoder.flush()))
            queue.put_nowait(Event("done", i, finish_reason="stop", prompt_tokens=len(prompt),
                                   completion_tokens=len(ids)))
        return queue, [_Done() for _ in range(n)]

    monkeypatch.setattr(service, "submit", submit)
    return client, prompts, lambda text: reply.update(text=text)


def _events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def _stream(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return _events(r)


def test_chat_reasoning_content_and_tool_calls(scripted):
    client, prompts, reply = scripted
    body = {"model": "m", "messages": ASK, "reasoning_effort": "high"}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets me.", "Hello there!")
    assert "Reasoning: high" in prompts[-1]
    deltas = [c["choices"][0]["delta"] for c in _stream(client, "/v1/chat/completions", body) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets me."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there!"
    reply(CALL)
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "reasoning_effort": "minimal"}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "I need the weather."
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert "Reasoning: low" in prompts[-1] and "type get_weather" in prompts[-1]
    chunks = _stream(client, "/v1/chat/completions", body)
    calls = [d["tool_calls"][0] for c in chunks if c["choices"] for d in [c["choices"][0]["delta"]]
             if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_history_reasoning_is_dropped_as_the_template_does(scripted):
    client, prompts, _ = scripted
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    loop = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Tool first.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": loop, "tools": TOOLS})
    assert "<|channel|>analysis<|message|>Tool first.<|end|>" in prompts[-1]  # the tool loop keeps its reasoning
    done = [*loop, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Said it."},
            {"role": "user", "content": "Thanks"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": done, "tools": TOOLS})
    assert "Tool first." not in prompts[-1] and "Said it." not in prompts[-1] and "final<|message|>Sunny." in \
        prompts[-1]


def test_anthropic_thinking_blocks_and_tool_use(scripted):
    client, prompts, reply = scripted
    body = {"model": "m", "max_tokens": 64, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 20000}}
    content = client.post("/v1/messages", json=body).json()["content"]
    assert content == [{"type": "thinking", "thinking": "The user greets me.", "signature": ""},
                       {"type": "text", "text": "Hello there!"}]
    assert "Reasoning: high" in prompts[-1]
    evs = _stream(client, "/v1/messages", body)
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert starts == ["thinking", "text"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user greets me."
    assert "".join(d.get("text", "") for d in deltas) == "Hello there!"
    reply(CALL)
    body = {"model": "m", "max_tokens": 64, "messages": ASK, "tools": ANTHROPIC_TOOLS}
    answer = client.post("/v1/messages", json=body).json()
    assert "Reasoning: low" in prompts[-1]  # Anthropic's default is no thinking: the least gpt-oss does
    assert [b["type"] for b in answer["content"]] == ["thinking", "tool_use"] and answer["stop_reason"] == "tool_use"
    assert (answer["content"][1]["name"], answer["content"][1]["input"]) == ("get_weather", {"city": "Paris"})
    evs = _stream(client, "/v1/messages", body)
    assert [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"] == ["thinking", "tool_use"]
    partial = "".join(e["delta"].get("partial_json", "") for e in evs if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}


@pytest.mark.parametrize("summary", [False, True])
def test_responses_reasoning_items_and_function_calls(scripted, summary):
    client, prompts, reply = scripted
    body = {"model": "m", "input": "Hi", "reasoning": {"effort": "low", **({"summary": "auto"} if summary else {})}}
    output = client.post("/v1/responses", json=body).json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"] and "Reasoning: low" in prompts[-1]
    part = (output[0]["summary"] if summary else output[0]["content"])[0]
    assert part["text"] == "The user greets me." and output[1]["content"][0]["text"] == "Hello there!"
    evs = _stream(client, "/v1/responses", body)
    kind = "response.reasoning_summary_text.delta" if summary else "response.reasoning_text.delta"
    assert "".join(e["delta"] for e in evs if e["type"] == kind) == "The user greets me."
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == "Hello there!"
    reply(CALL)
    output = client.post("/v1/responses", json={**body, "tools": RESPONSES_TOOLS}).json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "function_call"]
    assert (output[1]["name"], json.loads(output[1]["arguments"])) == ("get_weather", {"city": "Paris"})
    evs = _stream(client, "/v1/responses", {**body, "tools": RESPONSES_TOOLS})
    done = evs[-1]["response"]["output"]
    assert [o["type"] for o in done] == ["reasoning", "function_call"]


def test_responses_tool_loop_sends_its_reasoning_back(scripted):
    """Codex's loop: the reasoning item it sends back goes with its function_call, so the template shows it (gpt-oss
    keeps a tool loop's reasoning); a reasoning item before an answered turn is dropped by the template."""
    client, prompts, _ = scripted
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Tool first."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    loop = [{"role": "user", "content": "Weather?"}, reasoning, call,
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    client.post("/v1/responses", json={"model": "m", "input": loop, "tools": RESPONSES_TOOLS})
    assert "<|channel|>analysis<|message|>Tool first.<|end|><|start|>assistant to=functions.get_weather" in prompts[-1]
    answered = [*loop, {**reasoning, "summary": [{"type": "summary_text", "text": "Said it."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
                {"role": "user", "content": "Thanks"}]
    client.post("/v1/responses", json={"model": "m", "input": answered, "tools": RESPONSES_TOOLS})
    assert "Tool first." not in prompts[-1] and "Said it." not in prompts[-1]
    assert "<|channel|>final<|message|>Sunny.<|end|>" in prompts[-1]
    client.post("/v1/responses", json={"model": "m", "input": [{"role": "user", "content": "Hi"}, reasoning]})
    assert prompts[-1].endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")  # reasoning alone: no turn


def test_generated_replies_have_each_api_shape(served):
    """The model itself (random weights): whatever it writes comes back in each API's shape; with a tool required
    and an enum-only schema, the grammar leaves it a harmony call or reasoning cut at max_tokens."""
    client, _ = served
    enum_tool = [{"type": "function", "function": {"name": "pick", "description": "Pick one", "parameters": {
        "type": "object", "properties": {"v": {"enum": ["a", "b"]}}, "required": ["v"],
        "additionalProperties": False}}}]
    body = {"model": "m", "messages": ASK, "max_tokens": 24, "tools": enum_tool, "tool_choice": "required"}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = choice["message"]
    assert set(message) <= {"role", "content", "reasoning_content", "tool_calls"}
    if message.get("tool_calls"):
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["v"] in ("a", "b")
    else:
        assert choice["finish_reason"] == "length"
    chunks = _stream(client, "/v1/chat/completions", {**body, "tool_choice": "auto"})
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    answer = client.post("/v1/messages", json={"model": "m", "max_tokens": 16, "messages": ASK}).json()
    assert answer["content"] and {b["type"] for b in answer["content"]} <= {"thinking", "text", "tool_use"}
    output = client.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 16}).json()
    assert output["output"] and {o["type"] for o in output["output"]} <= {"reasoning", "message", "function_call"}


def test_openai_template_renders_what_the_server_prepares():
    """gpt-oss's own template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja, read from the llama-cpp-python
    sdist the benchmarks pin; not copied here) takes the messages as prepare_chat passes them: the effort, the tools
    as TypeScript, reasoning kept on the trailing tool-call turn and dropped once an answer follows."""
    import tarfile

    from luce_runtime.chat import render_chat
    from luce_runtime.tools import HARMONY, Tool, prepare_chat, tool_format

    from tests.bench._load import load_benchmark_module

    peer = load_benchmark_module("peers/llama_server")
    with tarfile.open(peer.find_sdist()) as tar:
        template = tar.extractfile(f"{peer.VENDOR}models/templates/openai-gpt-oss-120b.jinja").read().decode()
    assert tool_format(template) is HARMONY
    weather = Tool("get_weather", "The weather", TOOLS[0]["function"]["parameters"])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    loop = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, extra = prepare_chat(HARMONY, loop, [weather])
    prompt = render_chat(template, messages, **extra, reasoning_effort="high")
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt and "city: string" in prompt
    assert "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.get_weather" \
        '<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>' in prompt
    assert prompt.endswith('<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')
    done = [*loop, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}, *ASK]
    prompt = render_chat(template, *prepare_chat(HARMONY, done, [weather])[:1])
    assert "Use the tool." not in prompt and "Easy." not in prompt and "<|channel|>final<|message|>Sunny.<|end|>" \
        in prompt
