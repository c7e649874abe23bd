"""The serving benchmark with a draft model (issue 39): benchmarks/serve.py's "+draft" rows, the command lines and
code prompts both servers get with a draft, the record and table with speculation rows; then one real run of
`luce-compile serve` without and with a draft on tiny CPU models (e2e)."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from tests.bench._load import load_benchmark_module

serve = load_benchmark_module("serve")
from peers import llama_server  # noqa: E402  (importable once serve.py put benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[2]
# HumanEval's format (task_id, prompt, ...): three function stubs for a model to complete
PROBLEMS = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x: int) -> int:\n    \"\"\"Return x plus {i}.\"\"\"\n",
             "entry_point": f"f{i}"} for i in range(4)]


def humaneval_file(path: Path, problems: list[dict] = PROBLEMS) -> Path:
    lines = "".join(json.dumps(p) + "\n" for p in problems)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def artifact_dir(path: Path, n_vocab: int = 49152) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"config": {"n_vocab": n_vocab}, "target": {"name": "sm_90"},
                                                    "source": {"file_name": f"{path.parent.name}.gguf"}}))
    return path


def flags_of(cmd: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(cmd, cmd[1:], strict=False) if a.startswith("-")}


# ---- (a) the command lines ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_luce_compile_gets_its_draft_and_draft_max():
    ours = serve.server_command("luce-compile", Path("/w/t.gguf"), port=9, threads=None, clients=8, ctx=1024,
                                artifact=Path("/h/t/artifact"), gpu=True, draft=Path("/h/d/artifact"), draft_max=6)
    assert ours[1:5] == ["-m", "luce_compile.cli", "serve", "/h/t/artifact"]
    assert flags_of(ours)["--draft"] == "/h/d/artifact" and flags_of(ours)["--draft-max"] == "6"
    assert flags_of(ours)["--max-batch"] == "8" and flags_of(ours)["--ctx"] == "1024"
    plain = serve.server_command("luce-compile", Path("/w/t.gguf"), port=9, threads=None, clients=8, ctx=1024,
                                 artifact=Path("/h/t/artifact"), gpu=True)
    assert "--draft" not in plain and "--draft-max" not in plain


@pytest.mark.unit
def test_llama_server_gets_the_draft_gguf_a_drafter_and_the_draft_on_the_gpu():
    binary = Path("/w/llama.cpp/build/bin/llama-server")
    gpu = serve.server_command("llama-server", Path("/w/t.gguf"), port=9, threads=None, clients=8, ctx=1024,
                               binary=binary, gpu=True, draft=Path("/w/d.gguf"), draft_max=8)
    flags = flags_of(gpu)
    assert flags["-m"] == "/w/t.gguf" and flags["-md"] == "/w/d.gguf"
    assert flags["--spec-type"] == "draft-simple" and flags["--spec-draft-n-max"] == "8"
    assert flags["-ngl"] == flags["-ngld"] == "99" and flags["-np"] == "8" and flags["-c"] == str(8 * 1024)
    cpu = serve.server_command("llama-server", Path("/w/t.gguf"), port=9, threads=2, clients=1, ctx=512,
                               binary=binary, draft=Path("/w/d.gguf"), draft_max=8)
    assert "-md" in cpu and "-ngld" not in cpu and "-ngl" not in cpu  # the CPU build has no GPU to put it on
    plain = serve.server_command("llama-server", Path("/w/t.gguf"), port=9, threads=None, clients=1, ctx=512,
                                 binary=binary, gpu=True)
    assert not {"-md", "--spec-type", "--spec-draft-n-max", "-ngld"} & set(plain)


def vendored_llama_cpp(*names: str) -> dict[str, str]:
    """Files of the llama.cpp tree that the peers build (the llama-cpp-python sdist's), without downloading it."""
    sdist = next((p for p in (llama_server.cache_root() / "peers" / "sdist" / llama_server.SDIST,
                              Path("/tmp/lcp") / llama_server.SDIST) if p.is_file()), None)
    if sdist is None:
        pytest.skip(f"no {llama_server.SDIST} in the cache (scripts/setup.sh fetches it)")
    want, out = {llama_server.VENDOR + n: n for n in names}, {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name in want:
                out[want[member.name]] = tar.extractfile(member).read().decode()
            if len(out) == len(want):
                return out
    raise AssertionError(f"{sdist} lacks {sorted(set(names) - set(out))}")


@pytest.mark.unit
def test_llama_server_draft_flags_are_the_vendored_llama_cpp_s():
    """Checked against the llama.cpp the peer is built from: each flag is one of its options, `--draft-max` (what
    older llama.cpp took) is removed there, and without --spec-type a draft model drafts nothing (the types default
    to none), which is why the command names draft-simple."""
    src = vendored_llama_cpp("common/arg.cpp", "common/common.h", "common/speculative.cpp")
    flags = [f for f in serve.peer_draft_flags(Path("d.gguf"), 8, gpu=True) if f.startswith("-")]
    assert flags == ["-md", "--spec-type", "--spec-draft-n-max", "-ngld"]
    for flag in flags:
        assert f'"{flag}"' in src["common/arg.cpp"], flag
    removed = src["common/arg.cpp"].split('{"--draft", "--draft-n", "--draft-max"}', 1)[1][:200]
    assert "the argument has been removed" in removed
    assert "types = { COMMON_SPECULATIVE_TYPE_NONE }" in src["common/common.h"]
    assert '{"draft-simple",  COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE}' in src["common/speculative.cpp"]


# ---- (b) the prompts and request bodies --------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("name", ["HumanEval.jsonl.gz", "HumanEval.jsonl"])
def test_code_prompts_are_humaneval_prompts_in_file_order(tmp_path, name):
    assert serve.code_prompts(humaneval_file(tmp_path / name)) == [p["prompt"] for p in PROBLEMS]


@pytest.mark.unit
def test_code_prompts_default_to_spec_py_s_humaneval(monkeypatch):
    spec = importlib.import_module("spec")  # benchmarks/spec.py, as serve.py imports it
    monkeypatch.setattr(spec, "humaneval_problems", lambda: PROBLEMS[::-1])
    assert serve.code_prompts(None) == [p["prompt"] for p in PROBLEMS[::-1]]


def parse(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return serve.parse_args(["--model", str(tmp_path / "t.gguf"), "--artifact", str(artifact_dir(tmp_path / "t")),
                             "--code-prompts", str(humaneval_file(tmp_path / "he.jsonl")), *extra])


@pytest.mark.unit
def test_a_draft_brings_code_prompts_and_both_speculation_modes(tmp_path):
    args = parse(tmp_path, "--draft-artifact", str(artifact_dir(tmp_path / "d")), "--draft-model",
                 str(tmp_path / "d.gguf"), "--requests", "3")
    assert args.speculation == ["off", "on"]
    assert args.prompts == [p["prompt"] for p in PROBLEMS]  # the first 3 timed, the last one the warm-up's
    plain = serve.parse_args(["--model", "m.gguf"])
    assert plain.speculation == ["off"] and plain.prompts is None and plain.draft_max == 8
    only_off = parse(tmp_path, "--draft-model", str(tmp_path / "d.gguf"), "--servers", "llama-server",
                     "--speculation", "off", "--requests", "3")
    assert only_off.speculation == ["off"] and only_off.prompts  # the same prompts, for a baseline run


@pytest.mark.unit
def test_parse_args_refuses_what_would_not_speculate_as_asked(tmp_path):
    with pytest.raises(SystemExit, match="needs a draft model for every server: give --draft-model for llama-server"):
        parse(tmp_path, "--draft-artifact", str(artifact_dir(tmp_path / "d")), "--requests", "3")
    with pytest.raises(SystemExit, match="at most 3"):  # 4 prompts: each request its own, the last the warm-up's
        parse(tmp_path, "--servers", "luce-compile", "--draft-artifact", str(artifact_dir(tmp_path / "d")),
              "--requests", "4")
    with pytest.raises(SystemExit, match="151936 vocabulary rows and --artifact .* 49152: .*check_same_vocabulary"):
        parse(tmp_path, "--servers", "luce-compile", "--draft-artifact",
              str(artifact_dir(tmp_path / "d7", n_vocab=151936)), "--requests", "3")
    with pytest.raises(SystemExit, match="49153 vocabulary rows"):  # a draft never has more rows than its target
        parse(tmp_path, "--servers", "luce-compile", "--draft-artifact",
              str(artifact_dir(tmp_path / "d8", n_vocab=49153)), "--requests", "3")
    # up to 128 rows fewer: a family's padded target (Qwen2.5-7B's 152,064 over its 0.5B's 151,936)
    parse(tmp_path, "--servers", "luce-compile", "--draft-artifact", str(artifact_dir(tmp_path / "d9", n_vocab=49024)),
          "--requests", "3")
    with pytest.raises(SystemExit, match="is not a .gguf"):
        parse(tmp_path, "--servers", "llama-server", "--draft-model", str(tmp_path / "d"), "--requests", "3")
    with pytest.raises(SystemExit, match="is not a file; copy HumanEval.jsonl.gz"):
        serve.parse_args(["--model", "m.gguf", "--code-prompts", str(tmp_path / "missing.jsonl.gz")])


def fake_request(sent: list[dict], drafts: tuple[int, int] | None = None):
    """one_request's stand-in: records each body, streams "<its prompt's last word> done" (drafts: llama-server's
    draft_n and draft_n_accepted)."""

    async def one(client: httpx.AsyncClient, url: str, body: dict):
        sent.append(body)
        drafted, accepted = drafts or (None, None)
        return serve.RequestTiming(ttft_s=0.01, tokens=4, seconds=0.1, itl_ms=[1.0, 1.0],
                                   text=body["prompt"].split()[-1] + " done", drafted=drafted, accepted=accepted)

    return one


@pytest.mark.unit
def test_run_level_sends_request_i_code_prompt_i(monkeypatch):
    sent: list[dict] = []
    monkeypatch.setattr(serve, "one_request", fake_request(sent))
    prompts = [p["prompt"] for p in PROBLEMS]
    body = serve.request_body("luce-compile", Path("m.gguf"), 16)
    timings, _ = asyncio.run(serve.run_level(1, 2, 3, body, "n2", prompts))
    assert sorted(b["prompt"] for b in sent) == prompts[:3]  # as they are: no "Log" tag in front of code
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 16 and b["stream"] for b in sent)
    assert sorted(t.prompt for t in timings) == [0, 1, 2]
    assert all(prompts[t.prompt].split()[-1] in t.text for t in timings)
    sent.clear()
    timings, _ = asyncio.run(serve.run_level(1, 1, 2, body, "n1"))  # without code prompts: as before
    assert sorted(b["prompt"] for b in sent) == [f"Log n1-{i}. {serve.PROMPT}" for i in range(2)]
    assert all(t.prompt is None for t in timings)


class FakeServer:
    """What run_level_once needs of a started server's Popen: this process stands in for it (its /proc entry)."""

    pid = os.getpid()

    def poll(self):
        return None


def fake_start(started: list[list[str]]):
    """start_server's stand-in: records the command line, writes an empty server log."""

    def start(cmd: list[str], port: int, threads: int | None, log: Path) -> FakeServer:
        started.append(cmd)
        log.write_text("")
        return FakeServer()

    return start


def level_args(tmp_path: Path, **kw) -> argparse.Namespace:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    base = {"model": str(tmp_path / "t.gguf"), "artifact": artifact_dir(tmp_path / "t"), "llama_server": binary,
            "gpu": True, "threads": 2, "requests": 3, "max_tokens": 16, "ctx": 1024, "draft_max": 8,
            "draft_artifact": tmp_path / "d" / "artifact", "draft_model": tmp_path / "d.gguf",
            "prompts": [p["prompt"] for p in PROBLEMS]}
    return argparse.Namespace(**(base | kw))


@pytest.mark.unit
@pytest.mark.parametrize("server", ["luce-compile+draft", "llama-server+draft"])
def test_a_draft_level_serves_the_draft_on_code_prompts_and_counts_the_drafts(monkeypatch, tmp_path, server):
    """One level of a +draft row, with a stand-in server and requests: its command line, the warm-up on the last
    prompt, the timed requests on the first ones, and its draft counts (ours from /metrics before and after the timed
    requests, the peer's from each request's timings)."""
    started, sent = [], []
    monkeypatch.setattr(serve, "start_server", fake_start(started))
    monkeypatch.setattr(serve, "stop_server", lambda proc: None)
    monkeypatch.setattr(serve, "one_request", fake_request(sent, drafts=(8, 3)))
    counters = iter([{"drafted": 40, "accepted": 10}, {"drafted": 100, "accepted": 31}])
    monkeypatch.setattr(serve, "spec_metrics", lambda port: next(counters))
    args = level_args(tmp_path)
    row = serve.run_level_once(server, 2, Path(args.model), args, tmp_path)
    assert row["server"] == server and row["given"] == {"luce-compile+draft": "--max-batch 2 --draft",
                                                        "llama-server+draft": "-np 2 -md"}[server]
    flags = flags_of(started[0])
    assert flags.get("--draft", flags.get("-md")) == str({"luce-compile+draft": args.draft_artifact,
                                                           "llama-server+draft": args.draft_model}[server])
    assert [b["prompt"] for b in sent[:1]] == [args.prompts[-1]]  # the warm-up
    assert sorted(b["prompt"] for b in sent[1:]) == args.prompts[:3]
    assert ("ignore_eos" in sent[0]) == (server == "llama-server+draft")
    if server == "luce-compile+draft":  # the timed requests' share of the server's counters
        assert (row["spec_drafted"], row["spec_accepted"], row["spec_source"]) == (60, 21, "metrics")
    else:  # 3 timed requests of 8 drafted, 3 accepted each; the warm-up's left out
        assert (row["spec_drafted"], row["spec_accepted"], row["spec_source"]) == (24, 9, "timings")
    assert sorted(r["prompt"] for r in row["per_request"]) == [0, 1, 2]
    assert all(len(r["text_sha1"]) == 40 for r in row["per_request"])


@pytest.mark.unit
def test_a_level_without_a_draft_counts_no_drafts(monkeypatch, tmp_path):
    started: list[list[str]] = []
    monkeypatch.setattr(serve, "start_server", fake_start(started))
    monkeypatch.setattr(serve, "stop_server", lambda proc: None)
    monkeypatch.setattr(serve, "one_request", fake_request([]))
    monkeypatch.setattr(serve, "spec_metrics", lambda port: pytest.fail("a plain level reads no draft counters"))
    args = level_args(tmp_path)
    row = serve.run_level_once("luce-compile", 2, Path(args.model), args, tmp_path)
    assert "--draft" not in started[0] and "spec_drafted" not in row and row["given"] == "--max-batch 2"


def sse(*events: dict) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


@pytest.mark.unit
def test_one_request_keeps_the_text_and_llama_server_s_draft_counts():
    """llama-server's final /v1/completions chunk with a draft: timings has draft_n and draft_n_accepted
    (tools/server/server-common.cpp, sent where it drafted)."""
    text = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]} for t in ("    return", "", " x + 1\n")]
    final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 3},
             "timings": {"predicted_n": 3, "draft_n": 6, "draft_n_accepted": 2}}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse(*text, final)))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve.one_request(client, "http://127.0.0.1:1/v1/completions", {"prompt": "def f(x):\n"})

    t = asyncio.run(go())
    assert (t.text, t.drafted, t.accepted) == ("    return x + 1\n", 6, 2)
    record = serve.request_record(t)
    assert record["drafted"] == 6 and record["accepted"] == 2 and "text" not in record
    assert record["text_sha1"] == hashlib.sha1(b"    return x + 1\n").hexdigest()


