"""The CLI as a user runs it: subprocesses of `luce-compile`, their output parsed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRANCE = "The capital of France is"
FRANCE_IDS = [504, 3575, 282, 4649, 314]  # llama.cpp's tokenize of FRANCE for SmolLM2 (references.md)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luce_compile.cli", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_inspect_json_reports_the_config(smollm2_path):
    out = cli("inspect", str(smollm2_path), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["config"]["arch"] == "llama" and info["config"]["n_layer"] == 30
    assert info["tensors"]["by_type"]["Q4_1"]["tensors"] == 210 and info["tokenizer"]["pre"] == "smollm"


@pytest.mark.slow
def test_tokenize_json_matches_llama_cpp(smollm2_path):
    out = cli("tokenize", str(smollm2_path), FRANCE, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == FRANCE_IDS


@pytest.mark.slow
def test_oracle_generate_json_gives_paris(smollm2_path):
    out = cli("generate", str(smollm2_path), "-p", FRANCE, "-n", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_ids"] == FRANCE_IDS and result["ids"][0] == 7042 and "Paris" in result["text"]


@pytest.mark.unit
def test_targets_json_is_honest():
    out = cli("targets", "--json")
    assert out.returncode == 0, out.stderr
    status = {row["name"]: row["status"] for row in json.loads(out.stdout)}
    assert status["cpu"] == "measured" and status["sm_90"] == "measured"
    assert {status[t] for t in ("sm_86", "sm_120", "gfx1201", "gfx1151")} == {"compiled"}


@pytest.mark.unit
def test_unknown_model_is_one_line_error():
    out = cli("inspect", "/nonexistent/model.gguf")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_synthetic_preset_names_a_model():
    out = cli("inspect", "synthetic:tiny-qwen3", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"]["arch"] == "qwen3"
    bad = cli("inspect", "synthetic:no-such-preset")
    assert bad.returncode == 2 and "known: tiny-llama" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_serve_limits_reach_the_server_options(tmp_path, monkeypatch, capsys):
    """--max-waiting and --max-body-mb become ServeOptions: the 429 bound and the 413 limit; --kv-memory and the KV
    plan's batch and context too, and the plan's line is printed at start."""
    import luce_runtime.serve as serve_pkg
    from luce_runtime.kv_memory import KVPlan
    from luce_runtime.serve import app

    from luce_compile.cli import main

    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text("{}")  # only its presence is read before serve() is called
    got = []
    monkeypatch.setattr(serve_pkg, "serve", got.append)
    # the KV pool the server will make (it reads the artifact): its batch and context are what serve() gets
    plan = KVPlan("float16", 6144, 1 << 30, "--kv-memory", context=8192, sequences=3, extra=4)
    monkeypatch.setattr(app, "kv_plan", lambda options: plan)
    assert main(["serve", str(art), "--max-waiting", "3", "--max-body-mb", "0.5", "--kv-memory", "1G"]) == 0
    assert got[0].max_waiting == 3 and got[0].max_body_bytes == 2**19 and got[0].artifact == art
    assert (got[0].max_batch, got[0].max_context, got[0].kv_memory) == (3, 8192, 1 << 30)
    assert main(["serve", str(art)]) == 0
    assert got[1].max_waiting == 0 and got[1].max_body_bytes == 4 * 2**20  # 0: 4 x max_batch, decided by the server
    assert capsys.readouterr().err.count("KV cache float16, 6.0 KiB a token: 57,344 tokens of context") == 2
