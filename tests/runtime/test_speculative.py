"""Speculative decoding (luce_runtime.speculative) on compiled tiny models: verify scores every fed token as decode
steps would, greedy speculation gives the ids plain decoding gives, the KV caches after it are plain decoding's, and
sampled speculation has the target's distribution (chi-square against the exact distribution).

The draft models share the target's vocabulary (every synthetic model has SmolLM2's tokenizer): the target's own
spec quantized to Q4_0 (close to it: some drafts rejected, many accepted), and the spec with another seed (an
unrelated network: nearly every draft rejected). All artifacts are float32 (tests/codegen's `compiled`), so the
verify (prefill GEMMs) and decode (GEMVs) paths differ only in float rounding (TOL, as test_engine_api.py)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from luce_runtime.sampler import Sampler, SamplingParams
from luce_runtime.speculative import (
    CATCH_UP,
    Draft,
    DraftLength,
    DraftModel,
    NgramDrafter,
    SpecError,
    SpeculativeDecoder,
    accept,
    check_same_vocabulary,
)

TOL = 1e-5
OPTIONS = {"max_batch": 4, "max_context": 256, "prefill_chunk": 64}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@pytest.fixture()
def target(tiny, engine_of):
    engine = engine_of(tiny("tiny-llama"), **OPTIONS)
    yield engine
    for seq in engine.sequences():
        engine.remove_sequence(seq)


@pytest.fixture()
def drafts(tiny, engine_of, target):
    """name → a draft Engine with the target's vocabulary; "self" is the target's artifact (every draft accepted)."""
    models = {"q4": tiny("tiny-llama", quant="Q4_0"), "other": tiny("tiny-llama", seed=1), "self": tiny("tiny-llama")}
    engines = {name: engine_of(model, **OPTIONS) for name, model in models.items()}
    yield engines
    for engine in engines.values():
        for seq in engine.sequences():
            engine.remove_sequence(seq)


def prompts(rng: np.random.Generator, vocab: int, count: int) -> list[list[int]]:
    """Random prompts, every other one a short random phrase repeated (where prompt lookup finds matches)."""
    out = []
    for i in range(count):
        n = int(rng.integers(3, 7)) if i % 2 else int(rng.integers(5, 24))
        words = [int(t) for t in rng.integers(0, vocab, n)]
        out.append(words * int(rng.integers(2, 5)) if i % 2 else words)
    return out


def drafter_of(name: str, target, drafts):
    return NgramDrafter() if name == "ngram" else DraftModel(drafts[name], target)


# ---- the engine's verify ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_verify_scores_every_fed_token_as_decode_steps_do(target, rng):
    seq = target.add_sequence()
    target.prefill([seq], [[int(t) for t in rng.integers(0, target.vocab_size, 21)]])
    fed = [int(t) for t in rng.integers(0, target.vocab_size, 7)]
    want = np.stack([target.decode([seq], [t])[0] for t in fed])
    target.rollback(seq, len(fed))
    (got,) = target.verify([seq], [fed])
    assert got.shape == (7, target.vocab_size) and target.length(seq) == 28
    assert rel_err(got, want) < TOL
    target.rollback(seq, 4)  # the rejected tail of a verify goes as any tokens do
    assert rel_err(target.decode([seq], [fed[3]])[0], want[3]) < TOL
    target.rollback(seq, 1)
    (ids,) = target.verify_greedy([seq], [fed[3:]])  # greedy speculation's form: only the rows' argmax
    assert ids == np.argmax(want[3:], axis=-1).tolist() and target.length(seq) == 28
    with pytest.raises(Exception, match="longer than the prefill chunk"):
        target.verify([seq], [[1] * (target.prefill_chunk + 1)])


@pytest.mark.e2e
def test_tree_verify_scores_each_path_as_decoding_it_and_commits_one(target, rng):
    """Two branches in one forward (TVM's tree attention mask): every row equals decoding its own path alone, and
    after committing one path the cache holds that path only (the next step scores as a fresh prefill of it)."""
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, 19)]
    t0, a, b, c, d = (int(t) for t in rng.integers(0, target.vocab_size, 5))
    paths = {1: [t0, a, c], 2: [t0, b, d]}  # node order: t0, a, b, c, d; parents -1, 0, 0, 1, 2
    want = {}
    with target.sequence() as ref:
        target.prefill([ref], [prompt])
        for path in paths.values():
            want[tuple(path)] = np.stack([target.decode([ref], [t])[0] for t in path])
            target.rollback(ref, len(path))
    seq = target.add_sequence()
    target.prefill([seq], [prompt])
    rows = target.verify_tree(seq, [t0, a, b, c, d], [-1, 0, 0, 1, 2])
    assert rows.shape == (5, target.vocab_size) and target.length(seq) == 24
    assert rel_err(rows[[0, 1, 3]], want[(t0, a, c)]) < TOL and rel_err(rows[[0, 2, 4]], want[(t0, b, d)]) < TOL
    target.commit_tree(seq, 4)  # keep t0 → b → d
    assert target.length(seq) == 22
    nxt = int(rng.integers(0, target.vocab_size))
    got = target.decode([seq], [nxt])[0]
    with target.sequence() as fresh:
        assert rel_err(got, target.prefill([fresh], [[*prompt, t0, b, d, nxt]])[0]) < TOL
    with pytest.raises(Exception, match="token tree"):
        target.verify_tree(seq, [1, 2], [-1, 1])


# ---- drafters and acceptance, no model -------------------------------------------------------------------------------
@pytest.mark.unit
def test_ngram_drafter_copies_what_followed_the_longest_recent_match():
    d = NgramDrafter(ngram_max=3)
    assert d.propose([5, 6, 7, 8, 9, 1, 6, 7], 3).tokens == [8, 9, 1]  # 2-gram (6, 7) matched
    # the most recent of two matches of the longest n-gram
    assert d.propose([1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3], 2).tokens == [5, 9]
    # a loop shorter than k repeats itself (the copy reads what it appended)
    assert d.propose([4, 1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]
    assert d.propose([1, 2, 3], 4).tokens == [] and d.propose([7], 4).tokens == []


@pytest.mark.unit
def test_draft_length_grows_on_full_acceptance_and_shrinks_otherwise():
    length = DraftLength(draft_max=6)
    assert length.k == 4
    length.update(4, 4)
    assert length.k == 6
    length.update(6, 6)
    assert length.k == 6
    for _ in range(8):
        length.update(6, 2)
    assert length.k == 1
    length.update(0, 0)  # a step without drafts says nothing about acceptance
    assert length.k == 1
    with pytest.raises(SpecError, match="draft-max"):
        DraftLength(draft_max=0)


def _measured(decode: float, row: float, draft: float, draft_max: int = 8) -> DraftLength:
    length = DraftLength(draft_max=draft_max)
    length.observe("decode", decode)
    length.observe("verify", decode + 3 * row, drafts=3)
    length.observe("draft", 3 * draft, drafts=3)
    assert length.measured
    return length


@pytest.mark.unit
def test_draft_length_with_measured_costs_drafts_where_it_pays_and_decodes_plainly_where_not():
    # rows nearly free (a GPU) and drafts accepted: draft as far as allowed
    length = _measured(decode=1.0, row=0.02, draft=0.0)
    for _ in range(10):
        length.update(length.k, length.k)
    assert length.k == 8
    # a draft model costing half a step per token and rows another half (this 2-core CPU): at a = 0.9,
    # E(k) / T(k) = (1 - 0.9^(k+1)) / 0.1 / (1 + k) < 1 for every k >= 1, so plain decoding
    length = _measured(decode=1.0, row=0.5, draft=0.5)
    for _ in range(30):
        length.update(10, 9)
    assert 0.85 < length.acceptance < 0.95 and length.k == 0
    for _ in range(3 * DraftLength.PROBE_EVERY):  # nothing to probe for: even full acceptance would gain < 6%
        length.update(0, 0)
        assert length.k == 0


@pytest.mark.unit
def test_draft_length_probes_after_a_run_of_plain_steps_and_recovers():
    length = _measured(decode=1.0, row=0.3, draft=0.0)
    for _ in range(20):
        length.update(4, 0)  # nothing accepted: drafting does not pay
    assert length.k == 0
    ks = []
    for _ in range(DraftLength.PROBE_EVERY):
        length.update(0, 0)
        ks.append(length.k)
    assert ks[:-1] == [0] * (DraftLength.PROBE_EVERY - 1) and ks[-1] == DraftLength.PROBE_K
    for _ in range(30):  # the text turned predictable: every draft accepted
        length.update(max(length.k, 1), max(length.k, 1))
    assert length.k >= 4


@pytest.mark.unit
def test_draft_length_times_a_plain_step_after_its_first_timed_drafts():
    length = DraftLength(draft_max=6)
    length.observe("draft", 0.3, drafts=3)
    length.update(3, 3)
    assert length.k == 0  # a plain step to time
    length.observe("decode", 1.0)
    length.update(0, 0)
    assert length.k >= 1 and not length.measured
    length.observe("verify", 1.5, drafts=1)
    length.update(1, 1)
    assert length.measured


@pytest.mark.unit
def test_draft_length_ignores_timings_it_cannot_use():
    length = DraftLength(draft_max=4)
    length.observe("verify", 1.0, drafts=2)  # no decode step timed yet: no row cost
    length.observe("draft", 1.0, drafts=0)
    assert not length.measured
    length.update(4, 4)
    assert length.k == 4  # the heuristic until measured


@pytest.mark.unit
def test_greedy_acceptance_is_the_longest_match_then_the_targets_token():
    rows = np.full((4, 6), -1.0, dtype=np.float32)
    rows[0, 2] = rows[1, 3] = rows[2, 0] = rows[3, 5] = 1.0  # the target's argmax after each fed token
    greedy = Sampler(SamplingParams(temperature=0))
    assert accept(rows, Draft([2, 3, 0]), greedy, [1]) == (3, 5)
    assert accept(rows, Draft([2, 4, 0]), greedy, [1]) == (1, 3)
    assert accept(rows, Draft([1, 3, 0]), greedy, [1]) == (0, 2)


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's goodness of fit; cells expected < 5 times are pooled into one (the test's usual condition)."""
    import torch

    n = counts.sum()
    expected = expected_probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a draw where the target puts no mass
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.unit
def test_rejection_sampling_gives_the_target_distribution():
    """accept() alone on a 6-token vocabulary: whatever q the draft came from (a point mass, a close or a far
    distribution), the first emitted token is distributed as p; the plain draft is not (the test can fail)."""
    logits = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]] * 2, dtype=np.float32))
    p = logits[0].astype(np.float64)
    p = np.exp(p) / np.exp(p).sum()
    trials = 6000
    for q in (None, np.array([0.3, 0.3, 0.2, 0.1, 0.05, 0.05]), np.array([0.02, 0.03, 0.05, 0.1, 0.3, 0.5])):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
        counts, drafted = np.zeros(6), np.zeros(6)
        for _ in range(trials):
            d = 4 if q is None else int(sampler.rng.choice(6, p=q))
            n, token = accept(logits, Draft([d], None if q is None else [q]), sampler, [])
            counts[d if n else token] += 1
            drafted[d] += 1
        assert chi_square_p_value(counts, p) > 1e-3, (q, counts / trials)
        if q is not None and np.abs(q - p).max() > 0.1:
            assert chi_square_p_value(drafted, p) < 1e-6  # the same test rejects the draft's own distribution


