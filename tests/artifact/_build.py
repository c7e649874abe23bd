"""Builds small artifacts for the writer and loader tests: random weights of every stored dtype, a real-shaped
config, tokenizer keys, and a module file (the format treats the module as opaque bytes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType

from luce_compile.artifact.writer import write_artifact
from luce_compile.gguf.config import ModelConfig

CPU_TARGET = {"name": "cpu", "kind": "llvm", "tvm_target": {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}}

CONFIG = ModelConfig(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, head_dim_v=16, n_ff=128,
                     n_vocab=96, n_ctx_train=2048, rms_eps=1e-5, rope_base=10000.0, rope_dim=16, rope_layout="norm",
                     sliding=(False, False))

TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<s>", "a", "b", "ab", "é"],
             "tokenizer.ggml.token_type": [3, 1, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
             "tokenizer.ggml.bos_token_id": 0, "tokenizer.chat_template": "{{ messages[0]['content'] }}"}


def sample_weights(seed: int = 0) -> list[tuple[str, np.ndarray, dict[str, Any]]]:
    """One entry per kind of array the compiler stores, with sizes that force padding between them."""
    rng = np.random.default_rng(seed)
    q4_0 = rng.integers(0, 256, size=(3, 2 * 18), dtype=np.uint8)  # 3 rows of two Q4_0 blocks (18 bytes each)
    bf16 = rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)
    return [
        ("token_embd.qs", q4_0, {"source_tensor": "token_embd.weight", "ggml_type": GGMLQuantizationType.Q4_0,
                                 "plane": "blocks"}),
        ("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32), {"source_tensor":
                                                                               "blk.0.attn_norm.weight"}),
        ("blk.0.ffn_up.scales", rng.standard_normal((7, 3)).astype(np.float16), {"plane": "scales", "group": 32}),
        ("bf16.native", bf16, {}),
        ("bf16.bits", bf16.view(np.uint16), {"dtype": "bfloat16"}),
        ("int8.codes", rng.integers(-128, 128, size=(5, 3), dtype=np.int8), {}),
        ("int32.perm", rng.permutation(13).astype(np.int32), {}),
        ("scalar", np.array(rng.standard_normal(), dtype=np.float32), {}),
        ("empty", np.zeros((0, 4), np.float32), {}),
    ]


def manifest_fields(target: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "source": {"file_name": "tiny.gguf", "gguf_sha256": "ab" * 32, "size": 12345},
        "config": CONFIG.to_dict(),
        "target": target or CPU_TARGET,
        "kernels": {"functions": ["prefill", "decode"], "schedules": {"gemv": "dlight.cpu.GEMV"}},
        "runtime": {"page_size": 16, "max_context": 2048},
    }


def module_file(tmp_path: Path) -> Path:
    path = tmp_path / "built.so"
    path.write_bytes(b"\x7fELF" + np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    return path


def make_artifact(tmp_path: Path, name: str = "art", **kwargs: Any) -> Path:
    kwargs.setdefault("manifest_fields", manifest_fields())
    kwargs.setdefault("weights", sample_weights())
    kwargs.setdefault("tokenizer_metadata", TOKENIZER)
    if "export_fn" not in kwargs:
        kwargs.setdefault("module_path", module_file(tmp_path))
    return write_artifact(tmp_path / name, **kwargs)
