"""Real coding agents, unmodified, against a running `serve` (issue 37): Claude Code, Codex and OpenCode, each
installed from npm into a scratch folder, pointed at the server with its documented settings only, given a small
coding task in a fresh work folder; a logging proxy (proxy.py) records every request and answer.

    luce-compile serve qwen2.5-coder-0.5b --ctx 32768 --max-batch 2 --port 8000 &
    .venv/bin/python benchmarks/agents/run.py --server http://127.0.0.1:8000 [--clients claude codex opencode]

Writes <out>/<client>/ (the work folder, the client's output) and <out>/requests.jsonl (one line per exchange),
and prints a table per client: requests by endpoint, status codes, tool calls, wall time, prompt tokens. The
clients talk to 127.0.0.1 only (each gets its own HOME, and the settings that stop telemetry and update checks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy import Proxy  # noqa: E402

# client → (npm package, its binary under node_modules/.bin)
PACKAGES = {"claude": ("@anthropic-ai/claude-code", "claude"), "codex": ("@openai/codex", "codex"),
            "opencode": ("opencode-ai@latest", "opencode")}
TASK = ("The function add in calc.py returns the wrong result. Fix the bug in calc.py so that add(2, 3) returns 5. "
        "Edit the file; do not create other files.")
BUGGY = "def add(a, b):\n    return a - b\n"


def install(client: str, prefix: Path) -> Path:
    """The client's binary, installed from npm into prefix/<client> the first time."""
    package, binary = PACKAGES[client]
    folder = prefix / client
    path = folder / "node_modules" / ".bin" / binary
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # run from the folder: a bare package name equal to a local folder's name would install that folder
        subprocess.run(["npm", "install", "--prefix", str(folder), package], check=True, cwd=folder,
                       stdout=subprocess.DEVNULL)
    return path


def isolated_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), NO_COLOR="1")
    return env


def claude(binary: Path, url: str, model: str, work: Path, env: dict[str, str]) -> list[str]:
    env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_AUTH_TOKEN="x", ANTHROPIC_MODEL=model,
               ANTHROPIC_SMALL_FAST_MODEL=model, DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    # as root Claude Code refuses --dangerously-skip-permissions; acceptEdits lets it edit files
    return [str(binary), "-p", TASK, "--output-format", "json", "--permission-mode", "acceptEdits"]


def codex(binary: Path, url: str, model: str, work: Path, env: dict[str, str]) -> list[str]:
    home = Path(env["HOME"]) / ".codex"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "luce"\n\n[model_providers.luce]\nname = "luce"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "LUCE_API_KEY"\n')
    env.update(CODEX_HOME=str(home), LUCE_API_KEY="x")
    # exec's default sandbox is read-only, and the task is an edit
    return [str(binary), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", TASK]


def opencode(binary: Path, url: str, model: str, work: Path, env: dict[str, str]) -> list[str]:
    config = {"$schema": "https://opencode.ai/config.json", "model": f"luce/{model}", "provider": {"luce": {
        "npm": "@ai-sdk/openai-compatible", "name": "luce", "options": {"baseURL": f"{url}/v1", "apiKey": "x"},
        "models": {model: {"name": model}}}}}
    (work / "opencode.json").write_text(json.dumps(config, indent=2))
    env.update(OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1")
    return [str(binary), "run", "--print-logs", "-m", f"luce/{model}", TASK]


CLIENTS = {"claude": claude, "codex": codex, "opencode": opencode}


def run_client(client: str, binary: Path, server: str, model: str, out: Path, timeout: float) -> dict:
    folder = out / client
    shutil.rmtree(folder, ignore_errors=True)
    work, home = folder / "work", folder / "home"
    work.mkdir(parents=True)
    home.mkdir()
    (work / "calc.py").write_text(BUGGY)
    proxy = Proxy(server, out / "requests.jsonl", tag=client)
    proxy.start()
    env = isolated_env(home)
    env["PWD"] = str(work)  # OpenCode takes its project folder from PWD, not from its working directory
    cmd = CLIENTS[client](binary, proxy.url, model, work, env)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (stdout, stderr))
    wall = time.perf_counter() - start
    proxy.stop()
    (folder / "stdout.txt").write_text(stdout)
    (folder / "stderr.txt").write_text(stderr)
    fixed = (work / "calc.py").read_text() != BUGGY and "a + b" in (work / "calc.py").read_text()
    return {"client": client, "exit": code, "wall_s": round(wall, 1), "fixed": fixed}


def summarize(result: dict, records: list[dict]) -> dict:
    mine = [r for r in records if r.get("client") == result["client"]]
    return {**result, "requests": len(mine),
            "endpoints": dict(Counter(f"{r['method']} {r['path'].split('?')[0]}" for r in mine)),
            "status": dict(Counter(str(r.get("status", r.get("failure", "?"))) for r in mine)),
            "tool_calls": sum(r.get("tool_calls", 0) for r in mine),
            "prompt_tokens": [r["usage"].get("prompt_tokens") for r in mine if r.get("usage")],
            "ttfb_s": [r.get("ttfb_s") for r in mine if r.get("path", "").startswith("/v1/")]}


def served_model(server: str) -> str:
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        return json.loads(r.read())["model"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="a running luce-compile serve, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=sorted(CLIENTS))
    p.add_argument("--prefix", type=Path, default=Path("/tmp/luce-agents"), help="npm scratch folder")
    p.add_argument("--out", type=Path, default=Path("/tmp/luce-agents/runs"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds a client may run")
    args = p.parse_args(argv)
    model = served_model(args.server)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "requests.jsonl").write_text("")
    results = []
    for client in args.clients:
        binary = install(client, args.prefix)
        results.append(run_client(client, binary, args.server, model, args.out, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    records = [json.loads(line) for line in (args.out / "requests.jsonl").read_text().splitlines()]
    table = [summarize(r, records) for r in results]
    (args.out / "summary.json").write_text(json.dumps(table, indent=2))
    for row in table:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
