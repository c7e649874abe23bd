"""The engine's public API on a compiled tiny model: fork, rollback, the one KV pool, and the error boundary (a step
that fails, injected at the compiled function, leaves every sequence and the page pool as they were).

Each check compares logits with the same work done without the feature (float32 on both sides, same kernels), so
the tolerance is float rounding of a different batch composition (1e-5 relative)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.faults import fails_on_call

pytestmark = pytest.mark.e2e

TOL = 1e-5


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@pytest.fixture()
def engine(tiny, engine_of):
    engine = engine_of(tiny("tiny-llama"), max_batch=4, max_context=128, prefill_chunk=16)
    assert engine.sequences() == {} and engine.free_pages() == engine.total_pages
    yield engine
    for seq in engine.sequences():
        engine.remove_sequence(seq)


def prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def test_fork_shares_the_prefix_and_continues_like_the_parent(engine, rng):
    p = prompt(rng, 40, engine.vocab_size)
    parent = engine.add_sequence()
    want = engine.prefill([parent], [p])[0]
    free_before_fork = engine.free_pages()
    child = engine.fork_sequence(parent)
    assert engine.length(child) == 40
    assert engine.free_pages() >= free_before_fork - 1  # shared pages, at most one copied partial page
    nxt = int(np.argmax(want))
    a, b = engine.decode([parent, child], [nxt, nxt])
    assert rel_err(b, a) < TOL
    # a fork at a shorter length continues from there: the same logits as prefilling that prefix anew
    short = engine.fork_sequence(parent, 20)
    got = engine.prefill([short], [p[20:]])[0]
    assert rel_err(got, want) < TOL
    with pytest.raises(Exception, match="cannot fork"):
        engine.fork_sequence(parent, 42)


def test_rollback_undoes_tokens_and_frees_their_pages(engine, rng):
    p = prompt(rng, 30, engine.vocab_size)
    seq = engine.add_sequence()
    engine.prefill([seq], [p])
    free_at_30 = engine.free_pages()
    first = engine.decode([seq], [5])[0]
    engine.prefill([seq], [prompt(rng, 20, engine.vocab_size)])  # into new pages
    assert engine.free_pages() < free_at_30
    engine.rollback(seq, 21)
    assert engine.length(seq) == 30 and engine.free_pages() == free_at_30
    again = engine.decode([seq], [5])[0]
    assert rel_err(again, first) < TOL
    with pytest.raises(Exception, match="cannot roll back"):
        engine.rollback(seq, 32)


def test_a_failed_decode_leaves_the_pool_as_it_was(engine, rng, monkeypatch):
    seqs = [engine.add_sequence() for _ in range(2)]
    prompts = [prompt(rng, n, engine.vocab_size) for n in (17, 33)]
    engine.prefill(seqs, prompts)
    lengths, free = engine.sequences(), engine.free_pages()
    monkeypatch.setitem(engine._fns, "decode", fails_on_call(engine._fns["decode"], 1))
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.decode(seqs, [3, 4])
    assert engine.sequences() == lengths and engine.free_pages() == free
    monkeypatch.undo()
    got = engine.decode(seqs, [3, 4])
    # the same step on fresh sequences that never saw the fault
    fresh = [engine.add_sequence() for _ in range(2)]
    engine.prefill(fresh, prompts)
    want = engine.decode(fresh, [3, 4])
    assert rel_err(got, want) < TOL


def test_a_failed_prefill_chunk_rolls_back_the_chunks_before_it(engine, rng, monkeypatch):
    head, tail = prompt(rng, 5, engine.vocab_size), prompt(rng, 48, engine.vocab_size)
    seq = engine.add_sequence()
    engine.prefill([seq], [head])
    free = engine.free_pages()
    third_chunk_fails = fails_on_call(engine._fns["prefill"], 3)
    monkeypatch.setitem(engine._fns, "prefill", third_chunk_fails)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.prefill([seq], [tail])  # chunks of 16, 16, 16: the last one crosses into a fourth page
    assert third_chunk_fails.calls == 3 and engine.length(seq) == 5 and engine.free_pages() == free
    monkeypatch.undo()
    got = engine.prefill([seq], [tail])[0]
    fresh = engine.add_sequence()
    assert rel_err(got, engine.prefill([fresh], [head + tail])[0]) < TOL


def test_bad_steps_are_refused_before_the_cache_is_touched(engine):
    seq = engine.add_sequence()
    for bad in ([engine.vocab_size], [-1]):
        with pytest.raises(Exception, match="outside the vocabulary"):
            engine.prefill([seq], [bad])
    with pytest.raises(Exception, match="twice"):
        engine.decode([seq, seq], [1, 2])
    with pytest.raises(Exception, match="not live"):
        engine.decode([seq + 100], [1])
    assert engine.length(seq) == 0 and engine.free_pages() == engine.total_pages


def test_sequence_context_removes_on_error(engine):
    with pytest.raises(KeyError), engine.sequence() as seq:
        assert engine.length(seq) == 0
        raise KeyError("boom")
    assert engine.sequences() == {}


def test_the_engine_refuses_an_artifact_without_its_contract(tiny, tmp_path):
    import json
    import shutil

    from luce_runtime.artifact import MANIFEST
    from luce_runtime.contract import CONTRACT_VERSION, RuntimeContract
    from luce_runtime.engine import Engine
    from luce_runtime.errors import ArtifactError

    src = tiny("tiny-llama").artifact
    manifest = json.loads((src / MANIFEST).read_text())
    assert RuntimeContract.from_manifest(manifest, src).contract_version == CONTRACT_VERSION
    for change, message in [(lambda r: r.clear(), "no runtime contract"),
                            (lambda r: r.update(contract_version=CONTRACT_VERSION + 1), "newer"),
                            (lambda r: r.update(functions=["prefill"]), "lacks the functions"),
                            (lambda r: r.update(kv_cache_args=["page_size"]), "create_kv_cache")]:
        art = tmp_path / f"art{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, art)
        m = json.loads((art / MANIFEST).read_text())
        change(m["runtime"])
        (art / MANIFEST).write_text(json.dumps(m))
        with pytest.raises(ArtifactError, match=message) as err:
            Engine(art, verify=False)
        assert "recompile" in str(err.value)


def test_decode_greedy_is_the_argmax_of_decode(engine, rng):
    """decode_greedy (only ids back where the device takes the argmax) steps like decode + numpy's argmax: two
    sequences of one prompt, one stepped each way, produce the same ids and keep equal lengths."""
    p = prompt(rng, 24, engine.vocab_size)
    a, b = engine.add_sequence(), engine.add_sequence()
    first = int(np.argmax(engine.prefill([a, b], [p, p])[0]))
    ta = tb = first
    for _ in range(6):
        ta = int(np.argmax(engine.decode([a], [ta])[0]))
        (tb,) = engine.decode_greedy([b], [tb])
        assert tb == ta
    assert engine.length(a) == engine.length(b) == 30
    with pytest.raises(Exception, match="is not live"):
        engine.decode_greedy([12345], [1])


def test_decode_greedy_under_masks_is_the_best_allowed_token(engine, rng):
    """decode_greedy with grammar masks (llguidance's packing): a masked row's id is its logits' argmax over the
    allowed tokens, an unmasked row's the plain argmax, -1 where a mask allows none; three sequences of one prompt
    fed the same tokens, one stepped by decode for the logits."""
    vocab = engine.vocab_size
    p = prompt(rng, 20, vocab)
    a, b, c = (engine.add_sequence() for _ in range(3))
    t = int(np.argmax(engine.prefill([a, b, c], [p, p, p])[0]))
    for step in range(4):
        logits = engine.decode([a], [t])[0]
        allowed = rng.random(vocab) < 0.5
        allowed[int(np.argmax(logits))] = False  # the mask must move the answer
        if step == 3:
            allowed[:] = False
        words = np.packbits(np.pad(allowed, (0, -vocab % 32)), bitorder="little").view(np.int32)
        got_b, got_c = engine.decode_greedy([b, c], [t, t], [words, None])
        want = int(np.argmax(np.where(allowed, logits, -np.inf))) if allowed.any() else -1
        assert (got_b, got_c) == (want, int(np.argmax(logits)))
        t = got_c
    with pytest.raises(Exception, match="2 token masks for 1 sequences"):
        engine.decode_greedy([a], [t], [None, words])


def test_the_engine_keeps_the_megakernel_only_where_it_measured_faster(engine, monkeypatch):
    """_choose_decode_paths times both paths per number of sequences, and a verify of the largest kernel's rows,
    and routes decode and verify by the result. The CUDA megakernel is stood in for by a step that takes no time for
    rows of one sequence (a decode of one, a verify) and 1 s for more sequences (a per-op step of the tiny model
    takes a few ms, hundreds on a 2-core machine loaded by builds)."""
    import time

    from luce_runtime import engine as engine_module

    calls = []

    def fake_rows(seq_ids, feeds, logits=True, allowed=None):
        calls.append([len(f) for f in feeds])
        time.sleep(0 if len(seq_ids) == 1 else 1.0)  # past a per-op step on a loaded machine (0.2 s was not)
        engine._live.update({s: engine._live[s] + len(f) for s, f in zip(seq_ids, feeds, strict=True)})
        rows = sum(len(f) for f in feeds)
        return np.zeros(rows, np.int32) if not logits else np.zeros((rows, engine.vocab_size))

    monkeypatch.setattr(engine, "_megakernel_rows", fake_rows)
    engine.megakernel, engine._mk_sizes, engine._mk_pages, engine._mk_verify_rows = object(), {1, 2, 3}, {}, 3
    engine._choose_decode_paths(context=8, steps=2)
    assert engine._mk_sizes == {1} and engine.decode_path.startswith("megakernel for 1 sequences, verify of up to 3")
    assert set(engine.decode_timings_us) == {1, 2, 3} and set(engine.verify_timings_us) == {3}
    assert engine.sequences() == {} and engine.verify_rows_at_decode_cost == 3
    a, b = engine.add_sequence(), engine.add_sequence()
    engine.prefill([a, b], [[1, 2, 3], [4, 5, 6]])
    calls.clear()
    engine.decode_greedy([a], [7])
    engine.decode_greedy([a, b], [7, 8])  # two sequences: the per-op kernels
    assert engine.verify_greedy([b], [[9, 10, 11]]) == [[0, 0, 0]]  # three rows of one sequence: the megakernel
    engine.verify([a, b], [[1, 2], [3, 4]])  # four rows: more than the largest kernel's, the per-op verify
    assert calls == [[1], [3]] and engine.length(a) == 7 and engine.length(b) == 9
    monkeypatch.setattr(engine_module, "median_time", lambda fn, *a, **k: (fn(), 1.0)[1] if fn else 1.0)
    engine._mk_sizes = {1}
    engine._choose_decode_paths(context=8, steps=1)  # a tie is no gain: the per-op path stays
    assert engine.megakernel is None and "slower at every batch size" in engine.decode_path
    assert engine_module._ranges({1, 2, 3, 5, 7, 8}) == "1-3, 5, 7-8"


def test_an_engine_with_megakernels_times_its_paths_at_load(tiny, monkeypatch):
    """Engine.__init__ with megakernels and megakernel="auto" times a decode step on them at load, through
    _megakernel_step into _megakernel_rows, which reads the engine's batch-invariance choice (_mk_batch) for
    Megakernel.step: every attribute a step reads is set before the timing. The H100's 8B engine died at load on
    that read (2026-12-07: assigned after). The CUDA megakernel and its rows are stood in for."""
    from luce_runtime.engine import Engine, EngineOptions

    class StandIn:
        batches = [1, 2]
        layer_views: dict = {}

    def load(self, weights):
        self.decode_path, self._mk_pages = "megakernel for 1-2 sequences, per-op above", {}
        return StandIn()

    batches = []

    def rows(self, seq_ids, feeds, logits=True, allowed=None):
        batches.append(self._mk_batch)  # what the real one passes to Megakernel.step
        self._live.update({s: self._live[s] + len(f) for s, f in zip(seq_ids, feeds, strict=True)})
        n = sum(len(f) for f in feeds)
        return np.zeros(n, np.int32) if not logits else np.zeros((n, self.vocab_size))

    monkeypatch.setattr(Engine, "_load_megakernel", load)
    monkeypatch.setattr(Engine, "_megakernel_rows", rows)
    engine = Engine(tiny("tiny-llama").artifact, EngineOptions(max_batch=2, max_context=128, prefill_chunk=16))
    assert batches and set(batches) == {None} and set(engine.decode_timings_us) == {1, 2}
    assert engine.sequences() == {}


def test_a_batch_invariant_engine_decodes_each_row_as_alone(tiny, engine_of, rng, monkeypatch):
    """EngineOptions.batch_invariant (serve --deterministic): the f32 CPU build's decode runs a row a call (its
    DECODE1 and DECODE functions sum in other orders), so three sequences decoded together get exactly their logits
    alone; with a megakernel, steps run the largest kernel in groups of its rows (stood in for here: the CUDA
    kernel's row invariance is checked on the device, scripts/device_check.py run --served)."""
    from luce_runtime.serve.scheduler import Scheduler

    model = tiny("tiny-llama")
    plain = engine_of(model, max_batch=4, max_context=128, prefill_chunk=16)
    engine = engine_of(model, max_batch=4, max_context=128, prefill_chunk=16, batch_invariant=True)
    assert plain.invariant_rows == 0 and engine.invariant_rows == 1
    assert engine.decode_path.endswith("a row a call (batch_invariant)")
    with pytest.raises(ValueError, match="batch_invariant=True"):
        Scheduler(plain, max_batch=4, deterministic=True)
    prompts = [prompt(rng, n, engine.vocab_size) for n in (5, 9, 3)]
    tokens = [int(t) for t in rng.integers(0, engine.vocab_size, 3)]
    seqs = [engine.add_sequence() for _ in prompts]
    engine.prefill(seqs, prompts)
    together = engine.decode(seqs, tokens)
    ids = engine.decode_greedy(seqs, tokens[::-1])
    for s in seqs:
        engine.remove_sequence(s)
    for i, p in enumerate(prompts):
        s = engine.add_sequence()
        engine.prefill([s], [p])
        assert np.array_equal(engine.decode([s], [tokens[i]])[0], together[i])
        assert engine.decode_greedy([s], [tokens[::-1][i]]) == [ids[i]]
        engine.remove_sequence(s)

    calls = []

    def fake_rows(seq_ids, feeds, logits=True, allowed=None):
        calls.append(len(seq_ids))
        engine._live.update({s: engine._live[s] + len(f) for s, f in zip(seq_ids, feeds, strict=True)})
        return np.zeros(len(seq_ids), np.int32) if not logits else np.zeros((len(seq_ids), engine.vocab_size))

    monkeypatch.setattr(engine, "_megakernel_rows", fake_rows)
    monkeypatch.setattr(engine, "_mk_sizes", {1, 2, 3})
    monkeypatch.setattr(engine, "_mk_batch", 3)
    seqs = [engine.add_sequence() for _ in range(4)]
    try:
        engine.prefill(seqs, [[1, 2]] * 4)
        assert engine.invariant_rows == 3
        assert engine.decode_greedy(seqs, [5, 6, 7, 8]) == [0] * 4 and engine.decode(seqs[:2], [1, 2]).shape[0] == 2
        assert calls == [3, 1, 2]
    finally:
        for s in seqs:
            engine.remove_sequence(s)


def test_non_finite_logits_are_reported_never_taken_as_a_token(tiny, engine_of, rng):
    """A step whose logits hold NaN (here: one token's embedding row poisoned, in a model whose LM head is not the
    embedding) is an error naming the sequence and position, on decode, decode_greedy and prefill alike; a 7B of
    random weights once passed the device argmax of a NaN row (2**31 - 1) on as the next token."""
    from luce_runtime.engine import NonFiniteLogitsError

    engine = engine_of(tiny("tiny-qwen2"), max_batch=4, max_context=128, prefill_chunk=16)

    bad = 7
    names = [p["name"] for p in engine.artifact.manifest["weights"]["params"]]
    poisoned = 0
    for name, tensor in zip(names, engine.params, strict=True):
        values = tensor.numpy()
        if name.startswith("token_embd") and values.dtype.kind == "f" and values.ndim == 2:
            values[bad] = np.nan  # the row's scales (a quantized embedding) or values
            tensor.copyfrom(values)
            poisoned += 1
    assert poisoned

    def fresh_pair() -> list[int]:  # a NaN key stays in its sequence's pages: each check takes new sequences
        for seq in engine.sequences():
            engine.remove_sequence(seq)
        seqs = [engine.add_sequence() for _ in range(2)]
        engine.prefill(seqs, [[t if t != bad else bad + 1 for t in prompt(rng, 9, engine.vocab_size)] for _ in seqs])
        return seqs

    seqs = fresh_pair()
    with pytest.raises(NonFiniteLogitsError, match=rf"1 of 2 rows .*: sequence {seqs[1]} at position 9\."):
        engine.decode(seqs, [3, bad])
    seqs = fresh_pair()
    with pytest.raises(NonFiniteLogitsError, match=rf"1 of 2 rows .*: sequence {seqs[0]} at position 9\."):
        engine.decode_greedy(seqs, [bad, 3])
    fresh = fresh_pair()[0]
    with pytest.raises(NonFiniteLogitsError, match=rf"sequence {fresh} at position 13\."):
        engine.prefill([fresh], [[3, 4, 5, 6, bad]])  # its last row, after the 9 tokens it holds
