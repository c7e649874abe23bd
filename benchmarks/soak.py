"""Soak (issue 10.7): 64 concurrent streaming clients for 60 s against `luce-compile serve` on loopback, plus a flood
of oversized and malformed requests and clients that hang up mid-request. Not CI: it takes the machine for ~2 min.

    .venv/bin/python benchmarks/soak.py [--model smollm2-135m] [--clients 64] [--duration 60] [--max-batch 8]

The server runs as a user would start it (`luce-compile serve MODEL`, the API key from LUCE_API_KEY), with
`--max-batch 8`: 8 sequences decode and 4 × 8 may wait, so 64 clients overload it and some are answered 429 with
Retry-After; those clients wait that long and send the same request again (429s are counted, not failures).
Well-formed requests mix /v1/chat/completions, /v1/completions and /v1/messages, all streamed, over three fixed
prompts (so the prompt-prefix cache holds the same pages at the start and the end: the page check is exact).
Pass criteria, written to the results with the figures:
  - 0 failed well-formed requests (a 429 is not a failure; any other status, a broken stream or a missing end is)
  - every bad request a 4xx in its API's error shape (OpenAI's {"error": {message, type, param, code}}, Anthropic's
    {"type": "error", "error": {type, message}})
  - at least one 429 (the overload was real)
  - RSS flat: the median of the last 10 s within 10% of the median of the first 10 s (sampled every second)
  - KV pages: free pages after the run equal free pages after the warm-up, nothing running or waiting
Writes benchmarks/results/soak-<date>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from serve import free_port, stop_server  # noqa: E402

KEY = "soak-key"
MiB = 2**20
PROMPTS = ("Tell me a short story about a lighthouse keeper.", "List five facts about the moon.")
COMPLETION_PROMPT = "The history of the northern coast is a long one. In the winter of that year,"
READY_TIMEOUT_S = 900  # the first serve of a GGUF compiles it (minutes on 2 cores); cached after
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Tally:
    ok: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    rejected_429: int = 0  # well-formed requests answered 429 (retried after Retry-After)
    failed: list[str] = field(default_factory=list)  # well-formed requests that failed: what happened
    bad: dict[str, int] = field(default_factory=dict)  # bad requests per case
    bad_wrong: list[str] = field(default_factory=list)  # bad requests not answered 4xx in their API's shape
    abandoned: int = 0  # requests whose client hung up on purpose
    samples: list[dict] = field(default_factory=list)  # one a second: t, rss_mib and the scheduler's gauges


def headers(key: str | None = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def well_formed(kind: str, model: str, rng: random.Random) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": rng.randint(16, 96), "temperature": rng.choice((0.0, 0.7, 1.0)),
              "stream": True}
    if rng.random() < 0.3:
        common["stop" if kind != "messages" else "stop_sequences"] = ["\n\n", "The end"]
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    usage = {"stream_options": {"include_usage": True}}  # the token count from the server, not from chunks
    if kind == "chat":
        return "/v1/chat/completions", {**common, **usage, "messages": messages}
    if kind == "completion":
        return "/v1/completions", {**common, **usage, "prompt": COMPLETION_PROMPT}
    return "/v1/messages", {**common, "messages": messages}


async def stream_once(client: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> float | None:
    """One streamed request; returns the Retry-After seconds when answered 429, else None (ok or failed)."""
    start, ttft, tokens, ended, finished = time.perf_counter(), None, 0, False, False
    try:
        async with client.stream("POST", path, json=body, headers=headers()) as resp:
            if resp.status_code == 429:
                err = json.loads(await resp.aread())
                if not shaped(path, err):
                    tally.failed.append(f"429 not in the API's shape: {err}")
                return float(resp.headers.get("retry-after", "1"))
            if resp.status_code != 200:
                tally.failed.append(f"{path} {resp.status_code}: {(await resp.aread())[:200]!r}")
                return None
            async for line in resp.aiter_lines():
                if line.startswith("event: error") or '"error"' in line[:20]:
                    tally.failed.append(f"{path} error event: {line[:200]}")
                    return None
                if line == "data: [DONE]" or line == "event: message_stop":
                    ended = True
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage") or {}
                delta = ev.get("delta") or {}
                text = (delta.get("text") if ev.get("type") == "content_block_delta" else
                        "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                                for c in ev.get("choices", [])))
                if text:
                    tokens += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                finished |= any(c.get("finish_reason") for c in ev.get("choices", []))
                finished |= bool(delta.get("stop_reason"))
                tokens = max(tokens, usage.get("output_tokens", 0), usage.get("completion_tokens", 0))
    except httpx.HTTPError as e:
        tally.failed.append(f"{path} {type(e).__name__}: {e}")
        return None
    if not (ended and finished):
        tally.failed.append(f"{path}: the stream ended without its finish reason and end marker")
        return None
    tally.ok += 1
    tally.tokens += tokens
    if ttft is not None:
        tally.ttft_s.append(ttft)
    return None


async def streaming_client(i: int, client: httpx.AsyncClient, model: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(i)
    while time.monotonic() < deadline:
        path, body = well_formed(rng.choice(("chat", "completion", "messages")), model, rng)
        while (retry := await stream_once(client, path, body, tally)) is not None:
            tally.rejected_429 += 1
            await asyncio.sleep(retry)  # as the header says, then the same request again


def shaped(path: str, err: object) -> bool:
    if not isinstance(err, dict):
        return False
    if path.startswith("/v1/messages"):
        return err.get("type") == "error" and set(err.get("error") or {}) == {"type", "message"}
    return set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}


def bad_cases(model: str) -> list[tuple[str, str, bytes | None, str | None, int]]:
    """(case, path, body, API key, declared Content-Length or 0): each answered 4xx in its API's shape."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    huge = json.dumps({**chat, "messages": [{"role": "user", "content": "lorem ipsum " * (3 * MiB // 12)}]})
    cases = [
        ("oversized (declared 64 MiB)", "/v1/chat/completions", None, KEY, 64 * MiB),
        ("oversized messages (declared 8 MiB)", "/v1/messages", None, KEY, 8 * MiB),
        ("3 MiB prompt", "/v1/chat/completions", huge.encode(), KEY, 0),
        ("malformed json", "/v1/chat/completions", b'{"model": ', KEY, 0),
        ("malformed json (anthropic)", "/v1/messages", b"{", KEY, 0),
        ("invalid utf-8", "/v1/completions", b'{"model": "\xff\xfe"}', KEY, 0),
        ("not an object", "/v1/completions", b"[1, 2, 3]", KEY, 0),
        ("wrong type", "/v1/chat/completions", json.dumps({**chat, "max_tokens": "4"}).encode(), KEY, 0),
        ("unknown model", "/v1/messages", json.dumps({**chat, "model": "nope"}).encode(), KEY, 0),
        ("too many stops", "/v1/chat/completions", json.dumps({**chat, "stop": list("abcde")}).encode(), KEY, 0),
        ("stop too long", "/v1/messages", json.dumps({**chat, "stop_sequences": ["s" * 300]}).encode(), KEY, 0),
        ("token id out of range", "/v1/completions",
         json.dumps({"model": model, "prompt": [10**9], "max_tokens": 2}).encode(), KEY, 0),
        ("no api key", "/v1/chat/completions", json.dumps(chat).encode(), None, 0),
        ("wrong api key", "/v1/messages", json.dumps(chat).encode(), "wrong", 0),
    ]
    return cases


