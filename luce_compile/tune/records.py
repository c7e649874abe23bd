"""Tuning records: one JSON line per workload in `autotune_logs/<folder>/<name>.jsonl`, and the lookup compile uses.

A record (one line, readable as it is):
  {"key": workload key (workloads.py), "rule", "function", "weight_type", "target", "args": [{name, shape, dtype}],
   "knobs": the best knobs found, "time_us": their median time, "default_us": the rule defaults' median time,
   "speedup", "measured_at": {symbolic extent: value it was timed at}, "candidates": how many were timed,
   "device": what it was timed on, "date", "tvm", "luce_compile", "source": "local" or "bundle <id>"}
in `autotune_logs/<folder>/`, the folder a GPU arch (sm_90) or the host CPU's int8 level (cpu-avx2: `records_folder`).
A file holds at most one record per key; `trials/<name>.jsonl` beside it holds every candidate timed (every round),
so a search can resume, a record is chosen from all of them, and the search's cost can be read back.

Targets without hardware here take the records of the nearest target that has them: a CUDA arch those of the
measured CUDA arch (sm_90), a ROCm target those of a measured ROCm target (none yet: rule defaults).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import luce_compile
from luce_compile.errors import LuceError
from luce_compile.targets import TARGETS, TargetInfo, get_target

log = logging.getLogger(__name__)
TRIALS_DIR = "trials"


def default_logs_dir() -> Path:
    """The logs shipped with luce-compile: `autotune_logs/` beside the package (the checkout's top level), or
    $LUCE_TUNE_LOGS (tests point it at a temporary folder, so that they never write into the shipped logs)."""
    return Path(os.environ.get("LUCE_TUNE_LOGS") or Path(luce_compile.__file__).resolve().parent.parent
                / "autotune_logs")


class TuneLogError(LuceError, ValueError):
    """A tuning log or results file that cannot be read."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise TuneLogError(f"tune: {path}:{number} is not JSON ({e}); fix or delete that line.") from e
    return rows


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Replace path with these rows, through a temporary file (an interrupted write never leaves half a log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=False) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make a shared logs folder readable by its writer only
    os.replace(tmp, path)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def better(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether record b beats record a (a missing record is beaten by anything)."""
    return a is None or float(b["time_us"]) < float(a["time_us"])


def merge_records(path: Path, new: Iterable[dict[str, Any]], *, replace: bool = False) -> list[dict[str, Any]]:
    """Merge records into a log file, one per key: the faster (replace: the new one); returns those that went in."""
    rows = {r["key"]: r for r in read_jsonl(path)} if path.exists() else {}
    taken = []
    for record in new:
        if replace or better(rows.get(record["key"]), record):
            rows[record["key"]] = record
            taken.append(record)
    write_jsonl(path, (rows[k] for k in sorted(rows)))
    return taken


def records_folder(info: TargetInfo) -> str:
    """The folder of the logs that a target's records go to: a GPU target's (lowest) arch; for this host's CPU
    `cpu-<level>`, its int8 dot level (cpu_int8.int8_isa: avx512vnni, avxvnni, avx2; `cpu-x86-64` with none). The
    CPU kernels differ by that level (vpdpbusd or vpmaddubsw bodies, 512- or 256-bit vectors), so knobs measured on
    one level are never applied to another's kernels: SmolLM2's first records, from a Zen 4 with AVX512-VNNI, had
    been taken by every build on the Zen 3 (AVX2) that replaced it."""
    if info.kind == "llvm":
        from luce_compile.lower.cpu_int8 import int8_isa

        return f"{info.name}-{int8_isa(info.tvm_target()) or 'x86-64'}"
    return info.archs[0] if info.archs else info.name


def log_target(name: str, logs_dir: Path) -> str | None:
    """The records folder (`records_folder`) a build for `name` uses: its own when it has records, else for a GPU the
    nearest measured target's of the same kind that has some (a CUDA arch takes sm_90's), else None (rule
    defaults). A CPU takes only its own level's. A comma list of CUDA archs is generated for its lowest arch, so
    that arch's records apply."""
    info = get_target(name)
    own = records_folder(info)
    if _has_records(logs_dir / own):
        return own
    if info.kind == "llvm":
        return None
    measured = [records_folder(t) for t in TARGETS.values()
                if t.kind == info.kind and t.status == "measured" and records_folder(t) != own]
    return next((t for t in measured if _has_records(logs_dir / t)), None)


def _has_records(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.jsonl"))


@dataclass
class KernelTuning:
    """What the schedule pass did with one tunable kernel: its record's knobs, or the rule defaults."""

    function: str
    rule: str
    key: str
    record: dict[str, Any] | None = None
    error: str | None = None  # a record that did not apply (the rule refused its knobs): defaults were used
    differs: bool = False  # the record's knobs are not the rule's defaults (the search found something better)

    @property
    def tuned(self) -> bool:
        return self.record is not None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rule": self.rule, "status": "tuned" if self.tuned else "default", "key": self.key}
        if self.record is not None:
            d.update(record=self.record.get("_source"), knobs=self.record["knobs"], time_us=self.record["time_us"],
                     default_us=self.record.get("default_us"), differs=self.differs)
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class Tuning:
    """The records one build looks kernels up in (none: every kernel takes its rule's defaults), and the report of
    what each kernel got. Made by `load`; the schedule pass calls `lookup` and `note`."""

    target: str  # the build's target
    log_target: str | None  # whose records apply (see log_target)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    kernels: dict[str, KernelTuning] = field(default_factory=dict)

    @classmethod
    def load(cls, target: str, logs_dir: Path | None) -> Tuning:
        """Records for `target` from logs_dir (None: no records, every kernel default)."""
        if logs_dir is None:
            return cls(target, None)
        if not logs_dir.is_dir():
            raise TuneLogError(f"tune: no tuning logs folder {logs_dir}; pass --tune-logs DIR with a folder that "
                               "holds <target>/*.jsonl (written by `luce-compile tune`), or --no-tune-logs.")
        source = log_target(target, logs_dir)
        tuning = cls(target, source)
        if source is None:
            return tuning
        for path in sorted((logs_dir / source).glob("*.jsonl")):
            tuning.files.append(path)
            for number, record in enumerate(read_jsonl(path), 1):
                record = {**record, "_source": f"{_shown(path)}:{number}"}
                if better(tuning.records.get(record["key"]), record):
                    tuning.records[record["key"]] = record
        return tuning

    @property
    def key_target(self) -> str:
        """The target the keys of the applying records name: the records folder's GPU target (sm_86 builds look up
        sm_90's keys), the build's own for a CPU (its level's folder holds `cpu|…` keys)."""
        if self.log_target is None or get_target(self.target).kind == "llvm":
            return self.target
        return self.log_target

    def lookup(self, key: str) -> dict[str, Any] | None:
        return self.records.get(key)

    def note(self, kernel: KernelTuning) -> None:
        self.kernels[kernel.function] = kernel

    def digest(self) -> str:
        """A hash of the records that apply: part of the build cache's key, so new records mean a new build."""
        text = json.dumps([self.log_target, sorted((k, r["knobs"]) for k, r in self.records.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def summary(self) -> str:
        tuned = [k for k in self.kernels.values() if k.tuned]
        failed = [k for k in self.kernels.values() if k.error]
        if not self.files:
            return f"kernels: 0 tuned (no tuning logs), {len(self.kernels)} with rule defaults"
        # the files whose records were taken (a folder may hold other models' logs: their keys did not match)
        used = sorted({k.record["_source"].rsplit(":", 1)[0] for k in tuned})
        where = ", ".join(used) or f"no matching record in {_shown(self.files[0].parent)}"
        own = records_folder(get_target(self.target))
        borrowed = f" ({self.log_target}'s records)" if self.log_target and self.log_target != own else ""
        text = (f"kernels: {len(tuned)} tuned from {where}{borrowed} ({sum(k.differs for k in tuned)} with knobs "
                f"other than their rule's defaults), {len(self.kernels) - len(tuned)} with rule defaults")
        return text + (f" ({len(failed)} records refused by their rule)" if failed else "")

    def to_manifest(self) -> dict[str, Any]:
        return {"log_target": self.log_target, "files": [_shown(f) for f in self.files],
                "tuned": sum(k.tuned for k in self.kernels.values()),
                "default": sum(not k.tuned for k in self.kernels.values()),
                "kernels": {name: self.kernels[name].to_dict() for name in sorted(self.kernels)}}


def _shown(path: Path) -> str:
    """A log's path as reports show it: relative to the shipped logs folder's parent when inside it."""
    try:
        return str(path.resolve().relative_to(default_logs_dir().parent))
    except ValueError:
        return str(path)
