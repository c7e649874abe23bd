"""The serving benchmark's arithmetic, report schema and command lines (benchmarks/serve.py and
benchmarks/peers/llama_server.py). No servers run and nothing is timed: streams come from httpx's MockTransport."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
from luce_runtime.bench import percentile

from tests.bench._load import load_benchmark_module

serve = load_benchmark_module("serve")
from peers import llama_server  # noqa: E402  (importable once serve.py put benchmarks/ on sys.path)

MAX_TOKENS = 32


def timing(ttft_s: float, tokens: int = MAX_TOKENS, source: str = "usage"):
    return serve.RequestTiming(ttft_s=ttft_s, tokens=tokens, seconds=1.0, source=source)


def level_rows() -> list[dict]:
    """luce-compile 64 and 96 tok/s at N=1 and 4; llama-server 128 and 48: ratios 0.5 and 2.0."""
    rows = []
    for server, n, wall in (("luce-compile", 1, 2.0), ("llama-server", 1, 1.0),
                            ("luce-compile", 4, 4.0), ("llama-server", 4, 8.0)):
        timings = [timing(t) for t in (0.1, 0.2, 0.3, 0.4)] * 3  # 12 requests × 32 tokens = 384
        rows.append(serve.summarize(server, n, timings[: 4 if n == 1 else 12], wall, MAX_TOKENS)
                    | {"load_avg_1m": 0.5, "given": serve.given(server, n), "foreign_cpu_pct": 2.4 * n})
    return rows


@pytest.mark.unit
def test_summarize_aggregate_and_percentiles():
    ttfts = [0.05, 0.4, 0.1, 0.9, 0.2]
    timings = [timing(t) for t in ttfts] + [timing(0.3, tokens=10, source="chunks")]
    row = serve.summarize("llama-server", 4, timings, wall_s=3.0, max_tokens=MAX_TOKENS)
    assert row["tokens"] == 5 * 32 + 10
    assert row["aggregate_tok_s"] == pytest.approx(170 / 3.0)  # all generated tokens over the level's wall time
    ms = [t * 1e3 for t in [*ttfts, 0.3]]
    assert row["ttft_p50_ms"] == pytest.approx(percentile(ms, 50)) == pytest.approx(250.0)
    assert row["ttft_p99_ms"] == pytest.approx(percentile(ms, 99))
    assert row["short_requests"] == 1  # the 10-token request stopped before max_tokens
    assert row["token_sources"] == ["chunks", "usage"]
    assert len(row["per_request"]) == 6 and set(row["per_request"][0]) == {"ttft_s", "tokens", "seconds", "source"}


@pytest.mark.unit
def test_summarize_without_max_tokens_keeps_the_old_schema():
    row = serve.summarize("luce-compile", 1, [timing(0.1)], wall_s=1.0)
    assert "short_requests" not in row
    assert row["aggregate_tok_s"] == pytest.approx(32.0)
    assert row["ttft_p50_ms"] == row["ttft_p99_ms"] == pytest.approx(100.0)


@pytest.mark.unit
def test_ratios_are_ours_over_the_peer_at_the_same_n():
    rows = level_rows()
    assert [r["aggregate_tok_s"] for r in rows] == pytest.approx([64.0, 128.0, 96.0, 48.0])
    assert serve.ratios(rows) == {"llama-server": {1: pytest.approx(0.5), 4: pytest.approx(2.0)}}
    # a level the peer ran alone (ours failed or was skipped) has no ratio
    assert serve.ratios(rows[1:2]) == {}


@pytest.mark.unit
def test_results_doc_schema_round_trips_json():
    rows = level_rows()
    meta = {"date": "2026-11-30T05:00:00+00:00", "model": "m.gguf"}
    doc = json.loads(json.dumps(serve.results_doc(meta, rows)))
    assert set(doc) == {"meta", "rows", "ratios"}
    assert doc["ratios"] == {"llama-server": {"1": pytest.approx(0.5), "4": pytest.approx(2.0)}}
    required = {"server", "clients", "requests", "tokens", "wall_s", "aggregate_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                "token_sources", "per_request", "short_requests", "load_avg_1m", "given", "foreign_cpu_pct"}
    assert all(required <= set(r) for r in doc["rows"])


@pytest.mark.unit
def test_serve_table_groups_by_server_and_shows_what_each_was_given():
    meta = {"date": "2026-11-30T05:00:00+00:00", "cpu": "AMD EPYC", "threads": 2, "load_avg_1m": 0.5,
            "model": "m.gguf", "requests": 4, "max_tokens": 32, "prompt_chars": 100, "command": "python serve.py",
            "setup": "Each level restarts each server."}
    lines = serve.serve_table(level_rows(), meta).splitlines()
    assert lines[0] == "# Serving on loopback: luce-compile vs llama-server (2026-11-30T05:00:00+00:00)"
    assert lines[2].endswith("Each level restarts each server.")
    body = [ln for ln in lines if ln.startswith("| ") and "---" not in ln][1:]
    assert body == ["| luce-compile `--max-batch 1` | 1 | 4 | 128 | 64.0 | 250 | 397 |  | 0.50 (others 2%) |",
                    "| luce-compile `--max-batch 4` | 4 | 12 | 384 | 96.0 | 250 | 400 |  | 0.50 (others 10%) |",
                    "| llama-server `-np 1` | 1 | 4 | 128 | 128.0 | 250 | 397 | 0.50× | 0.50 (others 2%) |",
                    "| llama-server `-np 4` | 4 | 12 | 384 | 48.0 | 250 | 400 | 2.00× | 0.50 (others 10%) |"]


@pytest.mark.unit
def test_request_tokens_prefers_usage_then_timings_then_chunks():
    assert serve.request_tokens({"completion_tokens": 32}, {"predicted_n": 31}, 30) == (32, "usage")
    assert serve.request_tokens(None, {"predicted_n": 31}, 30) == (31, "timings")
    assert serve.request_tokens({"prompt_tokens": 5}, None, 30) == (30, "chunks")


def sse(*events: dict) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


@pytest.mark.unit
def test_one_request_counts_the_streamed_usage():
    """llama-server's /v1/completions stream: one text chunk per token (some empty mid-UTF-8), then a final chunk
    with usage and timings; the count is usage's, TTFT is at the first non-empty text."""
    text = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]} for t in ("", " the", " sea")]
    final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
             "usage": {"completion_tokens": 3, "prompt_tokens": 40}, "timings": {"predicted_n": 3}}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse(*text, final)))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve.one_request(client, "http://127.0.0.1:1/v1/completions", {"prompt": "x"})

    t = asyncio.run(go())
    assert (t.tokens, t.source) == (3, "usage")
    assert 0 <= t.ttft_s <= t.seconds


