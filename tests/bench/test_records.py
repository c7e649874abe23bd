"""The committed GPU records are well-formed, consistent and passing, in the schema the code writes today.

Two kinds, both under benchmarks/results/:
- the H200 table's JSON (h200-<date>*.json, benchmarks/h200/report.py): every workload has a row per engine, every
  number is a positive finite value, the roofline follows from the bytes and the run's bandwidth, the committed
  markdown's tables are the rendering of the JSON, and luce-compile's correctness check in that run passed;
- scripts/device_check.py's records (h200/<date>-<model>.json): the check passed, and the timing section (when
  there) is the one `time_engine` writes.
A record that stops matching (a field renamed, a check that failed, a hand-edited number) fails here.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from luce_compile.checks import BATCH_TOL, REL_TOL, REL_TOL_F16, REL_TOL_Q8, REL_TOL_TF32
from tests.bench._load import load_benchmark_module

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
REPORTS = sorted(RESULTS.glob("h200-*.json"))
DEVICE_CHECKS = sorted(p for p in (RESULTS / "h200").glob("*.json") if p.stem.split("-")[-1] in
                       ("tiny", "smollm2", "gemma3"))


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_correctness(checks: dict[str, Any], weights: dict[str, Any], q8: bool = False, tf32: bool = False,
                      oracle_not_run: str | None = None, q8_prefill: bool = False) -> None:
    """device_check's `checks` and `weights` sections: present, in today's schema, and passing; `q8`: the build's
    megakernel takes 8-bit activations, so its decode may be held to REL_TOL_Q8 (never a build without them); `tf32`:
    its F16/BF16 matvecs round their inputs to tf32 (--megakernel-tf32), so its decode may differ from the per-op
    path's by REL_TOL_TF32; `q8_prefill`: its prefill GEMMs take 8-bit activations (--prefill-gemm q8), so it may be
    held to REL_TOL_Q8 against the oracle (its megakernel against the per-op path keeps the megakernel's bars)."""
    assert weights == {"weights_sha_match": True, "gguf_sha_match": True}
    batched = checks["batched"]
    assert set(batched) == {"sequences", "steps", "max_rel_diff", "ok"}
    sizes = batched["sequences"]  # the batch sizes decoded together, each checked against its sequences alone
    assert isinstance(sizes, list) and sizes and all(isinstance(n, int) and n > 1 for n in sizes), sizes
    assert batched["ok"] is True and 0 <= batched["max_rel_diff"] <= BATCH_TOL and batched["steps"] >= 1
    _check_paths(checks.get("megakernel_vs_per_op"), q8, tf32)
    if "oracle" not in checks:  # a model the oracle cannot hold (device_check prepare --no-reference)
        assert oracle_not_run and oracle_not_run.startswith("not run:") and "megakernel_vs_per_op" in checks
        return
    oracle = checks["oracle"]
    fields = {"steps", "max_rel_err", "prefill_rel_err", "ids_checked", "ids_mismatched", "ok"}
    assert set(oracle) in (fields, fields | {"tolerance"})  # records before 2026-12-01 have no tolerance: 1e-3
    tolerance = oracle.get("tolerance", REL_TOL)
    assert tolerance in (REL_TOL, REL_TOL_F16, *((REL_TOL_Q8,) if q8 or q8_prefill else ()))
    assert oracle["ok"] is True and oracle["ids_mismatched"] == []
    assert 0 <= oracle["prefill_rel_err"] <= oracle["max_rel_err"] <= tolerance
    assert oracle["steps"] >= 1 and 0 <= oracle["ids_checked"] <= oracle["steps"] + 1


def _check_paths(paths: dict[str, Any] | None, q8: bool, tf32: bool) -> None:
    """Artifacts with a megakernel: its decode against the per-op one."""
    if paths is not None:
        bar = paths.get("tolerance", BATCH_TOL)
        assert bar in (BATCH_TOL, *((REL_TOL_Q8,) if q8 else ()), *((REL_TOL_TF32,) if tf32 else ()))
        assert paths["ok"] is True and 0 <= paths["max_rel_diff"] <= bar and paths["ids_mismatched"] == 0
        assert paths["ids_checked"] > 0 and paths.get("device_ids_mismatched", 0) == 0


@pytest.fixture(scope="module")
def report():
    return load_benchmark_module("h200/report")


@pytest.mark.unit
def test_there_are_records_to_check():
    assert REPORTS and DEVICE_CHECKS, "the committed records moved: point this test at them"


@pytest.mark.unit
@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.name)
def test_h200_report_record(path: Path, report):
    doc = json.loads(path.read_text())
    meta, res = doc["meta"], doc["results"]
    assert meta["gpu"].startswith("NVIDIA") and meta["runs"] and meta["command"]
    assert set(res) - {"spec_replay"} == {"workloads", "bandwidth_gb_s", "bandwidths_measured_gb_s"}
    assert all(_positive(b) for b in res["bandwidths_measured_gb_s"])
    assert res["bandwidth_gb_s"] == statistics.median_high(res["bandwidths_measured_gb_s"])
    if "spec_replay" in res:  # issue 14's run: the speculation pair, and the replay's verify costs and speed-ups
        assert set(res["workloads"]) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
        replay = res["spec_replay"]
        assert all(_positive(ms) for side in ("target", "draft") for ms in replay[side]["verify_ms"].values())
        assert replay["rows"] and all(_positive(d["s"]) and _positive(d["plain_s"])
                                      for r in replay["rows"] for d in r["drafters"].values())
    else:
        assert set(res["workloads"]) == set(report.WORKLOADS)
    for name, w in res["workloads"].items():
        engines = list(w["engines"])  # the per-op row (run.sh PEROP=1) after the three engines, where timed
        assert engines in (list(report.ENGINES), [*report.ENGINES, report.PER_OP]), name
        for engine, row in w["engines"].items():
            if row.get("error") == "not run" and engine != report.OURS and "LLAMA_CPP=0" in meta["command"]:
                continue  # a run that skipped llama.cpp on purpose (run.sh LLAMA_CPP=0) and says so
            assert "error" not in row, (name, engine, row.get("error", "")[:200])
            metrics = ("decode_b1", "decode_b8", "prefill_512") if engine == report.PER_OP else report.METRICS
            assert all(_positive(row[m]) for m in (*metrics, "weight_bytes_per_token")), (name, engine)
            assert row["run"] < len(meta["runs"])
            roof = report.roofline_tok_s(res["bandwidth_gb_s"], row["weight_bytes_per_token"])
            assert row["roofline_tok_s"] == pytest.approx(roof)
            assert row["roofline_fraction"] == pytest.approx(row["decode_b1"] / roof)
            assert 0 < row["roofline_fraction"] < 1, (name, engine)
        check_correctness(w["check"], w["weights"], q8="--megakernel-q8" in meta.get("build", ""),
                          oracle_not_run=w.get("oracle_not_run"),
                          tf32="--megakernel-tf32" in meta.get("build", ""),
                          q8_prefill="--prefill-gemm q8" in meta.get("build", ""))
    # the committed tables are this JSON rendered (the prose around them may describe the method of its day)
    rendered = [line for line in report.markdown(doc).splitlines() if line.startswith("|")]
    committed = [line for line in path.with_suffix(".md").read_text().splitlines() if line.startswith("|")]
    assert rendered == committed