# ---- speculation on compiled models ----------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("name", ["ngram", "q4", "other", "self"])
def test_greedy_speculation_gives_plain_decodings_ids(name, target, drafts, rng):
    decoder = SpeculativeDecoder(target, drafter_of(name, target, drafts), draft_max=6, timed_length=False)
    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in prompts(rng, target.vocab_size, 24):
        assert list(decoder.generate(prompt, params)) == list(target.generate(prompt, params)), prompt
    stats = decoder.stats
    assert target.sequences() == {} and all(not e.sequences() for e in drafts.values())
    assert stats.steps > 0 and stats.drafted > 0
    # each drafter reaches the paths it should: full acceptance, rejections, both
    expect = {"ngram": 0 < stats.accepted < stats.drafted, "q4": 0 < stats.accepted < stats.drafted,
              "other": stats.accepted < stats.drafted / 4, "self": stats.accepted == stats.drafted}
    assert expect[name], stats


@pytest.mark.e2e
def test_lookup_cache_before_the_draft_model_gives_plain_decodings_ids(target, drafts, rng):
    """ngram_cache: prompt lookup with the counts of earlier generations, the draft model where lookup finds
    nothing; one drafter across the prompts, as a decoder keeps it."""
    from luce_runtime.ngram_cache import FirstOf, LookupDrafter, NgramCache

    shared = NgramCache()
    decoder = SpeculativeDecoder(target, FirstOf(LookupDrafter(shared), DraftModel(drafts["q4"], target)),
                                 draft_max=6, timed_length=False)
    params = SamplingParams(temperature=0, max_tokens=32)
    for prompt in prompts(rng, target.vocab_size, 8):
        assert list(decoder.generate(prompt, params)) == list(target.generate(prompt, params)), prompt
    assert len(shared) > 0 and 0 < decoder.stats.accepted < decoder.stats.drafted, decoder.stats
    assert target.sequences() == {} and not drafts["q4"].sequences()