async def raw_exchange(port: int, path: str, head_only_length: int) -> tuple[int, bytes]:
    """Send only a request head declaring `head_only_length` bytes of body; the server must answer without them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {head_only_length}\r\n\r\n").encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")),
                      0)
        return int(head.split()[1]), await asyncio.wait_for(reader.readexactly(length), 30)
    finally:
        writer.close()


async def flood(client: httpx.AsyncClient, port: int, model: str, deadline: float, tally: Tally, seed: int) -> None:
    rng, cases = random.Random(seed), bad_cases(model)
    while time.monotonic() < deadline:
        case, path, body, key, declared = rng.choice(cases)
        try:
            if declared:
                status, raw = await raw_exchange(port, path, declared)
            else:
                resp = await client.post(path, content=body, headers={**headers(key),
                                                                      "content-type": "application/json"})
                status, raw = resp.status_code, resp.content
            err = json.loads(raw)
        except (TimeoutError, httpx.HTTPError, OSError, ValueError) as e:
            tally.bad_wrong.append(f"{case}: {type(e).__name__}: {e}")
            continue
        tally.bad[case] = tally.bad.get(case, 0) + 1
        if not (400 <= status < 500 and shaped(path, err)):
            tally.bad_wrong.append(f"{case}: {status} {str(err)[:200]}")
        await asyncio.sleep(0.1)  # ~10 bad requests a second per flooder: abuse beside the load, not instead of it


async def hang_up(port: int, model: str, deadline: float, tally: Tally) -> None:
    """Non-streaming requests whose client goes away after 0.5 s: the server must cancel them and free their pages."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 200})
    while time.monotonic() < deadline:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()
        tally.abandoned += 1
        await asyncio.sleep(1.5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sampler(client: httpx.AsyncClient, pid: int, t0: float, stop: asyncio.Event, tally: Tally) -> None:
    while not stop.is_set():
        s = (await client.get("/health")).json()["scheduler"]
        tally.samples.append({"t": round(time.monotonic() - t0, 2), "rss_mib": round(rss_mib(pid), 1),
                              **{k: s[k] for k in ("running", "waiting", "kv_pages_free", "tokens", "cancelled")}})
        with contextlib.suppress(TimeoutError):  # one sample a second until stopped
            await asyncio.wait_for(stop.wait(), 1.0)


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = (await client.get("/health")).json()["scheduler"]
        if (s["running"] == 0 and s["waiting"] == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.2)


async def soak(port: int, pid: int, model: str, args: argparse.Namespace) -> tuple[Tally, dict, dict, str, float]:
    tally = Tally()
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients + 16)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                 timeout=REQUEST_TIMEOUT_S) as client:
        warm = Tally()
        for kind in ("chat", "completion", "messages"):  # fills the prefix cache with the prompts used
            for prompt in PROMPTS:
                path, body = well_formed(kind, model, random.Random(0))
                if kind != "completion":
                    body["messages"] = [{"role": "user", "content": prompt}]
                await stream_once(client, path, body, warm)
        if warm.failed:
            raise RuntimeError(f"soak: warm-up failed: {warm.failed}")
        start = await wait_idle(client, 30)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        stop = asyncio.Event()
        watch = asyncio.create_task(sampler(client, pid, t0, stop, tally))
        await asyncio.gather(*(streaming_client(i, client, model, deadline, tally) for i in range(args.clients)),
                             *(flood(client, port, model, deadline, tally, 1000 + i) for i in range(args.flooders)),
                             hang_up(port, model, deadline, tally))
        load_s = time.monotonic() - t0  # the load, up to the last client's last request
        end = await wait_idle(client, 60)
        await asyncio.sleep(2)  # a few idle samples after the run
        stop.set()
        await watch
        metrics = (await client.get("/metrics")).text
    return tally, start, end, metrics, load_s


