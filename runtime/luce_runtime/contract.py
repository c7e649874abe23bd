"""The artifact's runtime contract: what the compiled module exports and how the engine must call it.

One typed, versioned description, written by the compiler (lower/relax_model.py declares the functions from it,
codegen/compile.py writes it into the manifest's "runtime" section) and read by the engine. It lives in the runtime
because the runtime never imports the compiler; the compiler imports it from here.

Bump CONTRACT_VERSION whenever a function's name, arguments or their order change: an engine refuses an artifact of
another contract version with a message that says to recompile, instead of calling a function with the wrong
arguments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from luce_runtime.errors import ArtifactError

CONTRACT_VERSION = 2  # 2: the cache's debug_get_kv is the runtime's KV_PAGES_PROBE (see there)

# The KV cache's `f_debug_get_kv` slot holds this global function, which the runtime registers before it loads a
# module (luce_runtime/kv_pages.py). TVM's PagedKVCache hands its page tensors out nowhere else: through it the
# runtime learns each layer's page tensor and a sequence's page ids, so the megakernel reads and writes the same
# pages as prefill and per-op decode (one KV pool for every path).
KV_PAGES_PROBE = "luce.kv_pages_probe"


class Fn(StrEnum):
    """The module's exported functions (Relax VM functions)."""

    CREATE_KV_CACHE = "create_kv_cache"  # KVCacheArgs → PagedKVCache
    PREFILL = "prefill"  # (tokens (1, S) int32, logit_rows (N,) int32, kv, params) → (logits (N, V) f32, kv)
    DECODE = "decode"  # (tokens (B, 1) int32, kv, params) → (logits (B, V) f32, kv)
    DECODE1 = "decode1"  # decode for B = 1 with static shapes (every matmul a GEMV)
    # optional: (tokens (1, S) int32, kv, params) → (logits (S, V) f32, kv): prefill's graph with logits for every
    # row and decode's 8-bit matmuls (int8 artifacts only; without it the engine verifies through prefill)
    VERIFY = "verify"


REQUIRED_FUNCTIONS: tuple[Fn, ...] = (Fn.CREATE_KV_CACHE, Fn.PREFILL, Fn.DECODE, Fn.DECODE1)
# exported where they apply; a runtime that does not know one ignores it, so adding one needs no version bump
OPTIONAL_FUNCTIONS: tuple[Fn, ...] = (Fn.VERIFY,)


@dataclass(frozen=True)
class KVCacheArgs:
    """create_kv_cache's arguments, in the order the function declares them (the field order IS the contract)."""

    max_batch_size: int  # sequences the cache holds at once
    max_total_seq_len: int  # tokens over all sequences: the page pool's size
    prefill_chunk_size: int  # tokens one forward may append, over all its sequences
    page_size: int  # tokens per KV page
    support_sliding_window: int  # 1 when any layer attends through a sliding window

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def values(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, name)) for name in self.names())


@dataclass(frozen=True)
class RuntimeContract:
    """The manifest's "runtime" section: contract version, exported functions, the engine's defaults."""

    contract_version: int = CONTRACT_VERSION
    functions: tuple[str, ...] = tuple(str(f) for f in REQUIRED_FUNCTIONS)
    kv_cache_args: tuple[str, ...] = KVCacheArgs.names()
    page_size: int = 16  # tokens per KV page (TVM's paged attention kernels are built for any; 16 is MLC's default)
    prefill_chunk: int = 512  # tokens per prefill call: longer prompts go in chunks
    kv_dtype: str = "float32"
    # the prefill kernels apply a sliding window to the keys already cached (luce_schedules' CPU kernels and TVM's
    # CUDA kernel do; TVM 0.27's CPU kernel is wrong there): a sliding-window sequence then prefills in chunks of up
    # to the window after its first, where it otherwise takes one token a call (Engine.chunk_limit). False for
    # artifacts built before.
    sliding_prefill_chunks: bool = False
    # the width of a head's row in the KV cache where it is not the config's head_dim (attention sinks ride in 16
    # more columns: luce_compile/lower/attention_sinks.py); 0: head_dim. Sizes the KV pool (kv_memory).
    kv_head_dim: int = 0

    def to_manifest(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], root: Path | str) -> RuntimeContract:
        """The artifact's contract, refused with a message saying what to do when this runtime cannot honour it."""
        section = manifest.get("runtime") or {}
        version = section.get("contract_version")
        hint = "recompile it with this luce-compile (`luce-compile compile MODEL --target T -o DIR --force`)"
        if version is None:
            raise ArtifactError(f"artifact: {root} has no runtime contract (built by an older luce-compile); {hint}.")
        if version != CONTRACT_VERSION:
            newer = "a newer" if int(version) > CONTRACT_VERSION else "an older"
            raise ArtifactError(f"artifact: {root} follows runtime contract {version}, from {newer} luce-compile; "
                                f"this runtime speaks contract {CONTRACT_VERSION}: {hint}, or run it with the "
                                "luce-compile that built it.")
        known = {f.name for f in fields(cls)}
        contract = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in section.items() if k in known})
        missing = [str(f) for f in REQUIRED_FUNCTIONS if str(f) not in contract.functions]
        if missing:
            raise ArtifactError(f"artifact: {root} lacks the functions {missing} this runtime calls; {hint}.")
        if contract.kv_cache_args != KVCacheArgs.names():
            raise ArtifactError(f"artifact: {root} declares create_kv_cache{contract.kv_cache_args}, this runtime "
                                f"calls create_kv_cache{KVCacheArgs.names()}; {hint}.")
        return contract
