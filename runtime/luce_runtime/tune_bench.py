"""Time a tuning bundle's candidate kernels with the TVM runtime alone: `python -m luce_runtime.tune_bench BUNDLE
--out RESULTS.json`, on the machine the bundle was built for (a GPU host has no compiler; this needs none).

A bundle (written by `luce-compile tune MODEL --target T`, luce_compile/tune/bundle.py) is a folder:
  index.json   {"format": BUNDLE_FORMAT, "target", "kind": llvm|cuda|rocm, "model", "rotate_bytes",
                "workloads": [{"key", "rule", "function", "weight_type", "target", "args", "measured_at",
                               "call_args": [{"shape": [ints], "dtype", "scalar"}]}],
                "candidates": [{"id", "key", "knobs", "default": bool, "library": "lib/<id>.so", "function"}
                               | {"id", "key", "knobs", "default", "error"} (refused or failed to build there)]}
  lib/<id>.so  one compiled kernel per candidate, exported with tvm's export_library
Each candidate is called on fresh random inputs of its workload's shapes (`call_args`), rotated through enough
copies that together exceed `rotate_bytes` (twice the last-level cache: weights come from memory, as they do in
the model), and timed with luce_runtime.timing (the project's one timer) for at least `--min-time` seconds.
Then each workload's fastest candidate is timed again beside its default in CONFIRM_ROUNDS alternating rounds.
RESULTS.json ({"format": RESULTS_FORMAT, "device", "results": [{"id", "key", "knobs", "default", "time_us" |
null, "error"}], "confirmed": {key: {"default_id", "best_id", "default_us", "best_us", "rounds"}}, "workloads",
...}) is what `luce-compile tune --ingest RESULTS.json` reads. Re-running with the same --out skips the candidates
(and confirmations) it already holds, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

if "tvm" not in sys.modules:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # the runtime only: this must run where no compiler is

import tvm  # noqa: E402  (after the environment switch above)

from luce_runtime.errors import LuceError  # noqa: E402
from luce_runtime.timing import call_times  # noqa: E402

log = logging.getLogger(__name__)
BUNDLE_FORMAT = "luce-tune-bundle/1"
RESULTS_FORMAT = "luce-tune-results/1"
MAX_COPIES = 256  # argument sets rotated through at most (a tiny kernel would otherwise need thousands)
GPU_CALLS = 8  # calls per synchronized sample on a GPU (time_kernel)
CONFIRM_ROUNDS = 3  # alternating timings of a workload's winner and its default before the winner is recorded


class BundleError(LuceError, ValueError):
    """A bundle or results file this runner cannot use."""


def random_array(shape: Sequence[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random values of a dtype: floats in [-1, 1) (finite, no denormals: those would time differently), integers
    as random bytes (packed quants), int32 small and non-negative (positions, ids: kept in range)."""
    count = math.prod(shape)
    if dtype.startswith(("float", "bfloat")):
        storage = "uint16" if dtype == "bfloat16" else dtype
        values = rng.uniform(-1, 1, count).astype("float32")
        out = (values.view("uint32") >> 16).astype("uint16") if dtype == "bfloat16" else values.astype(storage)
        return out.reshape(shape)
    if dtype == "int32":
        return rng.integers(0, 64, count, dtype="int32").reshape(shape)
    return np.frombuffer(rng.bytes(count * np.dtype(dtype).itemsize), dtype=dtype).reshape(shape).copy()


def argument_sets(call_args: list[dict[str, Any]], device: tvm.runtime.Device, rotate_bytes: int,
                  rng: np.random.Generator) -> list[list[Any]]:
    """Copies of one random argument set on the device, as many as fill rotate_bytes (at most MAX_COPIES)."""
    arrays = [None if a.get("scalar") else random_array(a["shape"], a["dtype"], rng) for a in call_args]
    size = sum(a.nbytes for a in arrays if a is not None)
    copies = max(1, min(MAX_COPIES, math.ceil(rotate_bytes / max(size, 1))))
    sets = []
    for _ in range(copies):
        sets.append([0 if a is None else tvm.runtime.tensor(a, device) for a in arrays])
    return sets


