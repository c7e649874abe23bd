"""Measure an artifact: prefill and decode tok/s, time to first token, and the fraction of the memory roofline.

Roofline for decode: each decoded token reads every weight once (the LM head reads the whole vocabulary table), so
  roofline tok/s = memory bandwidth / weight bytes per token,   fraction = measured tok/s / roofline tok/s.
The bandwidth is measured here, in the same run: a copy of a buffer far larger than the last-level cache, counting
bytes read plus bytes written. Timings are medians over repeats after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BenchResult:
    name: str  # what ran: "luce-compile", "llama.cpp", "torch"
    model: str
    target: str
    prompt_len: int
    gen_len: int
    batch: int
    prefill_tok_s: float
    decode_tok_s: float  # batch 1
    decode_batch_tok_s: float  # all sequences together, at `batch`
    ttft_ms: float  # prefill of prompt_len tokens + sampling of the first token
    weight_bytes_per_token: int
    bandwidth_gb_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def roofline_tok_s(self) -> float:
        return roofline_tok_s(self.bandwidth_gb_s, self.weight_bytes_per_token)

    @property
    def roofline_fraction(self) -> float:
        return self.decode_tok_s / self.roofline_tok_s if self.roofline_tok_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["roofline_tok_s"] = round(self.roofline_tok_s, 1)
        d["roofline_fraction"] = round(self.roofline_fraction, 4)
        d["schema_version"] = SCHEMA_VERSION
        return d


def roofline_tok_s(bandwidth_gb_s: float, bytes_per_token: int) -> float:
    """Decode tokens per second if every weight byte were read once at the measured bandwidth."""
    if bytes_per_token <= 0:
        raise ValueError(f"bench: bytes per token must be positive, got {bytes_per_token}")
    return bandwidth_gb_s * 1e9 / bytes_per_token


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls (clock: injectable for tests)."""
    if repeat <= 0:
        raise ValueError(f"bench: repeat must be positive, got {repeat}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default): p50/p99 latencies."""
    if not values:
        raise ValueError("bench: percentile of no values; run at least one request")
    if not 0 <= q <= 100:
        raise ValueError(f"bench: percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def host_bandwidth_gb_s(n_bytes: int = 1 << 30, repeat: int = 5) -> float:
    """Host memory bandwidth: read + write bytes of a large copy (1 GiB, far past any CPU cache) per second."""
    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    seconds = median_time(lambda: np.copyto(dst, src), repeat)
    return 2 * src.nbytes / seconds / 1e9


def weight_bytes_per_token(params: list[dict[str, Any]], tied_output: bool) -> int:
    """Bytes of weights one decode step reads: all of them, except an untied embedding table (one row is read)."""
    total = 0
    for p in params:
        if p.get("source_tensor") == "token_embd.weight" and not tied_output:
            continue
        total += int(p["nbytes"])
    return total


def machine_load() -> float:
    """1-minute load average: benchmarks on a busy machine are reported with it."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def bench_engine(engine, *, prompt_len: int, gen_len: int, batch: int, repeat: int = 3, seed: int = 0) -> dict:
    """Time an Engine: prefill of prompt_len random tokens, decode at batch 1 and at `batch`."""
    rng = np.random.default_rng(seed)
    vocab = int(engine.config["n_vocab"])

    def prompt() -> list[int]:
        return rng.integers(0, vocab, prompt_len).tolist()

    def prefill_once() -> None:
        seq = engine.add_sequence()
        try:
            logits = engine.prefill([seq], [prompt()])
            int(np.argmax(logits[0]))
        finally:
            engine.remove_sequence(seq)

    ttft = median_time(prefill_once, repeat)

    def decode_run(b: int) -> float:
        seqs = [engine.add_sequence() for _ in range(b)]
        try:
            engine.prefill(seqs, [prompt() for _ in seqs])
            tokens = rng.integers(0, vocab, b).tolist()
            engine.decode(seqs, tokens)  # warm-up step
            steps = []
            for _ in range(gen_len):
                start = time.perf_counter()
                logits = engine.decode(seqs, tokens)
                tokens = np.argmax(logits, axis=-1).tolist()
                steps.append(time.perf_counter() - start)
            return statistics.median(steps)
        finally:
            for s in seqs:
                engine.remove_sequence(s)

    step1 = decode_run(1)
    step_b = decode_run(batch) if batch > 1 else step1
    return {"prefill_tok_s": prompt_len / ttft, "ttft_ms": ttft * 1e3, "decode_tok_s": 1 / step1,
            "decode_batch_tok_s": batch / step_b}
