"""The targets registry: a short name → the TVM target and the facts the schedules and the build need.

`status` says honestly what has been done with each target on real hardware: "measured" (run and timed),
"compiled" (binaries built and checked, never run), or "planned" (not built yet).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from luce_compile.errors import LuceError


@dataclass(frozen=True)
class TargetInfo:
    name: str
    hardware: str
    kind: str  # TVM target kind: llvm | cuda | rocm
    status: str  # measured | compiled | planned
    note: str
    facts: dict[str, Any] = field(default_factory=dict)  # SM count, shared memory, warp size, …

    def tvm_target(self):
        import tvm

        if self.kind == "llvm":
            # the host CPU by name: "native" silently falls back to a generic CPU (10x slower, tvm-0.27 notes)
            cores = self.facts.get("num_cores") or len(os.sched_getaffinity(0))
            return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": cores})
        if self.kind == "cuda":
            return tvm.target.Target({"kind": "cuda", "arch": self.name,
                                      "max_shared_memory_per_block": self.facts["max_shared_memory_per_block"],
                                      "max_threads_per_block": 1024, "thread_warp_size": 32})
        return tvm.target.Target({"kind": "rocm", "mcpu": self.name, "thread_warp_size": 32})


def host_cpu() -> str:
    import tvm

    return str(tvm.target.codegen.llvm_get_system_cpu())


TARGETS = {
    "cpu": TargetInfo("cpu", "this host (x86-64)", "llvm", "measured", "the embedded default; CI runs it"),
    "sm_86": TargetInfo("sm_86", "RTX 3090", "cuda", "planned", "GPU targets come with the GPU issue",
                        {"sm_count": 82, "max_shared_memory_per_block": 49152}),
    "sm_90": TargetInfo("sm_90", "H100/H200", "cuda", "planned", "GPU targets come with the GPU issue",
                        {"sm_count": 132, "max_shared_memory_per_block": 49152}),
    "sm_120": TargetInfo("sm_120", "RTX 5090", "cuda", "planned", "GPU targets come with the GPU issue",
                         {"sm_count": 170, "max_shared_memory_per_block": 49152}),
    "gfx1201": TargetInfo("gfx1201", "Radeon AI PRO R9700", "rocm", "planned",
                          "GPU targets come with the GPU issue (wave32)", {"wave_size": 32}),
    "gfx1151": TargetInfo("gfx1151", "Strix Halo", "rocm", "planned",
                          "GPU targets come with the GPU issue (wave32)", {"wave_size": 32}),
}


def get_target(name: str) -> TargetInfo:
    if name not in TARGETS:
        raise LuceError(f"targets: unknown target {name!r}; known: {', '.join(TARGETS)} (see `luce-compile targets`).")
    info = TARGETS[name]
    if info.status == "planned":
        raise LuceError(f"targets: {name} ({info.hardware}) cannot be built yet: {info.note}. Use --target cpu.")
    return info
