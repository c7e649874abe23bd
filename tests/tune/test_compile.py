"""compile reuses the records: a record's knobs reach its rule (the kernel changes), the report says tuned or default,
a record the rule refuses falls back to the defaults, and --no-tune-logs takes none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tvm_ffi

from luce_compile.codegen.pipeline import relax_pipeline
from luce_compile.graph.registry import open_graph
from luce_compile.lower.cpu_int8 import resolve_precision
from luce_compile.lower.relax_model import LowerOptions, lower_graph
from luce_compile.targets import get_target
from luce_compile.tune.records import Tuning, merge_records, records_folder
from luce_compile.tune.workloads import Workload, rule_by_name

CPU = get_target("cpu")
FUNCTION = "int8_gemm_q8_0_64x64"  # the default build's batched int8 matmul (prefill's too)


def tuned_knobs(w: Workload) -> dict[str, int]:
    rule = rule_by_name(CPU.tvm_target(), w.rule)
    return dict(rule.DEFAULTS) | {"rows": 2, "unroll": 1}


def write_record(logs: Path, w: Workload, knobs: dict) -> None:
    merge_records(logs / records_folder(CPU) / "tiny.jsonl",
                  [{"key": w.key, **w.fields(), "knobs": knobs, "time_us": 1.0, "default_us": 2.0, "speedup": 2.0,
                    "device": "test"}])


def built(gguf: Path, tuning: Tuning | None) -> dict:
    graph, _ = open_graph(gguf)
    target = CPU.tvm_target()
    mod, _ = lower_graph(graph, target, LowerOptions(precision=resolve_precision("auto", target)))
    with target:
        out = relax_pipeline(target, tuning=tuning)(mod)
    return {gv.name_hint: f for gv, f in out.functions_items() if hasattr(f, "body")}


@pytest.mark.unit
def test_a_records_knobs_reach_the_rule_and_the_report(tiny_gguf, tiny_workloads, logs):
    w = next(w for w in tiny_workloads if w.function == FUNCTION)
    write_record(logs, w, tuned_knobs(w))
    default = built(tiny_gguf, Tuning.load("cpu", None))
    tuning = Tuning.load("cpu", logs)
    tuned = built(tiny_gguf, tuning)
    assert not tvm_ffi.structural_equal(tuned[FUNCTION], default[FUNCTION])  # the knobs changed the kernel
    # and no other tunable kernel (TVM's own KV-cache kernels and the Relax functions differ between any two builds)
    others = [w.function for w in tiny_workloads if w.function != FUNCTION]
    assert others and all(tvm_ffi.structural_equal(tuned[n], default[n]) for n in others)
    report = tuning.to_manifest()
    assert report["kernels"][FUNCTION]["status"] == "tuned" and report["kernels"][FUNCTION]["differs"]
    assert report["kernels"][FUNCTION]["record"].endswith("tiny.jsonl:1")
    assert report["tuned"] == 1 and report["default"] == len(tiny_workloads) - 1
    assert {k["status"] for n, k in report["kernels"].items() if n != FUNCTION} == {"default"}
    assert "1 tuned" in tuning.summary() and "1 with knobs other than" in tuning.summary()


@pytest.mark.unit
def test_a_record_the_rule_refuses_leaves_the_defaults(tiny_gguf, tiny_workloads, logs):
    w = next(w for w in tiny_workloads if w.function == FUNCTION)
    write_record(logs, w, {"no_such_knob": 4})
    tuning = Tuning.load("cpu", logs)
    tuned = built(tiny_gguf, tuning)
    default = built(tiny_gguf, None)
    assert tvm_ffi.structural_equal(tuned[FUNCTION], default[FUNCTION])
    kernel = tuning.to_manifest()["kernels"][FUNCTION]
    assert kernel["status"] == "default" and "no_such_knob" in kernel["error"]
    assert "1 records refused" in tuning.summary()


@pytest.mark.e2e
def test_compile_reports_tuned_kernels_and_no_tune_logs_reports_defaults(tiny_gguf, tiny_workloads, logs, tmp_path,
                                                                         capsys):
    from luce_compile.cli import main

    w = next(w for w in tiny_workloads if w.function == FUNCTION)
    write_record(logs, w, tuned_knobs(w))
    out = tmp_path / "tuned.cpu"
    # the default logs folder is `logs` here ($LUCE_TUNE_LOGS): the shipped logs' path, as a user runs compile
    assert main(["compile", str(tiny_gguf), "--target", "cpu", "-o", str(out), "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert "kernels: 1 tuned from" in err and "tiny.jsonl" in err
    tuning = json.loads((out / "manifest.json").read_text())["kernels"]["tuning"]
    assert tuning["kernels"][FUNCTION]["status"] == "tuned" and tuning["kernels"][FUNCTION]["knobs"] == tuned_knobs(w)
    plain = tmp_path / "plain.cpu"
    assert main(["compile", str(tiny_gguf), "--target", "cpu", "-o", str(plain), "--no-tune-logs", "--no-cache"]) == 0
    assert "kernels: 0 tuned (no tuning logs)" in capsys.readouterr().err
    tuning = json.loads((plain / "manifest.json").read_text())["kernels"]["tuning"]
    assert tuning["tuned"] == 0 and tuning["kernels"][FUNCTION]["status"] == "default"
    assert main(["compile", str(tiny_gguf), "--target", "cpu", "-o", str(plain), "--force",
                 "--tune-logs", str(tmp_path / "missing")]) == 2
    assert "--no-tune-logs" in capsys.readouterr().err  # a folder that is not there: say what to pass instead


@pytest.mark.e2e
def test_tuned_kernels_compute_what_the_defaults_do(tiny_gguf, tiny_workloads, logs, tmp_path):
    """Knobs change schedules, not arithmetic. The int8 kernels' knobs (rows, chunk, unroll) regroup work, not
    additions; the float32 GEMM's `vector` changes how many partial sums a dot product keeps (8 or 16 lanes), so
    prefill differs by float rounding (seen: 1e-5 of logits ~1), and decode only through the keys and values prefill
    cached (its int8 activations absorbed that here: equal to the bit, which the tolerance does not require)."""
    from luce_runtime.engine import Engine, EngineOptions

    from luce_compile.codegen.compile import compile_model

    target = CPU.tvm_target()
    for w in tiny_workloads:  # every kernel away from its defaults
        rule = rule_by_name(target, w.rule)
        knobs = {n: next(v for v in values if v != rule.DEFAULTS[n]) for n, values in rule.SPACE.items()}
        write_record(logs, w, dict(rule.DEFAULTS) | knobs)
    arts = {}
    for name, use in (("default", False), ("tuned", True)):
        arts[name] = compile_model(tiny_gguf, "cpu", tmp_path / name, use_cache=False, use_tune_logs=use)
    tuning = json.loads((arts["tuned"] / "manifest.json").read_text())["kernels"]["tuning"]
    assert tuning["tuned"] == len(tiny_workloads) and tuning["default"] == 0
    out = {}
    for name, art in arts.items():
        engine = Engine(art, EngineOptions(max_batch=2, max_context=64))
        seq = engine.add_sequence()
        prefill = engine.prefill([seq], [[1, 5, 9, 200, 31, 7]])
        steps = [engine.decode([seq], [int(np.argmax(prefill[-1]))])]
        for _ in range(4):
            steps.append(engine.decode([seq], [int(np.argmax(steps[-1][-1]))]))
        out[name] = (prefill, np.stack(steps))
    np.testing.assert_allclose(out["tuned"][0], out["default"][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["tuned"][1], out["default"][1], rtol=1e-4, atol=1e-4)
    assert (out["tuned"][1].argmax(-1) == out["default"][1].argmax(-1)).all()
