"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe-iswa.cpp): biased attention with sinks, windowed
and full layers alternating, YaRN RoPE, and a mixture of experts with a biased router in every layer."""

from luce_compile.graph.gptoss.model import STYLE, build

__all__ = ["STYLE", "build"]
