"""Prompt lookup at full strength (luce_runtime.ngram_cache): llama.cpp's n-gram counts and thresholds, the context
before the counts, the counts of earlier generations where the context has no match, lookup before a draft model.
No model: the drafters only read token ids."""

from __future__ import annotations

import pytest
from luce_runtime.ngram_cache import FirstOf, LookupDrafter, NgramCache
from luce_runtime.speculative import Draft

pytestmark = pytest.mark.unit


def test_counts_follow_common_ngram_cache_update():
    cache = NgramCache(ngram_min=1, ngram_max=2)
    cache.update([1, 2, 3, 1, 2, 4])
    assert cache.counts[(1, 2)] == {3: 1, 4: 1} and cache.counts[(2,)] == {3: 1, 4: 1}
    assert cache.counts[(3, 1)] == {2: 1} and (4,) not in cache.counts  # nothing follows the last token
    cache.update([1, 2, 3, 1, 2, 4, 1, 2], new=2)  # only the n-grams ending at the 2 new tokens
    assert cache.counts[(4, 1)] == {2: 1} and cache.counts[(1,)] == {2: 3}


def test_thresholds_are_llama_cpps_lax_and_strict():
    cache = NgramCache()
    cache.update([7, 8, 9] * 2)  # (7, 8) → 9 twice: 2 samples, 100%
    assert cache.next_token([5, 7, 8], strict=False) == 9
    assert cache.next_token([5, 7, 8], strict=True) is None  # strict: a 2-gram needs 3 samples, a 1-gram 4
    cache.update([7, 8, 9] * 3, new=3)
    assert cache.next_token([5, 7, 8], strict=True) == 9
    split = NgramCache(ngram_min=1, ngram_max=1)
    split.update([1, 2, 1, 3, 1, 2])  # (1,) → 2 twice, 3 once: 67% of 3
    assert split.next_token([1], strict=False) == 2  # lax 1-gram: ≥ 2 samples, ≥ 66%
    assert split.next_token([1], strict=True) is None  # strict 1-gram: ≥ 4 samples
    assert split.draft([4, 1], 3, strict=False) == [2]  # then (2,) → 1 once: below the lax 2 samples


def test_lookup_copies_the_context_first_then_uses_earlier_generations():
    shared = NgramCache()
    first = LookupDrafter(shared)
    # the context's most recent 2-gram match, continued by copying
    assert first.propose([5, 6, 7, 8, 9, 5, 6], 3).tokens == [7, 8, 9]
    first.propose([5, 6, 7, 8, 9] * 4 + [30, 31, 32], 2)  # (8,) → 9 four times: the strict 1-gram threshold
    first.reset()  # its tokens go into the shared counts
    assert len(shared) > 0
    second = LookupDrafter(shared)
    # no 2-gram of this history repeats in it, and its 1-grams are seen once: only the shared counts can draft
    assert LookupDrafter().propose([40, 41, 8], 2).tokens == []
    got = second.propose([40, 41, 8], 2).tokens
    assert got == [9, 5], got  # (8,) → 9, then (8, 9) → 5 three times of three


class Fixed:
    name = "fixed"

    def __init__(self, tokens):
        self.tokens, self.calls, self.resets = tokens, 0, 0

    def propose(self, history, k, sampler):
        self.calls += 1
        return Draft(self.tokens[:k], fed=1)

    def reset(self):
        self.resets += 1


def test_first_of_drafts_with_the_model_only_where_lookup_finds_nothing():
    model = Fixed([11, 12])
    chain = FirstOf(LookupDrafter(), model)
    assert chain.propose([1, 2, 3, 1, 2], 2, None).tokens == [3, 1] and model.calls == 0
    assert chain.propose([1, 2, 3, 4], 2, None).tokens == [11, 12] and model.calls == 1
    chain.reset()
    assert model.resets == 1 and chain.name == "lookup+fixed"
