"""The engine: a compiled artifact on a device, its paged KV cache, and the three steps everything else is built on.

  prefill(seq_ids, token lists) → logits of each sequence's last token   (chunked; several sequences at once)
  decode(seq_ids, one token each) → logits (B, V)                          (continuous batching uses this)
  verify(seq_ids, token lists) → logits of every fed token                  (speculative decoding's one forward)
  generate(prompt ids, ...) → streamed tokens                               (sampler, stop ids, stop strings)

Only the TVM runtime is imported (`TVM_USE_RUNTIME_LIB=1` is set before `import tvm` unless tvm is already
loaded): the compiler's library is never mapped, which a test checks. The VM functions and the KV-cache builtins
are TVM's own (Relax VM, TIRPagedKVCache); the functions' names and arguments are the artifact's contract
(luce_runtime/contract.py, written into the manifest by the compiler and checked here at load).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

if "tvm" not in sys.modules:
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

import tvm  # noqa: E402  (after the environment switch above)
import tvm_ffi  # noqa: E402
from tvm.runtime import vm as tvm_vm  # noqa: E402

from luce_runtime.artifact import Artifact, load_artifact  # noqa: E402
from luce_runtime.contract import OPTIONAL_FUNCTIONS, REQUIRED_FUNCTIONS, Fn, KVCacheArgs, RuntimeContract  # noqa: E402
from luce_runtime.device_views import mapped_tensor  # noqa: E402
from luce_runtime.errors import ArtifactError, LuceError  # noqa: E402
from luce_runtime.kv_memory import check_context, sliding_window  # noqa: E402
from luce_runtime.kv_pages import KVPages  # noqa: E402
from luce_runtime.megakernel import MAX_TREE_ROWS, Megakernel, off_path_words  # noqa: E402
from luce_runtime.sampler import SamplingParams, masked_argmax  # noqa: E402
from luce_runtime.timing import median_time  # noqa: E402
from luce_runtime.tokenizer import Tokenizer  # noqa: E402

log = logging.getLogger(__name__)


class EngineError(LuceError, ValueError):
    """A request the engine cannot serve as asked (too long, bad sequence id, n ≤ 0)."""


class NonFiniteLogitsError(EngineError):
    """A step's logits held NaN or inf (Engine._check_finite): the step ran, nothing it produced is a token."""


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 8  # sequences live at once (decode batch, forks, cached prefixes)
    max_context: int = 0  # tokens per sequence, at most the trained context; 0 → the trained context capped at 4096
    prefill_chunk: int = 0  # prompt tokens per prefill call (longer prompts go in chunks); 0 → the artifact's
    page_size: int = 0  # tokens per KV page; 0 → the artifact's
    # decode steps of 1-8 sequences and the artifact's megakernels (CUDA): "auto" runs a step of n sequences on the
    # megakernel where it measured faster than the per-op kernels at load (Engine._choose_decode_paths), True
    # wherever it has a kernel (checks of the megakernel itself), False never (checks against the per-op kernels)
    megakernel: bool | str = "auto"
    # a decode row's logits the same whatever else its step holds (serve --deterministic; Engine.invariant_rows says
    # how): no load-time choice of paths, which could differ between two engines
    batch_invariant: bool = False
    # prompts past a sliding window in chunks (Engine.chunk_limit): None as the artifact's contract says; True
    # whatever its build checked (scripts/device_check.py's window_prefill check compares such chunks with a token a
    # call on the device, before a build may say so)
    sliding_prefill_chunks: bool | None = None


INT8_VERIFY_ROWS = 16  # the most rows the int8 low-row matmuls are built for (schedules/cpu/int8_gemv.py)


def _ranges(numbers: set[int]) -> str:
    """{1, 2, 3, 8} → '1-3, 8'."""
    out: list[str] = []
    for n in sorted(numbers):
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def artifact_device(artifact: Artifact):
    """The device this machine runs the artifact's kernels on. A device API can be there with no device (a compile
    host's stand-in libcuda, a driver without a GPU): both are refused here, before the first allocation (or the KV
    pool's sizing) fails with the driver's own words."""
    target = artifact.manifest["target"]
    kind = target["kind"]
    device = tvm.cpu(0) if kind == "llvm" else tvm.device(kind, 0) if load_device_api(kind) else None
    if device is None or not device.exist:
        raise ArtifactError(f"engine: {artifact.root} was compiled for {target['name']} ({kind}), which this TVM "
                            "runtime cannot drive here; run it on that GPU, or recompile for this machine with "
                            "`luce-compile compile MODEL --target cpu`.")
    return device


def available_memory(kind: str) -> int:
    """Bytes free now: MemAvailable on the host; a GPU's free global memory (its total where the device API cannot
    say)."""
    if kind == "llvm":
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise LuceError("engine: /proc/meminfo has no MemAvailable; pass --max-batch explicitly.")
    load_device_api(kind)
    device = tvm.device(kind, 0)
    return int(device.available_global_memory or device.total_global_memory)


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


