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
