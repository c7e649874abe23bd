"""Speculative decoding in `luce-compile serve` (--spec ngram, --draft DRAFT_ART), through the HTTP API.

Lossless: at temperature 0 a speculating request returns the tokens the same request returns with speculation
turned off ("speculative": false, the per-request opt-out), alone, batched beside other requests, and under a
grammar. The artifacts are float32 (smol_artifact), so verify (prefill GEMMs) and decode (GEMVs) differ only in float
rounding. The draft model is a random-weight tiny Llama with SmolLM2's vocabulary: nearly every draft is rejected,
which exercises rollback and the target's replacement token on every step.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.codegen.conftest import compiled, tiny  # noqa: F401  (fixtures: the draft model)
from tests.serve.conftest import API_KEY, Server
from tests.serve.process import serve_process

pytestmark = pytest.mark.slow

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "one, two, three, four, five, six, seven,",
    "The capital of France is",
    "Rewrite this list in reverse order: apple, banana, cherry, date.\nAnswer:",
]


def _serve(artifact: Path, *extra: str):
    return serve_process(["serve", str(artifact), "--api-key", API_KEY, "--max-batch", "4", "--ctx", "512",
                          *extra])


@pytest.fixture(scope="module")
def ngram_server(smol_artifact: Path):
    with _serve(smol_artifact, "--spec", "ngram", "--draft-max", "6") as (url, proc, health):
        yield Server(url, health["model"], proc)


@pytest.fixture(scope="module")
def draft_server(smol_artifact: Path, tiny):  # noqa: F811
    with _serve(smol_artifact, "--draft", str(tiny("tiny-llama").artifact), "--draft-max", "4") as (url, proc, h):
        yield Server(url, h["model"], proc)


def _client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _metrics(server: Server) -> dict[str, float]:
    text = server.get("/metrics")
    return {m[1]: float(m[2]) for m in re.finditer(r"^(luce_spec_\w+) (\S+)$", text, re.M)}


def _complete(server: Server, prompt: str, speculative: bool, **kw) -> tuple[str, list[str], list[float]]:
    """(text, the generated tokens' pieces, their logprobs) of a completion, with or without speculation."""
    r = _client(server).completions.create(model=server.model, prompt=prompt, max_tokens=kw.pop("max_tokens", 40),
                                           temperature=kw.pop("temperature", 0), logprobs=0,
                                           extra_body={"speculative": speculative}, **kw)
    lp = r.choices[0].logprobs
    return r.choices[0].text, lp.tokens, lp.token_logprobs


def _idle(server: Server) -> None:
    """Nothing left running, and no page held but the cached prompts' (rejected drafts were rolled back)."""
    s = server.wait_idle()
    assert s["running"] == 0 and s["failed"] == 0 and s["kv_pages_used"] <= s["kv_prefix_pages"]


def _same(a: tuple[str, list[str], list[float]], b: tuple[str, list[str], list[float]]) -> None:
    assert a[0] == b[0] and a[1] == b[1]
    # the logprobs come from the verify's rows (prefill kernels) or the decode's: float rounding apart
    assert max((abs(x - y) for x, y in zip(a[2], b[2], strict=True)), default=0.0) < 1e-3


@pytest.mark.parametrize("which", ["ngram_server", "draft_server"])
def test_greedy_speculation_through_http_gives_plain_decodings_tokens(which, request):
    server: Server = request.getfixturevalue(which)
    before = _metrics(server)
    for prompt in PROMPTS:
        steps = _metrics(server)["luce_spec_steps_total"]
        plain = _complete(server, prompt, speculative=False)
        assert _metrics(server)["luce_spec_steps_total"] == steps  # the opted-out request never reached a drafter
        _same(_complete(server, prompt, speculative=True), plain)
    after = _metrics(server)
    assert after["luce_spec_drafted_tokens_total"] > before["luce_spec_drafted_tokens_total"]
    assert after["luce_spec_steps_total"] > before["luce_spec_steps_total"]
    accepted = after["luce_spec_accepted_tokens_total"] - before["luce_spec_accepted_tokens_total"]
    assert 0 <= accepted <= after["luce_spec_drafted_tokens_total"] - before["luce_spec_drafted_tokens_total"]
    if which == "ngram_server":  # SmolLM2 continues the code and the count by copying: prompt lookup pays
        assert accepted > 0
    _idle(server)


def test_speculating_requests_batched_with_plain_ones_give_their_alone_tokens(ngram_server):
    alone = {(p, s): _complete(ngram_server, p, s) for p in PROMPTS[:2] for s in (True, False)}
    with ThreadPoolExecutor(len(alone)) as pool:
        together = dict(zip(alone, pool.map(lambda key: _complete(ngram_server, *key), alone), strict=True))
    for key, got in together.items():
        _same(got, alone[key])
        _same(got, alone[(key[0], False)])
    _idle(ngram_server)


def test_grammar_constrained_request_speculates_within_its_grammar(ngram_server):
    client = _client(ngram_server)

    def ask(speculative: bool) -> tuple[str, str]:
        r = client.chat.completions.create(
            model=ngram_server.model, temperature=0, max_tokens=80, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "List three fruits and their colours as JSON."}],
            extra_body={"speculative": speculative})
        return r.choices[0].message.content, r.choices[0].finish_reason

    before = _metrics(ngram_server)["luce_spec_drafted_tokens_total"]
    (plain, plain_end), (spec, spec_end) = ask(False), ask(True)
    assert (spec, spec_end) == (plain, plain_end)
    if spec_end == "stop":  # the grammar ended it: one whole JSON object
        assert isinstance(json.loads(spec), dict)
    assert _metrics(ngram_server)["luce_spec_drafted_tokens_total"] > before


def test_sampled_speculation_streams_and_counts(draft_server):
    """Above temperature 0 the tokens differ from plain sampling's (the drafter draws from the same Generator); the
    distribution equality is tests/runtime/test_speculative.py's chi-square, over the same judge()."""
    stream = _client(draft_server).chat.completions.create(
        model=draft_server.model, temperature=0.8, seed=3, max_tokens=24, stream=True,
        messages=[{"role": "user", "content": "Count from one to ten."}])
    chunks = [c for c in stream]
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    _idle(draft_server)


def test_the_opt_out_field_is_accepted_by_every_api_and_checked(ngram_server):
    import urllib.error
    import urllib.request

    def post(path: str, body: dict) -> int:
        req = urllib.request.Request(ngram_server.url + path, json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "x-api-key": API_KEY})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    model = ngram_server.model
    assert post("/v1/messages", {"model": model, "max_tokens": 4, "speculative": False,
                                 "messages": [{"role": "user", "content": "Hi"}]}) == 200
    assert post("/v1/responses", {"model": model, "max_output_tokens": 4, "speculative": False,
                                  "input": "Hi"}) == 200
    assert post("/v1/completions", {"model": model, "max_tokens": 4, "speculative": "no", "prompt": "Hi"}) == 400
