"""Speculative decoding on the engine API: a drafter proposes k tokens, the target scores them all in one forward.

One step, for a sequence whose committed tokens are `history` (the last one, t, not yet in the target's KV cache):
  1. the drafter proposes d1..dk (with the distributions q_i it drew them from; none for a model-free drafter)
  2. Engine.verify feeds [t, d1..dk] in one forward: row i holds the target's logits after d_i (row 0: after t)
  3. acceptance, so that the output has exactly the target's distribution (Leviathan et al. 2023, "Fast Inference
     from Transformers via Speculative Decoding", Algorithm 1):
       temperature 0  the longest prefix of drafts equal to the target's argmax, then the target's own next token
       temperature >0 accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection resample from
                      normalize(max(p_i - q_i, 0)); when all are accepted, sample one more token from p_k.
                      A model-free drafter's q_i is a point mass on d_i (accept with p_i(d_i), resample from p_i
                      without d_i).
  4. Engine.rollback drops the rejected drafts' KV entries; the drafter re-syncs with the new history by itself.
A step emits between 1 and k + 1 tokens. p_i is the Sampler's distribution (penalties, top-k/p, min-p, temperature)
with the accepted drafts in the history, so speculation changes speed, never what is sampled.

Drafters: NgramDrafter (prompt lookup over prompt + output, as llama.cpp's lookup decoding: no model) and DraftModel
(a second Engine on a smaller artifact with the same vocabulary, or the target's short of its padded ids; with
branch > 0 at temperature 0, a token tree: its runner-up token as a sibling wherever its distribution is flat,
verified in the same forward by Engine.verify_tree on the megakernel's verify rows or the per-op kernels). The draft
length adapts to the acceptance history, and drafting stops where the measured costs of verify rows and drafts say
it does not pay (DraftLength). The steps
themselves are the one generation loop's (luce_runtime/generation.py). Above temperature 0 drafts are chains
(multi-draft rejection sampling for trees, SpecInfer's, is not built).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from luce_runtime.engine import Engine
from luce_runtime.errors import LuceError
from luce_runtime.sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)

# the tokens a draft model feeds before drafting in steady state: the target's token after a rejection, or the last
# draft and the target's token after a full acceptance; more is a prompt's prefill, not timed as drafting
CATCH_UP = 2


class SpecError(LuceError, ValueError):
    """Speculative decoding cannot run as asked (a draft model with another vocabulary, a sliding-window model)."""


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, and for each the distribution (vocab,) it was drawn from; probs None: point masses (a
    model-free or greedy drafter)."""

    tokens: list[int]
    probs: list[np.ndarray] | None = None
    # tokens the drafter's own model took in to catch up with the history before drafting: 1-2 a step, the whole
    # prompt at a generation's first proposal (a prefill, which is no drafting cost: DraftLength must not learn it)
    fed: int = 0
    # a token tree: each token's parent among the tokens (-1: it follows the history); None: a chain. The chain the
    # drafter would propose alone comes first (parents -1, 0, 1, ...), then the other branches
    parents: list[int] | None = None

    @property
    def chain(self) -> int:
        """How many leading tokens form a chain (all of them without a tree)."""
        return len(self.tokens) if self.parents is None else chain_length(self.parents)


def chain_length(parents: Sequence[int]) -> int:
    """How many leading nodes of a token tree (each node's parent, -1 for the root) form a chain (-1, 0, 1, ...)."""
    return next((i for i, p in enumerate(parents) if p != i - 1), len(parents))


