"""Serving benchmark on loopback: N concurrent streaming clients against `luce-compile serve` and llama.cpp's own
`llama-server -np N` on the same GGUF, one server at a time, each with the same threads.

    .venv/bin/python benchmarks/serve.py [--model smollm2-135m] [--clients 1 4 8] [--requests 32] [--max-tokens 64]

For each N, each server is started afresh sized for N: luce-compile with `--max-batch N`, llama-server with `-np N`
slots (continuous batching) and `-c N × ctx`, so each has N sequences of `--ctx` tokens; the servers alternate
within a level so a drift in machine load hits both. Per level and server: one untimed warm-up request, then
`--requests` /v1/completions requests (greedy, streamed, max_tokens) drawn by N clients.
Aggregate tok/s = generated tokens of all requests / wall time of the level; TTFT = request sent → first streamed
text; ITL (inter-token latency) = the gaps between consecutive streamed text chunks, pooled over the level.
Tokens: the `usage.completion_tokens` each server streams at the end (luce-compile with
stream_options.include_usage; llama-server always sends usage on its final /v1/completions chunk), else llama-server's
`timings.predicted_n`, else the count of text chunks; the source is recorded per request. llama-server also gets
`ignore_eos` (luce-compile's strict schema has no such field): tokens are counted, not assumed, so an early stop shows.
Each request opens its own loopback connection (both servers). Before a level the script waits for a quiet machine;
a level during which other processes took more than --max-foreign-pct of the CPU, or that failed, is rerun.
llama-server is built once from the llama-cpp-python sdist's llama.cpp (benchmarks/peers/llama_server.py).
Writes benchmarks/results/serve-<date>.json and .md (after every level, so a run cut short keeps its levels);
benchmarks/plot.py draws the PNG.

On a GPU machine (benchmarks/h200/serve.sh runs it there): `--artifact DIR --model THE.gguf --llama-server PATH --gpu`
serves a prebuilt artifact with the runtime alone against a given (CUDA) llama-server with every layer offloaded;
neither server gets a thread count, and the record names the GPU.

Speculation (issue 39): `--draft-artifact DRAFT` (luce-compile serve --draft) and `--draft-model DRAFT.gguf`
(llama-server -md) add, per level, rows "luce-compile+draft" and "llama-server+draft": the same server restarted with
the draft model, next to its rows without it (`--speculation off on`, the default once a draft is given). With a draft
every row's requests are code completions, the first `--requests` HumanEval prompts in file order (benchmarks/spec.py's
source: speculation pays on code; the file's last prompt warms up), the same for every row, greedy. The record adds
per speculating row the draft tokens proposed and accepted during the timed requests, and per request its prompt's
index and a digest of its text: `speculation` in the JSON gives each +draft row's aggregate tok/s over the same
server's without a draft at that N, and how many requests streamed the same text as without it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from report import write_results  # noqa: E402

OURS = "luce-compile"
PEER = "llama-server"
DRAFT = "+draft"  # a row's server with this suffix speculated with the draft model
PROMPT = ("The history of the lighthouse keepers of the northern coast is a long one. In the winter of that year, "
          "the storms came early, and the keeper wrote in his journal that")
READY_TIMEOUT_S = 900  # the first `luce-compile serve` of a GGUF compiles it (minutes on 2 cores); cached after
# luce-compile serve's /metrics series of speculation (runtime/luce_runtime/serve/metrics.py)
SPEC_METRICS = {"drafted": "luce_spec_drafted_tokens_total", "accepted": "luce_spec_accepted_tokens_total"}
REQUEST_TIMEOUT_S = 600.0  # one streamed request; a level of 32 × 64 tokens takes ~1.5 min here at worst


class LevelError(RuntimeError):
    """One level of one server failed (a request error or a dead server); bench_level reruns it."""


@dataclass
class RequestTiming:
    ttft_s: float
    tokens: int
    seconds: float
    source: str = "usage"  # where `tokens` came from: usage, timings (llama-server's predicted_n) or chunks
    # gaps between consecutive streamed text chunks (both servers send one chunk a token): the inter-token latency a
    # client sees; summarize pools them over the level and keeps only each request's mean in the record
    itl_ms: list[float] = field(default_factory=list)
    text: str = ""  # what it streamed; the record keeps its sha1 (text_sha1) to compare rows with and without a draft
    prompt: int | None = None  # which code prompt it was (their index), where the prompts differ per request
    # llama-server's timings.draft_n and draft_n_accepted (sent where it drafted); luce-compile's are per level
    drafted: int | None = None
    accepted: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server: str, gguf: Path, *, port: int, threads: int | None, clients: int, ctx: int,
                   artifact: Path | None = None, binary: Path | None = None, gpu: bool = False,
                   draft: Path | None = None, draft_max: int = 8) -> list[str]:
    """The command line of `server` sized for `clients` concurrent sequences of `ctx` tokens each.

    artifact: luce-compile serves this prebuilt artifact (the runtime alone loads it: no compiler needed), else it
    compiles the GGUF through its cache. binary: this llama-server, else the cached CPU build. gpu: llama-server
    offloads every layer (-ngl 99); threads None leaves each server's thread count at its own default. draft: the
    server speculates with this draft model (luce-compile: an artifact or a GGUF; llama-server: a GGUF), at most
    draft_max tokens a step."""
    if server == OURS:
        # threads: TVM_NUM_THREADS in the environment (start_server); --ctx is per sequence
        cmd = [sys.executable, "-m", "luce_compile.cli", "serve", str(artifact or gguf), "--host", "127.0.0.1",
               "--port", str(port), "--max-batch", str(clients), "--ctx", str(ctx)]
        return cmd + (["--draft", str(draft), "--draft-max", str(draft_max)] if draft else [])
    if server == PEER:
        from peers.llama_server import llama_server_binary
        from peers.llama_server import server_command as llama_server_command

        cmd = llama_server_command(binary or llama_server_binary(), gguf, port=port, threads=threads,
                                   parallel=clients, ctx_per_slot=ctx, gpu_layers=99 if gpu else 0)
        return cmd + (peer_draft_flags(draft, draft_max, gpu) if draft else [])
    raise ValueError(f"serve bench: unknown server {server!r}; expected {OURS!r} or {PEER!r}")


def peer_draft_flags(draft: Path, draft_max: int, gpu: bool) -> list[str]:
    """llama-server's flags to speculate with a draft model, as this llama.cpp (0c1e57098) spells them in
    common/arg.cpp: `-md` alone loads the draft and speculates with nothing (the speculative types default to none,
    and a plain model's GGUF infers none: common_speculative_init then returns no drafter), hence `--spec-type
    draft-simple`; `--spec-draft-n-max` is ours' --draft-max (the old --draft-max is removed there); its other
    defaults stay (n_min 0, p_min 0.0: it drafts n_max tokens a step). gpu: `-ngld 99` puts the draft's layers on
    the GPU too."""
    flags = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)]
    return flags + (["-ngld", "99"] if gpu else [])


def split_server(name: str) -> tuple[str, bool]:
    """A row's server name → (the server, whether it speculated with the draft model)."""
    return (name.removesuffix(DRAFT), True) if name.endswith(DRAFT) else (name, False)


def given(server: str, clients: int) -> str:
    """What each server was given at a level, for the table's server column."""
    base, spec = split_server(server)
    if base == OURS:
        return f"--max-batch {clients}" + (" --draft" if spec else "")
    return f"-np {clients}" + (" -md" if spec else "")


def start_server(cmd: list[str], port: int, threads: int | None, log: Path) -> subprocess.Popen:
    """Start a server in its own process group; wait until /v1/models answers 200 (llama-server answers 503 while
    it loads the model). Raises RuntimeError with its log tail if it exits or is not ready in time."""
    env = dict(os.environ)
    if threads is not None:
        env |= {"TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(proc, cmd, port, log)
    except BaseException:  # not ready, or interrupted (a SIGTERM): its own session would outlive this process
        stop_server(proc)
        raise
    return proc


def wait_ready(proc: subprocess.Popen, cmd: list[str], port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve bench: `{' '.join(cmd)}` exited with {proc.returncode}: "
                               f"{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve bench: `{' '.join(cmd)}` not ready after {READY_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (it started it), then SIGKILL what is left after 30 s; returns once
    nothing of the group runs, so a server's leftovers never share the CPU with the next one."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.2)
        if not _group_alive(proc):
            break


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader, or the group never empties
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat (user … steal; guest is inside user)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # minus idle and iowait


def own_jiffies(pid: int) -> int:
    """CPU ticks used by process `pid` (all its threads) plus by this process (the clients)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    me = os.times()
    return int(stat[11]) + int(stat[12]) + round((me.user + me.system) * os.sysconf("SC_CLK_TCK"))


def wait_quiet(threshold_pct: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until the machine is under threshold_pct busy over a 2 s sample; returns the last
    sample. Someone else's job on a 2-core machine halves a 2-thread server (llama.cpp's threads spin)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = cpu_jiffies()
        time.sleep(2)
        b1, t1 = cpu_jiffies()
        busy = 100 * (b1 - b0) / max(t1 - t0, 1)
        if busy <= threshold_pct or time.monotonic() > deadline:
            return busy
        print(f"serve bench: machine {busy:.0f}% busy before a level; waiting", file=sys.stderr, flush=True)
        time.sleep(8)


def request_tokens(usage: dict | None, timings: dict | None, chunks: int) -> tuple[int, str]:
    """Generated tokens of one streamed request and where the number came from (best source first)."""
    if usage and "completion_tokens" in usage:
        return int(usage["completion_tokens"]), "usage"
    if timings and "predicted_n" in timings:
        return int(timings["predicted_n"]), "timings"
    return chunks, "chunks"


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    """Stream one completion; time to the first text, the tokens generated, the text and (llama-server with a draft)
    the draft tokens proposed and accepted."""
    start = time.perf_counter()
    arrivals: list[float] = []  # when each non-empty text chunk came, since start
    usage, timings, text = None, None, []
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
            if pieces := [c["text"] for c in event.get("choices", []) if c.get("text")]:
                arrivals.append(time.perf_counter() - start)
                text += pieces
    tokens, source = request_tokens(usage, timings, len(arrivals))
    drafts = timings or {}
    return RequestTiming(ttft_s=arrivals[0] if arrivals else float("nan"), tokens=tokens,
                         seconds=time.perf_counter() - start, source=source, itl_ms=inter_token_ms(arrivals),
                         text="".join(text), drafted=drafts.get("draft_n"), accepted=drafts.get("draft_n_accepted"))


def inter_token_ms(arrivals: list[float]) -> list[float]:
    """Gaps between consecutive chunk arrivals (seconds since the request) in ms; none for fewer than two chunks."""
    return [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]


async def run_level(port: int, clients: int, requests: int, body: dict, tag: str,
                    prompts: list[str] | None = None) -> tuple[list[RequestTiming], float]:
    """`requests` requests drawn by `clients` concurrent workers; returns their timings and the wall time.

    Each prompt starts with its own number so no server reuses another request's cached prefix (both keep one).
    prompts: request i sends prompts[i] as it is instead (code prompts, each its own)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    todo = list(range(requests))
    timings: list[RequestTiming] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            prompt = prompts[i] if prompts else f"Log {tag}-{i}. {body['prompt']}"
            timing = await one_request(client, url, body | {"prompt": prompt})
            timing.prompt = i if prompts else None
            timings.append(timing)

    # a new loopback connection per request, for both servers: llama-server (cpp-httplib) now and then closes a
    # kept-alive connection after a streamed response, and the next request on it fails at once (RemoteProtocolError)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return timings, time.perf_counter() - start


def summarize(server: str, clients: int, timings: list[RequestTiming], wall_s: float,
              max_tokens: int | None = None) -> dict:
    """One table row: aggregate tok/s over the level's wall time, TTFT percentiles, inter-token latency percentiles
    over every gap of every request (as vLLM's benchmark_serving pools them), and (given max_tokens) how many requests
    stopped before it."""
    from luce_runtime.bench import percentile

    ttfts = [t.ttft_s * 1e3 for t in timings]
    gaps = [g for t in timings for g in t.itl_ms]
    tokens = sum(t.tokens for t in timings)
    row = {"server": server, "clients": clients, "requests": len(timings), "tokens": tokens,
           "wall_s": round(wall_s, 3), "aggregate_tok_s": tokens / wall_s,
           "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
           "token_sources": sorted({t.source for t in timings}), "per_request": [request_record(t) for t in timings]}
    if gaps:
        row |= {"itl_p50_ms": percentile(gaps, 50), "itl_p99_ms": percentile(gaps, 99)}
    if max_tokens is not None:
        row["short_requests"] = sum(t.tokens < max_tokens for t in timings)
    return row


def request_record(t: RequestTiming) -> dict:
    """One request in the JSON: its timing with the mean gap (the gaps themselves would be most of the file) and its
    text's sha1; a prompt index and draft counts where there are."""
    d = {k: v for k, v in asdict(t).items() if v is not None}
    gaps, text = d.pop("itl_ms"), d.pop("text")
    return (d | ({"itl_mean_ms": sum(gaps) / len(gaps), "chunks": len(gaps) + 1} if gaps else {})
            | ({"text_sha1": hashlib.sha1(text.encode()).hexdigest()} if text else {}))


def ratios(rows: list[dict]) -> dict[str, dict[int, float]]:
    """peer → clients → luce-compile's aggregate tok/s over the peer's at the same N (where both ran), each with a
    draft where the peer had one (llama-server+draft against luce-compile+draft)."""
    ours = {(r["server"], r["clients"]): r["aggregate_tok_s"] for r in rows if split_server(r["server"])[0] == OURS}
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        base, spec = split_server(r["server"])
        mine = ours.get((OURS + DRAFT if spec else OURS, r["clients"]))
        if base != OURS and mine is not None and r["aggregate_tok_s"]:
            out.setdefault(r["server"], {})[r["clients"]] = mine / r["aggregate_tok_s"]
    return out


def speculation(rows: list[dict]) -> dict[str, dict[str, dict[int, object]]]:
    """Per +draft row name and N, against the same server's row without a draft at that N: "speedup", its aggregate
    tok/s over that row's; "same_text", [requests that streamed the same text for the same prompt, requests
    compared] (greedy: speculation should not change the text, but for near ties that a verify's rounding flips)."""
    plain = {(r["server"], r["clients"]): r for r in rows if not split_server(r["server"])[1]}
    out: dict[str, dict[str, dict[int, object]]] = {"speedup": {}, "same_text": {}}
    for r in rows:
        base, spec = split_server(r["server"])
        if not spec or (p := plain.get((base, r["clients"]))) is None:
            continue
        if p["aggregate_tok_s"]:
            out["speedup"].setdefault(r["server"], {})[r["clients"]] = r["aggregate_tok_s"] / p["aggregate_tok_s"]
        texts = {q["prompt"]: q["text_sha1"] for q in p["per_request"] if "prompt" in q and "text_sha1" in q}
        pairs = [(texts[q["prompt"]], q["text_sha1"]) for q in r["per_request"]
                 if q.get("prompt") in texts and "text_sha1" in q]
        if pairs:
            out["same_text"].setdefault(r["server"], {})[r["clients"]] = [sum(a == b for a, b in pairs), len(pairs)]
    return {k: v for k, v in out.items() if v}


def results_doc(meta: dict, rows: list[dict]) -> dict:
    """The JSON document: meta, one row per (server, N) in run order, the ratios and, with +draft rows, what
    speculation changed (JSON keys are strings)."""
    doc = {"meta": meta, "rows": rows,
           "ratios": {peer: {str(n): v for n, v in by_n.items()} for peer, by_n in ratios(rows).items()}}
    if spec := speculation(rows):
        doc["speculation"] = {key: {name: {str(n): v for n, v in by_n.items()} for name, by_n in by_name.items()}
                              for key, by_name in spec.items()}
    return doc


def request_body(server: str, gguf: Path, max_tokens: int) -> dict:
    body = {"model": gguf.stem, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    return body | {"ignore_eos": True} if server == PEER else body


def draft_of(server: str, args: argparse.Namespace) -> Path | None:
    """The draft model `server` speculates with: luce-compile's --draft-artifact, llama-server's --draft-model."""
    return args.draft_artifact if server == OURS else args.draft_model


def spec_metrics(port: int) -> dict[str, int]:
    """luce-compile's speculation counters from its /metrics (Prometheus text; a missing series reads 0)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {key: int(float(m[1])) if (m := re.search(rf"^{name} (\S+)$", text, re.M)) else 0
            for key, name in SPEC_METRICS.items()}


def draft_counts(timings: list[RequestTiming], before: dict | None, after: dict | None) -> dict:
    """A +draft row's draft tokens proposed and accepted during its timed requests: luce-compile's /metrics counters
    after the level less before it (the warm-up's left out), else llama-server's per-request timings summed."""
    if before is not None and after is not None:
        return {"spec_drafted": after["drafted"] - before["drafted"],
                "spec_accepted": after["accepted"] - before["accepted"], "spec_source": "metrics"}
    return {"spec_drafted": sum(t.drafted or 0 for t in timings),
            "spec_accepted": sum(t.accepted or 0 for t in timings), "spec_source": "timings"}


def bench_level(server: str, clients: int, gguf: Path, args: argparse.Namespace, logdir: Path) -> dict:
    """One level of one server on a quiet machine: rerun (up to --retries times) when other processes took more than
    --max-foreign-pct of the CPU during it, and keep the least disturbed attempt."""
    best: dict | None = None
    for attempt in range(1, args.retries + 2):
        busy = wait_quiet(args.max_foreign_pct, args.quiet_wait_s)
        try:
            row = run_level_once(server, clients, gguf, args, logdir) | {"busy_before_pct": busy, "attempt": attempt}
        except LevelError as e:
            print(f"{server} N={clients}: attempt {attempt} failed: {e}", file=sys.stderr, flush=True)
            continue
        print(f"{server} N={clients}: {row['aggregate_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
              f"{row['tokens']} tokens ({'/'.join(row['token_sources'])}), load {row['load_avg_1m']:.2f}, "
              f"other processes {row['foreign_cpu_pct']:.0f}% CPU", file=sys.stderr, flush=True)
        if best is None or row["foreign_cpu_pct"] < best["foreign_cpu_pct"]:
            best = row
        if row["foreign_cpu_pct"] <= args.max_foreign_pct:
            break
    if best is None:
        base, spec = split_server(server)
        raise LevelError(f"serve bench: {server} N={clients} failed {args.retries + 1} times; each attempt's error "
                         f"and server log tail are printed above; rerun with --servers {base} --clients {clients}"
                         + (" --speculation on" if spec else ""))
    return best | {"attempts": attempt}


def run_level_once(server: str, clients: int, gguf: Path, args: argparse.Namespace, logdir: Path) -> dict:
    """Start `server` (a +draft name: with its draft model) sized for `clients`, warm it up, time one level, stop
    it; returns the row."""
    from luce_runtime.bench import machine_load

    base, spec = split_server(server)
    port = free_port()
    threads = None if args.gpu else args.threads
    cmd = server_command(base, gguf, port=port, threads=threads, clients=clients, ctx=args.ctx,
                         artifact=args.artifact, binary=args.llama_server, gpu=args.gpu,
                         draft=draft_of(base, args) if spec else None, draft_max=args.draft_max)
    log = logdir / f"{server}-n{clients}.log"
    try:
        proc = start_server(cmd, port, threads, log)
    except RuntimeError as e:  # it exited or never answered: a failed level, rerun like one
        raise LevelError(str(e)) from e
    body = request_body(base, gguf, args.max_tokens)
    prompts = args.prompts  # code prompts: the last warms up, the first --requests are timed
    counters = spec_metrics if spec and base == OURS else None  # ours counts drafts per server, not per request
    try:
        # warm-up: first-call allocations, caches, thread pools
        asyncio.run(run_level(port, 1, 1, body, "warm", prompts[-1:] if prompts else None))
        load = machine_load()  # a busy 2-core machine stalls llama.cpp's spinning threads: keep it visible
        before = counters(port) if counters else None
        (busy0, total0), own0 = cpu_jiffies(), own_jiffies(proc.pid)
        timings, wall = asyncio.run(run_level(port, clients, args.requests, body, f"n{clients}", prompts))
        (busy1, total1), own1 = cpu_jiffies(), own_jiffies(proc.pid)
        after = counters(port) if counters else None
    except (httpx.HTTPError, OSError) as e:  # a dropped stream or a server that died mid-level
        raise LevelError(f"{type(e).__name__}: {e}; server exit code {proc.poll()}; its log ends: "
                         f"{log.read_text(errors='replace')[-1500:]}") from e
    finally:
        stop_server(proc)
    # CPU that neither this server nor the clients used during the level, as % of all cores: someone else's job
    foreign = 100 * max(0, (busy1 - busy0) - (own1 - own0)) / max(total1 - total0, 1)
    row = summarize(server, clients, timings, wall, args.max_tokens) | {
        "load_avg_1m": load, "foreign_cpu_pct": round(foreign, 1), "given": given(server, clients),
        "server_command": " ".join(cmd)}
    if spec:
        row |= draft_counts(timings, before, after)
    if m := re.search(r"n_ctx_slot = (\d+)", log.read_text(errors="replace")):
        row["ctx_per_slot"] = int(m[1])  # llama-server's own report: -c was split over the -np slots as intended
    return row


def serve_table(rows: list[dict], meta: dict) -> str:
    """One row per (server, N), grouped by server; the ratio is luce-compile's aggregate tok/s over the peer's (each
    with a draft where the peer had one). With +draft rows, three more columns (speculation_cells)."""
    ratio = ratios(rows)
    order = list(dict.fromkeys(r["server"] for r in rows))
    ordered = sorted(rows, key=lambda r: (order.index(r["server"]), r["clients"]))
    # records from before inter-token latency was measured keep their table as it was
    itl = bool(rows) and all("itl_p50_ms" in r for r in rows)
    spec = speculation(rows) if any(split_server(r["server"])[1] for r in rows) else None
    lines = [f"# Serving on loopback: luce-compile vs {meta.get('peer', PEER)} ({meta['date']})", "",
             f"{machine_text(meta)}, load before {meta['load_avg_1m']:.2f}; model "
             f"{meta['model']}; {meta['requests']} streamed /v1/completions requests per level (greedy, max_tokens "
             f"{meta['max_tokens']}, {prompt_text(meta)}). " + meta.get("setup", ""), "",
             f"Command: `{meta['command']}`", "",
             "| server | clients | requests | tokens | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | "
             + ("ITL p50 ms | ITL p99 ms | " if itl else "")
             + "luce-compile / peer | "
             + ("with draft / without | drafts accepted | same text as without | " if spec is not None else "")
             + "load before (others' CPU during) |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if itl else "")
             + ("---|---|---|" if spec is not None else "")]
    for r in ordered:
        name = f"{r['server']} `{r['given']}`" if "given" in r else r["server"]
        value = ratio.get(r["server"], {}).get(r["clients"])
        lines.append(f"| {name} | {r['clients']} | {r['requests']} | {r['tokens']} | "
                     f"{r['aggregate_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     + (f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | " if itl else "")
                     + f"{'' if value is None else f'{value:.2f}×'} | "
                     + ("".join(f"{c} | " for c in speculation_cells(r, spec)) if spec is not None else "")
                     + f"{load_text(r)} |")
    return "\n".join(lines) + "\n"


def speculation_cells(row: dict, spec: dict) -> tuple[str, str, str]:
    """A row's speculation columns: its aggregate tok/s over the same server's without a draft at that N, the draft
    tokens accepted of those proposed (%), and the requests whose text equals the same prompt's without a draft;
    empty for a row without a draft."""
    speedup = spec.get("speedup", {}).get(row["server"], {}).get(row["clients"])
    same = spec.get("same_text", {}).get(row["server"], {}).get(row["clients"])
    accepted = ""
    if "spec_drafted" in row:
        share = f" ({100 * row['spec_accepted'] / row['spec_drafted']:.0f}%)" if row["spec_drafted"] else ""
        accepted = f"{row['spec_accepted']}/{row['spec_drafted']}{share}"
    return ("" if speedup is None else f"{speedup:.2f}×", accepted, "" if same is None else f"{same[0]}/{same[1]}")


def prompt_text(meta: dict) -> str:
    """The table's words on the prompts: the one text every request repeats, or the code prompts."""
    prompts = meta.get("prompts")
    if not prompts:
        return f"{meta['prompt_chars']}-character prompt"
    return (f"{prompts['kind']} prompts 1-{prompts['count']} in file order as code completions, "
            f"{meta['prompt_chars']} characters on average, the same for every row")


def machine_text(meta: dict) -> str:
    """What the servers ran on: the GPU and its host, or the CPU and the threads each server was given."""
    if meta.get("gpu"):
        return f"{meta['gpu']} (host {meta['cpu']}, {meta.get('cores', '?')} cores)"
    return f"{meta['cpu']}, {meta['threads']} threads per server"


def load_text(row: dict) -> str:
    """The 1-minute load before the level, and the CPU other processes took during it when measured."""
    text = f"{row.get('load_avg_1m', float('nan')):.2f}"
    return text + (f" (others {row['foreign_cpu_pct']:.0f}%)" if "foreign_cpu_pct" in row else "")


def setup_text(args: argparse.Namespace, peer_version: str) -> str:
    """The table's sentences on what each server was given and how tokens were counted."""
    return (gpu_setup_text(args, peer_version) if args.gpu else cpu_setup_text(args, peer_version)) + draft_text(args)


def cpu_setup_text(args: argparse.Namespace, peer_version: str) -> str:
    return (f"Each level restarts each server sized for N sequences of {args.ctx} tokens: luce-compile serve "
            f"`--max-batch N --ctx {args.ctx}` (TVM_NUM_THREADS={args.threads}); llama-server {peer_version} "
            f"`-np N -c N×{args.ctx} --cont-batching -t {args.threads} -tb {args.threads}` (CPU backend, native build "
            "of the llama-cpp-python sdist's llama.cpp) with `ignore_eos`. Tokens are each server's streamed "
            "usage.completion_tokens; ratio = luce-compile aggregate tok/s over llama-server's at the same N. "
            "Others' CPU: the share of both cores that processes other than the server and its clients used "
            "during the level "
            f"(a level over {args.max_foreign_pct:.0f}% is rerun, up to {args.retries} times).")


def gpu_setup_text(args: argparse.Namespace, peer_version: str) -> str:
    """setup_text on a GPU machine: both servers on the one GPU, one at a time, thread counts their own defaults."""
    ours = (f"prebuilt artifact `{args.artifact}`: {artifact_summary(args.artifact)}" if args.artifact else
            "the GGUF compiled for the default target")
    return (f"Each level restarts each server sized for N sequences of {args.ctx} tokens, alone on the GPU: "
            f"luce-compile serve ({ours}) `--max-batch N --ctx {args.ctx}`; llama-server "
            f"{peer_version} `-np N -c N×{args.ctx} --cont-batching -ngl 99` (CUDA build) with `ignore_eos`. "
            "Tokens are each server's streamed usage.completion_tokens; ITL: the gaps between streamed text chunks "
            "(one a token), pooled over the level's requests; ratio = luce-compile aggregate tok/s over "
            "llama-server's at the same N.")


def draft_text(args: argparse.Namespace) -> str:
    """The table's sentences on the +draft rows: each server's draft flags and the speculation columns (empty
    without +draft rows)."""
    if "on" not in args.speculation:
        return ""
    flags = []
    if OURS in args.servers:
        flags.append(f"luce-compile serve `--draft {args.draft_artifact.name} --draft-max {args.draft_max}`")
    if PEER in args.servers:
        peer = " ".join(peer_draft_flags(Path(args.draft_model.name), args.draft_max, args.gpu))
        flags.append(f"llama-server `{peer}` (its other speculative defaults: n_min 0, p_min 0.0)")
    return (" Rows +draft: the same server restarted to speculate with a draft model, " + "; ".join(flags)
            + ". With draft / without: a row's aggregate tok/s over the same server's without a draft at that N; "
            "drafts accepted: draft tokens the target accepted of those proposed during the timed requests "
            "(luce-compile's /metrics, llama-server's timings.draft_n_accepted of draft_n); same text as without: "
            "requests whose streamed text equals the same prompt's without a draft (greedy: speculation changes "
            "no text but where a verify's rounding flips a near tie). Tokens a step accepts are streamed together, "
            "so a speculating server's ITL gaps are between those bursts.")


def artifact_summary(artifact: Path) -> str:
    """What an artifact was compiled as, from its manifest: target and decode megakernels (the flags that change
    the served numbers)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    mk = manifest.get("megakernel") or {}
    if "kernels" not in mk:
        kernels = f"no decode megakernels ({mk.get('skipped', 'not built')})"
    else:
        q8 = (mk.get("options") or {}).get("q8_activations")
        kernels = (f"decode megakernels for {min(mk['batches'])}-{max(mk['batches'])} sequences"
                   + (", 8-bit activations (--megakernel-q8)" if q8 else ", float activations"))
    return f"{manifest['target']['name']}, {kernels}"


def gpu_name() -> str:
    """nvidia-smi's name, driver and memory of the first GPU (what the record says the servers ran on)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"serve bench: --gpu but nvidia-smi failed ({e}); run it on the GPU machine") from None
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"serve bench: --gpu but nvidia-smi failed ({done.returncode}): {done.stderr[-500:]}")
    name, driver, memory = (f.strip() for f in done.stdout.splitlines()[0].split(","))
    return f"{name}, driver {driver}, {memory}"


def meta_for(args: argparse.Namespace, gguf: Path, servers: list[str]) -> dict:
    from cpu import _cpu_name
    from luce_runtime.bench import machine_load
    from peers import llama_server

    import luce_compile

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": platform.processor() or _cpu_name(),
            "threads": None if args.gpu else args.threads, "load_avg_1m": machine_load(), "model": gguf.name,
            "requests": args.requests, "max_tokens": args.max_tokens, "ctx": args.ctx, "prompt_chars": len(PROMPT),
            "clients": args.clients, "luce_compile": luce_compile.__version__, "peer": PEER,
            "llama_cpp": llama_server.LLAMA_CPP_PYTHON_VERSION,
            "command": " ".join(["python benchmarks/serve.py", *sys.argv[1:]])}
    if args.gpu:
        meta |= {"gpu": gpu_name(), "cores": os.cpu_count()}
    if args.artifact:
        manifest = json.loads((args.artifact / "manifest.json").read_text())
        meta["artifact"] = {"path": str(args.artifact), "target": manifest["target"]["name"],
                            "source": manifest["source"]["file_name"]}
    if PEER in servers and args.llama_server:
        meta["llama_server"] = {"version": llama_server.version(args.llama_server), "binary": str(args.llama_server),
                                "source": "given (--llama-server)", "gpu_layers": 99 if args.gpu else 0}
    elif PEER in servers:
        binary = llama_server.llama_server_binary()  # built once (~10 min on 2 cores), before any timing
        meta["llama_server"] = {"version": llama_server.version(binary), "binary": str(binary),
                                "source": f"llama-cpp-python {llama_server.LLAMA_CPP_PYTHON_VERSION} sdist, "
                                          "vendor/llama.cpp", "cmake_flags": llama_server.CMAKE_FLAGS,
                                "build_seconds": llama_server.build_seconds()}
    if "on" in args.speculation:
        meta |= {"speculation": args.speculation, "draft_max": args.draft_max, "draft": drafts_meta(args, servers)}
    if args.prompts:
        timed = args.prompts[:args.requests]
        meta |= {"prompt_chars": round(sum(map(len, timed)) / len(timed)),
                 "prompts": {"kind": "HumanEval", "count": len(timed), "source": str(args.code_prompts or "cache"),
                             "warm_up_index": len(args.prompts) - 1}}
    meta["setup"] = setup_text(args, meta.get("llama_server", {}).get("version", ""))
    return meta


def drafts_meta(args: argparse.Namespace, servers: list[str]) -> dict:
    """Which draft model each server speculated with: luce-compile's artifact (with its manifest's target and source
    GGUF) or GGUF, llama-server's GGUF and its draft flags."""
    out: dict[str, dict] = {}
    if OURS in servers:
        manifest = args.draft_artifact / "manifest.json"
        out[OURS] = {"path": str(args.draft_artifact), "flags": f"--draft {args.draft_artifact} --draft-max "
                                                                  f"{args.draft_max}"}
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            out[OURS] |= {"target": m["target"]["name"], "source": m["source"]["file_name"]}
    if PEER in servers:
        out[PEER] = {"path": str(args.draft_model), "source": args.draft_model.name,
                     "flags": " ".join(peer_draft_flags(args.draft_model, args.draft_max, args.gpu))}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked (check_args), with the speculation modes resolved and the code prompts loaded."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m", help="a known model name or a .gguf path")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=32, help="requests per level (fixed, whatever N is)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=512, help="context per sequence / slot")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-foreign-pct", type=float, default=10.0,
                   help="rerun a level when other processes took more than this %% of the CPU during it")
    p.add_argument("--retries", type=int, default=2, help="reruns of a disturbed level (the least disturbed is kept)")
    p.add_argument("--quiet-wait-s", type=float, default=300.0, help="longest wait for a quiet machine per level")
    p.add_argument("--servers", nargs="+", default=[OURS, PEER], choices=[OURS, PEER])
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--logdir", type=Path, help="keep each server's log here (default: a temporary folder, deleted)")
    # on a GPU machine (benchmarks/h200/serve.sh): a prebuilt artifact, a llama-server built there, every layer on
    # the GPU; the quiet-machine wait and reruns still apply (measured over all its cores)
    p.add_argument("--artifact", type=Path, help="luce-compile serves this prebuilt artifact (with the runtime "
                   "alone) instead of compiling --model; --model is then the GGUF it was compiled from")
    p.add_argument("--llama-server", type=Path, help="this llama-server binary instead of the cached CPU build")
    p.add_argument("--gpu", action="store_true", help="llama-server gets -ngl 99, neither server a thread count; "
                   "the record names the GPU (nvidia-smi)")
    # speculation (issue 39): rows with a draft model beside the rows without, on code prompts
    p.add_argument("--draft-artifact", type=Path, help="luce-compile serve speculates with this draft (--draft): an "
                   "artifact directory, or a GGUF it compiles; its vocabulary must be the target's")
    p.add_argument("--draft-model", type=Path, help="llama-server speculates with this draft GGUF (-md, "
                   "--spec-type draft-simple)")
    p.add_argument("--draft-max", type=int, default=8, help="most tokens drafted a step, both servers (luce-compile's "
                   "--draft-max, llama-server's --spec-draft-n-max; default 8, luce-compile serve's)")
    p.add_argument("--speculation", nargs="+", choices=("off", "on"), help="per server and N, a row without the "
                   "draft model (off) and one with it (on, named SERVER+draft); default: off on where a draft is "
                   "given, else off")
    p.add_argument("--code-prompts", type=Path, help="HumanEval's problems (HumanEval.jsonl[.gz]) for the code "
                   "prompts that a draft brings, instead of the cache's copy (fetched with pip): for a machine "
                   "without PyPI. Given alone, the rows without a draft use code prompts too")
    p.add_argument("--check", action="store_true", help="check the arguments and the prompts, then exit "
                   "(serve.sh's first step: a mistake shows before minutes of setup)")
    args = p.parse_args(argv)
    drafts = args.draft_artifact is not None or args.draft_model is not None
    args.speculation = args.speculation or (["off", "on"] if drafts else ["off"])
    check_args(args)
    args.prompts = code_prompts(args.code_prompts) if drafts or args.code_prompts else None
    if args.prompts and args.requests >= len(args.prompts):
        raise SystemExit(f"serve bench: --requests {args.requests} code prompts, and the last is the warm-up's: "
                         f"at most {len(args.prompts) - 1} (each request its own prompt)")
    return args


def main() -> int:
    args = parse_args()
    if args.check:
        return 0
    # a SIGTERM (serve.sh's `timeout`) ends the run as Ctrl-C does, so the level's server is stopped on the way out:
    # it runs in its own session, which a device machine leaves running after the call
    signal.signal(signal.SIGTERM, _interrupt)
    import logging

    from luce_compile.models import fetch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    gguf = Path(args.model) if args.model.endswith(".gguf") else fetch(args.model)
    meta = meta_for(args, gguf, args.servers)
    stem = args.out / f"serve-{meta['date'][:10]}"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        logdir = args.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        # per N: each server without a draft, then each with one (alternating, so a drift in load hits both)
        names = [server + (DRAFT if mode == "on" else "") for mode in args.speculation for server in args.servers]
        for n in args.clients:
            for server in names:
                try:
                    rows.append(bench_level(server, n, gguf, args, logdir))
                except LevelError as e:  # the other levels still run: one call on a GPU machine gets them all
                    print(e, file=sys.stderr, flush=True)
                    meta.setdefault("failed_levels", []).append(f"{server} N={n}")
                # the record so far after every level: a run cut short (a device call's time limit) keeps its levels
                write_results(stem, results_doc(meta, rows), serve_table(rows, meta))
    print(serve_table(rows, meta))
    return 1 if meta.get("failed_levels") else 0


def check_args(args: argparse.Namespace) -> None:
    """Refuse option combinations that would measure something else than asked, before anything starts."""
    if args.artifact and not (args.artifact / "manifest.json").is_file():
        raise SystemExit(f"serve bench: --artifact {args.artifact} has no manifest.json; pass an artifact directory")
    if args.artifact and not args.model.endswith(".gguf"):
        raise SystemExit("serve bench: --artifact needs --model as the .gguf it was compiled from (llama-server "
                         "serves that file and the requests name it)")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"serve bench: --llama-server {args.llama_server} is not an executable file")
    check_draft_args(args)


def check_draft_args(args: argparse.Namespace) -> None:
    """check_args for speculation: a draft for every server that speculates, of the kind it takes, and (both being
    artifacts) luce-compile's draft with the target's vocabulary, which its server requires before it starts."""
    if "on" in args.speculation:
        flags = {OURS: ("--draft-artifact", args.draft_artifact), PEER: ("--draft-model", args.draft_model)}
        if missing := [f"{flag} for {s}" for s, (flag, path) in flags.items() if s in args.servers and path is None]:
            raise SystemExit(f"serve bench: --speculation on needs a draft model for every server: give "
                             f"{' and '.join(missing)}, or leave that server out (--servers)")
    if args.code_prompts and not args.code_prompts.is_file():
        raise SystemExit(f"serve bench: --code-prompts {args.code_prompts} is not a file; copy HumanEval.jsonl.gz from "
                         "the luce cache's data/ there (benchmarks/spec.py fetches it)")
    if args.draft_model and args.draft_model.suffix != ".gguf":
        raise SystemExit(f"serve bench: --draft-model {args.draft_model} is not a .gguf: llama-server loads a GGUF")
    draft = args.draft_artifact
    if draft is None or draft.suffix == ".gguf":  # a GGUF: luce-compile serve compiles it for the target's target
        return
    if not (draft / "manifest.json").is_file():
        raise SystemExit(f"serve bench: --draft-artifact {draft} has no manifest.json; pass an artifact directory "
                         "(or a GGUF)")
    if args.artifact:
        from luce_runtime.speculative import VOCAB_SLACK

        theirs, mine = (json.loads((a / "manifest.json").read_text())["config"]["n_vocab"]
                        for a in (draft, args.artifact))
        if not 0 <= mine - theirs <= VOCAB_SLACK:  # the runtime's rule (speculative.check_same_vocabulary)
            raise SystemExit(f"serve bench: --draft-artifact {draft} has {theirs} vocabulary rows and --artifact "
                             f"{args.artifact} {mine}: luce-compile serve refuses a draft whose vocabulary is not "
                             f"the target's or at most {VOCAB_SLACK} rows shorter (speculative."
                             "check_same_vocabulary); pick a draft of the target's vocabulary")


def code_prompts(path: Path | None) -> list[str]:
    """HumanEval's prompts in file order, raw (the model completes each function body, as HumanEval is scored): the
    source benchmarks/spec.py draws its code prompts from; from `path` (HumanEval.jsonl or .jsonl.gz) if given, else
    spec.py's cached copy, fetched with pip the first time."""
    from spec import humaneval_problems, read_problems

    problems = humaneval_problems() if path is None else read_problems(path)
    return [p["prompt"] for p in problems]


if __name__ == "__main__":
    sys.exit(main())
