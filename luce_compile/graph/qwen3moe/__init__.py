"""qwen3moe (src/models/qwen3moe.cpp): qwen3's attention, and a mixture-of-experts FFN in every layer."""

from luce_compile.graph.qwen3moe.model import STYLE, build

__all__ = ["STYLE", "build"]
