"""Token sampling on host logits (numpy): llama.cpp's default sampler chain, OpenAI's presence/frequency penalties.

The chain, in llama.cpp's default order (common/common.h `common_params_sampling::samplers`, leaving out the
samplers we do not offer: DRY, top-n-sigma, typical-p, XTC):
  1. penalties    repetition penalty over the last `repeat_last_n` history tokens (llama.cpp: a seen token's logit
                  is divided by the penalty when positive, multiplied when ≤ 0), then presence/frequency penalties
                  over the whole history (OpenAI: logit -= count * frequency + (count > 0) * presence)
  2. top_k        keep the k largest logits
  3. top_p        softmax over what is left; keep the shortest most-probable prefix whose mass reaches top_p
  4. min_p        keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p)
  5. temperature  divide the logits by T; T = 0 is greedy: the argmax of the penalized logits
  6. dist         softmax, then one uniform draw from this sequence's own numpy Generator
As in llama.cpp, top_p and min_p see the distribution at temperature 1 (HF and vLLM apply temperature first).
Which tokens count as history (prompt + generated, or generated only as OpenAI does) is the caller's choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

from luce_runtime.errors import LuceError

# top_p first looks for the nucleus among the 256, 4096, then 65536 most probable tokens (llama.cpp's adaptive sort
# starts at 256 too): a stable sort of gemma3's 262k vocab costs ~30 ms per token, a partition ~2 ms.
_TOP_P_HEADS = (256, 4096, 65536)
# The draw sums the probabilities in chunks of this many tokens (see Sampler._draw).
_CHUNK = 1024


class SamplingParamsError(LuceError, ValueError):
    """A sampling parameter is out of range (a bad request: the server answers 400)."""


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise SamplingParamsError(f"sampling: {name}={value!r} is invalid; expected {expected}.")


def _is_int(v: object) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the defaults change nothing (plain softmax sampling at temperature 1)."""

    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 or -1 → off
    top_p: float = 1.0  # 1 → off
    min_p: float = 0.0  # 0 → off
    repetition_penalty: float = 1.0  # 1 → off (llama.cpp's repeat_penalty)
    repeat_last_n: int = 64  # window of the repetition penalty: -1 = whole history, 0 = off (llama.cpp default 64)
    presence_penalty: float = 0.0  # OpenAI range [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI range [-2, 2]
    seed: int | None = None  # None → fresh OS entropy per Sampler
    max_tokens: int | None = None  # None → until a stop or the context is full
    stop: tuple[str, ...] = field(default=())  # a str or a list is accepted and made a tuple
    stop_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a finite number >= 0 (0 = greedy)")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k, "an integer >= 0 (0 or -1 = off)")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a finite number > 0 (1 = off)")
        _check(_is_int(self.repeat_last_n) and self.repeat_last_n >= -1, "repeat_last_n", self.repeat_last_n,
               "an integer >= -1 (-1 = whole history, 0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(self.seed is None or (_is_int(self.seed) and self.seed >= 0), "seed", self.seed,
               "an integer >= 0 or None")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               self.max_tokens, "an integer >= 1 or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Samples one sequence's tokens; its Generator is seeded once, so a seed replays the same choices."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def _repeat_penalty(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 and p.repeat_last_n != 0

    @property
    def penalizes(self) -> bool:
        """Whether any penalty (repetition, presence, frequency) changes the logits."""
        p = self.params
        return bool(self._repeat_penalty or p.presence_penalty or p.frequency_penalty)

    @property
    def argmax_only(self) -> bool:
        """Greedy with no penalty: the next token is the logits' argmax, which the device can take
        (Engine.decode_greedy), so the logits need not cross to the host."""
        return self.params.greedy and not self.penalizes

    def sample(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray = ()) -> int:
        """The next token for logits of shape (vocab,) or (1, vocab); history_ids feed the penalties."""
        x = self.penalized(logits, history_ids)
        if self.params.greedy:
            return int(np.argmax(x))
        ids, vals = self._candidates(x)
        i = self._draw(vals)
        return int(i if ids is None else ids[i])

    def distribution(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray = ()) -> np.ndarray:
        """The (vocab,) float64 probabilities `sample` draws from (zero outside the kept set); for rejection
        sampling in speculative decoding."""
        x = self.penalized(logits, history_ids)
        probs = np.zeros(x.shape[0], dtype=np.float64)
        if self.params.greedy:
            probs[np.argmax(x)] = 1.0
            return probs
        ids, vals = self._candidates(x)
        e = np.exp(vals.astype(np.float64) - vals.max())
        probs[slice(None) if ids is None else ids] = e / e.sum()
        return probs

    def penalized(self, logits: np.ndarray, history_ids: Sequence[int] | np.ndarray = ()) -> np.ndarray:
        """Step 1: the logits as float32 (vocab,), with the repetition, presence and frequency penalties applied
        to a copy (the caller's array is never modified)."""
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim == 2 and x.shape[0] == 1:
            x = x[0]
        if x.ndim != 1:
            raise ValueError(f"sampling: logits of shape {x.shape}; expected (vocab,) or (1, vocab) "
                             f"(sample_batch takes (batch, vocab)).")
        if np.isnan(x).any():
            raise LuceError("sampling: the logits contain NaN: the model produced invalid values (check the "
                            "kernels or the weights; a damaged artifact fails its sha256 check at load).")
        hist = np.asarray(history_ids, dtype=np.int64).reshape(-1)
        if hist.size and (hist.min() < 0 or hist.max() >= x.shape[0]):
            raise SamplingParamsError(f"sampling: history holds token ids outside [0, {x.shape[0]}).")
        p = self.params
        if not hist.size or not self.penalizes:
            return x
        x = x.copy()
        if self._repeat_penalty:
            seen = np.unique(hist if p.repeat_last_n < 0 else hist[-p.repeat_last_n:])
            v = x[seen]
            x[seen] = np.where(v <= 0, v * p.repetition_penalty, v / p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            seen, counts = np.unique(hist, return_counts=True)
            x[seen] -= (counts * p.frequency_penalty + p.presence_penalty).astype(np.float32)
        return x

    def _candidates(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Steps 2–5: the ids still allowed (None: all of them, in vocab order) and their tempered logits."""
        p, n = self.params, x.shape[0]
        ids, vals, is_sorted = None, x, False
        if 0 < p.top_k < n:
            ids = np.argpartition(x, n - p.top_k)[n - p.top_k:]  # the k largest, any order
            ids = ids[np.argsort(-x[ids], kind="stable")]
            vals, is_sorted = x[ids], True
        if p.top_p < 1.0:
            ids, vals = _top_p(ids, vals, p.top_p, is_sorted)
        if p.min_p > 0.0:
            keep = vals >= vals.max() + np.float32(math.log(p.min_p))
            if not keep.all():
                sel = np.flatnonzero(keep)
                ids, vals = (sel if ids is None else ids[sel]), vals[sel]
        return ids, (vals if p.temperature == 1.0 else vals / np.float32(p.temperature))

    def _draw(self, vals: np.ndarray) -> int:
        """Step 6: inverse-CDF draw over the candidates in their current order (llama.cpp's dist sampler).

        A whole-vocab cumsum costs more than the exp; chunk sums find the chunk, one short cumsum the token.
        """
        e = np.exp(vals - vals.max())  # float32 in (0, 1]: 4x cheaper than float64; sums are float64
        n = e.shape[0]
        if n <= 4 * _CHUNK:
            cum = np.cumsum(e, dtype=np.float64)
            return min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="left")), n - 1)
        full = n - n % _CHUNK
        sums = e[:full].reshape(-1, _CHUNK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, e[full:].sum(dtype=np.float64))
        csum = np.cumsum(sums)
        target = self.rng.random() * csum[-1]
        c = min(int(np.searchsorted(csum, target, side="left")), csum.shape[0] - 1)
        inner = np.cumsum(e[c * _CHUNK:(c + 1) * _CHUNK], dtype=np.float64) + (csum[c - 1] if c else 0.0)
        return min(c * _CHUNK + int(np.searchsorted(inner, target, side="left")), n - 1)


def _top_p(ids: np.ndarray | None, vals: np.ndarray, top_p: float,
           is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    """Keep the most probable tokens until their mass reaches top_p (the token that crosses it included)."""
    e = np.exp(vals - vals.max())
    total = float(e.sum(dtype=np.float64))
    n, order = e.shape[0], None
    if is_sorted:
        order = np.arange(n)
    for k in () if is_sorted else _TOP_P_HEADS:
        if n <= 2 * k:
            break
        head = np.argpartition(e, n - k)[n - k:]
        head = head[np.argsort(-e[head], kind="stable")]
        if e[head].sum(dtype=np.float64) >= top_p * total:
            order = head  # the nucleus lies inside the k most probable: no full sort
            break
    if order is None:
        order = np.argsort(-e, kind="stable")  # stable: ties keep vocab order on every machine
    cum = np.cumsum(e[order], dtype=np.float64)
    keep = order[:min(int(np.searchsorted(cum, top_p * total, side="left")) + 1, order.shape[0])]
    return (keep if ids is None else ids[keep]), vals[keep]


def sample_batch(samplers: Sequence[Sampler], logits: np.ndarray,
                 histories: Sequence[Sequence[int] | np.ndarray] | None = None) -> np.ndarray:
    """One token per row of (batch, vocab) logits, each row with its own sequence's Sampler; int64 (batch,)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"sampling: logits {logits.shape} do not match {len(samplers)} samplers as (batch, vocab).")
    plain = all(s.params.greedy and s.params.repetition_penalty == 1.0 and not s.params.presence_penalty
                and not s.params.frequency_penalty for s in samplers)
    if plain:  # the common greedy batch: one vectorized argmax
        return np.argmax(logits, axis=-1).astype(np.int64)
    hist = histories if histories is not None else [()] * len(samplers)
    return np.array([s.sample(row, h) for s, row, h in zip(samplers, logits, hist, strict=True)], dtype=np.int64)


def unpack_mask(words: np.ndarray, vocab: int) -> np.ndarray:
    """(..., vocab) bool from token masks packed as llguidance writes them (int32 words, token t is bit t % 32 of
    word t // 32); tokens past the words are not allowed."""
    w = np.ascontiguousarray(words, dtype=np.int32)
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little").view(bool)[..., :vocab]
    if bits.shape[-1] < vocab:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], vocab - bits.shape[-1]), bool)], axis=-1)
    return bits