@pytest.mark.unit
def test_request_body_is_the_same_but_for_ignore_eos():
    ours = serve.request_body("luce-compile", Path("m.gguf"), MAX_TOKENS)
    peer = serve.request_body("llama-server", Path("m.gguf"), MAX_TOKENS)
    assert peer == ours | {"ignore_eos": True}  # luce-compile's strict schema rejects unknown fields
    assert ours["temperature"] == 0.0 and ours["stream"] and ours["stream_options"] == {"include_usage": True}


@pytest.mark.unit
def test_llama_server_command_line():
    cmd = llama_server.server_command(Path("/bin/llama-server"), Path("/m/model.gguf"), port=8123, threads=2,
                                      parallel=4, ctx_per_slot=512)
    assert cmd[0] == "/bin/llama-server"
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert flags["-m"] == "/m/model.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["-t"] == flags["-tb"] == "2"
    assert flags["-np"] == "4" and flags["-c"] == "2048"  # -c is split over the slots: 4 × 512
    assert "--cont-batching" in cmd and "--no-webui" in cmd
    with pytest.raises(ValueError, match="parallel=0"):
        llama_server.server_command(Path("b"), Path("m"), port=1, threads=2, parallel=0, ctx_per_slot=512)


@pytest.mark.unit
def test_luce_command_and_unknown_server():
    cmd = serve.server_command("luce-compile", Path("/m/model.gguf"), port=9, threads=2, clients=8, ctx=512)
    assert cmd[1:4] == ["-m", "luce_compile.cli", "serve"]
    assert cmd[cmd.index("--max-batch") + 1] == "8" and cmd[cmd.index("--ctx") + 1] == "512"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(ValueError, match="unknown server 'vllm'"):
        serve.server_command("vllm", Path("m"), port=9, threads=2, clients=1, ctx=512)


@pytest.mark.unit
def test_cache_dir_is_keyed_like_setup_sh(monkeypatch, tmp_path):
    monkeypatch.setenv("LUCE_CACHE", str(tmp_path))
    key = llama_server.cpu_key()
    assert llama_server.install_dir() == tmp_path / "peers" / f"llama-server-0.3.36-{key}"
    if Path("/proc/cpuinfo").is_file() and shutil.which("md5sum"):
        shell = subprocess.run("grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-12", shell=True,
                               capture_output=True, text=True, check=True).stdout.strip()
        # scripts/setup.sh's wheel cache key, with its -noamx where the CPU has AMX (built without it)
        assert key == (f"{shell}-noamx" if llama_server.cpu_has_amx() else shell)
        has_amx = subprocess.run("grep -qw amx_tile /proc/cpuinfo", shell=True).returncode == 0
        assert llama_server.cpu_has_amx() == has_amx  # setup.sh's test


