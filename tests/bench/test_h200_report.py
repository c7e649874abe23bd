"""benchmarks/h200/report.py: the raw outputs of one device call → one table. Arithmetic and parsing only, on a
fabricated run folder whose numbers are chosen so every ratio and roofline fraction is known by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench._load import load_benchmark_module


@pytest.fixture(scope="module")
def report():
    return load_benchmark_module("h200/report")


def fabricate(run: Path, bytes_per_token: int = 100_000_000) -> None:
    w = run / "tiny"
    w.mkdir(parents=True)
    (w / "ours.json").write_text(json.dumps({
        "name": "luce-compile", "prompt_len": 512, "batch": 8, "prefill_tok_s": 10_000.0, "ttft_ms": 51.2,
        "decode_tok_s": 400.0, "decode_batch_tok_s": 1600.0, "weight_bytes_per_token": bytes_per_token,
        "bandwidth_gb_s": 4000.0, "extra": {"prefill_tok_s_by_len": {"2048": 5000.0}}}))
    (w / "torch.json").write_text(json.dumps({
        "prefill_tok_s": {"512": 20_000.0, "2048": 25_000.0}, "decode_tok_s": {"1": 800.0, "8": 3200.0},
        "weight_bytes_per_token": 2 * bytes_per_token, "bandwidth_gb_s": 4200.0}))
    (w / "llama_bench.json").write_text(json.dumps([
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 40_000.0, "model_size": bytes_per_token, "build_commit": "abc",
         "build_number": 1},
        {"n_prompt": 2048, "n_gen": 0, "avg_ts": 50_000.0, "model_size": bytes_per_token},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 1000.0, "stddev_ts": 5.0, "model_size": bytes_per_token}]))
    (w / "llama_batched.txt").write_text(
        "some log line\n"
        '{"pp": 512, "tg": 128, "pl": 1, "speed_pp": 1.0, "speed_tg": 990.0}\n'
        '{"pp": 512, "tg": 128, "pl": 8, "speed_pp": 1.0, "speed_tg": 4000.0}\n')
    (w / "check.json").write_text(json.dumps({
        "environment": {"date": "2026-11-30T06:00:00+00:00"},
        "checks": {"oracle": {"ok": True, "max_rel_err": 2e-6, "ids_checked": 17, "ids_mismatched": []},
                   "batched": {"ok": True, "max_rel_diff": 1e-6}}}))


@pytest.mark.unit
def test_collect_rows_ratios_and_roofline(report, tmp_path):
    fabricate(tmp_path)
    res = report.collect(tmp_path)
    assert res["bandwidth_gb_s"] == 4200.0  # the median of ours (4000) and torch's (4200) measurements
    e = res["workloads"]["tiny"]["engines"]
    assert e["llama.cpp"]["decode_b1"] == 1000.0 and e["llama.cpp"]["decode_b8"] == 4000.0  # tg128; batched pl=8
    assert e["llama.cpp"]["prefill_512"] == 40_000.0 and e["llama.cpp"]["prefill_2048"] == 50_000.0
    assert e["luce-compile"]["prefill_2048"] == 5000.0 and e["torch"]["decode_b8"] == 3200.0
    # roofline: 4200 GB/s over 100 MB = 42,000 tok/s; ours 400 → 0.952%; torch reads bf16, twice the bytes
    assert e["luce-compile"]["roofline_tok_s"] == pytest.approx(42_000.0)
    assert e["luce-compile"]["roofline_fraction"] == pytest.approx(400 / 42_000)
    assert e["torch"]["roofline_fraction"] == pytest.approx(800 / 21_000)
    assert report.ratio(e["luce-compile"], e["llama.cpp"], "decode_b1") == pytest.approx(0.4)
    assert report.ratio(e["luce-compile"], e["torch"], "prefill_2048") == pytest.approx(0.2)


@pytest.mark.unit
def test_markdown_rows_and_failed_engine(report, tmp_path):
    fabricate(tmp_path)
    (tmp_path / "tiny" / "torch.json").unlink()
    (tmp_path / "tiny" / "torch.log").write_text("Traceback ... CUDA out of memory")
    res = report.collect(tmp_path)
    assert "CUDA out of memory" in res["workloads"]["tiny"]["engines"]["torch"]["error"]
    doc = {"meta": {"date": "2026-11-30T06:00", "gpu": "H200", "torch": "2.11", "cuda": "13.0",
                    "llama_cpp_python": "0.3.36", "luce_compile": "0.1.0", "tvm": "0.27", "command": "bash x"},
           "results": res}
    lines = report.markdown(doc).splitlines()
    llama = next(line for line in lines if line.startswith("| tiny | llama.cpp"))
    # ours / llama.cpp: 400/1000, 1600/4000, 10000/40000, 5000/50000
    assert llama.endswith("| 0.40×, 0.40×, 0.25×, 0.10× |")
    assert "| 95.4 | 1,000 | 2.5% |" in llama  # 100 MB = 95.4 MiB; torch failed: 4000 GB/s → 1000 of 40,000
    assert next(line for line in lines if line.startswith("| tiny | torch")).startswith("| tiny | torch | error")
    assert "| tiny | 2.0e-06 | 17 / 0 | 1.0e-06 | yes |" in lines
    header = next(line for line in lines if line.startswith("| workload | engine"))
    rows = [line for line in lines if line.startswith(tuple(f"| tiny | {e} |" for e in report.ENGINES))]
    assert len(rows) == 3 and all(line.count("|") == header.count("|") for line in rows)


@pytest.mark.unit
def test_long_context_rows_and_section(report, tmp_path):
    """run.sh LONG=32768: ours-long.json (bench --prompt-len 32768) and llama-bench's -p 32768 / -d 32768 records
    become prefill_32768 and decode_b1_ctx32768 beside the table's keys, and a section of their own."""
    fabricate(tmp_path)
    w = tmp_path / "tiny"
    (w / "ours-long.json").write_text(json.dumps({"prompt_len": 32768, "prefill_tok_s": 5000.0, "decode_tok_s": 90.0,
                                                  "batch": 1}))
    (w / "llama_long_prefill.json").write_text(json.dumps([
        {"n_prompt": 32768, "n_gen": 0, "n_depth": 0, "avg_ts": 3900.0, "samples_ts": [4000.0]}]))
    (w / "llama_long_decode.json").write_text(json.dumps([
        {"n_prompt": 0, "n_gen": 32, "n_depth": 32768, "avg_ts": 70.0, "samples_ts": [72.0]}]))
    res = report.collect(tmp_path)
    e = res["workloads"]["tiny"]["engines"]
    assert (e["luce-compile"]["prefill_32768"], e["luce-compile"]["decode_b1_ctx32768"]) == (5000.0, 90.0)
    assert (e["llama.cpp"]["prefill_32768"], e["llama.cpp"]["decode_b1_ctx32768"]) == (4000.0, 72.0)
    assert e["luce-compile"]["decode_b1"] == 400.0  # the short-context keys are untouched
    doc = {"meta": {"date": "2026-12-06T23:00", "gpu": "H200", "torch": "2.11", "cuda": "13.0",
                    "llama_cpp_python": "0.3.36", "luce_compile": "0.1.0", "tvm": "0.27", "command": "bash x"},
           "results": res}
    lines = report.markdown(doc).splitlines()
    at = lines.index("| workload | engine | tokens | prefill tok/s | decode b=1 tok/s at depth | "
                     "ours / peer (prefill, decode) |")
    assert lines[at + 2:at + 4] == ["| tiny | luce-compile | 32,768 | 5,000 | 90.0 |  |",
                                    "| tiny | llama.cpp | 32,768 | 4,000 | 72.0 | 1.25×, 1.25× |"]


