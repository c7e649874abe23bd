"""What a compiled persistent kernel asks of its GPU, read from the device binary alone (no GPU), and the check that
it fits the target: the megakernel runs one block per SM (CU), so a block that asks for more registers, shared
memory (LDS) or threads than one SM has cannot launch, and spills turn register traffic into memory traffic.

CUDA (the fatbin or cubin TVM embedded): `cuobjdump -res-usage` gives registers a thread (REG), the stack frame
(STACK: where ptxas puts spills), local memory (LOCAL) and static shared memory (SHARED) per kernel and arch; the
SASS (`cuobjdump -sass`, through nvdisasm) gives the spill instructions themselves (STL / LDL).
ROCm (the HSACO): the AMDGPU metadata note (`llvm-readelf --notes`) gives VGPRs, SGPRs, their spill counts, the
private (scratch) segment, the static LDS (group segment) and the wavefront size; the kernel descriptor
(`llvm-objdump -D`) gives the VGPRs the hardware allocates a lane, which LLVM may raise above the metadata's count
when occupancy is bound by LDS anyway (seen: 116 used, 248 allocated, gfx1201).

The launch side (threads a block, dynamic shared memory the launcher asks) is the build's: fuse/build.py records it.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from luce_compile.codegen.device_binaries import (
    DeviceBinaryError,
    _cuobjdump_env,
    _llvm_tool,
    _run,
    extract_binaries,
)
from luce_compile.codegen.gpu_toolchain import find_tool
from luce_compile.targets import TargetInfo

# Spills are bounded, not zero: at 512 threads ptxas caps a thread at 65,536 / 512 = 128 registers, and the b8
# matvec bodies (32 sums a lane, several rows' loads in flight) need more. Measured 2026-12-06 (stack + local bytes a
# thread, b8): SmolLM2-135M 16 on sm_86, 32 on sm_120; Llama-3.1-8B Q4_K_M 360 (190 STL) on sm_86, 1,304 (618 STL)
# on sm_120, ~228 on sm_90 (ptxas -v); b1: 0 (SmolLM2, sm_86) to 192 (8B, sm_120). The bound refuses a kernel that
# spills kilobytes (a change that doubles the worst of those); the manifest records every kernel's numbers.
CUDA_SPILL_BOUND_BYTES = 2048
# AMD: a wave32 lane has at most 256 VGPRs whatever the block size, and the 8B-shaped matvec bodies need more: scratch
# of 160 (b1) and 236 (b8) bytes a lane on gfx1201 (40 and 224 with unroll_passes=1), 132 and 384 on gfx1151.
# SmolLM2-135M and smaller have none at any batch. Scratch goes through the vector memory path like any load; the
# bound flags growth past that.
ROCM_SCRATCH_BOUND_BYTES = 512


@dataclass
class KernelResources:
    kernel: str
    arch: str
    threads: int  # a block
    registers: int  # CUDA: a thread's (REG); ROCm: VGPRs the kernel descriptor allocates a lane
    static_shared: int  # bytes: CUDA's SHARED, ROCm's group segment (LDS)
    dynamic_shared: int  # bytes the launch asks on top (CUDA's shared.dyn; none on ROCm)
    spill_bytes: int  # CUDA: stack frame + local memory a thread; ROCm: private (scratch) segment a lane
    spill_stores: int  # CUDA: STL instructions in the SASS; ROCm: LLVM's VGPR spill count
    wave_size: int = 32
    sgprs: int = 0  # ROCm
    sgpr_spills: int = 0  # ROCm: SGPRs spilled into VGPR lanes (v_writelane), no memory

    def to_manifest(self) -> dict:
        return asdict(self)


def _cuda_usage(path: Path) -> dict[tuple[str, str], dict]:
    tool = find_tool("cuobjdump")
    if tool is None:
        raise DeviceBinaryError("build: checking CUDA binaries needs cuobjdump: pip install nvidia-cuda-cuobjdump.")
    env = _cuobjdump_env()
    usage: dict[tuple[str, str], dict] = {}
    arch = ""
    for line in _run([tool, "-res-usage", str(path)], env).splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.search(r"Function (\S+):", line):
            name = m.group(1)
        elif "REG:" in line:
            fields = dict(re.findall(r"(\w+):(\d+)", line))
            usage[(arch, name)] = {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}
    if "NVDISASM_PATH" in env:  # the spill instructions, per arch and kernel
        arch = name = ""
        for line in _run([tool, "-sass", str(path)], env).splitlines():
            if m := re.search(r"arch = (sm_\d+a?)", line):
                arch = m.group(1)
            elif m := re.search(r"Function : (\S+)", line):
                name = m.group(1)
            elif re.search(r"\bSTL(\.\w+)*\s", line) and (arch, name) in usage:
                usage[(arch, name)]["STL"] = usage[(arch, name)].get("STL", 0) + 1
    return usage


def cuda_resources(path: Path, launch: dict[str, tuple[int, int]]) -> list[KernelResources]:
    """Every kernel of `launch` (name → threads, dynamic shared bytes) in a fatbin/cubin, for each arch it holds."""
    found = []
    for (arch, name), u in sorted(_cuda_usage(path).items()):
        kernel = name.removesuffix("_kernel")
        if kernel in launch:
            threads, dynamic = launch[kernel]
            found.append(KernelResources(kernel, arch, threads, u["REG"], u["SHARED"], dynamic,
                                         u["STACK"] + u["LOCAL"], u.get("STL", 0)))
    return found


def _notes_kernels(notes: str) -> list[dict[str, str]]:
    """The AMDGPU metadata's per-kernel scalar fields from `llvm-readelf --notes`: amdhsa.kernels is a YAML list of
    maps at indent 2 ("  - .key:"), their keys at indent 4; the arguments' keys are deeper."""
    kernels: list[dict[str, str]] = []
    in_kernels = False
    for line in notes.splitlines():
        if not line.startswith(" "):
            in_kernels = line.startswith("amdhsa.kernels:")
            continue
        if not in_kernels:
            continue
        if line.startswith("  - "):
            kernels.append({})
        if m := re.match(r"(?:  - |    )\.(\w+):\s+(\S+)\s*$", line):
            kernels[-1][m.group(1)] = m.group(2)
    return [k for k in kernels if "symbol" in k]


