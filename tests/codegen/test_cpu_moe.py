"""qwen3moe compiled for the CPU: the f32 build against the float64 oracle, the int8 build against the oracle with
llama.cpp's activation rounding emulated (graph/rounding.GgmlRounding, experts included), and the int8 build against
llama.cpp itself on the same GGUF.

Models: tiny-qwen3moe (Q8_0, 8 experts, 2 used) and the same with K-quant rows (n_embd, n_ff_exp, q heads 256): Q4_K
experts and attention, Q6_K ffn_down_exps and Q5_0 attn_v as in a Q4_K_M mix, so one input is quantized as Q8_K and
Q8_0.
Tolerances are checks.py's: REL_TOL for f32; REL_TOL_INT8_FIRST for the int8 prefill and first step, REL_TOL_INT8
for the steps after (a float32 activation on an 8-bit rounding boundary flips, tests/schedules/test_cpu_int8_model.py
says why). The prompts are fixed (seeded): an expert choice is one more thing a boundary flip could change, and these
prompts were measured clear of both (6e-8-4e-7 on every row, 2026-12-06), so the check cannot flake; a kernel that
reads the wrong expert or rows is O(1) off. The llama.cpp bar is the weight types' (test_int8_vs_llama_cpp.py): the
greedy id agrees at >= 97% of positions, a disagreement a near tie for us.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.checks import REL_TOL_INT8, REL_TOL_INT8_FIRST
from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import GgmlRounding
from luce_compile.synthetic import N_VOCAB, cached_synthetic, preset
from tests.codegen._reference import check_against_oracle, engine_logits, rel_err
from tests.conftest import requires_llama_cpp

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

K_QUANT_MIX = {"attn_v.weight": "Q5_0", "ffn_down_exps.weight": "Q6_K"}
SPECS = {
    "tiny-qwen3moe": preset("tiny-qwen3moe"),
    "k-quants": dataclasses.replace(preset("tiny-qwen3moe"), n_embd=256, n_ff_exp=256, head_dim=64, quant="Q4_K",
                                    quant_overrides=K_QUANT_MIX),
}


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, N_VOCAB, n)]


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory):
    from luce_runtime.engine import Engine, EngineOptions

    from luce_compile.codegen.compile import compile_model

    built = {}

    def get(name: str):
        if name not in built:
            gguf = cached_synthetic(SPECS[name])
            art = compile_model(gguf, "cpu", tmp_path_factory.mktemp("moe") / name, precision="int8")
            built[name] = gguf, Engine(art, EngineOptions(max_batch=1, max_context=256, megakernel=False))
        return built[name]

    return get


def test_f32_build_matches_oracle(tiny, oracle_of, engine_of):
    model = tiny("tiny-qwen3moe")
    result = check_against_oracle("tiny-qwen3moe f32", engine_of(model), oracle_of(model), _prompt(0, 20), 16)
    assert result.steps == 16 and result.ids_matched >= 8


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length", [1, 24])
def test_int8_build_follows_emulated_rounding(name, length, int8_build):
    gguf, engine = int8_build(name)
    prompt = _prompt(length, length)
    oracle = GgmlRounding(gguf)
    want, fed = [oracle.prefill(prompt)[-1]], []
    for _ in range(6):
        fed.append(int(np.argmax(want[-1])))
        want.append(oracle.decode(fed[-1]))
    got = engine_logits(engine, prompt, fed)
    errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
    plain = rel_err(got[0], Oracle(gguf).prefill(prompt)[-1])
    print(f"{name}, {length}-token prompt: rel errors per row {np.array(errors)}, prefill vs the plain oracle {plain}")
    assert errors[0] <= REL_TOL_INT8_FIRST < plain, "the int8 prefill follows the emulated rounding"
    assert errors[1] <= REL_TOL_INT8_FIRST, "the first int8 step follows the emulated rounding"
    assert max(errors) <= REL_TOL_INT8
    assert [int(np.argmax(g)) for g in got[:-1]] == fed


@requires_llama_cpp
@pytest.mark.parametrize("name", list(SPECS))
def test_int8_build_agrees_with_llama_cpp(name, int8_build):
    from tests.graph.test_vs_llama_cpp import _llama, greedy_agreement

    gguf, engine = int8_build(name)
    agree, total = greedy_agreement(engine, _llama(gguf, exact_kv=True))
    print(f"{name}: greedy ids agree with llama.cpp at {agree}/{total} positions")
    assert agree / total >= 0.97, (agree, total)


def test_int8_batched_decode_equals_each_sequence_alone(int8_build):
    """Three sequences decoded in one batch (their rows routed to different experts in one call) give each sequence's
    logits alone: every expert row is the int8 GEMV's value for its token, whatever the batch (BATCH_TOL)."""
    from luce_runtime.engine import Engine, EngineOptions

    from luce_compile.checks import BATCH_TOL

    gguf, alone_engine = int8_build("k-quants")
    batched = Engine(alone_engine.artifact.root, EngineOptions(max_batch=4, max_context=256, megakernel=False))
    prompts = [_prompt(seed, n) for seed, n in ((7, 5), (8, 11), (9, 3))]
    seqs = [batched.add_sequence() for _ in prompts]
    rows = batched.prefill(seqs, prompts)
    tokens = [[int(np.argmax(r))] for r in rows]
    for _ in range(4):
        rows = batched.decode(seqs, [t[-1] for t in tokens])
        for t, r in zip(tokens, rows, strict=True):
            t.append(int(np.argmax(r)))
    for prompt, toks, last in zip(prompts, tokens, rows, strict=True):
        alone = engine_logits(alone_engine, prompt, toks[:-1])
        assert rel_err(last, alone[-1].astype(np.float64)) <= BATCH_TOL
