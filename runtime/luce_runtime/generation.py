"""The one generation loop: every caller that generates tokens (`run`, `bench`, the server's scheduler, the
benchmarks) steps its sequences through GenerationLoop, so drafting, verifying, committing and stopping exist once.

    loop = GenerationLoop(engine)
    gen = loop.start(seq, prompt, params, spec=Speculating(NgramDrafter(), DraftLength(8)))
    commits = loop.first(gen, engine.prefill([seq], [prompt])[0])
    while not gen.done:
        commits = [c for _, c in loop.step([gen])]

One step over the generations that have a pending token (the last committed one, not yet in the KV cache), as
vLLM's engine step serves both its offline LLM and its server:
  1. draft: each speculating generation's drafter proposes up to k tokens (k from its DraftLength, within the
     tokens it may still produce and the step's verify budget)
  2. forward: the generations without drafts decode in one batched Engine.decode (decode_greedy where every token is
     its row's argmax: only ids cross to the host), those with drafts verify in one batched Engine.verify
     (verify_greedy likewise)
  3. commit: each draft is judged position by position against the target's row (speculative.judge: the longest
     agreeing prefix at temperature 0, rejection sampling above it) under the request's grammar mask; every
     committed token goes through the generation's GenerationEnd, which is where a generation stops; the rejected
     drafts' KV entries are rolled back.
A greedy drafter may propose a token tree (Draft.parents): it is verified alone in one forward (Engine.verify_tree:
the megakernel's rows where its kernels take trees, else the per-op kernels with TVM's tree attention mask), the
target's argmax path through it is committed, and the other branches' keys and values are dropped
(Engine.commit_tree). Where a tree cannot be verified at a chain's cost (sampling, a grammar, logprobs, a
megakernel built before tree rows: Engine.verifies_trees) its chain is.
A caller that isolates failures (the server) passes `isolate` and `fail`; otherwise an error propagates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from luce_runtime.engine import Engine
from luce_runtime.grammar import Constraint
from luce_runtime.sampler import Sampler, SamplingParams, find_stop
from luce_runtime.speculative import CATCH_UP, Draft, Drafter, DraftLength, SpecStats, judge
from luce_runtime.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """One committed token: emitted (part of the output; False for an end-of-generation or stop id), the text it
    lets the caller stream now, the reason the generation ended with it ("stop" | "length", None while it goes on),
    the stop string that ended it, and the target's logits row it was chosen from (None where only ids came back)."""

    token: int
    emitted: bool
    text: str = ""
    reason: str | None = None
    stop_string: str | None = None
    row: np.ndarray | None = None


