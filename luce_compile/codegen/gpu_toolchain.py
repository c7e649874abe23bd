"""Make TVM's GPU code generators produce real device binaries on a machine without a GPU.

CUDA: TVM compiles kernels through `tvm_callback_cuda_compile`, but only once `libtvm_runtime_cuda.so` is loaded,
and that library needs the driver's `libcuda.so.1`. Without a driver it fails to load *silently* and `tvm.compile`
embeds CUDA source instead of cubins (tvm-0.27 notes, gotcha 1). `ensure_cuda_codegen` loads a stub `libcuda.so.1`
(the `cu*` symbols that library imports, each returning CUDA_ERROR_STUB_LIBRARY) — built with gcc into the cache on
first use, and only when no real driver can be loaded. `cuda_fatbin_hook` replaces the compile hook with nvcc
emitting one fatbin holding a cubin per requested arch.

ROCm: TVM links kernels with `ld.lld` and the ROCm device libraries (Debian: lld-NN, rocm-device-libs under
/usr/lib/x86_64-linux-gnu/amdgcn/bitcode). `rocm_toolchain` points TVM there, links the wave32 flavour of the
device libraries, and lowers float64 exp/sin/cos to ocml (TVM 0.27 leaves them as LLVM intrinsics that the AMDGPU
backend cannot select: "no libcall available for fexp"; the RoPE kernel forms its angles in float64).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from luce_compile.errors import LuceError
from luce_compile.models import cache_dir

log = logging.getLogger(__name__)

CUDA_HOME_CANDIDATES = ("/usr/local/cuda/bin",)
ROCM_PATH_CANDIDATES = ("/usr/lib/x86_64-linux-gnu", "/opt/rocm")
_state: dict[str, object] = {}


class ToolchainError(LuceError, RuntimeError):
    """A tool a GPU build needs is missing or broken (nvcc, gcc, ld.lld, the ROCm device libraries)."""


def _tvm_lib(name: str) -> Path:
    import tvm

    path = Path(tvm.__file__).parent / "lib" / name
    if not path.is_file():
        raise ToolchainError(f"build: {path} is missing; reinstall apache-tvm (pip install --force-reinstall "
                             "apache-tvm==0.27.0.post1).")
    return path


def cuda_runtime_registered() -> bool:
    import tvm_ffi

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


def ensure_cuda_codegen() -> str:
    """Make TVM's CUDA module creation available; returns "driver", "stub" or "ready" (already loaded)."""
    if cuda_runtime_registered():
        return "ready"
    try:  # a real driver: never shadow it with the stub
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        how = "driver"
    except OSError:
        ctypes.CDLL(str(_cuda_stub()), mode=ctypes.RTLD_GLOBAL)
        how = "stub"
    try:
        # the same load tvm.backend.cuda does at import (which failed quietly before libcuda.so.1 was loadable)
        ctypes.CDLL(str(_tvm_lib("libtvm_runtime_cuda.so")), mode=ctypes.RTLD_LOCAL)
    except OSError as err:
        raise ToolchainError(f"build: TVM's CUDA runtime library does not load even with libcuda.so.1 ({how}): "
                             f"{err}. It also needs libcudart.so.13 (the CUDA 13 toolkit).") from err
    if not cuda_runtime_registered():
        raise ToolchainError("build: libtvm_runtime_cuda.so loaded but registered no CUDA module; the TVM install "
                             "is inconsistent (pip install --force-reinstall apache-tvm==0.27.0.post1).")
    log.info("CUDA code generation enabled (libcuda.so.1: %s)", how)
    return how


def _cuda_stub() -> Path:
    """libcuda.so.1 exporting every cu* symbol TVM's CUDA runtime imports; built once per TVM build."""
    runtime = _tvm_lib("libtvm_runtime_cuda.so")
    nm = shutil.which("nm")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if nm is None or gcc is None:
        raise ToolchainError("build: CUDA builds without a GPU driver need gcc and nm (apt-get install gcc binutils) "
                             "to make a stand-in libcuda.so.1.")
    listed = subprocess.run([nm, "-D", "--undefined-only", str(runtime)], capture_output=True, text=True, check=True)
    symbols = sorted({line.split()[-1].split("@")[0] for line in listed.stdout.splitlines() if line.strip()})
    symbols = [s for s in symbols if s.startswith("cu") and s[2:3].isupper()]
    key = hashlib.sha256(("\n".join(symbols) + str(runtime.stat().st_size)).encode()).hexdigest()[:16]
    out = cache_dir() / "cuda-stub" / key / "libcuda.so.1"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # 34 = CUDA_ERROR_STUB_LIBRARY: anything that really calls the driver here fails cleanly instead of crashing
    source = "".join(f"int {s}(void) {{ return 34; }}\n" for s in symbols)
    src = out.parent / "stub.c"
    src.write_text(source)
    tmp = out.with_suffix(".tmp")
    subprocess.run([gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)], check=True,
                   capture_output=True)
    tmp.replace(out)
    return out


