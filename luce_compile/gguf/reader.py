"""Read a GGUF file: metadata as Python values, tensors as memory-mapped raw GGUF blocks.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. The layout is
  magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv × (key, type, value) |
  n_tensors × (name, u32 n_dims, n_dims × u64 ne, u32 type, u64 offset) | pad to alignment | tensor data.

Why not `gguf.GGUFReader`: it builds a numpy view per array element, which takes ~7 s on SmolLM2's 49k-token
vocabulary (and longer on Gemma's 262k), and it trusts the header counts. This parser reads the header once with
`struct`, checks every count against the bytes that remain before it loops or allocates, and maps the tensor data
without copying. Type codes, block sizes and key names still come from the `gguf` package.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from luce_compile.errors import GGUFError, UnsupportedError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# The tensor types the dequantizer and the kernels handle; anything else is refused before work starts.
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
                 "IQ4_NL", "IQ4_XS", "MXFP4")
)

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file. `shape` is numpy order (outermost first): ggml's ne reversed,
    so a weight applied as y = W @ x has shape (out_features, in_features)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def row_bytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return self.shape[-1] // block * block_bytes


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"GGUF {self.path}: {what} (at byte {self.pos}). The file is corrupt or truncated; "
                         "re-download it or re-export it with llama.cpp's convert script.")

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.remaining:
            raise self.fail(f"{what} needs {n} bytes but only {self.remaining} remain")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"length of {what}")
        start = self.take(n, what)
        # surrogateescape keeps any byte sequence (some vocabularies hold partial UTF-8) round-trippable.
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, key: str) -> Any:
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"metadata key {key!r} has unknown value type {vtype}") from None
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        return self.scalar(_SCALAR_FORMATS[vtype], f"value of {key!r}")

    def array(self, key: str) -> list[Any]:
        try:
            etype = GGUFValueType(self.scalar("<I", f"array type of {key!r}"))
        except ValueError as e:
            raise self.fail(f"metadata array {key!r} has an unknown element type: {e}") from None
        if etype == GGUFValueType.ARRAY:  # llama.cpp's gguf.cpp refuses them too; nesting would recurse unbounded
            raise self.fail(f"metadata array {key!r} holds arrays, which GGUF readers do not accept")
        count = self.scalar("<Q", f"array length of {key!r}")
        min_size = 8 if etype == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[etype])
        if count * min_size > self.remaining:
            raise self.fail(f"metadata array {key!r} claims {count} elements, more than the file can hold")
        if etype in _NUMPY_DTYPES:  # numeric arrays in one read, not one struct call per element
            start = self.take(count * min_size, f"array {key!r}")
            return np.frombuffer(self.buf, dtype=_NUMPY_DTYPES[etype], count=count, offset=start).tolist()
        return [self.string(f"element of {key!r}") for _ in range(count)]


class GGUFFile:
    """A parsed GGUF file. Metadata are plain Python values; tensors stay in the file, memory-mapped."""

    def __init__(self, path: Path, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 data: mmap.mmap):
        self.path, self.version, self.metadata, self.tensors = path, version, metadata, tensors
        self._data = data

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view, shape (*outer, row_bytes): raw GGUF blocks."""
        info = self.tensor(name)
        view = np.frombuffer(self._data, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return view.reshape(*info.shape[:-1], info.row_bytes)

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"GGUF {self.path}: tensor {name!r} is missing; the file does not match its "
                            f"architecture {self.arch!r}.")
        return self.tensors[name]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its numpy shape (used by the oracle and tests, one tensor at a time)."""
        from luce_compile.gguf.quants import dequantize

        info = self.tensor(name)
        return dequantize(self.raw(name), info.ggml_type).reshape(info.shape)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        self._data.close()


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate a GGUF file's header; map its tensor data. Raises GGUFError on any inconsistency,
    UnsupportedError for a valid file with a tensor type luce-compile cannot read."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF {path}: no such file. Pass the path of a .gguf model (see `luce-compile models`).")
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise GGUFError(f"GGUF {path}: the file is empty.")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, data)
    except BaseException:
        with contextlib.suppress(BufferError):  # a refused file is not left mapped (unless a view still holds it)
            data.close()
        raise


def _parse(path: Path, data: mmap.mmap) -> GGUFFile:
    cur = _Cursor(data, path)
    magic = bytes(data[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"GGUF {path}: bad magic {magic!r}, expected {GGUF_MAGIC!r}. This is not a GGUF file.")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"GGUF {path}: version {version} is not supported (expected one of {SUPPORTED_VERSIONS}); "
                        "re-export the model with a current llama.cpp.")
    n_tensors = cur.scalar("<Q", "tensor count")
    n_kv = cur.scalar("<Q", "metadata count")
    # A key needs ≥ 12 bytes (u64 length + u32 type), a tensor info ≥ 24: refuse absurd counts before looping.
    if n_kv * 12 > cur.remaining or n_tensors * 24 > cur.remaining:
        raise cur.fail(f"header claims {n_tensors} tensors and {n_kv} metadata keys, more than the file can hold")
    metadata = _read_metadata(cur, n_kv)
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment = {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(infos, data_start, len(data), alignment, cur)
    return GGUFFile(path, version, metadata, tensors, data)


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.scalar("<I", f"type of {key!r}"), key)
    return metadata


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("tensor name")
    n_dims = cur.scalar("<I", f"dimension count of {name!r}")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, expected 1..{GGML_MAX_DIMS}")
    ne = [cur.scalar("<Q", f"dimensions of {name!r}") for _ in range(n_dims)]
    type_code = cur.scalar("<I", f"type of {name!r}")
    offset = cur.scalar("<Q", f"offset of {name!r}")
    return name, tuple(reversed(ne)), type_code, offset


def _place_tensors(infos: list, data_start: int, file_size: int, alignment: int, cur: _Cursor) -> dict:
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_code, offset in infos:
        try:
            ggml_type = GGMLQuantizationType(type_code)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {type_code}") from None
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedError(
                f"GGUF {cur.path}: tensor {name!r} is {ggml_type.name}, which luce-compile does not read yet "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}). Re-quantize the model to one "
                "of those with llama-quantize.")
        if any(d <= 0 for d in shape):
            raise cur.fail(f"tensor {name!r} has an empty or negative dimension {shape}")
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block:
            raise cur.fail(f"tensor {name!r} ({ggml_type.name}) has rows of {shape[-1]} elements, "
                           f"not a multiple of the block size {block}")
        n_elements = int(np.prod(shape, dtype=object))
        nbytes = n_elements // block * block_bytes
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        if data_start + offset + nbytes > file_size:
            raise cur.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end of the "
                           f"file ({file_size} bytes)")
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, ggml_type, shape, data_start + offset, nbytes)
    return tensors
