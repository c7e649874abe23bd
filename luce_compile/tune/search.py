"""The search: candidate knobs per workload, each scheduled by its rule, built alone, and timed.

Candidates: the rule's DEFAULTS first (the baseline every record is compared with), then the whole SPACE when it
has no more than `trials` points, else a random subset of it (seeded by the workload key: the same command gives
the same candidates, and a larger --trials extends the earlier list). Candidates whose schedules come out the same
(a knob clamped to the shape by the rule) are timed once. A candidate the rule refuses (None, a ScheduleError, an
unknown knob) or that fails to build is recorded as invalid, with the reason.

Timing: the CPU is measured here, each kernel built with tvm.compile and timed in this process by
luce_runtime.tune_bench's `time_kernel` (luce_runtime.timing underneath, the one timer of the project), the same
code a GPU host runs on a bundle. Symbolic extents are timed at SYMBOLIC_EXTENTS (overridable per name).
Every timed candidate is appended to `<logs>/<target>/trials/<name>.jsonl`: a re-run skips those, so an interrupted
search resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tvm
from tvm import tirx

import luce_compile
from luce_compile.targets import TargetInfo
from luce_compile.tune.records import TRIALS_DIR, append_jsonl, merge_records, read_jsonl
from luce_compile.tune.workloads import SCHEDULE_ERRORS, Workload, rule_by_name, scheduled_func

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
# Values symbolic extents are timed at: `batch` is a prefill chunk's rows (and the float32 batched decode's), `rows`
# the int8 kernels' activation rows (a batched decode of up to 8 sequences, a verify of k + 1 <= 9 drafts),
# `seq_len` a prompt chunk. Any other name gets DEFAULT_EXTENT. --extent NAME=N overrides.
SYMBOLIC_EXTENTS = {"batch": 128, "seq_len": 128, "rows": 8, "n_tokens": 128}
DEFAULT_EXTENT = 128


def knob_id(knobs: dict[str, int]) -> str:
    return json.dumps(dict(sorted(knobs.items())))


def candidates(rule: Any, workload: Workload, trials: int) -> list[dict[str, int]]:
    """Up to `trials` knob settings (at least the defaults): DEFAULTS first, then SPACE in a seeded order."""
    names = sorted(rule.SPACE)
    default = dict(rule.DEFAULTS)
    seed = int(hashlib.sha256(workload.key.encode()).hexdigest()[:12], 16)
    size = 1
    for n in names:
        size *= len(rule.SPACE[n])
    if size <= 100_000:
        grid = itertools.product(*(rule.SPACE[n] for n in names))
        points = [dict(zip(names, values, strict=True)) for values in grid]
        random.Random(seed).shuffle(points)
    else:  # a space too large to list: independent draws per knob (duplicates are dropped below)
        rng = random.Random(seed)
        points = [{n: rng.choice(rule.SPACE[n]) for n in names} for _ in range(4 * trials)]
    out, seen = [default], {knob_id(default)}
    for point in points:
        knobs = default | point
        if len(out) >= max(1, trials):
            break
        if knob_id(knobs) not in seen:
            seen.add(knob_id(knobs))
            out.append(knobs)
    return out


def extents_for(workload: Workload, overrides: dict[str, int]) -> dict[str, int]:
    return {s: overrides.get(s, SYMBOLIC_EXTENTS.get(s, DEFAULT_EXTENT)) for s in workload.symbols()}


def call_args(workload: Workload, extents: dict[str, int]) -> list[dict[str, Any]]:
    """The workload's arguments with every symbolic extent replaced by its timing value."""
    def concrete(d: int | str) -> int:
        if isinstance(d, int):
            return d
        if d in extents:
            return extents[d]
        raise ValueError(f"tune: {workload.function} has an extent {d!r} that is not a plain name; it cannot be "
                         "timed at a chosen size yet.")

    return [{"shape": [concrete(d) for d in a.shape], "dtype": a.dtype, "scalar": a.scalar} for a in workload.args]


@dataclass
class Candidate:
    """One knob setting of one workload: scheduled (func) or refused (error)."""

    workload: Workload
    knobs: dict[str, int]
    default: bool
    func: tirx.PrimFunc | None = None
    error: str | None = None
    same_as: Candidate | None = None  # an earlier candidate whose schedule is structurally equal

    @property
    def id(self) -> str:
        return knob_id(self.knobs)


