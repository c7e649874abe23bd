"""The emulating oracle's type filter: the megakernel's q8_activations round only the inputs of quantized matmuls,
and its float_mma (--megakernel-tf32) only those of F16/BF16 ones, so its reference must leave every other matmul
exact; and the 8-bit path's integer arithmetic is that oracle's matmul."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from luce_compile.graph.oracle import Oracle
from luce_compile.graph.rounding import GgmlRounding, q8_blocks, tf32
from luce_compile.synthetic import cached_synthetic, preset

pytestmark = pytest.mark.unit


def _logits(oracle: Oracle) -> np.ndarray:
    return oracle.prefill([5, 17, 99, 3])[-1]


def test_rounding_applies_to_the_named_types_only():
    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant="Q4_1"))
    plain = _logits(Oracle(gguf))
    assert np.array_equal(_logits(GgmlRounding(gguf, types=("Q8_0",))), plain)  # no Q8_0 matmul in the model
    rounded = _logits(GgmlRounding(gguf, types=("Q4_1",)))
    gap = np.abs(rounded - plain).max() / np.abs(plain).max()
    assert 1e-4 < gap < 0.2  # 8-bit activations move the logits, by the rounding's size, not more


def test_q8_blocks_round_half_to_even_on_127_over_amax():
    x = np.array([[127.0, 63.5, -0.5, 1.5] + [0.0] * 28], dtype=np.float32)
    q, d = q8_blocks(x)
    assert q[0, 0, :4].tolist() == [127, 64, -0, 2] and d[0, 0, 0] == np.float32(1)


def test_tf32_keeps_ten_mantissa_bits_rounding_ties_away_from_zero():
    """cvt.rna.tf32.f32, as the megakernel's emit_cuda.tf32 does it: +0x1000 on the bits, 13 low bits cleared."""
    one = 1.0
    x = np.array([one + 2.0**-11, one + 2.0**-12, -(one + 2.0**-11), one + 3 * 2.0**-11, 2.0**-11, 65504.0],
                 dtype=np.float32)
    assert tf32(x).tolist() == [one + 2.0**-10, one, -(one + 2.0**-10), one + 2 * 2.0**-10, 2.0**-11, 65504.0]


def test_tf32_rounding_applies_to_the_named_float_types_only():
    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), quant="BF16"))
    plain = _logits(Oracle(gguf))
    assert np.array_equal(_logits(GgmlRounding(gguf, types=(), tf32_types=("F16",))), plain)  # no F16 matmul
    rounded = _logits(GgmlRounding(gguf, types=(), tf32_types=("BF16",)))
    gap = np.abs(rounded - plain).max() / np.abs(plain).max()
    assert 1e-6 < gap < 5e-3  # 10 mantissa bits of every input: ~1e-3 at the logits, as measured on the H200