class _KV:
    """TVM's paged-KV builtins on one cache object: the only place their names appear."""

    def __init__(self, cache: object):
        self.cache = cache
        # seq id → tokens the megakernel appended inside pages TVM already holds, not yet counted by TVM: reserved
        # (begin + end forward, no kernel) before anything else touches the sequence
        self.behind: dict[int, int] = {}
        get = _kv_builtin
        self._add, self._remove = get("kv_state_add_sequence"), get("kv_state_remove_sequence")
        self._fork, self._popn = get("kv_state_fork_sequence"), get("kv_state_popn")
        self._begin, self._end = get("kv_state_begin_forward"), get("kv_state_end_forward")
        self._slide = get("attention_kv_cache_enable_sliding_window_for_seq")
        self._commit_tree = get("attention_kv_cache_commit_accepted_token_tree_nodes")
        self._free = get("attention_kv_cache_get_num_available_pages")

    def add(self, seq: int) -> None:
        self._add(self.cache, seq)

    def remove(self, seq: int) -> None:
        self.behind.pop(seq, None)
        self._remove(self.cache, seq)

    def fork(self, parent: int, child: int, length: int) -> None:
        self.flush([parent])
        self._fork(self.cache, parent, child, length)

    def popn(self, seq: int, n: int) -> None:
        self.flush([seq])
        self._popn(self.cache, seq, n)

    def begin(self, seqs: Sequence[int], lengths: Sequence[int], parents: Sequence[int] | None = None) -> None:
        """parents: the appended tokens as a tree (each one's parent index among them, -1 for a root), whose
        attention follows the tree's paths and whose positions are depths; None: a chain."""
        self.flush(seqs)
        tree = () if parents is None else (tvm_ffi.Shape(list(parents)),)
        self._begin(self.cache, tvm_ffi.Shape(list(seqs)), tvm_ffi.Shape(list(lengths)), *tree)

    def commit_tree(self, seqs: Sequence[int], leaves: Sequence[int]) -> None:
        """Keep each sequence's tree path from the root to its leaf (-1: none), moved to consecutive slots."""
        self._commit_tree(self.cache, tvm_ffi.Shape(list(seqs)), tvm_ffi.Shape(list(leaves)))

    def defer(self, seq: int, n: int = 1) -> None:
        """n tokens appended to `seq` in pages TVM holds, their keys and values already written there."""
        self.behind[seq] = self.behind.get(seq, 0) + n

    def flush(self, seqs: Sequence[int]) -> None:
        """TVM counts the deferred tokens of these sequences: one forward that reserves their slots (the same slots:
        a position's slot is fixed once its page is allocated) and runs no kernel."""
        pending = [(s, self.behind.pop(s)) for s in seqs if self.behind.get(s)]
        if pending:
            self._begin(self.cache, tvm_ffi.Shape([s for s, _ in pending]), tvm_ffi.Shape([n for _, n in pending]))
            self._end(self.cache)

    def end(self) -> None:
        self._end(self.cache)

    def enable_sliding_window(self, seq: int, window: int) -> None:
        """With TVM 0.27's per-layer windows this pages nothing out (every page stays: luce_compile/lower/
        kv_layers.py); it makes the cache refuse forks of the sequence, whose sliding layers it would window wrong."""
        self._slide(self.cache, seq, window, 0)

    def free_pages(self) -> int:
        return int(self._free(self.cache))


