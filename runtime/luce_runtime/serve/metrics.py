"""/metrics in the Prometheus text format (exposition format 0.0.4), from the scheduler's counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luce_runtime.serve.scheduler import Scheduler

# time-to-first-token buckets (seconds): a CPU serves SmolLM2's first token in tens of ms, a queued one in seconds
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

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
    ("max_batch_seen", "luce_max_batch_seen", "gauge", "Largest decode batch so far"),
    ("running", "luce_running_sequences", "gauge", "Sequences being prefilled or decoded"),
    ("waiting", "luce_waiting_sequences", "gauge", "Requests waiting for a batch slot"),
    ("kv_pages_used", "luce_kv_pages_used", "gauge", "KV pages held by running requests (from their lengths)"),
    ("kv_prefix_pages", "luce_kv_prefix_pages", "gauge", "KV pages held by the prompt-prefix cache"),
    ("kv_pages_total", "luce_kv_pages_total", "gauge", "KV pages in the pool"),
    ("kv_pages_free", "luce_kv_pages_free", "gauge", "KV pages free in the pool (the cache's own count)"),
)


def render_metrics(scheduler: Scheduler) -> str:
    stats = scheduler.stats()
    lines: list[str] = []
    for key, name, kind, text in _SERIES:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    ttft = list(scheduler.counters.ttft)
    name = "luce_time_to_first_token_seconds"
    lines += [f"# HELP {name} Seconds from request to first token", f"# TYPE {name} histogram"]
    for bound in TTFT_BUCKETS:
        lines.append(f'{name}_bucket{{le="{bound}"}} {sum(t <= bound for t in ttft)}')
    lines += [f'{name}_bucket{{le="+Inf"}} {len(ttft)}', f"{name}_sum {sum(ttft):.6f}", f"{name}_count {len(ttft)}"]
    return "\n".join(lines) + "\n"
