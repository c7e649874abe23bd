"""gemma3 (src/models/gemma3.cpp): GeGLU, scaled embeddings, q/k norms, post norms, sliding-window layers."""

from luce_compile.graph.gemma3.model import STYLE, build

__all__ = ["STYLE", "build"]
