"""Load and verify a compiled luce-compile artifact (format version 1) with the runtime alone.

An artifact is a directory:
  manifest.json   what was compiled, from which GGUF, for which target; the sha256 of every other file
  weights.bin     every weight array at a 64-byte aligned offset, mapped zero-copy by `Artifact.weights()`
  tokenizer.json  the GGUF's `tokenizer.*` metadata keys (the runtime builds its tokenizer from them)
  model.so        the compiled kernels / Relax VM module (loaded by the engine with the TVM runtime)
or the same files in one uncompressed tar with manifest.json first (`luce-compile pack`), unpacked into a cache.

The compiler writes it (luce_compile/artifact/writer.py) and imports the format's constants from here, because the
runtime must never import the compiler.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import mmap
import os
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from luce_runtime.errors import ArtifactError

log = logging.getLogger(__name__)

FORMAT_NAME = "luce-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS_LAYOUT = "luce-planes-v1"
# TVM's kAllocAlignment: DLPack tensors handed to TVM must start 64-byte aligned. The map itself is page aligned,
# so aligned offsets give aligned arrays. 64 is also a cache line and one AVX-512 load.
ALIGNMENT = 64
# Array element types a weights entry may have (all little-endian). bfloat16 is stored as its 16 raw bits.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2",
        "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "i1",
        "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "u1",
    }.items()
}
# ISA extensions whose absence makes kernels built with `-mcpu=<compile host>` die with SIGILL on another CPU.
ISA_FLAGS = frozenset({
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni",  # x86-64
    "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16",  # aarch64
})
_HASH_BUFFER = 8 << 20  # one streaming pass; 8 MiB reads keep syscalls off the profile


def recompile_hint(target: str = "cpu") -> str:
    return f"recompile with `luce-compile compile MODEL.gguf --target {target} -o ARTIFACT_DIR`"


def file_sha256(path: Path) -> str:
    """sha256 of a file in one streaming pass (no whole-file read)."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BUFFER)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def host_cpu_facts() -> dict[str, Any]:
    """This machine's CPU model name and ISA flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    facts: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "cpu_model" not in facts:
            facts["cpu_model"] = value.strip()
        elif key in ("flags", "Features") and "cpu_flags" not in facts:
            facts["cpu_flags"] = sorted(ISA_FLAGS.intersection(value.split()))
    return facts


def _llvm_host_cpu() -> str | None:
    """LLVM's name for this CPU, when the TVM compiler library happens to be loaded (runtime-only TVM lacks it)."""
    if "tvm_ffi" not in sys.modules:
        return None
    func = sys.modules["tvm_ffi"].get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    return str(func()) if func is not None else None