@pytest.mark.e2e
def test_greedy_tree_speculation_gives_plain_decodings_ids(target, drafts, rng):
    """A draft model's token tree (its runner-up as a sibling wherever its distribution is flat), verified in one
    forward and committed along the target's greedy path: plain decoding's ids, branches accepted off the draft's
    own chain, and nothing left in either cache."""
    decoder = SpeculativeDecoder(target, DraftModel(drafts["q4"], target, branch=0.05), draft_max=4,
                                 timed_length=False)
    params = SamplingParams(temperature=0, max_tokens=32)
    for prompt in prompts(rng, target.vocab_size, 8):
        assert list(decoder.generate(prompt, params)) == list(target.generate(prompt, params)), prompt
    stats = decoder.stats
    assert stats.tree_steps > 0 and stats.branch_accepted > 0 and stats.accepted < stats.drafted, stats
    assert target.sequences() == {} and not drafts["q4"].sequences()


@pytest.mark.e2e
def test_draft_length_from_measured_costs_keeps_plain_decodings_ids(target, drafts, rng):
    """The default draft length (timed steps, plain steps where drafting does not pay) changes when the target
    verifies, never what it commits."""
    decoder = SpeculativeDecoder(target, drafter_of("q4", target, drafts), draft_max=6)
    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in prompts(rng, target.vocab_size, 8):
        assert list(decoder.generate(prompt, params)) == list(target.generate(prompt, params)), prompt
    assert decoder.length.measured and decoder.stats.drafted > 0, decoder.stats