class Drafter(Protocol):
    """Proposes up to k tokens to follow `history` (prompt + every committed token; the last one is the target's
    next input). It keeps whatever state it needs between calls and re-syncs from history itself: the tokens it
    proposed last time may have been rejected."""

    name: str

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> Draft: ...

    def reset(self) -> None:
        """Forget the current generation (free its sequences)."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from ngram_max down to
    ngram_min) and propose what followed it, copied as LZ77 does so that a loop shorter than k repeats itself."""

    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecError(f"speculative: n-gram sizes {ngram_min}..{ngram_max} are invalid; use 1 <= min <= max.")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, history: Sequence[int], k: int, sampler: Sampler | None = None) -> Draft:
        h = np.asarray(history, dtype=np.int64)
        for n in range(min(self.ngram_max, h.shape[0] - 1), self.ngram_min - 1, -1):
            # windows that end before the last token: each has at least one token after it to copy
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if hits.size:
                src = int(hits[-1]) + n  # where the continuation starts
                ext = list(history)
                for m in range(k):
                    ext.append(ext[src + m])  # src + m < len(ext) always: it may copy what it just appended
                return Draft(ext[len(history):])
        return Draft([])

    def reset(self) -> None:
        pass


# a draft may have up to this many fewer logits than its target, the same tokens below (llama.cpp's
# SPEC_VOCAB_MAX_SIZE_DIFFERENCE): Qwen2.5-7B pads its 151,936 tokens to 152,064 rows, its 0.5B drafts have 151,936
VOCAB_SLACK = 128


def check_same_vocabulary(target: Engine, draft: Engine) -> None:
    """Refuse a draft model whose token ids mean other texts than the target's (its drafts would be noise). The draft's
    vocabulary may stop up to VOCAB_SLACK ids short of the target's (a family's padded rows: the target's extra ids
    are never drafted), never go past it."""
    hint = ("compile a draft model of the target's family, which shares its tokenizer (for Qwen2.5-Coder-1.5B: "
            "Qwen2.5-Coder-0.5B), or use --spec ngram, which needs no model")
    if not 0 <= target.vocab_size - draft.vocab_size <= VOCAB_SLACK:
        raise SpecError(f"speculative: the draft model {draft.artifact.root} has {draft.vocab_size} logits, the "
                        f"target {target.artifact.root} {target.vocab_size} (a draft may have at most {VOCAB_SLACK} "
                        f"fewer, never more); {hint}.")
    mine = target.artifact.tokenizer_metadata().get("tokenizer.ggml.tokens") or []
    theirs = draft.artifact.tokenizer_metadata().get("tokenizer.ggml.tokens") or []
    if len(theirs) > len(mine) or mine[:len(theirs)] != theirs:
        where = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine),
                                                                                                    len(theirs)))
        raise SpecError(f"speculative: the draft model {draft.artifact.root} has another vocabulary than the target "
                        f"{target.artifact.root} ({len(theirs)} vs {len(mine)} tokens, first difference at id "
                        f"{where}); {hint}.")


def refuse_sliding_window(engine: Engine, role: str) -> None:
    """A target with sliding-window layers speculates where a verify can feed a sequence several tokens, each row
    in its own window (Engine.verify_limit): on the megakernel's rows, or where the prefill kernels window the cached
    keys (the CPU build's). Rolling back the rejected drafts works at any depth: TVM 0.27 keeps every page of such
    a model (luce_compile/lower/kv_layers.py). A draft model needs only the rollback: it is not asked."""
    if engine.sliding_window and engine.verify_limit < 2:
        raise SpecError(f"speculative: the {role} {engine.artifact.root} has sliding-window layers and verifies "
                        f"one token a call: its per-op prefill takes one token a call past the first chunk "
                        f"(Engine.chunk_limit) and no megakernel verifies rows ({engine.decode_path}). Run it "
                        "without speculation, or build it with its megakernels (a GPU build without --no-megakernel).")


