"""The engine: a compiled artifact on a device, its paged KV cache, and the three steps everything else is built on.

  prefill(seq_ids, token lists) → logits of each sequence's last token   (chunked; several sequences at once)
  decode(seq_ids, one token each) → logits (B, V)                          (continuous batching uses this)
  generate(prompt ids, ...) → streamed tokens                               (sampler, stop ids, stop strings)

Only the TVM runtime is imported (`TVM_USE_RUNTIME_LIB=1` is set before `import tvm` unless tvm is already
loaded): the compiler's library is never mapped, which a test checks. The VM functions and the KV-cache builtins
are TVM's own (Relax VM, TIRPagedKVCache); their signatures are the artifact's contract (lower/relax_model.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if "tvm" not in sys.modules:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

import tvm  # noqa: E402  (after the environment switch above)
import tvm_ffi  # noqa: E402
from tvm.runtime import vm as tvm_vm  # noqa: E402

from luce_runtime.artifact import Artifact, load_artifact  # noqa: E402
from luce_runtime.errors import ArtifactError, LuceError  # noqa: E402
from luce_runtime.sampler import Sampler, SamplingParams  # noqa: E402
from luce_runtime.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

log = logging.getLogger(__name__)


class EngineError(LuceError, ValueError):
    """A request the engine cannot serve as asked (too long, bad sequence id, n ≤ 0)."""


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 8  # sequences in flight at once (decode batch)
    max_context: int = 0  # tokens per sequence; 0 → the model's training context, capped at 4096
    prefill_chunk: int = 512  # prompt tokens per prefill call: longer prompts go in chunks
    page_size: int = 16  # tokens per KV page


def kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """KV-cache bytes one token takes over all layers: keys and values of every KV head (float32 cache)."""
    return 2 * int(config["n_layer"]) * int(config["n_head_kv"]) * int(config["head_dim"]) * dtype_bytes


def available_memory(kind: str) -> int:
    """Bytes free for the KV pool: MemAvailable on the host; a GPU's total global memory (weights are small next
    to it at the sizes served here; the fraction the caller takes leaves room for them)."""
    if kind == "llvm":
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise LuceError("engine: /proc/meminfo has no MemAvailable; pass --max-batch explicitly.")
    load_device_api(kind)
    return int(tvm.device(kind, 0).total_global_memory)


def max_batch_for_memory(config: dict, kind: str, max_context: int, fraction: float = 0.25) -> int:
    """How many sequences of max_context tokens the KV pool can hold in `fraction` of the available memory.
    Every live sequence is given its full context of pages up front, so admission can never run out of pages."""
    per_seq = kv_bytes_per_token(config) * max_context
    return max(1, min(256, int(available_memory(kind) * fraction) // per_seq))


def load_device_api(kind: str) -> bool:
    """Register a GPU device API with the runtime-only TVM (its CUDA part is a separate library, loaded on demand).

    libtvm_runtime.so goes in first with RTLD_GLOBAL: kernels with parallel loops or workspaces segfault without it
    (tvm-0.27 notes). Returns whether the device API is available afterwards."""
    if kind == "llvm" or tvm.runtime.enabled(kind):
        return True
    lib = Path(tvm.__file__).parent / "lib"
    try:
        ctypes.CDLL(str(lib / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib / f"libtvm_runtime_{kind}.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        log.info("no %s device API: %s", kind, e)
    return tvm.runtime.enabled(kind)


def _kv_builtin(name: str):
    return tvm_ffi.get_global_func(f"vm.builtin.{name}")


class Engine:
    """One artifact loaded on one device."""

    def __init__(self, artifact: str | Path | Artifact, options: EngineOptions = EngineOptions(),
                 *, verify: bool = True):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact, verify=verify)
        manifest = self.artifact.manifest
        self.config = self.artifact.config
        kind = manifest["target"]["kind"]
        if not load_device_api(kind):
            raise ArtifactError(f"engine: {self.artifact.root} was compiled for {manifest['target']['name']} "
                                f"({kind}), which this TVM runtime cannot drive here; run it on that GPU, or "
                                "recompile for this machine with `luce-compile compile MODEL --target cpu`.")
        missing = {"create_kv_cache", "prefill", "decode", "decode1"} - set(manifest["kernels"].get("functions", ()))
        if missing:
            raise ArtifactError(f"engine: {self.artifact.root} lacks the functions {sorted(missing)} this runtime "
                                "calls (built by an older luce-compile); recompile it with `luce-compile compile`.")
        self.device = tvm.cpu(0) if kind == "llvm" else tvm.device(kind, 0)
        self.tokenizer = Tokenizer.from_metadata(self.artifact.tokenizer_metadata())
        self.max_context = options.max_context or min(int(self.config["n_ctx_train"]), 4096)
        self.options = options
        self.vm = tvm_vm.VirtualMachine(tvm.runtime.load_module(str(self.artifact.module_path)), self.device)
        weights = self.artifact.weights()
        self.params = [tvm.runtime.tensor(np.ascontiguousarray(weights[p["name"]]), self.device)
                       for p in manifest["weights"]["params"]]
        self._sliding = bool(int(self.config.get("sliding_window") or 0) and any(self.config.get("sliding", ())))
        sliding = int(self._sliding)
        # every live sequence may grow to max_context; pages are whole, so round each one up (+1 spare page)
        pages_per_seq = -(-self.max_context // options.page_size) + 1
        self.kv = self.vm["create_kv_cache"](
            tvm_ffi.Shape([options.max_batch]), tvm_ffi.Shape([pages_per_seq * options.page_size * options.max_batch]),
            tvm_ffi.Shape([options.prefill_chunk]), tvm_ffi.Shape([options.page_size]), tvm_ffi.Shape([sliding]))
        self._begin, self._end = _kv_builtin("kv_state_begin_forward"), _kv_builtin("kv_state_end_forward")
        self._live: dict[int, int] = {}  # seq id → tokens in its cache
        self._next_id = 0

    # ---- sequences -------------------------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        if len(self._live) >= self.options.max_batch:
            raise EngineError(f"engine: {self.options.max_batch} sequences are already live; remove one first "
                              "(or load the engine with a larger max_batch).")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        _kv_builtin("kv_state_add_sequence")(self.kv, seq_id)
        if self._sliding:
            _kv_builtin("attention_kv_cache_enable_sliding_window_for_seq")(
                self.kv, seq_id, int(self.config["sliding_window"]), 0)
        self._live[seq_id] = 0
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        self._check(seq_id)
        _kv_builtin("kv_state_remove_sequence")(self.kv, seq_id)
        del self._live[seq_id]

    def length(self, seq_id: int) -> int:
        self._check(seq_id)
        return self._live[seq_id]

    def _check(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise EngineError(f"engine: sequence {seq_id} is not live.")

    def _reserve(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        for sid, n in zip(seq_ids, lengths, strict=True):
            self._check(sid)
            if self._live[sid] + n > self.max_context:
                raise EngineError(f"engine: sequence {sid} would hold {self._live[sid] + n} tokens, over the "
                                  f"context of {self.max_context}; shorten the prompt or max_tokens.")

    # ---- steps -----------------------------------------------------------------------------------------------------
    def prefill(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Append each prompt to its sequence; the logits after each one's last token, (N, V) float32."""
        if any(len(p) == 0 for p in prompts):
            raise EngineError("engine: an empty prompt has nothing to prefill; give at least one token.")
        self._reserve(seq_ids, [len(p) for p in prompts])
        last: dict[int, np.ndarray] = {}
        pending = [(sid, list(p)) for sid, p in zip(seq_ids, prompts, strict=True)]
        while pending:  # chunks of at most prefill_chunk tokens, several sequences per call
            batch, budget = [], self.options.prefill_chunk
            for sid, rest in pending:
                take = rest[:min(budget, self._chunk_limit(sid))]
                if not take:
                    break
                batch.append((sid, take))
                budget -= len(take)
                if self._sliding:  # see _chunk_limit: a call mixing first chunks and 1-token rows takes the bad path
                    break
            logits = self._prefill_call(batch)
            for (sid, _take), row in zip(batch, logits, strict=True):
                last[sid] = row
            done = {sid: len(take) for sid, take in batch}
            pending = [(sid, rest[done.get(sid, 0):]) for sid, rest in pending if len(rest) > done.get(sid, 0)]
        return np.stack([last[sid] for sid in seq_ids])

    def _chunk_limit(self, seq_id: int) -> int:
        """Tokens of one sequence that one prefill call may append.

        TVM 0.27's CPU prefill kernel for sliding-window layers is wrong once the cache already holds tokens of the
        sequence (NaN or wrong rows, seen on a tiny gemma3 with window 8), and its in-chunk attention ignores the
        window. Both are exact in the cases used here: a first chunk no longer than the window, then one token per
        call (the decode kernel, which applies the window correctly). Long prompts on sliding models are slower.
        """
        if not self._sliding:
            return self.options.prefill_chunk
        return min(self.options.prefill_chunk, int(self.config["sliding_window"])) if self._live[seq_id] == 0 else 1

    def _prefill_call(self, batch: list[tuple[int, list[int]]]) -> np.ndarray:
        ids = [sid for sid, _ in batch]
        lens = [len(t) for _, t in batch]
        tokens = np.array([[t for _, toks in batch for t in toks]], dtype=np.int32)
        rows = (np.cumsum(lens) - 1).astype(np.int32)
        self._begin(self.kv, tvm_ffi.Shape(ids), tvm_ffi.Shape(lens))
        out = self.vm["prefill"](tvm.runtime.tensor(tokens, self.device), tvm.runtime.tensor(rows, self.device),
                                 self.kv, self.params)
        self._end(self.kv)
        for sid, n in zip(ids, lens, strict=True):
            self._live[sid] += n
        return out[0].numpy()

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each sequence, all in one batched step; logits (B, V) float32."""
        self._reserve(seq_ids, [1] * len(seq_ids))
        self._begin(self.kv, tvm_ffi.Shape(list(seq_ids)), tvm_ffi.Shape([1] * len(seq_ids)))
        x = tvm.runtime.tensor(np.asarray(tokens, dtype=np.int32).reshape(-1, 1), self.device)
        out = self.vm["decode1" if len(seq_ids) == 1 else "decode"](x, self.kv, self.params)
        self._end(self.kv)
        for sid in seq_ids:
            self._live[sid] += 1
        return out[0].numpy()

    # ---- generation ------------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Stream generated token ids until max_tokens, an end-of-generation token, or a stop string."""
        params = params or SamplingParams()
        # None: until a stop, or until the context is full
        limit = params.max_tokens if params.max_tokens is not None else self.max_context - len(prompt_ids)
        if limit <= 0:
            raise EngineError(f"engine: max_tokens must be positive, got {params.max_tokens} (prompt of "
                              f"{len(prompt_ids)} tokens, context {self.max_context}).")
        if len(prompt_ids) + limit > self.max_context:
            raise EngineError(f"engine: prompt ({len(prompt_ids)} tokens) + max_tokens ({limit}) "
                              f"exceeds the context of {self.max_context} tokens; shorten one of them.")
        sampler = Sampler(params)
        stop_ids = set(params.stop_token_ids or ()) | set(self.tokenizer.eos_ids)
        seq = self.add_sequence()
        try:
            history = list(prompt_ids)
            logits = self.prefill([seq], [history])[0]
            text = StreamDecoder(self.tokenizer)
            produced = ""
            for _ in range(limit):
                token = sampler.sample(logits, history)
                if token in stop_ids:
                    return
                history.append(token)
                yield token
                if params.stop:
                    produced += text.feed(token)
                    if any(s in produced for s in params.stop):
                        return
                logits = self.decode([seq], [token])[0]
        finally:
            self.remove_sequence(seq)
