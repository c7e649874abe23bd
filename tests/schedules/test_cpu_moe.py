"""schedules/cpu/moe.py's ExpertMatmul: it takes lower/moe.py's expert matmuls and nothing else, and the scheduled
function gives the unscheduled one's outputs bit for bit (it only moves loops: every sum keeps its order), for the
float32 and the int8 form, on random weight blocks and router choices."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from luce_schedules.cpu.moe import ExpertMatmul

from luce_compile.lower.cpu_int8 import int8_format, quantize_q8
from luce_compile.lower.moe import expert_matmul, int8_expert_matmul
from luce_compile.lower.quant_layout import repack
from luce_compile.lower.quant_matmul import quant_matmul

pytestmark = pytest.mark.unit
HOST = tvm.target.Target("llvm")
N_EXPERT, N_OUT, N_IN, TOKENS, USED = 4, 32, 256, 3, 2


def _planes(rng, qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N_EXPERT * N_OUT, N_IN // block * size), dtype=np.uint8)
    scales = 2 if qtype == GGMLQuantizationType.Q8_0 else 4  # Q8_0's d; Q4_K's d and dmin: finite, small
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


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_scheduled_expert_matmul_is_bit_identical(qtype, int8, rng):
    rows = TOKENS * USED
    experts = np.sort(rng.integers(0, N_EXPERT, rows)).astype(np.int32)  # grouped, as moe.sort_func gives them
    tokens = rng.integers(0, TOKENS, rows).astype(np.int32)
    x = rng.standard_normal((TOKENS, N_IN)).astype(np.float32)
    if int8:
        fmt = int8_format(qtype)
        quantize = tvm.compile(tvm.IRModule({"main": quantize_q8(N_IN, fmt, batch="dynamic")}), target=HOST)["main"]
        outs = [tvm.runtime.tensor(np.zeros(s, d), tvm.cpu()) for s, d in fmt.specs(N_IN, TOKENS).values()]
        quantize(tvm.runtime.tensor(x, tvm.cpu()), *outs)
        acts = [o.numpy() for o in outs]
        func = int8_expert_matmul(qtype, N_EXPERT, N_OUT, N_IN, True, "experts")
    else:
        acts = [x]
        func = expert_matmul(qtype, N_EXPERT, N_OUT, N_IN, True, "experts")
    inputs = [*acts, experts, tokens, *_planes(rng, qtype)]
    plain, scheduled = (_call(_build(func, s), inputs, (rows, N_OUT)) for s in (False, True))
    assert np.array_equal(plain, scheduled)
    assert np.abs(plain).max() > 0
    if not int8:  # the gather itself: row q is token tokens[q] through expert experts[q]'s rows
        dense = _build(quant_matmul(qtype, N_EXPERT * N_OUT, N_IN, name="dense"), False)
        every = _call(dense, [x, *inputs[3:]], (TOKENS, N_EXPERT * N_OUT)).reshape(TOKENS, N_EXPERT, N_OUT)
        np.testing.assert_allclose(plain, every[tokens, experts], rtol=1e-5, atol=1e-5)


def test_declines_other_functions():
    assert ExpertMatmul().apply(quant_matmul("Q4_K", 64, 256), HOST) is None
    func = expert_matmul(GGMLQuantizationType.Q8_0, N_EXPERT, N_OUT, N_IN, False, "experts")
    assert ExpertMatmul().apply(func, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None