class DraftModel:
    """A second Engine drafts autoregressively: its own sequence mirrors the committed history (it rolls back its
    rejected drafts at the next proposal), one decode step per drafted token after the first.

    branch > 0 (greedy only): a token tree, the chain of the model's greedy tokens and, at each position where its
    distribution is flat (the second token's probability ≥ branch), the second token as a sibling leaf, verified
    in the same forward (Engine.verify_tree). A sibling costs a verify row and no draft step."""

    name = "draft"

    def __init__(self, engine: Engine, target: Engine, *, checked: bool = False, branch: float = 0.0):
        if not checked:  # the server checks its one draft engine once, not per request (152k token strings)
            check_same_vocabulary(target, engine)
        self.engine, self.branch = engine, branch
        self.target_vocab = target.vocab_size  # the draft's distributions are padded to it (check_same_vocabulary)
        self._seq: int | None = None
        self._fed = 0  # tokens the last proposal fed to catch up (Draft.fed)
        self._tokens: list[int] = []  # what the draft sequence's cache holds
        self._committed = 0  # history[:_committed] was committed at the last proposal: never changes after

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> Draft:
        # a target-only id (its padded rows) since the last proposal (history[:_committed] never changes after it):
        # nothing to feed, so nothing is drafted
        if max(history[self._committed:], default=0) >= self.engine.vocab_size:
            return Draft([])
        logits = self._sync(history)
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        hist = list(history)
        next_token = -1
        tree = self.branch > 0 and sampler.params.greedy
        siblings: list[tuple[int, int]] = []  # (the chain position, the token) of each flat position's runner-up
        for i in range(k):
            if logits is None:  # the device took the argmax: the previous step's decode_greedy gave this token
                token = next_token
            elif sampler.params.greedy:
                token = sampler.sample(logits, hist)
                if tree and (second := self._runner_up(sampler.penalized(logits, hist), token)) is not None:
                    siblings.append((i, second))
            else:
                q = sampler.distribution(logits, hist)
                probs.append(np.pad(q, (0, self.target_vocab - q.shape[0])))  # the target's rows past the draft's: 0
                token = draw(probs[-1], sampler.rng)
            tokens.append(token)
            hist.append(token)
            if i + 1 < k:  # the last draft is never fed here: the target verifies it, and the next _sync feeds it
                if sampler.argmax_only and not tree:  # only the id crosses to the host (the megakernel's argmax)
                    logits, next_token = None, self.engine.decode_greedy([self._seq], [token])[0]
                else:
                    logits = self.engine.decode([self._seq], [token])[0]
                self._tokens.append(token)
        if siblings:  # each after the chain, its parent the chain token before its position
            return Draft([*tokens, *(t for _, t in siblings)], None, fed=self._fed,
                         parents=[*range(-1, k - 1), *(i - 1 for i, _ in siblings)])
        return Draft(tokens, probs or None, fed=self._fed)

    def _runner_up(self, logits: np.ndarray, first: int) -> int | None:
        """The second most likely token where the distribution is flat (its probability ≥ branch), else None."""
        x = logits.astype(np.float64) - float(np.max(logits))
        p = np.exp(x)
        p /= p.sum()
        p[first] = -1.0
        second = int(np.argmax(p))
        return second if p[second] >= self.branch else None

    def _sync(self, history: Sequence[int]) -> np.ndarray:
        """Make the draft cache hold history and return the logits after it: roll back what was not accepted, feed
        what is new (the whole prompt the first time)."""
        if self._seq is None:
            self._seq = self.engine.add_sequence()
        same = min(self._committed, len(self._tokens))
        while same < len(self._tokens) and same < len(history) - 1 and self._tokens[same] == history[same]:
            same += 1
        self.engine.rollback(self._seq, len(self._tokens) - same)
        new = list(history[same:])
        self._fed = len(new)
        self._tokens = list(history)
        self._committed = len(history)
        if len(new) == 1:
            return self.engine.decode([self._seq], new)[0]
        if len(new) <= self.engine.verify_rows_at_decode_cost:
            # after a fully accepted step: 2 new tokens. The prefill function costs several decode steps even for
            # 2 tokens (an int8 artifact's float32 GEMMs; on a GPU its fixed cost); verify through decode's kernels
            # (the megakernel's rows, the int8 low-row matmuls) costs ~1-1.5 steps for 2 rows
            return self.engine.verify([self._seq], [new])[0][-1]
        return self.engine.prefill([self._seq], [new])[0]

    def reset(self) -> None:
        if self._seq is not None:
            self.engine.remove_sequence(self._seq)
        self._seq, self._tokens, self._committed = None, [], 0


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One id from a (vocab,) distribution (not necessarily normalized) by inverse CDF."""
    cum = np.cumsum(probs, dtype=np.float64)
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), probs.shape[0] - 1)


def judge(row: np.ndarray, d: int, q: np.ndarray | None, sampler: Sampler, history: Sequence[int]) -> tuple[bool, int]:
    """One drafted token d against the target's logits row for its position: (accepted, the token committed there:
    d, or the target's replacement). q is the distribution d was drawn from (None: a point mass on d).
    Temperature 0: accepted when d is the target's choice. Otherwise rejection sampling (module docstring)."""
    if sampler.params.greedy:
        token = sampler.sample(row, history)
        return token == d, token
    p = sampler.distribution(row, history)
    q_d = 1.0 if q is None else float(q[d])
    if sampler.rng.random() * q_d < p[d]:  # accepted: u < p/q, written without dividing
        return True, d
    if q is None:
        residual = p.copy()
        residual[d] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    # a rejection implies p(d) < q(d), so mass is left elsewhere; rounding could still empty it
    return False, draw(residual if residual.sum() > 0 else p, sampler.rng)


