"""The token-step scheduler: one background thread owns the Engine and runs it one step at a time.

Each step (continuous batching, as vLLM/llama.cpp's server do it):
  1. admit waiting requests while fewer than max_batch run (a new sequence, or a fork of a cached prompt prefix)
  2. free the sequences of cancelled requests (client gone, or stop): their KV pages go back to the pool
  3. prefill at most `prefill_chunk` prompt tokens in total, over the requests still reading their prompt, so a long
     prompt costs running streams one chunk per step instead of a stall
  4. one step of the generation loop (luce_runtime.generation, the loop `run` and `bench` use too) over ALL requests
     that have a pending token: one batched Engine.decode, each row sampled with that request's own Sampler; with
     speculation (serve/speculation.py) the requests whose drafter proposed tokens are verified together in one
     Engine.verify call instead, and commit 1 to k + 1 tokens each. What each committed is streamed to its asyncio
     queue; the loop's GenerationEnd says where it stops.

Error boundary: a step that fails is retried one request at a time (the engine rolls back what the failed call
appended), so only the request that fails alone gets an error event; the others go on, and the KV pool stays
consistent. The scheduler reaches the engine only through its public API (luce_runtime/engine.py).

n > 1: choices 1.. of a request wait for choice 0's prefill and then fork its pages (Engine.fork_sequence), so
the prompt is computed once and every choice samples its first token from the same last logits row.

Prefix reuse: after a prompt is prefilled its sequence is forked (Engine.fork_sequence shares the pages,
copy-on-write for the partial last page) into a small LRU of cached prompts. A later request whose prompt shares
≥ page_size tokens with one of them forks from it at the common length and prefills only the rest: the rendered
system prompt (and earlier turns of a conversation) are computed once.

Batch invariance (deterministic=True, `serve --deterministic`): a greedy or seeded request gives the same tokens
alone or beside others. Decode is row for row the same in any batch (the engine's batch_invariant option: one
kernel for every step on a GPU, Engine.invariant_rows), and so is a joint prefill of several
sequences of more than 16 rows each; what changes a request's sums is where its prompt is cut into chunks (a
chunk's attention over cached pages sums in another order than within one chunk), a chunk of ≤ 16 rows joined to
others (the int8 matmuls take another kernel above 16 rows), and a fork of a cached prompt (attention over the
parent's pages and the sequence's own is computed apart and merged, and so it is for the parent once a fork of it
exists). 8-bit activations can turn such ~1e-7 differences into a near tie going the other way. So such a request
prefills its whole prompt without forking, in chunks that end at multiples of prefill_chunk as alone (never cut
shorter by the step's budget), each chunk a call of its own; its prompt is cached for others only when it ends,
and its n > 1 choices prefill their own. The price is prefix reuse for those requests, which is why it is not the
default. A seeded sampled request never forks in any case (the same seed replays the same text).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from luce_runtime.engine import Engine, EngineError
from luce_runtime.generation import Commit, Generation, GenerationLoop
from luce_runtime.grammar import Constraint
from luce_runtime.sampler import SamplingParams, TokenLogprobs, logprobs
from luce_runtime.serve.access import log_progress
from luce_runtime.serve.metrics import Histogram
from luce_runtime.serve.speculation import Speculation

log = logging.getLogger(__name__)
T = TypeVar("T")
# a prompt that takes several prefill steps logs its progress at most this often (agents' prompts of 10-20K tokens
# prefill for minutes on a CPU: the log shows that the server works on them)
PROGRESS_S = 5.0


@dataclass
class Event:
    """What a request's queue receives: a text delta (one per token), then exactly one 'done' or 'error'."""

    kind: str  # "delta" | "done" | "error"
    index: int = 0  # the choice this event belongs to (n > 1 shares one queue)
    text: str = ""
    token: int = -1
    logprob: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_string: str | None = None  # the stop string that ended it, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class GenRequest:
    """One sequence to generate; `queue` lives on `loop` (the server's event loop), everything else on the thread."""

    prompt: list[int]
    params: SamplingParams  # max_tokens is always set by the caller
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int = 0
    top_logprobs: int | None = None  # None: no logprobs; k ≥ 0: the chosen token's and the k best
    constraint: Constraint | None = None  # a grammar the tokens must follow (structured output, tool calls)
    leader: GenRequest | None = None  # choice 0 of the same request (n > 1): its prompt's KV is forked, not redone
    speculative: bool = True  # False: the client opted out ("speculative": false); no effect without --spec/--draft
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # scheduler state
    seq: int | None = None
    pos: int = 0  # prompt tokens in the cache
    gen: Generation | None = None  # its sampler, drafter, committed tokens and text (the generation loop's state)
    forking: bool = False  # waits for its leader's prefill, then forks the leader's pages
    prefill_start: tuple[float, int] | None = None  # when its prefill began, at which prompt position
    progress_logged: float = 0.0  # when its prefill progress was last logged

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Counters:
    steps: int = 0  # decode steps (one batched Engine.decode each)
    batched_steps: int = 0  # decode steps with ≥ 2 sequences
    max_batch_seen: int = 0
    prefill_calls: int = 0
    tokens: int = 0  # generated tokens
    prompt_tokens: int = 0
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    choice_forks: int = 0  # choices 1.. of an n > 1 request that forked choice 0's prompt instead of prefilling it
    # seconds, submit → first token; cumulative (Prometheus histograms never go down), constant memory
    ttft: Histogram = field(default_factory=Histogram)