def fake_sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.mark.unit
def test_extract_takes_only_vendored_llama_cpp(tmp_path):
    sdist = fake_sdist(tmp_path / "s.tar.gz", {"llama_cpp_python-0.3.36/setup.py": "x",
                                               "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": "y"})
    src = llama_server.extract_llama_cpp(sdist, tmp_path / "out")
    assert (src / "CMakeLists.txt").read_text() == "y"
    assert not (tmp_path / "out" / "llama_cpp_python-0.3.36" / "setup.py").exists()
    wrong = fake_sdist(tmp_path / "w.tar.gz", {"other-1.0/README": "z"})
    with pytest.raises(llama_server.PeerBuildError, match="has no llama_cpp_python-0.3.36/vendor/llama.cpp/"):
        llama_server.extract_llama_cpp(wrong, tmp_path / "out2")


@pytest.mark.unit
def test_bench_level_reruns_a_disturbed_level_and_keeps_the_cleanest(monkeypatch):
    attempts = iter([35.0, 12.0, 20.0])
    monkeypatch.setattr(serve, "wait_quiet", lambda threshold, wait: 1.0)
    monkeypatch.setattr(serve, "run_level_once", lambda *a: {
        "aggregate_tok_s": 1.0, "ttft_p50_ms": 1.0, "tokens": 1, "token_sources": ["usage"], "load_avg_1m": 0.1,
        "foreign_cpu_pct": next(attempts)})
    args = type("Args", (), {"retries": 2, "max_foreign_pct": 10.0, "quiet_wait_s": 0.0})()
    row = serve.bench_level("llama-server", 4, Path("m.gguf"), args, Path("."))
    assert (row["foreign_cpu_pct"], row["attempt"], row["attempts"]) == (12.0, 2, 3)
    quiet = iter([2.0])
    monkeypatch.setattr(serve, "run_level_once", lambda *a: {
        "aggregate_tok_s": 1.0, "ttft_p50_ms": 1.0, "tokens": 1, "token_sources": ["usage"], "load_avg_1m": 0.1,
        "foreign_cpu_pct": next(quiet)})
    assert serve.bench_level("luce-compile", 1, Path("m.gguf"), args, Path("."))["attempts"] == 1


@pytest.mark.unit
def test_cpu_accounting_reads_proc():
    if not Path("/proc/stat").is_file():
        pytest.skip("no /proc")
    busy, total = serve.cpu_jiffies()
    assert 0 < busy < total
    assert serve.own_jiffies(os.getpid()) > 0  # this process's ticks, counted twice (as "server" and as client)


@pytest.mark.unit
def test_bench_level_reruns_a_failed_level_and_says_so_when_all_fail(monkeypatch):
    monkeypatch.setattr(serve, "wait_quiet", lambda threshold, wait: 1.0)
    outcomes = iter([serve.LevelError("RemoteProtocolError"), 3.0])

    def once(*a):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return {"aggregate_tok_s": 1.0, "ttft_p50_ms": 1.0, "tokens": 1, "token_sources": ["usage"],
                "load_avg_1m": 0.1, "foreign_cpu_pct": outcome}

    monkeypatch.setattr(serve, "run_level_once", once)
    args = type("Args", (), {"retries": 1, "max_foreign_pct": 10.0, "quiet_wait_s": 0.0})()
    assert serve.bench_level("luce-compile", 4, Path("m.gguf"), args, Path("."))["attempt"] == 2

    def fail(*a):
        raise serve.LevelError("server died")

    monkeypatch.setattr(serve, "run_level_once", fail)
    with pytest.raises(serve.LevelError, match="luce-compile N=4 failed 2 times"):
        serve.bench_level("luce-compile", 4, Path("m.gguf"), args, Path("."))


# ---- inter-token latency, the GPU machine's command lines and meta (benchmarks/h200/serve.sh) -------------------


@pytest.mark.unit
def test_inter_token_gaps_are_between_consecutive_chunks():
    assert serve.inter_token_ms([0.1, 0.15, 0.35]) == pytest.approx([50.0, 200.0])
    assert serve.inter_token_ms([0.1]) == [] and serve.inter_token_ms([]) == []