# ---- (c) the record and the table with speculation rows ---------------------------------------------------------


def spec_rows() -> list[dict]:
    """Both servers without and with a draft at N=1 and 4, in run order, 4 requests of 32 tokens each, prompts 0-3:
    tok/s ours 64, 128 (N=1) and 96, 192 (N=4) without and with; the peer's 128, 64 and 48, 96. Every text is the
    same with a draft but llama-server+draft's prompt 2 at N=4."""
    rows = []
    for n, server, wall in ((1, "luce-compile", 2.0), (1, "llama-server", 1.0), (1, "luce-compile+draft", 1.0),
                            (1, "llama-server+draft", 2.0), (4, "luce-compile", 4 / 3), (4, "llama-server", 8 / 3),
                            (4, "luce-compile+draft", 2 / 3), (4, "llama-server+draft", 4 / 3)):
        texts = ["a", "b", "c" if (n, server) != (4, "llama-server+draft") else "c'", "d"]
        timings = [serve.RequestTiming(ttft_s=0.1 * (i + 1), tokens=32, seconds=1.0, itl_ms=[2.0, 4.0], text=t,
                                       prompt=i) for i, t in enumerate(texts)]
        row = serve.summarize(server, n, timings, wall, 32) | {"load_avg_1m": 0.5, "given": serve.given(server, n)}
        if server.endswith("+draft"):
            row |= serve.draft_counts(timings, {"drafted": 0, "accepted": 0}, {"drafted": 100, "accepted": 25})
        rows.append(row)
    return rows