class Scheduler:
    """Owns `engine` from its own thread; `submit` and `stats` are safe to call from any thread."""

    def __init__(self, engine: Engine, max_batch: int, *, prefix_cache: int = 4,
                 speculation: Speculation | None = None, deterministic: bool = False):
        if deterministic and not engine.options.batch_invariant:
            raise EngineError("scheduler: deterministic needs an engine whose decode rows do not depend on the rest "
                             "of the step: build it with EngineOptions(batch_invariant=True)")
        self.engine, self.max_batch = engine, max_batch
        self.deterministic = deterministic  # batch invariance for greedy and seeded requests (the docstring)
        self.speculation = speculation
        self.page_size = engine.page_size
        # sliding-window models: no forks (TVM's kernels window a sliding layer per block of the fork tree, so a forked
        # sequence attends to too many keys; the cache refuses them: luce_compile/lower/kv_layers.py)
        self.prefix_slots = 0 if engine.sliding_window else max(0, min(prefix_cache, engine.max_sequences - max_batch))
        self.counters = Counters()
        # its stats: draft tokens proposed to the target, of them accepted, target forwards of speculating requests
        self.loop = GenerationLoop(engine, isolate=self._isolated, fail=self._fail)
        self._waiting: deque[GenRequest] = deque()
        self._active: list[GenRequest] = []
        self._prefixes: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # cached seq id → its tokens (LRU order)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="luce-scheduler", daemon=True)
        self.total_pages = engine.total_pages
        self._free = engine.free_pages()  # refreshed after each step: only this thread touches the KV cache

    # ---- any thread -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def submit(self, *reqs: GenRequest, max_waiting: int | None = None) -> bool:
        """Queue reqs (the choices of one request) all or none. False, queueing nothing, when more than max_waiting
        would wait (the server answers 429); an empty queue always takes them, so n > max_waiting is not refused
        forever."""
        with self._cond:
            if max_waiting is not None and self._waiting and len(self._waiting) + len(reqs) > max_waiting:
                return False
            self._waiting.extend(reqs)
            self.counters.requests += len(reqs)
            self._cond.notify()
        return True

    def stats(self) -> dict[str, int | float]:
        """A snapshot of the counters and the KV page accounting (pages derived from live sequence lengths)."""
        with self._cond:
            c = self.counters
            prefix = [len(t) for t in self._prefixes.values()]
            return {
                "steps": c.steps, "batched_steps": c.batched_steps, "max_batch_seen": c.max_batch_seen,
                "prefill_calls": c.prefill_calls, "tokens": c.tokens, "prompt_tokens": c.prompt_tokens,
                "requests": c.requests, "finished": c.finished, "cancelled": c.cancelled, "failed": c.failed,
                "prefix_hits": c.prefix_hits, "prefix_tokens_reused": c.prefix_tokens_reused,
                "choice_forks": c.choice_forks, "spec_drafted": self.loop.stats.drafted,
                "spec_accepted": self.loop.stats.accepted, "spec_steps": self.loop.stats.steps,
                "running": len(self._active), "waiting": len(self._waiting),
                # from the pool itself (free pages after the last step), not from the running set: a leaked page
                # shows here even when nothing runs
                "kv_pages_used": self.total_pages - self._free,
                # at most this many of them belong to cached prompt prefixes (forks share pages, so ≤)
                "kv_prefix_pages": sum(-(-n // self.page_size) for n in prefix),
                "kv_pages_total": self.total_pages, "kv_pages_free": self._free, "page_size": self.page_size,
            }

    # ---- the scheduler thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                self._step()
            except Exception as e:  # a bug in the scheduler itself (engine failures are isolated per request)
                log.exception("scheduler: a step failed")
                for r in list(self._active):
                    self._finish(r, error=f"generation failed: {e}")
                self._free = self.engine.free_pages()
        for r in list(self._active) + list(self._waiting):
            self._finish(r, error="the server is shutting down")
        while self._prefixes:  # the cached prompts' pages go back to the pool: a stopped scheduler holds nothing
            self.engine.remove_sequence(self._prefixes.popitem()[0])
        self._free = self.engine.free_pages()

    def _step(self) -> None:
        self._admit()
        for r in [r for r in self._active if r.cancelled.is_set()]:
            self.counters.cancelled += 1
            self._finish(r, reason=None)
        self._prefill_step()
        self._decode_step()
        self._free = self.engine.free_pages()

    def _admit(self) -> None:
        while len(self._active) < self.max_batch:
            with self._cond:
                if not self._waiting:
                    return
                r = self._waiting.popleft()
            if r.cancelled.is_set():
                self.counters.cancelled += 1
                self._emit(r, Event("done", r.index, finish_reason=None))
                continue
            try:  # r is off the queue: whatever fails now must still answer its client
                spec = self.speculation.start() if self.speculation is not None and r.speculative else None
                # penalties over generated tokens only, as OpenAI's
                r.gen = self.loop.start(None, r.prompt, r.params, spec=spec, strip_leading_space=False,
                                        constraint=r.constraint, top_logprobs=r.top_logprobs, penalize_prompt=False,
                                        cancelled=r.cancelled, owner=r)
                lead = r.leader
                if lead is not None and lead in self._active and lead.seq is not None and \
                        lead.pos < len(lead.prompt) and not self._reproducible(r):
                    r.forking = True  # n > 1: the leader prefills the prompt once; _prefill_step forks it
                else:
                    self._start_sequence(r)
            except Exception as e:
                log.exception("scheduler: starting a request failed")
                self._finish(r, error=f"could not start generation: {e}")
                continue
            with self._cond:
                self._active.append(r)

    def _start_sequence(self, r: GenRequest) -> None:
        """A new sequence for r, forked from the cached prompt sharing the longest prefix with it when that is long.

        A seeded sampled request always prefills its whole prompt, so that the same seed replays the same text, and
        so does every reproducible request of a deterministic scheduler (the module's docstring): a cached prefix's
        attention sums in another order (prefix pages, then the rest, merged), ~1e-7 of the logits, which 8-bit
        activations can turn into ~1e-3 (an activation at a rounding boundary) and a token into another."""
        if (r.params.seed is not None and r.params.temperature > 0) or self._reproducible(r):
            r.seq = self.engine.add_sequence()
            return
        best, best_len = None, 0
        for sid, toks in self._prefixes.items():
            n = _common_prefix(toks, r.prompt)
            if n > best_len:
                best, best_len = sid, n
        best_len = min(best_len, len(r.prompt) - 1)  # at least one token is prefilled: its logits are the first
        if best is None or best_len < self.page_size:
            r.seq = self.engine.add_sequence()
            return
        self._prefixes.move_to_end(best)
        r.seq = self.engine.fork_sequence(best, best_len)
        r.pos = best_len
        self.counters.prefix_hits += 1
        self.counters.prefix_tokens_reused += best_len

    def _reproducible(self, r: GenRequest) -> bool:
        """Greedy or seeded, on a deterministic scheduler: the same tokens whatever else runs."""
        return self.deterministic and (r.params.temperature == 0 or r.params.seed is not None)

    def _remember_prefix(self, r: GenRequest, n: int) -> None:
        """Cache r's first n prompt tokens (its whole prompt once prefilled, or what a cancelled request had
        prefilled: a client that timed out and sends the request again resumes there instead of starting over)."""
        try:  # a cache that cannot take this prompt costs a later request a prefill, never this request its answer
            self._cache_prefix(r, n)
        except Exception:
            log.exception("scheduler: caching the prompt prefix failed")

    def _cache_prefix(self, r: GenRequest, n: int) -> None:
        if not self.prefix_slots or n < self.page_size:
            return
        key = tuple(r.prompt[:n])
        if key in self._prefixes.values():
            return
        if len(self._prefixes) >= self.prefix_slots:
            old, _ = self._prefixes.popitem(last=False)
            self.engine.remove_sequence(old)
        self._prefixes[self.engine.fork_sequence(r.seq, n)] = key

    def _prefill_step(self) -> None:
        chunk = budget = self.engine.prefill_chunk
        batch: list[tuple[GenRequest, list[int]]] = []
        for r in self._active:
            if r.pos < len(r.prompt) and budget > 0 and not r.forking:
                # a reproducible request's chunk ends at the next multiple of the chunk size, as alone; when the
                # step's budget cannot take all of it, it waits for a step where it comes first
                end = r.pos - r.pos % chunk + chunk if self._reproducible(r) else r.pos + budget
                if end - r.pos > budget and batch:
                    continue
                take = r.prompt[r.pos:end]
                batch.append((r, take))
                budget -= len(take)
        if not batch:
            return
        now = time.perf_counter()
        for r, _ in batch:
            r.prefill_start = r.prefill_start or (now, r.pos)
        # a reproducible request's chunk is a call of its own: the int8 matmuls take another kernel above 16 rows
        # (INT8_VERIFY_ROWS), so a short chunk beside another request's would sum in another order than alone
        joint = [item for item in batch if not self._reproducible(item[0])]
        calls = ([joint] if joint else []) + [[item] for item in batch if self._reproducible(item[0])]
        self.counters.prefill_calls += len(calls)
        done = [pair for call in calls for pair in self._isolated(call, lambda b: self.engine.prefill(
            [r.seq for r, _ in b], [t for _, t in b]))]
        for (r, take), row in done:
            r.pos += len(take)
            self._log_progress(r)
            if r.pos == len(r.prompt):
                self.counters.prompt_tokens += len(r.prompt)
                if not self._reproducible(r):  # a reproducible one is cached when it ends (_finish)
                    self._remember_prefix(r, len(r.prompt))
                followers = self._fork_followers(r)  # before r's first token: r may end at once and free its pages
                for f in (r, *followers):
                    self.counters.ttft.observe(time.perf_counter() - f.submitted)
                    f.gen.seq = f.seq
                    # the prompt's last logits row is every choice's first distribution
                    self._stream(f, self.loop.first(f.gen, row))

    def _log_progress(self, r: GenRequest) -> None:
        """A line in the access log every PROGRESS_S while a prompt of several chunks prefills, and when it ends."""
        now = time.perf_counter()
        (t0, pos0), n = r.prefill_start, len(r.prompt)
        if n - pos0 <= self.engine.prefill_chunk or (r.pos < n and now - r.progress_logged < PROGRESS_S):
            return
        r.progress_logged = now
        rate = (r.pos - pos0) / max(now - t0, 1e-9)
        log_progress(f"prefill {r.pos}/{n} tokens ({r.pos - pos0} computed at {rate:.0f} tok/s, {pos0} reused)",
                     prefill_tokens=r.pos, prompt_tokens=n, reused_tokens=pos0, tok_s=round(rate, 1))

    def _fork_followers(self, r: GenRequest) -> list[GenRequest]:
        """The choices waiting on r's prefill, each now a fork of r's prompt pages (shared, copy-on-write)."""
        out = []
        for f in [a for a in self._active if a.forking and a.leader is r]:
            f.forking = False
            try:
                f.seq = self.engine.fork_sequence(r.seq, len(r.prompt))
            except Exception as e:
                self._fail(f, e)
                continue
            f.pos = len(f.prompt)
            self.counters.choice_forks += 1
            self.counters.prefix_tokens_reused += len(f.prompt)
            out.append(f)
        return out

    def _release_followers(self, r: GenRequest) -> None:
        """r ended before its prompt was prefilled: its waiting choices start their own sequences."""
        for f in [a for a in self._active if a.forking and a.leader is r]:
            f.forking = False
            try:
                self._start_sequence(f)
            except Exception as e:
                self._finish(f, error=f"could not start generation: {e}")

    def _decode_step(self) -> None:
        ready = [r.gen for r in self._active if r.gen is not None and r.gen.pending is not None]
        if not ready:
            return
        committed = self.loop.step(ready, self.engine.prefill_chunk)
        c, plain = self.counters, self.loop.decoded
        if plain:
            c.steps += 1
            c.batched_steps += plain >= 2
            c.max_batch_seen = max(c.max_batch_seen, plain)
        for gen, commit in committed:
            self._stream(gen.owner, [commit])

    def _isolated(self, items: list[T], call: Callable[[list[T]], Sequence]) -> list[tuple[T, Any]]:
        """call(items) → one logits row (or token) per item; when the batched call fails, each item is tried alone
        and only the requests that fail alone get an error. The engine has rolled back whatever a failed call
        appended."""
        try:
            return list(zip(items, call(items), strict=True))
        except Exception as e:
            if len(items) == 1:
                self._fail(items[0], e)
                return []
            log.warning("scheduler: a batched step of %d failed (%s); retrying each request alone", len(items), e)
        done = []
        for item in items:
            try:
                done.append((item, call([item])[0]))
            except Exception as e:
                self._fail(item, e)
        return done

    def _fail(self, item: GenRequest | Generation | tuple, e: Exception) -> None:
        r = item[0] if isinstance(item, tuple) else item
        r = r.owner if isinstance(r, Generation) else r
        log.error("scheduler: request failed: %s", e)
        self._finish(r, error=f"generation failed: {e}")

    def _stream(self, r: GenRequest, commits: list[Commit]) -> None:
        """Stream what r committed (a delta per emitted token, with its logprobs where asked); finish r where its
        generation ended (the loop's GenerationEnd: an end token, a stop string, the limit, a complete grammar)."""
        for c in commits:
            if r.seq is None:  # failed meanwhile
                return
            if c.emitted:
                self.counters.tokens += 1
                lp = logprobs(c.row, c.token, r.top_logprobs) if r.top_logprobs is not None else None
                self._emit(r, Event("delta", r.index, text=c.text, token=c.token, logprob=lp))
            elif c.text:
                self._emit(r, Event("delta", r.index, text=c.text))
            if c.reason is not None:
                self._finish(r, reason=c.reason, stop_string=c.stop_string)

    def _finish(self, r: GenRequest, *, reason: str | None = None, stop_string: str | None = None,
                error: str | None = None) -> None:
        if r.gen is not None:
            self.loop.finish(r.gen)  # the draft engine's sequence goes back too
        if reason is None and error is None and r.seq is not None and 0 < r.pos < len(r.prompt):
            self._remember_prefix(r, r.pos)  # cancelled mid-prefill: agents send the same prompt again
        elif error is None and r.seq is not None and r.pos == len(r.prompt) and self._reproducible(r):
            self._remember_prefix(r, r.pos)  # not earlier: a fork of its pages would change its own attention
        if r.seq is not None and r.seq in self.engine.sequences():  # a failed step may have dropped it already
            try:
                self.engine.remove_sequence(r.seq)
            except Exception:
                log.exception("scheduler: freeing sequence %s failed", r.seq)
        r.seq = None
        self._free = self.engine.free_pages()  # before r leaves the running set: an idle snapshot is never stale
        with self._cond:
            if r in self._active:
                self._active.remove(r)
        if not self._stop:
            self._release_followers(r)
        if error is not None:
            self.counters.failed += 1
            self._emit(r, Event("error", r.index, text=error))
            return
        self.counters.finished += reason is not None
        self._emit(r, Event("done", r.index, finish_reason=reason, stop_string=stop_string,
                            prompt_tokens=len(r.prompt),
                            completion_tokens=len(r.gen.generated) if r.gen is not None else 0))

    @staticmethod
    def _emit(r: GenRequest, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the server's loop is closed: nobody is listening any more
            r.loop.call_soon_threadsafe(r.queue.put_nowait, event)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
