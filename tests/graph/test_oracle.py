"""The float64 oracle: KV-cache steps equal a longer prefill, each op against an independent formulation (explicit
loops, torch, closed-form rotations), the sliding window's receptive field, and the SmolLM2 anchor token."""

from __future__ import annotations

import math

import numpy as np
import pytest

from luce_compile.errors import LuceError
from luce_compile.gguf.reader import read_gguf
from luce_compile.graph import build_graph
from luce_compile.graph.oracle import Oracle, attention, gelu_tanh, rms_norm, rope, silu
from tests.graph.conftest import TINY

# float64 executes the same sums in a different grouping (one row vs many): agreement is ~1e-14 (measured 3e-14)
INCREMENTAL_ATOL = 1e-10


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, n)


@pytest.mark.unit
@pytest.mark.parametrize("preset", TINY)
def test_prefill_then_decode_equals_longer_prefill(synthetic, preset):
    oracle = Oracle(synthetic(preset))
    tokens = _tokens(14)  # tiny-gemma3's window is 8: decoding crosses it
    full = oracle.prefill(tokens)
    assert full.shape == (14, oracle.config.n_vocab) and full.std() > 1.0  # logits with real spread
    oracle.prefill(tokens[:10])
    steps = np.stack([oracle.decode(t) for t in tokens[10:]])
    np.testing.assert_allclose(steps, full[10:], rtol=0, atol=INCREMENTAL_ATOL)
    assert oracle.n_past == 14


@pytest.mark.unit
def test_chunked_forward_equals_prefill(synthetic):
    oracle = Oracle(synthetic("tiny-gemma3"))
    tokens = _tokens(17, seed=1)
    full = oracle.prefill(tokens)
    oracle.reset()
    chunks = [oracle.forward(tokens[a:b]) for a, b in ((0, 5), (5, 12), (12, 17))]
    np.testing.assert_allclose(np.concatenate(chunks), full, rtol=0, atol=INCREMENTAL_ATOL)


@pytest.mark.unit
def test_tree_forward_gives_each_node_its_paths_logits_and_leaves_the_cache(synthetic):
    """The tree verify reference: a chain is forward(); a branch's node gets the logits of its own path decoded
    after the prefix (not of the sibling before it), and the sequence is as it was afterwards."""
    oracle = Oracle(synthetic("tiny-qwen2"))
    prompt, t = _tokens(6), [int(x) for x in _tokens(5, seed=2)]
    oracle.prefill(prompt)
    chain = oracle.tree_forward(t[:3], [-1, 0, 1])
    assert oracle.n_past == 6
    tree = oracle.tree_forward(t, [-1, 0, 0, 2, 1])
    assert oracle.n_past == 6
    plain = oracle.forward(t[:3])
    np.testing.assert_allclose(chain, plain, rtol=0, atol=INCREMENTAL_ATOL)
    np.testing.assert_allclose(tree[:2], plain[:2], rtol=0, atol=INCREMENTAL_ATOL)
    oracle.prefill(prompt)
    branch = oracle.forward([t[0], t[2], t[3]])  # nodes 0, 2, 3: the second branch's path
    np.testing.assert_allclose(tree[[0, 2, 3]], branch, rtol=0, atol=INCREMENTAL_ATOL)
    assert np.abs(tree[2] - plain[2]).max() > 1e-3  # node 2 is not the chain's third token
    oracle.prefill(prompt)
    np.testing.assert_allclose(tree[4], oracle.forward([t[0], t[1], t[4]])[-1], rtol=0, atol=INCREMENTAL_ATOL)


@pytest.mark.unit
def test_oracle_accepts_graph_path_or_file(synthetic):
    path = synthetic("tiny-qwen3")
    tokens = _tokens(4)
    a = Oracle(path).prefill(tokens)
    b = Oracle(read_gguf(path)).prefill(tokens)
    c = Oracle(build_graph(read_gguf(path))).prefill(tokens)
    assert np.array_equal(a, b) and np.array_equal(a, c)


@pytest.mark.unit
def test_generate_is_greedy_argmax_chain(synthetic):
    oracle = Oracle(synthetic("tiny-llama"))
    prompt = [int(t) for t in _tokens(5)]
    out = oracle.generate(prompt, 4)
    ids = list(prompt)
    for _ in range(4):  # without the cache: recompute the whole sequence each step
        ids.append(int(np.argmax(oracle.prefill(ids)[-1])))
    assert out == ids[5:]
    sampled = oracle.generate(prompt, 6, greedy=False, temperature=0.8, seed=3)
    assert sampled == oracle.generate(prompt, 6, greedy=False, temperature=0.8, seed=3)
    assert all(0 <= t < oracle.config.n_vocab for t in sampled)


@pytest.mark.unit
def test_bad_inputs_raise(synthetic):
    oracle = Oracle(synthetic("tiny-llama"))
    with pytest.raises(LuceError, match="outside the vocabulary"):
        oracle.prefill([1, 49152])
    with pytest.raises(LuceError, match="at least one token"):
        oracle.prefill([])
    graph = build_graph(read_gguf(synthetic("tiny-llama")))
    graph.source = None
    with pytest.raises(LuceError, match="no source GGUF"):
        Oracle(graph)