def _allocated_vgprs(path: Path, mcpu: str, symbol: str) -> int:
    text = _run([_llvm_tool("llvm-objdump"), "-D", f"--mcpu={mcpu}", f"--disassemble-symbols={symbol}", str(path)])
    m = re.search(r"\.amdhsa_next_free_vgpr\s+(\d+)", text)
    if not m:
        raise DeviceBinaryError(f"build: no kernel descriptor {symbol} in the HSACO for {mcpu}.")
    return int(m.group(1))


def hsaco_resources(path: Path, mcpu: str, launch: dict[str, tuple[int, int]]) -> list[KernelResources]:
    notes = _run([_llvm_tool("llvm-readelf"), "--notes", str(path)])
    found = []
    for k in _notes_kernels(notes):
        kernel = k["name"].removesuffix("_kernel")
        if kernel not in launch:
            continue
        threads, dynamic = launch[kernel]
        found.append(KernelResources(
            kernel, mcpu, threads, _allocated_vgprs(path, mcpu, k["symbol"]), int(k["group_segment_fixed_size"]),
            dynamic, int(k["private_segment_fixed_size"]), int(k["vgpr_spill_count"]), int(k["wavefront_size"]),
            int(k["sgpr_count"]), int(k["sgpr_spill_count"])))
    return found


