"""The megakernel emitter on tiny models of every architecture and batch 1 and 3: the generated CUDA source (taken
from TVM's compile hook, so no nvcc is needed) has every warp shuffle and block barrier where all the threads that
must meet there reach it: never under a branch on the lane or on a thread index finer than the warp. A shuffle sunk
into a lane-0 branch hung the H200 (notes/megakernel.md)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from luce_compile.fuse.emit_cuda import emit_megakernel
from luce_compile.fuse.program import build_program
from luce_compile.graph.registry import open_graph
from luce_compile.synthetic import cached_synthetic, preset

pytestmark = pytest.mark.unit

PRESETS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]
COLLECTIVES = ("__syncthreads", "warp_reduce", "__syncwarp", "__shfl_sync")


def cuda_source(func) -> str:
    import tvm
    from tvm.target import Target

    from luce_compile.codegen.gpu_toolchain import cuda_source as generated

    return generated(tvm.IRModule({"megakernel": func}), Target({"kind": "cuda", "arch": "sm_90"}), tir_pipeline="tirx")


def divergent_collectives(source: str) -> list[str]:
    """Collectives nested in an `if` whose condition tests threadIdx other than through the warp (>> 5)."""
    body = source[source.index("megakernel_kernel("):]
    body = body[body.index("{"):]
    stack: list[str] = []
    bad = []
    for line in body.split("\n"):
        text = line.strip()
        if any(c in text for c in COLLECTIVES):
            for cond in stack:
                if cond.startswith(("if", "while")):
                    # warp-uniform uses: the warp index (>> 5), or a comparison with a multiple of 32
                    uses = re.findall(r"\(\(int\)threadIdx\.x\)( >> 5| [<>]=? (\d+)\))?", cond)
                    if any(not (shift.startswith(" >>") or (n and int(n) % 32 == 0)) for shift, n in uses):
                        bad.append(f"{text[:60]} under {cond[:80]}")
        for _ in range(line.count("}")):
            if stack:
                stack.pop()
        stack += [text] * line.count("{")
    return bad


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("plan", ["chunks", "even-splits-merged-by-o-proj", "chunks-merged-by-last"])
def test_collectives_are_reached_by_every_thread_that_takes_part(name, batch, plan):
    graph, _ = open_graph(cached_synthetic(preset(name)))
    extra = {"chunks": {}, "even-splits-merged-by-o-proj": {"kv_splits": 3, "fold_merge": True},
             "chunks-merged-by-last": {"merge_in_last": True}}[plan]
    prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16, **extra)
    assert plan != "even-splits-merged-by-o-proj" or any(st.merged >= 0 for st in prog.tg.stages)
    source = cuda_source(emit_megakernel(prog))
    assert "__syncthreads" in source and "warp_reduce_sum" in source
    # merged by the last chunk: an arrival counter (atomicAdd's old value) decides which block merges
    assert ("atomic_add" in source) == (plan == "chunks-merged-by-last")
    assert divergent_collectives(source) == []


def test_the_check_catches_a_shuffle_under_a_lane_branch():
    src = ("megakernel_kernel(int x) {\n  if ((((int)threadIdx.x) % 32) == 0) {\n"
           "    y = tvm_builtin_cuda_warp_reduce_sum_32(v);\n  }\n}\n")
    assert divergent_collectives(src)


def test_the_variant_knobs_emit_kernels_without_divergent_collectives():
    """The options a GPU session times against the defaults (256 threads, rolled K passes) still give kernels
    whose collectives every thread reaches."""
    from luce_compile.fuse.options import MegakernelOptions

    graph, _ = open_graph(cached_synthetic(preset("tiny-qwen3")))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
    source = cuda_source(emit_megakernel(prog, options=MegakernelOptions(threads=256, unroll_passes=1)))
    assert "__launch_bounds__(256)" in source
    assert divergent_collectives(source) == []
    split = build_program(open_graph(cached_synthetic(preset("tiny-llama")))[0], batch=2, n_sms=32, max_context=64,
                          kv_chunk=16, rope_pairs=True)
    options = MegakernelOptions(q8_activations=True, interleave_slices=True)
    assert divergent_collectives(cuda_source(emit_megakernel(split, options=options))) == []
    fewest = MegakernelOptions(q8_activations=True, fewest_rounds=True)
    assert divergent_collectives(cuda_source(emit_megakernel(split, options=fewest))) == []


@pytest.mark.parametrize("quant,integer", [("Q4_0", True), ("Q4_1", True), ("Q8_0", True), ("F16", False),
                                           ("Q5_0", True), ("Q5_1", True)])
def test_q8_activations_give_integer_dots_where_the_weight_type_has_them(quant, integer):
    """q8_activations: the matvecs of Q4_0/1, Q5_0/1, Q8_0, Q4_K weights quantize their input once per task (a
    thread per 32-value block) and dot 8-bit words (dp4a); other weight types keep the float32 body. The kernels'
    numbers are checked on the H200 (scripts/megakernel_check.py, against the oracle with the rounding emulated)."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant=quant)))
    for batch in (1, 3):
        prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16)
        source = cuda_source(emit_megakernel(prog, options=MegakernelOptions(q8_activations=True)))
        assert ("__dp4a" in source) == integer and ("nearbyintf" in source) == integer
        assert divergent_collectives(source) == []
        plain = cuda_source(emit_megakernel(prog))
        assert "__dp4a" not in plain