def accept(rows: np.ndarray, draft: Draft, sampler: Sampler, history: Sequence[int]) -> tuple[int, int]:
    """(how many drafts are accepted, the token after them) for the target's logits rows (k + 1, V) of one verify.
    Each position is judged in turn (judge); after the last accepted draft the target's own token follows, so the
    result is distributed as the target's own sampling."""
    hist = list(history)
    for i, d in enumerate(draft.tokens):
        ok, token = judge(rows[i], d, None if draft.probs is None else draft.probs[i], sampler, hist)
        if not ok:
            return i, token
        hist.append(d)
    return len(draft.tokens), sampler.sample(rows[len(draft.tokens)], hist)


@dataclass
class DraftLength:
    """How many tokens to draft next: transformers' "heuristic" schedule for assisted generation (+2 after a step
    that accepted every draft, -1 after one that did not, within [1, draft_max]: it rides the runs of accepted drafts
    that code edits make), and, once the costs are measured, plain decoding (k = 0) wherever no draft pays.

    SpeculativeDecoder times its steps and calls observe(): a plain decode step, a verify's extra cost per row, the
    drafter's cost per drafted token (exponential averages). Drafting pays when some k in [1, draft_max] has more
    expected tokens per second than a plain step, E(k) / T(k) > 1:
      E(k) = (1 - a^(k+1)) / (1 - a)   tokens a step commits when each draft is accepted with probability a,
                                       a = accepted / (accepted + rejections) over the decayed history
      T(k) = 1 + k (row + draft) / decode   its cost in plain steps
    It does not when drafts are rarely accepted, or when rows and drafts cost about as much as the steps they save
    (this 2-core CPU, bandwidth-bound, reads nearly a step's worth of draft model per drafted token). Then plain steps,
    with a probe of PROBE_K drafts after every PROBE_EVERY of them, so that a text that turns predictable (a code edit
    reaching the unchanged lines) is noticed, unless even full acceptance would gain less than PROBE_GAIN (drafts
    costing about a step each: no acceptance rate can pay for them). A caller that times its steps gets one plain
    step after its first drafts, to time a step to compare them with. (The expected-rate model alone, choosing k by
    E(k) / T(k), was tried and measured: with a decayed mean acceptance it drafts too little inside the runs of a code
    edit, 1.37x where the heuristic gets 1.52x; benchmarks/README.md.)"""

    draft_max: int
    k: int = 0
    DECAY = 0.9  # per verify step, on the acceptance counts: ~10 steps of memory
    AVERAGE = 0.2  # weight of a new timing in its exponential average
    PROBE_EVERY, PROBE_K, PROBE_GAIN = 16, 2, 1.2

    def __post_init__(self) -> None:
        if self.draft_max < 1:
            raise SpecError(f"speculative: --draft-max must be at least 1, got {self.draft_max}.")
        self.k = min(self.k or 4, self.draft_max)
        self._accepted = self._rejected = 0.0
        self._cost: dict[str, float] = {}  # seconds: "decode" a step, "row" a verify row more, "draft" a token
        self._plain_run = 0  # plain steps since the last verify

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._plain_run = 0
            self._accepted = self.DECAY * self._accepted + accepted
            self._rejected = self.DECAY * self._rejected + (accepted < drafted)
            heuristic = min(self.k + 2, self.draft_max) if accepted == drafted else max(1, self.k - 1)
        else:
            self._plain_run += 1
            heuristic = max(self.k, 1)
        if not self.measured:
            untimed = drafted and "draft" in self._cost and "decode" not in self._cost
            self.k = 0 if untimed else heuristic  # untimed: one plain step, for verify rows to compare with
        elif self._pays():
            self.k = heuristic
        elif self._plain_run >= self.PROBE_EVERY and self._ceiling() >= self.PROBE_GAIN:
            self.k = min(self.PROBE_K, self.draft_max)
        else:
            self.k = 0

    def observe(self, kind: str, seconds: float, drafts: int = 0) -> None:
        """A timing: kind "decode" (one plain step), "verify" (a verify of `drafts` drafts plus the pending token) or
        "draft" (proposing `drafts` tokens)."""
        if kind == "verify":
            if "decode" not in self._cost or not drafts:
                return
            kind, seconds = "row", max(seconds - self._cost["decode"], 0.0) / drafts
        elif kind == "draft":
            if not drafts:
                return
            seconds /= drafts
        old = self._cost.get(kind)
        self._cost[kind] = seconds if old is None else (1 - self.AVERAGE) * old + self.AVERAGE * seconds

    @property
    def measured(self) -> bool:
        return {"decode", "row", "draft"} <= self._cost.keys()

    @property
    def acceptance(self) -> float:
        """a, with a prior of one accepted and one rejected draft."""
        return (self._accepted + 1) / (self._accepted + self._rejected + 2)

    def _per_draft(self) -> float:
        return (self._cost["row"] + self._cost["draft"]) / self._cost["decode"]

    def _pays(self) -> bool:
        a, per_draft = self.acceptance, self._per_draft()
        return any((1 - a ** (k + 1)) / (1 - a) > 1 + k * per_draft for k in range(1, self.draft_max + 1))

    def _ceiling(self) -> float:
        """Tokens per plain step's time with every draft accepted, at draft_max."""
        return (self.draft_max + 1) / (1 + self.draft_max * self._per_draft())