class GenerationEnd:
    """Where a generation stops, for every caller: an end-of-generation or stop id ends it before that token is
    emitted; a stop string ends it after the token that completes it (the text cut where the string starts), and so
    do the token limit and a grammar that is complete. It also streams the text: what could still grow into a stop
    string is held back until the next token decides."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, limit: int, constraint: Constraint | None = None,
                 strip_leading_space: bool = True):
        self.stop_ids = set(params.stop_token_ids or ()) | set(tokenizer.eos_ids)
        self.stop, self.limit, self.emitted, self.constraint = params.stop, limit, 0, constraint
        self.decoder = StreamDecoder(tokenizer, strip_leading_space=strip_leading_space)
        self.text, self.streamed = "", 0  # streamed: characters handed out (find_stop's safe length)

    def commit(self, token: int) -> Commit:
        if token in self.stop_ids:
            self.text += self.decoder.flush()
            return Commit(token, False, self._take(final=True)[0], "stop")
        self.emitted += 1
        self.text += self.decoder.feed(token)
        final = self.emitted >= self.limit
        if final:
            self.text += self.decoder.flush()
        text, stop_string = self._take(final)
        if stop_string is not None:
            return Commit(token, True, text, "stop", stop_string)
        if self.constraint is not None and self.constraint.stopped:  # complete: only an end token would fit
            self.text += self.decoder.flush()
            return Commit(token, True, text + self._take(final=True)[0], "stop")
        return Commit(token, True, text, "length" if final else None)

    def _take(self, final: bool) -> tuple[str, str | None]:
        """The text that can be streamed now, and the stop string found in it (the text ends where it starts)."""
        where, safe = find_stop(self.text, self.stop, start=self.streamed)
        end = where if where is not None else (len(self.text) if final else safe)
        text = self.text[self.streamed:end]
        self.streamed = max(self.streamed, end)
        if where is None:
            return text, None
        return text, min((s for s in self.stop if self.text.startswith(s, where)), key=len)


@dataclass
class Speculating:
    """A generation's speculation: its drafter and draft length (a decoder keeps one length across generations,
    the server one per request). timed: DraftLength learns the measured costs of steps that run this generation
    alone (False: the draft length from the acceptance alone)."""

    drafter: Drafter
    length: DraftLength
    timed: bool = True


@dataclass(eq=False)
class Generation:
    """One sequence being generated. penalize_prompt: the sampler's penalties see the prompt too (llama.cpp's
    window over the whole context; the server's OpenAI semantics count generated tokens only)."""

    seq: int | None
    prompt: list[int]
    sampler: Sampler
    end: GenerationEnd
    spec: Speculating | None = None
    constraint: Constraint | None = None
    top_logprobs: int | None = None  # the caller wants each token's logits row (logprobs)
    penalize_prompt: bool = True
    cancelled: threading.Event | None = None  # set: commit nothing more (the caller finishes it)
    owner: Any = None  # the caller's request, for its failure hook
    generated: list[int] = field(default_factory=list)
    pending: int | None = None
    done: bool = False

    @property
    def history(self) -> list[int]:
        return [*self.prompt, *self.generated]

    @property
    def penalty_history(self) -> list[int]:
        return self.history if self.penalize_prompt else self.generated

    @property
    def ids_only(self) -> bool:
        """Every token is its row's argmax and nobody reads the rows: the device may pick the ids."""
        return self.sampler.argmax_only and self.top_logprobs is None

    def is_cancelled(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()

    def commit(self, token: int, row: np.ndarray | None) -> Commit:
        if self.constraint is not None:
            self.constraint.consume(token)
        c = self.end.commit(token)
        if c.emitted:
            self.generated.append(token)
        self.done = c.reason is not None
        self.pending = None if self.done else token
        return Commit(c.token, c.emitted, c.text, c.reason, c.stop_string, row)

    def choose(self, row: np.ndarray) -> int:
        """The token sampled from a row, under the grammar's mask (the sampler's chain only sees allowed tokens)."""
        masked = self.constraint.mask(row) if self.constraint is not None else row
        return self.sampler.sample(masked, self.penalty_history)


def _together(items: list, call: Callable[[list], Sequence]) -> list[tuple[Any, Any]]:
    return list(zip(items, call(items), strict=True))


class GenerationLoop:
    """Steps the generations of one engine (module docstring). stats count the speculating generations' target
    forwards, drafts and accepted drafts; trace, when a list, gets each verify's (drafted, accepted); trees, when a
    dict too, gets each token tree's (parents, path) keyed by its verify's index in trace: the tree as verified
    (Draft.parents) and the draft index of each accepted token, root first (benchmarks replay them)."""

    def __init__(self, engine: Engine, *, isolate: Callable | None = None,
                 fail: Callable[[Generation, Exception], None] | None = None):
        self.engine = engine
        self.stats = SpecStats()
        self.trace: list[tuple[int, int]] | None = None
        self.trees: dict[int, tuple[list[int], list[int]]] | None = None
        self._isolate = isolate or _together  # (items, call) → [(item, result)] of the items that did not fail
        self._fail = fail
        self.decoded = 0  # generations the last step decoded plainly (in one batched call)

    def start(self, seq: int | None, prompt: Sequence[int], params: SamplingParams, *, limit: int | None = None,
              spec: Speculating | None = None, strip_leading_space: bool = True, ignore_eos: bool = False,
              **kw: Any) -> Generation:
        """A generation of `prompt` on sequence seq (limit: tokens it may produce, default params.max_tokens).
        ignore_eos: no id ends it, only the limit or a stop string (llama.cpp's --ignore-eos: benchmarks that
        generate a set number of tokens)."""
        limit = limit if limit is not None else params.max_tokens
        end = GenerationEnd(self.engine.tokenizer, params, limit, kw.get("constraint"), strip_leading_space)
        if ignore_eos:
            end.stop_ids = set()
        return Generation(seq, list(prompt), Sampler(params), end, spec=spec, **kw)

    def first(self, gen: Generation, row: np.ndarray) -> list[Commit]:
        """Commit the first token, sampled from the prompt's last logits row (the prefill's)."""
        if gen.is_cancelled():
            return []
        return self._guard(gen, lambda: [gen.commit(gen.choose(row), row)])

    def finish(self, gen: Generation) -> None:
        """The generation ended: its drafter forgets it (a draft model's sequence goes back to its pool)."""
        if gen.spec is None:
            return
        try:
            gen.spec.drafter.reset()
        except Exception:
            log.exception("generation: freeing a drafter's state failed")
        gen.spec = None

    def step(self, gens: Sequence[Generation], budget: int | None = None) -> list[tuple[Generation, Commit]]:
        """One target forward for every generation with a pending token; what each committed, in order. budget:
        the most tokens one verify may take (default, and at most, the engine's verify_budget: its prefill chunk but
        for a model with sliding-window layers whose per-op prefill takes one token a call)."""
        ready = [g for g in gens if g.pending is not None and not g.done]
        self.decoded = 0
        if not ready:
            return []
        self.stats.steps += sum(g.spec is not None for g in ready)
        alone = ready[0] if len(ready) == 1 and ready[0].spec is not None and ready[0].spec.timed else None
        drafts = self._propose(ready, min(budget or self.engine.prefill_chunk, self.engine.verify_budget), alone)
        out = self._decode([g for g in ready if g not in drafts], alone)
        return out + self._verify(drafts, alone) if drafts else out

    # ---- the three phases ------------------------------------------------------------------------------------------
    def _propose(self, ready: list[Generation], budget: int, alone: Generation | None) -> dict[Generation, Draft]:
        """The non-empty drafts of the speculating generations, within `budget` tokens for one verify (each feeds
        its pending token and its drafts). A drafter that fails ends that generation's speculation alone."""
        cheap = self.engine.verify_rows_at_decode_cost  # more rows cost the prefill function's several steps
        out: dict[Generation, Draft] = {}
        for g in ready:
            if g.spec is None:
                continue
            # a step commits up to k + 1 tokens: never more than the limit allows (the cache stays in context)
            k = min(g.spec.length.k, g.end.limit - g.end.emitted - 1, budget - 1, self.engine.verify_limit - 1,
                    cheap - 1 if cheap > 1 else g.spec.length.k)
            if k < 1:
                continue
            start = time.perf_counter()
            try:
                draft = self._shape(g, g.spec.drafter.propose(g.history, k, g.sampler), budget, cheap)
                if draft.chain > k:
                    raise ValueError(f"it proposed {draft.chain} tokens, asked for at most {k}")
            except Exception:
                log.exception("generation: the %s drafter failed; this generation goes on without speculation",
                              getattr(g.spec.drafter, "name", type(g.spec.drafter).__name__))
                self.finish(g)
                continue
            if g is alone and draft.fed <= CATCH_UP:  # not a proposal that prefilled a draft model with the prompt
                g.spec.length.observe("draft", time.perf_counter() - start, len(draft.tokens))
            if draft.tokens:
                out[g] = draft
                budget -= len(draft.tokens) + 1
        return out

    def _shape(self, g: Generation, draft: Draft, budget: int, cheap: int) -> Draft:
        """A token tree where this generation can verify one, else its chain: a tree needs greedy ids (the
        longest accepted path is the target's argmax path) and an engine that verifies it where a chain would go
        (Engine.verifies_trees: not a megakernel built before tree rows). Its branches go within the verify budget
        and decode-cost rows."""
        if draft.parents is None:
            return draft
        if not (g.ids_only and g.constraint is None and self.engine.verifies_trees):
            return Draft(draft.tokens[:draft.chain], None if draft.probs is None else draft.probs[:draft.chain],
                         fed=draft.fed)
        rows = min(budget, cheap if cheap > 1 else budget) - 1  # the pending token is a row too
        n = max(min(len(draft.tokens), rows), draft.chain)
        return Draft(draft.tokens[:n], None, fed=draft.fed, parents=draft.parents[:n])

    def _decode(self, plain: list[Generation], alone: Generation | None) -> list[tuple[Generation, Commit]]:
        if not plain:
            return []
        engine, start = self.engine, time.perf_counter()
        self.decoded = len(plain)
        if all(g.ids_only for g in plain):
            # every token is its logits' argmax, over the tokens its grammar allows where it has one: taken on the
            # device where it can (the masks go up, only ids come back)
            masks = self._masks(plain)
            plain = [g for g in plain if g in masks]
            done = self._isolate(plain, lambda b: engine.decode_greedy([g.seq for g in b], [g.pending for g in b],
                                                                       [masks[g] for g in b]))
            pick = [(g, lambda g=g, t=t: [g.commit(int(t), None)]) for g, t in done]
        else:
            done = self._isolate(plain, lambda b: engine.decode([g.seq for g in b], [g.pending for g in b]))
            pick = [(g, lambda g=g, row=row: [g.commit(g.choose(row), row)]) for g, row in done]
        if alone is not None and done:
            alone.spec.length.observe("decode", time.perf_counter() - start)
        out = []
        for g, commit in pick:
            g.pending = None  # fed now; a commit sets the next one
            if g.spec is not None:
                g.spec.length.update(0, 0)
            if not g.is_cancelled():
                out += [(g, c) for c in self._guard(g, commit)]
        return out

    def _verify(self, drafts: dict[Generation, Draft], alone: Generation | None) -> list[tuple[Generation, Commit]]:
        engine, start = self.engine, time.perf_counter()
        chains = [(g, d) for g, d in drafts.items() if d.parents is None]
        feeds = lambda b: [[g.pending, *d.tokens] for g, d in b]  # noqa: E731
        ids = all(g.ids_only and g.constraint is None for g, _ in chains)
        if not chains:
            done = []
        elif ids:  # greedy: the rows' argmax ids are all acceptance needs (only they cross from the megakernel)
            done = self._isolate(chains, lambda b: engine.verify_greedy([g.seq for g, _ in b], feeds(b)))
        else:
            done = self._isolate(chains, lambda b: engine.verify([g.seq for g, _ in b], feeds(b)))
        accept = {g: lambda g=g, d=d, r=r: self._accept(g, d, r, ids) for (g, d), r in done}
        for item in [(g, d) for g, d in drafts.items() if d.parents is not None]:  # a tree: one sequence a call
            for (g, d), ids in self._isolate([item], lambda b: [engine.verify_tree_greedy(
                    b[0][0].seq, [b[0][0].pending, *b[0][1].tokens], [-1, *(p + 1 for p in b[0][1].parents)])]):
                accept[g] = lambda g=g, d=d, i=ids: self._accept_tree(g, d, i)
        if alone is not None and alone in accept:
            alone.spec.length.observe("verify", time.perf_counter() - start, len(drafts[alone].tokens))
        out = []
        for g, work in accept.items():
            g.pending = None
            if not g.is_cancelled():
                out += [(g, c) for c in self._guard(g, work)]
        return out

    def _accept_tree(self, g: Generation, draft: Draft, ids: list[int]) -> list[Commit]:
        """Greedy acceptance on a token tree (node 0 the pending token, node i + 1 draft i) from the target's argmax
        at each node (`ids`): from the root, the node's id is committed, and accepted where it is one of the node's
        children, whose id then decides the next; the longest such path is the target's own greedy continuation.
        The engine keeps the accepted path's keys and values and drops the other branches' (Engine.commit_tree)."""
        children: dict[tuple[int, int], int] = {}
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
            children.setdefault((parent + 1, token), i + 1)
        node, path, commits = 0, [], []
        while True:
            token = int(ids[node])
            child = children.get((node, token))
            commits.append(g.commit(token, None))
            if child is not None:
                node = child
                path.append(child)
            if child is None or g.done:
                break
        self.stats.drafted += len(draft.tokens)
        self.stats.accepted += len(path)
        self.stats.tree_steps += 1
        self.stats.branch_accepted += sum(c - 1 >= draft.chain for c in path)
        if self.trace is not None:
            self.trace.append((len(draft.tokens), len(path)))
            if self.trees is not None:
                self.trees[len(self.trace) - 1] = (list(draft.parents), [c - 1 for c in path])
        if g.spec is not None:
            g.spec.length.update(draft.chain, min(len(path), draft.chain))
        if not g.done:
            self.engine.commit_tree(g.seq, node)
        return commits

    def _accept(self, g: Generation, draft: Draft, rows: np.ndarray | list[int], ids: bool) -> list[Commit]:
        """Judge g's drafts position by position against the target's rows (k + 1 of them: logits, or argmax ids),
        commit what is accepted and the target's token after it, and roll back the rejected drafts' KV entries."""
        commits, accepted = [], 0
        for i, row in enumerate(rows):
            if ids:
                ok, token, row = i < len(draft.tokens) and rows[i] == draft.tokens[i], int(rows[i]), None
            elif i < len(draft.tokens):
                masked = g.constraint.mask(row) if g.constraint is not None else row  # the grammar at this position
                q = None if draft.probs is None else draft.probs[i]
                ok, token = judge(masked, draft.tokens[i], q, g.sampler, g.penalty_history)
            else:  # every draft accepted: the target's own token after them
                ok, token = False, g.choose(row)
            accepted += ok
            commits.append(g.commit(token, row))
            if not ok or g.done:
                break
        self.stats.drafted += len(draft.tokens)
        self.stats.accepted += accepted
        if self.trace is not None:
            self.trace.append((len(draft.tokens), accepted))
        if g.spec is not None:
            g.spec.length.update(len(draft.tokens), accepted)
        if not g.done:  # a finished generation's sequence goes as a whole
            self.engine.rollback(g.seq, len(draft.tokens) - accepted)
        return commits

    def _masks(self, gens: list[Generation]) -> dict[Generation, np.ndarray | None]:
        """Each generation's grammar mask for its next token (None without a grammar); one whose grammar fails
        here is failed and left out."""
        out: dict[Generation, np.ndarray | None] = {}
        for g in gens:
            got = self._guard(g, lambda g=g: [g.constraint.bits() if g.constraint is not None else None])
            if got:
                out[g] = got[0]
        return out

    def _guard(self, gen: Generation, work: Callable[[], list]) -> list:
        """work() for one generation; where the caller isolates failures, one that fails is this generation's
        alone (a sampler, grammar or decoder error): the caller's fail hook ends it."""
        if self._fail is None:
            return work()
        try:
            return work()
        except Exception as e:
            log.exception("generation: committing a token failed")
            self._fail(gen, e)
            return []


def generate(engine: Engine, prompt_ids: Sequence[int], params: SamplingParams | None = None,
             spec: Speculating | None = None, loop: GenerationLoop | None = None,
             ignore_eos: bool = False) -> Iterator[int]:
    """Stream generated token ids of one prompt until max_tokens (default: the context's rest), an end token or a
    stop string: plain decoding without spec, speculative decoding with it (Engine.generate, SpeculativeDecoder)."""
    params = params or SamplingParams()
    loop = loop or GenerationLoop(engine)
    limit = engine.token_limit(len(prompt_ids), params.max_tokens)
    with engine.sequence() as seq:
        gen = loop.start(seq, prompt_ids, params, limit=limit, spec=spec, ignore_eos=ignore_eos)
        try:
            commits = loop.first(gen, engine.prefill([seq], [list(prompt_ids)])[0])
            while True:
                yield from (c.token for c in commits if c.emitted)
                if gen.done:
                    return
                commits = [c for _, c in loop.step([gen])]
        finally:
            loop.finish(gen)
