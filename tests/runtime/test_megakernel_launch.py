"""The runtime side of a megakernel step, on the CPU with a kernel written in numpy in place of the CUDA one: what
the kernel is handed (tokens, lengths and page table, padding rows repeating the last real row, nothing uploaded
that the device already holds), what comes back (each row's id; the logits only when asked) and a stalled block
reported as an error. The CUDA kernel itself is checked on the H200 (scripts/device_check.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_runtime.megakernel import Kernel, Megakernel, MegakernelError

pytestmark = pytest.mark.unit

VOCAB, MAX_PAGES, QUEUES = 7, 3, 2


def spec(batch: int, marker: bool = False, masks: bool = False, trees: bool = False) -> dict:
    return {"batch": batch, "n_queues": QUEUES, "arena_size": 16 + 17 * VOCAB, "lm_tiles": 1, "n_counters": 4,
            "profile_clocks": 6, "vocab": VOCAB, "logits_at": 16, "gave_up_marker": marker,
            "params": ["tokens", "lengths", "page_table", "pages", "arena", "token_out", "lengths_out", "status",
                       "epoch", *(["allowed", "masked"] if masks else []), *(["off_path"] if trees else [])]}


class NumpyKernel:
    """Stands in for the compiled kernel: logits row r = token + page sum (one-hot at (token + pages) % VOCAB),
    token_out = its argmax, lengths_out = lengths + 1; `stall` sets a block's status as a bounded wait does, and
    with `marker` (kernels built since 2026-12-02) the step's epoch after the ids. With `masks` (since the same
    day) it takes token masks: logits fall from the hot token on (hot, hot + 1, ... mod VOCAB), and a masked step's
    id is the best allowed token, INT32_MAX where none is."""

    def __init__(self, batch: int, marker: bool = False, masks: bool = False, trees: bool = False):
        self.batch, self.seen, self.stall, self.marker, self.masks = batch, [], False, marker, masks
        self.params = spec(batch, marker, masks, trees)["params"]  # the order the launcher passes them in
        self.seen_masks: list[np.ndarray | None] = []
        self.seen_off_path: list[np.ndarray] = []

    def __call__(self, *args):
        a = {"allowed": None, "masked": 0, "off_path": None, **dict(zip(self.params, args, strict=True))}
        tokens, lengths, page_table, arena, token_out, lengths_out, status, epoch, allowed, masked, off_path = (
            a[n] for n in ("tokens", "lengths", "page_table", "arena", "token_out", "lengths_out", "status", "epoch",
                           "allowed", "masked", "off_path"))
        t, n, pt = tokens.numpy()[:self.batch], lengths.numpy(), page_table.numpy()
        self.seen.append((t.copy(), n.copy(), pt.copy()))
        self.seen_masks.append(allowed.numpy().copy() if masked else None)
        if off_path is not None:
            self.seen_off_path.append(off_path.numpy().copy())
        hot = (t + pt.sum(axis=1)) % VOCAB
        logits = np.zeros((self.batch, VOCAB), np.float32)
        logits[np.arange(self.batch), hot] = 1.0
        if self.masks:
            logits = -((np.arange(VOCAB)[None, :] - hot[:, None]) % VOCAB).astype(np.float32)
        if masked:
            bits = np.unpackbits(allowed.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :VOCAB].astype(bool)
            hot = np.where(bits.any(axis=-1), np.argmax(np.where(bits, logits, -np.inf), axis=-1), 2**31 - 1)
        a = arena.numpy()
        a[16:16 + logits.size] = logits.reshape(-1)
        arena.copyfrom(a)
        mark = [epoch if self.stall else 0] if self.marker else []
        token_out.copyfrom(np.array([*hot, *mark], np.int32))
        lengths_out.copyfrom((n + 1).astype(np.int32))
        st = np.zeros((QUEUES, 4), np.int32)
        if self.stall:
            st[1] = (3, 9, 8, 5)
        status.copyfrom(st)


def megakernel(batches=(1, 4), marker: bool = False, masks: bool = False,
               trees: bool = False) -> tuple[Megakernel, dict[int, NumpyKernel]]:
    mk = Megakernel.__new__(Megakernel)
    mk.batches, mk.profiling, mk._last = sorted(batches), False, None
    fns = {b: NumpyKernel(b, marker, masks, trees) for b in batches}
    tables = {f"b{b}_{f}": np.zeros((QUEUES, 2, 14) if f == "tasks" else (QUEUES,), np.int32)
              for b in batches for f in ("tasks", "queue_len", "deps")}
    mk.kernels = {b: Kernel(fns[b], spec(b, marker, masks, trees), tables, {}, tvm.cpu(0), MAX_PAGES)
                  for b in batches}
    return mk, fns


class _CountedReads:
    def __init__(self, tensor):
        self.tensor, self.reads = tensor, 0

    def numpy(self):
        self.reads += 1
        return self.tensor.numpy()

    def copyfrom(self, array):  # the kernel's write
        self.tensor.copyfrom(array)


def test_with_the_marker_a_step_copies_back_only_the_ids_and_still_fails_a_stalled_block():
    """Kernels that write the gave-up marker after the ids: a step whose blocks all finished never reads their
    status (one synchronizing copy back, not two); a stalled block still fails the step, with its status."""
    mk, fns = megakernel(marker=True)
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    k = mk.kernels[1]
    k.status = _CountedReads(k.status)
    tokens, lengths = [3], [10]
    for _ in range(3):
        tokens = mk.step(tokens, lengths, [[1]], pages, None, logits=False).tolist()
        lengths = [lengths[0] + 1]
    assert k.status.reads == 0 and tokens == [(((3 + 1) % VOCAB + 1) % VOCAB + 1) % VOCAB]
    assert fns[1].seen[-1][0].tolist() == [tokens[0] - 1 if tokens[0] else VOCAB - 1]
    fns[1].stall = True
    with pytest.raises(MegakernelError, match="1 blocks gave up waiting"):
        mk.step(tokens, lengths, [[1]], pages, None, logits=False)
    assert k.status.reads == 1


def test_a_step_hands_each_row_its_inputs_and_pads_with_the_last_row():
    mk, fns = megakernel()
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    ids = mk.step([3, 5, 6], [10, 20, 30], [[1], [2, 4], [5, 6, 0]], pages, None, logits=False)
    tokens, lengths, table = fns[4].seen[-1]
    assert tokens.tolist() == [3, 5, 6, 6] and lengths.tolist() == [10, 20, 30, 30]
    assert table.tolist() == [[1, 0, 0], [2, 4, 0], [5, 6, 0], [5, 6, 0]]
    assert ids.tolist() == [(3 + 1) % VOCAB, (5 + 6) % VOCAB, (6 + 11) % VOCAB]
    logits = mk.step([3, 5, 6], [11, 21, 31], [[1], [2, 4], [5, 6, 0]], pages, None)
    assert logits.shape == (3, VOCAB) and np.argmax(logits, axis=-1).tolist() == ids.tolist()
    # a smaller step runs the batch-1 kernel, and a new step's page table holds no row of the last one
    assert mk.step([2], [4], [[3]], pages, None, logits=False).tolist() == [5]
    assert fns[1].seen[-1][2].tolist() == [[3, 0, 0]]
    # batch: the kernel a batch-invariant engine runs for every step, padded as any
    assert mk.step([2], [4], [[3]], pages, None, logits=False, batch=4).tolist() == [5]
    assert fns[4].seen[-1][0].tolist() == [2, 2, 2, 2]


def test_a_stalled_block_fails_the_step():
    mk, fns = megakernel()
    fns[1].stall = True
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    with pytest.raises(MegakernelError, match="1 blocks gave up waiting"):
        mk.step([1], [1], [[0]], pages, None, logits=False)


def test_a_greedy_loop_copies_nothing_up_once_running():
    """Each step's inputs are the last step's outputs (the argmax, lengths + 1) on the same pages: no upload."""
    mk, fns = megakernel()
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    k = mk.kernels[4]
    tokens, lengths, table = [3, 5], [10, 20], [[1, 2], [4, 0]]
    for step in range(4):
        before = k.uploads
        ids = mk.step(tokens, lengths, table, pages, None, logits=False).tolist()
        seen_tokens, seen_lengths, _ = fns[4].seen[-1]
        assert seen_tokens.tolist() == [*tokens, tokens[-1], tokens[-1]]
        assert seen_lengths.tolist() == [*lengths, lengths[-1], lengths[-1]]
        assert k.uploads - before == (3 if step == 0 else 0)
        tokens, lengths = ids, [n + 1 for n in lengths]
    # a token the caller chose itself (a sampled one) is sent; a new page is sent
    mk.step([tokens[0], 6], lengths, [[1, 2], [4, 7]], pages, None, logits=False)
    assert k.uploads - before == 3 and fns[4].seen[-1][0].tolist() == [tokens[0], 6, 6, 6]


def _packed(allowed: list[int]) -> np.ndarray:
    bits = np.zeros(32, bool)
    bits[allowed] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_a_masked_step_hands_each_row_its_mask_and_returns_the_best_allowed_ids():
    """Grammar-constrained greedy steps: each row's packed mask goes up (padding rows repeat the last real row's),
    the kernel is told to apply them, the ids are the argmax over the allowed tokens as the host's masked_argmax
    computes it (-1 for a row that allows none); the next unmasked step is not masked."""
    from luce_runtime.sampler import masked_argmax

    mk, fns = megakernel(marker=True, masks=True)
    assert mk.can_mask
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    tokens, lengths, table = [3, 5, 6], [10, 20, 30], [[1], [2, 4], [5, 6, 0]]
    masks = np.stack([_packed([0, 2]), _packed([]), _packed([1, 4, 5, 6])])
    ids = mk.step(tokens, lengths, table, pages, None, logits=False, allowed=masks)
    seen = fns[4].seen_masks[-1]
    assert seen.tolist() == [*masks.tolist(), masks[-1].tolist()]
    logits = mk.step(tokens, [n + 1 for n in lengths], table, pages, None)  # the same rows, unmasked
    assert fns[4].seen_masks[-1] is None
    assert ids.tolist() == masked_argmax(logits, masks).tolist() and ids[1] == -1
    assert ids.tolist() != np.argmax(logits, axis=-1).tolist()  # the masks changed the answer


def test_masks_refused_by_a_kernel_built_without_them():
    mk, _ = megakernel(marker=True)
    assert not mk.can_mask
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    with pytest.raises(Exception, match="takes no token masks"):
        mk.step([3], [10], [[1]], pages, None, logits=False, allowed=_packed([1])[None])


def test_page_tables_are_as_wide_as_the_engines_context_and_long_contexts_are_served():
    """Kernels built since 2026-12-06 cover the model's trained context (131,072 tokens for Llama 3.1) and take a
    page table of any width: the engine's rows hold its own context's pages (a 4K engine uploads 256 ids a row, not
    8,192); older kernels keep the width they were built with. An engine at any context up to the kernels' runs
    them; past it, the per-op path."""
    section = {"max_context": 131072, "page_size": 16, "kv_dtype": "float16",
               "kernels": {"1": {"n_queues": QUEUES}}}
    new, old = {"page_table_any_width": True}, {}
    assert Megakernel.table_pages(section, new, 4096) == 256
    assert Megakernel.table_pages(section, new, 32769) == 2049
    assert Megakernel.table_pages(section, new) == Megakernel.table_pages(section, old, 4096) == 8192
    ask = {"kv_dtype": "float16", "page_size": 16, "sm_count": QUEUES}
    assert Megakernel.refusal(section, max_context=131072, **ask) is None
    assert "up to 4096 tokens" in Megakernel.refusal({**section, "max_context": 4096}, max_context=32768, **ask)


def test_off_path_words_mark_each_nodes_keys_off_its_path_and_count_its_depth(rng):
    """A token tree's rows (Engine.verify_tree on the megakernel): bit k of node i's word is set exactly where node
    i - k is not an ancestor of node i, so the kernel's RoPE position (slot - popcount) is the node's depth; a
    chain's words are all zero (the chain verify the kernel ran before trees)."""
    from luce_runtime.megakernel import MAX_TREE_ROWS, off_path_words

    assert off_path_words([-1, 0, 1, 2]).tolist() == [0, 0, 0, 0]
    assert off_path_words([-1, 0, 0, 1, 2]).tolist() == [0, 0, 0b10, 0b10, 0b1010]
    for n in (2, 7, MAX_TREE_ROWS):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        words = off_path_words(parents)
        assert words.dtype == np.int32
        for i, word in enumerate(words.view(np.uint32).tolist()):
            path, node = set(), i
            while node >= 0:
                path.add(node)
                node = parents[node]
            assert {i - k for k in range(32) if word >> k & 1} == set(range(i + 1)) - path
            assert i - bin(word).count("1") == len(path) - 1  # the node's depth
    with pytest.raises(Exception, match="32"):
        off_path_words([-1, *range(MAX_TREE_ROWS)])
    with pytest.raises(Exception, match="not an earlier node"):
        off_path_words([-1, 1])


