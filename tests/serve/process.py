"""`luce-compile serve` as a real server process on 127.0.0.1, for the tests that talk to it over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(args: list[str], timeout: float = 120, log: Path | None = None, *,
                  command: list[str] | None = None, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen, dict]]:
    """`luce-compile serve ARGS --port P` (or `command` ARGS, e.g. another install's `luce-runtime`) on a free port
    until /health answers: (url, the process, /health's JSON); stopped (terminated, then killed after 20 s) on exit.
    Its stderr (the access log: a line per request) goes to `log`, or a temporary file: a pipe nobody reads would
    fill and block the server."""
    port = free_port()
    err = open(log, "wb") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    command = command or [sys.executable, "-m", "luce_compile.cli"]
    proc = subprocess.Popen([*command, *args, "--port", str(port)], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                            env=env if env is not None else os.environ.copy())
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        err.flush()
        with open(err.fileno(), "rb", closefd=False) as f:
            f.seek(0)
            return f.read().decode(errors="replace")[-2000:]

    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"serve exited: {tail()}"
            try:
                health = json.loads(urllib.request.urlopen(url + "/health", timeout=2).read())
                break
            except OSError:
                assert time.monotonic() < deadline, f"serve did not answer /health within {timeout:.0f} s"
                time.sleep(0.2)
        yield url, proc, health
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()