@dataclass
class SpecStats:
    """drafted: tokens proposed; accepted: of them, kept; steps: target forwards after the prompt (verify or
    decode). Tokens per step = (accepted + steps) / steps."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    tree_steps: int = 0  # verifies of a token tree (Draft.parents)
    branch_accepted: int = 0  # of their accepted tokens, those off the drafter's own chain

    def to_dict(self) -> dict[str, int]:
        """The counts; the tree ones only where a tree was verified (`run --json` and the benchmarks' records keep
        their keys for chains)."""
        d = asdict(self)
        if not self.tree_steps:
            del d["tree_steps"], d["branch_accepted"]
        return d

    @property
    def tokens_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class SpeculativeDecoder:
    """Engine.generate with a drafter: the same limits, stop ids and stop strings, the same output distribution. The
    steps are the one generation loop's (luce_runtime.generation); this keeps the drafter and the draft length of
    the pair across generations, and the loop's counts."""

    engine: Engine
    drafter: Drafter
    draft_max: int = 8
    length: DraftLength = field(init=False)  # kept across generations: the acceptance history of this pair
    # the draft length from measured costs (DraftLength); False: from the acceptance alone, drafting at every step
    # (tests that must reach every drafter's paths, on tiny models where drafting rarely pays)
    timed_length: bool = True

    def __post_init__(self) -> None:
        from luce_runtime.generation import GenerationLoop  # the loop imports this module's drafts and acceptance

        refuse_sliding_window(self.engine, "target model")
        self.length = DraftLength(self.draft_max)
        self.loop = GenerationLoop(self.engine)

    @property
    def stats(self) -> SpecStats:
        return self.loop.stats

    @stats.setter
    def stats(self, stats: SpecStats) -> None:
        self.loop.stats = stats

    @property
    def trace(self) -> list[tuple[int, int]] | None:
        """A list: each verify step's (drafted, accepted) appended (benchmarks)."""
        return self.loop.trace

    @trace.setter
    def trace(self, trace: list[tuple[int, int]] | None) -> None:
        self.loop.trace = trace

    @property
    def trees(self) -> dict[int, tuple[list[int], list[int]]] | None:
        """A dict, with trace a list: each token tree's (parents, accepted path) by its step in trace (benchmarks)."""
        return self.loop.trees

    @trees.setter
    def trees(self, trees: dict[int, tuple[list[int], list[int]]] | None) -> None:
        self.loop.trees = trees

    def _spec(self):
        from luce_runtime.generation import Speculating

        return Speculating(self.drafter, self.length, timed=self.timed_length)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Stream generated token ids until max_tokens, an end-of-generation token, or a stop string."""
        from luce_runtime.generation import generate

        return generate(self.engine, prompt_ids, params, self._spec(), self.loop)

    def step(self, seq: int, history: list[int], sampler: Sampler, remaining: int) -> list[int]:
        """One target forward on a sequence the caller owns (its cache holds history but the last token): the
        tokens it commits after history (1 to k + 1 of them). No stop id ends it: the caller decides."""
        gen = self.loop.start(seq, history[:-1], sampler.params, limit=remaining, spec=self._spec(), ignore_eos=True)
        gen.sampler, gen.generated, gen.pending = sampler, [history[-1]], history[-1]
        return [c.token for _, c in self.loop.step([gen]) if c.emitted]


# Prompts for `luce-compile bench --spec/--draft`: a code edit (the answer repeats most of the prompt, where prompt
# lookup pays) and an open question (where only a draft model can guess).
BENCH_PROMPTS = (
    "Rewrite this function so that it skips negative numbers:\n\n"
    "def total(values):\n    result = 0\n    for value in values:\n        result += value\n    return result\n\n"
    "def total(values):\n",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.\n",
)


def bench_speculation(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], gen_len: int) -> dict:
    """Greedy tokens/s of plain decoding and of speculation on the same prompts, in one run (each prompt once
    untimed first, so both paths have loaded their kernels), with the acceptance counts and whether the ids agree."""
    engine, params = decoder.engine, SamplingParams(temperature=0, max_tokens=gen_len)
    plain = lambda p: engine.generate(p, params)  # noqa: E731
    spec = lambda p: decoder.generate(p, params)  # noqa: E731
    for run in (plain, spec):
        list(run(prompts[0][:8]))
    decoder.stats, decoder.length = SpecStats(), DraftLength(decoder.draft_max)
    timed = {}
    for name, run in (("plain", plain), ("spec", spec)):
        start, ids = time.perf_counter(), [list(run(p)) for p in prompts]
        timed[name] = (ids, time.perf_counter() - start)
    tokens = sum(len(ids) for ids in timed["plain"][0])
    plain_tok_s = tokens / timed["plain"][1]
    spec_tok_s = sum(len(ids) for ids in timed["spec"][0]) / timed["spec"][1]
    stats = decoder.stats
    return {"drafter": decoder.drafter.name, "draft_max": decoder.draft_max, "prompts": len(prompts),
            "tokens": tokens, "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s,
            "identical": timed["plain"][0] == timed["spec"][0], **stats.to_dict(),
            "mean_accepted": stats.accepted / max(stats.steps, 1), "tokens_per_step": stats.tokens_per_step}