def time_kernel(fn: Callable[..., Any], sets: list[list[Any]], device: tvm.runtime.Device,
                min_time: float = 0.2, max_repeat: int = 1000, calls: int = 1) -> tuple[float, int]:
    """(median seconds per call, samples timed): fn on each argument set in turn, repeated until ~min_time is spent.
    Each sample is `calls` calls back to back between two synchronizations, divided by calls: on a GPU one call per
    sync adds the launch and the sync's round trip (~10 µs through TVM's FFI on the H200) to a kernel that may take
    less, as the model's CUDA graphs never do (tune_bench passes GPU_CALLS; the CPU's calls are synchronous)."""
    turn = iter(range(1 << 62))

    def call() -> None:
        for _ in range(calls):
            fn(*sets[next(turn) % len(sets)])

    first = call_times(call, 1, warmup=1, sync=device.sync)[0]
    repeat = int(min(max_repeat, max(5, min_time / max(first, 1e-7))))
    times = call_times(call, repeat, warmup=0, sync=device.sync)
    return float(np.median(times)) / calls, repeat


def calls_per_sample(device: tvm.runtime.Device) -> int:
    return 1 if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type() else GPU_CALLS


def load_device(kind: str) -> tvm.runtime.Device:
    """The device for a bundle's kind; kernels with parallel loops or workspaces need libtvm_runtime global."""
    lib = Path(tvm.__file__).parent / "lib"
    with_runtime = [lib / "libtvm_runtime.so"] + ([lib / f"libtvm_runtime_{kind}.so"] if kind != "llvm" else [])
    try:
        for path in with_runtime:
            if path.exists():
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # e.g. libcuda.so.1 missing: no driver, so no GPU here
        raise BundleError(f"tune_bench: cannot load TVM's {kind} runtime here ({e}); run the bundle on the machine "
                          f"it was built for (a {kind} GPU and its driver).") from e
    if kind != "llvm" and not tvm.runtime.enabled(kind):
        raise BundleError(f"tune_bench: this TVM runtime cannot drive {kind} devices here; run the bundle on the "
                          f"machine it was built for (a {kind} GPU with TVM's runtime for it).")
    return tvm.cpu(0) if kind == "llvm" else tvm.device(kind, 0)


def describe_device(kind: str, device: tvm.runtime.Device) -> str:
    if kind == "llvm":
        name = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "CPU")
        return f"{name}, {len(os.sched_getaffinity(0))} threads"
    return f"{device.device_name} (compute {device.compute_version}, {device.multi_processor_count} SMs)"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def read_versioned(path: Path, fmt: str, missing: str, rebuild: str) -> dict[str, Any]:
    """A bundle's index or a results file: JSON whose "format" is fmt. `missing` and `rebuild` say what to do when the
    file is absent or of another format (the one reader of both, here and in luce_compile/tune/bundle.py)."""
    if not path.is_file():
        raise BundleError(missing)
    doc = json.loads(path.read_text())
    if doc.get("format") != fmt:
        raise BundleError(f"{path} is format {doc.get('format')!r}, not {fmt}; {rebuild}")
    return doc


def read_index(bundle: Path) -> dict[str, Any]:
    return read_versioned(bundle / "index.json", BUNDLE_FORMAT,
                          f"tune_bench: {bundle} has no index.json; pass the folder `luce-compile tune ... --bundle "
                          "DIR` wrote.",
                          "rebuild the bundle with the same luce-compile version as this runtime.")


