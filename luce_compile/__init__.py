"""luce-compile: GGUF models compiled to TVM TensorIR artifacts, served by a thin runtime."""

__version__ = "0.1.0"