@dataclass(frozen=True)
class ParamInfo:
    """One weights.bin entry: `shape`/`dtype` at `offset` (bytes), and which GGUF tensor (and plane) it came from."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    source_tensor: str | None = None
    ggml_type: str | None = None
    plane: str | None = None


class Artifact:
    """A loaded (and, unless asked otherwise, verified) artifact directory."""

    def __init__(self, root: Path, manifest: dict[str, Any], params: list[ParamInfo]):
        self.root, self.manifest, self.params = root, manifest, params
        self._map: mmap.mmap | None = None

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    @property
    def target(self) -> dict[str, Any]:
        return self.manifest["target"]

    @property
    def runtime_defaults(self) -> dict[str, Any]:
        return self.manifest.get("runtime", {})

    @property
    def module_path(self) -> Path:
        return self.root / self.manifest["kernels"]["module"]

    @property
    def weights_path(self) -> Path:
        return self.root / self.manifest["weights"]["file"]

    def tokenizer_metadata(self) -> dict[str, Any]:
        return json.loads((self.root / self.manifest["tokenizer"]).read_text(encoding="utf-8"))

    def weights(self, *, bfloat16: str = "uint16") -> dict[str, np.ndarray]:
        """name → array viewing a private (copy-on-write) map of weights.bin: nothing is read until used.

        The arrays are writable because DLPack (numpy → TVM) refuses read-only arrays; writes stay in this process.
        bfloat16 entries come as their raw uint16 bits (what TVM and DLPack accept), or as ml_dtypes.bfloat16 with
        `bfloat16="ml_dtypes"`.
        """
        if bfloat16 not in ("uint16", "ml_dtypes"):
            raise ValueError(f"artifact: bfloat16={bfloat16!r}; expected 'uint16' or 'ml_dtypes'")
        bf16 = DTYPES["bfloat16"]
        if bfloat16 == "ml_dtypes" and any(p.dtype == "bfloat16" for p in self.params):
            import ml_dtypes  # optional: only needed for this view

            bf16 = np.dtype(ml_dtypes.bfloat16)
        buf = self._weights_map()
        out = {}
        for p in self.params:
            dtype = bf16 if p.dtype == "bfloat16" else DTYPES[p.dtype]
            count = math.prod(p.shape)
            out[p.name] = np.frombuffer(buf, dtype=dtype, count=count, offset=p.offset).reshape(p.shape)
        return out

    def _weights_map(self) -> mmap.mmap | bytearray:
        if self._map is None:
            with open(self.weights_path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return bytearray()  # mmap cannot map an empty file; only zero-size params can point here
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if hasattr(mmap, "MADV_WILLNEED"):  # start reading the file ahead of the first kernels (not on Windows)
                self._map.madvise(mmap.MADV_WILLNEED)
        return self._map

    def close(self) -> None:
        """Drop this object's reference to the map; it is unmapped once no weight array views it any more."""
        self._map = None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_artifact(path: str | Path, *, expect_target: str | None = None, verify: bool = True,
                  cache_dir: Path | None = None) -> Artifact:
    """Open an artifact directory (or a packed .tar, unpacked into `cache_dir`) and check it before use.

    Refuses with ArtifactError: no manifest, another format, a newer format version, a missing file, a file whose
    sha256 differs from the manifest's (only with verify=True: one streaming pass over every file), another target
    than `expect_target`, a weights entry that runs past weights.bin.
    """
    root = Path(path)
    if root.is_file() and is_packed(root):
        root = open_packed(root, cache_dir=cache_dir)
    manifest = _read_manifest(root)
    _check_format(manifest, root)
    _check_target(manifest, root, expect_target)
    _check_files(manifest, root, verify)
    params = _parse_params(manifest, root)
    _warn_tvm_version(manifest)
    return Artifact(root, manifest, params)


def _read_manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not an artifact directory or packed artifact"
        raise ArtifactError(f"artifact: {root} {what}; pass the folder written by `luce-compile compile` "
                            f"(or a file written by `luce-compile pack`), or {recompile_hint()}.")
    file = root / MANIFEST
    if not file.is_file():
        raise ArtifactError(f"artifact: {root} has no {MANIFEST}, so it is not a luce-compile artifact (or it was "
                            f"only half copied); {recompile_hint()}.")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact: {file} is not valid JSON ({e}); {recompile_hint()}.") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"artifact: {file} holds a {type(manifest).__name__}, expected an object; "
                            f"{recompile_hint()}.")
    return manifest


def _check_format(manifest: dict[str, Any], root: Path) -> None:
    if manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"artifact: {root / MANIFEST} says format {manifest.get('format')!r}, expected "
                            f"{FORMAT_NAME!r}: this folder is not a luce-compile artifact; {recompile_hint()}.")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"artifact: {root}: format_version {version!r} is not a positive integer; the manifest "
                            f"is damaged; {recompile_hint()}.")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"artifact: {root} has format version {version}, newer than this runtime reads "
                            f"({FORMAT_VERSION}); upgrade luce-compile (`pip install -U luce-compile`).")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"artifact: {root} has format version {version}, older than this runtime reads "
                            f"({FORMAT_VERSION}); {recompile_hint()}.")
    missing = [k for k in ("config", "target", "kernels", "weights", "tokenizer", "files") if k not in manifest]
    if missing:
        raise ArtifactError(f"artifact: {root / MANIFEST} lacks {', '.join(missing)}; {recompile_hint()}.")