@pytest.mark.e2e
def test_a_draft_models_prompt_prefill_is_not_timed_as_drafting(target, drafts, rng, monkeypatch):
    """The draft model's first proposal of a generation prefills the prompt (and the first token) into its own
    cache: that is no drafting cost, and learning it as one (an exponential average over every draft) had the draft
    length decide that drafts cost about a target step each and stop drafting for good (benchmarks/README.md,
    2026-12-04). Likewise the catch-up after a run of plain steps, which the draft model did not see; the
    steady-state proposals (1-2 tokens fed) are timed."""
    decoder = SpeculativeDecoder(target, drafter_of("q4", target, drafts), draft_max=4)
    timed: list[int] = []
    observe = decoder.length.observe
    monkeypatch.setattr(decoder.length, "observe", lambda kind, seconds, drafts=0: (
        timed.append(drafts) if kind == "draft" and drafts else None, observe(kind, seconds, drafts)))
    fed: list[int] = []
    propose = decoder.drafter.propose
    monkeypatch.setattr(decoder.drafter, "propose", lambda *a: (d := propose(*a), fed.append(d.fed))[0])
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, 30)]
    list(decoder.generate(prompt, SamplingParams(temperature=0, max_tokens=24)))
    assert fed[0] == len(prompt) + 1 and all(n >= 1 for n in fed[1:]), fed
    steady = [n for n in fed if n <= CATCH_UP]
    assert steady and len(timed) == len(steady), (fed, timed)  # every steady-state proposal timed, and only those


