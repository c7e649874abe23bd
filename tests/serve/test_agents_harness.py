"""The real coding agents against a real server (benchmarks/agents/run.py), when they are installed: the clients come
from npm, which CI cannot reach, so this runs only with LUCE_AGENTS_PREFIX naming the folder run.py installed them
into (`.venv/bin/python benchmarks/agents/run.py --server URL` installs them there, /tmp/luce-agents by default)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench._load import load_benchmark_module
from tests.serve.process import serve_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PREFIX = os.environ.get("LUCE_AGENTS_PREFIX")


@pytest.fixture(scope="module")
def qwen_server(qwen2_path: Path):
    # Codex's first prompt is ~8.9K tokens and Claude Code's ~18.8K: more than SmolLM2's 8K context
    with serve_process(["serve", str(qwen2_path), "--ctx", "20480", "--max-batch", "2"], timeout=900) as (url, _, _):
        yield url


@pytest.mark.skipif(not PREFIX, reason="the agents come from npm: set LUCE_AGENTS_PREFIX to where run.py installed "
                                       "them")
@pytest.mark.parametrize("client", ["opencode", "codex", "claude"])
def test_an_agent_session_is_answered_2xx(client, qwen_server, tmp_path):
    run = load_benchmark_module("agents/run")
    binary = Path(PREFIX) / client / "node_modules" / ".bin" / run.PACKAGES[client][1]
    if not binary.exists():
        pytest.skip(f"{client} is not installed under {PREFIX}")
    result = run.run_client(client, binary, qwen_server, run.served_model(qwen_server), tmp_path, timeout=1800)
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    summary = run.summarize(result, records)
    assert summary["exit"] == 0 and summary["requests"] >= 1, summary
    assert all(200 <= r.get("status", 0) < 300 for r in records), [r for r in records if r.get("status") != 200]
