"""The llama graph: the plain pre-norm decoder. llama.cpp's llama graph reads an optional bias on every projection
and llama 3's rope_freqs.weight; its Llama 4 kq-norm branch (use_kq_norm) is not part of this architecture here."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(
    arch="llama",
    optional_biases=frozenset({"attn_output", "ffn_gate", "ffn_up", "ffn_down"}),
    rope_freq_factors=True,
)


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    return build_decoder(config, tensors, STYLE)
