"""Prompt lookup at full strength: n-grams from the request's own prompt and output, then from earlier requests.

The anchor is llama.cpp's ngram cache (common/ngram-cache.cpp, `llama-lookup`): a map from an n-gram (1-4 tokens) to
the counts of the tokens that followed it, kept for the current context and, across generations, as a "dynamic"
cache; a token is drafted from the longest n-gram whose followers are frequent and agree enough (their
draft_min_sample_size / draft_min_percent thresholds: lax for the context, strict for the dynamic cache), one token
at a time, each drafted token extending the n-gram for the next. What differs here, measured on the code-edit
prompts before (benchmarks/README.md): the context is searched first as NgramDrafter does (the continuation of the
most recent match of the longest n-gram, copied: an edit's unchanged lines copy whole), and the counts are only
asked where the context has no match of at least two tokens. llama.cpp's static cache (counts from a large corpus)
has no counterpart: no corpus ships with an artifact.

    shared = NgramCache()                        # one per server or decoder: outlives requests
    drafter = LookupDrafter(shared)              # one per generation; reset() adds its tokens to `shared`
    drafter = FirstOf(LookupDrafter(shared), DraftModel(draft_engine, target))   # lookup before the draft model
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from luce_runtime.sampler import Sampler
from luce_runtime.speculative import Draft, Drafter, NgramDrafter

NGRAM_MAX = 4  # llama.cpp's LLAMA_NGRAM_MAX
# llama.cpp's thresholds per n-gram size 1..4 (common/ngram-cache.cpp): the followers seen at least this often, the
# most frequent one at least this share of them, or nothing is drafted from that n-gram
MIN_SAMPLES_LAX, MIN_PERCENT_LAX = (2, 2, 1, 1), (66, 50, 50, 50)
MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT = (4, 3, 2, 2), (75, 66, 66, 66)


class NgramCache:
    """n-gram (a tuple of 1..NGRAM_MAX ids) → {next id: count}. Thread-safe for one writer beside readers (the
    server's scheduler thread is the only one that drafts; `update` takes a lock all the same)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = NGRAM_MAX):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.counts: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.counts)

    def update(self, tokens: Sequence[int], new: int | None = None) -> None:
        """Count the n-grams followed by each of the last `new` tokens (all of them by default), as
        common_ngram_cache_update does."""
        tokens = list(tokens)
        new = len(tokens) if new is None else new
        with self._lock:
            for n in range(self.ngram_min, self.ngram_max + 1):
                for i in range(max(len(tokens) - new, n), len(tokens)):
                    part = self.counts[tuple(tokens[i - n:i])]
                    part[tokens[i]] = part.get(tokens[i], 0) + 1

    def merge(self, other: NgramCache) -> None:
        with self._lock:
            for ngram, part in other.counts.items():
                mine = self.counts[ngram]
                for token, count in part.items():
                    mine[token] = mine.get(token, 0) + count

    def next_token(self, context: Sequence[int], strict: bool) -> int | None:
        """The token to draft after context: from the longest n-gram (context's tail) whose followers pass the
        thresholds (common/ngram-cache.cpp try_draft), else None."""
        samples, percent = (MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT) if strict else (MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
        for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
            part = self.counts.get(tuple(context[len(context) - n:]))
            if not part:
                continue
            total = sum(part.values())
            token, best = max(part.items(), key=lambda kv: kv[1])
            if total >= samples[n - 1] and 100 * best >= percent[n - 1] * total:
                return token
        return None

    def draft(self, history: Sequence[int], k: int, strict: bool) -> list[int]:
        """Up to k tokens, each drafted after history and the tokens drafted before it."""
        ext, out = list(history[-self.ngram_max:]), []
        while len(out) < k:
            token = self.next_token(ext, strict)
            if token is None:
                break
            out.append(token)
            ext = [*ext[1:], token]
        return out


class LookupDrafter:
    """Prompt lookup over the request's prompt and output, then the n-grams of earlier requests (`shared`).

    1. the context's most recent match of its longest n-gram (ngram_max down to context_min tokens), continued by
       copying (NgramDrafter);
    2. where the context has none: the context's own n-gram counts (lax thresholds), then the shared cache's (strict
       thresholds), token by token (NgramCache.draft).
    reset() counts this generation's tokens into `shared`, so that later requests draft from them."""

    name = "lookup"

    def __init__(self, shared: NgramCache | None = None, context_min: int = 2):
        self.copy = NgramDrafter(ngram_max=NGRAM_MAX, ngram_min=context_min)
        self.shared = shared
        self.context = NgramCache()
        self._seen = 0  # tokens of the history counted into self.context
        self._history: list[int] = []

    def propose(self, history: Sequence[int], k: int, sampler: Sampler | None = None) -> Draft:
        draft = self.copy.propose(history, k)
        self._sync(history)
        if draft.tokens:
            return draft
        tokens = self.context.draft(history, k, strict=False)
        if not tokens and self.shared is not None:
            tokens = self.shared.draft(history, k, strict=True)
        return Draft(tokens)

    def _sync(self, history: Sequence[int]) -> None:
        """Count the history's new tokens into the context cache (the history only grows within a generation:
        what was rejected never entered it)."""
        if len(history) < self._seen or (self._seen and history[self._seen - 1] != self._history[-1]):
            self.context, self._seen = NgramCache(), 0  # another generation's history: start over
        self.context.update(history, len(history) - self._seen)
        self._history, self._seen = list(history), len(history)

    def reset(self) -> None:
        if self.shared is not None and self._history:
            self.shared.merge(self.context)
        self.context, self._seen, self._history = NgramCache(), 0, []


class FirstOf:
    """The first drafter that proposes anything: prompt lookup (free drafts) before a draft model (a decode step of
    its own per drafted token), so the model drafts only where lookup finds no match."""

    def __init__(self, *drafters: Drafter):
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> Draft:
        draft = Draft([])
        for d in self.drafters:
            draft = d.propose(history, k, sampler)
            if draft.tokens:
                return draft
        return draft

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()
