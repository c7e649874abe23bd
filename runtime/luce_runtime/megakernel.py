"""The artifact's decode megakernels (issue 11): one persistent kernel runs a whole decode step of 1-8 sequences.

The compiler (luce_compile/fuse/build.artifact_megakernels) writes megakernel.so, the task tables of each batch
size (megakernel.npz) and the manifest's "megakernel" section: every kernel's arguments in order, which per-op
weights each stacked weight argument holds (one per layer), the arena layout. This module only loads and launches
them; the engine decides when (Engine.decode) and hands over the KV pages of TVM's cache (luce_runtime.kv_pages).

A step of n sequences runs the smallest kernel of batch >= n; the rows past n repeat the last real row (same
token, length and pages), so they compute and write the same bytes as that row: no scratch pages are needed.

A verify's rows may be a token tree (kernels that take `off_path`, built since 2026-12-06 for issue 39): each node
a row at its own slot, as TVM lays a tree out (consecutive slots after the sequence), with a word whose bit k marks
the key k slots before the row's own as another branch's: the row's attention skips it and its RoPE position (its
depth past the sequence) counts it out (off_path_words).
Every block of a persistent kernel must be resident at once (they wait on each other's counters), so a kernel is
only used on a GPU with at least as many SMs as it has queues; the bounded waits report a stall in `status`
instead of hanging, and the step raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tvm

from luce_runtime.device_views import layer_views
from luce_runtime.errors import ArtifactError, LuceError

NO_TOKEN = 2**31 - 1  # a masked row's id when its mask allowed no token
# every argument of a megakernel but its weights, which the launcher passes by name (tests/fuse check the emitter's
# list against it: an argument added to the emitter without it here made every GPU run fail, unseen until one ran)
KERNEL_ARGS = frozenset({"tokens", "lengths", "page_table", "pages", "kv_layer_offset", "arena", "amax_val", "amax_idx",
                         "token_out", "lengths_out", "tasks", "queue_len", "deps", "counters", "status", "profile",
                         "profiling", "epoch", "allowed", "masked", "off_path"})


MAX_TREE_ROWS = 32  # a row's off_path word has a bit for each of the 31 slots before its own


def off_path_words(parents: Sequence[int]) -> np.ndarray:
    """The off_path word of each node of a token tree fed as consecutive rows (node i at the i-th slot; parents[i]
    an earlier node, -1 for a root): bit k set where node i - k is not on node i's path from its root. A chain
    (parents i - 1) gives zeros. (n,) int32, the kernel's type."""
    n = len(parents)
    if n > MAX_TREE_ROWS:
        raise LuceError(f"megakernel: a token tree of {n} nodes; a verify's off_path words hold {MAX_TREE_ROWS}")
    words = np.zeros(n, dtype=np.uint32)
    paths: list[set[int]] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise LuceError(f"megakernel: node {i}'s parent {p} is not an earlier node of the tree")
        paths.append({i} | (paths[p] if p >= 0 else set()))
        for k in range(1, i + 1):
            if i - k not in paths[i]:
                words[i] |= np.uint32(1 << k)
    return words.view(np.int32)


class MegakernelError(LuceError, RuntimeError):
    """A megakernel step failed on the device (a block gave up waiting: the step's results are not usable)."""