def find_tool(name: str, extra_dirs: tuple[str, ...] = ()) -> str | None:
    """A CUDA tool on PATH, in /usr/local/cuda/bin, or in the nvidia-cuda-* pip packages (nvidia/cu13/bin)."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [*extra_dirs, *CUDA_HOME_CANDIDATES]
    with contextlib.suppress(ImportError):
        import nvidia

        dirs += [str(Path(p) / sub / "bin") for p in nvidia.__path__ for sub in ("cu13", "cuda_nvcc")]
    for d in dirs:
        path = Path(d) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    flags: list[str] = []
    for arch in archs:
        num = arch.removeprefix("sm_")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return flags


@contextlib.contextmanager
def cuda_fatbin_hook(archs: tuple[str, ...]) -> Iterator[None]:
    """While active, TVM's CUDA compile hook runs nvcc for every arch in `archs` into one fatbin."""
    from tvm.support import nvcc as tvm_nvcc

    if find_tool("nvcc") is None:
        raise ToolchainError("build: CUDA targets need nvcc (the CUDA 13 toolkit, /usr/local/cuda/bin) on PATH.")
    flags = gencode_flags(archs)
    nvcc_dir = str(Path(find_tool("nvcc")).parent)
    compiled: list[int] = []

    def compile_fatbin(code: str) -> bytearray:
        # compile_cuda runs "nvcc" from PATH; the kernels were generated for the lowest arch (the target scope)
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{nvcc_dir}{os.pathsep}{path}"
        try:
            binary = tvm_nvcc.compile_cuda(code, target_format="fatbin", arch=flags, compiler="nvcc")
        finally:
            os.environ["PATH"] = path
        compiled.append(len(binary))
        return binary

    with overriding_global_func("tvm_callback_cuda_compile", compile_fatbin):
        yield
    log.info("nvcc built %d fatbin(s) for %s", len(compiled), ",".join(archs))


@contextlib.contextmanager
def overriding_global_func(name: str, func) -> Iterator[None]:
    """Replace one of TVM's global callbacks while active; the original is put back even on error."""
    import tvm_ffi

    original = tvm_ffi.get_global_func(name)
    tvm_ffi.register_global_func(name, func, override=True)
    try:
        yield
    finally:
        tvm_ffi.register_global_func(name, original, override=True)


def rocm_path() -> str:
    for root in [os.environ.get("ROCM_PATH", ""), *ROCM_PATH_CANDIDATES]:
        if root and (Path(root) / "amdgcn" / "bitcode" / "ocml.bc").is_file():
            return root
    raise ToolchainError("build: ROCm targets need the ROCm device libraries (ocml.bc): apt-get install "
                         "rocm-device-libs (Debian), or set ROCM_PATH to a ROCm install with amdgcn/bitcode.")


# The device libraries linked into every kernel, in link order: one flavour of each control library, matching the
# target (TVM's default list links both "on" and "off" flavours and wave64, which is wrong for RDNA's wave32).
_ROCM_BITCODE = ("ocml", "oclc_daz_opt_off", "oclc_correctly_rounded_sqrt_on", "oclc_finite_only_off",
                 "oclc_unsafe_math_off", "oclc_wavefrontsize64_off", "oclc_abi_version_500")


@contextlib.contextmanager
def rocm_toolchain(mcpu: str, extra_ir: tuple[str, ...] = ()) -> Iterator[None]:
    """While active, TVM's ROCm build finds lld and the device libraries and links the wave32 flavour, and the LLVM
    IR files `extra_ir` (text or bitcode: functions the kernels call that TIR cannot express, emit_cuda/intrinsics)."""
    import tvm
    from tvm.support import rocm as tvm_rocm

    root = rocm_path()
    if not tvm_rocm.find_lld(required=False):
        major = tvm.target.codegen.llvm_version_major(allow_none=True)
        raise ToolchainError(f"build: ROCm targets need ld.lld (TVM's LLVM is {major}): apt-get install lld-{major}.")
    _register_rocm_f64_math()
    bitcode = Path(root) / "amdgcn" / "bitcode"
    isa = bitcode / f"oclc_isa_version_{mcpu.removeprefix('gfx')}.bc"
    files = [str(bitcode / f"{n}.bc") for n in _ROCM_BITCODE] + ([str(isa)] if isa.is_file() else [])
    files += [str(f) for f in extra_ir]

    def bitcode_path(_rocdl_dir=None):
        return tvm.runtime.convert(files)

    saved_env = os.environ.get("ROCM_PATH")
    os.environ["ROCM_PATH"] = root
    try:
        with overriding_global_func("tvm_callback_rocm_bitcode_path", bitcode_path):
            yield
    finally:
        if saved_env is None:
            os.environ.pop("ROCM_PATH", None)
        else:
            os.environ["ROCM_PATH"] = saved_env


