"""A real server process on 127.0.0.1 (a free port), serving SmolLM2's CPU artifact, shared by the serve tests."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serve.process import serve_process

API_KEY = "test-key"


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str
    proc: subprocess.Popen
    log: Path | None = None  # its stderr: the access log

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log else []

    def get(self, path: str) -> dict | str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            body = r.read().decode()
        return json.loads(body) if path != "/metrics" else body

    def stats(self) -> dict:
        return self.get("/health")["scheduler"]

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """The scheduler's stats once nothing runs or waits (bounded wait: the step loop frees within a step)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["running"] == 0 and s["waiting"] == 0) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


@pytest.fixture(scope="session")
def smol_artifact(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from luce_compile.codegen.compile import compile_model

    # f32: the serve tests compare batched streams with each alone token for token, and batched decode runs the
    # float32 GEMM while a lone sequence would take the int8 GEMV under "auto"
    return compile_model(smollm2_path, "cpu", tmp_path_factory.mktemp("serve") / "smol.cpu", precision="f32")


ALIAS = "gpt-4o-mini"  # the shared server's --alias


@pytest.fixture(scope="session")
def server(smol_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    args = ["serve", str(smol_artifact), "--api-key", API_KEY, "--max-batch", "8", "--ctx", "512", "--alias", ALIAS]
    log = tmp_path_factory.mktemp("serve-log") / "stderr.log"
    with serve_process(args, log=log) as (url, proc, health):
        yield Server(url, health["model"], proc, log)


@pytest.fixture(scope="session")
def strict_server(smol_artifact: Path) -> Server:
    """The same server under --strict: unknown fields and model names, and max_tokens past the context, refused."""
    args = ["serve", str(smol_artifact), "--api-key", API_KEY, "--max-batch", "2", "--ctx", "512", "--strict"]
    with serve_process(args) as (url, proc, health):
        yield Server(url, health["model"], proc)


@pytest.fixture(scope="session")
def oai(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def claude(server: Server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
