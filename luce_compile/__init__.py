"""luce-compile: GGUF models compiled to TVM TensorIR artifacts, served by a thin runtime."""

import luce_runtime  # noqa: F401  (claims the CPU's cores for TVM's thread pool before any kernel runs here)

__version__ = "0.1.0"