def schedule_candidates(workload: Workload, knob_list: list[dict[str, int]], target: tvm.target.Target,
                        ) -> list[Candidate]:
    """Each knob setting scheduled by the workload's rule; structurally equal schedules share one timing."""
    rule = rule_by_name(target, workload.rule)
    out: list[Candidate] = []
    by_hash: dict[int, Candidate] = {}
    with target:
        for knobs in knob_list:
            cand = Candidate(workload, knobs, default=knob_id(knobs) == knob_id(dict(rule.DEFAULTS)))
            try:
                result = rule.apply(workload.func, target, knobs)
                if result is None:
                    cand.error = "declined by the rule"
                else:
                    cand.func = scheduled_func(result).with_attr("global_symbol", workload.function)
            except SCHEDULE_ERRORS as err:
                cand.error = f"{type(err).__name__}: {first_line(err)}"
            if cand.func is not None:
                digest = tvm_ffi_hash(cand.func)
                cand.same_as = by_hash.get(digest)
                by_hash.setdefault(digest, cand)
            out.append(cand)
    return out


def tvm_ffi_hash(func: tirx.PrimFunc) -> int:
    import tvm_ffi

    return int(tvm_ffi.structural_hash(func))


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def build_kernel(cand: Candidate, info: TargetInfo, target: tvm.target.Target):
    """tvm.compile of one scheduled kernel alone (GPU targets inside their toolchain, as compile builds them)."""
    from luce_compile.codegen.gpu_toolchain import gpu_toolchain

    mod = tvm.IRModule({cand.workload.function: cand.func})
    with gpu_toolchain(info.kind, info.archs, info.name), target:
        return tvm.compile(mod, target=target)


# ---- the CPU, measured here --------------------------------------------------------------------------------------
@dataclass
class LocalSearch:
    """Tune workloads on this CPU: trials per workload, a deadline for the whole search, a trials log to resume."""

    info: TargetInfo
    trials: int
    deadline: float  # time.monotonic() value
    trials_path: Path
    extents: dict[str, int] = field(default_factory=dict)
    min_time: float = 0.2
    progress: Progress = lambda _msg: None  # noqa: E731

    def run(self, workloads: list[Workload]) -> list[dict[str, Any]]:
        """One record per workload with a timed default and at least one timed candidate."""
        from luce_runtime.tune_bench import argument_sets

        target = self.info.tvm_target()
        done = trials_by_key(self.trials_path)
        records = []
        for i, w in enumerate(workloads):
            left = max(0.0, self.deadline - time.monotonic())
            budget = left / (len(workloads) - i)  # the time still left, shared by the workloads still to search
            sets = argument_sets(call_args(w, extents_for(w, self.extents)), tvm.cpu(0), rotate_bytes(self.info),
                                 _rng())
            rows = self._search(w, target, done.get(w.key, {}), sets, time.monotonic() + budget)
            record = best_record(w, rows, extents_for(w, self.extents), describe_host(), "local")
            if record:
                records.append(self._confirm(w, target, record, sets))
            shown = (f"best {record['time_us']:.1f} us, default {record['default_us']:.1f} us "
                     f"({record['speedup']:.2f}x, confirmed)") if record else "no valid timing"
            self.progress(f"[{i + 1}/{len(workloads)}] {w.function} ({w.rule}): {len(rows)} candidates, {shown}")
        return records

    def _search(self, w: Workload, target: tvm.target.Target, done: dict[str, dict], sets: list,
                until: float) -> list[dict]:
        rows = dict(done)
        todo = [k for k in candidates(rule_by_name(target, w.rule), w, self.trials) if knob_id(k) not in rows]
        for cand in schedule_candidates(w, todo, target) if todo else []:
            if time.monotonic() > until and not cand.default:
                break  # the default (first in the list) is timed whatever the budget: it is every record's baseline
            row = self._time(cand, sets, target, rows)
            rows[cand.id] = row
            append_jsonl(self.trials_path, row)
        return list(rows.values())

    def _time(self, cand: Candidate, sets: list, target: tvm.target.Target, rows: dict[str, dict]) -> dict:
        from luce_runtime.tune_bench import time_kernel

        row = trial_row(cand)
        if cand.same_as is not None and cand.same_as.id in rows:  # the same schedule: its timing, not a new one
            row.update(time_us=rows[cand.same_as.id]["time_us"], error=rows[cand.same_as.id]["error"],
                       same_as=cand.same_as.id)
            return row
        if cand.error is None:
            try:
                fn = build_kernel(cand, self.info, target).jit()[cand.workload.function]
                seconds, _ = time_kernel(fn, sets, tvm.cpu(0), self.min_time)
                row["time_us"] = round(seconds * 1e6, 3)
            except SCHEDULE_ERRORS as err:
                row["error"] = f"build: {type(err).__name__}: {first_line(err)}"
        return row

    def _confirm(self, w: Workload, target: tvm.target.Target, record: dict[str, Any], sets: list) -> dict[str, Any]:
        """The winner re-timed beside the default (luce_runtime.tune_bench.confirm, as a GPU host does it): the
        record keeps these times, and the default's knobs when the winner is not faster after all."""
        from luce_runtime.tune_bench import CONFIRM_ROUNDS, confirm

        default = dict(rule_by_name(target, w.rule).DEFAULTS)
        if knob_id(record["knobs"]) == knob_id(default):
            return record
        pair = schedule_candidates(w, [default, record["knobs"]], target)
        fns = [build_kernel(c, self.info, target).jit()[w.function] for c in pair]
        default_s, best_s = confirm(*fns, sets, tvm.cpu(0), self.min_time)
        return apply_confirmation(record, default, default_s * 1e6, best_s * 1e6, CONFIRM_ROUNDS)


