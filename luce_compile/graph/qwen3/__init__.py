"""qwen3 (src/models/qwen3.cpp): qwen2 without biases, with per-head RMSNorm of q and k before RoPE."""

from luce_compile.graph.qwen3.model import STYLE, build

__all__ = ["STYLE", "build"]
