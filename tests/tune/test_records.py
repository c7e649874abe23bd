"""Workload keys, the JSON-lines logs, and which target's records a build takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luce_compile.targets import get_target
from luce_compile.tune.records import Tuning, log_target, merge_records, read_jsonl, records_folder
from luce_compile.tune.workloads import Workload

pytestmark = pytest.mark.unit
HOST = records_folder(get_target("cpu"))  # cpu-avx2 on an AVX2 machine, cpu-avx512vnni with VNNI


def record(key: str, time_us: float, knobs: dict | None = None) -> dict:
    return {"key": key, "rule": "cpu.quant_gemm", "function": "f", "weight_type": "Q8_0", "target": "cpu",
            "args": [], "knobs": knobs or {"rows": 2}, "time_us": time_us, "default_us": 10.0,
            "speedup": 10.0 / time_us, "device": "test", "date": "2026-12-01", "tvm": "0.27", "luce_compile": "0.1"}


def test_workloads_are_deterministic_and_keyed_by_rule_shape_type_target(tiny_gguf, tiny_workloads):
    from luce_compile.targets import get_target
    from luce_compile.tune.tuner import model_workloads

    again = model_workloads(tiny_gguf, get_target("cpu"))
    assert [w.key for w in again] == [w.key for w in tiny_workloads]
    assert len({w.key for w in tiny_workloads}) == len(tiny_workloads)
    # the tiny model's matmuls: decode GEMVs and batched GEMMs (int8, VNNI on this CPU), prefill's among them
    rules = {w.rule for w in tiny_workloads}
    assert rules == {"cpu.int8_gemv"}, rules  # prefill too since issue 13: no float32 GEMM
    for w in tiny_workloads:
        target, rule, function, weight, signature = w.key.split("|")
        assert (target, rule, function, weight) == ("cpu", w.rule, w.function, "Q8_0")
        assert signature.count("[") == len(w.args)
    gemm = next(w for w in tiny_workloads if w.function == "int8_gemm_q8_0_64x64")
    assert gemm.symbols() == ["rows"]  # the symbolic batch keeps its name: one record serves every batch
    assert "int8[rows,64]" in gemm.key


def test_a_log_round_trips_and_merging_keeps_the_faster(tmp_path: Path):
    path = tmp_path / HOST / "m.jsonl"
    merge_records(path, [record("a", 5.0), record("b", 7.0)])
    assert [r["key"] for r in read_jsonl(path)] == ["a", "b"]
    assert read_jsonl(path)[0] == record("a", 5.0)  # every field as written
    taken = merge_records(path, [record("a", 6.0, {"rows": 8}), record("b", 3.0, {"rows": 4})])
    assert [r["key"] for r in taken] == ["b"]
    rows = {r["key"]: r for r in read_jsonl(path)}
    assert rows["a"]["time_us"] == 5.0 and rows["b"]["knobs"] == {"rows": 4}
    assert all(json.loads(line) for line in path.read_text().splitlines())  # one readable JSON object a line


def test_tuning_takes_the_fastest_record_across_files(tmp_path: Path):
    merge_records(tmp_path / HOST / "one.jsonl", [record("a", 5.0, {"rows": 1})])
    merge_records(tmp_path / HOST / "two.jsonl", [record("a", 4.0, {"rows": 8})])
    merge_records(tmp_path / HOST / "trials" / "ignored.jsonl", [record("a", 1.0, {"rows": 2})])
    tuning = Tuning.load("cpu", tmp_path)
    assert tuning.lookup("a")["knobs"] == {"rows": 8}
    assert tuning.lookup("a")["_source"].endswith("two.jsonl:1")
    assert Tuning.load("cpu", tmp_path).digest() == tuning.digest()
    merge_records(tmp_path / HOST / "two.jsonl", [record("a", 2.0, {"rows": 4})])
    assert Tuning.load("cpu", tmp_path).digest() != tuning.digest()  # new records: a new build, not the cached one


def test_targets_without_hardware_take_the_nearest_measured_targets_records(tmp_path: Path):
    assert log_target("sm_86", tmp_path) is None
    merge_records(tmp_path / "sm_90" / "m.jsonl", [record("a", 1.0)])
    assert log_target("sm_90", tmp_path) == "sm_90"
    assert log_target("sm_86", tmp_path) == "sm_90" and log_target("sm_120", tmp_path) == "sm_90"
    assert log_target("sm_86,sm_120", tmp_path) == "sm_90"
    assert log_target("gfx1201", tmp_path) is None and log_target("gfx1151", tmp_path) is None  # none measured
    assert log_target("cpu", tmp_path) is None
    merge_records(tmp_path / "sm_86" / "m.jsonl", [record("a", 1.0)])
    assert log_target("sm_86", tmp_path) == "sm_86"  # its own records, once it has some


def test_a_cpu_takes_only_the_records_of_its_own_int8_level(tmp_path: Path):
    """Knobs timed on another CPU level are for other kernels (vpdpbusd vs vpmaddubsw bodies, vector width)."""
    assert HOST.startswith("cpu-") and HOST.split("-", 1)[1] in ("avx512vnni", "avxvnni", "avx2", "x86-64")
    other = "cpu-avx2" if HOST != "cpu-avx2" else "cpu-avx512vnni"
    merge_records(tmp_path / other / "m.jsonl", [record("a", 1.0)])
    merge_records(tmp_path / "cpu" / "m.jsonl", [record("a", 1.0)])  # the old unlevelled folder: not read either
    assert log_target("cpu", tmp_path) is None and Tuning.load("cpu", tmp_path).records == {}
    merge_records(tmp_path / HOST / "m.jsonl", [record("a", 2.0)])
    assert log_target("cpu", tmp_path) == HOST and Tuning.load("cpu", tmp_path).records["a"]["time_us"] == 2.0


def test_targets_command_says_which_log_each_target_uses(logs: Path, capsys):
    from luce_compile.cli import main

    merge_records(logs / "sm_90" / "m.jsonl", [record("a", 1.0)])
    assert main(["targets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sm_90"]["tuning_logs"] == "sm_90" and rows["sm_86"]["tuning_logs"] == "sm_90"
    assert "nearest measured" in rows["sm_120"]["tuning"]
    assert rows["gfx1201"]["tuning_logs"] is None and "defaults" in rows["gfx1201"]["tuning"]
    assert rows["cpu"]["tuning_logs"] is None


def test_missing_logs_folder_is_an_error_that_says_what_to_do(tmp_path: Path):
    from luce_compile.tune.records import TuneLogError

    with pytest.raises(TuneLogError, match="--no-tune-logs"):
        Tuning.load("cpu", tmp_path / "nope")


def test_workload_fields_name_every_argument(tiny_workloads: list[Workload]):
    w = tiny_workloads[0]
    fields = w.fields()
    assert [a["name"] for a in fields["args"]] == [a.name for a in w.args]
    assert fields["rule"] == w.rule and fields["target"] == "cpu"