class Kernel:
    """One batch size's kernel with its buffers on the device: the one launcher the engine (Megakernel), the GPU
    machine's kernel checks (scripts/megakernel_check.py) and the benchmarks use."""

    def __init__(self, fn, spec: dict, tables: dict, weights: dict, device, max_pages: int):
        self.fn, self.spec, self.batch = fn, spec, int(spec["batch"])
        b, dev = self.batch, device
        key = f"b{self.batch}_"
        self.tasks = tvm.runtime.tensor(tables[key + "tasks"], dev)
        self.queue_len = tvm.runtime.tensor(tables[key + "queue_len"], dev)
        self.deps = tvm.runtime.tensor(tables[key + "deps"], dev)
        n_queues, max_tasks = int(spec["n_queues"]), int(tables[key + "tasks"].shape[1])
        zeros = lambda shape, dtype: tvm.runtime.tensor(np.zeros(shape, dtype=dtype), dev)  # noqa: E731
        self.arena = zeros(int(spec["arena_size"]), np.float32)
        lm = max(1, int(spec["lm_tiles"]))
        self.amax_val, self.amax_idx = zeros((b, lm), np.float32), zeros((b, lm), np.int32)
        self.counters = zeros(int(spec["n_counters"]), np.int32)  # never reset: waits compare with count x epoch
        self.profile = zeros((n_queues, max_tasks, int(spec["profile_clocks"])), np.int64)
        self.status = zeros((n_queues, 4), np.int32)
        # A kernel argument must start its allocation (the compiled function refuses a view with a byte offset), so
        # each input is its own tensor. Uploads are skipped where the device already holds the values: tokens and
        # lengths ping-pong between two pairs of buffers, and a greedy step's inputs are the last step's outputs
        # (token_out = the argmax, lengths_out = lengths + 1); the page table is sent only when it changed. A
        # steady greedy step then copies nothing up and one small array back (the ids, with the gave-up marker
        # after them), a synchronous round trip of ~16 µs on the H200 against a step of ~0.5-1.5 ms.
        self.max_pages = max_pages
        # kernels built since 2026-12-02 write the step's epoch after the ids (token_out[b]) when a block gave up,
        # so one copy back tells both; older ones have b ids and the status is copied too
        self.marker = bool(spec.get("gave_up_marker"))
        n_tok = b + 1 if self.marker else b
        self.tok, self.len = [zeros(n_tok, np.int32), zeros(n_tok, np.int32)], [zeros(b, np.int32), zeros(b, np.int32)]
        self.cur = 0  # tok[cur], len[cur] are this step's inputs; the other pair its outputs
        self.expected: tuple[list[int], list[int]] | None = None  # the inputs the device holds after a step
        self.page_table_host = np.zeros((b, max_pages), dtype=np.int32)
        self.page_table_sent = np.full((b, max_pages), -1, dtype=np.int32)
        self._rows_sent: list[list[int]] | None = None  # each row's page ids as the device's table holds them
        self.page_table = zeros((b, max_pages), np.int32)
        self.uploads = 0  # host-to-device copies made, for tests and profiles
        self._lens: list[int] = []
        self.logits = self.arena._create_view((b, int(spec["vocab"])), "float32", 4 * int(spec["logits_at"]))
        self.weights = weights
        self.epoch = 0
        # a step's token masks (grammar-constrained greedy decoding): kernels built since 2026-12-02 take packed
        # bits per row and argmax over the allowed tokens on the device when `masked` is set; uploaded only then
        self.can_mask = "allowed" in spec["params"]
        self.mask_words = -(-int(spec["vocab"]) // 32)
        self.allowed = zeros((b, self.mask_words), np.int32) if self.can_mask else None
        self.masked = 0
        # a token tree's verify rows (kernels built since 2026-12-06, issue 39): each row's word of other branches'
        # keys, uploaded when it changes (zeros for decode steps and chains, so those upload nothing for it)
        self.can_tree = "off_path" in spec["params"]
        self.off_path = zeros(b, np.int32) if self.can_tree else None
        self.off_path_sent = np.zeros(b, dtype=np.int32)
        self._args: list[tuple | None] = [None, None]  # launch's argument lists, by which side is the input

    def launch(self, pages, kv_layer_offset, profiling: bool = False) -> None:
        self.epoch += 1
        c, o = self.cur, 1 - self.cur
        cached = self._args[c]
        if cached is None or cached[0] is not pages or cached[1] is not kv_layer_offset:
            # the argument list of each ping-pong side, made once: only `profiling` and `epoch` change a step
            named = {"tokens": self.tok[c], "lengths": self.len[c], "page_table": self.page_table, "pages": pages,
                     "kv_layer_offset": kv_layer_offset, "arena": self.arena, "amax_val": self.amax_val,
                     "amax_idx": self.amax_idx, "token_out": self.tok[o], "lengths_out": self.len[o],
                     "tasks": self.tasks, "queue_len": self.queue_len, "deps": self.deps, "counters": self.counters,
                     "status": self.status, "profile": self.profile, "profiling": 0, "epoch": 0,
                     "allowed": self.allowed, "masked": 0, "off_path": self.off_path}
            assert set(named) == KERNEL_ARGS
            params = self.spec["params"]
            cached = self._args[c] = (pages, kv_layer_offset,
                                      [named[n] if n in named else self.weights[n] for n in params],
                                      [i for i, n in enumerate(params) if n == "profiling"],
                                      [i for i, n in enumerate(params) if n == "epoch"],
                                      [i for i, n in enumerate(params) if n == "masked"])
        args = cached[2]
        for i in cached[3]:
            args[i] = int(profiling)
        for i in cached[4]:
            args[i] = self.epoch
        for i in cached[5]:
            args[i] = self.masked
        self.fn(*args)

    def relaunch(self, pages, kv_layer_offset, profiling: bool = False) -> None:
        """The next greedy step from this one's outputs, with no host work at all (the ids and lengths the kernel
        wrote are the next inputs): back-to-back steps for timing the device alone."""
        self.cur = 1 - self.cur
        self.expected = None
        self._lens = [n + 1 for n in self._lens]
        self.launch(pages, kv_layer_offset, profiling)

    def stage(self, tokens: Sequence[int], lengths: Sequence[int], pages: Sequence[Sequence[int]],
              allowed: np.ndarray | None = None, off_path: Sequence[int] | None = None) -> None:
        """Put one step's inputs on the device; rows past len(tokens) repeat the last real row. allowed: (n, words)
        int32 token masks for the argmax (a set bit allows the token), or None. off_path: each row's word of a
        token tree's other branches (off_path_words), or None: none (lengths are then positions too)."""
        n, b = len(tokens), self.batch
        rows = [*range(n), *([n - 1] * (b - n))]
        words = np.zeros(b, dtype=np.int32) if off_path is None else np.asarray(off_path, dtype=np.int32)[rows]
        if words.any() and not self.can_tree:
            raise LuceError(f"megakernel_b{b}: this kernel verifies no token trees (built before issue 39); "
                            "recompile the artifact to verify trees on the megakernel")
        if self.can_tree and not np.array_equal(words, self.off_path_sent):
            self.off_path.copyfrom(words)
            self.off_path_sent[:] = words
            self.uploads += 1
        self.masked = int(allowed is not None)
        if allowed is not None:
            if self.allowed is None:
                raise LuceError(f"megakernel_b{b}: this kernel takes no token masks (built before 2026-12-02); "
                                "recompile the artifact to mask on the device")
            self.allowed.copyfrom(np.ascontiguousarray(np.asarray(allowed, dtype=np.int32)[rows]))
            self.uploads += 1
        toks, lens = [int(tokens[i]) for i in rows], [int(lengths[i]) for i in rows]
        self.cur = 1 - self.cur  # the last step's outputs are now in tok[cur], len[cur]
        if (toks, lens) != self.expected:
            self.tok[self.cur].copyfrom(np.array(toks + [0] * self.marker, dtype=np.int32))
            self.len[self.cur].copyfrom(np.array(lens, dtype=np.int32))
            self.uploads += 2
        by_row = [list(pages[i]) for i in rows]
        if by_row != self._rows_sent:  # the table is rebuilt (and compared with the device's) only then
            table = self.page_table_host
            table[:] = 0
            for r, ids in enumerate(by_row):
                table[r, :len(ids)] = ids
            if not np.array_equal(table, self.page_table_sent):
                self.page_table.copyfrom(table)
                self.page_table_sent[:] = table
                self.uploads += 1
            self._rows_sent = by_row
        self.expected = None  # until the step's outputs are known (finish)
        self._lens = lens

    def finish(self) -> np.ndarray:
        """The step's greedy token per row (the kernel's on-device argmax: the lowest index of the largest logit,
        as numpy's argmax, among the allowed tokens on a masked step; -1 where the mask allowed none), after
        checking that no block gave up waiting: by the marker after the ids (one copy back), or for kernels without
        it by the blocks' status (a second copy, ~16 µs on the H200)."""
        out = self.tok[1 - self.cur].numpy()
        ids = out[:self.batch]
        if not self.marker or out[self.batch] == self.epoch:
            st = self.status.numpy()
            stuck = np.nonzero(st[:, 0])[0]
            if len(stuck):
                first = [(int(q), *map(int, st[q])) for q in stuck[:4]]
                raise MegakernelError(f"megakernel_b{self.batch}: {len(stuck)} blocks gave up waiting at step "
                                      f"{self.epoch} ((block, queue position + 1, counter, target, seen): {first}); "
                                      "serve with the per-op path (`--no-megakernel` when compiling) and report it.")
        self.expected = (ids.tolist(), [n + 1 for n in self._lens])
        return np.where(ids == NO_TOKEN, -1, ids) if self.masked else ids


class Megakernel:
    """The decode megakernels of an artifact, ready to launch on one device."""

    def __init__(self, root: Path, section: dict, device, params: dict[str, np.ndarray], max_context: int = 0):
        """max_context: the most tokens a sequence the caller steps holds (the engine's context; 0: the kernels'),
        which sizes the page tables of kernels that take any width."""
        self.batches = sorted(int(b) for b in section["batches"])
        module = tvm.runtime.load_module(str(root / section["module"]))
        with np.load(root / section["tables"]) as npz:
            tables = {k: npz[k] for k in npz.files}
        stacked, shareable = _stack_weights(section, params, device)
        # the per-op kernels' weights as views of the stacked ones: the GPU holds each weight once
        self.layer_views = {name: view for arg, layers in shareable.items()
                            for name, view in layer_views(stacked[arg], layers).items()}
        self.kernels = {}
        for spec in section["kernels"].values():
            weights = {n: stacked[n] for n in spec["weights"]}
            self.kernels[int(spec["batch"])] = Kernel(module[spec["name"]], spec, tables, weights, device,
                                                      self.table_pages(section, spec, max_context))
        # True: the next steps record each task's clocks (the GPU's global timer, ns): wait begins, body begins,
        # task ends, then a matvec body's phases; `profile` returns the last step's (benchmarks/h200/engine_profile)
        self.profiling = False
        self._last: Kernel | None = None

    @staticmethod
    def table_pages(section: dict, spec: dict, max_context: int = 0) -> int:
        """Page ids a row of a kernel's page table holds: the caller's context where the kernel takes a table of
        any width (built since 2026-12-06: its maximum context is the model's, up to 131,072 tokens, 8,192 ids a
        row that a 4K engine would upload for nothing), else the kernel's maximum context."""
        built = int(section["max_context"])
        width = min(max_context, built) if max_context and spec.get("page_table_any_width") else built
        return -(-width // int(section["page_size"]))

    @classmethod
    def refusal(cls, section: dict, *, kv_dtype: str, page_size: int, max_context: int, sm_count: int) -> str | None:
        """Why this engine cannot run the artifact's megakernels (None: it can). Models with sliding windows get
        them only from a build that asked (fuse/build.artifact_megakernels says why in the section otherwise): the
        kernel applies each row's window to the whole page table it is handed, the pages TVM keeps for every layer."""
        if "kernels" not in section:
            return f"the artifact has none: {section.get('skipped', 'not built')}"
        if section["kv_dtype"] != kv_dtype or int(section["page_size"]) != page_size:
            return (f"they were built for {section['kv_dtype']} pages of {section['page_size']} tokens, the cache "
                    f"holds {kv_dtype} pages of {page_size}")
        if max_context > int(section["max_context"]):
            return f"they serve contexts up to {section['max_context']} tokens, the engine {max_context}"
        need = max(int(k["n_queues"]) for k in section["kernels"].values())
        if sm_count < need:
            return f"they were planned for {need} SMs and this GPU has {sm_count}; recompile for this GPU"
        return None

    @property
    def can_mask(self) -> bool:
        """Whether every kernel takes token masks (step's `allowed`)."""
        return all(k.can_mask for k in self.kernels.values())

    @property
    def can_tree(self) -> bool:
        """Whether every kernel verifies token trees (step's `off_path`)."""
        return all(k.can_tree for k in self.kernels.values())

    def kernel_for(self, n: int) -> int | None:
        """The batch size of the kernel that steps n sequences (None: more than the largest)."""
        return next((b for b in self.batches if b >= n), None)

    def step(self, tokens: Sequence[int], lengths: Sequence[int], pages: Sequence[Sequence[int]],
             kv_pages, kv_layer_offset, *, logits: bool = True, allowed: np.ndarray | None = None,
             off_path: Sequence[int] | None = None, batch: int | None = None) -> np.ndarray:
        """One decode step: token i at position lengths[i] of the sequence whose page ids are pages[i] (covering
        that position); keys and values go into the cache's pages. The logits (n, vocab) float32, or with
        logits=False only each row's greedy token (n,) int32: the one copy back is then 4 bytes a row. allowed:
        (n, ceil(vocab / 32)) int32 token masks (token t is bit t % 32 of word t // 32) for the greedy ids (the
        logits stay the model's); a row that allows no token gets -1. off_path: a token tree's rows (lengths[i]
        is then row i's slot; off_path_words), None for a decode step or a chain. batch: the kernel's batch size
        (at least n; None: the smallest that takes n rows)."""
        n = len(tokens)
        k = self.kernels[batch if batch is not None and batch >= n else self.kernel_for(n)]
        k.stage(tokens, lengths, pages, allowed, off_path)
        k.launch(kv_pages, kv_layer_offset, self.profiling)
        self._last = k
        ids = k.finish()[:n]
        return k.logits.numpy()[:n] if logits else ids

    def profile(self) -> np.ndarray:
        """The last step's task clocks (blocks, tasks, clocks) int64 ns, recorded with `profiling` on (the
        compiler's fuse/program.profile_summary reads them against the kernel's program)."""
        if self._last is None:
            raise LuceError("megakernel: no step has run yet; set profiling = True and step first.")
        return self._last.profile.numpy()


def _stack_weights(section: dict, params: dict[str, np.ndarray], device) -> tuple[dict[str, object], dict]:
    """Each stacked weight argument: the per-op weights of its layers on a leading axis, in the kernel's dtype
    (norm vectors stored as float16 are widened; the rest are the per-op planes as they are), and for those kept
    as they are, the per-op names of their layers in order (their layers can be the per-op kernels' weights)."""
    out, shareable = {}, {}
    for spec in section["kernels"].values():
        for name, layers in spec["weights"].items():
            if name in out:
                continue
            missing = [p for p in layers if p not in params]
            if missing:
                raise ArtifactError(f"megakernel: weight {name} stacks {missing[:2]}, which the artifact does not "
                                    "hold; the artifact is damaged: recompile it.")
            dtype = spec["param_dtypes"][name]
            stacked = np.stack([np.asarray(params[p]) for p in layers])
            if str(stacked.dtype) != dtype:
                stacked = stacked.astype(dtype)
            elif len(set(layers)) == len(layers):
                shareable[name] = list(layers)
            out[name] = tvm.runtime.tensor(np.ascontiguousarray(stacked), device)
    return out, shareable