@pytest.mark.unit
def test_one_request_records_a_gap_per_chunk_after_the_first():
    text = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]} for t in (" a", "", " b", " c")]
    final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 3}}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse(*text, final)))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve.one_request(client, "http://127.0.0.1:1/v1/completions", {"prompt": "x"})

    t = asyncio.run(go())
    assert len(t.itl_ms) == 2  # three non-empty chunks; the empty one (mid-UTF-8) is no token arrival
    assert all(g >= 0 for g in t.itl_ms) and t.ttft_s + sum(t.itl_ms) / 1e3 <= t.seconds


@pytest.mark.unit
def test_summarize_pools_the_gaps_and_keeps_each_requests_mean():
    fast = serve.RequestTiming(ttft_s=0.1, tokens=4, seconds=1.0, itl_ms=[1.0, 2.0, 3.0])
    slow = serve.RequestTiming(ttft_s=0.2, tokens=4, seconds=1.0, itl_ms=[10.0, 20.0, 30.0])
    row = serve.summarize("luce-compile", 2, [fast, slow], wall_s=1.0, max_tokens=4)
    pooled = [1.0, 2.0, 3.0, 10.0, 20.0, 30.0]
    assert row["itl_p50_ms"] == pytest.approx(percentile(pooled, 50)) == pytest.approx(6.5)
    assert row["itl_p99_ms"] == pytest.approx(percentile(pooled, 99))
    assert row["per_request"][1] == {"ttft_s": 0.2, "tokens": 4, "seconds": 1.0, "source": "usage",
                                     "itl_mean_ms": pytest.approx(20.0), "chunks": 4}
    assert json.loads(json.dumps(row))["itl_p50_ms"] == pytest.approx(6.5)


@pytest.mark.unit
def test_serve_table_shows_itl_columns_only_when_every_row_has_them():
    meta = {"date": "2026-12-01T22:00:00+00:00", "cpu": "AMD EPYC", "threads": 2, "load_avg_1m": 0.5,
            "model": "m.gguf", "requests": 4, "max_tokens": 32, "prompt_chars": 100, "command": "python serve.py"}
    gaps = [serve.RequestTiming(ttft_s=0.1, tokens=32, seconds=1.0, itl_ms=[2.0, 4.0])] * 4
    rows = [serve.summarize("luce-compile", 1, gaps, 2.0, MAX_TOKENS) | {"load_avg_1m": 0.5, "given": "--max-batch 1"},
            serve.summarize("llama-server", 1, gaps, 1.0, MAX_TOKENS) | {"load_avg_1m": 0.5, "given": "-np 1"}]
    lines = serve.serve_table(rows, meta).splitlines()
    assert "| TTFT p99 ms | ITL p50 ms | ITL p99 ms | luce-compile / peer |" in lines[6]
    assert lines[7].count("|") == lines[6].count("|")
    assert lines[8] == "| luce-compile `--max-batch 1` | 1 | 4 | 128 | 64.0 | 100 | 100 | 3.0 | 4.0 |  | 0.50 |"
    old = [rows[0], level_rows()[1]]  # a row from before ITL was measured: the old table
    assert "ITL" not in serve.serve_table(old, meta)


@pytest.mark.unit
@pytest.mark.parametrize("path", sorted((Path(serve.ROOT) / "results").glob("serve-*.json")), ids=lambda p: p.name)
def test_committed_serve_records_render_to_their_tables(path: Path):
    """Each committed serving record's JSON (those from before ITL too) renders to its committed table, line for
    line."""
    doc = json.loads(path.read_text())
    rendered = [ln for ln in serve.serve_table(doc["rows"], doc["meta"]).splitlines() if ln.startswith("|")]
    committed = [ln for ln in path.with_suffix(".md").read_text().splitlines() if ln.startswith("|")]
    assert rendered == committed


@pytest.mark.unit
def test_gpu_command_lines_serve_the_artifact_and_offload_llama_server():
    ours = serve.server_command("luce-compile", Path("/w/m.gguf"), port=9, threads=None, clients=32, ctx=512,
                                artifact=Path("/h/smollm2-135m/artifact"), gpu=True)
    assert ours[1:5] == ["-m", "luce_compile.cli", "serve", "/h/smollm2-135m/artifact"]  # the runtime alone loads it
    assert ours[ours.index("--max-batch") + 1] == "32"
    peer = serve.server_command("llama-server", Path("/w/m.gguf"), port=9, threads=None, clients=32, ctx=512,
                                binary=Path("/w/llama.cpp/build/bin/llama-server"), gpu=True)
    assert peer[0] == "/w/llama.cpp/build/bin/llama-server"
    assert peer[peer.index("-ngl") + 1] == "99" and peer[peer.index("-np") + 1] == "32"
    assert peer[peer.index("-c") + 1] == str(32 * 512)
    assert "-t" not in peer and "-tb" not in peer  # thread counts are for the CPU runs only
    cpu = llama_server.server_command(Path("b"), Path("m"), port=1, threads=2, parallel=1, ctx_per_slot=512)
    assert "-ngl" not in cpu and cpu[cpu.index("-t") + 1] == "2"