@pytest.mark.e2e
def test_stops_end_speculation_where_they_end_plain_decoding(target, drafts, rng):
    """A stop token or stop string inside a step's accepted drafts ends the output there, as in plain decoding."""
    decoder = SpeculativeDecoder(target, drafter_of("self", target, drafts), draft_max=6,  # every draft accepted
                                 timed_length=False)
    prompt = [int(t) for t in rng.integers(0, target.vocab_size, 10)]
    full = list(target.generate(prompt, SamplingParams(temperature=0, max_tokens=30)))
    stop_token = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(full[13],))
    text = next(t for j in range(17, 28) if (t := target.tokenizer.decode(full[j:j + 2])).strip())
    stop_text = SamplingParams(temperature=0, max_tokens=30, stop=text)
    for params in (stop_token, stop_text):
        want = list(target.generate(prompt, params))
        assert len(want) < len(full) and list(decoder.generate(prompt, params)) == want
    assert decoder.stats.accepted > 0


@pytest.mark.e2e
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_speculation_are_plain_decodings(temperature, target, drafts, rng):
    """Step by step on a sequence we own: after every step the target's cache holds the committed history but its
    last token (the next input) and scores the next token as a fresh prefill of that history does; the draft model's
    cache, re-synced, drafts what a fresh draft sequence drafts."""
    drafter = DraftModel(drafts["q4"], target)
    decoder = SpeculativeDecoder(target, drafter, draft_max=5, timed_length=False)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3))
    history = [int(t) for t in rng.integers(0, target.vocab_size, 9)]
    seq = target.add_sequence()
    history.append(sampler.sample(target.prefill([seq], [history])[0], history))
    while len(history) < 60:
        history += decoder.step(seq, history, sampler, 100)
        assert target.length(seq) == len(history) - 1
    assert decoder.stats.accepted < decoder.stats.drafted  # rejections were rolled back
    got = target.decode([seq], [history[-1]])[0]
    with target.sequence() as fresh:
        assert rel_err(got, target.prefill([fresh], [history])[0]) < TOL
    greedy = Sampler(SamplingParams(temperature=0))
    fresh_drafter = DraftModel(drafts["q4"], target)
    try:
        assert drafter.propose(history, 4, greedy).tokens == fresh_drafter.propose(history, 4, greedy).tokens
        assert drafts["q4"].length(drafter._seq) == len(history) + 3  # all of history, then 3 of the 4 drafts
    finally:
        drafter.reset()
        fresh_drafter.reset()


class PointDrafter:
    """A deterministic drafter, as prompt lookup is (its q a point mass on each draft), that drafts the Q4_0 model's
    greedy tokens: prompt lookup's path through accept(), with drafts the target often takes (a random tiny model's
    samples rarely repeat the prompt, so prompt lookup itself would draft nothing here)."""

    name = "point"

    def __init__(self, model: DraftModel):
        self.model, self.greedy = model, Sampler(SamplingParams(temperature=0))

    def propose(self, history, k: int, sampler: Sampler) -> Draft:
        return Draft(self.model.propose(history, k, self.greedy).tokens)

    def reset(self) -> None:
        self.model.reset()


@pytest.mark.e2e
def test_sampled_speculation_has_the_targets_distribution(target, drafts):
    """The first two sampled tokens of many seeds (t2 is the first speculated one), with the Q4_0 draft model (drafts
    accepted with p/q or resampled from max(p - q, 0)) and with point-mass drafts, against the target's exact joint
    distribution of (t1, t2) under top_k=3: 9 cells, computed from one prefill and three decodes. (The unrelated
    draft model's top 3 miss the target's, so it would only reach the resampling: the unit test above has a far q.)"""
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3)
    prompt = [17, 400, 9, 17, 400, 9, 17, 400]
    plain = Sampler(params)
    with target.sequence() as seq:
        p1 = plain.distribution(target.prefill([seq], [prompt])[0], prompt)
    joint: dict[tuple[int, int], float] = {}
    for t1 in np.flatnonzero(p1):
        with target.sequence() as seq:
            target.prefill([seq], [prompt])
            p2 = plain.distribution(target.decode([seq], [int(t1)])[0], [*prompt, int(t1)])
        joint |= {(int(t1), int(t2)): float(p1[t1] * p2[t2]) for t2 in np.flatnonzero(p2)}
    cells = sorted(joint)
    for drafter in (DraftModel(drafts["q4"], target), PointDrafter(DraftModel(drafts["q4"], target))):
        decoder = SpeculativeDecoder(target, drafter, draft_max=2, timed_length=False)
        seen = Counter(tuple(list(decoder.generate(prompt, replace(params, seed=seed)))[:2]) for seed in range(1000))
        assert set(seen) <= set(cells), (drafter.name, seen)
        counts = np.array([seen[c] for c in cells], dtype=np.float64)
        assert chi_square_p_value(counts, np.array([joint[c] for c in cells])) > 1e-3, (drafter.name, seen, joint)
        assert 0 < decoder.stats.accepted < decoder.stats.drafted, drafter.name


