"""Find, extract and check the device binaries embedded in a compiled kernels library (model.so).

TVM serializes the device module into the exported library as a blob that no tool reads directly (cuobjdump does
not see it: tvm-0.27 notes, gotcha 6), so each binary is found by its magic bytes and cut out by its own headers:
  fatbin   magic 0xBA55ED50, 16-byte header with the payload size          (nvcc, one cubin per arch)
  cubin    ELF, e_machine 190 (EM_CUDA), outside any fatbin                 (NVRTC)
  HSACO    ELF, e_machine 224 (EM_AMDGPU)                                   (ROCm, linked by ld.lld)
Then each is checked with the vendor's tools: cuobjdump (-lelf: one cubin per requested arch; -sass or -symbols:
every kernel of the module present for each arch), llvm-readelf/llvm-objdump (the gfx arch, wavefront size 32 for
every kernel, every kernel disassembles). A library for a GPU target that carries no binary, or carries CUDA source,
is refused: it could not run with the TVM runtime alone.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from luce_compile.codegen.gpu_toolchain import find_tool
from luce_compile.errors import LuceError
from luce_compile.targets import TargetInfo

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
ELF_MAGIC = b"\x7fELF"
EM_CUDA, EM_AMDGPU = 190, 224
CUDA_SOURCE_MARKER = b'extern "C" __global__'
ROCM_WAVE_SIZE = 32


class DeviceBinaryError(LuceError, RuntimeError):
    """A kernels library whose device code is missing, is source, or is not for the asked-for hardware."""


@dataclass
class DeviceBinary:
    kind: str  # fatbin | cubin | hsaco
    offset: int
    data: bytes
    archs: list[str] = field(default_factory=list)
    kernels: dict[str, list[str]] = field(default_factory=dict)  # arch → kernel symbols found
    wave_sizes: list[int] = field(default_factory=list)  # ROCm: one per kernel

    def summary(self) -> dict:
        return {"kind": self.kind, "bytes": len(self.data), "archs": self.archs,
                "kernels": max((len(k) for k in self.kernels.values()), default=0),
                **({"wave_sizes": sorted(set(self.wave_sizes))} if self.wave_sizes else {})}


def _elf_size(data: bytes, at: int) -> int | None:
    """Size of a 64-bit little-endian ELF starting at `at` (its section headers come last), else None."""
    if len(data) < at + 64 or data[at + 4] != 2 or data[at + 5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, at + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, at + 0x3A)
    end = shoff + shentsize * shnum
    return end if 0 < end <= len(data) - at else None


def extract_binaries(data: bytes) -> list[DeviceBinary]:
    """Every fatbin, stand-alone cubin and HSACO code object inside a library's bytes."""
    found: list[DeviceBinary] = []
    taken: list[tuple[int, int]] = []
    for m in re.finditer(re.escape(FATBIN_MAGIC), data):
        at = m.start()
        if len(data) < at + 16:
            continue
        _magic, _version, header, size = struct.unpack_from("<IHHQ", data, at)
        if header == 16 and 0 < size <= len(data) - at - header:
            found.append(DeviceBinary("fatbin", at, data[at:at + header + size]))
            taken.append((at, at + header + size))
    for m in re.finditer(re.escape(ELF_MAGIC), data):
        at = m.start()
        if at == 0 or any(lo <= at < hi for lo, hi in taken) or len(data) < at + 20:
            continue  # offset 0 is the host library itself; ELFs inside a fatbin are its cubins
        machine, = struct.unpack_from("<H", data, at + 18)
        size = _elf_size(data, at)
        if machine in (EM_CUDA, EM_AMDGPU) and size:
            found.append(DeviceBinary("cubin" if machine == EM_CUDA else "hsaco", at, data[at:at + size]))
    return sorted(found, key=lambda b: b.offset)


