"""Stage 2: GGUF → graph IR (one builder per architecture), the float64 oracle, and ONNX export."""

from luce_compile.graph.ir import Graph, Op, OpKind, Value, validate
from luce_compile.graph.registry import BUILDERS, build_graph

__all__ = ["BUILDERS", "Graph", "Op", "OpKind", "Value", "build_graph", "validate"]
