"""luce_runtime.sampler: the llama.cpp chain (penalties → top_k → top_p → min_p → temperature → dist), checked
against hand-computed arithmetic, an independent torch log-softmax, and many seeded draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from luce_runtime.errors import LuceError
from luce_runtime.sampler import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    find_stop,
    logprobs,
    masked_argmax,
    sample_batch,
    unpack_mask,
)

pytestmark = pytest.mark.unit

# Five tokens with probabilities 0.5, 0.2, 0.15, 0.1, 0.05 at temperature 1 (cumulative 0.5, 0.7, 0.85, 0.95, 1).
PROBS = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # shifted: softmax does not care, penalties would


def _draws(params: SamplingParams, logits: np.ndarray, n: int = 6000) -> np.ndarray:
    sampler = Sampler(params)
    return np.bincount([sampler.sample(logits) for _ in range(n)], minlength=logits.shape[-1]) / n


def _random_logits(seed: int, vocab: int = 1000) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * 3).astype(np.float32)


def test_greedy_is_argmax():
    for seed in range(20):
        x = _random_logits(seed)
        assert Sampler(SamplingParams(temperature=0, top_p=0.5, seed=seed)).sample(x) == int(np.argmax(x))
        assert Sampler(SamplingParams(temperature=0)).sample(x[None, :]) == int(np.argmax(x))


def test_top_k_1_is_greedy_at_any_temperature():
    for seed in range(20):
        x = _random_logits(seed)
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed)).sample(x) == int(np.argmax(x))


def test_same_seed_replays_and_another_seed_differs():
    x = _random_logits(0, vocab=50)
    runs = [[Sampler(SamplingParams(seed=s)) for s in (7, 7, 8)]]
    seqs = [[s.sample(x) for _ in range(200)] for s in runs[0]]
    assert seqs[0] == seqs[1]
    assert seqs[0] != seqs[2]
    assert len(set(seqs[0])) > 10  # really sampling, not stuck on one token


def test_plain_sampling_follows_softmax():
    freq = _draws(SamplingParams(seed=1), LOGITS)
    np.testing.assert_allclose(freq, PROBS, atol=0.025)  # 6000 draws: sigma <= 0.0065


def test_top_p_keeps_the_nucleus_only():
    freq = _draws(SamplingParams(top_p=0.8, seed=2), LOGITS)  # 0.5 + 0.2 < 0.8 <= 0.85: keep three
    assert freq[3] == freq[4] == 0
    np.testing.assert_allclose(freq[:3], PROBS[:3] / 0.85, atol=0.03)


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    freq = _draws(SamplingParams(min_p=0.25, seed=3), LOGITS)  # keep p >= 0.125: three tokens
    assert freq[3] == freq[4] == 0
    np.testing.assert_allclose(freq[:3], PROBS[:3] / 0.85, atol=0.03)


def test_top_k_keeps_k_most_probable():
    freq = _draws(SamplingParams(top_k=2, seed=4), LOGITS)
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], PROBS[:2] / 0.7, atol=0.03)


def test_truncation_happens_before_temperature():
    # llama.cpp's order: top_p picks the set at T=1, then T flattens only what is left.
    probs = Sampler(SamplingParams(temperature=2.0, top_p=0.8)).distribution(LOGITS)
    kept = np.exp(LOGITS[:3].astype(np.float64) / 2)
    np.testing.assert_allclose(probs, np.r_[kept / kept.sum(), 0, 0], rtol=1e-6)


@pytest.mark.parametrize("vocab", [50_000, 262_144])
@pytest.mark.parametrize("scale", [8.0, 4.0, 0.5])  # nucleus within the 256 / the 4096 most probable / neither
def test_top_p_large_vocab_matches_a_full_sort(vocab: int, scale: float):
    x = (np.random.default_rng(vocab).standard_normal(vocab) * scale).astype(np.float32)
    probs = Sampler(SamplingParams(top_p=0.9)).distribution(x)
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    n_keep = int(np.searchsorted(np.cumsum(p[order]), 0.9)) + 1
    assert set(np.flatnonzero(probs)) == set(order[:n_keep].tolist())
    assert int(np.searchsorted([256, 4096], n_keep, side="right")) == [8.0, 4.0, 0.5].index(scale)  # each path
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-9)


def test_chunked_draw_over_a_large_vocab_follows_softmax():
    # Mass in the first chunk, a middle chunk and the short last chunk (10000 = 9 * 1024 + 784).
    x = np.full(10_000, -30.0, np.float32)
    x[[5, 3000, 9999]] = [1.0, 0.0, 0.5]
    freq = _draws(SamplingParams(seed=11), x, n=3000)
    want = Sampler(SamplingParams()).distribution(x)
    assert freq.sum() == freq[[5, 3000, 9999]].sum()
    np.testing.assert_allclose(freq[[5, 3000, 9999]], want[[5, 3000, 9999]], atol=0.035)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0))
    np.testing.assert_array_equal(s.penalized(x, [0, 1, 1, 4]), [1.0, -2.0, 0.5, 3.0, 0.0])
    window = Sampler(SamplingParams(repetition_penalty=2.0, repeat_last_n=1))
    np.testing.assert_array_equal(window.penalized(x, [0, 1]), [2.0, -2.0, 0.5, 3.0, 0.0])
    off = Sampler(SamplingParams(repetition_penalty=2.0, repeat_last_n=0))
    np.testing.assert_array_equal(off.penalized(x, [0, 1]), x)


def test_presence_and_frequency_penalties_count_the_whole_history():
    x = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, repeat_last_n=1))
    np.testing.assert_allclose(s.penalized(x, [2, 2, 2, 3]), [2.0, -1.0, 0.5 - 2.5, 3.0 - 1.5])
    both = Sampler(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5))  # repetition first, as llama.cpp
    np.testing.assert_allclose(both.penalized(x, [0]), [2.0 / 2 - 0.5, -1.0, 0.5, 3.0])


def test_penalty_changes_the_greedy_choice():
    x = np.array([1.0, 3.0, 2.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=2.0)).sample(x, [1]) == 2


def test_sample_batch_matches_per_sequence_samplers():
    logits = np.stack([_random_logits(i, vocab=300) for i in range(4)])
    params = [SamplingParams(temperature=0), SamplingParams(seed=5, top_k=20), SamplingParams(seed=6, top_p=0.9),
              SamplingParams(temperature=0, repetition_penalty=1.3)]
    hist = [[1, 2], [3], [], [int(np.argmax(logits[3]))]]
    got = sample_batch([Sampler(p) for p in params], logits, hist)
    want = [Sampler(p).sample(row, h) for p, row, h in zip(params, logits, hist, strict=True)]
    assert got.tolist() == want and got.dtype == np.int64
    greedy = sample_batch([Sampler(SamplingParams(temperature=0))] * 4, logits)
    assert greedy.tolist() == np.argmax(logits, axis=-1).tolist()


def test_logprobs_against_torch():
    x = _random_logits(9, vocab=500)
    ref = torch.log_softmax(torch.from_numpy(x).double(), dim=-1).numpy()
    lp = logprobs(x, chosen=17, k=5)
    assert lp.token_id == 17 and lp.logprob == pytest.approx(ref[17], abs=1e-12)
    top_ids = np.argsort(-ref)[:5]
    assert [i for i, _ in lp.top] == top_ids.tolist()
    np.testing.assert_allclose([v for _, v in lp.top], ref[top_ids], atol=1e-12)
    assert logprobs(x, chosen=0).top == []


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2},
    {"top_k": 2.5}, {"min_p": 1.1}, {"repetition_penalty": 0.0}, {"repeat_last_n": -2},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"seed": -1}, {"max_tokens": 0}, {"stop": ["ok", ""]},
    {"stop_token_ids": [-1]}, {"top_k": True},
])
def test_bad_params_are_refused(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(SamplingParamsError, match=rf"sampling: {name}=.* is invalid; expected"):
        SamplingParams(**kwargs)


def test_params_normalize_and_errors_are_value_errors():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3])
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3)
    assert issubclass(SamplingParamsError, ValueError) and issubclass(SamplingParamsError, LuceError)


def test_bad_inputs_to_sample():
    s = Sampler(SamplingParams(seed=0))
    with pytest.raises(LuceError, match="NaN"):
        s.sample(np.array([0.0, np.nan], np.float32))
    with pytest.raises(SamplingParamsError, match="outside"):
        s.sample(np.zeros(4, np.float32) + np.arange(4), [4])
    with pytest.raises(ValueError, match="sample_batch"):
        s.sample(np.ones((2, 4), np.float32))


def test_find_stop():
    assert find_stop("Hello###world", ["###"]) == (5, 5)
    assert find_stop("a END b STOP", ["STOP", "END"]) == (2, 2)  # the earliest one wins
    assert find_stop("Hello ##", ["###"]) == (None, 6)  # "##" may become "###": hold it back
    assert find_stop("Hello", ["###", "lo!"]) == (None, 3)
    assert find_stop("plain", []) == (None, 5)


def test_masked_argmax_takes_the_best_allowed_token_by_bit():
    """Packed masks as llguidance writes them (token t = bit t % 32 of int32 word t // 32, bit 31 the sign bit):
    each row's argmax over its set bits, the lowest index on ties, -1 where no bit is set; tokens past the words
    are not allowed. Checked against a loop over the tokens on fresh random rows."""
    rng = np.random.default_rng(7)
    vocab = 70  # three words, the last one partial
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    logits[0, [3, 40]] = 9.0  # a tie: the lower index
    words = rng.integers(-2**31, 2**31, (6, 3), dtype=np.int64).astype(np.int32)
    words[0], words[1], words[2] = -1, 0, [0, 0, 1 << 5]  # all; none; only token 2 * 32 + 5 = 69
    words[3] = [-2**31, 0, 0]  # bit 31 alone: token 31
    for w in (words, words[:, :2]):  # without the third word, tokens 64-69 are not allowed
        bit = np.array([[t // 32 < w.shape[1] and bool((int(w[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                        for r in range(6)])
        assert (unpack_mask(w, vocab) == bit).all()
        want = [max(np.flatnonzero(b), key=lambda t, r=r: (logits[r, t], -t)) if b.any() else -1
                for r, b in enumerate(bit)]
        assert masked_argmax(logits, w).tolist() == want
    assert masked_argmax(logits, words)[:4].tolist() == [3, -1, 69, 31]