def apply_confirmation(record: dict[str, Any], default: dict[str, int], default_us: float, best_us: float,
                       rounds: int) -> dict[str, Any]:
    """A record with its winner's and default's re-timed medians (the default's knobs if the winner lost)."""
    default_us, best_us = round(default_us, 3), round(best_us, 3)
    if best_us >= default_us:
        record.update(knobs=default, time_us=default_us)
    else:
        record.update(time_us=best_us)
    record.update(default_us=default_us, speedup=round(default_us / record["time_us"], 3),
                  confirmed=f"winner and default re-timed in {rounds} alternating rounds")
    return record


def _rng():
    import numpy as np

    return np.random.default_rng(0)


def trial_row(cand: Candidate) -> dict[str, Any]:
    return {"key": cand.workload.key, "knobs": cand.knobs, "default": cand.default, "time_us": None,
            "error": cand.error, "date": datetime.now(UTC).isoformat(timespec="seconds")}


def trials_by_key(path: Path) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for row in read_jsonl(path) if path.exists() else []:
        out.setdefault(row["key"], {})[knob_id(row["knobs"])] = row
    return out


def rotate_bytes(info: TargetInfo) -> int:
    """Twice the last-level cache: the argument copies a timing rotates through, so weights come from memory."""
    if info.kind == "llvm":
        return 2 * _host_llc_bytes()
    return 2 * int(info.facts.get("l2_bytes", 64 << 20))


def _host_llc_bytes() -> int:
    for index in ("index3", "index2"):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/{index}/size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        return int(text.rstrip("KM")) * scale
    return 32 << 20


def describe_host() -> str:
    from luce_runtime.tune_bench import describe_device

    from luce_compile.targets import host_cpu

    return f"{describe_device('llvm', tvm.cpu(0))} (llvm -mcpu={host_cpu()})"


def best_record(w: Workload | dict[str, Any], rows: list[dict], extents: dict[str, int], device: str,
                source: str) -> dict[str, Any] | None:
    """The record for a workload from its timed candidates: the fastest valid one, beside the default's time."""
    valid = [r for r in rows if r.get("time_us") is not None]
    default = next((r for r in valid if r.get("default")), None)
    if not valid or default is None:
        return None
    best = min(valid, key=lambda r: r["time_us"])
    fields = w.fields() if isinstance(w, Workload) else {k: w[k] for k in ("rule", "function", "weight_type",
                                                                          "target", "args")}
    key = w.key if isinstance(w, Workload) else w["key"]
    return {"key": key, **fields, "knobs": best["knobs"], "time_us": best["time_us"],
            "default_us": default["time_us"], "speedup": round(default["time_us"] / best["time_us"], 3),
            "measured_at": extents, "candidates": len(rows), "invalid": sum(r.get("time_us") is None for r in rows),
            "device": device, "date": datetime.now(UTC).isoformat(timespec="seconds"), "tvm": tvm.__version__,
            "luce_compile": luce_compile.__version__, "source": source}


def save_records(records: list[dict[str, Any]], logs_dir: Path, target: str, name: str) -> Path:
    """Into the log: a new record replaces its workload's old one. It was chosen from every candidate in the trials
    log (this run's and earlier rounds'), so it already keeps the best found; keeping the lower of two times from
    different runs instead would keep the luckiest timing, not the best kernel."""
    path = logs_dir / target / f"{name}.jsonl"
    merge_records(path, records, replace=True)
    return path


def trials_path(logs_dir: Path, target: str, name: str) -> Path:
    return logs_dir / target / TRIALS_DIR / f"{name}.jsonl"
