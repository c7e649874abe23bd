"""The CPU search: candidates, invalid ones recorded (not a crash), resuming, and ingesting a GPU run's results."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from luce_runtime.tune_bench import RESULTS_FORMAT, argument_sets

from luce_compile.targets import get_target
from luce_compile.tune.bundle import ingest
from luce_compile.tune.records import read_jsonl, records_folder
from luce_compile.tune.search import LocalSearch, call_args, candidates, knob_id, schedule_candidates, trials_path
from luce_compile.tune.workloads import Workload, rule_by_name

pytestmark = pytest.mark.unit
CPU = get_target("cpu")

# the batched int8 matmul (decode batches, verify, prefill): the default CPU build (int8 on VNNI) has no float32
# GEMM since issue 13's prefill part
GEMM = "int8_gemm_q8_0_64x64"

def pick(workloads: list[Workload], function: str) -> Workload:
    return next(w for w in workloads if w.function == function)


def search(logs: Path, trials: int) -> LocalSearch:
    return LocalSearch(CPU, trials, time.monotonic() + 120, trials_path(logs, records_folder(CPU), "tiny"),
                       {"batch": 4, "rows": 2}, min_time=0.005)


def test_candidates_start_with_the_default_and_are_reproducible(tiny_workloads):
    w = pick(tiny_workloads, GEMM)
    rule = rule_by_name(CPU.tvm_target(), w.rule)
    first = candidates(rule, w, 6)
    assert first[0] == rule.DEFAULTS and len(first) == 6 and len({knob_id(k) for k in first}) == 6
    assert candidates(rule, w, 6) == first
    assert candidates(rule, w, 9)[:6] == first  # a larger --trials extends the same list
    assert all(set(k) == set(rule.DEFAULTS) and all(k[n] in rule.SPACE[n] or k[n] == rule.DEFAULTS[n] for n in k)
               for k in first)


def test_a_candidate_the_rule_refuses_is_invalid_not_a_crash(tiny_workloads, logs):
    w = pick(tiny_workloads, GEMM)
    target = CPU.tvm_target()
    rule = rule_by_name(target, w.rule)
    default, bogus = schedule_candidates(w, [dict(rule.DEFAULTS), dict(rule.DEFAULTS) | {"bogus": 3}], target)
    assert default.func is not None and default.default and default.error is None
    assert bogus.func is None and "no knob" in bogus.error
    s = search(logs, 2)
    sets = argument_sets(call_args(w, {"rows": 4}), tvm.cpu(0), 1 << 16, np.random.default_rng(0))
    rows = {}
    for cand in (default, bogus):
        rows[cand.id] = s._time(cand, sets, target, rows)
    assert rows[default.id]["time_us"] > 0 and rows[default.id]["error"] is None
    assert rows[bogus.id]["time_us"] is None and "no knob" in rows[bogus.id]["error"]


def test_search_records_the_best_and_resumes_without_retiming(tiny_workloads, logs):
    ws = [pick(tiny_workloads, GEMM), pick(tiny_workloads, "int8_gemv_q8_0_64x64")]
    records = search(logs, 3).run(ws)
    assert [r["key"] for r in records] == [w.key for w in ws]
    for r in records:
        assert r["time_us"] <= r["default_us"] and r["candidates"] == 3 and r["knobs"]
        assert r["tvm"] and r["luce_compile"] and r["device"] and r["date"]
    assert records[0]["measured_at"] == {"rows": 2}
    path = trials_path(logs, records_folder(CPU), "tiny")
    first = read_jsonl(path)
    assert len(first) == 6 and sum(r["default"] for r in first) == 2
    search(logs, 3).run(ws)
    assert read_jsonl(path) == first  # resumed: nothing timed again
    search(logs, 5).run(ws[:1])
    after = read_jsonl(path)
    assert after[:6] == first and len(after) == 8  # only the two new candidates were timed
    assert {knob_id(r["knobs"]) for r in after[6:]}.isdisjoint({knob_id(r["knobs"]) for r in first})


def results(workload: Workload, bundle: str, rows: list[tuple[dict, bool, float | None]]) -> dict:
    return {"format": RESULTS_FORMAT, "bundle": bundle, "target": "cpu", "kind": "llvm", "model": "tiny",
            "device": "test device", "date": "2026-12-01T00:00:00+00:00",
            "workloads": [{"key": workload.key, **workload.fields(), "measured_at": {"batch": 4}}],
            "results": [{"id": f"c{i}", "key": workload.key, "knobs": knobs, "default": default, "time_us": t,
                         "error": None if t else "failed"} for i, (knobs, default, t) in enumerate(rows)]}


def test_ingest_keeps_the_best_over_rounds(tiny_workloads, logs, tmp_path):
    w = pick(tiny_workloads, GEMM)
    rule = rule_by_name(CPU.tvm_target(), w.rule)
    d = dict(rule.DEFAULTS)
    a, b, c = (d | {"chunk": 1}), (d | {"chunk": 4}), (d | {"chunk": 64})  # none of them the default (16)

    def round_(name: str, rows: list) -> dict:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(results(w, name, rows)))
        log, taken = ingest(path, logs)
        assert log == logs / records_folder(CPU) / "tiny.jsonl"
        (record,) = read_jsonl(log)
        return record

    first = round_("r1", [(d, True, 10.0), (a, False, 8.0), (c, False, None)])
    assert first["knobs"] == a and first["time_us"] == 8.0 and first["default_us"] == 10.0
    assert first["speedup"] == 1.25 and first["invalid"] == 1 and first["source"] == "bundle r1"
    second = round_("r2", [(b, False, 5.0)])  # a second round without the default: the first round's is known
    assert second["knobs"] == b and second["default_us"] == 10.0 and second["candidates"] == 4
    third = round_("r3", [(c, False, 9.0)])
    assert third["knobs"] == b and third["time_us"] == 5.0
    # every candidate once, and c again with its new time (the later line wins when the log is read back)
    timed = read_jsonl(trials_path(logs, records_folder(CPU), "tiny"))
    assert [r["time_us"] for r in timed] == [10.0, 8.0, None, 5.0, 9.0]


def test_ingest_refuses_a_file_that_is_not_results(tmp_path, logs):
    from luce_compile.tune.records import TuneLogError

    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(TuneLogError, match="tune_bench"):
        ingest(path, logs)