class Engine:
    """One artifact loaded on one device, and the one KV pool every step reads and writes.

    Sequences:  add_sequence() → id, fork_sequence(parent, length) → id (shares the parent's first `length` tokens'
                pages), length(id), rollback(id, n) (drop the last n tokens), remove_sequence(id).
    Steps:      prefill(ids, token lists) (extend each sequence; logits after each one's last token),
                decode(ids, one token each) (one batched step; logits (B, V)),
                verify(ids, token lists) (extend in one forward; logits after every fed token: speculation).
    A step that fails leaves the pool as it was before the step (the tokens it appended are rolled back) and raises;
    the sequences stay usable. Not thread-safe: one thread drives an engine (the server's scheduler thread).
    """

    def __init__(self, artifact: str | Path | Artifact, options: EngineOptions = EngineOptions(),
                 *, verify: bool = True):
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact, verify=verify)
        manifest = self.artifact.manifest
        self.config = self.artifact.config
        self.contract = RuntimeContract.from_manifest(manifest, self.artifact.root)
        if options.sliding_prefill_chunks is not None:
            self.contract = replace(self.contract, sliding_prefill_chunks=options.sliding_prefill_chunks)
        self.device = artifact_device(self.artifact)
        self.tokenizer = Tokenizer.from_metadata(self.artifact.tokenizer_metadata())
        self.options = replace(options, page_size=options.page_size or self.contract.page_size,
                               prefill_chunk=options.prefill_chunk or self.contract.prefill_chunk)
        self.max_context = check_context(self.config, options.max_context)  # ≤ the trained context
        self.vocab_size = int(self.config["n_vocab"])
        self.vm = tvm_vm.VirtualMachine(tvm.runtime.load_module(str(self.artifact.module_path)), self.device)
        self._fns = {str(f): self.vm[str(f)] for f in REQUIRED_FUNCTIONS}
        self._fns.update({str(f): self.vm[str(f)] for f in OPTIONAL_FUNCTIONS if str(f) in self.contract.functions})
        weights = self.artifact.weights()
        self.sliding_window = sliding_window(self.config)
        # every live sequence may grow to max_context; pages are whole, so round each one up (+1 spare page)
        pages_per_seq = -(-self.max_context // self.page_size) + 1
        args = KVCacheArgs(max_batch_size=self.options.max_batch,
                           max_total_seq_len=pages_per_seq * self.page_size * self.options.max_batch,
                           prefill_chunk_size=self.options.prefill_chunk, page_size=self.page_size,
                           support_sliding_window=int(bool(self.sliding_window)))
        self._kv = _KV(self._fns[Fn.CREATE_KV_CACHE](*(tvm_ffi.Shape([v]) for v in args.values())))
        self.total_pages = self._kv.free_pages()
        self._live: dict[int, int] = {}  # seq id → tokens in its cache
        self._trees: dict[int, list[int]] = {}  # seq id → the parents of its verified, not yet committed token tree
        self._next_id = 0
        if self.options.megakernel not in (True, False, "auto"):
            raise EngineError(f"engine: megakernel must be True, False or 'auto', got {self.options.megakernel!r}")
        self.megakernel = self._load_megakernel(weights)
        # the megakernel's stacked weights are the per-op kernels' too where they can be (device_views.py)
        shared = self.megakernel.layer_views if self.megakernel is not None else {}
        self.params = [shared[p["name"]] if p["name"] in shared else
                       mapped_tensor(weights[p["name"]], self.device)
                       for p in manifest["weights"]["params"]]
        self._mk_sizes: set[int] = set()  # numbers of sequences whose decode steps run the megakernel
        # rows of a verify the megakernel takes (each fed token a row, at its own position of its sequence's pages)
        self._mk_verify_rows = 0
        self.decode_timings_us: dict[int, tuple[float, float]] = {}  # n → (megakernel, per-op) µs, when measured
        self.verify_timings_us: dict[int, tuple[float, float]] = {}  # rows → (megakernel, per-op) µs, likewise
        # batch invariance: the megakernel's variants split attention's keys by batch size (fuse/taskgraph.py's
        # kv_fill), so every step runs the largest
        self._mk_batch = self.megakernel.batches[-1] if self.options.batch_invariant and self.megakernel else None
        if self.megakernel is not None:
            largest = min(self.megakernel.batches[-1], self.options.max_batch)
            self._mk_sizes = set(range(1, largest + 1))
            self._mk_verify_rows = self.megakernel.batches[-1]
            if self.options.megakernel == "auto" and not self.options.batch_invariant:
                self._choose_decode_paths()
        if self._mk_batch:
            self.decode_path = f"megakernel of {self._mk_batch} rows for every step (batch_invariant)"
        elif self.options.batch_invariant and self.invariant_rows == 1:
            self.decode_path += ", a row a call (batch_invariant)"

    def _load_megakernel(self, weights: dict[str, np.ndarray]) -> Megakernel | None:
        """The artifact's decode megakernels, when this engine can run them (else None, and the reason logged)."""
        section = self.artifact.manifest.get("megakernel")
        self.decode_path = "per-op kernels"  # what decode() runs, with the reason when not the megakernel
        if not self.options.megakernel or section is None:
            if section is not None:
                self.decode_path += " (the megakernel is turned off)"
            return None
        sm_count = int(self.device.multi_processor_count or 0)
        why = Megakernel.refusal(section, kv_dtype=self.contract.kv_dtype, page_size=self.page_size,
                                 max_context=self.max_context, sm_count=sm_count)
        if why:
            log.info("engine: decode runs the per-op kernels, not the megakernels: %s", why)
            self.decode_path += f" (no megakernel: {why})"
            return None
        self.decode_path = f"megakernel for 1-{max(int(b) for b in section['batches'])} sequences, per-op above"
        c = self.config
        self._pages = KVPages(self._kv.cache, int(c["n_layer"]), int(c["n_head_kv"]), int(c["head_dim"]),
                              self.page_size, self.max_context, self.contract.kv_dtype)
        self._mk_pages: dict[int, list[int]] = {}  # seq id → its page ids as last read (dropped when they may move)
        return Megakernel(self.artifact.root, section, self.device, weights, max_context=self.max_context)

    def _choose_decode_paths(self, context: int = 512, steps: int = 6) -> None:
        """Time a greedy decode step of n sequences on the megakernel and on the per-op kernels, for every n the
        megakernels serve, after prompts of `context` random tokens (capped by the context); keep the megakernel
        for the n where it was faster. Which path wins depends on the model and the GPU (on the H200, 2026-12-01:
        the megakernel at one sequence on three of four workloads, the per-op GEMVs at eight on three of four), so
        it is measured here, once, ~1 s at load. Without a size left the megakernels' buffers are freed."""
        sizes = sorted(self._mk_sizes)
        rows = self._mk_verify_rows
        appended = len(sizes) * 2 * (steps + 2) + 2 * rows * (steps + 2)  # tokens the timed steps add at most
        context = max(1, min(context, self.max_context - appended - 1))
        rng = np.random.default_rng(0)
        seqs = [self.add_sequence() for _ in sizes]
        chosen, times = set(), {}
        try:
            self.prefill(seqs, [rng.integers(0, self.vocab_size, context).tolist() for _ in seqs])
            for n in sizes:
                tokens = [0] * n
                mk = median_time(lambda n=n, t=tokens: self._megakernel_step(seqs[:n], t, logits=False), steps,
                                 warmup=2, sync=self.device.sync)
                op = median_time(lambda n=n, t=tokens: self._per_op_step(seqs[:n], t), steps, warmup=2,
                                 sync=self.device.sync)
                times[n] = (mk, op)
                if mk < op:
                    chosen.add(n)
            # a verify of the largest kernel's rows (one sequence): the megakernel's rows, or the per-op verify
            # (the prefill function's fixed cost: 2.5-3 decode steps on the H200 from 2 rows up, 2026-12-02)
            feed = [[0] * rows]
            mk_v = median_time(lambda: self._verify_then_pop(seqs[0], feed, True), steps, warmup=2,
                               sync=self.device.sync)
            op_v = median_time(lambda: self._verify_then_pop(seqs[0], feed, False), steps, warmup=2,
                               sync=self.device.sync)
        finally:
            for sid in seqs:
                self.remove_sequence(sid)
        self._mk_sizes = chosen
        self.decode_timings_us = {n: (round(mk * 1e6, 1), round(op * 1e6, 1)) for n, (mk, op) in times.items()}
        self.verify_timings_us = {rows: (round(mk_v * 1e6, 1), round(op_v * 1e6, 1))}
        if mk_v >= op_v:
            self._mk_verify_rows = 0
        log.info("engine: decode step µs (megakernel, per-op) by sequences: %s; verify of %d rows: %s",
                 self.decode_timings_us, rows, self.verify_timings_us[rows])
        verify = f", verify of up to {self._mk_verify_rows} rows" if self._mk_verify_rows else ""
        if not chosen and not self._mk_verify_rows:
            self.megakernel = None  # its stacked weights and arenas leave the device
            self.decode_path = "per-op kernels (the megakernel measured slower at every batch size and for verify)"
        elif not chosen:
            self.decode_path = f"per-op kernels (measured faster at load); megakernel for verify of up to {rows} rows"
        else:
            self.decode_path = (f"megakernel for {_ranges(chosen)} sequences{verify} (measured faster at load), "
                                "per-op otherwise")

    def _verify_then_pop(self, seq_id: int, feeds: list[list[int]], megakernel: bool) -> None:
        """A verify of one sequence through the megakernel or the per-op path, its tokens popped again (timings)."""
        if megakernel:
            self._megakernel_rows([seq_id], feeds, logits=False)
        else:
            self._forward([seq_id], feeds, Fn.VERIFY if self.has_int8_verify else Fn.PREFILL, every_row=True)
        self.rollback(seq_id, len(feeds[0]))

    # ---- facts -----------------------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.options.page_size

    @property
    def prefill_chunk(self) -> int:
        return self.options.prefill_chunk

    @property
    def has_int8_verify(self) -> bool:
        """The artifact exports `verify` (decode's integer matmuls over several rows): a few tokens cost about one
        decode step each, where the float32 prefill function costs several."""
        return str(Fn.VERIFY) in self._fns

    @property
    def verify_rows_at_decode_cost(self) -> int:
        """The most rows a verify takes through decode's own kernels, at about a decode step's cost (the
        megakernel's rows, or the int8 `verify` function's low-row matmuls); 0: verify runs the prefill function,
        whose fixed cost is several decode steps."""
        if self.megakernel is not None and self._mk_verify_rows:
            return self._mk_verify_rows
        return min(INT8_VERIFY_ROWS, self._per_op_verify_limit) if self.has_int8_verify else 0

    @property
    def verify_limit(self) -> int:
        """The most tokens one verify may feed a sequence: the prefill chunk, or for a model with sliding-window
        layers what a prefill call may take (chunk_limit: the window, or one token where the prefill kernels do not
        window the cached keys) unless the megakernel's rows take it (each row applies its own window)."""
        return max(self._per_op_verify_limit, self._mk_verify_rows if self.megakernel is not None else 0)

    @property
    def verify_budget(self) -> int:
        """The most tokens one verify may feed over all its sequences: the prefill chunk, or for a model with
        sliding-window layers whose prefill kernels take one token a call, the megakernel's rows."""
        if not self.sliding_window or self.contract.sliding_prefill_chunks:
            return self.prefill_chunk
        return self._mk_verify_rows if self.megakernel is not None else 0

    @property
    def _per_op_verify_limit(self) -> int:
        if not self.sliding_window:
            return self.prefill_chunk
        return min(self.prefill_chunk, self.sliding_window) if self.contract.sliding_prefill_chunks else 1

    @property
    def max_sequences(self) -> int:
        """Sequences the pool holds at once (decode batch, forks and cached prefixes together)."""
        return self.options.max_batch

    def free_pages(self) -> int:
        """KV pages not held by any sequence (a forked prefix's pages count once)."""
        return self._kv.free_pages()

    def sequences(self) -> dict[int, int]:
        """Live sequence id → tokens in its cache (a copy)."""
        return dict(self._live)

    # ---- sequences -------------------------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new, empty sequence."""
        seq_id = self._new_id()
        self._kv.add(seq_id)
        self._register(seq_id, 0)
        return seq_id

    def fork_sequence(self, parent: int, length: int | None = None) -> int:
        """A new sequence holding the first `length` tokens of `parent` (default: all), sharing their pages
        (copy-on-write for a partial last page): a cached prompt prefix is computed once."""
        self._check(parent)
        length = self._live[parent] if length is None else length
        if not 0 < length <= self._live[parent]:
            raise EngineError(f"engine: cannot fork {length} tokens of sequence {parent}, which holds "
                              f"{self._live[parent]}; fork between 1 and that many.")
        seq_id = self._new_id()
        self._kv.fork(parent, seq_id, length)
        self._pages_moved(parent)  # the parent's last page is shared now: its next append copies it
        self._register(seq_id, length)
        return seq_id

    def rollback(self, seq_id: int, n: int) -> None:
        """Drop the last n tokens of a sequence (rejected draft tokens, a failed step); their pages are freed."""
        self._check(seq_id)
        if not 0 <= n <= self._live[seq_id]:
            raise EngineError(f"engine: cannot roll back {n} tokens of sequence {seq_id}, which holds "
                              f"{self._live[seq_id]}.")
        if n:  # at any depth, past a sliding window too: TVM 0.27 keeps every page (luce_compile/lower/kv_layers.py)
            self._kv.popn(seq_id, n)
            self._live[seq_id] -= n
            self._pages_moved(seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        """Free a sequence and its pages (pages shared with a fork stay until the fork is removed too)."""
        self._check(seq_id)
        self._trees.pop(seq_id, None)
        self._kv.remove(seq_id)
        del self._live[seq_id]
        self._pages_moved(seq_id)

    @contextmanager
    def sequence(self) -> Iterator[int]:
        """A new sequence, removed on exit whatever happens."""
        seq_id = self.add_sequence()
        try:
            yield seq_id
        finally:
            if seq_id in self._live:
                self.remove_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        self._check(seq_id)
        return self._live[seq_id]

    def chunk_limit(self, seq_id: int) -> int:
        """Tokens of one sequence that one prefill call may append.

        The in-chunk attention of a prefill ignores a sliding window (TVM's ragged kernel and ours), so a chunk is at
        most the window long: every key in it is then inside each of its queries' windows. TVM 0.27's CPU prefill
        kernel for the keys already cached is wrong on sliding-window layers (NaN or wrong rows, seen on a tiny
        gemma3 with window 8); artifacts whose kernel applies the window there (the contract's
        sliding_prefill_chunks: the CPU build's own kernels, and TVM's CUDA kernel, which masks each row to its
        window since apache/tvm#20121 and was checked on the H100 without attention sinks) take such chunks at
        every call, the others one token per call after the first chunk (the decode kernel, which applies the
        window correctly). A verify on the megakernel is not bound by this (verify_limit): its rows each apply their
        own window.
        """
        self._check(seq_id)
        if not self.sliding_window:
            return self.prefill_chunk
        if self.contract.sliding_prefill_chunks or self._live[seq_id] == 0:
            return min(self.prefill_chunk, self.sliding_window)
        return 1

    def _new_id(self) -> int:
        if len(self._live) >= self.max_sequences:
            raise EngineError(f"engine: {self.max_sequences} sequences are already live; remove one first "
                              "(or load the engine with a larger max_batch).")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        return seq_id

    def _register(self, seq_id: int, length: int) -> None:
        if self.sliding_window:  # the cache then refuses forks of it (_KV.enable_sliding_window says why)
            self._kv.enable_sliding_window(seq_id, self.sliding_window)
        self._live[seq_id] = length

    def _check(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise EngineError(f"engine: sequence {seq_id} is not live.")

    def _check_step(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Everything a step needs, checked before the cache is touched (a bad request never reaches a kernel)."""
        if len(set(seq_ids)) != len(seq_ids):
            raise EngineError(f"engine: a step names a sequence twice ({list(seq_ids)}).")
        for sid, toks in zip(seq_ids, tokens, strict=True):
            self._check(sid)
            if not toks:
                raise EngineError("engine: an empty prompt has nothing to prefill; give at least one token.")
            if self._live[sid] + len(toks) > self.max_context:
                raise EngineError(f"engine: sequence {sid} would hold {self._live[sid] + len(toks)} tokens, over "
                                  f"the context of {self.max_context}; shorten the prompt or max_tokens.")
            bad = [t for t in toks if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise EngineError(f"engine: token ids {bad[:4]} are outside the vocabulary (0..{self.vocab_size - 1}).")

    # ---- steps -----------------------------------------------------------------------------------------------------
    def prefill(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Append each prompt to its sequence; the logits after each one's last token, (N, V) float32."""
        self._check_step(seq_ids, prompts)
        last: dict[int, np.ndarray] = {}
        pending = [(sid, list(p)) for sid, p in zip(seq_ids, prompts, strict=True)]
        appended: dict[int, int] = {}
        try:
            while pending:  # chunks of at most prefill_chunk tokens, several sequences per call
                batch = self._next_chunk(pending)
                logits = self._forward([sid for sid, _ in batch], [t for _, t in batch], Fn.PREFILL)
                for (sid, take), row in zip(batch, logits, strict=True):
                    last[sid] = row
                    appended[sid] = appended.get(sid, 0) + len(take)
                done = {sid: len(take) for sid, take in batch}
                pending = [(sid, rest[done.get(sid, 0):]) for sid, rest in pending if len(rest) > done.get(sid, 0)]
        except BaseException:
            for sid, n in appended.items():  # earlier chunks of this call went in: take them out the same way
                self._live[sid] -= n
                self._undo_append(sid, n)
            raise
        return np.stack([last[sid] for sid in seq_ids])

    def _next_chunk(self, pending: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        batch, budget = [], self.prefill_chunk
        for sid, rest in pending:
            take = rest[:min(budget, self.chunk_limit(sid))]
            if not take:
                break
            batch.append((sid, take))
            budget -= len(take)
            if self.sliding_window and not self.contract.sliding_prefill_chunks:
                break  # see chunk_limit: on TVM's kernel a call mixing first chunks and 1-token rows goes wrong
        return batch

    @property
    def invariant_rows(self) -> int:
        """With batch_invariant, the rows one decode call runs together (more go in several calls); 0 = any number.
        The CPU's int8 decode is row-invariant as built (each row's integer sums in one fixed order); the largest
        megakernel takes its batch of rows, each summed alike wherever it sits; the other per-op kernels branch on
        the row count (schedules/gpu/quant_gemm.py, the f32 CPU's DECODE1 and DECODE), so a row a call."""
        if not self.options.batch_invariant or (self.artifact.manifest["target"]["kind"] == "llvm"
                                                and self.has_int8_verify):
            return 0
        return self._mk_batch if self._mk_batch else 1

    def _in_groups(self, n: int, step) -> np.ndarray:
        """step(a, b) over rows [a, b) of a decode of n rows, in groups of invariant_rows, concatenated."""
        size = self.invariant_rows or n
        outs = [step(a, min(a + size, n)) for a in range(0, n, size)]
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each sequence, all in one batched step; logits (B, V) float32."""
        self._check_step(seq_ids, [[t] for t in tokens])
        return self._in_groups(len(seq_ids), lambda a, b: self._decode_rows(list(seq_ids[a:b]), list(tokens[a:b])))

    def _decode_rows(self, seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        if len(seq_ids) in self._mk_sizes:
            return self._megakernel_step(seq_ids, [int(t) for t in tokens])
        return self._per_op_step(seq_ids, tokens)

    def _per_op_step(self, seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        return self._forward(seq_ids, [[t] for t in tokens], Fn.DECODE1 if len(seq_ids) == 1 else Fn.DECODE)

    def decode_greedy(self, seq_ids: Sequence[int], tokens: Sequence[int],
                      allowed: Sequence[np.ndarray | None] | None = None) -> list[int]:
        """decode() followed by each row's argmax (the lowest index of the largest logit), where only the token ids
        cross to the host when the megakernel runs the step (its LM head takes the argmax on the device); the
        per-op path copies the logits and takes it here. For greedy sampling with nothing that needs the logits.

        allowed: per row None or a grammar's token mask, packed as llguidance writes it (int32 words, token t is
        bit t % 32 of word t // 32; tokens past the words are not allowed); the argmax then runs over the allowed
        tokens only: on the device for a megakernel step (its kernel takes masks), here otherwise. A row whose
        mask allows no token gets -1."""
        masks = self._mask_words(allowed, len(seq_ids))
        self._check_step(seq_ids, [[t] for t in tokens])

        def rows(a: int, b: int) -> np.ndarray:
            group = None if masks is None else masks[a:b]
            if b - a in self._mk_sizes and (group is None or self.megakernel.can_mask):
                return self._megakernel_step(list(seq_ids[a:b]), [int(t) for t in tokens[a:b]], logits=False,
                                             allowed=group)
            logits = self._decode_rows(list(seq_ids[a:b]), list(tokens[a:b]))
            return np.argmax(logits, axis=-1) if group is None else masked_argmax(logits, group)

        return self._in_groups(len(seq_ids), rows).tolist()

    def _mask_words(self, allowed: Sequence[np.ndarray | None] | None, n: int) -> np.ndarray | None:
        """Rows' masks as one (n, ceil(vocab / 32)) int32 array (None rows allow every token); None if no row has
        one."""
        if allowed is None or all(a is None for a in allowed):
            return None
        if len(allowed) != n:
            raise EngineError(f"engine: {len(allowed)} token masks for {n} sequences")
        words = np.full((n, -(-self.vocab_size // 32)), -1, dtype=np.int32)
        for row, a in zip(words, allowed, strict=True):
            if a is not None:
                a = np.asarray(a, dtype=np.int32).reshape(-1)
                row[:] = 0
                row[:min(len(a), len(row))] = a[:len(row)]
        return words

    def _megakernel_step(self, seq_ids: list[int], tokens: list[int], logits: bool = True,
                         allowed: np.ndarray | None = None) -> np.ndarray:
        """decode() through the megakernel: one row per sequence (_megakernel_rows)."""
        return self._megakernel_rows(seq_ids, [[t] for t in tokens], logits=logits, allowed=allowed)

    def _megakernel_rows(self, seq_ids: list[int], feeds: list[list[int]], logits: bool = True,
                         allowed: np.ndarray | None = None, parents: list[int] | None = None) -> np.ndarray:
        """One megakernel step over every fed token: token j of sequence s is a row at position length(s) + j of
        s's pages (a decode step feeds one token a sequence; a verify several). The kernel writes each row's keys
        and values into its slot, and a row attends over its sequence's keys up to its own position: every
        attention task waits on the key/value tiles of all rows of the step (the task graph's regions), so a
        verify's rows see the drafts before them, causally, as a prefill chunk does.

        A token whose position lies in a page TVM already holds for the sequence (read before, not moved since) is
        only counted (_KV.defer: skipping TVM's begin + end forward took ~100 µs off SmolLM2's step on the H200);
        otherwise TVM's cache reserves the slots first (begin forward, which allocates pages at page boundaries
        and copies a shared last page after a fork), as a per-op step does. The logits (rows, V) or the greedy
        ids (rows,), rows in feed order.

        parents: the one sequence's feed is a token tree (verify_tree): TVM always reserves it, with the parents,
        so that it lays the nodes out in consecutive slots and can commit a path (commit_tree); each row gets its
        word of other branches' keys (megakernel.off_path_words)."""
        lengths = [self._live[s] for s in seq_ids]
        counts = [len(f) for f in feeds]
        reserve = [(s, c) for s, n, c in zip(seq_ids, lengths, counts, strict=True)
                   if parents is not None or n + c > len(self._mk_pages.get(s, ())) * self.page_size]
        if reserve:
            self._kv.begin([s for s, _ in reserve], [c for _, c in reserve], parents)
        try:
            pages = [self._page_ids(s, n + c) for s, n, c in zip(seq_ids, lengths, counts, strict=True)]
            out = self.megakernel.step([t for f in feeds for t in f],
                                       [n + j for n, c in zip(lengths, counts, strict=True) for j in range(c)],
                                       [p for p, c in zip(pages, counts, strict=True) for _ in range(c)],
                                       *self._pages.kernel_args(self.device), logits=logits, allowed=allowed,
                                       off_path=None if parents is None else off_path_words(parents),
                                       batch=self._mk_batch)
        except BaseException:
            if reserve:
                self._kv.end()
            if parents is not None:  # TVM pops a tree's nodes only through its commit (none accepted)
                self._pages_moved(*seq_ids)
                self._kv.commit_tree(seq_ids, [-1])
            else:
                for sid, c in reserve:
                    self._undo_append(sid, c)  # forgets the page ids read for the step too (_pages_moved)
            raise
        if reserve:
            self._kv.end()
        reserved = {s for s, _ in reserve}
        for sid, c in zip(seq_ids, counts, strict=True):
            self._live[sid] += c
            if sid not in reserved:
                self._kv.defer(sid, c)
        self._check_finite(seq_ids, lengths, counts, out, ids=not logits, masked=allowed is not None)
        return out

    def _check_finite(self, seq_ids: Sequence[int], lengths: Sequence[int], counts: Sequence[int], out: np.ndarray,
                      ids: bool = False, masked: bool = False) -> None:
        """Refuse a step whose logits are not finite, naming the sequence and position, before a NaN becomes a
        token: the device argmax of a NaN row is no index (it returned 2**31 - 1 for a 7B of random weights whose
        activations overflowed), and numpy's argmax of one is the first NaN's. out: the step's logits (rows, V) or
        greedy ids (rows,), rows in sequence order, counts[i] of them for seq_ids[i] from position lengths[i]. Only
        each row's largest logit is read (NaN propagates through max); a masked row's -1 (no token allowed) is the
        grammar's, not this."""
        if ids:
            bad = np.nonzero((out >= self.vocab_size) | ((out < 0) & (not masked)))[0]
        else:
            bad = np.nonzero(~np.isfinite(np.max(out, axis=-1)))[0] if out.size else []
        if len(bad) == 0:
            return
        rows = [(sid, n + j) for sid, n, c in zip(seq_ids, lengths, counts, strict=True) for j in range(c)]
        where = ", ".join(f"sequence {sid} at position {pos}" for sid, pos in (rows[int(r)] for r in bad[:4]))
        raise NonFiniteLogitsError(
            f"engine: the logits of {len(bad)} of {len(rows)} rows are not finite (NaN or inf): {where}. The model's "
            "activations overflowed float32 (damaged or random weights), or a kernel is wrong: compare with "
            "`luce-compile compile ... --precision f32` and the per-op path (`bench --no-megakernel`).")

    def _page_ids(self, seq_id: int, length: int) -> list[int]:
        """The page ids holding a sequence's first `length` positions: read once, then one page more at each page
        boundary (a page never moves while only megakernel steps append to its sequence)."""
        known = self._mk_pages.get(seq_id)
        need = -(-length // self.page_size)
        if known is None or len(known) < need - 1:
            known = self._pages.page_ids(seq_id, length)
        elif len(known) < need:
            start = (need - 1) * self.page_size
            known = [*known, int(self._pages.slots(seq_id, start, start + 1)[0]) // self.page_size]
        self._mk_pages[seq_id] = known
        return known

    def _pages_moved(self, *seq_ids: int) -> None:
        """Sequences whose page ids TVM may have changed (a per-op append, fork, pop or removal)."""
        if self.megakernel is not None:
            for sid in seq_ids:
                self._mk_pages.pop(sid, None)

    def verify(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append each token list to its sequence in one forward (speculative verify: the last accepted token and
        the drafts); the logits after every appended token, one (len(tokens[i]), V) float32 array per sequence.
        Row j of a sequence scores the token after its j-th fed token. Roll back the rejected tail with rollback().

        Where the artifact has decode megakernels and the rows fit the largest (8 rows by default), the megakernel
        runs them: each fed token is a row at its own position, so a verify costs about one batched decode step
        and its rows are the megakernel's decode numbers (bit-identical to decoding the same tokens one by one on
        it). An artifact whose decode takes 8-bit activations (--precision auto on x86 with AVX2, or int8) exports
        `verify`: prefill's attention with decode's integer matmuls, each row quantized on its own as decode
        quantizes it, so the rows are decode's numbers (up to the two attention kernels' float rounding) at
        decode's per-row cost. Otherwise it runs the prefill function with every row selected."""
        self._check_verify(seq_ids, tokens)
        if self._verify_on_megakernel(tokens):
            logits = self._megakernel_rows(list(seq_ids), [list(map(int, t)) for t in tokens])
        else:
            fn = Fn.VERIFY if self.has_int8_verify else Fn.PREFILL
            logits = self._forward(list(seq_ids), [list(t) for t in tokens], fn, every_row=True)
        return np.split(logits, np.cumsum([len(t) for t in tokens])[:-1])

    def verify_greedy(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[list[int]]:
        """verify() followed by every row's argmax (the lowest index of the largest logit): only the ids cross to
        the host where the megakernel runs the verify (greedy speculation needs nothing else)."""
        if not self._verify_on_megakernel(tokens):  # verify checks the request
            return [np.argmax(rows, axis=-1).tolist() for rows in self.verify(seq_ids, tokens)]
        self._check_verify(seq_ids, tokens)
        ids = self._megakernel_rows(list(seq_ids), [list(map(int, t)) for t in tokens], logits=False).tolist()
        at = np.cumsum([0, *(len(t) for t in tokens)])
        return [ids[a:b] for a, b in zip(at[:-1], at[1:], strict=True)]

    def verify_tree(self, seq_id: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Feed a token tree to a sequence in one forward (tree verify): node i is tokens[i], its parent parents[i]
        (an earlier node; -1 only for node 0, the sequence's next input), at position length + its depth, attending
        to the sequence and its own ancestors only (TVM's tree attention mask). Row i of the (n, V) logits scores the
        token after node i's path. The sequence then must keep one path: commit_tree(seq_id, leaf).

        TVM's cache holds the tree either way (its nodes in consecutive slots, its parents for the commit). Where
        the megakernel verifies trees (`verifies_trees`) and the nodes fit its rows, it runs them as verify() runs
        a chain: each node a row at its own slot, its word of other branches' keys (megakernel.off_path_words)
        keeping its attention on its path and its RoPE position at its depth; else the per-op kernels with TVM's
        tree attention mask."""
        tokens, parents = self._check_tree(seq_id, tokens, parents)
        if self._tree_on_megakernel(len(tokens)):
            logits = self._megakernel_rows([seq_id], [tokens], parents=parents)
            self._trees[seq_id] = parents
            return logits
        fn = Fn.VERIFY if self.has_int8_verify else Fn.PREFILL
        try:
            logits = self._forward([seq_id], [tokens], fn, every_row=True, parents=parents)
        except TypeError as e:  # the compiled cache's tree kernels in TVM's swapped order
            raise EngineError(f"engine: {self.artifact.root} cannot verify a token tree ({str(e).splitlines()[0]}): "
                              "it was compiled before the CPU tree-attention kernels were put in the order TVM's "
                              "runtime calls them; recompile it with `luce-compile compile ... --force`, or draft "
                              "chains (no branch).") from e
        self._trees[seq_id] = parents
        return logits

    def verify_tree_greedy(self, seq_id: int, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """verify_tree() followed by every row's argmax: only the ids cross to the host where the megakernel runs
        the tree (greedy tree acceptance needs nothing else)."""
        if not self._tree_on_megakernel(len(tokens)):
            return np.argmax(self.verify_tree(seq_id, tokens, parents), axis=-1).tolist()
        tokens, parents = self._check_tree(seq_id, tokens, parents)
        ids = self._megakernel_rows([seq_id], [tokens], logits=False, parents=parents).tolist()
        self._trees[seq_id] = parents
        return ids

    @property
    def verifies_trees(self) -> bool:
        """Whether a token tree verifies where a chain of as many rows would (so drafting one costs only its rows):
        on the per-op kernels where chains verify there too (no megakernel, or one measured slower for verify), or
        on the megakernel's verify rows when its kernels take a tree (built since issue 39: the manifest's kernel
        parameters list `off_path`). An older megakernel verifies chains only; a tree would go to the per-op path,
        at several decode steps' cost. A model with sliding-window layers verifies none (_check_tree says why)."""
        if self.sliding_window:
            return False
        if self.megakernel is None or not self._mk_verify_rows:
            return True
        return self.megakernel.can_tree

    def _tree_on_megakernel(self, n: int) -> bool:
        return (self.megakernel is not None and bool(self._mk_verify_rows) and self.megakernel.can_tree
                and not self.sliding_window and n <= min(self._mk_verify_rows, MAX_TREE_ROWS))

    def _check_tree(self, seq_id: int, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int]]:
        tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
        if len(parents) != len(tokens) or not tokens or parents[0] != -1 or \
                any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise EngineError(f"engine: a token tree needs one parent per token, -1 for the first and an earlier "
                              f"node for every other; got parents {parents} for {len(tokens)} tokens.")
        if self.sliding_window:
            # TVM's tree kernels take no window (their length info is a global layer's), and the megakernel windows
            # a row by its slot where a node's position is its depth
            raise EngineError(f"engine: {self.artifact.root} has sliding-window layers, which verify chains only, "
                              "not token trees; draft chains (verifies_trees is False).")
        self._check_verify([seq_id], [tokens])
        return tokens, parents

    def commit_tree(self, seq_id: int, leaf: int) -> None:
        """After verify_tree: keep the path from the tree's root (node 0) to node `leaf` and drop every other node's
        keys and values (TVM moves the path's to consecutive slots and frees the rest)."""
        parents = self._trees.pop(seq_id, None)
        if parents is None or not 0 <= leaf < len(parents):
            raise EngineError(f"engine: sequence {seq_id} has no token tree with a node {leaf} to commit.")
        depth, node = 0, leaf
        while parents[node] != -1:
            depth, node = depth + 1, parents[node]
        self._pages_moved(seq_id)
        self._kv.commit_tree([seq_id], [leaf])
        self._live[seq_id] -= len(parents) - (depth + 1)

    def _verify_on_megakernel(self, tokens: Sequence[Sequence[int]]) -> bool:
        return self.megakernel is not None and sum(len(t) for t in tokens) <= self._mk_verify_rows

    def _check_verify(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        self._check_step(seq_ids, tokens)
        total = sum(len(t) for t in tokens)
        if total > self.prefill_chunk:
            raise EngineError(f"engine: a verify of {total} tokens is longer than the prefill chunk of "
                              f"{self.prefill_chunk}; draft fewer tokens (or load with a larger prefill_chunk).")
        if self._verify_on_megakernel(tokens):  # each row applies its own window: no chunk limit
            return
        for sid, toks in zip(seq_ids, tokens, strict=True):
            if len(toks) > self.chunk_limit(sid):
                raise EngineError(f"engine: sequence {sid} can take {self.chunk_limit(sid)} tokens per call on the "
                                  f"per-op kernels, not {len(toks)} (sliding-window layers: see chunk_limit); verify "
                                  f"at most {self.verify_limit} tokens of a sequence (Engine.verify_limit).")

    def _forward(self, seq_ids: list[int], tokens: list[list[int]], fn: Fn, every_row: bool = False,
                 parents: list[int] | None = None) -> np.ndarray:
        """One call of a compiled step between the cache's begin and end of forward; on failure the appended
        tokens are popped again, so the pool is as it was and every sequence can go on. Prefill returns the logits
        of each sequence's last token, or of every token with every_row (verify)."""
        lens = [len(t) for t in tokens]
        self._pages_moved(*seq_ids)
        self._kv.begin(seq_ids, lens, parents)
        try:
            if fn in (Fn.PREFILL, Fn.VERIFY):
                flat = tvm.runtime.tensor(np.array([[t for toks in tokens for t in toks]], dtype=np.int32),
                                          self.device)
                rows = np.arange(sum(lens), dtype=np.int32) if every_row else (np.cumsum(lens) - 1).astype(np.int32)
                out = (self._fns[fn](flat, self._kv.cache, self.params) if fn == Fn.VERIFY else
                       self._fns[fn](flat, tvm.runtime.tensor(rows, self.device), self._kv.cache, self.params))
            else:
                x = tvm.runtime.tensor(np.asarray(tokens, dtype=np.int32).reshape(-1, 1), self.device)
                out = self._fns[fn](x, self._kv.cache, self.params)
            logits = out[0].numpy()
        except BaseException:
            self._kv.end()
            if parents is not None:  # TVM pops a tree's nodes only through its commit (none accepted)
                self._kv.commit_tree(seq_ids, [-1])
            else:
                for sid, n in zip(seq_ids, lens, strict=True):
                    self._undo_append(sid, n)
            raise
        self._kv.end()
        starts = [self._live[sid] for sid in seq_ids]
        for sid, n in zip(seq_ids, lens, strict=True):
            self._live[sid] += n
        # the rows returned: every fed token's, or each sequence's last (a prefill's, a decode's one)
        self._check_finite(seq_ids, starts if every_row else [a + n - 1 for a, n in zip(starts, lens, strict=True)],
                           lens if every_row else [1] * len(lens), logits)
        return logits

    def _undo_append(self, seq_id: int, n: int) -> None:
        """Pop the n tokens a failed step appended beyond the sequence's counted length."""
        self._pages_moved(seq_id)
        self._kv.popn(seq_id, n)

    # ---- generation ------------------------------------------------------------------------------------------------
    def token_limit(self, prompt_len: int, max_tokens: int | None) -> int:
        """Tokens a generation may produce after a prompt of prompt_len (max_tokens None: until the context is
        full), refused when they do not fit the context."""
        limit = max_tokens if max_tokens is not None else self.max_context - prompt_len
        if limit <= 0:
            raise EngineError(f"engine: max_tokens must be positive, got {max_tokens} (prompt of "
                              f"{prompt_len} tokens, context {self.max_context}).")
        if prompt_len + limit > self.max_context:
            raise EngineError(f"engine: prompt ({prompt_len} tokens) + max_tokens ({limit}) "
                              f"exceeds the context of {self.max_context} tokens; shorten one of them.")
        return limit

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Stream generated token ids until max_tokens, an end-of-generation token, or a stop string: plain
        decoding through the one generation loop (luce_runtime.generation, which speculation and the server use)."""
        from luce_runtime.generation import generate  # the loop drives this engine: it imports this module

        return generate(self, prompt_ids, params)