def run_bundle(bundle: Path, out: Path, *, min_time: float = 0.2, seed: int = 0,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time every candidate of a bundle not yet in `out`; write `out` after each one (resumable)."""
    say = progress or (lambda _msg: None)
    index = read_index(bundle)
    device = load_device(index["kind"])
    workloads = {w["key"]: w for w in index["workloads"]}
    results = _previous(out, index)
    done = {r["id"] for r in results["results"]}
    todo = [c for c in index["candidates"] if c["id"] not in done]
    results["device"] = describe_device(index["kind"], device)
    say(f"{len(todo)} of {len(index['candidates'])} candidates to time on {results['device']}")
    sets_of: dict[str, list[list[Any]]] = {}
    for n, cand in enumerate(todo, 1):
        row = {k: cand[k] for k in ("id", "key", "knobs", "default")} | {"time_us": None, "error": cand.get("error")}
        if row["error"] is None:
            if cand["key"] not in sets_of:  # one argument set per workload, shared by its candidates
                sets_of.clear()
                rng = np.random.default_rng(seed)
                sets_of[cand["key"]] = argument_sets(workloads[cand["key"]]["call_args"], device,
                                                     int(index["rotate_bytes"]), rng)
            row.update(_time_one(bundle, cand, sets_of[cand["key"]], device, min_time))
        results["results"].append(row)
        results["date"] = datetime.now(UTC).isoformat(timespec="seconds")
        _write(out, results)
        shown = f"{row['time_us']:.1f} us" if row["time_us"] is not None else f"invalid ({row['error']})"
        say(f"[{n}/{len(todo)}] {workloads[cand['key']]['function']} {cand['knobs']}: {shown}")
    _confirm_winners(bundle, index, results, out, device, min_time, seed, say)
    return results


def confirm(default_fn: Callable[..., Any], best_fn: Callable[..., Any], sets: list[list[Any]],
            device: tvm.runtime.Device, min_time: float, rounds: int = CONFIRM_ROUNDS) -> tuple[float, float]:
    """(default, best) median seconds per call over `rounds` alternating timings of the two kernels: the fastest of
    many noisy timings is biased low, so a winner is timed again beside the default before it is recorded."""
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for fn, out in zip((default_fn, best_fn), times, strict=True):
            out.append(time_kernel(fn, sets, device, min_time, calls=calls_per_sample(device))[0])
    return float(np.median(times[0])), float(np.median(times[1]))


def _confirm_winners(bundle: Path, index: dict[str, Any], results: dict[str, Any], out: Path,
                     device: tvm.runtime.Device, min_time: float, seed: int, say: Callable[[str], None]) -> None:
    """Per workload, this bundle's fastest candidate and its default re-timed in alternating rounds, into
    results["confirmed"][key] (resumable: confirmed workloads are skipped)."""
    confirmed = results.setdefault("confirmed", {})
    by_id = {c["id"]: c for c in index["candidates"]}
    for w in index["workloads"]:
        rows = [r for r in results["results"] if r["key"] == w["key"] and r["time_us"] is not None]
        default = next((r for r in rows if r["default"]), None)
        best = min((r for r in rows if not r["default"]), key=lambda r: r["time_us"], default=None)
        if w["key"] in confirmed or default is None or best is None:
            continue
        sets = argument_sets(w["call_args"], device, int(index["rotate_bytes"]), np.random.default_rng(seed))
        fns = [tvm.runtime.load_module(str((bundle / by_id[r["id"]]["library"]).resolve()))[w["function"]]
               for r in (default, best)]
        default_s, best_s = confirm(*fns, sets, device, min_time)
        confirmed[w["key"]] = {"default_id": default["id"], "best_id": best["id"], "rounds": CONFIRM_ROUNDS,
                               "default_us": round(default_s * 1e6, 3), "best_us": round(best_s * 1e6, 3)}
        _write(out, results)
        say(f"confirmed {w['function']}: default {default_s * 1e6:.1f} us, best {best_s * 1e6:.1f} us")


def _time_one(bundle: Path, cand: dict[str, Any], sets: list[list[Any]], device: tvm.runtime.Device,
              min_time: float) -> dict[str, Any]:
    try:
        fn = tvm.runtime.load_module(str((bundle / cand["library"]).resolve()))[cand["function"]]
        seconds, repeat = time_kernel(fn, sets, device, min_time, calls=calls_per_sample(device))
    except Exception as err:  # noqa: BLE001  (a kernel that fails to load or run is an invalid candidate)
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return {"time_us": round(seconds * 1e6, 3), "repeat": repeat}


def _previous(out: Path, index: dict[str, Any]) -> dict[str, Any]:
    fresh = {"format": RESULTS_FORMAT, "bundle": index.get("id"), "target": index["target"], "kind": index["kind"],
             "model": index.get("model"), "tvm": tvm.__version__, "luce_compile": index.get("luce_compile"),
             "workloads": index["workloads"], "results": []}
    if not out.is_file():
        return fresh
    old = json.loads(out.read_text())
    if old.get("bundle") != index.get("id"):
        raise BundleError(f"tune_bench: {out} holds results of another bundle ({old.get('bundle')}); pass a new "
                          "--out for this one.")
    return old


def _write(out: Path, results: dict[str, Any]) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m luce_runtime.tune_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path, help="the folder `luce-compile tune MODEL --target T --bundle DIR` wrote")
    p.add_argument("--out", type=Path, required=True, help="results JSON (resumed when it exists)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of calls timed per candidate (default 0.2)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        results = run_bundle(args.bundle, args.out, min_time=args.min_time,
                             progress=lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True))
    except LuceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(results['results'])} candidates; record them with "
          f"`luce-compile tune --ingest {args.out}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