def test_a_tree_step_hands_each_row_its_off_path_word_and_uploads_it_only_when_it_changes():
    """The rows of a token tree get their words (padding rows repeat the last real row's); a decode step or a chain
    after it gets zeros, sent once; steady decode steps send nothing for it."""
    from luce_runtime.megakernel import off_path_words

    mk, fns = megakernel(marker=True, trees=True)
    assert mk.can_tree
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    k = mk.kernels[4]
    words = off_path_words([-1, 0, 0])
    mk.step([3, 5, 6], [10, 11, 12], [[1]] * 3, pages, None, logits=False, off_path=words)
    assert fns[4].seen_off_path[-1].tolist() == [0, 0, 2, 2]
    before = k.uploads
    mk.step([3, 5, 6], [10, 11, 12], [[1]] * 3, pages, None, logits=False, off_path=words)
    assert k.uploads - before == 2  # the same tree again: its tokens and lengths, not its words
    before = k.uploads
    mk.step([3, 5], [20, 21], [[1]] * 2, pages, None, logits=False)
    assert fns[4].seen_off_path[-1].tolist() == [0, 0, 0, 0] and k.uploads - before == 3  # and the words
    ids = mk.step([3, 5], [30, 31], [[1]] * 2, pages, None, logits=False).tolist()
    before = k.uploads
    mk.step(ids, [31, 32], [[1]] * 2, pages, None, logits=False)
    assert k.uploads == before


def test_trees_refused_by_a_kernel_built_without_them():
    from luce_runtime.megakernel import off_path_words

    mk, fns = megakernel(marker=True, masks=True)
    assert not mk.can_tree
    pages = tvm.runtime.tensor(np.zeros(4, np.float32), tvm.cpu(0))
    mk.step([3, 5], [10, 11], [[1]] * 2, pages, None, logits=False, off_path=off_path_words([-1, 0]))  # a chain
    with pytest.raises(Exception, match="verifies no token trees"):
        mk.step([3, 5, 6], [10, 11, 12], [[1]] * 3, pages, None, logits=False, off_path=off_path_words([-1, 0, 0]))