def _check_target(manifest: dict[str, Any], root: Path, expect: str | None) -> None:
    target = manifest["target"]
    name = target.get("name")
    if expect is not None and name != expect:
        raise ArtifactError(f"artifact: {root} was compiled for target {name!r}, not {expect!r}; "
                            f"{recompile_hint(expect)}.")
    if target.get("kind") != "llvm":
        return
    # CPU kernels are built for the compile host's CPU (LLVM -mcpu): elsewhere they may run slowly or hit SIGILL.
    here = host_cpu_facts()
    missing = sorted(set(target.get("cpu_flags", [])) - set(here.get("cpu_flags", [])))
    if missing:
        log.warning("artifact %s: compiled for a CPU with %s, which this CPU lacks: kernels may crash (SIGILL); %s",
                    root, " ".join(missing), recompile_hint(name or "cpu"))
    llvm_cpu = _llvm_host_cpu()
    if llvm_cpu is not None and target.get("host_cpu") not in (None, llvm_cpu):
        log.warning("artifact %s: compiled for CPU %s, this host is %s: kernels may be slower; %s",
                    root, target.get("host_cpu"), llvm_cpu, recompile_hint(name or "cpu"))
    elif llvm_cpu is None and target.get("cpu_model") not in (None, here.get("cpu_model")):
        log.warning("artifact %s: compiled on a %s, this host is a %s: kernels may be slower; %s",
                    root, target.get("cpu_model"), here.get("cpu_model"), recompile_hint(name or "cpu"))


def _check_files(manifest: dict[str, Any], root: Path, verify: bool) -> None:
    files: dict[str, str] = manifest["files"]
    needed = [manifest["kernels"].get("module"), manifest["weights"].get("file"), manifest["tokenizer"]]
    unlisted = [n for n in needed if n not in files]
    if unlisted:
        raise ArtifactError(f"artifact: {root / MANIFEST} lists no checksum for {', '.join(map(str, unlisted))}; "
                            f"the manifest is damaged; {recompile_hint()}.")
    for rel, digest in files.items():
        file = _inside(root, rel)
        if not file.is_file():
            raise ArtifactError(f"artifact: {root} is missing {rel} (listed in its manifest); copy the whole "
                                f"folder again or {recompile_hint()}.")
        if verify and file_sha256(file) != digest:
            raise ArtifactError(f"artifact: {file} does not match the sha256 in the manifest: it was changed or "
                                f"damaged after compiling; copy it again or {recompile_hint()}.")