@pytest.mark.unit
def test_ratios_pair_each_peer_row_with_ours_in_the_same_mode():
    assert serve.ratios(spec_rows()) == {
        "llama-server": {1: pytest.approx(0.5), 4: pytest.approx(2.0)},
        "llama-server+draft": {1: pytest.approx(2.0), 4: pytest.approx(2.0)}}  # ours+draft over the peer's+draft


@pytest.mark.unit
def test_speculation_is_each_draft_row_against_the_same_server_without():
    spec = serve.speculation(spec_rows())
    assert spec["speedup"] == {"luce-compile+draft": {1: pytest.approx(2.0), 4: pytest.approx(2.0)},
                               "llama-server+draft": {1: pytest.approx(0.5), 4: pytest.approx(2.0)}}
    assert spec["same_text"] == {"luce-compile+draft": {1: [4, 4], 4: [4, 4]},
                                 "llama-server+draft": {1: [4, 4], 4: [3, 4]}}
    assert serve.speculation([r for r in spec_rows() if "+draft" not in r["server"]]) == {}


@pytest.mark.unit
def test_results_doc_with_speculation_rows_round_trips_json():
    doc = json.loads(json.dumps(serve.results_doc({"date": "2026-12-08T00:00:00+00:00"}, spec_rows())))
    assert set(doc) == {"meta", "rows", "ratios", "speculation"}
    assert doc["ratios"]["llama-server+draft"] == {"1": pytest.approx(2.0), "4": pytest.approx(2.0)}
    assert doc["speculation"]["same_text"]["llama-server+draft"]["4"] == [3, 4]
    drafted = [(r["server"], r.get("spec_drafted"), r.get("spec_accepted")) for r in doc["rows"] if r["clients"] == 1]
    assert drafted == [("luce-compile", None, None), ("llama-server", None, None),
                       ("luce-compile+draft", 100, 25), ("llama-server+draft", 100, 25)]
    assert {q["prompt"] for q in doc["rows"][0]["per_request"]} == {0, 1, 2, 3}


