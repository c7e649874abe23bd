"""The targets registry: a short name → the TVM target and the facts the schedules and the build need.

`status` says honestly what has been done with each target on real hardware: "measured" (run and timed),
"compiled" (binaries built and checked, never run), or "planned" (not built yet).

Several CUDA archs build into one artifact with a comma list (`--target sm_86,sm_90,sm_120`): the kernels are
generated once for the lowest arch (so no instruction a lower arch lacks is used) and nvcc emits one cubin per arch
into a single fatbin (codegen/device_binaries.py). Facts are the hardware's own numbers (vendor data sheets) that a
schedule may size itself by; the limits TVM enforces (threads per block, shared memory) are in the TVM target.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from luce_compile.errors import LuceError

# One workgroup on RDNA may hold 1024 threads, but TVM 0.27's AMDGPU codegen marks every kernel
# "amdgpu-flat-work-group-size"="1,256" when no ROCm device is present (it asks the device, else 256), so schedules
# built here must stay at or under 256 threads per block or the launch fails on the card.
ROCM_MAX_THREADS = 256
STATUS_ORDER = ("planned", "compiled", "measured")


@dataclass(frozen=True)
class TargetInfo:
    name: str
    hardware: str
    kind: str  # TVM target kind: llvm | cuda | rocm
    status: str  # measured | compiled | planned
    note: str
    facts: dict[str, Any] = field(default_factory=dict)  # SM count, shared memory, warp size, …
    archs: tuple[str, ...] = ()  # CUDA: every sm_XX the fatbin carries (one unless a comma list was asked for)
    # the decode megakernel's own status (measured | compiled | none) and how it was checked: it is one kernel
    # that can hang or spill where the per-op kernels run, so `luce-compile targets` says it apart
    megakernel: str = "none"
    megakernel_note: str = "the per-op kernels only"

    def tvm_target(self):
        import tvm

        if self.kind == "llvm":
            # the host CPU by name: "native" silently falls back to a generic CPU (10x slower, tvm-0.27 notes)
            cores = self.facts.get("num_cores") or len(os.sched_getaffinity(0))
            return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": cores})
        f = self.facts
        if self.kind == "cuda":
            return tvm.target.Target({"kind": "cuda", "arch": (self.archs or (self.name,))[0],
                                      "max_shared_memory_per_block": f["max_shared_memory_per_block"],
                                      "max_threads_per_block": f["max_threads_per_block"],
                                      "thread_warp_size": f["warp_size"]})
        # RDNA is wave32: TVM's rocm default (64) would make every warp-level reduction wrong
        return tvm.target.Target({"kind": "rocm", "mcpu": self.name, "thread_warp_size": f["warp_size"],
                                  "max_threads_per_block": f["max_threads_per_block"],
                                  "max_num_threads": f["max_threads_per_block"],
                                  "max_shared_memory_per_block": f["max_shared_memory_per_block"]})


def host_cpu() -> str:
    import tvm

    return str(tvm.target.codegen.llvm_get_system_cpu())


def _cuda(name: str, hardware: str, status: str, note: str, sm_count: int, l2_mb: int, gb_s: int,
          opt_in_shared_kib: int) -> TargetInfo:
    # 48 KiB is the static shared memory any kernel may use without opting in to more (cudaFuncSetAttribute);
    # opted in, a block may have opt_in_shared_kib (CUDA programming guide, compute capabilities table)
    # registers_per_sm: 64K 32-bit registers on every SM from sm_50 to sm_120 (the same table)
    facts = {"sm_count": sm_count, "l2_bytes": l2_mb << 20, "warp_size": 32, "max_threads_per_block": 1024,
             "max_shared_memory_per_block": 49152, "max_shared_memory_opt_in": opt_in_shared_kib << 10,
             "mem_bandwidth_gb_s": gb_s, "registers_per_sm": 65536}
    megakernel = ("measured", "run on an H200: matches the oracle, timed") if status == "measured" else \
        ("compiled", "built; registers, spills and shared memory checked in the cubin here (cuobjdump); never run")
    return TargetInfo(name, hardware, "cuda", status, note, facts, (name,), *megakernel)


def _rocm(name: str, hardware: str, status: str, note: str, compute_units: int, gb_s: int) -> TargetInfo:
    # an RDNA3/RDNA4 CU has 2 SIMDs; vgprs_per_simd: the wave32 register file LLVM 22 models for gfx1100, gfx1151
    # and gfx1201 (1,536: a kernel held to 5 waves a SIMD keeps 256 VGPRs there, 192 on gfx1102's 1,024), the bound
    # of the VGPRs a lane x the waves of a block on one CU
    facts = {"sm_count": compute_units, "warp_size": 32, "max_threads_per_block": ROCM_MAX_THREADS,
             "max_shared_memory_per_block": 65536, "mem_bandwidth_gb_s": gb_s, "simds_per_cu": 2,
             "vgprs_per_simd": 1536}
    return TargetInfo(name, hardware, "rocm", status, note, facts, (), "compiled",
                      "built through LLVM's AMDGPU backend; VGPRs, scratch, LDS and wave size checked in the HSACO, "
                      "the task protocol in the simulator; never run")


_COMPILED = "compiled and binary-checked here (cuobjdump); never run"
# mem_bandwidth_gb_s: the device-copy bandwidth measured on the H200 (benchmarks/results/h200-2026-11-30-run3.md,
# read + write), elsewhere the vendor's datasheet figure: the megakernel planner's cost model (fuse/plan.py)
TARGETS = {
    "cpu": TargetInfo("cpu", "this host (x86-64)", "llvm", "measured", "the embedded default; CI runs it"),
    "sm_86": _cuda("sm_86", "RTX 3090", "compiled", _COMPILED, 82, 6, 936, 99),
    "sm_90": _cuda("sm_90", "H100/H200", "measured",
                   "run on an H200 (runtime only): matches the oracle, timed; benchmarks/results/h200/", 132, 50, 4225,
                   227),
    "sm_120": _cuda("sm_120", "RTX 5090", "compiled", _COMPILED, 170, 96, 1792, 99),
    "gfx1201": _rocm("gfx1201", "Radeon AI PRO R9700", "compiled",
                     "wave32 HSACO compiled and disassembled here (llvm-objdump); never run", 64, 640),
    "gfx1151": _rocm("gfx1151", "Strix Halo", "compiled",
                     "wave32 HSACO compiled and disassembled here (llvm-objdump); never run", 40, 256),
}


def get_target(name: str) -> TargetInfo:
    """The registry entry for a name, or for a comma list of CUDA archs (one fatbin carrying each of them)."""
    if "," in name:
        return _multi_arch(name)
    if name not in TARGETS:
        raise LuceError(f"targets: unknown target {name!r}; known: {', '.join(TARGETS)} (see `luce-compile targets`); "
                        "several CUDA archs build together as a comma list, e.g. sm_86,sm_90,sm_120.")
    info = TARGETS[name]
    if info.status == "planned":
        raise LuceError(f"targets: {name} ({info.hardware}) cannot be built yet: {info.note}. Use --target cpu.")
    return info


def _multi_arch(name: str) -> TargetInfo:
    parts = [p.strip() for p in name.split(",") if p.strip()]
    infos = [get_target(p) for p in dict.fromkeys(parts)]
    if any(i.kind != "cuda" for i in infos) or len(infos) < 2:
        raise LuceError(f"targets: {name!r}: only CUDA archs combine into one artifact (e.g. sm_86,sm_90,sm_120); "
                        "build a ROCm or cpu target on its own.")
    infos.sort(key=lambda i: int(i.name.removeprefix("sm_")))
    lowest = infos[0]
    # a schedule sized for the lowest arch runs everywhere; the weakest status is the honest one for the set
    status = min((i.status for i in infos), key=STATUS_ORDER.index)
    return dataclasses.replace(
        lowest, name=",".join(i.name for i in infos), hardware=" + ".join(i.hardware for i in infos),
        status=status, note=f"one fatbin for {len(infos)} archs, kernels generated for {lowest.name}",
        archs=tuple(i.name for i in infos))


def sm_version(target) -> int | None:
    """A CUDA target's compute capability as a number (sm_90a → 90); None for other targets."""
    arch = str(target.attrs.get("arch", "")).removeprefix("sm_").rstrip("a")
    return int(arch) if target.kind.name == "cuda" and arch.isdigit() else None


def facts_for(target) -> dict[str, Any]:
    """The registry facts of a TVM target (by its CUDA arch or ROCm mcpu); {} for a target the registry lacks."""
    kind = target.kind.name
    key = str(target.attrs.get("arch", "")) if kind == "cuda" else str(target.attrs.get("mcpu", ""))
    info = TARGETS.get(key)
    if info is None or info.kind != kind:
        return {}
    return dict(info.facts)
