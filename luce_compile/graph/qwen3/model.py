"""The qwen3 graph: per-head RMSNorm of q and k (attn_q_norm, attn_k_norm), applied before RoPE as qwen3.cpp does."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(arch="qwen3", qk_norm=True)


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    return build_decoder(config, tensors, STYLE)
