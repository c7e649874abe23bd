"""The gpt-oss graph (GGUF architecture "gpt-oss"), op for op as openai-moe-iswa.cpp builds it:
attn_norm → q/k/v with biases → NEOX RoPE with YaRN (the same base and scale on windowed and full layers) →
attention scaled by 1/sqrt(head_dim), masked to the window on the even layers, with a sink logit per query head
(attn_sinks) → attn_output with bias → + residual → post_attention_norm (the pre-FFN norm, under that name) →
build_moe_ffn: router with bias, the expert_used_count largest logits weighted by their own softmax
(SOFTMAX_WEIGHT, norm_w false), experts with biases and ggml_swiglu_oai → + residual. Untied LM head. The numbers
come from the ModelConfig (gguf/config._gptoss, _yarn)."""

from __future__ import annotations

from collections.abc import Mapping

from luce_compile.errors import GGUFError
from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.decoder import DecoderStyle, build_decoder
from luce_compile.graph.ir import Graph

STYLE = DecoderStyle(arch="gpt-oss", optional_biases=frozenset({"attn_output"}), attn_sinks=True,
                     ffn_norm="post_attention_norm")


def build(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> Graph:
    if not config.n_expert or config.tied_output:
        raise GGUFError("graph (gpt-oss): the config has no experts or no output.weight; it is not a gpt-oss model.")
    return build_decoder(config, tensors, STYLE)