# ---- refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_draft_model_with_another_vocabulary_is_refused(tiny, target, tmp_path):
    from luce_runtime.artifact import MANIFEST
    from luce_runtime.engine import Engine, EngineOptions

    art = tmp_path / "other-vocab"
    shutil.copytree(tiny("tiny-llama", quant="Q4_0").artifact, art)
    tokenizer = art / json.loads((art / MANIFEST).read_text())["tokenizer"]
    meta = json.loads(tokenizer.read_text())
    tokens = meta["tokenizer.ggml.tokens"]
    tokens[100], tokens[101] = tokens[101], tokens[100]  # same size, two ids swapped: still another vocabulary
    tokenizer.write_text(json.dumps(meta))
    draft = Engine(art, EngineOptions(max_batch=1, max_context=64), verify=False)
    with pytest.raises(SpecError, match="another vocabulary.*first difference at id 100.*ngram"):
        DraftModel(draft, target)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["ngram", "q4"])
def test_a_sliding_window_target_speculates_with_plain_decodings_ids(name, tiny, engine_of, rng):
    """tiny-gemma3 (window 8) on the CPU build, whose prefill kernels window the cached keys: its verify takes up to
    the window's tokens of a sequence (Engine.verify_limit), chains only (no trees on sliding layers), and its
    rollbacks of rejected drafts go past the window (TVM 0.27 keeps every page): generations of 40 tokens, far past
    the window, are plain decoding's. Its own Q4_0 as the draft model rolls back past the window too."""
    target = engine_of(tiny("tiny-gemma3"), **OPTIONS)
    assert target.sliding_window == 8 and target.verify_limit == 8 and not target.verifies_trees
    drafter = NgramDrafter() if name == "ngram" else DraftModel(engine_of(tiny("tiny-gemma3", quant="Q4_0"),
                                                                          **OPTIONS), target, branch=0.05)
    decoder = SpeculativeDecoder(target, drafter, draft_max=12, timed_length=False)
    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in prompts(rng, target.vocab_size, 8):
        assert list(decoder.generate(prompt, params)) == list(target.generate(prompt, params)), prompt
    assert target.sequences() == {}
    assert 0 < decoder.stats.accepted < decoder.stats.drafted, decoder.stats


@pytest.mark.e2e
def test_a_sliding_window_target_verifying_one_token_a_call_is_refused(tiny, engine_of, monkeypatch):
    """A build whose prefill kernels do not window the cached keys (a CUDA build's: one token a call past the first
    chunk) and with no megakernel rows verifies one token a call: speculation is refused, with the reason."""
    engine = engine_of(tiny("tiny-gemma3"), **OPTIONS)
    monkeypatch.setattr(engine, "contract", replace(engine.contract, sliding_prefill_chunks=False))
    assert engine.verify_limit == 1 and engine.verify_budget == 0
    with pytest.raises(SpecError, match="sliding-window layers and verifies one token a call"):
        SpeculativeDecoder(engine, NgramDrafter())