@pytest.mark.unit
def test_gguf_bytes_per_token_counts_every_tensor_of_a_tied_model(report):
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.synthetic import cached_synthetic

    gguf = read_gguf(cached_synthetic("tiny-llama"))
    assert report.gguf_bytes_per_token("tiny-llama") == sum(t.nbytes for t in gguf.tensors.values())
    untied = read_gguf(cached_synthetic("tiny-qwen2"))  # untied: the embedding table is one row per token, not read
    assert report.gguf_bytes_per_token("tiny-qwen2") == sum(
        t.nbytes for t in untied.tensors.values() if t.name != "token_embd.weight")


@pytest.mark.unit
def test_a_later_run_replaces_only_the_engines_it_measured(report, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    fabricate(first)
    fabricate(second)
    for name in ("llama_bench.json", "llama_batched.txt"):  # run 2 re-measured luce-compile and torch only
        (second / "tiny" / name).unlink()
    ours = json.loads((second / "tiny" / "ours.json").read_text()) | {"decode_batch_tok_s": 3200.0}
    (second / "tiny" / "ours.json").write_text(json.dumps(ours))
    e = report.collect(first, second)["workloads"]["tiny"]["engines"]
    assert list(e) == list(report.ENGINES)
    assert e["luce-compile"]["decode_b8"] == 3200.0 and e["luce-compile"]["run"] == 1
    assert e["llama.cpp"]["decode_b8"] == 4000.0 and e["llama.cpp"]["run"] == 0
    assert e["torch"]["run"] == 1
    doc = {"meta": {"date": "d", "gpu": "H200", "torch": "2.11", "cuda": "13.0", "llama_cpp_python": "0.3.36",
                    "luce_compile": "0.1.0", "tvm": "0.27", "command": "bash x", "runs": ["t1 abc", "t2 def"]},
           "results": report.collect(first, second)}
    text = report.markdown(doc)
    assert "run 1: t1 abc; run 2: t2 def" in text
    assert "| tiny | llama.cpp (run 1) |" in text and "| tiny | luce-compile (run 2) |" in text


@pytest.mark.unit
def test_tuned_vs_untuned_pairs_each_workloads_two_artifacts(report, tmp_path):
    fabricate(tmp_path / "run")
    tuned = json.loads((tmp_path / "run" / "tiny" / "ours.json").read_text())
    slower = {**tuned, "decode_tok_s": 320.0, "prefill_tok_s": 8_000.0, "extra": {"prefill_tok_s_by_len": {}}}
    (tmp_path / "run" / "tiny" / "ours-untuned.json").write_text(json.dumps(slower))
    text = report.tuned_vs_untuned((tmp_path / "run",), tmp_path / "out" / "tvu", "cmd")
    row = json.loads((tmp_path / "out" / "tvu.json").read_text())["workloads"]["tiny"]
    assert row["tuned"]["decode_b1"] == 400.0 and row["untuned"]["decode_b1"] == 320.0
    assert row["untuned"]["prefill_2048"] is None  # not measured: shown as n/a, never as a ratio
    assert "400 / 320 (1.25×)" in text and "10,000 / 8,000 (1.25×)" in text and "| n/a |" in text
    with pytest.raises(SystemExit, match="ours-untuned"):
        report.tuned_vs_untuned((tmp_path / "out",), tmp_path / "x", "cmd")


def test_spec_replay_section_sums_each_task_and_drafter(report, tmp_path):
    fabricate(tmp_path)
    replay = {"target_decode_path": "megakernel for 1-2 sequences", "draft_decode_path": "per-op",
              "target": {"context": 256, "decode_ms": 2.0, "verify_ms": {"1": 2.5, "8": 4.0}},
              "draft": {"context": 256, "decode_ms": 1.0, "verify_ms": {"1": 1.5, "8": 2.0}},
              "rows": [{"task": "humaneval", "name": f"HumanEval/{i}", "prompt_tokens": 90,
                        "drafters": {"draft model": {"tokens": 10, "s": 0.01, "plain_s": 0.02, "steps": 3,
                                                     "accepted": 6}}} for i in range(2)]}
    (tmp_path / "spec-replay.json").write_text(json.dumps(replay))
    res = report.collect(tmp_path)
    lines = report.spec_replay_lines(res["spec_replay"])
    assert "| 8 | 4.000 | 2.00 | 2.000 |" in lines
    assert "| humaneval | draft model | 2 | 20 | 500 | 1,000 | 2.00× | 3.00 |" in lines
    assert report.spec_replay_lines(report.collect(tmp_path / "tiny").get("spec_replay")) == []


def test_spec_replay_section_lists_tree_positions(report):
    tasks = [{"task": "code-edit", "drafter": "draft model", "steps": 4, "replayed": 4},
             {"task": "code-edit", "drafter": "draft tree", "steps": 5, "replayed": 5, "tree_steps": 3,
              "positions": [{"chain": [3, 3], "sibling": [0, 1]}, {"chain": [1, 3], "sibling": [1, 2]}]}]
    lines = report.tree_position_lines(tasks)
    assert "| code-edit | draft tree | 3 | 5 / 5 | 1 | 1 / 3 | 1 / 2 |" in lines
    assert not any("draft model" in line for line in lines) and report.tree_position_lines(tasks[:1]) == []


def test_build_description_names_the_8_bit_megakernel(report, tmp_path):
    """An artifact built with prepare.py --megakernel-q8 says so in the table's header (device_check prepare records
    it in spec.json, which check.json carries)."""
    for name, q8 in (("plain", False), ("q8", True)):
        w = tmp_path / name / "tiny"
        w.mkdir(parents=True)
        (w / "check.json").write_text(json.dumps({"spec": {"precision": "f16", "megakernel_q8": q8}}))
    assert "--megakernel-q8" not in report.build_description(tmp_path / "plain")
    assert "--megakernel-q8" in report.build_description(tmp_path / "q8")
    assert report.build_description(tmp_path / "q8").startswith("float16 tensor-core GEMMs")
    assert "--megakernel-tf32" not in report.build_description(tmp_path / "q8")
    w = tmp_path / "tf32" / "tiny"
    w.mkdir(parents=True)
    (w / "check.json").write_text(json.dumps({"spec": {"precision": "f16", "megakernel_q8": True,
                                                        "megakernel_tf32": True}}))
    assert "--megakernel-q8" in report.build_description(tmp_path / "tf32")
    assert "--megakernel-tf32" in report.build_description(tmp_path / "tf32")


@pytest.mark.unit
def test_a_run_is_dated_by_date_txt_else_its_commit_file(report, tmp_path):
    """A record's date: run.sh's date.txt; a run from before it (and without a check.json, which dates the run too)
    takes the time its commit.txt was written on the GPU machine (kept by the tarball), never "?"."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    (run / "commit.txt").write_text("abc1234\n")
    os.utime(run / "commit.txt", (1_796_598_000, 1_796_598_000))
    assert report._run_label(run) == "2026-12-06T23:00:00+00:00 abc1234"
    (run / "date.txt").write_text("2026-12-06T22:43:10+00:00\n")
    assert report._run_label(run) == "2026-12-06T22:43:10+00:00 abc1234"
    assert report.gpu_label({"gpu": "NVIDIA H100 80GB HBM3, 580.159.04"}) == "H100"