@pytest.mark.unit
def test_serve_table_with_speculation_rows():
    meta = {"date": "2026-12-08T00:00:00+00:00", "cpu": "x86_64", "gpu": "NVIDIA H200, driver 580, 143771 MiB",
            "cores": 16, "load_avg_1m": 0.5, "model": "t.gguf", "requests": 4, "max_tokens": 32, "prompt_chars": 410,
            "prompts": {"kind": "HumanEval", "count": 4}, "command": "python benchmarks/serve.py", "setup": "S."}
    lines = serve.serve_table(spec_rows(), meta).splitlines()
    assert "(greedy, max_tokens 32, HumanEval prompts 1-4 in file order as code completions, 410 characters on " \
           "average, the same for every row). S." in lines[2]
    assert lines[6] == ("| server | clients | requests | tokens | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | "
                        "ITL p50 ms | ITL p99 ms | luce-compile / peer | with draft / without | drafts accepted | "
                        "same text as without | load before (others' CPU during) |")
    assert lines[7].count("|") == lines[6].count("|")
    body = [ln for ln in lines[8:] if ln.startswith("| ")]
    assert [ln.split(" | ")[0] for ln in body] == [
        "| luce-compile `--max-batch 1`", "| luce-compile `--max-batch 4`", "| llama-server `-np 1`",
        "| llama-server `-np 4`", "| luce-compile+draft `--max-batch 1 --draft`",
        "| luce-compile+draft `--max-batch 4 --draft`", "| llama-server+draft `-np 1 -md`",
        "| llama-server+draft `-np 4 -md`"]
    assert body[0].endswith("| 3.0 | 4.0 |  |  |  |  | 0.50 |")  # no draft: the speculation cells are empty
    assert body[2].endswith("| 0.50× |  |  |  | 0.50 |")
    assert body[5] == ("| luce-compile+draft `--max-batch 4 --draft` | 4 | 4 | 128 | 192.0 | 250 | 397 | 3.0 | 4.0 |"
                       "  | 2.00× | 25/100 (25%) | 4/4 | 0.50 |")
    assert body[7].endswith("| 2.00× | 2.00× | 25/100 (25%) | 3/4 | 0.50 |")


