"""Serving benchmark on loopback: N concurrent streaming clients against `luce-compile serve` and llama-cpp-python's
OpenAI server on the same GGUF, one server at a time, each with the same threads.

    .venv/bin/python benchmarks/serve.py [--model smollm2-135m] [--clients 1 4 8] [--requests 16] [--max-tokens 32]

For each server and each N: `--requests` identical /v1/completions requests (greedy, streamed) drawn by N clients,
after one untimed warm-up request. Aggregate tok/s = streamed tokens of all requests / wall time of the level;
TTFT = request sent → first streamed text. Tokens: the server's usage when it streams one (luce-compile does with
stream_options.include_usage), else the count of streamed text chunks (llama-cpp-python streams one per token).
llama-cpp-python's server decodes one request at a time (no -np); llama-server -np N is the GPU-machine peer.
Writes benchmarks/results/serve-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from report import write_results  # noqa: E402

PROMPT = ("The history of the lighthouse keepers of the northern coast is a long one. In the winter of that year, "
          "the storms came early, and the keeper wrote in his journal that")
READY_TIMEOUT_S = 900  # the first `luce-compile serve` of a GGUF compiles it (minutes on 2 cores); cached after


@dataclass
class RequestTiming:
    ttft_s: float
    tokens: int
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server: str, gguf: Path, port: int, threads: int, max_batch: int) -> list[str]:
    if server == "luce-compile":
        return [sys.executable, "-m", "luce_compile.cli", "serve", str(gguf), "--port", str(port),
                "--max-batch", str(max_batch), "--ctx", "512"]
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "512",
            # its default cuts a streaming response short when the next request arrives: queue them instead
            "--interrupt_requests", "False"]


def start_server(cmd: list[str], port: int, threads: int, log: Path) -> subprocess.Popen:
    """Start a server and wait until /v1/models answers; raises RuntimeError with its log tail if it does not."""
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve bench: {cmd[2]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"serve bench: {cmd[2]} not ready after {READY_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    """Stream one completion; time to the first text and the tokens streamed."""
    start = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if any(c.get("text") for c in event.get("choices", [])):
                chunks += 1
                ttft = ttft if ttft is not None else time.perf_counter() - start
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return RequestTiming(ttft_s=ttft if ttft is not None else float("nan"), tokens=tokens,
                         seconds=time.perf_counter() - start)


async def run_level(port: int, clients: int, requests: int, body: dict, tag: str) -> tuple[list[RequestTiming], float]:
    """`requests` requests drawn by `clients` concurrent workers; returns their timings and the wall time.

    Each prompt starts with its own number so no server reuses another request's cached prefix (both keep one)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    todo = list(range(requests))
    timings: list[RequestTiming] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            timings.append(await one_request(client, url, body | {"prompt": f"Log {tag}-{i}. {body['prompt']}"}))

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return timings, time.perf_counter() - start


def summarize(server: str, clients: int, timings: list[RequestTiming], wall_s: float) -> dict:
    from luce_runtime.bench import percentile

    ttfts = [t.ttft_s * 1e3 for t in timings]
    tokens = sum(t.tokens for t in timings)
    return {"server": server, "clients": clients, "requests": len(timings), "tokens": tokens,
            "wall_s": round(wall_s, 3), "aggregate_tok_s": tokens / wall_s,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "per_request": [asdict(t) for t in timings]}


def bench_server(server: str, gguf: Path, args: argparse.Namespace, logdir: Path) -> list[dict]:
    from luce_runtime.bench import machine_load

    port = free_port()
    cmd = server_command(server, gguf, port, args.threads, max(args.clients))
    proc = start_server(cmd, port, args.threads, logdir / f"{server}.log")
    body = {"model": gguf.stem, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        asyncio.run(run_level(port, 1, 1, body, "warm"))  # warm-up: first-call allocations, caches, thread pools
        rows = []
        for n in args.clients:
            load = machine_load()  # a busy 2-core machine stalls llama.cpp's spinning threads: keep it visible
            timings, wall = asyncio.run(run_level(port, n, args.requests, body, f"n{n}"))
            rows.append(summarize(server, n, timings, wall) | {"load_avg_1m": load})
            print(f"{server} N={n}: {rows[-1]['aggregate_tok_s']:.1f} tok/s, "
                  f"TTFT p50 {rows[-1]['ttft_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
        return rows
    finally:
        stop_server(proc)


def serve_table(rows: list[dict], meta: dict) -> str:
    """One row per (server, N); the ratio is luce-compile's aggregate tok/s over the peer's at the same N."""
    ours = {r["clients"]: r["aggregate_tok_s"] for r in rows if r["server"] == "luce-compile"}
    lines = [f"# Serving on loopback: luce-compile vs llama-cpp-python server ({meta['date']})", "",
             f"{meta['cpu']}, {meta['threads']} threads per server, load before {meta['load_avg_1m']:.2f}; model "
             f"{meta['model']}; {meta['requests']} streamed /v1/completions requests per level (greedy, max_tokens "
             f"{meta['max_tokens']}, {meta['prompt_chars']}-character prompt); llama-cpp-python {meta['llama_cpp']} "
             "serves one request at a time.", "", f"Command: `{meta['command']}`", "",
             "| server | clients | requests | tokens | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | "
             "luce-compile / peer | load before |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["server"] == "luce-compile" or r["clients"] not in ours else \
            f"{ours[r['clients']] / r['aggregate_tok_s']:.2f}×"
        lines.append(f"| {r['server']} | {r['clients']} | {r['requests']} | {r['tokens']} | "
                     f"{r['aggregate_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {ratio} | "
                     f"{r.get('load_avg_1m', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def meta_for(args: argparse.Namespace, gguf: Path) -> dict:
    import llama_cpp
    from cpu import _cpu_name
    from luce_runtime.bench import machine_load

    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": platform.processor() or _cpu_name(),
            "threads": args.threads, "load_avg_1m": machine_load(), "model": gguf.name, "requests": args.requests,
            "max_tokens": args.max_tokens, "prompt_chars": len(PROMPT), "clients": args.clients,
            "llama_cpp": llama_cpp.__version__, "command": " ".join(["python benchmarks/serve.py", *sys.argv[1:]])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m", help="a known model name or a .gguf path")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="requests per level (fixed, whatever N is)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--servers", nargs="+", default=["luce-compile", "llama.cpp"], choices=["luce-compile", "llama.cpp"])
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args()
    from luce_compile.models import fetch

    gguf = Path(args.model) if args.model.endswith(".gguf") else fetch(args.model)
    meta = meta_for(args, gguf)
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as logdir:
        rows = [row for server in args.servers for row in bench_server(server, gguf, args, Path(logdir))]
    markdown = serve_table(rows, meta)
    write_results(args.out / f"serve-{meta['date'][:10]}", {"meta": meta, "rows": rows}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
