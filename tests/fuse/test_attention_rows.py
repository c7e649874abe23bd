"""The attention body that reads key rows across a warp's lanes (fuse/emit_cuda/attention_rows.py, attn_rows): its
lane layouts, its reduce-scatter (the emitter's own function, run here over numpy arrays of 32 lanes with shuffles
as index permutations, so every lane's kept score is checked against the sums it must hold), and the CUDA it emits:
every load of a step's key rows a vector load issued before the arithmetic, no 2-byte loads of the pages, the
collectives reached by whole warps, the same body at every batch size. The kernel's numbers are checked on the GPU
(scripts/megakernel_check.py, the oracle at short and long contexts)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from luce_compile.fuse.emit_cuda import emit_megakernel
from luce_compile.fuse.emit_cuda.attention_rows import kept_index, reduce_scatter, rows_layout, scatter_steps
from luce_compile.fuse.options import MegakernelOptions
from luce_compile.fuse.program import build_program
from luce_compile.graph.registry import open_graph
from luce_compile.synthetic import cached_synthetic, preset
from tests.fuse.test_emit_cuda import PRESETS, cuda_source, divergent_collectives

pytestmark = pytest.mark.unit
ROWS = MegakernelOptions(attn_rows=True)


def scatter_emulated(parts: np.ndarray, lanes: int) -> tuple[list[np.ndarray], list]:
    """parts (32 lanes, n partials) through reduce_scatter with numpy standing in for the warp."""
    steps, kept, padded = scatter_steps(parts.shape[1], lanes)
    lane = np.arange(32)
    vals = [parts[:, k] if k < parts.shape[1] else np.zeros(32) for k in range(padded)]
    out = reduce_scatter(vals, steps, lane, np.where, lambda v, mask: v[lane ^ mask], lambda k, v: v)
    assert len(out) == kept
    return out, steps


@pytest.mark.parametrize("n", [1, 2, 3, 8, 12, 16, 24, 30, 32, 40, 64])
@pytest.mark.parametrize("lanes", [4, 8, 16, 32])
def test_each_lane_keeps_the_whole_sums_of_its_indices(n, lanes):
    """Every kept value is the sum over its row's lanes of the partial it names; each index below n is kept by
    exactly one lane of each row that is not a copy (padding lies past n only: an odd list padded mid-way would
    shift the later indices onto their neighbours')."""
    rng = np.random.default_rng(n * 64 + lanes)
    parts = rng.standard_normal((32, n))
    out, steps = scatter_emulated(parts, lanes)
    copies = sum(mask for mask, half in steps if not half)
    for row in range(32 // lanes):
        sums = parts[row * lanes:(row + 1) * lanes].sum(axis=0)
        held = []
        for lane in range(row * lanes, (row + 1) * lanes):
            first = kept_index(steps, lane)
            for f, value in enumerate(out):
                if first + f < n:
                    assert value[lane] == pytest.approx(sums[first + f], abs=1e-12)
                    if lane & copies == 0:
                        held.append(first + f)
        assert sorted(held) == list(range(n))


def test_the_scatter_costs_one_shuffle_a_kept_value_and_step():
    """32 partials over 32 lanes: 16 + 8 + 4 + 2 + 1 = 31 shuffles (a butterfly a value: 160), one score a lane."""
    steps, kept, padded = scatter_steps(32, 32)
    assert (sum(max(half, 1) for _, half in steps), kept, padded) == (31, 1, 32)
    assert scatter_steps(24, 16)[1:] == (2, 32)  # SmolLM2's 8 keys x 3 heads over 16 lanes: padded at the end
    assert scatter_steps(16, 32)[1:] == (1, 16)  # Qwen3-0.6B's 8 keys x 2 heads: the last step sums copies


@pytest.mark.parametrize("d,group,bits,expect", [
    (128, 4, 16, (4, 32, 1, 8, 2)),  # the 8B: 8-byte words, a warp a row, 8 keys a step
    (64, 4, 16, (4, 16, 2, 8, 2)),  # the 1B: two rows a warp instruction
    (256, 4, 16, (8, 32, 1, 4, 4)),  # 16-byte words, 4 keys a step (32 registers of K and V)
    (128, 7, 16, (4, 32, 1, 4, 2)),  # a large group: fewer slots (its partials within 32)
    (128, 4, 32, (4, 32, 1, 4, 4)),  # float32 pages: 16-byte words
    (16, 2, 16, (4, 4, 8, 8, 2)),  # tiny-llama: 8 rows a warp instruction
])
def test_rows_layouts(d, group, bits, expect):
    lay = rows_layout(d, group, bits)
    assert (lay.vec, lay.lanes, lay.rows, lay.slots, lay.words) == expect
    assert lay.stride % 4 == 0 and lay.stride >= lay.padded >= lay.partials


@pytest.mark.parametrize("d,bits", [(96, 16), (80, 16), (512, 16), (128, 8)])
def test_rows_decline_what_does_not_split_into_whole_lanes(d, bits):
    assert rows_layout(d, 4, bits) is None


def attention_body(source: str) -> str:
    """The attention opcode's branch of the kernel: from its chunk bounds to the combine's barrier."""
    start = re.search(r"if \(0 <= _ptr_\d+\[\d+\]\) \{", source).start()
    return source[start:source.index("__syncthreads()", source.index("tvm_builtin_cuda_warp_sync", start))]


def test_a_step_issues_every_key_and_value_load_before_its_arithmetic():
    """The 8B's shape (heads of 128 in groups of 4, float16 pages): 8 K and 8 V loads of 8 bytes a lane, all
    before the first conversion of a loaded half; no 2-byte loads of the pages (the old p·v read one a key and
    dimension); the scores and p through 16-byte shared loads."""
    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("llama-3.1-8b"), n_layer=1)))
    prog = build_program(graph, batch=1, n_sms=132, max_context=32768, kv_splits=-1, merge_in_last=True)
    body = attention_body(cuda_source(emit_megakernel(prog, options=ROWS)))
    loads = [m.start() for m in re.finditer(r"\*\(uint2\*\)\(\(\(uint\*\)pages_ptr\)", body)]
    assert len(loads) == 16
    assert max(loads) < body.index("(float)(*(half *)")
    assert not re.search(r"\(float\)pages_ptr\[", body)
    assert len(re.findall(r"__shfl_xor_sync", body)) == 31  # the scatter (a warp a row: no row groups to sum)
    assert len(re.findall(r"warp_reduce_sum", body)) == 4  # each head's running sum over the lanes, once
    assert re.findall(r"\*\(float4\*\)\(_ptr", body)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("batch", [1, 3])
def test_rows_collectives_are_reached_by_whole_warps(name, batch):
    graph, _ = open_graph(cached_synthetic(preset(name)))
    prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16, merge_in_last=True)
    source = cuda_source(emit_megakernel(prog, options=ROWS))
    assert "__shfl_xor_sync((uint)4294967295" in source
    assert divergent_collectives(source) == []


def test_every_batch_size_runs_the_same_rows_body():
    """The body reads a row's q, pages and lengths through its task row: the kernels at batch 1 and 8 have the same
    key loop but for the batch strides (the chunk bounds before it divide by each batch's split count)."""
    graph, _ = open_graph(cached_synthetic(preset("tiny-qwen3")))
    bodies = []
    for batch in (1, 8):
        prog = build_program(graph, batch=batch, n_sms=132, max_context=4096, kv_splits=-1, merge_in_last=True)
        body = attention_body(cuda_source(emit_megakernel(prog, options=ROWS)))
        loop = body.index("for (int")
        bodies.append(body[loop:body.index("profile_ptr", loop)])  # to the clock after the key loop
    strip = [re.sub(r"\d+", "N", b) for b in bodies]
    assert strip[0] == strip[1]