@pytest.mark.unit
def test_meta_says_which_draft_each_server_used(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvidia_smi = bin_dir / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.95.05, 81559 MiB'\n")
    nvidia_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    draft = artifact_dir(tmp_path / "qwen2.5-coder-0.5b-vocab" / "artifact")
    args = level_args(tmp_path, draft_artifact=draft, clients=[1, 8], servers=["luce-compile", "llama-server"],
                      speculation=["off", "on"], code_prompts=tmp_path / "HumanEval.jsonl.gz")
    meta = serve.meta_for(args, Path(args.model), args.servers)
    assert meta["speculation"] == ["off", "on"] and meta["draft_max"] == 8
    assert meta["draft"]["luce-compile"] == {"path": str(draft), "flags": f"--draft {draft} --draft-max 8",
                                             "target": "sm_90", "source": "qwen2.5-coder-0.5b-vocab.gguf"}
    assert meta["draft"]["llama-server"] == {
        "path": str(args.draft_model), "source": "d.gguf",
        "flags": f"-md {args.draft_model} --spec-type draft-simple --spec-draft-n-max 8 -ngld 99"}
    assert meta["prompts"] == {"kind": "HumanEval", "count": 3, "source": str(args.code_prompts), "warm_up_index": 3}
    assert meta["prompt_chars"] == round(sum(len(p["prompt"]) for p in PROBLEMS[:3]) / 3)
    assert "llama-server `-md d.gguf --spec-type draft-simple --spec-draft-n-max 8 -ngld 99`" in meta["setup"]
    assert "luce-compile serve `--draft artifact --draft-max 8`" in meta["setup"]
    plain = serve.meta_for(level_args(tmp_path, clients=[1], servers=["luce-compile"], speculation=["off"],
                                      prompts=None, code_prompts=None), Path(args.model), ["luce-compile"])
    assert not {"draft", "speculation", "prompts"} & set(plain) and "+draft" not in plain["setup"]


# ---- (d) a real run on this CPU ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_serve_py_runs_luce_compile_without_and_with_a_draft(tiny, tmp_path):  # noqa: F811
    """benchmarks/serve.py end to end: luce-compile serve on a tiny model, without a draft and with itself as the
    draft (the target's own greedy tokens: nearly every draft is accepted, so a count that reads 0 is a broken
    /metrics reading), at 1 and 2 clients on three code prompts. float32 artifacts: greedy speculation streams the
    same text as plain decoding (tests/serve/test_speculative.py)."""
    model = tiny("tiny-llama")
    prompts = humaneval_file(tmp_path / "HumanEval.jsonl")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--servers", "luce-compile", "--model",
           str(model.gguf), "--artifact", str(model.artifact), "--draft-artifact", str(model.artifact),
           "--code-prompts", str(prompts), "--clients", "1", "2", "--requests", "3", "--max-tokens", "12",
           "--quiet-wait-s", "0", "--retries", "0", "--max-foreign-pct", "100", "--out", str(out), "--logdir",
           str(tmp_path / "logs")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = out.glob("serve-*.json")
    doc = json.loads(record.read_text())
    rows = doc["rows"]
    assert [(r["server"], r["clients"]) for r in rows] == [("luce-compile", 1), ("luce-compile+draft", 1),
                                                           ("luce-compile", 2), ("luce-compile+draft", 2)]
    for r in rows:
        assert r["requests"] == 3 and r["tokens"] > 0
        assert sorted(q["prompt"] for q in r["per_request"]) == [0, 1, 2]
        assert ("--draft" in r["server_command"]) == r["server"].endswith("+draft")
    for r in rows[1::2]:
        assert r["spec_source"] == "metrics" and 0 < r["spec_accepted"] <= r["spec_drafted"]
    assert doc["speculation"]["same_text"] == {"luce-compile+draft": {"1": [3, 3], "2": [3, 3]}}
    assert set(doc["speculation"]["speedup"]["luce-compile+draft"]) == {"1", "2"}
    assert doc["meta"]["draft"]["luce-compile"]["path"] == str(model.artifact)
    assert doc["meta"]["prompts"]["count"] == 3
    table = record.with_suffix(".md").read_text()
    assert "| luce-compile+draft `--max-batch 2 --draft` | 2 | 3 |" in table and "| 3/3 |" in table