@pytest.mark.unit
@pytest.mark.parametrize("path", DEVICE_CHECKS, ids=lambda p: p.name)
def test_device_check_record(path: Path):
    record = json.loads(path.read_text())
    assert set(record) >= {"spec", "environment", "weights", "load_seconds", "manifest_kernels", "checks"}
    assert record["environment"]["gpu"].startswith("NVIDIA"), "the record names the GPU and driver"
    assert record["spec"]["target"].startswith("sm_")
    check_correctness(record["checks"], record["weights"], q8=bool(record["spec"].get("megakernel_q8")),
                      oracle_not_run=record.get("oracle"),
                      tf32=bool(record["spec"].get("megakernel_tf32")),
                      q8_prefill=record["spec"].get("prefill_gemm") == "q8")
    if "timing" not in record:  # device_check run --no-timing
        return
    timing = record["timing"]
    decode = timing["decode"]
    assert set(decode) == {"batch", "steps", "ms_per_token", "tok_s"} and decode["batch"] == 1
    assert decode["ms_per_token"] == pytest.approx(1e3 / decode["tok_s"])
    for p in timing["prefill"]:
        assert set(p) == {"tokens", "chunk", "seconds", "tok_s"}
        assert _positive(p["seconds"]) and p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"])


@pytest.mark.unit
def test_megakernel_engine_record():
    """The engine's megakernel on the H200 (2026-12-01): per workload, device_check's oracle and batched checks and
    its megakernel-vs-per-op check, all passing within device_check's bars."""
    record = json.loads((RESULTS / "h200" / "2026-12-01-megakernel-engine.json").read_text())
    assert record["workloads"]
    for name, run in record["workloads"].items():
        assert run["decode_path"].startswith("megakernel"), name
        checks = run["checks"]
        assert checks["oracle"]["ok"] and checks["oracle"]["max_rel_err"] <= REL_TOL_F16, name
        assert checks["batched"]["ok"] and checks["batched"]["max_rel_diff"] <= BATCH_TOL, name
        paths = checks["megakernel_vs_per_op"]
        assert paths["ok"] and paths["max_rel_diff"] <= BATCH_TOL and paths["ids_mismatched"] == 0, name
        assert paths["ids_checked"] >= 100, name
