"""The benchmark harness's arithmetic and schema: roofline, medians, weight bytes, BenchResult JSON, the CPU table.

No timing assertions: clocks are fakes, and the one real run (bench_engine on a tiny model) only checks that the
numbers are positive, finite and carry the documented keys.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from luce_runtime.bench import (
    SCHEMA_VERSION,
    BenchResult,
    percentile,
    roofline_tok_s,
    weight_bytes_per_token,
)

from tests.bench._load import load_benchmark_module


def result(**over) -> BenchResult:
    base = {"name": "luce-compile", "model": "m.gguf", "target": "cpu", "prompt_len": 128, "gen_len": 32, "batch": 4,
            "prefill_tok_s": 80.0, "decode_tok_s": 25.0, "decode_batch_tok_s": 34.0, "ttft_ms": 1600.0,
            "weight_bytes_per_token": 100_000_000, "bandwidth_gb_s": 20.0}
    return BenchResult(**(base | over))


@pytest.mark.unit
def test_roofline_known_numbers():
    # 20 GB/s over 100 MB a token: 200 tok/s; H200's 4.8 TB/s over SmolLM2's 96,576,768 bytes: ~49.7k tok/s
    assert roofline_tok_s(20.0, 100_000_000) == pytest.approx(200.0)
    assert roofline_tok_s(4800.0, 96_576_768) == pytest.approx(49_701.4, rel=1e-5)
    r = result()
    assert r.roofline_tok_s == pytest.approx(200.0)
    assert r.roofline_fraction == pytest.approx(25.0 / 200.0)


@pytest.mark.unit
def test_roofline_rejects_empty_model():
    with pytest.raises(ValueError, match="bytes per token must be positive"):
        roofline_tok_s(20.0, 0)


@pytest.mark.unit
@pytest.mark.parametrize("q", [0, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [0.31, 0.12, 0.9, 0.45, 0.05, 0.77, 0.2]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.unit
def test_percentile_errors():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


PARAMS = [{"source_tensor": "token_embd.weight", "nbytes": 1000},
          {"source_tensor": "blk.0.attn_q.weight", "nbytes": 200},
          {"source_tensor": None, "nbytes": 30},  # a derived parameter (e.g. a fused bias) is read too
          {"source_tensor": "output_norm.weight", "nbytes": 4}]


@pytest.mark.unit
def test_weight_bytes_tied_counts_the_embedding_as_lm_head():
    assert weight_bytes_per_token(PARAMS, tied_output=True) == 1234


@pytest.mark.unit
def test_weight_bytes_of_a_mixture_of_experts_count_the_chosen_experts_only():
    moe = [*PARAMS, {"source_tensor": "blk.0.ffn_up_exps.weight", "nbytes": 12800},
           {"source_tensor": "blk.0.ffn_gate_inp.weight", "nbytes": 64}]  # the router is read whole
    assert weight_bytes_per_token(moe, tied_output=True, n_expert=128, n_expert_used=8) == 1234 + 800 + 64
    assert weight_bytes_per_token(moe, tied_output=True) == 1234 + 12800 + 64


@pytest.mark.unit
def test_weight_bytes_untied_skips_the_embedding_table():
    untied = [*PARAMS, {"source_tensor": "output.weight", "nbytes": 900}]
    # decode reads one embedding row (not counted) and the whole separate output matrix
    assert weight_bytes_per_token(untied, tied_output=False) == 234 + 900


@pytest.mark.unit
def test_bench_result_schema():
    d = result(extra={"load_avg_1m": 1.5}).to_dict()
    assert set(d) == {"name", "model", "target", "prompt_len", "gen_len", "batch", "prefill_tok_s", "decode_tok_s",
                      "decode_batch_tok_s", "ttft_ms", "weight_bytes_per_token", "bandwidth_gb_s", "extra",
                      "roofline_tok_s", "roofline_fraction", "schema_version"}
    assert d["schema_version"] == SCHEMA_VERSION == 1
    assert d["roofline_tok_s"] == 200.0
    assert d["roofline_fraction"] == 0.125
    assert d["extra"] == {"load_avg_1m": 1.5}


FIXED_DOC = {
    "meta": {"date": "2026-11-30T03:50:56+00:00", "cpu": "AMD EPYC", "threads": 2, "load_avg_1m": 1.42,
             "luce_compile": "0.1.0", "tvm": "0.27.0.post1", "llama_cpp": "0.3.36", "prompt_len": 128, "gen_len": 32,
             "command": "python benchmarks/cpu.py --models smollm2-135m"},
    "rows": [
        {"model": "smollm2-135m", "engine": "luce-compile", "result": result(model="smollm2-135m").to_dict()},
        {"model": "smollm2-135m", "engine": "llama.cpp",
         "result": {"prefill_tok_s": 160.0, "ttft_ms": 800.0, "decode_tok_s": 50.0, "version": "0.3.36"}},
        {"model": "gemma3-270m", "engine": "luce-compile", "result": {"error": "Traceback ..."}},
    ],
}


@pytest.mark.unit
def test_cpu_table_rows_roofline_and_ratio():
    report = load_benchmark_module("report")
    md = report.cpu_table(FIXED_DOC["rows"], FIXED_DOC["meta"])
    lines = md.splitlines()
    assert lines[0] == "# CPU: luce-compile vs llama.cpp (2026-11-30T03:50:56+00:00)"
    assert "AMD EPYC, 2 threads, load before 1.42" in md
    assert "Command: `python benchmarks/cpu.py --models smollm2-135m`" in md
    # ours: 25 of a 200 tok/s roofline; llama.cpp at 50 tok/s on the same model/run's roofline: 25%, ours 0.5×
    assert "| smollm2-135m | luce-compile | 80.0 | 25.0 | 34.0 (B=4) | 1600.0 | 12.5% |  |" in lines
    assert "| smollm2-135m | llama.cpp | 160.0 | 50.0 | n/a | 800.0 | 25.0% | 0.50× |" in lines
    assert "| gemma3-270m | luce-compile | error | | | | | |" in lines


@pytest.mark.unit
def test_cpu_table_header_says_which_builds_took_tuning_records():
    report = load_benchmark_module("report")
    assert "(TVM 0.27.0.post1, untuned)" in report.cpu_table(FIXED_DOC["rows"], FIXED_DOC["meta"])  # no record
    rows = [dict(FIXED_DOC["rows"][0], result={**FIXED_DOC["rows"][0]["result"],
                                               "tuning": {"log_target": "cpu-avx2", "tuned": 9, "default": 1}}),
            *FIXED_DOC["rows"][1:]]
    md = report.cpu_table(rows, FIXED_DOC["meta"])
    assert "(TVM 0.27.0.post1, kernels tuned from autotune_logs/cpu-avx2: smollm2-135m 9/10)" in md


@pytest.mark.unit
def test_cpu_table_prefill_length_columns():
    report = load_benchmark_module("report")
    res = result().to_dict() | {"extra": {"prefill_tok_s_by_len": {"512": 70.0}}}  # as read back from JSON
    rows = [{"model": "m", "engine": "luce-compile", "result": res},
            {"model": "m", "engine": "llama.cpp", "result": {"error": "boom"}}]
    meta = {"date": "d", "cpu": "c", "threads": 2, "load_avg_1m": 0.0, "luce_compile": "0", "tvm": "0",
            "llama_cpp": "0", "prompt_len": 128, "gen_len": 8, "prefill_lens": [512, 2048], "command": "x"}
    lines = report.cpu_table(rows, meta).splitlines()
    header = next(line for line in lines if line.startswith("| model"))
    assert "prefill tok/s (pp128) | pp512 tok/s | pp2048 tok/s | decode" in header
    ours = next(line for line in lines if line.startswith("| m | luce-compile"))
    assert "| 70.0 | n/a |" in ours  # 2048 was not measured
    error = next(line for line in lines if line.startswith("| m | llama.cpp"))
    assert error.count("|") == header.count("|")
    header = next(line for line in lines if line.startswith("| model"))
    assert all(line.count("|") == header.count("|") for line in lines if line.startswith("| "))


@pytest.mark.unit
def test_write_results_round_trips(tmp_path):
    report = load_benchmark_module("report")
    md = report.cpu_table(FIXED_DOC["rows"], FIXED_DOC["meta"])
    json_path, md_path = report.write_results(tmp_path / "sub" / "cpu-2026-11-30", FIXED_DOC, md)


    assert json.loads(json_path.read_text()) == FIXED_DOC
    assert md_path.read_text() == md
    assert report.main([str(json_path)]) == 0
    assert md_path.read_text() == md


@pytest.mark.slow
def test_bench_engine_on_tiny_artifact(tmp_path):
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    art = compile_model(cached_synthetic("tiny-llama"), "cpu", tmp_path / "tiny.cpu")  # cached after the first
    # after compiling: luce_runtime.engine alone would load TVM's runtime-only library and break the compiler's import
    from luce_runtime.bench import bench_engine
    from luce_runtime.engine import Engine, EngineOptions

    engine = Engine(art, EngineOptions(max_batch=2, max_context=64, prefill_chunk=16))
    timings = bench_engine(engine, prompt_len=8, gen_len=4, batch=2, repeat=2)
    assert set(timings) == {"prefill_tok_s", "ttft_ms", "decode_tok_s", "decode_batch_tok_s"}
    assert all(math.isfinite(v) and v > 0 for v in timings.values()), timings
    # the manifest's params give a weight count between the body alone and the body plus the embedding table
    params = engine.artifact.manifest["weights"]["params"]
    total = sum(int(p["nbytes"]) for p in params)
    assert 0 < weight_bytes_per_token(params, bool(engine.config["tied_output"])) <= total
    r = result(**timings, weight_bytes_per_token=weight_bytes_per_token(params, True), batch=2)
    assert 0 < r.to_dict()["roofline_fraction"] < math.inf


@pytest.mark.slow
def test_bench_artifact_and_its_cli(tmp_path):
    """bench_artifact times prefill at extra lengths and measures bandwidth; `python -m luce_runtime.bench` prints the
    same schema with the runtime alone (a subprocess: this one has the compiler's TVM loaded)."""
    import json
    import subprocess

    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    art = compile_model(cached_synthetic("tiny-llama"), "cpu", tmp_path / "tiny.cpu")
    from luce_runtime.bench import bench_artifact

    d = bench_artifact(art, prompt_len=8, gen_len=3, batch=2, repeat=1, prefill_lens=[12, 40]).to_dict()
    assert set(d["extra"]["prefill_tok_s_by_len"]) == {12, 40}
    assert all(v > 0 for v in d["extra"]["prefill_tok_s_by_len"].values())
    assert d["bandwidth_gb_s"] > 0 and 0 < d["roofline_fraction"] < math.inf
    out = subprocess.run([sys.executable, "-m", "luce_runtime.bench", str(art), "--prompt-len", "8", "--gen-len", "2",
                          "--batch", "2", "--repeat", "1", "--prefill-lens", "16"],
                         capture_output=True, text=True, check=True, timeout=600)
    cli = json.loads(out.stdout)
    assert set(cli) == set(d) and cli["schema_version"] == d["schema_version"]
    assert list(cli["extra"]["prefill_tok_s_by_len"]) == ["16"]  # JSON keys are strings
    # a prompt that fills the trained context less the decoded tokens and the warm-up step is benched (run.sh's
    # LONG on Qwen2.5's 32,768 asked 32,736 + 32 and the 8 positions of slack took it past); one more is refused
    trained = int(json.loads((art / "manifest.json").read_text())["config"]["n_ctx_train"])
    assert bench_artifact(art, prompt_len=trained - 3, gen_len=2, batch=1, repeat=1).prompt_len == trained - 3
    from luce_runtime.kv_memory import KVMemoryError

    with pytest.raises(KVMemoryError, match="past the model's trained context"):
        bench_artifact(art, prompt_len=trained - 2, gen_len=2, batch=1, repeat=1)


@pytest.mark.unit
def test_serve_summary_and_table():
    serve = load_benchmark_module("serve")
    timings = [serve.RequestTiming(ttft_s=t, tokens=32, seconds=1.0) for t in (0.1, 0.2, 0.3, 0.4)]
    ours = serve.summarize("luce-compile", 4, timings, wall_s=2.0)
    assert ours["aggregate_tok_s"] == pytest.approx(64.0)  # 4 × 32 tokens in 2 s
    assert ours["ttft_p50_ms"] == pytest.approx(250.0)
    assert ours["ttft_p99_ms"] == pytest.approx(397.0)
    peer = serve.summarize("llama.cpp", 4, timings, wall_s=4.0) | {"load_avg_1m": 0.7}
    meta = {"date": "2026-11-30T04:00:00+00:00", "cpu": "AMD EPYC", "threads": 2, "load_avg_1m": 0.5,
            "model": "m.gguf", "requests": 4, "max_tokens": 32, "prompt_chars": 100, "llama_cpp": "0.3.36",
            "command": "python benchmarks/serve.py"}
    lines = serve.serve_table([ours, peer], meta).splitlines()
    assert "| luce-compile | 4 | 4 | 128 | 64.0 | 250 | 397 |  | nan |" in lines
    assert "| llama.cpp | 4 | 4 | 128 | 32.0 | 250 | 397 | 2.00× | 0.70 |" in lines


@pytest.mark.unit
def test_plot_writes_a_png_per_table(tmp_path):
    pytest.importorskip("matplotlib")
    plot = load_benchmark_module("plot")
    (tmp_path / "cpu-2026-11-30.json").write_text(json.dumps(FIXED_DOC))
    (tmp_path / "h200").mkdir()
    record = {"spec": {"preset": "smollm2-135m"}, "environment": {"date": "2026-11-30T03:32:43+00:00",
              "gpu": "NVIDIA H200", "tvm": "0.27.0.post1"},
              "timing": {"decode": {"tok_s": 519.0}, "prefill": [{"tokens": 512, "tok_s": 17051.0}]}}
    (tmp_path / "h200" / "2026-11-30-smollm2.json").write_text(json.dumps(record))
    (tmp_path / "h200" / "2026-11-30-gemv.json").write_text(json.dumps({"ours_Q4_1": {"us": 5.3}}))
    written = plot.plot_all(tmp_path)
    assert written == [tmp_path / "cpu-2026-11-30.png", tmp_path / "h200" / "2026-11-30.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    # the roofline panel: llama.cpp's 50 tok/s over the 200 tok/s roofline luce-compile measured on that model
    models, series = plot.cpu_series(FIXED_DOC, "decode_tok_s", roofline=True)
    assert models == ["smollm2-135m", "gemma3-270m"]
    assert series == {"luce-compile": [12.5, 0.0], "llama.cpp": [25.0, 0.0]}


@pytest.mark.unit
def test_tuned_vs_untuned_table_gives_both_builds_and_the_change():
    tvu = load_benchmark_module("tuned_vs_untuned")
    meta = {"date": "d", "cpu": "c", "threads": 2, "steps": 48, "batch": 8, "prompt_len": 128, "prefill_len": 512,
            "command": "python benchmarks/tuned_vs_untuned.py"}
    row = {"model": "m", "tuning": {"untuned": {"log_target": None, "tuned": 0, "default": 10},
                                    "tuned": {"log_target": "cpu-avx2", "tuned": 9, "default": 1}},
           "decode_tok_s": {"untuned": 100.0, "tuned": 110.0}, "decode_batch_tok_s": {"untuned": 200.0, "tuned": 190.0},
           "prefill_tok_s": {"untuned": 400.0, "tuned": 400.0}}
    lines = tvu.table([row], meta).splitlines()
    assert "| m | 9/10 (cpu-avx2) | 100.0 / 110.0 (+10.0%) | 200.0 / 190.0 (-5.0%) | 400.0 / 400.0 (+0.0%) |" in lines
    assert "decode tok/s (b=8) untuned / tuned" in lines[6] and "pp512" in lines[6]