def library_resources(library: Path, info: TargetInfo, launch: dict[str, tuple[int, int]]) -> list[KernelResources]:
    """The resources of each launched kernel in a kernels library's device binaries."""
    binaries = [b for b in extract_binaries(library.read_bytes()) if b.kind in ("fatbin", "cubin", "hsaco")]
    found: list[KernelResources] = []
    with tempfile.TemporaryDirectory(prefix="luce-res-") as tmp:
        for i, b in enumerate(binaries):
            file = Path(tmp) / f"{i}.{b.kind}"
            file.write_bytes(b.data)
            if b.kind == "hsaco":
                found += hsaco_resources(file, info.name, launch)
            else:
                found += cuda_resources(file, launch)
    return found


def check_cuda(r: KernelResources, facts: dict) -> list[str]:
    problems = []
    if r.registers * r.threads > facts["registers_per_sm"]:
        problems.append(f"{r.registers} registers x {r.threads} threads > the SM's {facts['registers_per_sm']}")
    shared = r.static_shared + r.dynamic_shared
    if shared > facts["max_shared_memory_opt_in"]:
        problems.append(f"{shared} bytes of shared memory ({r.static_shared} static + {r.dynamic_shared} dynamic) > "
                        f"the {facts['max_shared_memory_opt_in']} a block may opt in to")
    if r.dynamic_shared == 0 and r.static_shared > facts["max_shared_memory_per_block"]:
        problems.append(f"{r.static_shared} bytes of static shared memory > {facts['max_shared_memory_per_block']}")
    if r.spill_bytes > CUDA_SPILL_BOUND_BYTES:
        problems.append(f"{r.spill_bytes} bytes of stack/local memory a thread (spills: {r.spill_stores} STL) > "
                        f"the bound of {CUDA_SPILL_BOUND_BYTES}")
    return problems


def check_rocm(r: KernelResources, facts: dict) -> list[str]:
    """Scratch within ROCM_SCRATCH_BOUND_BYTES (a spill is a scratch store per lane through the vector memory path;
    SGPR spills go to VGPR lanes, no memory, and are allowed)."""
    problems = []
    if r.wave_size != facts["warp_size"]:
        problems.append(f"wavefront size {r.wave_size}, the target runs wave{facts['warp_size']}")
    waves_per_simd = math.ceil(r.threads / r.wave_size / facts["simds_per_cu"])
    if r.registers * waves_per_simd > facts["vgprs_per_simd"]:
        problems.append(f"{r.registers} VGPRs x {waves_per_simd} waves a SIMD > the SIMD's {facts['vgprs_per_simd']}")
    if r.static_shared + r.dynamic_shared > facts["max_shared_memory_per_block"]:
        problems.append(f"{r.static_shared + r.dynamic_shared} bytes of LDS > the workgroup's "
                        f"{facts['max_shared_memory_per_block']}")
    if r.spill_bytes > ROCM_SCRATCH_BOUND_BYTES:
        problems.append(f"scratch: {r.spill_bytes} bytes a lane ({r.spill_stores} VGPRs spilled) > the bound of "
                        f"{ROCM_SCRATCH_BOUND_BYTES}")
    return problems


def check_megakernels(library: str | os.PathLike, info: TargetInfo,
                      launch: dict[str, tuple[int, int]]) -> list[KernelResources]:
    """Every megakernel of `launch` is in the library for each arch, and fits the target; DeviceBinaryError if not."""
    found = library_resources(Path(library), info, launch)
    archs = info.archs or (info.name,)
    missing = sorted({f"{k} ({a})" for k in launch for a in archs} - {f"{r.kernel} ({r.arch})" for r in found})
    if missing:
        raise DeviceBinaryError(f"build: the megakernel library has no machine code for {', '.join(missing)}.")
    problems = []
    for r in found:
        check = check_rocm if info.kind == "rocm" else check_cuda
        problems += [f"{r.kernel} on {r.arch}: {p}" for p in check(r, info.facts)]
    if problems:
        raise DeviceBinaryError(f"build: the megakernels do not fit {info.name}: {'; '.join(problems)}.")
    return found
