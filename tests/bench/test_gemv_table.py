"""benchmarks/h200/gemv_table.py: the kernels it lists and the table's arithmetic (no time is asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.bench._load import load_benchmark_module


@pytest.fixture(scope="module")
def table():
    return load_benchmark_module("h200/gemv_table")


@pytest.mark.unit
def test_every_quantized_type_at_every_shape_it_can_take(table):
    listed = table.kernels()
    assert len(listed) == len(table.TYPES) * len(table.SHAPES) - 3  # no K-quant at n_in 896 (not 256-aligned)
    assert ("Q8_0", 151936, 896) in listed and ("Q6_K", 151936, 896) not in listed
    assert table.plane_bytes("Q8_0", 4096, 4096) == 4096 * 4096 + 4096 * 128 * 2  # int8 quants + an f16 scale per 32


@pytest.mark.unit
def test_report_rows_are_bytes_over_time_against_the_copy_bandwidth(table, tmp_path):
    key = "sm_90|gpu.quant_gemv|gemv_q8_0_4096x4096|Q8_0|..."
    results = {"format": "luce-tune-results/1", "date": "2026-12-01T00:00:00", "device": "NVIDIA H200", "results": [
        {"id": "a", "key": key, "knobs": {"threads": 32}, "default": True, "time_us": 10.0},
        {"id": "b", "key": key, "knobs": {"threads": 64}, "default": False, "time_us": 7.0},
        {"id": "c", "key": key, "knobs": {"threads": 128}, "default": False, "time_us": None, "error": "refused"}],
        "confirmed": {key: {"default_id": "a", "best_id": "b", "default_us": 10.0, "best_us": 8.0}}}
    (tmp_path / "tune-gemv.json").write_text(json.dumps(results))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"device_copy_gb_s": 4000.0}))
    table.report(argparse.Namespace(run=str(tmp_path), out=str(tmp_path)))
    (row,) = json.loads((tmp_path / "2026-12-01-gemv.json").read_text())["rows"]
    moved = table.plane_bytes("Q8_0", 4096, 4096) + 4 * (4096 + 4096)
    assert row["best_us"] == 8.0 and row["best_knobs"] == {"threads": 64} and row["invalid"] == 1
    assert row["best_gb_s"] == pytest.approx(moved / 8.0 / 1e3)
    assert row["best_fraction"] == pytest.approx(row["best_gb_s"] / 4000.0)


@pytest.mark.unit
def test_a_winner_slower_on_confirmation_keeps_the_default(table, tmp_path):
    key = "sm_90|gpu.quant_gemv|gemv_q4_0_4096x4096|Q4_0|..."
    results = {"format": "luce-tune-results/1", "date": "2026-12-01T00:00:00", "device": "NVIDIA H200", "results": [
        {"id": "a", "key": key, "knobs": {"threads": 32}, "default": True, "time_us": 10.0},
        {"id": "b", "key": key, "knobs": {"threads": 64}, "default": False, "time_us": 7.0}],
        "confirmed": {key: {"default_id": "a", "best_id": "b", "default_us": 10.0, "best_us": 12.0}}}
    (tmp_path / "tune-gemv.json").write_text(json.dumps(results))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"device_copy_gb_s": 4000.0}))
    table.report(argparse.Namespace(run=str(tmp_path), out=str(tmp_path)))
    (row,) = json.loads((tmp_path / "2026-12-01-gemv.json").read_text())["rows"]
    assert row["best_us"] == row["default_us"] == 10.0 and row["best_knobs"] == {"rule default": "kept"}