def _inside(root: Path, rel: str) -> Path:
    """root/rel, refusing names that leave the folder (an edited manifest must not read arbitrary files)."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ArtifactError(f"artifact: {root / MANIFEST} names the file {rel!r}, which is outside the artifact; "
                            f"the manifest is damaged; {recompile_hint()}.")
    return root / rel


def _parse_params(manifest: dict[str, Any], root: Path) -> list[ParamInfo]:
    weights = manifest["weights"]
    if weights.get("layout") != WEIGHTS_LAYOUT:
        raise ArtifactError(f"artifact: {root}: weights layout {weights.get('layout')!r} is not {WEIGHTS_LAYOUT!r}, "
                            f"the only one this runtime reads; upgrade luce-compile or {recompile_hint()}.")
    path = _inside(root, weights["file"])
    size = path.stat().st_size
    params, seen = [], set()
    for entry in weights.get("params", []):
        try:
            p = ParamInfo(name=str(entry["name"]), shape=tuple(int(d) for d in entry["shape"]),
                          dtype=str(entry["dtype"]), offset=int(entry["offset"]), nbytes=int(entry["nbytes"]),
                          source_tensor=entry.get("source_tensor"), ggml_type=entry.get("ggml_type"),
                          plane=entry.get("plane"))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"artifact: {root}: weights entry {entry!r} is malformed ({e!r}); "
                                f"{recompile_hint()}.") from e
        _check_param(p, root, path, size, seen)
        seen.add(p.name)
        params.append(p)
    return params


def _check_param(p: ParamInfo, root: Path, path: Path, size: int, seen: set[str]) -> None:
    bad = None
    if p.name in seen:
        bad = "appears twice"
    elif p.dtype not in DTYPES:
        bad = f"has dtype {p.dtype!r}; known: {', '.join(DTYPES)}"
    elif any(d < 0 for d in p.shape) or p.nbytes != math.prod(p.shape) * DTYPES[p.dtype].itemsize:
        bad = f"has shape {p.shape} of {p.dtype} but nbytes {p.nbytes}"
    elif p.offset < 0 or p.offset % ALIGNMENT:
        bad = f"starts at offset {p.offset}, not a multiple of {ALIGNMENT}"
    if bad:
        raise ArtifactError(f"artifact: {root}: weight {p.name!r} {bad}; the manifest is damaged; {recompile_hint()}.")
    if p.offset + p.nbytes > size:
        raise ArtifactError(f"artifact: weight {p.name!r} ends at byte {p.offset + p.nbytes} but {path} has only "
                            f"{size} bytes: the file is truncated; copy it again or {recompile_hint()}.")


def _warn_tvm_version(manifest: dict[str, Any]) -> None:
    try:
        here = importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        # the luce-runtime wheel carries TVM's runtime files without apache-tvm's metadata; TVM is imported by then
        # (the engine loads it first). Not imported here: the import would pick the compiler library where it exists
        here = getattr(sys.modules.get("tvm"), "__version__", None)
    if here is None:
        return  # a TVM runtime built from source, or none loaded yet: nothing to compare with
    built = manifest.get("tvm_version")
    if built and built != here:
        log.warning("artifact: built with TVM %s, this runtime has TVM %s; if loading the module fails, "
                    "recompile with this TVM or install apache-tvm==%s", built, here, built)


def is_packed(path: str | Path) -> bool:
    """True for a single-file artifact: a tar whose first member is manifest.json."""
    path = Path(path)
    if not path.is_file() or not tarfile.is_tarfile(path):
        return False
    with tarfile.open(path, "r:") as tar:
        first = tar.next()
    return first is not None and first.name == MANIFEST


def _packed_manifest(file: Path) -> bytes:
    with tarfile.open(file, "r:") as tar:
        first = tar.next()
        if first is None or first.name != MANIFEST or not first.isfile():
            raise ArtifactError(f"artifact: {file} is not a packed artifact (its first member is not {MANIFEST}); "
                                f"pack one with `luce-compile pack ARTIFACT_DIR -o FILE.tar`.")
        extracted = tar.extractfile(first)
        assert extracted is not None  # isfile() was checked
        return extracted.read()


def unpack(file: str | Path, out_dir: str | Path) -> Path:
    """Extract a packed artifact into out_dir (which must not exist), atomically: all of it or nothing."""
    file, out_dir = Path(file), Path(out_dir)
    _packed_manifest(file)
    if out_dir.exists():
        raise ArtifactError(f"artifact: {out_dir} already exists; remove it or unpack somewhere else.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.unpack-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tarfile.open(file, "r:") as tar:
            for member in tar.getmembers():
                if not member.isfile():
                    raise ArtifactError(f"artifact: {file} holds {member.name!r}, which is not a regular file; "
                                        f"a packed artifact holds only files: pack it again.")
                _inside(tmp, member.name)
            tar.extractall(tmp, filter="data")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def open_packed(file: str | Path, cache_dir: Path | None = None) -> Path:
    """The folder a packed artifact is unpacked into (once): `cache_dir/<sha256 of its manifest>`.

    The manifest holds the sha256 of every other file, so its own hash names the whole content.
    """
    file = Path(file)
    base = cache_dir or Path(os.environ.get("LUCE_CACHE", Path.home() / ".cache" / "luce-compile")) / "artifacts"
    out = base / hashlib.sha256(_packed_manifest(file)).hexdigest()[:32]
    if (out / MANIFEST).is_file():
        log.info("artifact: %s already unpacked in %s", file, out)
        return out
    log.info("artifact: unpacking %s into %s", file, out)
    try:
        return unpack(file, out)
    except (ArtifactError, OSError):
        if (out / MANIFEST).is_file():  # another process unpacked the same artifact first
            return out
        raise