# ---- the command line ------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_run_with_speculation_prints_the_same_ids_and_its_counts(tiny, capsys):
    from luce_compile.cli import main

    art, draft = str(tiny("tiny-llama").artifact), str(tiny("tiny-llama", quant="Q4_0").artifact)
    runs = {}
    for name, extra in [("plain", []), ("ngram", ["--spec", "ngram", "--draft-max", "3"]),
                        ("draft", ["--draft", draft])]:
        assert main(["run", art, "-p", "one two one two one two one", "-n", "24", "--json", *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert "spec" not in runs["plain"]
    for name in ("ngram", "draft"):
        assert runs[name]["ids"] == runs["plain"]["ids"]
        spec = runs[name]["spec"]
        assert set(spec) == {"drafted", "accepted", "steps"} and 0 <= spec["accepted"] <= spec["drafted"]
        assert spec["steps"] + spec["accepted"] == len(runs["plain"]["ids"]) - 1  # the first token is the prefill's


@pytest.mark.e2e
def test_bench_compares_plain_and_speculative_decoding_in_one_run(tiny, capsys):
    from luce_compile.cli import main

    art, draft = str(tiny("tiny-llama").artifact), str(tiny("tiny-llama", quant="Q4_0").artifact)
    for extra in (["--spec", "ngram"], ["--draft", draft, "--draft-max", "4"]):
        assert main(["bench", art, "--gen-len", "12", "--json", *extra]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["identical"] and d["tokens"] > 0 and d["plain_tok_s"] > 0 and d["spec_tok_s"] > 0
        assert d["speedup"] == pytest.approx(d["spec_tok_s"] / d["plain_tok_s"])
        assert d["tokens_per_step"] == pytest.approx((d["accepted"] + d["steps"]) / d["steps"])


# ---- a draft short of the target's padded ids (Qwen2.5-7B's 152,064 rows over its 0.5B's 151,936) --------------------
class _Vocab:
    """What check_same_vocabulary and DraftModel read of an engine: its logits, its tokenizer's tokens, and (as a
    draft) decode steps whose logits favour token 3."""

    def __init__(self, tokens: list[str], rows: int | None = None):
        self.vocab_size = rows or len(tokens)
        self.verify_rows_at_decode_cost = 2
        self.fed: list[int] = []
        self.artifact = SimpleNamespace(root=f"art{self.vocab_size}",
                                        tokenizer_metadata=lambda: {"tokenizer.ggml.tokens": tokens})

    def add_sequence(self) -> int:
        return 0

    def rollback(self, seq: int, n: int) -> None:
        del self.fed[len(self.fed) - n:]

    def _logits(self, toks) -> list[np.ndarray]:  # noqa: ANN001
        self.fed += list(toks)
        logits = np.zeros(self.vocab_size, np.float32)
        logits[3] = 2.0
        return [logits]

    def decode(self, seqs, toks):  # noqa: ANN001
        return self._logits(toks)

    def verify(self, seqs, rows):  # noqa: ANN001
        return [np.stack(self._logits(rows[0]) * len(rows[0]))]

    prefill = decode


@pytest.mark.unit
def test_a_draft_may_stop_short_of_the_targets_padded_ids_never_go_past_them():
    words = [f"t{i}" for i in range(300)]
    target = _Vocab(words + [f"<pad{i}>" for i in range(128)])  # 428 ids
    check_same_vocabulary(target, _Vocab(words))  # 128 fewer, the same tokens below: a padded family
    with pytest.raises(SpecError, match="at most 128 fewer, never more"):
        check_same_vocabulary(target, _Vocab(words[:299]))  # 129 fewer
    with pytest.raises(SpecError, match="at most 128 fewer, never more"):
        check_same_vocabulary(_Vocab(words), target)  # the draft past the target's
    swapped = list(words)
    swapped[7], swapped[8] = swapped[8], swapped[7]
    with pytest.raises(SpecError, match="another vocabulary.*first difference at id 7"):
        check_same_vocabulary(target, _Vocab(swapped))


@pytest.mark.unit
def test_a_shorter_drafts_distributions_cover_the_targets_ids_and_its_padded_ids_stop_it():
    words = [f"t{i}" for i in range(300)]
    target, draft_engine = _Vocab(words + [f"<pad{i}>" for i in range(28)]), _Vocab(words)
    drafter = DraftModel(draft_engine, target)
    sampler = Sampler(SamplingParams(temperature=0.7, seed=1))
    draft = drafter.propose([5, 6, 7], 3, sampler)
    assert len(draft.tokens) == 3 and all(q.shape == (328,) for q in draft.probs)
    assert all(q[300:].sum() == 0 and q[:300].sum() > 0.99 for q in draft.probs)  # the target's padded ids: 0
    rows = np.zeros((4, 328), np.float32)
    accept(rows, draft, sampler, [5, 6, 7])  # p - q over the target's ids: the shapes meet
    # a history holding an id the draft does not have (a padded one): nothing is drafted, nothing fed
    fed = len(draft_engine.fed)
    assert drafter.propose([5, 6, 7, 310], 3, sampler).tokens == [] and len(draft_engine.fed) == fed