def _register_rocm_f64_math() -> None:
    """float64 exp/sin/cos → __ocml_*_f64 calls on ROCm (once per process); other dtypes keep TVM's lowering."""
    if _state.get("rocm_f64"):
        return
    import tvm
    from tvm import tirx

    for name in ("exp", "sin", "cos"):
        op_name = f"tirx.{name}"
        original = tvm.ir.Op.get(op_name).get_attr("rocm.FLowerIntrinsic")

        def lower(call, _name=name, _original=original):
            if str(call.ty.dtype) == "float64":
                return tirx.call_pure_extern("float64", f"__ocml_{_name}_f64", *call.args)
            return _original(call)

        tirx.op.register_intrin_lowering(op_name, target="rocm", f=lower, level=99)
    _state["rocm_f64"] = True


# How to get each missing piece. The apt packages are Debian's (what scripts/setup.sh installs, as root, for the
# tests); the CUDA checkers are pip wheels (the gpu extra). The CPU target needs none of this.
_APT_GPU = "apt-get install lld-{major} llvm-{major} rocm-device-libs (as root; bash scripts/setup.sh does it)"
_PIP_GPU = "pip install -e '.[gpu]' (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)"


def missing_gpu_tools(kind: str) -> list[str]:
    """What a build (and its binary check) for a target of this TVM kind needs and this machine lacks, each with how
    to get it; empty when everything is there (and always for the CPU)."""
    if kind == "cuda":
        missing = []
        if find_tool("nvcc") is None:
            missing.append("nvcc (the CUDA 13 toolkit: https://developer.nvidia.com/cuda-downloads, then "
                           "/usr/local/cuda/bin on PATH)")
        if find_tool("cuobjdump") is None:
            missing.append(f"cuobjdump: {_PIP_GPU}")
        has_cc = bool((shutil.which("gcc") or shutil.which("cc")) and shutil.which("nm"))
        if not has_cc and not _loads("libcuda.so.1"):
            missing.append("gcc and nm, to stand in for the GPU driver: apt-get install gcc binutils")
        return missing
    if kind != "rocm":
        return []
    import tvm
    from tvm.support import rocm as tvm_rocm

    major = tvm.target.codegen.llvm_version_major(allow_none=True) or 22
    missing = []
    try:
        rocm_path()
    except ToolchainError:
        missing.append("the ROCm device libraries (ocml.bc)")
    if not tvm_rocm.find_lld(required=False):
        missing.append(f"ld.lld-{major}")
    if not all(shutil.which(f"{tool}-{major}") or shutil.which(tool) for tool in ("llvm-readelf", "llvm-objdump")):
        missing.append(f"llvm-readelf-{major} and llvm-objdump-{major}")
    return [f"{', '.join(missing)}: {_APT_GPU.format(major=major)}"] if missing else []


def require_gpu_toolchain(kind: str, target: str) -> None:
    """Fail fast, before a model is fetched or lowered, when a GPU target's toolchain is not installed."""
    missing = missing_gpu_tools(kind)
    if missing:
        raise ToolchainError(f"build: --target {target} needs a GPU toolchain this machine lacks: "
                             f"{'; '.join(missing)}. The CPU target (--target cpu) needs none of it.")


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def cuda_source(mod, target, **compile_kwargs) -> str:  # noqa: ANN001  (tvm.IRModule, tvm.target.Target)
    """The CUDA C++ TVM generates for an IRModule, captured before any compiler runs (no nvcc or NVRTC needed):
    what tests inspect and what a reader of a schedule wants to see."""
    import tvm

    ensure_cuda_codegen()
    captured: list[str] = []

    def capture(code: str) -> bytearray:
        captured.append(code)
        return bytearray(b"\0")

    with overriding_global_func("tvm_callback_cuda_compile", capture), target:
        tvm.compile(mod, target=target, **compile_kwargs)
    return captured[0]


@contextlib.contextmanager
def gpu_toolchain(kind: str, archs: tuple[str, ...], mcpu: str = "", extra_ir: tuple[str, ...] = ()) -> Iterator[str]:
    """Everything a build for a cuda/rocm target needs around tvm.compile; yields how CUDA codegen was enabled.
    `extra_ir`: LLVM IR files a ROCm build links into its kernels."""
    if kind == "cuda":
        how = ensure_cuda_codegen()
        with cuda_fatbin_hook(archs):
            yield how
    elif kind == "rocm":
        with rocm_toolchain(mcpu, extra_ir):
            yield "rocm"
    else:
        yield "none"
