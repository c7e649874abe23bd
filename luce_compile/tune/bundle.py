"""Tuning where the compiler is not: every candidate built here into a bundle, timed on the target's machine by
`python -m luce_runtime.tune_bench BUNDLE --out RESULTS.json` (the TVM runtime alone), and the results ingested.

The bundle's format is written down once, in luce_runtime/tune_bench.py (its reader). Rounds: a second `tune
--bundle` leaves out the candidates the trials log already holds (ingested from an earlier round), except each
workload's default, so a larger --trials times only the new ones, and each round's winner is confirmed against the
default on the target (tune_bench re-times both in alternating rounds). Ingesting records per workload the best
candidate of every round, with the confirmed times where that candidate is the winner a confirmation was made for.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tvm
from luce_runtime.tune_bench import BUNDLE_FORMAT, RESULTS_FORMAT, BundleError, read_versioned

import luce_compile
from luce_compile.errors import LuceError
from luce_compile.targets import TargetInfo, get_target
from luce_compile.tune.records import TuneLogError, append_jsonl, records_folder
from luce_compile.tune.search import (
    SCHEDULE_ERRORS,
    apply_confirmation,
    best_record,
    build_kernel,
    call_args,
    candidates,
    extents_for,
    first_line,
    knob_id,
    rotate_bytes,
    save_records,
    schedule_candidates,
    trials_by_key,
    trials_path,
)
from luce_compile.tune.workloads import Workload, rule_by_name

Progress = Callable[[str], None]


def build_bundle(workloads: list[Workload], info: TargetInfo, model: str, out: Path, *, trials: int,
                 logs_dir: Path, extents: dict[str, int] | None = None,
                 progress: Progress = lambda _msg: None) -> dict[str, Any]:
    """Build every candidate of every workload not yet timed (per the trials log) into the bundle folder `out`."""
    from luce_compile.codegen.device_binaries import export_checked

    if out.exists() and not (out / "index.json").is_file():
        raise LuceError(f"tune: {out} exists and is not a tuning bundle; pass a new --bundle folder.")
    shutil.rmtree(out, ignore_errors=True)  # a bundle of ours: rebuilt whole (ids must match its libraries)
    (out / "lib").mkdir(parents=True)
    target = info.tvm_target()
    done = trials_by_key(trials_path(logs_dir, records_folder(info), model))
    index: dict[str, Any] = {"format": BUNDLE_FORMAT, "target": info.name, "kind": info.kind, "model": model,
                             "tvm": tvm.__version__, "luce_compile": luce_compile.__version__,
                             "created": datetime.now(UTC).isoformat(timespec="seconds"),
                             "rotate_bytes": rotate_bytes(info), "workloads": [], "candidates": []}
    for i, w in enumerate(workloads):
        seen = done.get(w.key, {})
        # the default always (every round confirms its winner against it), then what no earlier round timed
        knob_list = [k for i, k in enumerate(candidates(rule_by_name(target, w.rule), w, trials))
                     if i == 0 or knob_id(k) not in seen]
        measured_at = extents_for(w, extents or {})
        index["workloads"].append({"key": w.key, **w.fields(), "measured_at": measured_at,
                                   "call_args": call_args(w, measured_at)})
        built = 0
        for j, cand in enumerate(schedule_candidates(w, knob_list, target)):
            entry = {"id": f"w{i:03d}c{j:03d}", "key": w.key, "knobs": cand.knobs, "default": cand.default}
            if cand.error is None and cand.same_as is not None:
                entry["library"] = next(c["library"] for c in index["candidates"]
                                        if c["key"] == w.key and c["knobs"] == cand.same_as.knobs)
                entry["function"] = w.function
            elif cand.error is None:
                try:
                    export_checked(build_kernel(cand, info, target), info, out / "lib" / f"{entry['id']}.so")
                    entry.update(library=f"lib/{entry['id']}.so", function=w.function)
                    built += 1
                except SCHEDULE_ERRORS as err:
                    cand.error = f"build: {type(err).__name__}: {first_line(err)}"
            if cand.error is not None:
                entry["error"] = cand.error
            index["candidates"].append(entry)
        progress(f"[{i + 1}/{len(workloads)}] {w.function} ({w.rule}): {len(knob_list)} candidates, {built} built")
    index["id"] = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()[:16]
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return index


def bundle_at_extents(src: Path, out: Path, extents: dict[str, int], model: str) -> dict[str, Any]:
    """A copy of the bundle `src` whose workloads are timed at other symbolic extents (e.g. 2,048 rows instead of
    512): the same libraries (a kernel of a symbolic batch serves every batch), new call arguments, a new id."""
    index = json.loads((src / "index.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src / "lib", out / "lib")
    for w in index["workloads"]:
        w["measured_at"] = {s: extents.get(s, v) for s, v in w["measured_at"].items()}
        w["call_args"] = [{**a, "shape": [w["measured_at"].get(d, d) if isinstance(d, str) else d
                                          for d in spec["shape"]]} for a, spec in zip(w["call_args"], w["args"],
                                                                                      strict=True)]
    index.update(model=model, created=datetime.now(UTC).isoformat(timespec="seconds"))
    index.pop("id", None)
    index["id"] = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()[:16]
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return index


def ingest(results_path: Path, logs_dir: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Record a tune_bench results file: every candidate into the trials log, and per workload the best of all its
    candidates timed so far (every round's) into the log. Returns (the log, the records written)."""
    results = _read_results(results_path)
    # a CPU bundle's records go to this host's level (records_folder): ingest where it was timed
    folder, model = records_folder(get_target(results["target"])), results.get("model") or "bundle"
    trials = trials_path(logs_dir, folder, model)
    known = trials_by_key(trials)
    by_key: dict[str, list[dict]] = {}
    for r in results["results"]:
        row = {"key": r["key"], "knobs": r["knobs"], "default": r["default"], "time_us": r.get("time_us"),
               "error": r.get("error"), "date": results.get("date"), "bundle": results.get("bundle")}
        before = known.get(r["key"], {}).get(knob_id(r["knobs"]))
        if before is None or (before.get("time_us"), before.get("error")) != (row["time_us"], row["error"]):
            append_jsonl(trials, row)  # new, or timed again (a later line wins when the log is read)
        known.setdefault(r["key"], {})[knob_id(r["knobs"])] = row
    for key, rows in known.items():
        by_key[key] = list(rows.values())
    records = []
    for w in results["workloads"]:
        record = best_record(w, by_key.get(w["key"], []), w["measured_at"], results["device"],
                             f"bundle {results.get('bundle')}")
        if record:
            records.append(_confirmed(record, results, w["key"]))
    path = save_records(records, logs_dir, folder, model)
    return path, records


def _confirmed(record: dict[str, Any], results: dict[str, Any], key: str) -> dict[str, Any]:
    """The record with tune_bench's confirmation of this round's winner, when the record's knobs are that winner's."""
    check = results.get("confirmed", {}).get(key)
    knobs = {r["id"]: r for r in results["results"]}
    if not check or knob_id(knobs[check["best_id"]]["knobs"]) != knob_id(record["knobs"]):
        return record
    default = knobs[check["default_id"]]["knobs"]
    return apply_confirmation(record, default, check["default_us"], check["best_us"], check["rounds"])


def _read_results(path: Path) -> dict[str, Any]:
    try:
        return read_versioned(path, RESULTS_FORMAT,
                              f"tune: no results file {path}; write it on the target machine with "
                              "`python -m luce_runtime.tune_bench BUNDLE --out RESULTS.json`.",
                              "it is not a tune_bench results file.")
    except BundleError as err:
        raise TuneLogError(str(err)) from err
