"""The gemma3 graph. From the config: embeddings × sqrt(n_embd), GeGLU (tanh GELU), sliding layers with their own
RoPE base and window, final logit softcapping. Fixed by gemma3.cpp: q/k head norms before RoPE, q multiplied by
the attention scale after RoPE (attention itself unscaled), RMSNorm after attention and after the FFN, each before
its residual add."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(arch="gemma3", qk_norm=True, post_norms=True, scale_q=True)


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    return build_decoder(config, tensors, STYLE)