@pytest.mark.unit
def test_sliding_window_receptive_field(synthetic):
    """Every layer local (pattern 0), window w, L layers: position t sees token 0 iff t ≤ L·(w − 1)."""
    oracle = Oracle(synthetic("tiny-gemma3", sliding_window_pattern=0))
    assert all(op.attrs["sliding_window"] == 8 for op in oracle.graph.attention_ops())
    reach = oracle.config.n_layer * (8 - 1)  # 21
    tokens = _tokens(reach + 8, seed=2)
    base = oracle.prefill(tokens)
    tokens[0] = (tokens[0] + 1) % 49152
    moved = np.abs(oracle.prefill(tokens) - base).max(axis=-1)
    assert (moved[: reach + 1] > 1e-9).all()
    assert (moved[reach + 1:] == 0).all()


@pytest.mark.unit
def test_rope_closed_form():
    x = np.array([1.0, 0.0, 0.0, 2.0]).reshape(1, 1, 1, 4)  # (B,S,H,D)
    pos = np.array([[3]])
    # NORM: pair (x0, x1) at theta = 3, pair (x2, x3) at theta = 3 · base^(-2/4) = 0.03
    out = rope(x, pos, "norm", 4, 10000.0, 1.0)[0, 0, 0]
    np.testing.assert_allclose(out, [math.cos(3), math.sin(3), -2 * math.sin(0.03), 2 * math.cos(0.03)])
    # NEOX: pairs (x0, x2) and (x1, x3)
    out = rope(x, pos, "neox", 4, 10000.0, 1.0)[0, 0, 0]
    np.testing.assert_allclose(out, [math.cos(3), -2 * math.sin(0.03), math.sin(3), 2 * math.cos(0.03)])


@pytest.mark.unit
def test_rope_layouts_relate_by_permutation_and_are_relative():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 16))
    pos = rng.integers(0, 1000, (2, 5))
    evens_then_odds = np.r_[0:16:2, 1:16:2]
    norm = rope(x, pos, "norm", 16, 1e4, 0.5)
    neox = rope(x[..., evens_then_odds], pos, "neox", 16, 1e4, 0.5)
    np.testing.assert_allclose(norm[..., evens_then_odds], neox, atol=1e-12)
    # q·k after RoPE depends only on the distance between positions
    q, k = x[:1, :1], x[1:, :1]
    dots = [np.sum(rope(q, np.array([[m]]), "neox", 16, 1e4, 1.0) * rope(k, np.array([[m - 7]]), "neox", 16, 1e4, 1.0))
            for m in (7, 50, 900)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)
    # freq_factors divide each frequency: factors of 2 everywhere equal freq_scale 0.5; partial rotation keeps the rest
    np.testing.assert_allclose(rope(x, pos, "norm", 16, 1e4, 1.0, np.full(8, 2.0)), norm, atol=1e-12)
    part = rope(x, pos, "neox", 8, 1e4, 1.0)
    assert np.array_equal(part[..., 8:], x[..., 8:])


def _attention_loops(q, k, v, q_pos, k_pos, scale, window, softcap):
    """One query, one head at a time, with Python's math: the textbook definition."""
    b_n, s_n, h_n, _ = q.shape
    rep = h_n // k.shape[2]
    out = np.zeros((b_n, s_n, h_n, v.shape[3]))
    for b in range(b_n):
        for s in range(s_n):
            for h in range(h_n):
                scores = []
                for j in range(k.shape[1]):
                    d = q_pos[b, s] - k_pos[b, j]
                    if d < 0 or (window and d >= window):
                        continue
                    raw = float(np.dot(q[b, s, h], k[b, j, h // rep]))
                    raw = softcap * math.tanh(raw / softcap) if softcap else raw
                    scores.append((raw * scale, j))
                top = max(sc for sc, _ in scores)
                z = sum(math.exp(sc - top) for sc, _ in scores)
                for sc, j in scores:
                    out[b, s, h] += math.exp(sc - top) / z * v[b, j, h // rep]
    return out.reshape(b_n, s_n, -1)


@pytest.mark.unit
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (4, 2.5)])
def test_attention_against_loops(window, softcap):
    rng = np.random.default_rng(window)
    q, k, v = rng.standard_normal((2, 4, 6, 8)), rng.standard_normal((2, 9, 2, 8)), rng.standard_normal((2, 9, 2, 5))
    k_pos = np.tile(np.arange(9), (2, 1))
    q_pos = k_pos[:, 5:] - np.array([[0], [1]])  # the second sequence's queries sit one position earlier
    got = attention(q, k, v, q_pos, k_pos, 0.3, window, softcap)
    np.testing.assert_allclose(got, _attention_loops(q, k, v, q_pos, k_pos, 0.3, window, softcap), atol=1e-12)


@pytest.mark.unit
def test_activations_and_norm_against_torch():
    torch = pytest.importorskip("torch")
    x = np.linspace(-12, 12, 2001)
    t = torch.from_numpy(x)
    np.testing.assert_allclose(gelu_tanh(x), torch.nn.functional.gelu(t, approximate="tanh").numpy(), atol=1e-14)
    np.testing.assert_allclose(silu(x), torch.nn.functional.silu(t).numpy(), atol=1e-14)
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((3, 32)), rng.standard_normal(32)
    ref = torch.nn.functional.rms_norm(torch.from_numpy(h), (32,), torch.from_numpy(w), eps=1e-6).numpy()
    np.testing.assert_allclose(rms_norm(h, w, 1e-6), ref, atol=1e-13)


@pytest.mark.slow
def test_smollm2_anchor(smollm2_path):
    """llama.cpp's reference: "The capital of France is" (no BOS) → " Paris" (7042)."""
    logits = Oracle(smollm2_path).prefill([504, 3575, 282, 4649, 314])
    assert int(np.argmax(logits[-1])) == 7042