def executable(path: Path, script: str) -> Path:
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def gpu_args(tmp_path: Path, **kw) -> argparse.Namespace:
    artifact = tmp_path / "artifact"
    artifact.mkdir(exist_ok=True)
    (artifact / "manifest.json").write_text(json.dumps({"target": {"name": "sm_90"},
                                                        "source": {"file_name": "llama-30x576.gguf"}}))
    binary = executable(tmp_path / "llama-server", "echo 'version: 1 (abc1234)' >&2\n")
    base = {"model": str(tmp_path / "llama-30x576.gguf"), "artifact": artifact, "llama_server": binary, "gpu": True,
            "threads": 2, "requests": 64, "max_tokens": 64, "ctx": 512, "clients": [1, 8, 32],
            "servers": ["luce-compile", "llama-server"], "speculation": ["off"], "draft_artifact": None,
            "draft_model": None, "draft_max": 8, "code_prompts": None, "prompts": None}
    return argparse.Namespace(**(base | kw))


@pytest.mark.unit
def test_gpu_meta_names_the_gpu_the_artifact_and_the_given_llama_server(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # nvidia-smi's CSV line as an H200 machine prints it (this machine has no GPU)
    executable(bin_dir / "nvidia-smi", "echo 'NVIDIA H200, 580.95.05, 143771 MiB'\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = gpu_args(tmp_path)
    meta = serve.meta_for(args, Path(args.model), ["luce-compile", "llama-server"])
    assert meta["gpu"] == "NVIDIA H200, driver 580.95.05, 143771 MiB" and meta["threads"] is None
    assert meta["artifact"] == {"path": str(args.artifact), "target": "sm_90", "source": "llama-30x576.gguf"}
    assert meta["llama_server"]["binary"] == str(args.llama_server) and meta["llama_server"]["gpu_layers"] == 99
    assert meta["llama_server"]["version"].startswith("1 (abc1234)")
    assert "-ngl 99" in meta["setup"] and "TVM_NUM_THREADS" not in meta["setup"]
    meta |= {"load_avg_1m": 0.1, "command": "python benchmarks/serve.py --gpu", "prompt_chars": 166}
    line = serve.serve_table([], meta).splitlines()[2]
    assert line.startswith("NVIDIA H200, driver 580.95.05, 143771 MiB (host ") and "threads per server" not in line


@pytest.mark.unit
def test_check_args_refuses_what_would_measure_something_else(tmp_path):
    serve.check_args(gpu_args(tmp_path))  # the GPU machine's arguments pass
    with pytest.raises(SystemExit, match="needs --model as the .gguf"):
        serve.check_args(gpu_args(tmp_path, model="smollm2-135m"))
    with pytest.raises(SystemExit, match="has no manifest.json"):
        serve.check_args(gpu_args(tmp_path, artifact=tmp_path))
    with pytest.raises(SystemExit, match="is not an executable file"):
        serve.check_args(gpu_args(tmp_path, llama_server=tmp_path / "missing"))


@pytest.mark.unit
def test_plot_draws_a_gpu_record(tmp_path):
    pytest.importorskip("matplotlib")
    plot = load_benchmark_module("plot")
    meta = {"date": "2026-12-01T22:00:00+00:00", "model": "m.gguf", "cpu": "Xeon", "threads": None,
            "gpu": "NVIDIA H200, driver 580.95.05, 143771 MiB", "requests": 64}
    out = plot.plot_serve({"meta": meta, "rows": level_rows()}, tmp_path / "serve-h200.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
def test_a_server_that_exits_at_start_is_a_failed_level(monkeypatch, tmp_path):
    """Not a crash of the whole run: on the GPU machine the other levels still run (bench_level reruns it first)."""
    import sys

    monkeypatch.setattr(serve, "server_command", lambda *a, **k: [sys.executable, "-c", "raise SystemExit(3)"])
    args = gpu_args(tmp_path)
    with pytest.raises(serve.LevelError, match="exited with 3"):
        serve.run_level_once("luce-compile", 32, Path(args.model), args, tmp_path)