def masked_argmax(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Each row's argmax over its allowed tokens (the lowest index on ties, as numpy's), -1 where none is allowed:
    what the megakernel's masked argmax computes on the device. logits (n, vocab), words (n, ceil(vocab / 32))."""
    allowed = unpack_mask(words, logits.shape[-1])
    ids = np.argmax(np.where(allowed, logits, -np.inf), axis=-1)
    return np.where(allowed.any(axis=-1), ids, -1)


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the k most probable alternatives (OpenAI `logprobs`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most probable first


def logprobs(logits: np.ndarray, chosen: int, k: int = 0) -> TokenLogprobs:
    """Log-softmax of the logits as given (the caller picks raw or processed ones), in float64."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, x.shape[0])
        head = np.argpartition(-lp, k - 1)[:k]
        head = head[np.argsort(-lp[head], kind="stable")]
        top = [(int(i), float(lp[i])) for i in head]
    return TokenLogprobs(int(chosen), float(lp[chosen]), top)


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int | None, int]:
    """(where the earliest stop string starts in text, or None; how much of text is safe to stream now).

    The safe length holds back a tail that could still grow into a stop string with the next token. `start` is a
    position before which no stop string can begin: a streaming caller passes what it already streamed (the safe
    length of its previous call, or less), so each token costs O(new text + longest stop) instead of a search of
    the whole text, which made a long generation quadratic on the scheduler thread.
    """
    hits = [i for s in stop if (i := text.find(s, start)) >= 0]
    if hits:
        return min(hits), min(hits)
    held = 0
    for s in stop:
        # the earliest position in the tail where a proper prefix of s could start is the longest hold for s
        i = text.find(s[0], max(start, len(text) - len(s) + 1))
        while i >= 0:
            if s.startswith(text[i:]):
                held = max(held, len(text) - i)
                break
            i = text.find(s[0], i + 1)
    return None, len(text) - held
