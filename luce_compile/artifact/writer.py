"""Write a compiled artifact: the directory format that luce_runtime.artifact reads (its docstring describes it).

Everything is written into a hidden sibling directory and renamed into place at the end, so a failed or interrupted
compile never leaves a half-written artifact where the runtime would look. Weights stream one array at a time to
weights.bin (each at a 64-byte aligned offset) and are hashed while they are written, so they are neither held
twice in memory nor read back.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from luce_runtime.artifact import (
    ALIGNMENT,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    WEIGHTS_LAYOUT,
    file_sha256,
    host_cpu_facts,
    load_artifact,
    unpack,
)

from luce_compile import __version__
from luce_compile.errors import ArtifactError

__all__ = ["check_destination", "describe_source", "is_artifact", "move_into_place", "pack", "tokenizer_metadata_from",
           "unpack", "write_artifact"]

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.bin"
TOKENIZER_FILE = "tokenizer.json"
TARGET_KINDS = ("llvm", "cuda", "rocm")
# Filled in by the writer; a caller that passes one of these has a bug.
_WRITER_KEYS = ("format", "format_version", "weights", "tokenizer", "files")
_PARAM_KEYS = ("name", "shape", "dtype", "offset", "nbytes", "source_tensor", "ggml_type", "plane")

WeightItem = tuple[str, np.ndarray, Mapping[str, Any]]


def write_artifact(
    out_dir: str | Path,
    *,
    manifest_fields: Mapping[str, Any],
    weights: Iterable[WeightItem],
    tokenizer_metadata: Mapping[str, Any],
    module_path: str | Path | None = None,
    export_fn: Callable[[Path], None] | None = None,
    module_name: str = "model.so",
    extra_files: Mapping[str, str | Path] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an artifact directory atomically and return its path.

    manifest_fields: "source" (see `describe_source`), "config" (ModelConfig.to_dict()), "target" ({"name",
      "kind": llvm|cuda|rocm, "tvm_target": dict, "host_cpu" for llvm}), optional "kernels" ({"functions",
      "schedules"}), "runtime" (free-form defaults), "tvm_version", "created". The writer adds the rest.
    weights: (name, array, meta) in the order they should lie in weights.bin; meta may carry "source_tensor",
      "ggml_type", "plane", "dtype" (e.g. "bfloat16" for a uint16 array of raw bits) and free-form extra keys.
    module_path / export_fn: exactly one: a compiled module to copy, or a callback that writes it to the path it
      is given (e.g. `lambda p: executable.export_library(str(p))`); any other files it writes there are kept.
    extra_files: more files to copy in, relative name → source path (all hashed into the manifest).
    """
    out_dir = Path(out_dir)
    _check_fields(manifest_fields)
    if (module_path is None) == (export_fn is None):
        raise ArtifactError("artifact writer: pass exactly one of module_path and export_fn.")
    check_destination(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        params, weights_sha = _write_weights(tmp / WEIGHTS_FILE, weights)
        _write_json(tmp / TOKENIZER_FILE, dict(tokenizer_metadata))
        _place_module(tmp / module_name, module_path, export_fn)
        for rel, src in (extra_files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
        files = {rel: (weights_sha if rel == WEIGHTS_FILE else file_sha256(tmp / rel)) for rel in _tree(tmp)}
        _write_json(tmp / MANIFEST, _manifest(manifest_fields, params, files, module_name))
        _fsync_tree(tmp)
        move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("artifact: wrote %s (%d weights, %.1f MB)", out_dir, len(params),
             (out_dir / WEIGHTS_FILE).stat().st_size / 1e6)
    return out_dir


def describe_source(gguf_path: str | Path) -> dict[str, Any]:
    """The manifest's "source" entry for a GGUF file (one streaming sha256 pass)."""
    path = Path(gguf_path)
    return {"file_name": path.name, "gguf_sha256": file_sha256(path), "size": path.stat().st_size}


def tokenizer_metadata_from(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF metadata keys that tokenizer.json carries: every `tokenizer.*` key (chat template included)."""
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def _check_fields(fields: Mapping[str, Any]) -> None:
    owned = [k for k in _WRITER_KEYS if k in fields]
    if owned:
        raise ArtifactError(f"artifact writer: manifest_fields must not set {', '.join(owned)}: the writer fills "
                            f"them in from what it writes.")
    source, target = fields.get("source"), fields.get("target")
    problems = []
    if not isinstance(source, Mapping) or not {"file_name", "gguf_sha256", "size"} <= source.keys():
        problems.append("source needs file_name, gguf_sha256, size (use describe_source(gguf_path))")
    if not isinstance(fields.get("config"), Mapping):
        problems.append("config must be a dict (ModelConfig.to_dict())")
    if not isinstance(target, Mapping) or not {"name", "kind", "tvm_target"} <= target.keys():
        problems.append("target needs name, kind, tvm_target")
    elif target["kind"] not in TARGET_KINDS:
        problems.append(f"target kind {target['kind']!r} is not one of {', '.join(TARGET_KINDS)}")
    if problems:
        raise ArtifactError("artifact writer: bad manifest_fields: " + "; ".join(problems) + ".")


def is_artifact(path: Path) -> bool:
    """A directory whose manifest.json says format "luce-artifact": something this project wrote (so it may replace
    it). Presence of a manifest.json alone is not enough: many tools write a file of that name."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME


def check_destination(out_dir: Path, overwrite: bool) -> None:
    """Refuse a destination that would lose data: anything that is not an artifact, always; an artifact unless
    `overwrite` (the CLI's --force). The one guard for every writer of artifacts (this module, codegen's copies)."""
    out_dir = Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return  # an empty folder (made ahead, e.g. by a job runner) is replaced as if absent
    if not out_dir.is_dir() or out_dir.is_symlink() or not is_artifact(out_dir):
        raise ArtifactError(f"artifact: {out_dir} exists and is not an artifact; refusing to replace it (that would "
                            f"delete what is in it, --force or not). Choose another -o, or move it away first.")
    if not overwrite:
        raise ArtifactError(f"artifact: {out_dir} already exists (an artifact); pass --force to replace it, or "
                            f"choose another -o.")


def _as_bytes(name: str, array: np.ndarray, meta: Mapping[str, Any]) -> tuple[str, np.ndarray]:
    """The manifest dtype name and a flat little-endian uint8 view of the array (a copy only if strided)."""
    array = np.asarray(array)
    dtype = str(meta.get("dtype", array.dtype.name))
    if dtype not in DTYPES or DTYPES[dtype].itemsize != array.dtype.itemsize:
        raise ArtifactError(f"artifact writer: weight {name!r} has dtype {array.dtype} (meta dtype {dtype!r}); "
                            f"expected one of {', '.join(DTYPES)} with a matching item size.")
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder != "little"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return dtype, np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _write_weights(path: Path, weights: Iterable[WeightItem]) -> tuple[list[dict[str, Any]], str]:
    h, params, offset, names = hashlib.sha256(), [], 0, set()
    with open(path, "wb") as f:
        for name, array, meta in weights:
            if name in names:
                raise ArtifactError(f"artifact writer: weight {name!r} is given twice.")
            names.add(name)
            dtype, data = _as_bytes(name, array, meta)
            pad = bytes(-offset % ALIGNMENT)
            f.write(pad)
            h.update(pad)
            offset += len(pad)
            f.write(data)
            h.update(data)
            params.append(_param_entry(name, np.shape(array), dtype, offset, data.nbytes, meta))
            offset += data.nbytes
    return params, h.hexdigest()


def _param_entry(name: str, shape: tuple[int, ...], dtype: str, offset: int, nbytes: int,
                 meta: Mapping[str, Any]) -> dict[str, Any]:
    ggml_type = meta.get("ggml_type")
    entry = {"name": name, "shape": [int(d) for d in shape], "dtype": dtype, "offset": offset, "nbytes": nbytes,
             "source_tensor": meta.get("source_tensor"),
             # a gguf.GGMLQuantizationType is stored by its spec name (Q4_K), not its number
             "ggml_type": ggml_type.name if isinstance(ggml_type, enum.Enum) else ggml_type,
             "plane": meta.get("plane")}
    entry.update({k: v for k, v in meta.items() if k not in _PARAM_KEYS})
    return entry


def _place_module(dest: Path, module_path: str | Path | None, export_fn: Callable[[Path], None] | None) -> None:
    if export_fn is not None:
        export_fn(dest)
        if not dest.is_file():
            raise ArtifactError(f"artifact writer: export_fn did not write the module file {dest.name}.")
    else:
        shutil.copyfile(module_path, dest)


def _tree(root: Path) -> list[str]:
    """Every regular file under root except the manifest, as sorted POSIX relative paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1, ensure_ascii=False, default=_json_default)
    except TypeError as e:
        raise ArtifactError(f"artifact writer: {path.name}: {e}; pass plain Python values.") from e
    path.write_text(text + "\n", encoding="utf-8")


def _tvm_version() -> str:
    if "tvm" in sys.modules:
        return str(sys.modules["tvm"].__version__)
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _manifest(fields: Mapping[str, Any], params: list[dict[str, Any]], files: dict[str, str],
              module_name: str) -> dict[str, Any]:
    target = dict(fields["target"])
    if target["kind"] == "llvm":
        # CPU kernels are built for this host's CPU: record what the runtime compares against.
        target.setdefault("host_cpu", target["tvm_target"].get("mcpu"))
        for key, value in host_cpu_facts().items():
            target.setdefault(key, value)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "luce_compile_version": fields.get("luce_compile_version", __version__),
        "tvm_version": fields.get("tvm_version") or _tvm_version(),
        "created": fields.get("created", created),
        "source": fields["source"], "config": fields["config"], "target": target,
        "kernels": {"functions": [], "schedules": {}, **fields.get("kernels", {}), "module": module_name},
        "weights": {"file": WEIGHTS_FILE, "layout": WEIGHTS_LAYOUT, "alignment": ALIGNMENT, "params": params},
        "runtime": dict(fields.get("runtime", {})),
        "tokenizer": TOKENIZER_FILE,
    }
    manifest.update({k: v for k, v in fields.items() if k not in manifest})
    manifest["files"] = files
    return manifest


def _fsync_tree(root: Path) -> None:
    """Flush every file (and the folder entries) so the rename below never publishes data still in the page cache."""
    for p in [*root.rglob("*"), root]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def move_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Publish the finished folder `tmp` (a sibling of out_dir) as out_dir. The guard runs again here: a compile
    takes minutes, and the destination may have changed meanwhile."""
    check_destination(out_dir, overwrite)
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    # Replacing: move the old one aside first (rename(2) cannot replace a non-empty directory), and back if the
    # second rename fails, so out_dir is never left missing. Only the old artifact (checked above) is deleted.
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old / out_dir.name)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old / out_dir.name, out_dir)
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def pack(art_dir: str | Path, out_file: str | Path) -> Path:
    """One uncompressed tar of a verified artifact, manifest first, written atomically. `unpack` reverses it.

    Uncompressed: the weights are quantized and barely compress, and a plain tar extracts at disk speed.
    """
    art = load_artifact(art_dir, verify=True)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_file.name}.partial-", dir=out_file.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp_name, "w", format=tarfile.PAX_FORMAT) as tar:
            for rel in [MANIFEST, *art.manifest["files"]]:
                _add_file(tar, art.root / rel, rel)
        os.replace(tmp_name, out_file)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out_file


def _add_file(tar: tarfile.TarFile, path: Path, rel: str) -> None:
    # Fixed owner, mode and time: the same artifact always packs to the same bytes.
    info = tarfile.TarInfo(rel)
    info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
    with open(path, "rb") as f:
        tar.addfile(info, f)
