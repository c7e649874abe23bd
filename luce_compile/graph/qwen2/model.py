"""The qwen2 graph: the plain decoder with q/k/v biases (read wherever present), NEOX RoPE (from the config), and
the optional `output.bias` on the LM head that qwen2.cpp adds."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(arch="qwen2", optional_biases=frozenset({"output"}))


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    return build_decoder(config, tensors, STYLE)
