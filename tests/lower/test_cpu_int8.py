"""8-bit activations and the int8 GEMV definitions of luce_compile.lower.cpu_int8, against llama.cpp's arithmetic.

The activation rounding is the emulation tests/graph/test_vs_llama_cpp.py checks the oracle with against llama.cpp
(`_q8_blocks`); the quantizer must reproduce it bit for bit (q, and the fp16 d and s). The GEMV reference is then
the exact float64 dot of those rounded activations with the dequantized weights (gguf-py's dequantizer).

Tolerance of the GEMV: the integer parts are exact; a kernel may split each block's integer dot into partial sums
(the VNNI kernel keeps 8 lanes of 4 products) and scale each by d_w·d_x (one rounding) before summing them in
float32, so with every such split the error stays below (n_in/32 + 12)·u·Σ_k |x_k·w_k| (+ the min terms' |m·s|),
u = 2^-24 (Higham §3.1; 8 lanes summed at the end, 2 roundings per term, 2 for the min sum); each output is checked
against twice that bound. For Q4_K/Q5_K, whose weight d·sc·q − dmin·mn is summed as two separate integer dots,
|w| in that sum is |d·sc·q| + |dmin·mn|. A wrong nibble, bit, order or scale moves y by ~|y|/√(n_in/32), far above.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType

from luce_compile.errors import UnsupportedError
from luce_compile.graph.rounding import q8_blocks as _q8_blocks
from luce_compile.graph.rounding import q8_k_blocks as _q8_k_blocks
from luce_compile.lower.cpu_int8 import (
    INT8_FORMATS,
    INT8_GEMV_ATTR,
    int8_format,
    int8_isa,
    int8_matmul,
    quantize_q8,
    resolve_precision,
)
from luce_compile.lower.quant_layout import repack
from tests.lower.test_quant_matmul import random_raw, reference_dequant

pytestmark = pytest.mark.unit
TYPES = [t.name for t in INT8_FORMATS]
HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})
HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # AVX2 + FMA + F16C, no VNNI
# targets whose int8 kernels run on this CPU, one per byte dot: its own best, and AVX2's forced where it has VNNI
INT8_TARGETS = [] if int8_isa(HOST) is None else [HOST] if int8_isa(HOST) == "avx2" else [HOST, HASWELL]
INT8_IDS = [str(int8_isa(t)) for t in INT8_TARGETS]


def emulated_activations(x: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """llama.cpp's Q8_0/Q8_1/Q8_K blocks of x (1, n_in) for weight type `kind`, in the kernel's value order.

    Returns the quantizer's outputs as `Q8Format.specs` names them: xq (1, n_in) int8, xd (1, nb) (fp16(d) for
    Q8_0/Q8_1, the float32 d for Q8_K), [xs (1, nb) = fp16(d·Σq) from the float32 d], [xb (1, n_in/16) the sums of
    q per 16 natural values], [xi (1, nb) Σq per block]; and `x_rounded` (1, n_in) float64 = q·d in the natural
    order (what the weights multiply)."""
    fmt = int8_format(kind)
    q, d = (_q8_k_blocks if fmt.with_bsums else _q8_blocks)(x)  # (1, nb, block) natural order, (1, nb, 1) float32
    if not fmt.with_bsums:
        d = d.astype(np.float16).astype(np.float32)  # Q8_0/Q8_1 store d as fp16; s is taken from the float32 d
    order = [fmt.position_element(p) for p in range(32)]
    out = {"xq": q.reshape(1, -1, 32)[..., order].reshape(x.shape).astype(np.int8), "xd": d[..., 0]}
    if fmt.with_sum:
        out["xs"] = (_q8_blocks(x)[1][..., 0] * q.sum(-1)).astype(np.float16).astype(np.float32)
    if fmt.with_bsums:
        out["xb"] = q.reshape(1, -1, 16).sum(-1).astype(np.int32)
    if fmt.with_isum:
        out["xi"] = q.sum(-1).astype(np.int32)
    out["x_rounded"] = (q * d.astype(np.float64)).reshape(x.shape)
    return out


# the bytes of a block that hold quants (ggml-common.h): zeroed, they leave a K-quant's min part −dmin·mn
QUANT_BYTES = {"Q4_K": slice(16, 144), "Q5_K": slice(16, 176)}


def reference_gemv(raw: np.ndarray, kind: str, act: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(y, bound): the exact float64 result for rounded activations, and each output's error bound (see above)."""
    w = reference_dequant(raw, kind).astype(np.float64)  # (n_out, n_in); gguf-py's one float32 rounding per value
    nb = w.shape[1] // 32
    x = act["x_rounded"]
    if kind in ("Q4_1", "Q5_1"):  # ggml: Σ d_w·d_x·Σq_w·q_x + m_w·s_x; w = d·q + m, so d·q = w − m
        m = raw.reshape(raw.shape[0], nb, -1)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        w = w - np.repeat(m, 32, axis=1)
    y, magnitude = x @ w.T, np.abs(x) @ np.abs(w).T  # (1, n_out)
    if kind in ("Q4_1", "Q5_1"):
        y, magnitude = y + act["xs"] @ m.T, magnitude + np.abs(act["xs"]) @ np.abs(m).T
    if kind in QUANT_BYTES:  # the scale part and the min part are summed separately: both magnitudes count
        zeroed = raw.reshape(raw.shape[0], w.shape[1] // 256, -1).copy()
        zeroed[..., QUANT_BYTES[kind]] = 0
        minimum = reference_dequant(zeroed.reshape(raw.shape), kind).astype(np.float64)  # exactly −dmin·mn
        magnitude = np.abs(x) @ (np.abs(w - minimum) + np.abs(minimum)).T
    return y, 2 * (nb + 12) * 2.0**-24 * magnitude


def run(
    func: tvm.tirx.PrimFunc,
    *arrays: np.ndarray,
    outs: list[tuple[tuple[int, ...], str]],
    target: tvm.target.Target = HOST,
) -> list[np.ndarray]:
    """Compile func (unscheduled unless it is already) and call it on numpy inputs; returns the outputs."""
    ex = tvm.compile(tvm.IRModule({"main": func}), target=target)
    results = [tvm.runtime.tensor(np.zeros(shape, dtype)) for shape, dtype in outs]
    ex["main"](*(tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays), *results)
    return [r.numpy() for r in results]


def quantized_inputs(x: np.ndarray, kind: str) -> list[np.ndarray]:
    """The quantizer's outputs (the int8 GEMV's first arguments) for x, run through our TIR kernel."""
    fmt = int8_format(kind)
    return run(quantize_q8(x.shape[1], fmt), x, outs=list(fmt.specs(x.shape[1]).values()))


def activations(rng: np.random.Generator, n_in: int) -> np.ndarray:
    """Random activations with a varied scale per block, plus an all-zero block (amax 0: d = 0, q = 0)."""
    x = rng.standard_normal((1, n_in)) * 2.0 ** rng.integers(-6, 6, (1, n_in // 32)).repeat(32, axis=1)
    x[0, 32:64] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", TYPES)
def test_quantize_matches_llama_cpp_rounding_bit_for_bit(kind, rng):
    x = activations(rng, 768)
    x[0, 512:] = 0.0  # a whole Q8_K block of zeros: d = 0, q = 0, bsums 0 (not 1/0)
    want = emulated_activations(x, kind)
    got = quantized_inputs(x, kind)
    assert len(got) == len(want) - 1
    for name, value in zip(int8_format(kind).specs(768), got, strict=True):
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_q8_k_keeps_the_sign_of_the_first_largest_value():
    """max is the first value of largest magnitude, sign included: −4 before 4 gives iscale = −127/−4 > 0, so −4
    → −127 and 4 → 127 (the last one, or |max|, would give iscale < 0: −4 → 127, 4 → −127)."""
    x = np.linspace(-1, 1, 256, dtype=np.float32)[None]
    x[0, 5], x[0, 9] = -4.0, 4.0
    q, d, _ = quantized_inputs(x, "Q4_K")
    assert d[0, 0] == np.float32(1) / (np.float32(-127) / np.float32(-4))
    fmt = int8_format("Q4_K")
    assert (q[0, fmt.element_position(5)], q[0, fmt.element_position(9)]) == (-127, 127)


def test_quantize_rounds_half_to_even():
    """ggml's x86 quantizer rounds with _MM_ROUND_NEAREST (rint), not roundf: 2.5 → 2, 3.5 → 4, −2.5 → −2."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 2.5, 3.5, -2.5]  # amax 127: the scale is exactly 1
    q = quantized_inputs(x, "Q8_0")[0]
    assert list(q[0, :4]) == [127, 2, 4, -2]


@pytest.mark.parametrize("kind", TYPES)
def test_int8_matmul_definition_matches_reference(kind, rng):
    """The unscheduled TE definition (what the schedule rule must reproduce) against the float64 reference."""
    n_out, n_in = 24, 512 if int8_format(kind).with_bsums else 128
    raw = random_raw(kind, n_out, n_in, rng)
    x = activations(rng, n_in)
    (y,) = run(
        int8_matmul(kind, n_out, n_in),
        *quantized_inputs(x, kind),
        *repack(raw, kind).values(),
        outs=[((1, n_out), "float32")],
    )
    want, bound = reference_gemv(raw, kind, emulated_activations(x, kind))
    assert np.all(np.abs(y - want) <= bound), np.abs(y - want).max()


@pytest.mark.parametrize("kind", TYPES)
def test_batched_definition_is_the_gemv_row_by_row(kind, rng):
    """batch "dynamic" (the batched decode): each row quantized on its own (bit for bit llama.cpp's rounding of that
    row) and multiplied as the GEMV's reference would; run here on 3 rows."""
    n_out, n_in, rows = 16, 512 if int8_format(kind).with_bsums else 128, 3
    fmt = int8_format(kind)
    raw = random_raw(kind, n_out, n_in, rng)
    x = np.concatenate([activations(rng, n_in) for _ in range(rows)])
    quantized = run(quantize_q8(n_in, fmt, batch="dynamic"), x, outs=list(fmt.specs(n_in, rows).values()))
    (y,) = run(
        int8_matmul(kind, n_out, n_in, batch="dynamic"),
        *quantized,
        *repack(raw, kind).values(),
        outs=[((rows, n_out), "float32")],
    )
    for r in range(rows):
        want = emulated_activations(x[r : r + 1], kind)
        for name, value in zip(fmt.specs(n_in), quantized, strict=True):
            np.testing.assert_array_equal(value[r : r + 1], want[name], err_msg=f"row {r} {name}")
        ref, bound = reference_gemv(raw, kind, want)
        assert np.all(np.abs(y[r : r + 1] - ref) <= bound), (r, np.abs(y[r : r + 1] - ref).max())


def test_int8_matmul_marks_its_weight_type():
    assert str(int8_matmul("Q4_1", 8, 64).attrs[INT8_GEMV_ATTR]) == "Q4_1"


def test_types_without_integer_kernel_are_refused():
    assert int8_format(GGMLQuantizationType.F16) is None
    with pytest.raises(UnsupportedError, match="no integer kernel for F16"):
        int8_matmul("F16", 8, 256)
    with pytest.raises(UnsupportedError, match="Q8_K activations need n_in a positive multiple of 256"):
        int8_matmul("Q4_K", 8, 288)


def test_resolve_precision():
    no_avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "sandybridge"})  # AVX without AVX2: no byte dot
    assert resolve_precision("auto", no_avx2) == "f32"
    assert resolve_precision("f32", HOST) == "f32"
    with pytest.raises(UnsupportedError, match="needs an x86 CPU target with AVX2"):
        resolve_precision("int8", no_avx2)  # asked for explicitly where it cannot run: refused before any work
    with pytest.raises(UnsupportedError, match="precision must be one of"):
        resolve_precision("fp8", HOST)


def test_resolve_precision_picks_f16_on_cuda_with_tensor_cores():
    from luce_compile.targets import get_target

    assert resolve_precision("auto", get_target("sm_90").tvm_target()) == "f16"
    assert resolve_precision("f32", get_target("sm_90").tvm_target()) == "f32"  # the exact mode stays
    assert resolve_precision("auto", get_target("gfx1201").tvm_target()) == "f32"  # no tensor-core rule on ROCm
    with pytest.raises(UnsupportedError, match="needs a CUDA target with tensor cores"):
        resolve_precision("f16", HOST)


@pytest.mark.parametrize("mcpu,isa", [("znver4", "avx512vnni"), ("sapphirerapids", "avx512vnni"),
                                      ("alderlake", "avxvnni"), ("znver3", "avx2"), ("haswell", "avx2"),
                                      ("sandybridge", None)])
def test_int8_isa_is_the_best_byte_dot_the_cpu_has(mcpu, isa):
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    assert int8_isa(target) == isa
    assert resolve_precision("auto", target) == ("int8" if isa else "f32")
    assert int8_isa(tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None


@pytest.mark.parametrize("precision,int8_calls", [("int8", True), ("f32", False)])
def test_lowering_quantizes_each_input_once(precision, int8_calls):
    """decode1, the batched decode, prefill and verify with precision int8: one quantize per matmul input (Q/K/V
    share one, gate/up another), one int8 GEMV (GEMM for more rows) per matmul and the LM head (issue 13: prefill
    takes them too). f32 emits no int8 kernel at all."""
    import re

    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph.registry import build_graph
    from luce_compile.lower.relax_model import LowerOptions, lower_graph
    from luce_compile.synthetic import SyntheticSpec, cached_synthetic

    graph = build_graph(read_gguf(cached_synthetic(SyntheticSpec(quant="Q4_1", n_embd=256, n_ff=512))))
    mod, _ = lower_graph(graph, HOST, LowerOptions(precision=precision))
    layers = graph.config.n_layer
    want = (4 * layers + 1, 7 * layers + 1) if int8_calls else (0, 0)
    functions = [("decode1", "gemv"), ("decode", "gemm"), ("prefill", "gemm")]  # decode: one row per sequence
    for function, kind in functions + ([("verify", "gemm")] if int8_calls else []):
        script = mod[function].script()
        quantizes = len(re.findall(r"R\.call_tir\(quantize_q8", script))
        assert (quantizes, len(re.findall(rf"R\.call_tir\(int8_{kind}", script))) == want, function