def _run(cmd: list[str], env: dict | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise DeviceBinaryError(f"build: {Path(cmd[0]).name} failed on an extracted binary: {proc.stderr.strip()}")
    return proc.stdout


def _cuobjdump_env() -> dict:
    import os

    env = dict(os.environ)
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm:
        env["NVDISASM_PATH"] = nvdisasm
    return env


def inspect_cuda(binary: DeviceBinary, path: Path) -> None:
    """Fill archs and per-arch kernel symbols with cuobjdump (-lelf, then -sass, or -symbols without nvdisasm)."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise DeviceBinaryError("build: checking CUDA binaries needs cuobjdump: pip install nvidia-cuda-cuobjdump "
                                "(or the CUDA toolkit's /usr/local/cuda/bin).")
    env = _cuobjdump_env()
    listing = _run([tool, "-lelf", str(path)], env)
    binary.archs = sorted(set(re.findall(r"\.(sm_\d+a?)\.cubin", listing)))
    mode = "-sass" if "NVDISASM_PATH" in env else "-symbols"
    text = _run([tool, mode, str(path)], env)
    arch = None
    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1)
            binary.kernels.setdefault(arch, [])
        elif arch and (m := re.search(r"Function : (\S+)|STT_FUNC\s+STB_GLOBAL\s+STO_ENTRY\s+(\S+)", line)):
            binary.kernels[arch].append(m.group(1) or m.group(2))


def _llvm_tool(name: str) -> str:
    import tvm

    major = tvm.target.codegen.llvm_version_major(allow_none=True)
    for candidate in ([f"{name}-{major}"] if major else []) + [name]:
        if path := shutil.which(candidate):
            return path
    raise DeviceBinaryError(f"build: checking ROCm binaries needs {name} from LLVM {major or '≥ 19'} "
                            f"(apt-get install llvm-{major}).")


def inspect_hsaco(binary: DeviceBinary, path: Path) -> None:
    """Fill arch, kernel names and wavefront sizes from the code object's AMDGPU metadata note; disassemble it."""
    notes = _run([_llvm_tool("llvm-readelf"), "--notes", str(path)])
    binary.archs = sorted(set(re.findall(r"amdhsa\.target:\s+\S*?(gfx\w+)", notes)))
    names = re.findall(r"\.symbol:\s+(\S+)\.kd", notes)
    binary.wave_sizes = [int(w) for w in re.findall(r"\.wavefront_size:\s+(\d+)", notes)]
    mcpu = binary.archs[0] if binary.archs else ""
    disasm = _run([_llvm_tool("llvm-objdump"), "-d", f"--mcpu={mcpu}", str(path)])
    shown = set(re.findall(r"^[0-9a-f]+ <([^>]+)>:", disasm, flags=re.M))
    binary.kernels = {mcpu: [n for n in names if n in shown]}


def device_sources(executable) -> list[tuple[str, str]]:
    """(kind, source) of every device module the compiled module imports (CUDA C, or ROCm's LLVM IR), before export."""
    stack, found = [executable.mod], []
    while stack:
        mod = stack.pop()
        stack.extend(mod.imports)
        if mod.kind in ("cuda", "hip", "rocm"):
            found.append((mod.kind, mod.inspect_source("")))
    return found


def expected_kernels(executable) -> tuple[str, set[str]]:
    """(device module kind, kernel names) from the compiled module's device code, before export."""
    sources, names = device_sources(executable), set()
    for _, source in sources:
        names |= set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', source))
        names |= set(re.findall(r'define\s+(?:\w+\s+)*amdgpu_kernel\s+void\s+@"?([\w.$]+)"?\(', source))
    return (sources[0][0] if sources else "none"), names


@dataclass
class BinaryReport:
    target: str
    library_bytes: int
    binaries: list[DeviceBinary]
    kernels: int

    def to_manifest(self) -> dict:
        return {"library_bytes": self.library_bytes, "kernels": self.kernels,
                "binaries": [b.summary() for b in self.binaries]}


def check_library(path: str | Path, info: TargetInfo, expected: set[str] | None = None) -> BinaryReport:
    """Extract and check every device binary of a kernels library for a GPU target; raise DeviceBinaryError."""
    path = Path(path)
    data = path.read_bytes()
    binaries = extract_binaries(data)
    want_kind = {"cuda": ("fatbin", "cubin"), "rocm": ("hsaco",)}[info.kind]
    mine = [b for b in binaries if b.kind in want_kind]
    if not mine:
        src = " It carries CUDA source instead:" if CUDA_SOURCE_MARKER in data else ""
        raise DeviceBinaryError(
            f"build: {path.name} for {info.name} holds no {'/'.join(want_kind)} device binary.{src} TVM embeds "
            "source when its CUDA runtime library did not load (no libcuda.so.1); build through "
            "luce_compile.codegen.compile, which loads a stand-in driver library first.")
    with tempfile.TemporaryDirectory(prefix="luce-bin-") as tmp:
        for i, binary in enumerate(mine):
            file = Path(tmp) / f"{i}.{binary.kind}"
            file.write_bytes(binary.data)
            (inspect_hsaco if binary.kind == "hsaco" else inspect_cuda)(binary, file)
    _check_archs(mine, info)
    if expected is not None:
        _check_kernels(mine, expected, info)
    kernels = sum(max((len(k) for k in b.kernels.values()), default=0) for b in mine)
    return BinaryReport(info.name, len(data), mine, kernels)


def _check_archs(binaries: list[DeviceBinary], info: TargetInfo) -> None:
    want = set(info.archs or (info.name,))
    for b in binaries:
        if set(b.archs) != want:
            raise DeviceBinaryError(f"build: a {b.kind} in the library is for {b.archs or 'no arch'}, "
                                    f"expected exactly {sorted(want)} for target {info.name}.")
        if b.kind == "hsaco" and set(b.wave_sizes) != {ROCM_WAVE_SIZE}:
            raise DeviceBinaryError(f"build: HSACO kernels use wavefront sizes {sorted(set(b.wave_sizes))}; "
                                    f"{info.name} (RDNA) runs wave{ROCM_WAVE_SIZE} (target thread_warp_size 32).")


def _check_kernels(binaries: list[DeviceBinary], expected: set[str], info: TargetInfo) -> None:
    for arch in info.archs or (info.name,):
        present = {k for b in binaries for k in b.kernels.get(arch, [])}
        missing = sorted(expected - present)
        if missing:
            raise DeviceBinaryError(f"build: {len(missing)} of {len(expected)} kernels have no {arch} machine code "
                                    f"in the library (e.g. {missing[:5]}).")


def export_checked(executable, info: TargetInfo, path: str | Path) -> BinaryReport | None:
    """Export a compiled executable to `path`; for a GPU target, check its device binaries (None for cpu)."""
    path = Path(path)
    if info.kind not in ("cuda", "rocm"):
        executable.export_library(str(path))
        return None
    module_kind, names = expected_kernels(executable)
    if not names:
        raise DeviceBinaryError(f"build: the {info.name} module has no GPU kernels (device module: {module_kind}); "
                                "every function would run as host code on device memory.")
    executable.export_library(str(path))
    return check_library(path, info, names)
