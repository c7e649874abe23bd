"""schedules/cpu/moe.py's ExpertMatmul: it takes lower/moe.py's expert matmuls and nothing else; the float32 form's
schedule gives the unscheduled outputs bit for bit (it only moves loops), the int8 form's vector body gives each row
exactly the int8 GEMV's value for that token and expert row; on random weight blocks and router choices."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from luce_schedules.cpu.int8_gemv import Int8GEMV
from luce_schedules.cpu.moe import ExpertMatmul

from luce_compile.lower.cpu_int8 import int8_format, int8_isa, int8_matmul, quantize_q8
from luce_compile.lower.moe import expert_matmul, int8_expert_matmul
from luce_compile.lower.quant_layout import repack
from luce_compile.lower.quant_matmul import quant_matmul

pytestmark = pytest.mark.unit
HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
N_EXPERT, N_OUT, N_IN, TOKENS, USED = 4, 32, 256, 3, 2


def _planes(rng, qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N_EXPERT * N_OUT, N_IN // block * size), dtype=np.uint8)
    # the fp16 scales at the start of each block finite and small: d (Q8_0, Q5_0), Q4_K's d and dmin
    scales = 4 if qtype == GGMLQuantizationType.Q4_K else 2
    raw.reshape(N_EXPERT * N_OUT, -1, size)[..., :scales] = np.tile(np.frombuffer(np.float16(0.01).tobytes(), np.uint8),
                                                                     scales // 2)
    return list(repack(raw, qtype).values())


def _build(func, scheduled: bool):
    if scheduled:
        func = ExpertMatmul().apply(func, HOST).mod["main"]
    return tvm.compile(tvm.IRModule({"main": func}), target=HOST)["main"]


def _call(func, inputs, out_shape):
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.tensor(np.zeros(out_shape, np.float32), dev)]
    func(*args)
    return args[-1].numpy()


def _quantized(x, qtype):
    fmt = int8_format(qtype)
    quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(N_IN, fmt, batch="dynamic")}), target=HOST)["main"]
    outs = [tvm.runtime.tensor(np.zeros(s, d), tvm.cpu()) for s, d in fmt.specs(N_IN, x.shape[0]).values()]
    quantize(tvm.runtime.tensor(x, tvm.cpu()), *outs)
    return [o.numpy() for o in outs]


def _rows(rng):
    experts = np.sort(rng.integers(0, N_EXPERT, TOKENS * USED)).astype(np.int32)  # grouped, as moe.sort_func gives
    return experts, rng.integers(0, TOKENS, TOKENS * USED).astype(np.int32)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_f32_schedule_is_bit_identical_and_gathers(qtype, rng):
    experts, tokens = _rows(rng)
    x = rng.standard_normal((TOKENS, N_IN)).astype(np.float32)
    planes = _planes(rng, qtype)
    func = expert_matmul(qtype, N_EXPERT, N_OUT, N_IN, True, "experts")
    inputs = [x, experts, tokens, *planes]
    plain, scheduled = (_call(_build(func, s), inputs, (experts.size, N_OUT)) for s in (False, True))
    assert np.array_equal(plain, scheduled) and np.abs(plain).max() > 0
    # row q is token tokens[q] through expert experts[q]'s rows
    dense = _build(quant_matmul(qtype, N_EXPERT * N_OUT, N_IN, name="dense"), False)
    every = _call(dense, [x, *planes], (TOKENS, N_EXPERT * N_OUT)).reshape(TOKENS, N_EXPERT, N_OUT)
    np.testing.assert_allclose(plain, every[tokens, experts], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(int8_isa(HOST) is None, reason="no int8 CPU path here (x86 with AVX2 or VNNI)")
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0,
                                   GGMLQuantizationType.Q5_0], ids=lambda t: t.name)
def test_int8_kernel_is_the_gemv_of_each_row(qtype, rng):
    """The vector body gives, for row q, exactly the int8 GEMV's output (Int8GEMV, decode's kernel) of token
    tokens[q] against the stacked matrix's row experts[q]·n_out + n; the TE definition sums its blocks in another
    order (float32 rounding apart)."""
    experts, tokens = _rows(rng)
    x = rng.standard_normal((TOKENS, N_IN)).astype(np.float32)
    planes, acts = _planes(rng, qtype), _quantized(x, qtype)
    func = int8_expert_matmul(qtype, N_EXPERT, N_OUT, N_IN, True, "experts")
    inputs = [*acts, experts, tokens, *planes]
    plain, scheduled = (_call(_build(func, s), inputs, (experts.size, N_OUT)) for s in (False, True))
    gemv = tvm.compile(tvm.IRModule({"main": Int8GEMV().apply(int8_matmul(qtype, N_EXPERT * N_OUT, N_IN), HOST)
                                     .mod["main"]}), target=HOST)["main"]
    every = np.stack([_call(gemv, [a[t:t + 1] for a in acts] + planes, (1, N_EXPERT * N_OUT))[0]
                      for t in range(TOKENS)]).reshape(TOKENS, N_EXPERT, N_OUT)
    assert np.array_equal(scheduled, every[tokens, experts])
    assert np.abs(plain - scheduled).max() <= 1e-6 * np.abs(plain).max()


def test_declines_other_functions():
    assert ExpertMatmul().apply(quant_matmul("Q4_K", 64, 256), HOST) is None
    func = expert_matmul(GGMLQuantizationType.Q8_0, N_EXPERT, N_OUT, N_IN, False, "experts")
    assert ExpertMatmul().apply(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None


@pytest.mark.skipif(int8_isa(HOST) is None, reason="no int8 CPU path here (x86 with AVX2 or VNNI)")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q5_0", "Q6_K", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("gather,block_rows", [(True, 64), (True, 8), (False, 8)], ids=["gate", "blocks-of-8", "down"])
def test_prompt_rows_take_the_dense_gemms_numbers(qtype, gather, block_rows, rng):
    """A prompt's many rows an expert (past GEMM_ROWS_PER_EXPERT) take the output-lane GEMM body: row q is, to the
    bit, the dense int8 GEMM's output (Int8GEMV past 16 rows: int8_gemm's body) of token tokens[q] against expert
    experts[q]'s rows, however the rows fall into the tasks' blocks (runs of one expert split across blocks, an
    expert absent, blocks ending mid-run); within the reference's bound of llama.cpp's arithmetic."""
    from luce_schedules.cpu.moe import GEMM_ROWS_PER_EXPERT

    from tests.lower.test_cpu_int8 import emulated_activations, reference_gemv
    from tests.lower.test_quant_matmul import random_raw

    qtype = GGMLQuantizationType[qtype]
    tokens_n, used = 40, 3
    rows_n = tokens_n * used
    assert rows_n > GEMM_ROWS_PER_EXPERT * N_EXPERT
    experts = np.sort(rng.choice([0, 1, 3], rows_n, p=[0.2, 0.5, 0.3])).astype(np.int32)  # expert 2 chosen by none
    tokens = rng.integers(0, tokens_n, rows_n).astype(np.int32)
    n_in = 512
    raw = random_raw(qtype.name, N_EXPERT * N_OUT, n_in, rng)
    planes = list(repack(raw, qtype).values())
    x = rng.standard_normal((tokens_n, n_in)).astype(np.float32)
    fmt = int8_format(qtype)
    quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(n_in, fmt, batch="dynamic")}), target=HOST)["main"]
    acts = [tvm.runtime.tensor(np.zeros(s, d), tvm.cpu()) for s, d in fmt.specs(n_in, tokens_n).values()]
    quantize(tvm.runtime.tensor(x, tvm.cpu()), *acts)
    acts = [a.numpy() for a in acts]
    func = int8_expert_matmul(qtype, N_EXPERT, N_OUT, n_in, gather, "experts")
    kernel = tvm.compile(tvm.IRModule({"main": ExpertMatmul().apply(func, HOST, {"block_rows": block_rows})
                                       .mod["main"]}), target=HOST)["main"]
    row_acts = acts if gather else [a[tokens] for a in acts]  # down: the rows' activations in sorted order
    got = _call(kernel, [*row_acts, experts, *([tokens] if gather else []), *planes], (rows_n, N_OUT))
    dense = tvm.compile(tvm.IRModule({"main": Int8GEMV().apply(
        int8_matmul(qtype, N_EXPERT * N_OUT, n_in, batch="dynamic"), HOST).mod["main"]}), target=HOST)["main"]
    every = _call(dense, [*acts, *planes], (tokens_n, N_EXPERT * N_OUT)).reshape(tokens_n, N_EXPERT, N_OUT)
    np.testing.assert_array_equal(got, every[tokens, experts])
    for t in np.unique(tokens)[:4]:
        want, bound = reference_gemv(raw, qtype.name, emulated_activations(x[t:t + 1], qtype.name))
        want, bound = want.reshape(N_EXPERT, N_OUT), bound.reshape(N_EXPERT, N_OUT)
        for q in np.flatnonzero(tokens == t):
            assert np.all(np.abs(got[q] - want[experts[q]]) <= bound[experts[q]]), (t, q)
