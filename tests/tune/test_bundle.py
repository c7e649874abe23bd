"""A bundle built here, timed by luce_runtime.tune_bench with the TVM runtime alone (an llvm bundle: the same code a
GPU host runs), and its results ingested into the log that compile reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from luce_compile.targets import get_target
from luce_compile.tune.bundle import build_bundle, ingest
from luce_compile.tune.records import Tuning, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
# tune_bench run as the GPU host runs it, then what the process mapped and imported: the compiler must not be there
CHILD = """
import json, sys
from luce_runtime.tune_bench import main
code = main(sys.argv[1:])
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
ours = [m for m in sys.modules if m.split(".")[0] in ("luce_compile", "luce_schedules")]
ours += [m for m in sys.modules if m.startswith(("tvm.relax", "tvm.s_tir"))]
print(json.dumps({"code": code, "libraries": sorted(m.rsplit("/", 1)[-1] for m in maps if ".so" in m),
                  "compiler_modules": sorted(ours)}))
"""


def run_bench(bundle: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(bundle), "--out", str(out), "--min-time", "0.01"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_tune_bench_times_a_cpu_bundle_runtime_only_and_its_results_ingest(tiny_workloads, logs, tmp_path):
    ws = [w for w in tiny_workloads if w.function in ("int8_gemm_q8_0_64x64", "int8_gemv_q8_0_64x64")]
    bundle = tmp_path / "bundle"
    index = build_bundle(ws, get_target("cpu"), "tiny", bundle, trials=3, logs_dir=logs, extents={"rows": 4})
    assert len(index["candidates"]) == 6 and sum(c["default"] for c in index["candidates"]) == 2
    assert all((bundle / c["library"]).is_file() for c in index["candidates"] if "library" in c)
    gemm = next(w for w in index["workloads"] if w["function"] == "int8_gemm_q8_0_64x64")
    assert gemm["call_args"][0] == {"shape": [4, 64], "dtype": "int8", "scalar": False}

    out = tmp_path / "results.json"
    child = run_bench(bundle, out)
    assert child["code"] == 0
    assert not [lib for lib in child["libraries"] if "libtvm_compiler" in lib or lib == "libtvm.so"]
    assert child["compiler_modules"] == []
    results = json.loads(out.read_text())
    assert len(results["results"]) == 6 and all(r["time_us"] > 0 for r in results["results"])
    # each workload's winner timed again beside its default (3 alternating rounds), what ingest records
    assert set(results["confirmed"]) == {w.key for w in ws}
    assert all(c["rounds"] == 3 and c["default_us"] > 0 and c["best_us"] > 0 for c in results["confirmed"].values())
    assert run_bench(bundle, out)["code"] == 0  # resumed: nothing left to time, the file unchanged
    assert json.loads(out.read_text())["results"] == results["results"]

    log, records = ingest(out, logs)
    assert {r["function"] for r in records} == {w.function for w in ws}
    assert all(r["time_us"] <= r["default_us"] and r["source"].startswith("bundle ") for r in read_jsonl(log))
    for r in read_jsonl(log):  # a winner's confirmed times, not the search's (biased low by picking the fastest)
        check, default = results["confirmed"][r["key"]], next(c for c in results["results"] if c["key"] == r["key"]
                                                                and c["default"])
        if "confirmed" in r:
            assert r["default_us"] == check["default_us"] and r["time_us"] == min(check["best_us"], check["default_us"])
        else:  # the default won the search itself: nothing to confirm
            assert r["knobs"] == default["knobs"] and r["time_us"] == r["default_us"] == default["time_us"]
    tuning = Tuning.load("cpu", logs)
    assert all(tuning.lookup(w.key) is not None for w in ws)  # what compile will look up

    again = build_bundle(ws, get_target("cpu"), "tiny", bundle, trials=4, logs_dir=logs, extents={"rows": 4})
    # round two: the default again (its winner is confirmed against it) and the candidates round one did not time
    assert len(again["candidates"]) == 4 and sum(c["default"] for c in again["candidates"]) == 2


@pytest.mark.unit
def test_bundle_refuses_a_folder_that_is_not_a_bundle(tiny_workloads, logs, tmp_path):
    from luce_compile.errors import LuceError

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(LuceError, match="not a tuning bundle"):
        build_bundle(tiny_workloads[:1], get_target("cpu"), "tiny", tmp_path / "mine", trials=1, logs_dir=logs)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_a_cuda_bundle_holds_real_device_binaries(tiny_gguf, logs, tmp_path):
    """sm_90: the candidates of the GPU rules built into a bundle with device code (checked by export_checked)."""
    from luce_compile.codegen.gpu_toolchain import missing_gpu_tools
    from luce_compile.tune.tuner import model_workloads

    if missing_gpu_tools("cuda"):
        pytest.skip(f"no CUDA toolchain: {missing_gpu_tools('cuda')}")
    ws = model_workloads(tiny_gguf, get_target("sm_90"))
    assert {"gpu.quant_gemv", "gpu.rope"} <= {w.rule for w in ws}
    w = next(w for w in ws if w.rule == "gpu.quant_gemv")
    index = build_bundle([w], get_target("sm_90"), "tiny", tmp_path / "b", trials=2, logs_dir=logs)
    assert index["kind"] == "cuda" and len(index["candidates"]) == 2
    assert all((tmp_path / "b" / c["library"]).stat().st_size > 0 for c in index["candidates"])
