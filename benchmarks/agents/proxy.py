"""A logging HTTP proxy between an agent client and `serve`: every exchange is passed through unchanged (responses
streamed chunk by chunk) and recorded as one JSON line: what the client sent (endpoint, body keys, model, tools by
type, max_tokens) and what it got (status, time to first byte, total time, SSE events by name, tool calls, usage).

    proxy = Proxy("http://127.0.0.1:8000", log_path)   # listens on a free 127.0.0.1 port: proxy.url
    proxy.start(); ...; proxy.stop()
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
        "content-length", "host"}


def request_summary(body: bytes) -> dict[str, Any]:
    """What a client sent, without the prompt text: keys, model, sizes, tool types."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return {"body_bytes": len(body), "json": False}
    if not isinstance(data, dict):
        return {"body_bytes": len(body)}
    tools = data.get("tools") or []
    types = Counter((t.get("type") or "custom") if isinstance(t, dict) else "?" for t in tools)
    roles = Counter(m.get("role") for m in data.get("messages") or [] if isinstance(m, dict))
    items = data.get("input")
    return {"body_bytes": len(body), "keys": sorted(data), "model": data.get("model"), "stream": data.get("stream"),
            "max_tokens": data.get("max_tokens", data.get("max_output_tokens")), "tools": dict(types),
            "roles": dict(roles), "input_items": len(items) if isinstance(items, list) else None,
            "temperature": data.get("temperature")}


def response_summary(text: str) -> dict[str, Any]:
    """SSE events by name, tool calls started, and the usage the server reported (any of the three APIs)."""
    events: Counter[str] = Counter()
    calls, usage = 0, {}
    for line in text.splitlines():
        if line.startswith("event: "):
            events[line[7:]] += 1
        elif line.startswith(":"):
            events["(comment)"] += 1
        elif line.startswith("data: {"):
            try:
                data = json.loads(line[6:])
            except ValueError:
                continue
            calls += _calls(data)
            usage.update(_usage(data))  # Anthropic: input tokens in message_start, output in message_delta
    if not events and text.startswith("{"):  # a JSON answer
        try:
            data = json.loads(text)
        except ValueError:
            data = {}
        usage = _usage(data)
        calls = sum(c.get("type") in ("tool_use", "function_call") for c in data.get("content", data.get("output", []))
                    if isinstance(c, dict))
        calls += sum(len(ch.get("message", {}).get("tool_calls") or []) for ch in data.get("choices", []))
    return {"events": dict(events), "tool_calls": calls, "usage": usage}


def _calls(data: dict[str, Any]) -> int:
    block = data.get("content_block") or data.get("item") or {}
    if data.get("type") in ("content_block_start", "response.output_item.added") and \
            block.get("type") in ("tool_use", "function_call"):
        return 1
    return sum(1 for ch in data.get("choices") or [] for tc in (ch.get("delta") or {}).get("tool_calls") or []
               if tc.get("id"))


def _usage(data: dict[str, Any]) -> dict[str, Any]:
    usage = data.get("usage") or (data.get("message") or {}).get("usage") or (data.get("response") or {}).get("usage")
    if not isinstance(usage, dict):
        return {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return {k: v for k, v in (("prompt_tokens", prompt), ("completion_tokens", completion)) if v}


class Proxy:
    def __init__(self, upstream: str, log_path: Path, tag: str = ""):
        self.upstream, self.log_path, self.tag = urlsplit(upstream), log_path, tag
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock, open(self.log_path, "a") as f:
            f.write(json.dumps({"client": self.tag, **entry}) + "\n")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # the record is the log
                pass

            def _forward(self) -> None:
                start = time.perf_counter()
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=3600)
                entry: dict[str, Any] = {"method": self.command, "path": self.path, **request_summary(body)}
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    entry["status"] = resp.status
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    if self.command == "HEAD":  # no body may follow
                        self.send_header("content-length", "0")
                        self.end_headers()
                        return
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    seen, first = [], None
                    while chunk := resp.read1(65536):
                        first = first or time.perf_counter()
                        seen.append(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    text = b"".join(seen).decode(errors="replace")
                    entry.update(response_summary(text))
                    if resp.status >= 400:
                        entry["error"] = text[:500]
                    if first is not None:
                        entry["ttfb_s"] = round(first - start, 3)
                except OSError as e:  # the client went away, or the server did
                    entry["failure"] = f"{type(e).__name__}: {e}"
                finally:
                    conn.close()
                    entry["total_s"] = round(time.perf_counter() - start, 3)
                    proxy.record(entry)

            do_GET = do_POST = do_HEAD = do_DELETE = _forward

        return Handler