def test_q4_k_matvecs_take_8_bit_activations_as_q4_1_blocks():
    """Q4_K on the 8-bit path: its qs plane is Q4_0's nibble layout, and a sub-block of 32 is a Q4_1 block with
    d·sc and −dmin·mn as its scale and minimum (llama.cpp's vec_dot_q4_K_q8_1); Q6_K (a Q4_K_M file's attn_v and
    ffn_down in some layers) and Q5_K take the same path, with their high bits; a stage that mixes in a type without
    an integer body (F16) keeps float32 inputs."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    spec = dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=512, quant="Q4_K")
    # n_ff 1,024: the down projection takes a lane per 32-value block (q8_by_block), the others per granule
    q4_k_m = dataclasses.replace(spec, n_ff=1024, quant_overrides={"ffn_down.weight": "Q6_K",
                                                                   "attn_v.weight": "Q6_K", "ffn_gate.weight": "Q5_K"})
    mixed = dataclasses.replace(spec, quant_overrides={"ffn_down.weight": "F16"})
    for model, q8_stages in ((spec, {"qkv", "gate_up", "down"}), (q4_k_m, {"qkv", "gate_up", "down"}),
                             (mixed, {"qkv", "gate_up"})):
        graph, _ = open_graph(cached_synthetic(model))
        prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
        source = cuda_source(emit_megakernel(prog, options=MegakernelOptions(q8_activations=True)))
        assert "__dp4a" in source and "_dmin_ptr[" in source and divergent_collectives(source) == []
        # the down projection's opcode body: the last branch on its opcode (the first is its L2 prefetch; the task
        # row's local is _ptr_4 in TVM's naming)
        down = next(o.index for o in prog.opcodes if o.kind.name == "MATVEC" and any(
            "ffn_down" in w for w in o.weights))
        body = source.split(f"_ptr_4[0] == {down})")[-1].split("_ptr_4[0] == ")[0]
        assert ("__dp4a" in body) == ("down" in q8_stages), model.quant_overrides
        if model is q4_k_m:  # Q6_K's int8 scales multiply the integer sums; its two high bits are read
            assert "_sc_ptr[" in body and "_qh_ptr[" in body
            continue
        # on integer tensor cores (q8_mma) the same blocks take the same scales
        mma = cuda_source(emit_megakernel(prog, options=MegakernelOptions(q8_activations=True, q8_mma=True)))
        assert "mma.sync.aligned.m16n8k32" in mma and "_dmin_ptr[" in mma.split("mma.sync.aligned.m16n8k32")[-1]


def test_a_float_granule_reads_each_weight_word_once():
    """The float32 matvec body dequantizes a granule's 8 values from one load of each plane word (the quants, the
    scales): the indices of the 8 values' blocks simplify to the granule's (emit_cuda._Granule). Loading per value
    made the Q4_K_M shapes' kernels several megabytes of CUDA and nvcc minutes."""
    import dataclasses

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=512,
                                                               quant="Q4_K")))
    prog = build_program(graph, batch=1, n_sms=8, max_context=64, kv_chunk=16)
    source = cuda_source(emit_megakernel(prog))
    qs_loads = len(re.findall(r"(?<!&\()w\d+_\d+_qs_ptr\[", source))  # not the L2 prefetches
    sc_loads = len(re.findall(r"(?<!&\()w\d+_\d+_sc_ptr\[", source))
    nibbles = len(re.findall(r">> \(uint\)\d+\) & \(uint\)15\)", source))
    assert qs_loads and nibbles >= 8 * qs_loads - 8 and sc_loads <= qs_loads