def verdict(tally: Tally, start: dict, end: dict) -> dict:
    rss = [s["rss_mib"] for s in tally.samples]
    first, last = statistics.median(rss[:10]), statistics.median(rss[-10:])
    return {
        "well_formed_failed_zero": not tally.failed,
        "bad_all_4xx_in_shape": not tally.bad_wrong and sum(tally.bad.values()) > 0,
        "overload_answered_429": tally.rejected_429 > 0,
        "rss_flat": abs(last - first) <= 0.10 * first,
        "kv_pages_all_free": (end["kv_pages_free"] == start["kv_pages_free"] and end["running"] == 0
                              and end["waiting"] == 0),
        "rss_first_10s_mib": first, "rss_last_10s_mib": last,
    }


def write(out: Path, record: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    s, v, r = record["samples"], record["verdict"], record["results"]
    t = [x["t"] for x in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(t, [x["rss_mib"] for x in s], label="server RSS")
    a.set_ylim(0, max(x["rss_mib"] for x in s) * 1.2)
    a.set_ylabel("MiB")
    a.set_title(f"soak: {record['config']['clients']} streaming clients + bad-request flood, "
                f"{record['config']['model']} on {record['machine']['cpus']} CPUs")
    a.legend(loc="lower right")
    b.plot(t, [x["running"] for x in s], label="running")
    b.plot(t, [x["waiting"] for x in s], label="waiting")
    b.set_ylabel("sequences")
    b.set_xlabel("seconds")
    b.legend(loc="upper left")
    c = b.twinx()
    c.plot(t, [100 * x["kv_pages_free"] / max(record["kv_pages_total"], 1) for x in s], "g:", label="KV pages free")
    c.set_ylim(0, 105)
    c.set_ylabel("% of KV pages free")
    c.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    ok = lambda k: "pass" if v[k] else "FAIL"  # noqa: E731
    server_rejected = next(int(line.split()[1]) for line in record["metrics_tail"]
                           if line.startswith("luce_requests_rejected_total"))
    lines = [
        f"# Soak {record['date']}: {record['config']['clients']} streaming clients for "
        f"{record['config']['duration_s']:.0f} s",
        "", f"`{record['command']}` (server: `{record['server_command']}`)", "",
        "| criterion | result | |", "|---|---|---|",
        f"| well-formed requests failed | {len(r['failed'])} of {r['ok'] + len(r['failed'])} | "
        f"{ok('well_formed_failed_zero')} |",
        f"| bad requests answered 4xx in the API's shape | {sum(r['bad'].values()) - len(r['bad_wrong'])} of "
        f"{sum(r['bad'].values())} | {ok('bad_all_4xx_in_shape')} |",
        f"| 429 under overload (retried after Retry-After) | {r['rejected_429']} | {ok('overload_answered_429')} |",
        f"| RSS first 10 s → last 10 s (median) | {v['rss_first_10s_mib']:.0f} → {v['rss_last_10s_mib']:.0f} MiB | "
        f"{ok('rss_flat')} |",
        f"| KV pages free after warm-up → after the run | {record['start']['kv_pages_free']} → "
        f"{record['end']['kv_pages_free']} of {record['kv_pages_total']} | {ok('kv_pages_all_free')} |",
        "", f"Served {r['ok']} streamed requests, {r['tokens']} tokens ({r['tokens'] / record['wall_s']:.0f} tok/s "
        f"aggregate), TTFT p50 {record['ttft_p50_s']:.2f} s / p99 {record['ttft_p99_s']:.2f} s; "
        f"{r['abandoned']} requests abandoned mid-generation on purpose (server counted "
        f"{record['end']['cancelled'] - record['start']['cancelled']} cancelled).",
        "", "Bad requests per case: " + ", ".join(f"{k} {n}" for k, n in sorted(r["bad"].items())) + ".",
        "", f"The server counted {server_rejected} requests refused 429: the streaming clients' {r['rejected_429']} "
        f"and {server_rejected - r['rejected_429']} of the hang-up requests, refused before they were queued (so "
        "only the others had anything to cancel). TTFT is mostly queueing: 32 requests wait behind 8 running ones "
        "(the 4 × max_batch bound) while the machine serves the aggregate rate above; a smaller "
        "ServeOptions.max_waiting answers 429 sooner instead.",
        "", f"![soak]({out.with_suffix('.png').name})", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a known model name, a GGUF or an artifact")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (the run then drains and stops)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--flooders", type=int, default=2, help="concurrent senders of bad requests")
    p.add_argument("--date", default=datetime.now(UTC).strftime("%Y-%m-%d"))
    p.add_argument("--out", type=Path, default=None, help="results path without suffix")
    p.add_argument("--render", action="store_true", help="only redraw the .md and .png from the run's .json")
    args = p.parse_args()
    out = args.out or ROOT / "results" / f"soak-{args.date}"
    if args.render:
        write(out, json.loads(out.with_suffix(".json").read_text()))
        return 0
    port = free_port()
    cmd = [sys.executable, "-m", "luce_compile.cli", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(args.max_batch), "--ctx", str(args.ctx)]
    log = out.with_suffix(".server.log")
    with log.open("w") as f:  # the key from the environment, not the command line (visible in ps)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, LUCE_API_KEY=KEY),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"soak: the server did not come up: {log.read_text()[-2000:]}")
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        tally, start, end, metrics, wall = asyncio.run(soak(port, proc.pid, health["model"], args))
    finally:
        stop_server(proc)
    log.unlink(missing_ok=True)
    ttft = sorted(tally.ttft_s) or [float("nan")]
    results = asdict(tally)
    samples = results.pop("samples")
    results.pop("ttft_s")
    record = {
        "date": args.date, "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "server_command": " ".join(cmd[1:]).replace(sys.executable, "python"),
        "config": {"model": args.model, "clients": args.clients, "duration_s": args.duration,
                   "max_batch": args.max_batch, "max_waiting": 4 * args.max_batch, "ctx": args.ctx,
                   "flooders": args.flooders},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "wall_s": round(wall, 1), "kv_pages_total": end["kv_pages_total"], "start": start, "end": end,
        "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "results": results, "verdict": verdict(tally, start, end), "samples": samples,
        "metrics_tail": [line for line in metrics.splitlines() if line.startswith(("luce_requests", "luce_time"))],
    }
    write(out, record)
    print(out.with_suffix(".md").read_text())
    return 0 if all(v for v in record["verdict"].values() if isinstance(v, bool)) else 1


if __name__ == "__main__":
    sys.exit(main())
