"""Prefix reuse for long agent prompts (issue 38, item 5): a conversation of --turns turns on a --system-tokens system
prompt, time to first token of each turn, on `luce-compile serve` with its prompt-prefix cache (`--prefix-cache 4`)
and without it (`--prefix-cache 0`), and on llama.cpp's `llama-server` with `cache_prompt` (its own prefix reuse), one
server at a time, the same GGUF and threads.

    nice .venv/bin/python benchmarks/multi_turn.py --model qwen2.5-coder-0.5b --system-tokens 20000 --turns 5

The system prompt is Python's documentation (pydoc_data/topics.py) cut to --system-tokens tokens; each turn sends
the whole conversation (system, then the user and assistant messages so far, then a new user message) as a streamed
greedy /v1/chat/completions request of --max-tokens tokens; the next turn appends the answer. TTFT: request sent →
first streamed content. --turns-without-cache bounds the turns run without the prefix cache (each is a whole
prefill). Writes benchmarks/results/cpu-<date>-multi-turn.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from report import write_results  # noqa: E402
from serve import OURS, PEER, free_port, server_command, start_server, stop_server  # noqa: E402

QUESTIONS = ("Which section of that text explains the `with` statement? Answer in one line.",
             "And which one explains decorators?", "Name one built-in exception mentioned above.",
             "What does the text say `pass` is for?", "Summarise the topic of the first section in five words.")


def system_prompt(gguf: Path, n_tokens: int) -> str:
    import pydoc_data.topics as topics

    from luce_runtime.tokenizer import Tokenizer

    from luce_compile.gguf.reader import read_gguf

    tok = Tokenizer.from_metadata(read_gguf(gguf).metadata)
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok.encode(text, add_special=False, parse_special=False)[:n_tokens]
    return tok.decode(ids)


def turn(client: httpx.Client, port: int, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """One streamed greedy turn: (TTFT s, the answer's text, usage)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": True}
    start, ttft, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
    return (ttft if ttft is not None else time.perf_counter() - start), text, usage


def conversation(port: int, system: str, turns: int, max_tokens: int) -> list[dict]:
    rows, messages = [], [{"role": "system", "content": system}]
    with httpx.Client() as client:
        turn(client, port, [{"role": "user", "content": "Say hi."}], 4)  # warm-up: not the system prompt
        for i in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            ttft, text, usage = turn(client, port, messages, max_tokens)
            messages.append({"role": "assistant", "content": text})
            rows.append({"turn": i + 1, "ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens"),
                         "answer": text})
            print(f"  turn {i + 1}: TTFT {ttft:.2f} s, prompt {usage.get('prompt_tokens')} tokens", file=sys.stderr,
                  flush=True)
    return rows


def run(server: str, extra: list[str], gguf: Path, args: argparse.Namespace, system: str, turns: int) -> dict:
    port = free_port()
    cmd = server_command(server, gguf, port=port, threads=args.threads, clients=1, ctx=args.ctx) + extra
    log = Path(tempfile.gettempdir()) / f"multi-turn-{server}.log"  # the server's own log, outside the repository
    proc = start_server(cmd, port, args.threads, log)
    try:
        return {"command": " ".join(cmd[1:] if server == OURS else cmd), "turns": conversation(
            port, system, turns, args.max_tokens)}
    finally:
        stop_server(proc)


def markdown(doc: dict) -> str:
    modes = list(doc["runs"])
    head = "| turn | " + " | ".join(modes) + " |"
    lines = [f"# Multi-turn TTFT on a {doc['system_tokens']:,}-token system prompt, {doc['model']}, {doc['date']}", "",
             f"`{doc['command']}` ({doc['threads']} threads; load before: {doc['load']}). Time to first token per "
             "turn, seconds (prompt tokens).", "", head, "|---" * (len(modes) + 1) + "|"]
    for i in range(doc["turns"]):
        cells = []
        for m in modes:
            rows = doc["runs"][m].get("turns", [])
            cells.append(f"{rows[i]['ttft_s']:.2f} ({rows[i]['prompt_tokens']})" if i < len(rows) else "-")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--system-tokens", type=int, default=20000)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turns-without-cache", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ctx", type=int, default=24576)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--servers", nargs="+", default=["cache", "no-cache", "llama-server"])
    args = p.parse_args()
    from luce_compile.cli import resolve_model

    gguf = resolve_model(args.model)
    system = system_prompt(gguf, args.system_tokens)
    plans = {"cache": (OURS, ["--prefix-cache", "4"], args.turns),
             "no-cache": (OURS, ["--prefix-cache", "0"], args.turns_without_cache),
             "llama-server": (PEER, [], args.turns)}
    labels = {"cache": f"{OURS} --prefix-cache 4", "no-cache": f"{OURS} --prefix-cache 0",
              "llama-server": "llama-server (cache_prompt)"}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    doc = {"model": gguf.name, "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "threads": args.threads, "system_tokens": args.system_tokens, "turns": args.turns, "load": load,
           "runs": {}}
    for name in args.servers:
        server, extra, turns = plans[name]
        print(f"{labels[name]}:", file=sys.stderr, flush=True)
        try:
            doc["runs"][labels[name]] = run(server, extra, gguf, args, system, turns)
        except Exception as e:  # one server failing leaves the others' rows
            doc["runs"][labels[name]] = {"error": str(e)[-2000:]}
        write_results(ROOT / "results" / f"cpu-{datetime.now(UTC):%Y-%m-%d}-multi-turn", doc, markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
