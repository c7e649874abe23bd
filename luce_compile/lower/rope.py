"""RoPE in both of ggml's layouts, as a TensorIR function over (B, S, H, D) with per-token positions.

ggml_rope_ext: theta_i = pos · freq_scale · base^(-2i/dim) / freq_factors[i], i < dim/2 (freq_factors: llama 3's
rope_freqs.weight, its long-context "llama3" scaling, an input when given; else 1). NORM (llama) rotates adjacent pairs
(x[2i], x[2i+1]); NEOX (qwen2/qwen3/gemma3) rotates halves (x[i], x[i + dim/2]). Dims past `dim` pass through.
The angle is formed in float64: at position 8000 a float32 angle is off by ~1e-3 rad, which is visible in logits.
YaRN (gpt-oss; OpKind.ROPE's docstring, ggml's rope_yarn): each pair's position scale ramps from freq_scale (long
wavelengths, interpolated) to 1 (short ones, kept) between the correction dims, and cos and sin are scaled by
attn_factor · (1 + 0.1 ln(1/freq_scale)); the correction dims are constants of the kernel (`yarn_corr_dims`).
"""

from __future__ import annotations

import math

from tvm import te, tirx

from luce_compile.errors import LuceError


def yarn_corr_dims(dim: int, base: float, beta_fast: float, beta_slow: float, n_ctx_orig: int) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pairs whose wavelength fits beta_fast (beta_slow) times in the original context,
    rounded down (up) and kept within [0, dim - 1]."""
    def corr(beta: float) -> float:
        return dim * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr(beta_fast))), min(dim - 1.0, math.ceil(corr(beta_slow)))


def rope_func(layout: str, n_head: int, head_dim: int, dim: int, base: float, freq_scale: float,
              dtype: str = "float32", name: str = "rope", freq_factors: bool = False,
              yarn: dict | None = None) -> tirx.PrimFunc:
    """(x (B, S, H, D), positions (B, S) int32[, freq_factors (dim/2,) float32]) → y (B, S, H, D). `yarn`: the rope
    op's ext_factor, attn_factor, beta_fast, beta_slow and n_ctx_orig (module docstring), else none."""
    if layout not in ("norm", "neox") or dim % 2 or not 0 < dim <= head_dim:
        raise LuceError(f"lower: rope layout {layout!r} with dim {dim} over head size {head_dim} is not valid.")
    b, s = tirx.Var("batch", "int64"), tirx.Var("seq_len", "int64")
    x = te.placeholder((b, s, n_head, head_dim), dtype, name="x")
    pos = te.placeholder((b, s), "int32", name="positions")
    factors = te.placeholder((dim // 2,), "float32", name="freq_factors") if freq_factors else None
    half = dim // 2
    log_base = math.log(base)
    ext, mscale, lo, span = 0.0, 1.0, 0.0, 1.0
    if yarn is not None:
        ext, mscale = yarn["ext_factor"], yarn["attn_factor"]
        if ext:
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        lo, hi = yarn_corr_dims(dim, base, yarn["beta_fast"], yarn["beta_slow"], yarn["n_ctx_orig"])
        span = max(0.001, hi - lo)

    def position_scale(i: tirx.PrimExpr) -> tirx.PrimExpr:
        """freq_scale, or YaRN's mix of it and 1 for pair i (1 where the ramp is 1, below the correction dims)."""
        if not ext:
            return tirx.const(freq_scale, "float64")
        ramp = 1.0 - tirx.min(1.0, tirx.max(0.0, (tirx.Cast("float64", i) - lo) / span))
        r = ramp * ext
        return freq_scale * (1.0 - r) + r

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
        theta = tirx.Cast("float64", pos[bi, si]) * position_scale(i) * inv_freq
        xd, xp = tirx.Cast("float64", x[bi, si, h, d]), tirx.Cast("float64", x[bi, si, h, partner])
        rotated = xd * tirx.cos(theta) + sign * xp * tirx.sin(theta)
        if mscale != 1.0:
            rotated = rotated * mscale
        return tirx.if_then_else(d < dim, tirx.Cast(dtype, rotated), x[bi, si, h, d])

    y = te.compute((b, s, n_head, head_dim), rotate, name="rope")
    inputs = [x, pos] + ([factors] if factors is not None else [])
    return te.create_prim_func([*inputs, y]).with_attr("global_symbol", name)