def test_q8_choice_is_the_same_at_every_batch_size():
    """A stage takes 8-bit activations only if the build's largest batch fits them in shared memory with 1/16 left
    (q8.Q8_RESERVE): then a sequence is computed alike at every batch size (batched equal to alone), and a build
    whose largest batch does not fit keeps float32 activations at batch 1 too."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant="Q4_1")))
    prog = build_program(graph, batch=1, n_sms=8, max_context=64, kv_chunk=16)
    fits = MegakernelOptions(q8_activations=True, batches=(1, 8))
    assert "__dp4a" in cuda_source(emit_megakernel(prog, options=fits))
    too_wide = dataclasses.replace(fits, batches=(1, 800))  # 800 x 64 features: over 44 KiB, under 15/16 of 96
    assert "__dp4a" not in cuda_source(emit_megakernel(prog, options=too_wide))
    wider_memory = dataclasses.replace(too_wide, shared_kib=96)  # dynamic shared memory
    source = cuda_source(emit_megakernel(prog, options=wider_memory))
    assert "__dp4a" in source and "extern __shared__" in source


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_q8_by_block_loads_a_block_a_lane_where_k_is_wide(quant):
    """q8_by_block: inputs of 1,024 features or more give each lane a whole 32-value block of a row, read with
    16-byte loads (one for Q4 quants, two for Q8_0); narrower inputs keep a lane per 8 values."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    spec = dataclasses.replace(preset("tiny-llama"), n_embd=1024, n_head=8, n_head_kv=4, n_ff=128, quant=quant)
    graph, _ = open_graph(cached_synthetic(spec))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
    options = MegakernelOptions(q8_activations=True, q8_by_block=True)
    source = cuda_source(emit_megakernel(prog, options=options))
    vector_load = r"= \*\((u?int4)\*\)\((?:\(\(u?int\*\))?w\d+_\d+_qs_ptr"
    loads = re.findall(vector_load, source)
    assert loads and set(loads) == {"uint4"}  # Q8_0's signed quants too, as words
    assert divergent_collectives(source) == []
    granules = cuda_source(emit_megakernel(prog, options=dataclasses.replace(options, q8_by_block=False)))
    assert not re.findall(vector_load, granules)


@pytest.mark.parametrize("quant", ["Q4_K", "Q6_K"])
def test_a_block_pass_issues_its_loads_before_its_dot_products(quant):
    """q8_by_block: every row's quants and scales are loaded before the pass's first dot product (written row by
    row, ptxas issued the scales' small loads after the dot products: a second memory round trip a pass)."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    spec = dataclasses.replace(preset("tiny-llama"), n_embd=1024, n_head=8, n_head_kv=4, n_ff=1024, quant=quant)
    graph, _ = open_graph(cached_synthetic(spec))
    prog = build_program(graph, batch=1, n_sms=8, max_context=64, kv_chunk=16)
    source = cuda_source(emit_megakernel(prog, options=MegakernelOptions(q8_activations=True, q8_by_block=True)))
    first_load = re.search(r"= \*\(uint4\*\)\(w\d+_\d+_qs_ptr", source).start()
    first_dot = source.index("__dp4a(", first_load)
    loads = source[first_load:first_dot]
    assert len(re.findall(r"uint4\*\)\(w\d+_\d+_qs_ptr", loads)) >= 2  # more than one row's quants
    assert re.search(r"w\d+_\d+_sc_ptr\[", loads) and re.search(r"w\d+_\d+_d_ptr\[", loads)


@pytest.mark.parametrize("quant,loads", [("BF16", 1), ("F16", 1), ("F32", 2)])
def test_float_weights_are_read_as_16_byte_words(quant, loads):
    """F32/F16/BF16 matvecs read a lane's 8 values of a row as 16-byte words (one for 16-bit types, two for F32),
    not a load per value; each word's halves are split in registers (BF16: a shift and a mask). The values and
    their order of summation are the element-wise dequant's (checked on the H200 against the oracle)."""
    import dataclasses

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant=quant)))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
    source = cuda_source(emit_megakernel(prog))
    per_row = re.findall(r"\*\(uint4\*\)\(_ptr_\d+ \+ (\d+)\) = \*\(uint4\*\)\(\(\(uint\*\)w\d+_\d+_w_ptr\)", source)
    assert per_row and set(per_row) == {str(4 * i) for i in range(loads)}
    assert prog.opcodes[0].kind.name == "EMBED"  # its rows are read a value at a time: only op 0's plane
    assert set(re.findall(r"(?<!&\()(w\d+)_\d+_w_ptr\[", source)) == {"w0"}  # (&(...[i]): an L2 prefetch
    assert divergent_collectives(source) == []


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
def test_q8_mma_dots_on_tensor_cores_at_every_batch_size(quant):
    """q8_mma: the 8-bit matvecs take integer mma.m16n8k32 instead of dp4a at batch 1 as at 3 (one summation order
    for every batch size); Q4_0's quants enter as q − 8 per byte; every mma sits where its whole warp arrives."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant=quant)))
    options = MegakernelOptions(q8_activations=True, q8_mma=True, batches=(1, 3))
    for batch in (1, 3):
        prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16, merge_in_last=True)
        source = cuda_source(emit_megakernel(prog, options=options))
        assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in source and "__dp4a" not in source
        assert ("2155905152" in source) == (quant == "Q4_0")  # 0x80808080: the per-byte q − 8
        body = source[source.index("megakernel_kernel("):]
        calls = [line for line in body.split("\n") if "mma_int_sync" in line]
        assert calls and divergent_collectives(source.replace("tvm_builtin_ptx_mma_int_sync", "__shfl_sync")) == []


@pytest.mark.parametrize("quant", ["F16", "BF16"])
def test_float_mma_runs_float_weights_on_tf32_tensor_cores_at_every_batch_size(quant):
    """float_mma: F16/BF16 matvecs take mma.m16n8k8.tf32 at batch 1 as at 3 (one summation order for every batch
    size), BF16 weights split from their words by a shift and a mask, F16 converted, the input rounded once
    (0x1000, then the 13 low bits cleared); every mma and barrier sits where its whole warp or block arrives; F32
    weights keep the float32 lane body (tf32 would round them)."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    options = MegakernelOptions(float_mma=True, batches=(1, 3))
    for q in (quant, "F32"):
        graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant=q)))
        for batch in (1, 3):
            prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16, merge_in_last=True)
            source = cuda_source(emit_megakernel(prog, options=options))
            mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
            assert (mma in source) == (q != "F32")
            if q == "F32":
                continue
            assert "4294959104" in source and "4096" in source  # 0xFFFFE000 and 0x1000: the tf32 rounding
            assert ("4294901760" in source) == (q == "BF16")  # 0xFFFF0000: a BF16 word's high value
            calls = [line for line in source.split("\n") if "m16n8k8_row_col_f32_tf32" in line]
            assert len(calls) > 1
            assert divergent_collectives(source.replace("tvm_builtin_ptx_mma_sync_aligned", "__shfl_sync")) == []


