"""read_gguf on valid, truncated, corrupt and hostile files: every bad file must raise GGUFError (or
UnsupportedError for a valid file we do not handle), quickly and without allocating what the header claims.

The files are built byte by byte here (`gguf_bytes`), so each test states exactly what is wrong with its file.
"""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.config import model_config
from luce_compile.gguf.reader import GGUFFile, read_gguf

pytestmark = pytest.mark.unit
T, V = GGMLQuantizationType, GGUFValueType


# ------------------------------------------------------------------------------------------ a GGUF builder

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: GGUFValueType, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_str(key: str, value: str) -> bytes:
    return kv(key, V.STRING, gstr(value))


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, V.UINT32, struct.pack("<I", value))


def kv_array(key: str, etype: GGUFValueType, count: int, payload: bytes) -> bytes:
    return kv(key, V.ARRAY, struct.pack("<IQ", etype, count) + payload)


def tensor_info(name: str, ne: list[int], ggml_type: int, offset: int) -> bytes:
    """ne is ggml order: innermost dimension first."""
    return gstr(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)


def gguf_bytes(kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, version: int = 3,
               n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


DATA_A = np.arange(32, dtype=np.float32).tobytes()  # tensor "a": F32, numpy shape (4, 8), 128 bytes
DATA_B = bytes(np.random.default_rng(0).integers(0, 127, 68, dtype=np.uint8))  # "b": Q8_0 (2, 32), 2 blocks


def small_kvs() -> list[bytes]:
    return [kv_str("general.architecture", "llama"), kv("x.float", V.FLOAT32, struct.pack("<f", 0.5)),
            kv_array("x.ints", V.INT32, 3, struct.pack("<3i", -1, 0, 7)),
            kv_array("x.strs", V.STRING, 2, gstr("héllo") + gstr(b"\xff\xfe")), kv("x.flag", V.BOOL, b"\x01")]


def small_infos(offset_b: int = 128) -> list[bytes]:
    return [tensor_info("a", [8, 4], T.F32, 0), tensor_info("b", [32, 2], T.Q8_0, offset_b)]


def small_gguf() -> bytes:
    return gguf_bytes(small_kvs(), small_infos(), DATA_A + DATA_B)


def header_size() -> int:
    """Where the tensor data of small_gguf() starts (the header padded to the alignment)."""
    return len(gguf_bytes(small_kvs(), small_infos()))


@pytest.fixture
def write(tmp_path):
    counter = iter(range(10**6))

    def _write(content: bytes) -> Path:
        path = tmp_path / f"f{next(counter)}.gguf"
        path.write_bytes(content)
        return path

    return _write


def _refused(path: Path, match: str, error: type[Exception] = GGUFError) -> None:
    with pytest.raises(error, match=match) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


# ------------------------------------------------------------------------------------------------ valid

def test_small_file_reads_back(write):
    gguf = read_gguf(write(small_gguf()))
    assert isinstance(gguf, GGUFFile) and gguf.version == 3 and gguf.arch == "llama"
    assert gguf.metadata["x.float"] == 0.5 and gguf.metadata["x.ints"] == [-1, 0, 7]
    assert gguf.metadata["x.strs"][0] == "héllo" and gguf.metadata["x.flag"] is True
    # partial UTF-8 survives as surrogate escapes, so the bytes can be recovered
    assert gguf.metadata["x.strs"][1].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert gguf.tensors["a"].shape == (4, 8) and gguf.tensors["b"].shape == (2, 32)
    assert np.array_equal(gguf.dequantize("a"), np.arange(32, dtype=np.float32).reshape(4, 8))
    assert gguf.raw("b").shape == (2, 34) and bytes(gguf.raw("b")) == DATA_B
    q = np.frombuffer(DATA_B, dtype=np.uint8).reshape(2, 34)
    expected = q[:, 2:].view(np.int8) * q[:, :2].copy().view(np.float16).astype(np.float32)
    assert np.array_equal(gguf.dequantize("b"), expected)


def test_version_2_is_read(write):
    assert read_gguf(write(gguf_bytes(small_kvs(), small_infos(), DATA_A + DATA_B, version=2))).version == 2


# ------------------------------------------------------------------------------------------------ truncated

def test_every_truncation_is_refused(write):
    """Every prefix of the header, every 8th byte of the data, and one byte short of the end."""
    full = small_gguf()
    lengths = [*range(0, header_size() + 1), *range(header_size() + 1, len(full), 8), len(full) - 1]
    for n in lengths:
        with pytest.raises(GGUFError) as info:
            read_gguf(write(full[:n]))
        reasons = ("empty", "magic", "remain", "can hold", "past the end")
        assert any(w in str(info.value) for w in reasons), (n, info.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")


# ------------------------------------------------------------------------------------------------ header

@pytest.mark.parametrize("magic", [b"GGUX", b"FUGG", b"PK\x03\x04", b"\0\0\0\0"])
def test_wrong_magic(write, magic):
    _refused(write(magic + small_gguf()[4:]), "bad magic")


@pytest.mark.parametrize("version", [0, 1, 4, 99, 2**32 - 1])
def test_unsupported_version(write, version):
    _refused(write(gguf_bytes(small_kvs(), small_infos(), DATA_A + DATA_B, version=version)),
             f"version {version} is not supported")


@pytest.mark.parametrize("field", ["n_tensors", "n_kv"])
@pytest.mark.parametrize("count", [2**40, 2**63, 2**64 - 1])
def test_absurd_counts_refused_before_allocating(write, field, count):
    path = write(gguf_bytes(small_kvs(), small_infos(), DATA_A + DATA_B, **{field: count}))
    start = time.perf_counter()
    _refused(path, "more than the file can hold")
    assert time.perf_counter() - start < 0.5


def test_string_length_2_62(write):
    key = struct.pack("<Q", 2**62) + b"general.architecture"
    _refused(write(gguf_bytes([key + struct.pack("<I", V.UINT32) + b"\0" * 4], [])), "metadata key needs")
    value = kv("general.name", V.STRING, struct.pack("<Q", 2**62) + b"abc")
    _refused(write(gguf_bytes([value], [])), "value of 'general.name' needs")


@pytest.mark.parametrize("etype", [V.UINT8, V.INT32, V.FLOAT64, V.STRING])
def test_array_count_2_50(write, etype):
    start = time.perf_counter()
    _refused(write(gguf_bytes([kv_array("x.big", etype, 2**50, b"\0" * 64)], [])), "claims 1125899906842624")
    assert time.perf_counter() - start < 0.5


def test_nested_arrays_and_unknown_value_types(write):
    nested = kv_array("x.nested", V.ARRAY, 1, struct.pack("<IQ", V.UINT8, 1) + b"\x07")
    _refused(write(gguf_bytes([nested], [])), "holds arrays")
    _refused(write(gguf_bytes([kv("x.odd", 13, b"\0" * 8)], [])), "unknown value type 13")
    _refused(write(gguf_bytes([kv_array("x.odd", 77, 1, b"\0" * 8)], [])), "unknown element type")


def test_duplicate_key_and_tensor(write):
    _refused(write(gguf_bytes([kv_u32("x.a", 1), kv_u32("x.a", 2)], [])), "'x.a' appears twice")
    infos = [tensor_info("a", [8], T.F32, 0), tensor_info("a", [8], T.F32, 32)]
    _refused(write(gguf_bytes([], infos, b"\0" * 64)), "'a' appears twice")


@pytest.mark.parametrize("alignment", [0, 24, 3])
def test_bad_alignment(write, alignment):
    _refused(write(gguf_bytes([kv_u32("general.alignment", alignment)], small_infos(), DATA_A + DATA_B)),
             "not a power of two")


def test_custom_alignment_is_honoured(write):
    kvs = [kv_u32("general.alignment", 64)]
    gguf = read_gguf(write(gguf_bytes(kvs, [tensor_info("a", [8, 4], T.F32, 0)], DATA_A, alignment=64)))
    assert gguf.tensors["a"].offset % 64 == 0
    assert np.array_equal(gguf.dequantize("a").ravel(), np.arange(32, dtype=np.float32))


# ------------------------------------------------------------------------------------------------ tensors

def test_unaligned_offset(write):
    _refused(write(gguf_bytes(small_kvs(), small_infos(offset_b=130), DATA_A + DATA_B + b"\0" * 2)),
             "'b' offset 130 is not aligned to 32")


def test_tensor_past_eof(write):
    _refused(write(gguf_bytes(small_kvs(), small_infos(offset_b=2**20), DATA_A + DATA_B)), "'b'.*past the end")
    huge = [tensor_info("big", [2**31, 2**31], T.F32, 0)]
    _refused(write(gguf_bytes([], huge, b"\0" * 64)), "'big'.*past the end")


@pytest.mark.parametrize("ne", [[], [1, 1, 1, 1, 1]])
def test_bad_dimension_count(write, ne):
    _refused(write(gguf_bytes([], [tensor_info("t", ne, T.F32, 0)], b"\0" * 32)), "dimensions, expected 1..4")


def test_zero_dimension_and_partial_block(write):
    _refused(write(gguf_bytes([], [tensor_info("t", [8, 0], T.F32, 0)], b"\0" * 32)), "empty or negative")
    _refused(write(gguf_bytes([], [tensor_info("t", [20], T.Q8_0, 0)], b"\0" * 64)), "not a multiple of the block")


def test_unknown_ggml_type_code(write):
    _refused(write(gguf_bytes([], [tensor_info("t", [32], 99, 0)], b"\0" * 64)), "unknown ggml type 99")


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ3_S, T.TQ1_0, T.I32])
def test_unsupported_quant_type_names_it(write, ggml_type):
    infos = [tensor_info("blk.0.ffn_down.weight", [256, 2], ggml_type, 0)]
    path = write(gguf_bytes(small_kvs(), infos, b"\0" * 4096))
    with pytest.raises(UnsupportedError, match=f"'blk.0.ffn_down.weight' is {ggml_type.name}"):
        read_gguf(path)