def test_megakernel_q8_is_refused_where_no_megakernel_is_built(tmp_path):
    """--megakernel-q8 changes the CUDA decode megakernels: on a CPU target, or with --no-megakernel, it would do
    nothing, so compile says so before any work."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.errors import LuceError

    gguf = cached_synthetic(preset("tiny-llama"))
    with pytest.raises(LuceError, match="--megakernel-q8"):
        compile_model(gguf, "cpu", tmp_path / "a", megakernel_q8=True)
    with pytest.raises(LuceError, match="--no-megakernel"):
        compile_model(gguf, "sm_90", tmp_path / "b", megakernel=False, megakernel_q8=True)
    with pytest.raises(LuceError, match="--megakernel-tf32"):
        compile_model(gguf, "cpu", tmp_path / "a", megakernel_tf32=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_q4_k_sub_blocks_are_q4_1_blocks_for_the_gpus_8_bit_dot_products():
    """The megakernel's 8-bit matvecs take a Q4_K sub-block of 32 as a Q4_1 block, w = (d·sc)·q + m with m = −dmin·mn
    (gguf.quants.k_quant_minimums), against q8_1 activations (GgmlRounding(gpu_q8_1=True)) where the CPU takes q8_K:
    each block's w − m must be a whole multiple 0..15 of one step, and the two roundings must both stay near the
    exact logits and differ from each other."""
    from luce_compile.gguf.quants import dequantize, k_quant_minimums
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.lower.quant_layout import repack

    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=512, quant="Q4_K"))
    f = read_gguf(gguf)
    raw = f.raw("blk.0.ffn_up.weight")
    w = dequantize(raw, f.tensor("blk.0.ffn_up.weight").ggml_type).astype(np.float64).reshape(raw.shape[0], -1, 32)
    q = w - k_quant_minimums(raw)[..., None]
    planes = repack(raw, "Q4_K")  # the kernels' planes: d per 256 values, sc per 32
    step = (np.repeat(planes["d"].astype(np.float64), 8, axis=-1) * planes["sc"])[..., None]
    levels = q / np.where(step > 0, step, 1)
    assert np.allclose(levels, np.rint(levels), atol=1e-6) and levels.min() >= 0 and levels.max() <= 15
    plain = _logits(Oracle(gguf))
    gpu = _logits(GgmlRounding(gguf, types=("Q4_K",), gpu_q8_1=True))
    cpu = _logits(GgmlRounding(gguf, types=("Q4_K",)))
    for rounded in (gpu, cpu):
        assert 1e-5 < np.abs(rounded - plain).max() / np.abs(plain).max() < 0.2
    assert not np.array_equal(gpu, cpu)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q6_K"])
def test_the_megakernels_integer_sums_are_the_gpu_roundings_matmul(qtype, rng):
    """The 8-bit path's arithmetic, written out in numpy from the kernels' planes as emit_cuda computes it (integer
    sums of stored quants times q8 activations, a Q5_K sub-block of 32 as a Q5_1 block with d·sc and −dmin·mn
    against s_x, a Q6_K half of 16 scaled by its int8 scale, offset 32), must be the emulating oracle's matmul
    (GgmlRounding(gpu_q8_1=True)), which the device checks hold the megakernel to."""
    from luce_compile.graph.ir import OpKind
    from luce_compile.graph.rounding import f16
    from luce_compile.lower.quant_layout import repack

    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=512, quant=qtype))
    oracle = GgmlRounding(gguf, types=(qtype,), gpu_q8_1=True)
    op = next(o for o in oracle.graph.ops if o.kind == OpKind.MATMUL and "ffn_down" in o.weights["weight"])
    raw = oracle.gguf.raw(op.weights["weight"])
    planes = {k: v.astype(np.int64) if v.dtype != np.float16 else v.astype(np.float64)
              for k, v in repack(raw, qtype).items()}
    n_out, n_in = raw.shape[0], planes["qs"].shape[1] * 8
    k = np.arange(n_in)
    q = (planes["qs"][:, k // 8] >> (4 * (k % 8))) & 0xF
    x = rng.standard_normal((3, n_in)) * 2
    qx, dx = q8_blocks(x)  # (3, blocks, 32), the float32 scale
    qx, dx = qx.astype(np.int64), f16(dx[..., 0])  # the kernel reads d_x as stored (fp16)
    blocks = n_in // 32
    if qtype == "Q6_K":
        q = (q | (((planes["qh"][:, k // 16] >> (2 * (k % 16))) & 3) << 4)) - 32
        halves = np.einsum("ohi,bhi->boh", q.reshape(n_out, -1, 16), qx.reshape(3, -1, 16))  # (3, out, K/16)
        ints = (halves * planes["sc"][None]).reshape(3, n_out, blocks, 2).sum(-1)  # Σ_h sc_h · Σ (q − 32)·q_x
        y = np.einsum("bon,bn,on->bo", ints, dx, np.repeat(planes["d"], 8, axis=-1))
    else:
        q = q | (((planes["qh"][:, k // 32] >> (k % 32)) & 1) << 4)
        ints = np.einsum("oni,bni->bon", q.reshape(n_out, blocks, 32), qx)
        d = np.repeat(planes["d"], 8, axis=-1) * planes["sc"]
        m = -np.repeat(planes["dmin"], 8, axis=-1) * planes["mn"]
        s = f16(q8_blocks(x)[1][..., 0] * qx.sum(-1))  # s_x = fp16(d_x · Σ q_x), from the float32 d_x
        y = np.einsum("bon,bn,on->bo", ints, dx, d) + s @ m.T
    want = oracle._matmul(op, x)
    assert np.abs(y - want).max() <= 1e-9 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["Q3_K", "Q2_K"])
def test_the_8_bit_gemms_q3_k_and_q2_k_sums_are_the_gpu_roundings_matmul(qtype, rng):
    """The 8-bit prefill GEMM's arithmetic for issue 40's K-quants, written out in numpy from the kernels' planes
    (schedules/gpu/mmq_blocks.py): Q3_K's 2 low bits with the hmask bit as the third, q − 4, dotted per 16 values and
    scaled by d·(sc − 32); Q2_K's sc·q dotted per 32 values and scaled by d, and its minimum −dmin·mn of each 16
    values times d_x·Σq_x over those 16. Both must be the emulating oracle's matmul (GgmlRounding(gpu_q8_1=True):
    q8_0's values, GPU_Q8_0_TYPES), which scripts/device_check.py holds the GEMM to."""
    from luce_compile.graph.ir import OpKind
    from luce_compile.graph.rounding import f16
    from luce_compile.lower.quant_layout import TWO_BIT_SLOTS, repack

    gguf = cached_synthetic(dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=512, quant=qtype))
    oracle = GgmlRounding(gguf, types=(qtype,), gpu_q8_1=True)
    op = next(o for o in oracle.graph.ops if o.kind == OpKind.MATMUL and "ffn_down" in o.weights["weight"])
    assert oracle.gguf.tensor(op.weights["weight"]).ggml_type.name == qtype
    raw = oracle.gguf.raw(op.weights["weight"])
    planes = repack(raw, qtype)
    n_out, n_in = raw.shape[0], planes["qs"].shape[1] * 16
    k = np.arange(n_in)
    slots = (planes["qs"][:, k // 16].astype(np.int64) >> (2 * (k % 16))) & 3  # (out, K), slot order per 32
    q = np.empty_like(slots)
    q.reshape(n_out, -1, 32)[..., TWO_BIT_SLOTS] = slots.reshape(n_out, -1, 32)  # element order
    x = rng.standard_normal((3, n_in)) * 2
    qx, dx = q8_blocks(x)
    qx16, dx16 = qx.astype(np.int64).reshape(3, -1, 16), np.repeat(f16(dx[..., 0]), 2, axis=-1)  # per 16 values
    d16 = np.repeat(planes["d"].astype(np.float64), 16, axis=-1)  # (out, K/16)
    if qtype == "Q3_K":
        q = (q | (((planes["qh"][:, k // 32].astype(np.int64) >> (k % 32)) & 1) << 2)) - 4
        ints = np.einsum("ohi,bhi->boh", q.reshape(n_out, -1, 16), qx16)  # (3, out, K/16)
        y = np.einsum("boh,bh,oh->bo", ints, dx16, d16 * planes["sc"])
    else:
        scaled = q.reshape(n_out, -1, 16) * planes["sc"][..., None].astype(np.int64)  # sc·q
        ints = np.einsum("ohi,bhi->boh", scaled, qx16)
        m = -np.repeat(planes["dmin"].astype(np.float64), 16, axis=-1) * planes["mn"]  # (out, K/16)
        y = np.einsum("boh,bh,oh->bo", ints, dx16, d16) + np.einsum("bh,bh,oh->bo", qx16.sum(-1), dx16, m)
    want = oracle._matmul(op, x)
    assert np.abs(y - want).max() <= 1e-9 * np.abs(want).max()
    # the q8_K rounding the CPU form takes (gpu_q8_1=False) is another one
    cpu = GgmlRounding(gguf, types=(qtype,))._matmul(op, x)
    assert np.abs(cpu - want).max() > 1e-6 * np.abs(want).max()