def test_the_launcher_passes_every_argument_the_kernel_takes():
    """The runtime's launcher (luce_runtime.megakernel.Kernel, which scripts/megakernel_check.py runs too) passes
    the kernel's non-weight arguments by name: the emitter's list (weights aside, named after the weight planes)
    must be exactly its KERNEL_ARGS, or every GPU run fails."""
    from luce_runtime.megakernel import KERNEL_ARGS

    graph, _ = open_graph(cached_synthetic(preset("tiny-qwen2")))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16, merge_in_last=True)
    func = emit_megakernel(prog)
    weights = {name for name, _, _ in prog.weight_args()}
    params = [str(v.name) for v in func.params]
    others = {p for p in params if p not in weights and not any(p.startswith(f"{w}_") for w in weights)}
    assert others == KERNEL_ARGS


def _high_bit_words(rng, ggml_type: str, qh_words: int, high, finish=None) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit path's two words of each granule of 32 values (low nibbles of the even / odd elements, their high
    bits placed by `high(qh, row, granule)`) and the quants as dequant_expr reads them (quant_matmul.stored_quant),
    on random planes, computed by the same TIR on the CPU: (row, granule, even/odd, byte i) and (row, granule, i,
    even/odd), which must be equal."""
    import tvm
    from tvm import te, tirx

    from luce_compile.lower.quant_matmul import stored_quant

    n = 64
    qs = te.placeholder((n, 4), "uint32", name="qs")  # 32 values per row: 4 granule words
    qh = te.placeholder((n, qh_words), "uint32", name="qh")
    mask = tirx.const(0x0F0F0F0F, "uint32")

    def word(i, g, h):
        nib = [qs[i, g] & mask, (qs[i, g] >> tirx.const(4, "uint32")) & mask]
        bits = high(qh, i, g)
        done = finish or (lambda w: w)  # the codebook types' lookup (_signed_quants)
        return tirx.Select(h == 0, done(nib[0] | bits[0]), done(nib[1] | bits[1]))

    words = te.compute((n, 4, 2), word, name="words")
    quants = te.compute((n, 32), lambda i, k: stored_quant(ggml_type, {"qs": qs, "qh": qh}, i, k), name="quants")
    func = tvm.compile(te.create_prim_func([qs, qh, words, quants]), target="llvm")
    a = rng.integers(0, 2**32, (n, 4), dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, (n, qh_words), dtype=np.uint64).astype(np.uint32)
    out = [tvm.runtime.tensor(np.zeros(s, d)) for s, d in (((n, 4, 2), np.uint32), ((n, 32), np.int32))]
    func(tvm.runtime.tensor(a), tvm.runtime.tensor(b), *out)
    got = out[0].numpy().view(np.uint8).reshape(n, 4, 2, 4)  # (row, granule, even/odd, byte i)
    want = out[1].numpy().reshape(n, 4, 4, 2).transpose(0, 1, 3, 2)  # element 8g + 2i + h
    return got, want


def test_q5_fifth_bits_land_in_their_quants_bytes(rng):
    """The 8-bit path's Q5 words: granule gg's low-nibble word with the fifth bits of its even elements in bit 4 of
    each byte, the high-nibble word with its odd elements', must be the Q5 quants as dequant_expr reads them."""
    from luce_compile.fuse.emit_cuda import _fifth_bits

    got, want = _high_bit_words(rng, "Q5_0", 1, lambda qh, i, g: _fifth_bits(qh[i, 0], g))
    assert np.array_equal(got, want) and want.max() > 15


