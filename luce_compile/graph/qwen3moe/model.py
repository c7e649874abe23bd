"""The qwen3moe graph: qwen3's attention (q/k head norms before RoPE, no biases), then in place of the dense FFN
build_moe_ffn with softmax gating, top expert_used_count experts and their weights renormalized (qwen3moe.cpp passes
norm_w = true), SwiGLU experts, no shared expert. The numbers come from the ModelConfig (gguf/config._moe)."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.errors import GGUFError
from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(arch="qwen3moe", qk_norm=True)


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    if not config.n_expert:
        raise GGUFError("graph (qwen3moe): the config has no experts (expert_count); it is not a qwen3moe model.")
    return build_decoder(config, tensors, STYLE)
