"""llama (src/models/llama.cpp): SwiGLU, NORM RoPE (adjacent pairs), optional biases and llama 3 rope factors."""

from luce_compile.graph.llama.model import STYLE, build

__all__ = ["STYLE", "build"]