def test_q6_k_high_bits_land_in_their_quants_bytes(rng):
    """The 8-bit path's Q6_K words: the two high bits of granule g's even elements in bits 4-5 of each byte of its
    low-nibble word, its odd elements' in the high one's, must be the Q6_K quants as dequant_expr reads them (0..63
    before the offset 32), for each granule of two sub-blocks of 16, with a granule index the kernel computes."""
    from luce_compile.fuse.emit_cuda import _sixth_bits

    got, want = _high_bit_words(rng, "Q6_K", 2, lambda qh, i, g: _sixth_bits(qh[i, g // 2], (g % 2) * 16))
    assert np.array_equal(got, want) and want.max() > 47


@pytest.mark.parametrize("quant", ["Q3_K", "Q2_K"])
def test_low_bit_words_are_the_quants_in_nibbles_order(rng, quant):
    """The 8-bit path's Q3_K/Q2_K words: granule g's two words from its block's `qs` word g % 2 (quant_layout._2bit's
    slots, shifted by 2·(g // 2) and 4 more for the odd elements) with Q3_K's hmask bit as bit 2 of each byte, must
    be the quants dequant_expr reads (quant_matmul.stored_quant: 0..7 / 0..3 before any offset), even elements then
    odd, for a granule index the kernel computes; on random planes, the same TIR run on the CPU."""
    import tvm
    from tvm import te, tirx

    from luce_compile.fuse.emit_cuda.q8 import _fifth_bits, _low_bits
    from luce_compile.lower.quant_matmul import stored_quant

    n = 64
    qs = te.placeholder((n, 2), "uint32", name="qs")  # 32 values a row: two words of 2-bit fields
    qh = te.placeholder((n, 1), "uint32", name="qh")

    def word(i, g, h):
        w = _low_bits(qs[i, g % 2], g)
        if quant == "Q3_K":
            w = [a | e for a, e in zip(w, _fifth_bits(qh[i, 0], g, bit=2), strict=True)]
        return tirx.Select(h == 0, w[0], w[1])

    words = te.compute((n, 4, 2), word, name="words")
    planes = {"qs": qs, "qh": qh} if quant == "Q3_K" else {"qs": qs}
    quants = te.compute((n, 32), lambda i, k: stored_quant(quant, planes, i, k), name="quants")
    func = tvm.compile(te.create_prim_func([qs, qh, words, quants]), target="llvm")
    a = rng.integers(0, 2**32, (n, 2), dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, (n, 1), dtype=np.uint64).astype(np.uint32)
    out = [tvm.runtime.tensor(np.zeros(sh, dt)) for sh, dt in (((n, 4, 2), np.uint32), ((n, 32), np.int32))]
    func(tvm.runtime.tensor(a), tvm.runtime.tensor(b), *out)
    got = out[0].numpy().view(np.uint8).reshape(n, 4, 2, 4)  # (row, granule, even/odd, byte i)
    want = out[1].numpy().reshape(n, 4, 4, 2).transpose(0, 1, 3, 2)  # element 8g + 2i + h
    assert np.array_equal(got, want) and want.max() == (7 if quant == "Q3_K" else 3)


@pytest.mark.parametrize("quant", ["Q3_K", "Q2_K"])
def test_q8_low_bits_give_integer_dots_to_2_and_3_bit_weights(quant):
    """q8_low_bits: Q3_K and Q2_K matvecs take 8-bit activations and dp4a (by granule at K 256, by block at 1,024);
    on by default (checked on the H100), their float lanes when off, and then what the oracle rounds."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions, q8_types

    spec = dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=1024, quant=quant)
    graph, _ = open_graph(cached_synthetic(spec))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
    on = MegakernelOptions(q8_activations=True, q8_low_bits=True)
    source = cuda_source(emit_megakernel(prog, options=on))
    assert "__dp4a" in source and divergent_collectives(source) == []
    off = MegakernelOptions(q8_activations=True, q8_low_bits=False)
    assert "__dp4a" not in cuda_source(emit_megakernel(prog, options=off))
    assert MegakernelOptions().q8_low_bits
    assert quant in q8_types(dataclasses.asdict(on)) and quant not in q8_types({"q8_activations": True})


def test_codebook_lookup_permutes_bytes_as_llama_cpp(rng):
    """IQ4's lookup of four 4-bit indices (one a byte) to their signed codebook values by three byte permutes: run
    on Python ints with CUDA's documented __byte_perm (byte i of the result: byte s<4i+2:4i> of y:x), it gives
    kvalues_iq4nl[index] in every byte, for every index in every byte position."""
    from luce_compile.lower.quant_matmul import CODEBOOKS, table16_bytes, table_words

    table = CODEBOOKS["IQ4_NL"]
    words = table_words(table)

    def byte_perm(x: int, y: int, s: int) -> int:
        both = (y << 32) | x
        return sum(((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))

    indices = rng.integers(0, 16, (2000, 4))
    indices[:16] = np.arange(16)[:, None]  # every index in every byte
    for idx in indices:
        word = int(sum(int(v) << (8 * i) for i, v in enumerate(idx)))
        got = table16_bytes(word, words, byte_perm, lambda v: v)
        assert np.frombuffer(got.to_bytes(4, "little"), np.int8).tolist() == [table[v] for v in idx]


@pytest.mark.parametrize("quant", ["IQ4_NL", "IQ4_XS"])
def test_codebook_words_are_the_signed_quants(rng, quant):
    """The 8-bit path's IQ4 words (a granule's low nibbles, then its high ones, each looked up by
    emit_cuda.q8._signed_quants) hold the signed values dequant_expr multiplies (quant_matmul.stored_quant), in the
    order the 8-bit activations take (even elements, then odd): ROCm's form (a lookup a byte), computed on the CPU."""
    import tvm

    from luce_compile.fuse.emit_cuda.q8 import _signed_quants

    def looked_up(word):
        with tvm.target.Target({"kind": "rocm", "mcpu": "gfx1201"}):  # the target-independent form
            return tvm.tirx.reinterpret("uint32", _signed_quants(quant, word))

    got, want = _high_bit_words(rng, quant, 1, lambda qh, i, g: [tvm.tirx.const(0, "uint32")] * 2, finish=looked_up)
    assert np.array_equal(got.view(np.int8), want) and want.min() < -100


@pytest.mark.parametrize("quant", ["IQ4_NL", "IQ4_XS"])
def test_q8_codebooks_give_integer_dots_to_iq4_weights(quant):
    """q8_codebooks: IQ4_NL and IQ4_XS matvecs take 8-bit activations, their indices looked up by __byte_perm and
    dotted with dp4a (llama.cpp's vec_dot_iq4_nl_q8_1 / iq4_xs_q8_1), by default; without it they keep the float32
    body, and q8_mma (no codebook body) keeps it too. A manifest without the key (older builds) rounds as the float
    body did."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions, q8_types
    from luce_compile.synthetic import in_type

    spec = in_type(dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=768), quant)
    graph, _ = open_graph(cached_synthetic(spec))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16)
    on = MegakernelOptions(q8_activations=True)
    assert on.q8_codebooks
    source = cuda_source(emit_megakernel(prog, options=on))
    assert "__byte_perm" in source and divergent_collectives(source) == []
    down = next(o.index for o in prog.opcodes if o.kind.name == "MATVEC" and any("ffn_down" in w for w in o.weights))
    body = source.split(f"_ptr_4[0] == {down})")[-1].split("_ptr_4[0] == ")[0]
    assert "__dp4a" in body and "__byte_perm" in body
    for off in (MegakernelOptions(q8_activations=True, q8_codebooks=False), dataclasses.replace(on, q8_mma=True)):
        body = cuda_source(emit_megakernel(prog, options=off)).split(f"_ptr_4[0] == {down})")[-1]
        assert "__byte_perm" not in body.split("_ptr_4[0] == ")[0]
    assert quant in q8_types(dataclasses.asdict(on)) and quant not in q8_types({"q8_activations": True})


@pytest.mark.parametrize("interleave", [False, True])
def test_k_slices_cover_every_unit_once(interleave):
    """A lane matvec's K slices, passes and lanes take every lane unit of K exactly once, whole or interleaved,
    for widths that fill the slices' passes and widths that do not (the 8B's down projection: 448 blocks in 8)."""
    from luce_compile.fuse.emit_cuda.matvec import slice_passes, slice_unit

    for units in (32, 96, 128, 448, 512, 1792, 1000):
        for split in (1, 2, 4, 8, 16):
            taken = [g for s in range(split) for gi in range(slice_passes(units, split, interleave))
                     for lane in range(32) for g, end in [slice_unit(units, split, interleave, s, gi, lane)]
                     if g < end]
            assert sorted(taken) == list(range(units)), (units, split)


def test_fewest_rounds_splits_k_where_the_rule_leaves_a_nearly_empty_pass():
    """matvec.k_split on the real shapes at b=1 (16 warps, tiles of 32 rows, 16 row slots): the 7B's K = 18,944 down
    projection (592 blocks) goes from 16 slices (2 steps x 2 passes, the second 80 of 512 lanes) to 8 (1 x 3);
    where the rule's split already takes the fewest rounds (the 8B's K = 14,336 and 4,096, 1.5B's 8,960) it stays,
    and every split covers K with 32 units a slice at least."""
    from luce_compile.fuse.emit_cuda.matvec import k_split, slice_passes

    def rounds(units: int, split: int) -> int:
        groups = 16 // split
        rows = min(-(-32 // groups), 16)
        return -(-32 // (groups * rows)) * slice_passes(units, split, True)

    assert k_split(592, 16, 32, 16, 32, True) == 16 and rounds(592, 16) == 4
    assert k_split(592, 16, 32, 16, 32, True, fewest_rounds=True) == 8 and rounds(592, 8) == 3
    for units in (448, 128, 280, 112):  # the 8B's down and K = 4,096, the 1.5B's down, the 7B's K = 3,584
        assert k_split(units, 16, 32, 16, 32, True, True) == k_split(units, 16, 32, 16, 32, True), units
    for units in (32, 37, 100, 592, 1000, 4000):
        split = k_split(units, 16, 32, 16, 32, True, True)
        assert units // split >= 32 and rounds(units, split) <= rounds(units, k_split(units, 16, 32, 16, 32, True))


def test_interleaved_slices_read_a_run_a_pass():
    """Interleaved, the slices' lanes of one pass read one run of split x 32 units (a row's bytes in order)."""
    from luce_compile.fuse.emit_cuda.matvec import slice_unit

    first_pass = sorted(slice_unit(448, 8, True, s, 0, lane)[0] for s in range(8) for lane in range(32))
    assert first_pass == list(range(256))
    whole = sorted(slice_unit(448, 8, False, s, 0, lane)[0] for s in range(8) for lane in range(32))
    assert whole != list(range(256))


def test_prefetch_ahead_asks_l2_for_the_next_pass_of_quants():
    """prefetch_ahead: a block pass asks L2 for the next pass's (or step's) quants, one prefetch a row of each plane
    of 4 bytes a block or more, and no more than that; the kernel's collectives stay where every thread meets them."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions

    spec = dataclasses.replace(preset("tiny-llama"), n_embd=1024, n_head=8, n_head_kv=4, n_ff=1024, quant="Q4_K")
    graph, _ = open_graph(cached_synthetic(spec))
    prog = build_program(graph, batch=1, n_sms=8, max_context=64, kv_chunk=16)
    base = MegakernelOptions(q8_activations=True, prefetch_bytes=0)
    plain = cuda_source(emit_megakernel(prog, options=base))
    ahead = cuda_source(emit_megakernel(prog, options=dataclasses.replace(base, prefetch_ahead=True)))
    call = r"tvm_builtin_ptx_prefetch_global_L2\(\(&\((w\d+_\d+_\w+)_ptr\["
    assert not re.findall(call, plain)
    prefetched = set(re.findall(call, ahead))
    assert prefetched and all(name.endswith("_qs") for name in prefetched)  # Q4_K: the quants, not the scales
    assert divergent_collectives(ahead) == []


