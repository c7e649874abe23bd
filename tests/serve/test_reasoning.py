"""A thinking model's reasoning in each API's shape, in-process on SmolLM2 with a Qwen3-style template whose
generation prompt opens the <think> block (as DeepSeek-R1's and Qwen3-Thinking's do): SmolLM2 never closes it, so
what it writes is all reasoning, unless the request turns thinking off (the template then writes an empty block)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_artifact):
    from fastapi.testclient import TestClient
    from luce_runtime.serve.app import ServeOptions, Service, create_app

    options = ServeOptions(artifact=smol_artifact, max_batch=2, max_context=512, temperature=0.0)
    service = Service(options)
    service.tokenizer.chat_template = THINKING_TEMPLATE
    service.thinks = True
    with TestClient(create_app(options, service)) as c:
        c.model = service.model_id
        yield c


def events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_chat_reasoning_content(client):
    body = {"model": client.model, "messages": ASK, "max_tokens": 12}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        deltas = [c["choices"][0]["delta"] for c in events(r) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    off = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in off.json()["choices"][0]["message"]


def test_anthropic_thinking_blocks(client):
    body = {"model": client.model, "messages": ASK, "max_tokens": 12, "thinking": {"type": "enabled",
                                                                                  "budget_tokens": 1024}}
    content = client.post("/v1/messages", json=body).json()["content"]
    assert content[0]["type"] == "thinking" and content[0]["thinking"]
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        evs = events(r)
    start = next(e for e in evs if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "thinking"
    text = "".join(e["delta"]["thinking"] for e in evs if e["type"] == "content_block_delta")
    assert text == content[0]["thinking"]
    plain = client.post("/v1/messages", json={k: v for k, v in body.items() if k != "thinking"}).json()["content"]
    assert [b["type"] for b in plain] == ["text"]  # Anthropic's default: no thinking


@pytest.mark.parametrize("summary", [True, False])
def test_responses_reasoning_item(client, summary):
    body = {"model": client.model, "input": "What is the capital of France?", "max_output_tokens": 12,
            **({"reasoning": {"summary": "auto"}} if summary else {})}
    item = client.post("/v1/responses", json=body).json()["output"][0]
    part = (item["summary"] if summary else item["content"])[0]
    assert item["type"] == "reasoning" and part["type"] == ("summary_text" if summary else "reasoning_text")
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        evs = events(r)
    kind = "response.reasoning_summary_text.delta" if summary else "response.reasoning_text.delta"
    assert "".join(e["delta"] for e in evs if e["type"] == kind) == part["text"]
    assert evs[-1]["response"]["output"][0]["type"] == "reasoning"
