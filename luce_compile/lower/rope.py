"""RoPE in both of ggml's layouts, as a TensorIR function over (B, S, H, D) with per-token positions.

ggml_rope_ext: theta_i = pos · freq_scale · base^(-2i/dim) / freq_factors[i], i < dim/2 (freq_factors: llama 3's
rope_freqs.weight, its long-context "llama3" scaling, an input when given; else 1). NORM (llama) rotates adjacent pairs
(x[2i], x[2i+1]); NEOX (qwen2/qwen3/gemma3) rotates halves (x[i], x[i + dim/2]). Dims past `dim` pass through.
The angle is formed in float64: at position 8000 a float32 angle is off by ~1e-3 rad, which is visible in logits.
"""

from __future__ import annotations

import math

from tvm import te, tirx

from luce_compile.errors import LuceError


def rope_func(layout: str, n_head: int, head_dim: int, dim: int, base: float, freq_scale: float,
              dtype: str = "float32", name: str = "rope", freq_factors: bool = False) -> tirx.PrimFunc:
    """(x (B, S, H, D), positions (B, S) int32[, freq_factors (dim/2,) float32]) → y (B, S, H, D)."""
    if layout not in ("norm", "neox") or dim % 2 or not 0 < dim <= head_dim:
        raise LuceError(f"lower: rope layout {layout!r} with dim {dim} over head size {head_dim} is not valid.")
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq_len", "int64")
    x = te.placeholder((b, s, n_head, head_dim), dtype, name="x")
    pos = te.placeholder((b, s), "int32", name="positions")
    factors = te.placeholder((dim // 2,), "float32", name="freq_factors") if freq_factors else None
    half = dim // 2
    log_base = math.log(base)

    def rotate(bi, si, h, d):
        # (pair index i, partner dim, sign of the partner's term) for this layout
        if layout == "norm":
            i, partner = d // 2, tirx.if_then_else(d % 2 == 0, d + 1, d - 1)
            sign = tirx.if_then_else(d % 2 == 0, -1.0, 1.0)
        else:
            i, partner = d % half, tirx.if_then_else(d < half, d + half, d - half)
            sign = tirx.if_then_else(d < half, -1.0, 1.0)
        inv_freq = tirx.exp(tirx.Cast("float64", i) * (-2.0 * log_base / dim))
        if factors is not None:  # clamped: dims past `dim` are not rotated, their (unused) index stays in bounds
            inv_freq = inv_freq / tirx.Cast("float64", factors[tirx.min(i, half - 1)])
        theta = tirx.Cast("float64", pos[bi, si]) * freq_scale * inv_freq
        xd, xp = tirx.Cast("float64", x[bi, si, h, d]), tirx.Cast("float64", x[bi, si, h, partner])
        rotated = xd * tirx.cos(theta) + sign * xp * tirx.sin(theta)
        return tirx.if_then_else(d < dim, tirx.Cast(dtype, rotated), x[bi, si, h, d])

    y = te.compute((b, s, n_head, head_dim), rotate, name="rope")
    inputs = [x, pos] + ([factors] if factors is not None else [])
    return te.create_prim_func([*inputs, y]).with_attr("global_symbol", name)
