"""qwen2 (src/models/qwen2.cpp): llama with q/k/v biases, NEOX RoPE and an optional output bias."""

from luce_compile.graph.qwen2.model import STYLE, build

__all__ = ["STYLE", "build"]