def test_unknown_architecture_names_it(write):
    kvs = [kv_str("general.architecture", "mamba"), kv_u32("mamba.block_count", 2)]
    gguf = read_gguf(write(gguf_bytes(kvs, [tensor_info("token_embd.weight", [8, 4], T.F32, 0)], DATA_A)))
    with pytest.raises(UnsupportedError, match="architecture 'mamba' is not supported"):
        model_config(gguf)


def test_tensor_lookup_errors_name_the_tensor(write):
    gguf = read_gguf(write(small_gguf()))
    with pytest.raises(GGUFError, match="tensor 'nope' is missing"):
        gguf.raw("nope")


# ------------------------------------------------------------------------------------------------ fuzz

_VALID = small_gguf()
_HEADER = header_size()


@settings(max_examples=400, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, _HEADER - 1), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, len(_VALID))))
def test_fuzzed_header_never_escapes(edits, cut):
    """Random byte overwrites in the header (and sometimes a truncation) either parse or raise our errors."""
    content = bytearray(_VALID)
    for pos, byte in edits:
        content[pos] = byte
    content = content[:cut] if cut is not None else content
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(content)
        f.flush()
        try:
            gguf = read_gguf(f.name)
        except (GGUFError, UnsupportedError):
            return
        # whatever parsed is self-consistent: every tensor lies inside the file
        for info in gguf:
            assert info.offset + info.nbytes <= len(content)
            assert gguf.raw(info.name).nbytes == info.nbytes