def test_a_long_maximum_context_changes_only_the_tables_and_the_chunk_arithmetic():
    """Issue 38: the kernel built for a 131,072-token context (kv_splits=-1 on 132 SMs; at batch 8, 8 waves of key
    chunks) is the kernel built for 4,096 but for its task tables' strides and each task's chunk arithmetic: the
    same shared buffers and nearly the same code (no loop, buffer or unrolled body grows with the context); the
    page table's width is an argument (the engine's context, not the kernel's); an attention chunk with no keys
    skips its wait and body, so chunk 0 adds for the skipped ones to the arrival counter (a value, not 1)."""
    graph, _ = open_graph(cached_synthetic(preset("tiny-llama")))

    def source(max_context: int) -> tuple[str, object]:
        prog = build_program(graph, batch=8, n_sms=132, max_context=max_context, kv_splits=-1, merge_in_last=True)
        return cuda_source(emit_megakernel(prog)), prog

    (short, short_prog), (long, long_prog) = source(4096), source(131072)
    assert (short_prog.tg.kv_waves, long_prog.tg.kv_waves) == (1, 8)
    assert len(long_prog.tg.tasks) > 2 * len(short_prog.tg.tasks)
    shared = re.compile(r"__shared__ .*;")
    assert shared.findall(long) == shared.findall(short)
    assert abs(len(long.splitlines()) - len(short.splitlines())) < 0.02 * len(short.splitlines())
    assert "int max_pages" in long and re.findall(r"page_table_ptr\[[^;]*max_pages", long)
    assert re.search(r"atomic_add\(\(&\(counters_ptr\[_ptr_\d+\[\d+\]\]\)\), _ptr_\d+\[0\]\)", long)
    assert divergent_collectives(long) == []


