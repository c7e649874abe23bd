"""Measure an artifact: prefill and decode tok/s, time to first token, and the fraction of the memory roofline.

Roofline for decode: each decoded token reads every weight once (the LM head reads the whole vocabulary table), so
  roofline tok/s = memory bandwidth / weight bytes per token,   fraction = measured tok/s / roofline tok/s.
The bandwidth is measured here, in the same run: a copy of a buffer far larger than the last-level cache, counting
bytes read plus bytes written. Timings are medians over repeats after a warm-up, taken by luce_runtime.timing (host
wall-clock, the device synchronized around each call), the one method every number here and in
scripts/device_check.py comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from luce_runtime.timing import median_time

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


def device_bandwidth_gb_s(device, n_bytes: int = 1 << 31, copies: int = 4, repeat: int = 5) -> float:
    """A GPU's memory bandwidth: read + write bytes of device-to-device copies of a 2 GiB buffer (far past any L2),
    `copies` back to back between two synchronizations so the host's launch and sync cost is amortized."""
    import tvm

    if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        return host_bandwidth_gb_s()
    src = tvm.runtime.empty((n_bytes // 4,), "float32", device)
    dst = tvm.runtime.empty((n_bytes // 4,), "float32", device)

    def copy() -> None:
        for _ in range(copies):
            src.copyto(dst)

    seconds = median_time(copy, repeat, sync=device.sync)
    return 2 * n_bytes * copies / seconds / 1e9


def weight_bytes_per_token(params: list[dict[str, Any]], tied_output: bool, n_expert: int = 0,
                           n_expert_used: int = 0) -> int:
    """Bytes of weights one decode step of one sequence reads: all of them, except an untied embedding table (one row
    is read) and, in a mixture of experts, the experts its router does not choose (n_expert_used of n_expert: the
    stacked `*_exps` tensors count that share)."""
    total = 0.0
    for p in params:
        name = p.get("source_tensor") or ""
        if name == "token_embd.weight" and not tied_output:
            continue
        share = n_expert_used / n_expert if n_expert and "_exps." in name else 1.0
        total += int(p["nbytes"]) * share
    return round(total)


def machine_load() -> float:
    """1-minute load average: benchmarks on a busy machine are reported with it."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def bench_engine(engine, *, prompt_len: int, gen_len: int, batch: int, repeat: int = 3, seed: int = 0,
                 prefill_lens: Sequence[int] = (), prefill_repeat: int | None = None) -> dict:
    """Time an Engine (luce-compile bench, benchmarks/, scripts/device_check.py): prefill of prompt_len random tokens
    up to the first token's argmax (TTFT), and of each of prefill_lens (`prefill_repeat` times: long prompts on a
    CPU take minutes); the median decode step, greedy, at batch 1 and at `batch` after prompt_len-token prompts.
    Seconds as a user sees them (luce_runtime.timing): each decode step's argmax is inside its interval (taken on
    the device where the megakernel runs the step, Engine.decode_greedy, as greedy generation does)."""
    rng = np.random.default_rng(seed)
    vocab = int(engine.config["n_vocab"])

    def prompts(n: int, count: int) -> list[list[int]]:
        return [rng.integers(0, vocab, n).tolist() for _ in range(count)]

    ttft = _prefill_seconds(engine, prompts(prompt_len, repeat + 1), warmup=1)
    # no warm-up for the extra lengths: the TTFT runs above loaded and warmed every prefill kernel
    prefill = {int(n): n / _prefill_seconds(engine, prompts(n, prefill_repeat or repeat), warmup=0)
               for n in prefill_lens}
    step1 = _decode_step_seconds(engine, prompts(prompt_len, 1), rng.integers(0, vocab, 1).tolist(), gen_len)
    step_b = (_decode_step_seconds(engine, prompts(prompt_len, batch), rng.integers(0, vocab, batch).tolist(),
                                   gen_len) if batch > 1 else step1)
    out = {"prefill_tok_s": prompt_len / ttft, "ttft_ms": ttft * 1e3, "decode_tok_s": 1 / step1,
           "decode_batch_tok_s": batch / step_b}
    if prefill:
        out["prefill_by_len"] = prefill
    return out


def _prefill_seconds(engine, prompts: list[list[int]], warmup: int) -> float:
    """Median seconds from a new sequence's prefill call to its first token (argmax), one prompt per call (drawn
    before the clock runs), the first `warmup` calls untimed."""
    pending = iter(prompts)

    def once() -> None:
        seq = engine.add_sequence()
        try:
            int(np.argmax(engine.prefill([seq], [next(pending)])[0]))
        finally:
            engine.remove_sequence(seq)

    return median_time(once, len(prompts) - warmup, warmup, sync=engine.device.sync)


def _decode_step_seconds(engine, prompts: list[list[int]], tokens: list[int], steps: int) -> float:
    """Median seconds of one greedy decode step of len(prompts) sequences after those prompts (one warm-up step):
    each step's argmax (Engine.decode_greedy), taken inside the interval, is the next step's input."""
    seqs = [engine.add_sequence() for _ in prompts]
    try:
        engine.prefill(seqs, prompts)

        def step() -> None:
            tokens[:] = engine.decode_greedy(seqs, tokens)

        return median_time(step, steps, warmup=1, sync=engine.device.sync)
    finally:
        for s in seqs:
            engine.remove_sequence(s)


def bench_artifact(artifact, *, prompt_len: int, gen_len: int, batch: int, repeat: int = 3,
                   prefill_lens: Sequence[int] = (), prefill_repeat: int | None = None,
                   megakernel: bool = True) -> BenchResult:
    """Load an artifact on its device and bench it (luce-compile bench and `python -m luce_runtime.bench`).
    Each prompt is prefilled in one call (the chunk is the longest prompt), as llama.cpp's pp benchmarks do."""
    from luce_runtime.artifact import Artifact, load_artifact
    from luce_runtime.engine import Engine, EngineOptions, artifact_device
    from luce_runtime.kv_memory import weights_bytes

    longest = max([prompt_len, *prefill_lens])  # max(x) of one int raises: the list form works with no --prefill-lens
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    # a GPU's free memory before the engine loads (the CPU's moves with other processes: not recorded)
    free_before = None if art.manifest["target"]["kind"] == "llvm" else artifact_device(art).available_global_memory
    # the prompt, the timed steps and the warm-up step (_decode_step_seconds), with 7 positions of slack but never
    # past the trained context: a prompt that fills it less those steps (run.sh's LONG on Qwen2.5's 32,768:
    # 32,735 + 32 + 1) is a valid bench; one token more is refused by the engine with the reason
    need = longest + gen_len + 1
    context = min(need + 7, max(need, int(art.config["n_ctx_train"])))
    engine = Engine(art, EngineOptions(max_batch=max(batch, 1), max_context=context,
                                            prefill_chunk=max(longest, 16),
                                            megakernel="auto" if megakernel else False))
    load_before = machine_load()
    timings = bench_engine(engine, prompt_len=prompt_len, gen_len=gen_len, batch=batch, repeat=repeat,
                           prefill_lens=prefill_lens, prefill_repeat=prefill_repeat)
    extra: dict[str, Any] = {"load_avg_1m": load_before, "decode_path": engine.decode_path}
    if free_before:  # what the loaded engine holds on the GPU: weights, KV pool, megakernel buffers
        extra["device_memory"] = {"engine_bytes": free_before - engine.device.available_global_memory,
                                  "weights_bytes": weights_bytes(art.manifest),
                                  "kv_pool_tokens": engine.total_pages * engine.page_size}
    if engine.decode_timings_us:  # the load-time measurement that chose the path per number of sequences
        extra["decode_step_us_megakernel_vs_per_op"] = {str(n): t for n, t in engine.decode_timings_us.items()}
    if "prefill_by_len" in timings:
        extra["prefill_tok_s_by_len"] = timings.pop("prefill_by_len")
    manifest = engine.artifact.manifest
    bandwidth = device_bandwidth_gb_s(engine.device)
    del engine  # its KV pool and weights before anything else runs in this process
    return BenchResult(
        name="luce-compile", model=manifest["source"]["file_name"], target=manifest["target"]["name"],
        prompt_len=prompt_len, gen_len=gen_len, batch=batch, **timings,
        weight_bytes_per_token=weight_bytes_per_token(manifest["weights"]["params"],
                                                      bool(manifest["config"]["tied_output"]),
                                                      int(manifest["config"].get("n_expert") or 0),
                                                      int(manifest["config"].get("n_expert_used") or 0)),
        bandwidth_gb_s=bandwidth, extra=extra)


def add_bench_arguments(parser) -> None:
    """The bench options, shared by `luce-compile bench` and `python -m luce_runtime.bench`."""
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens of the timed prompt (default 128)")
    parser.add_argument("--gen-len", type=int, default=32, help="tokens decoded after it (default 32)")
    parser.add_argument("--batch", type=int, default=4, help="sequences of the batched decode (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement, the median kept (default 3)")
    parser.add_argument("--prefill-lens", type=int, nargs="*", default=[], help="also time prefill of these lengths")
    parser.add_argument("--no-megakernel", action="store_true",
                        help="decode with the per-op kernels even where the artifact has a megakernel (A/B runs)")


def main(argv: list[str] | None = None) -> int:
    """Bench an artifact with the runtime alone, e.g. on a GPU machine without the compiler:
    python -m luce_runtime.bench ARTIFACT [--prompt-len 512] [--gen-len 128] [--batch 8] [--prefill-lens 2048]"""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m luce_runtime.bench", description=main.__doc__)
    p.add_argument("artifact")
    add_bench_arguments(p)
    args = p.parse_args(argv)
    result = bench_artifact(args.artifact, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch,
                            repeat=args.repeat, prefill_lens=args.prefill_lens, megakernel=not args.no_megakernel)
    print(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
