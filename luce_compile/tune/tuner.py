"""`luce-compile tune`'s entry: a model's workloads for a target, searched here (cpu) or built into a bundle."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luce_compile.errors import LuceError
from luce_compile.targets import TargetInfo
from luce_compile.tune.workloads import Workload

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 32  # candidates per workload, the rule default included
    minutes: float = 15.0  # the whole search (the CPU); a bundle is built whatever it takes
    logs_dir: Path = Path("autotune_logs")
    bundle: Path | None = None  # build a bundle here instead of timing (always, for GPU targets)
    precision: str = "auto"
    extents: dict[str, int] = field(default_factory=dict)  # symbolic extent name → value timed at
    min_time: float = 0.2  # seconds of calls per timed candidate


def model_workloads(gguf_path: Path, info: TargetInfo, precision: str = "auto") -> list[Workload]:
    """The model's tunable kernels for a target: lowered as compile lowers it, through TVM's passes up to the
    schedule step, so the keys are the ones compile will look up."""
    import tvm

    from luce_compile.codegen.pipeline import pre_schedule_passes
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph import build_graph
    from luce_compile.lower.cpu_int8 import resolve_precision
    from luce_compile.lower.relax_model import LowerOptions, lower_graph
    from luce_compile.tune.workloads import find_workloads

    target = info.tvm_target()
    graph = build_graph(read_gguf(gguf_path))
    mod, _ = lower_graph(graph, target, LowerOptions(precision=resolve_precision(precision, target)))
    with target:
        mod = tvm.transform.Sequential(pre_schedule_passes(target))(mod)
    return find_workloads(mod, target, info.name)


def tune(gguf_path: Path, info: TargetInfo, options: TuneOptions, progress: Progress) -> dict[str, Any]:
    """Search (cpu, no bundle asked) or build a bundle; returns what happened, for the command to print."""
    from luce_compile.tune.records import records_folder
    from luce_compile.tune.search import LocalSearch, save_records, trials_path

    if len(info.archs) > 1:
        raise LuceError(f"tune: {info.name} is several archs; tune one (e.g. --target {info.archs[0]}): a build "
                        f"for several takes the records of its lowest arch, {info.archs[0]}, its kernels' arch.")
    name = gguf_path.stem
    start = time.monotonic()
    workloads = model_workloads(gguf_path, info, options.precision)
    progress(f"{len(workloads)} tunable kernels in {name} for {info.name}")
    if options.bundle is not None or info.kind != "llvm":
        from luce_compile.tune.bundle import build_bundle

        bundle = options.bundle or Path(f"{name}.{info.name}.tune-bundle")
        index = build_bundle(workloads, info, name, bundle, trials=options.trials, logs_dir=options.logs_dir,
                             extents=options.extents, progress=progress)
        return {"bundle": bundle, "candidates": len(index["candidates"]), "workloads": len(workloads)}
    folder = records_folder(info)
    search = LocalSearch(info, options.trials, start + options.minutes * 60,
                         trials_path(options.logs_dir, folder, name), options.extents, options.min_time, progress)
    records = search.run(workloads)
    path = save_records(records, options.logs_dir, folder, name)
    return {"log": path, "records": records, "workloads": len(workloads), "seconds": time.monotonic() - start}