def test_a_token_trees_rows_take_one_word_each_whatever_the_batch():
    """Issue 39: a verify row of a token tree costs the kernel one int32 argument entry (off_path): its RoPE
    position is its slot less the word's set bits (__popc), and the attention's key loop weighs 0 a key whose bit
    is set, as a key past the chunk. Nothing grows with the tree's size or the batch: the kernels at batch 1 and 8
    read the word in the same places and differ from each other as they did before (the tree's arithmetic is in the
    simulator's test, tests/fuse/test_taskgraph.py)."""
    graph, _ = open_graph(cached_synthetic(preset("tiny-qwen2")))
    reads = {}
    for batch in (1, 8):
        source = cuda_source(emit_megakernel(build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16,
                                                           merge_in_last=True)))
        assert "int* __restrict__ off_path_ptr" in source
        assert re.search(r"lengths_ptr\[[^]]*\] - __popc\(off_path_ptr\[", source)  # RoPE's position
        assert re.search(r"_ptr_\d+\[0\] = off_path_ptr\[_ptr_\d+\[\d+\]\];", source)  # the attention row's word
        reads[batch] = len(re.findall(r"off_path_ptr\[", source))
        assert divergent_collectives(source) == []
    assert reads[1] == reads[8] <= 12, reads


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])  # gemma3: post-norm rows write norm inputs too
@pytest.mark.parametrize("q8", [True, False])
def test_norm_partials_are_written_by_the_writers_and_read_by_the_norms(name, q8):
    """norm_partials: every opcode that writes a norm's input stores its chunk sums to the arena at the partial's
    slot, every normed matvec loads them from its slot (8-bit and float bodies), every collective stays
    warp-uniform; at batch 1 and 8 the partials are the same chunk grid, K / 32 floats a row, so a row's sum has
    one order whatever the batch."""
    import dataclasses

    from luce_compile.fuse.options import MegakernelOptions
    from luce_compile.fuse.taskgraph import NORM_CHUNK

    graph, _ = open_graph(cached_synthetic(dataclasses.replace(preset(name), quant="Q4_1")))
    options = MegakernelOptions(q8_activations=q8, batches=(1, 8), norm_partials=True)
    grids = []
    for batch in (1, 8):
        prog = build_program(graph, batch=batch, n_sms=8, max_context=64, kv_chunk=16, norm_partials=True)
        source = cuda_source(emit_megakernel(prog, options=options))
        assert ("__dp4a" in source) == q8 and divergent_collectives(source) == []
        lines = [line.strip().split(" = ", 1) for line in source.split("\n") if " = " in line]
        readers = writers = 0
        for op in prog.opcodes:
            for part in (n for n in op.inputs + op.outputs if n.endswith("#sumsq")):
                at = re.compile(rf"arena_ptr\[[^;]*_ptr_\d+\[{op.slot(part)}\]")  # the slot's arena offset
                if part in op.inputs:  # the norm's 1/rms from the partials
                    readers += 1
                    assert any(at.search(rhs) for _, rhs in lines), (op.index, part)
                else:  # the writer's chunk sums
                    writers += 1
                    assert any(lhs.startswith("arena_ptr[") and at.search(lhs) for lhs, _ in lines), (op.index, part)
        assert readers and writers
        base = {p: x for x, p in prog.tg.norm_partials.items()}
        grids.append(sorted((p, prog.width(p), w.lo, w.hi, w.row) for t in prog.tg.tasks for w in t.writes
                            if (p := w.value) in base))
        assert all(width * NORM_CHUNK == prog.width(base[p]) for p, width, *_ in grids[-1])
    key = lambda g: sorted({(p, w, lo, hi) for p, w, lo, hi, row in g})  # noqa: E731 (gemma's rows: per batch row)
    assert key(grids[0]) == key(grids[1])
