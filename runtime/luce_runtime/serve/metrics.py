"""/metrics in the Prometheus text format (exposition format 0.0.4), from the scheduler's counters."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luce_runtime.serve.scheduler import Scheduler

# time-to-first-token buckets (seconds): a CPU serves SmolLM2's first token in tens of ms, a queued one in seconds
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A Prometheus histogram: fixed upper bounds, cumulative counts that only grow, their sum and count.

    Observations come from the scheduler thread and renders from the event loop; the lock keeps a render from
    seeing a count that disagrees with its buckets. Memory is constant however many requests are served.
    """

    def __init__(self, bounds: Sequence[float] = TTFT_BUCKETS):
        if list(bounds) != sorted(set(bounds)) or not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"metrics: histogram bounds {bounds!r} must be finite, distinct and increasing.")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is (bounds[-1], +Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # Prometheus buckets are `le`: a value on a bound counts in it
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative counts per bound then +Inf, sum, count)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, run = [], 0
        for c in counts:
            run += c
            cumulative.append(run)
        return cumulative, total, run

    @property
    def count(self) -> int:
        return self.snapshot()[2]

    def render(self, name: str, help_text: str) -> list[str]:
        cumulative, total, count = self.snapshot()
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, c in zip((*self.bounds, math.inf), cumulative, strict=True):
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {c}')
        return lines + [f"{name}_sum {total:.6f}", f"{name}_count {count}"]


# (stats key, metric name, type, help)
_SERIES = (
    ("requests", "luce_requests_total", "counter", "Generation requests received (one per choice)"),
    ("finished", "luce_requests_finished_total", "counter", "Requests that finished (stop or length)"),
    ("cancelled", "luce_requests_cancelled_total", "counter", "Requests cancelled (client gone)"),
    ("failed", "luce_requests_failed_total", "counter", "Requests that failed in the engine"),
    ("prompt_tokens", "luce_prompt_tokens_total", "counter", "Prompt tokens of requests that were prefilled"),
    ("tokens", "luce_generation_tokens_total", "counter", "Generated tokens"),
    ("steps", "luce_decode_steps_total", "counter", "Decode steps (one batched engine call each)"),
    ("batched_steps", "luce_batched_decode_steps_total", "counter", "Decode steps with two or more sequences"),
    ("prefill_calls", "luce_prefill_calls_total", "counter", "Prefill chunks run"),
    ("prefix_hits", "luce_prefix_cache_hits_total", "counter", "Requests forked from a cached prompt prefix"),
    ("prefix_tokens_reused", "luce_prefix_tokens_reused_total", "counter", "Prompt tokens not recomputed"),
    ("choice_forks", "luce_choice_forks_total", "counter", "Choices of n > 1 requests forked from choice 0's prompt"),
    ("spec_drafted", "luce_spec_drafted_tokens_total", "counter", "Draft tokens proposed for verification"),
    ("spec_accepted", "luce_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target"),
    ("spec_steps", "luce_spec_steps_total", "counter",
     "Target forwards of speculating sequences (tokens per step: (accepted + steps) / steps)"),
    ("max_batch_seen", "luce_max_batch_seen", "gauge", "Largest decode batch so far"),
    ("running", "luce_running_sequences", "gauge", "Sequences being prefilled or decoded"),
    ("waiting", "luce_waiting_sequences", "gauge", "Requests waiting for a batch slot"),
    ("kv_pages_used", "luce_kv_pages_used", "gauge", "KV pages held by running requests (from their lengths)"),
    ("kv_prefix_pages", "luce_kv_prefix_pages", "gauge", "KV pages held by the prompt-prefix cache"),
    ("kv_pages_total", "luce_kv_pages_total", "gauge", "KV pages in the pool"),
    ("kv_pages_free", "luce_kv_pages_free", "gauge", "KV pages free in the pool (the cache's own count)"),
)


def render_metrics(scheduler: Scheduler, rejected: int = 0) -> str:
    """The scheduler's series, its TTFT histogram, and the requests the server refused as overloaded (429)."""
    stats = scheduler.stats()
    lines: list[str] = []
    for key, name, kind, text in _SERIES:
        if key in stats:  # a series the scheduler does not report is left out rather than failing /metrics
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    name = "luce_requests_rejected_total"
    lines += [f"# HELP {name} Requests refused with 429 because the waiting queue was full",
              f"# TYPE {name} counter", f"{name} {rejected}"]
    lines += scheduler.counters.ttft.render("luce_time_to_first_token_seconds", "Seconds from request to first token")
    return "\n".join(lines) + "\n"
