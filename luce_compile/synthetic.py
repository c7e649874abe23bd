"""Random-weight GGUF models of any supported architecture, shape and quant mix, with SmolLM2's real tokenizer.

They stand in for real models where the weights cannot travel (GPU benchmarks at real shapes) and make
fast tests of every architecture. Metadata keys and tensors are what llama.cpp's converter writes
(`convert_hf_to_gguf.py`, `conversion/{llama,qwen,gemma}.py`), so llama.cpp loads them as it loads real models.

Weights are scaled so that activations stay O(1) through many layers and the logits are not degenerate:
matrices have std 1/sqrt(fan_in); norm weights are 1 ± 10% (gemma3's too: its GGUF stores 1 + w already);
token embeddings are small next to what the layers add to the residual stream (std 1/sqrt(n_embd) as the
model reads them, after gemma3's sqrt(n_embd) scale), so the tied LM head does not just copy the input token
(with embeddings of std 1, tiny models predicted their own input); the final norm weights are scaled (± 10%)
so that the logits have a spread (std ≈ 4) like trained models'; q and k are scaled up so that attention is
peaked (see ATTENTION_SHARPNESS).

Real-size models (issue 36: 7-14B, their real vocabularies) pad SmolLM2's vocabulary to `n_vocab` with unused tokens,
and with `direct_blocks` write their quantized weights as random blocks of the same std (synthetic_blocks), made by a
thread per core: a 14B in well under a minute instead of hours of quantizing in numpy.

Usage: `python -m luce_compile.synthetic PRESET[@TYPE] OUT.gguf` (PRESET: one of PRESETS; `@TYPE` writes its shapes in
one weight type, e.g. tiny-llama@IQ4_XS: `in_type`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import struct
import sys
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
)

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.quants import quantize
from luce_compile.gguf.reader import SUPPORTED_TYPES, read_gguf
from luce_compile.synthetic_blocks import FILLERS, random_blocks
from luce_compile.synthetic_harmony import HARMONY_TOKENS, harmony_tokenizer

log = logging.getLogger(__name__)

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss")
MOE_ARCHS = ("qwen3moe", "gpt-oss")
# llama.cpp's default sliding_window_pattern per architecture (a file writes the key only where it differs)
SWA_PATTERN_DEFAULT = {"gemma3": 6, "gpt-oss": 2}
TOKENIZER_SOURCE = "smollm2-135m"
N_VOCAB = 49152  # SmolLM2's vocabulary: every synthetic model uses its tokenizer
SPEC_KEY = "luce.synthetic.spec"  # the spec as JSON, so a file says how it was made
TOKEN_TYPE_UNUSED = 5  # llama_token_type: what llama.cpp's converter gives the padding tokens of a vocabulary
# fields added after files and results were recorded: to_json leaves them out at their defaults, so the JSON in
# every earlier file (SPEC_KEY) and the cache names made from it keep their bytes
_OMIT_AT_DEFAULT = {"omit_at_default": True}

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL, "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that defines a synthetic model. The defaults give a tiny llama that runs in milliseconds."""

    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None  # None → n_embd // n_head
    n_ff: int = 128
    n_ctx: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    quant: str = "Q8_0"  # type of the 2-D weights; 1-D tensors (norms, biases) are always F32
    # tensor-name suffix → type, e.g. {"ffn_down.weight": "Q6_K", "blk.0.attn_v.weight": "Q8_0"}; the longest
    # suffix that matches at a "." boundary wins
    quant_overrides: dict[str, str] = field(default_factory=dict)
    tied_output: bool = True
    sliding_window: int = 0  # gemma3, gpt-oss: 0 = no sliding-window layers
    sliding_window_pattern: int = 6  # gemma3: every n-th layer is global (gpt-oss: 2, every other layer)
    final_logit_softcap: float = 0.0  # gemma3: 0 = off
    seed: int = 0
    # rows of token_embd/output; above SmolLM2's 49152 its vocabulary is padded with unused tokens "[PAD<id>]"
    n_vocab: int = field(default=N_VOCAB, metadata=_OMIT_AT_DEFAULT)
    # quantized 2-D weights as random blocks with set scales (synthetic_blocks), not quantized normal values: for
    # billions of weights (a 4096² matrix: Q4_K 0.01 s against 4.2 s, Q6_K 80x, Q8_0 18x faster, 2 cores, loaded)
    direct_blocks: bool = field(default=False, metadata=_OMIT_AT_DEFAULT)
    # qwen3moe: experts per layer, chosen per token, and each expert's FFN width (n_ff is written, as the converter
    # writes config.json's intermediate_size, but a qwen3moe graph does not use it)
    n_expert: int = field(default=0, metadata=_OMIT_AT_DEFAULT)
    n_expert_used: int = field(default=0, metadata=_OMIT_AT_DEFAULT)
    n_ff_exp: int = field(default=0, metadata=_OMIT_AT_DEFAULT)
    # gpt-oss's YaRN RoPE scaling (rope.scaling.factor, .original_context_length): 0 = none
    yarn_factor: float = field(default=0.0, metadata=_OMIT_AT_DEFAULT)
    yarn_orig_ctx: int = field(default=4096, metadata=_OMIT_AT_DEFAULT)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quant_overrides", dict(self.quant_overrides))  # not shared with the caller
        if self.arch not in ARCHS:
            raise UnsupportedError(f"synthetic: architecture {self.arch!r} is not supported ({', '.join(ARCHS)}).")
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.head_size, self.n_ff) <= 0:
            raise GGUFError(f"synthetic: every size must be positive: {self}.")
        if self.n_vocab < N_VOCAB:
            raise GGUFError(f"synthetic: n_vocab {self.n_vocab} is below the {N_VOCAB} tokens of SmolLM2's tokenizer, "
                            "which every synthetic model uses; it can only be padded.")
        if self.n_head % self.n_head_kv:
            raise GGUFError(f"synthetic: n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}.")
        if self.arch == "qwen2" and self.head_size * self.n_head != self.n_embd:
            raise GGUFError("synthetic: llama.cpp's qwen2 needs head_dim * n_head == n_embd; use qwen3 instead.")
        if (self.arch not in SWA_PATTERN_DEFAULT and self.sliding_window) or \
                (self.arch != "gemma3" and self.final_logit_softcap):
            raise UnsupportedError(f"synthetic: sliding windows (gemma3, gpt-oss) and softcapping (gemma3) are not "
                                   f"{self.arch} features.")
        if (self.arch in MOE_ARCHS) != (0 < self.n_expert_used <= self.n_expert and self.n_ff_exp > 0):
            raise GGUFError(f"synthetic: {', '.join(MOE_ARCHS)}, and only they, need 0 < n_expert_used <= n_expert and "
                            f"n_ff_exp > 0; got {self.arch} with {self.n_expert_used}/{self.n_expert} experts of "
                            f"{self.n_ff_exp}.")
        if self.arch == "gpt-oss" and (not self.sliding_window or self.tied_output):
            raise GGUFError("synthetic: gpt-oss needs a sliding window and an untied output (llama.cpp requires both).")
        if self.arch == "gpt-oss" and self.n_vocab < N_VOCAB + len(HARMONY_TOKENS):
            raise GGUFError(f"synthetic: gpt-oss needs n_vocab >= {N_VOCAB + len(HARMONY_TOKENS)}: harmony's special "
                            f"tokens go after SmolLM2's {N_VOCAB} (synthetic_harmony.py); got {self.n_vocab}.")
        if self.yarn_factor and self.arch != "gpt-oss":
            raise UnsupportedError(f"synthetic: YaRN is written for gpt-oss only, not {self.arch}.")
        for t in (self.quant, *self.quant_overrides.values()):
            if t not in _FILE_TYPES:
                raise UnsupportedError(f"synthetic: quant type {t!r} is not supported ({', '.join(_FILE_TYPES)}).")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    def __hash__(self) -> int:  # the dict field would make the generated hash fail
        return hash(self.to_json())

    def to_json(self) -> str:
        values = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("omit_at_default") and values[f.name] == f.default:
                del values[f.name]
        return json.dumps(values, sort_keys=True)


def _q4_k_m_overrides(n_layer: int, attn_v: tuple[str, str], ffn_down: tuple[str, str], by_name: bool = False,
                      down: str = "ffn_down", **fixed: str) -> dict[str, str]:
    """A Q4_K_M file's quant mix: llama.cpp's use_more_bits layers (first and last eighth, every third between) get
    the first type of attn_v and ffn_down, the other layers the second; `fixed` names whole tensors (token_embd=…).
    llama-quantize counts the layers in the order of the source file's tensors: `by_name` for a file whose tensors
    were sorted by name (blk.0, blk.1, blk.10, …), as in Qwen's official GGUFs (read from Qwen2.5-Coder-0.5B's)."""
    order = sorted(range(n_layer), key=str) if by_name else range(n_layer)
    counter = {layer: c for c, layer in enumerate(order)}  # llama-quantize's i_ffn_down when it meets the layer
    more_bits = [c < n_layer // 8 or c >= 7 * n_layer // 8 or (c - n_layer // 8) % 3 == 2
                 for c in (counter[i] for i in range(n_layer))]
    overrides = {f"{name}.weight": t for name, t in fixed.items()}
    for i, more in enumerate(more_bits):
        overrides[f"blk.{i}.attn_v.weight"] = attn_v[0] if more else attn_v[1]
        overrides[f"blk.{i}.{down}.weight"] = ffn_down[0] if more else ffn_down[1]
    return overrides


def _gemma3_270m_overrides(n_layer: int = 18) -> dict[str, str]:
    """Gemma 3 270M Q4_K_M's quant mix (read from the real file): Q8_0/Q5_0 attn_v and Q6_K/Q4_K ffn_down."""
    return _q4_k_m_overrides(n_layer, ("Q8_0", "Q5_0"), ("Q6_K", "Q4_K"), token_embd="Q8_0", attn_output="Q4_K")


# gpt-oss's released GGUF (ggml-org/gpt-oss-20b-GGUF, mxfp4): the experts in MXFP4 as trained, the other matrices
# Q8_0 (an assumption from its size: 12.1 GB for 20.9B parameters leaves ~8.5 bits for the 1.8B outside the experts)
_MXFP4_EXPERTS = {f"ffn_{r}_exps.weight": "MXFP4" for r in ("gate", "up", "down")}

PRESETS: dict[str, SyntheticSpec] = {
    "tiny-llama": SyntheticSpec(),
    # untied output and q/k/v biases
    "tiny-qwen2": SyntheticSpec(arch="qwen2", tied_output=False, rope_base=1e6, rms_eps=1e-6),
    # head_dim 32 ≠ n_embd / n_head, so key_length is written and q is wider than the residual
    "tiny-qwen3": SyntheticSpec(arch="qwen3", head_dim=32, rope_base=1e6, rms_eps=1e-6),
    # 2 local layers then 1 global, a window short enough for test prompts to cross it, and logit softcapping
    # 8 experts of width 64, 2 chosen per token: prompts of a few tokens route to most of them
    "tiny-qwen3moe": SyntheticSpec(arch="qwen3moe", head_dim=32, rope_base=1e6, rms_eps=1e-6, n_expert=8,
                                   n_expert_used=2, n_ff_exp=64),
    # gpt-oss in miniature: MXFP4 experts (8 of 64, 2 used) and Q8_0 elsewhere as in the released mxfp4 GGUF, a
    # window of 8 on the even layers (test prompts cross it), 4 query heads a KV head, gpt-oss's YaRN and RoPE base;
    # 64 rows past SmolLM2's vocabulary for harmony's special tokens (synthetic_harmony.py)
    "tiny-gptoss": SyntheticSpec(arch="gpt-oss", n_layer=4, n_embd=64, n_head=8, n_head_kv=2, head_dim=32, n_ff=64,
                                 n_vocab=N_VOCAB + 64,
                                 n_ctx=131072, rope_base=150000.0, tied_output=False, sliding_window=8,
                                 sliding_window_pattern=2, n_expert=8, n_expert_used=2, n_ff_exp=64,
                                 yarn_factor=32.0, quant_overrides=_MXFP4_EXPERTS),
    "tiny-gemma3": SyntheticSpec(arch="gemma3", n_layer=3, head_dim=32, n_head_kv=1, rms_eps=1e-6, rope_base=1e6,
                                 sliding_window=8, sliding_window_pattern=3, final_logit_softcap=30.0),
    "smollm2-135m": SyntheticSpec(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_ctx=8192,
                                  rope_base=1e5, quant="Q4_1", quant_overrides={"token_embd.weight": "Q8_0"}),
    # Llama-3.2-1B's body (its own vocabulary is 128k; ours is SmolLM2's 49152)
    "llama-1b-body": SyntheticSpec(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=131072,
                                   rope_base=5e5, quant="Q4_1"),
    "llama-1b-body-bf16": SyntheticSpec(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=131072,
                                        rope_base=5e5, quant="BF16"),
    "qwen3-0.6b": SyntheticSpec(arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, head_dim=128,
                                n_ff=3072, n_ctx=40960, rope_base=1e6, rms_eps=1e-6, quant="Q8_0"),
    # issue 14's real pair, Qwen2.5-Coder-1.5B and -0.5B Instruct Q4_K_M: shapes and the quant mix of the real files
    # (read from them), on SmolLM2's 49152-token vocabulary (theirs is 151936: the LM head is a third of theirs)
    "qwen2.5-coder-1.5b": SyntheticSpec(arch="qwen2", n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960,
                                        n_ctx=32768, rope_base=1e6, rms_eps=1e-6, quant="Q4_K", tied_output=False,
                                        quant_overrides=_q4_k_m_overrides(28, ("Q6_K", "Q4_K"), ("Q6_K", "Q4_K"),
                                                                          output="Q6_K")),
    "qwen2.5-coder-0.5b": SyntheticSpec(arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
                                        n_ctx=32768, rope_base=1e6, rms_eps=1e-6, quant="Q5_0", tied_output=False,
                                        quant_overrides=_q4_k_m_overrides(24, ("Q8_0", "Q5_0"), ("Q6_K", "Q4_K"),
                                                                          output="Q8_0")),
    "gemma3-270m": SyntheticSpec(arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256,
                                 n_ff=2048, n_ctx=32768, rope_base=1e6, rms_eps=1e-6, sliding_window=512,
                                 quant="Q5_0", quant_overrides=_gemma3_270m_overrides()),
}
# What users download (issue 36): the shapes of the models' config.json, their real vocabulary sizes (SmolLM2's
# tokenizer padded) and llama.cpp's Q4_K_M mix (llama-quant.cpp: token_embd keeps the base type Q4_K, output Q6_K,
# attn_v and ffn_down Q6_K on the use_more_bits layers, counted by name in Qwen's official files), written as direct
# blocks. Llama 3.1's rope_freqs.weight (its long-context RoPE scaling) is left out: it does not change the work of
# a step, and is not lowered yet.
_Q4_K_M = {"quant": "Q4_K", "tied_output": False, "direct_blocks": True}
_QWEN = {"arch": "qwen2", "n_ctx": 32768, "rope_base": 1e6, "rms_eps": 1e-6}
_MORE_BITS_Q6_K = (("Q6_K", "Q4_K"), ("Q6_K", "Q4_K"))  # attn_v, ffn_down
PRESETS |= {
    "llama-3.1-8b": SyntheticSpec(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_ctx=131072,
                                  rope_base=5e5, n_vocab=128256, **_Q4_K_M,
                                  quant_overrides=_q4_k_m_overrides(32, *_MORE_BITS_Q6_K, output="Q6_K")),
    "qwen2.5-7b": SyntheticSpec(n_layer=28, n_embd=3584, n_head=28, n_head_kv=4, n_ff=18944, n_vocab=152064,
                                **_QWEN, **_Q4_K_M,
                                quant_overrides=_q4_k_m_overrides(28, *_MORE_BITS_Q6_K, by_name=True, output="Q6_K")),
    "qwen3-8b": SyntheticSpec(arch="qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
                              n_ff=12288, n_ctx=40960, rope_base=1e6, rms_eps=1e-6, quant="Q8_0", tied_output=False,
                              n_vocab=151936, direct_blocks=True),
    # Qwen3-30B-A3B (config.json: 128 experts of 768, 8 used; intermediate_size 6144 is written, unused); its Q4_K_M
    # as llama-quantize makes it: ffn_down_exps counts as ffn_down (name match) for the more-bits layers, the router
    # ffn_gate_inp stays F32
    "qwen3-30b-a3b": SyntheticSpec(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                                   n_ff=6144, n_ctx=40960, rope_base=1e6, rms_eps=1e-6, n_vocab=151936, n_expert=128,
                                   n_expert_used=8, n_ff_exp=768, **_Q4_K_M,
                                   quant_overrides=_q4_k_m_overrides(48, *_MORE_BITS_Q6_K, by_name=True,
                                                                     down="ffn_down_exps", output="Q6_K")),
    # gpt-oss-20b (config.json: 24 layers of 2880, 64 query and 8 KV heads of 64, 32 experts of 2880 with 4 used,
    # window 128 on every other layer, YaRN x32 from 4096, o200k's 201088 rows); MXFP4 experts, Q8_0 elsewhere
    "gpt-oss-20b": SyntheticSpec(arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                                 n_ff=2880, n_ctx=131072, rope_base=150000.0, n_vocab=201088, tied_output=False,
                                 sliding_window=128, sliding_window_pattern=2, n_expert=32, n_expert_used=4,
                                 n_ff_exp=2880, yarn_factor=32.0, direct_blocks=True, quant_overrides=_MXFP4_EXPERTS),
    "qwen2.5-14b": SyntheticSpec(n_layer=48, n_embd=5120, n_head=40, n_head_kv=8, n_ff=13824, n_vocab=152064,
                                 **_QWEN, **_Q4_K_M,
                                 quant_overrides=_q4_k_m_overrides(48, *_MORE_BITS_Q6_K, by_name=True, output="Q6_K")),
    # the issue-14 pair as the real files are: their vocabulary of 151936 rows, and the more-bits layers of their
    # name-sorted tensors (the presets above keep SmolLM2's 49152 and the layers in numeric order)
    "qwen2.5-coder-1.5b-vocab": dataclasses.replace(
        PRESETS["qwen2.5-coder-1.5b"], n_vocab=151936, direct_blocks=True,
        quant_overrides=_q4_k_m_overrides(28, *_MORE_BITS_Q6_K, by_name=True, output="Q6_K")),
    "qwen2.5-coder-0.5b-vocab": dataclasses.replace(
        PRESETS["qwen2.5-coder-0.5b"], n_vocab=151936, direct_blocks=True,
        quant_overrides=_q4_k_m_overrides(24, ("Q8_0", "Q5_0"), ("Q6_K", "Q4_K"), by_name=True, output="Q8_0")),
}


def preset(name: str) -> SyntheticSpec:
    """A preset by name, or `PRESET@TYPE`: that preset's shapes in one weight type (`in_type`)."""
    base, _, type_name = name.partition("@")
    if base not in PRESETS:
        raise GGUFError(f"synthetic: unknown preset {base!r}; known: {', '.join(PRESETS)} (each also as "
                        f"PRESET@TYPE, TYPE one of {', '.join(_FILE_TYPES)}).")
    return in_type(PRESETS[base], type_name) if type_name else PRESETS[base]


# llama-quant.cpp's tensor_type_fallback: where a type's blocks do not divide a tensor's rows, llama-quantize writes
# this type instead (and F16 where that does not divide them either)
FALLBACK_TYPES = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _fits(type_name: str, n_in: int) -> bool:
    return n_in % GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0] == 0


def in_type(spec: SyntheticSpec, type_name: str) -> SyntheticSpec:
    """spec with its 2-D weights in `type_name` (its own mix dropped), with the rules of llama-quantize
    (llama_tensor_get_type) that hold for every mix: the LM head (output.weight, or the tied token_embd) becomes Q6_K
    unless the type is Q8_0 or unquantized, Q8_0 where Q6_K's blocks do not divide its rows; any other weight whose
    rows the type's blocks do not divide takes FALLBACK_TYPES' type. Unlike llama-quantize's MXFP4_MOE, which keeps
    MXFP4 for expert tensors only, a dense model's weights all become MXFP4 here, so that the type is exercised."""
    if type_name not in _FILE_TYPES:
        raise UnsupportedError(f"synthetic: quant type {type_name!r} is not supported ({', '.join(_FILE_TYPES)}).")
    plain = dataclasses.replace(spec, quant=type_name, quant_overrides={})
    if type_name in _FLOAT_TYPES:
        return plain
    head = "token_embd.weight" if spec.tied_output else "output.weight"
    overrides = {}
    for name, shape in tensor_shapes(plain).items():
        if _kept_f32(name, shape):
            continue
        want = type_name
        if name == head and type_name != "Q8_0":
            want = "Q6_K" if _fits("Q6_K", shape[-1]) else "Q8_0"
        elif not _fits(type_name, shape[-1]):
            want = FALLBACK_TYPES.get(type_name, "F16")
            want = want if _fits(want, shape[-1]) else "F16"
        if want != type_name:
            overrides[name] = want
    if overrides:
        log.info("synthetic: %s@%s keeps other types where llama-quantize would: %s", spec.arch, type_name, overrides)
    return dataclasses.replace(plain, quant_overrides=overrides)


# ------------------------------------------------------------------------------------------------ tensors

def tensor_shapes(spec: SyntheticSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor llama.cpp's loader reads for this architecture, numpy shape (out, in), in file order."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.n_vocab, spec.n_embd)}
    for i in range(spec.n_layer):
        shapes |= _attention_shapes(spec, f"blk.{i}.") | _ffn_shapes(spec, f"blk.{i}.")
    shapes["output_norm.weight"] = (spec.n_embd,)
    if not spec.tied_output:
        shapes["output.weight"] = (spec.n_vocab, spec.n_embd)
    return shapes


def _attention_shapes(spec: SyntheticSpec, b: str) -> dict[str, tuple[int, ...]]:
    q_out, kv_out = spec.n_head * spec.head_size, spec.n_head_kv * spec.head_size
    shapes = {b + "attn_norm.weight": (spec.n_embd,), b + "attn_q.weight": (q_out, spec.n_embd),
              b + "attn_k.weight": (kv_out, spec.n_embd), b + "attn_v.weight": (kv_out, spec.n_embd)}
    if spec.arch in ("qwen2", "gpt-oss"):
        shapes |= {b + "attn_q.bias": (q_out,), b + "attn_k.bias": (kv_out,), b + "attn_v.bias": (kv_out,)}
    if spec.arch in ("qwen3", "gemma3", "qwen3moe"):
        shapes |= {b + "attn_q_norm.weight": (spec.head_size,), b + "attn_k_norm.weight": (spec.head_size,)}
    shapes[b + "attn_output.weight"] = (spec.n_embd, q_out)
    if spec.arch == "gpt-oss":  # its output bias, a sink logit per query head, and its pre-FFN norm's name
        shapes |= {b + "attn_output.bias": (spec.n_embd,), b + "attn_sinks.weight": (spec.n_head,)}
    if spec.arch in ("gemma3", "gpt-oss"):
        shapes[b + "post_attention_norm.weight"] = (spec.n_embd,)
    return shapes


def _ffn_shapes(spec: SyntheticSpec, b: str) -> dict[str, tuple[int, ...]]:
    shapes = {} if spec.arch == "gpt-oss" else {b + "ffn_norm.weight": (spec.n_embd,)}
    if spec.n_expert:  # the converter's order: router, then the experts stacked (expert, out, in)
        e, f = spec.n_expert, spec.n_ff_exp
        shapes |= {b + ROUTER: (e, spec.n_embd), b + "ffn_gate_exps.weight": (e, f, spec.n_embd),
                   b + "ffn_down_exps.weight": (e, spec.n_embd, f), b + "ffn_up_exps.weight": (e, f, spec.n_embd)}
        if spec.arch == "gpt-oss":  # a bias for the router and a row per expert for each stacked matrix
            shapes |= {b + "ffn_gate_inp.bias": (e,), b + "ffn_gate_exps.bias": (e, f),
                       b + "ffn_down_exps.bias": (e, spec.n_embd), b + "ffn_up_exps.bias": (e, f)}
    else:
        shapes |= {b + "ffn_gate.weight": (spec.n_ff, spec.n_embd), b + "ffn_up.weight": (spec.n_ff, spec.n_embd),
                   b + "ffn_down.weight": (spec.n_embd, spec.n_ff)}
    if spec.arch == "gemma3":
        shapes[b + "post_ffw_norm.weight"] = (spec.n_embd,)
    return shapes


def tensor_type(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """F32 for 1-D tensors, biases (gpt-oss's experts' are 2-D) and the MoE router (llama-quantize never quantizes
    ffn_gate_inp); else the longest
    matching override, else spec.quant. Checks the row fits the blocks."""
    if _kept_f32(name, shape):
        return GGMLQuantizationType.F32
    matches = [k for k in spec.quant_overrides if name == k or name.endswith("." + k)]
    type_name = spec.quant_overrides[max(matches, key=len)] if matches else spec.quant
    ggml_type = GGMLQuantizationType[type_name]
    block = GGML_QUANT_SIZES[ggml_type][0]
    if shape[-1] % block:
        raise GGUFError(f"synthetic: {name} has rows of {shape[-1]} elements, which {type_name} (blocks of "
                        f"{block}) cannot hold; override its type or choose sizes that are multiples of {block}.")
    assert ggml_type in SUPPORTED_TYPES
    return ggml_type


ROUTER = "ffn_gate_inp.weight"


def _kept_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith((ROUTER, ".bias"))


def _rng(spec: SyntheticSpec, name: str) -> np.random.Generator:
    # seeded per tensor, so a tensor's values do not depend on the others or on the order they are made in
    return np.random.default_rng(np.random.SeedSequence([spec.seed, zlib.crc32(name.encode())]))


# q and k (or their per-head norms) are scaled so that attention scores have std ≈ 2, not 1. With std 1,
# attention averages over the context and over 30 layers the residual stream converges to one vector (synthetic
# SmolLM2: 23 distinct greedy tokens over 48 positions; 46 with 2). Sharper is worse: random networks with peaked
# attention amplify small errors, and with 3 llama.cpp's q8 activations moved logits by up to 3.8 from the fp64
# oracle (1.3 with 2, which is what the real SmolLM2 shows: up to 1.4).
ATTENTION_SHARPNESS = 2.0
_QK_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def tensor_values(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of one tensor before quantization (see the module docstring for the scales)."""
    noise = _rng(spec, name).standard_normal(shape, dtype=np.float32)
    if name == "output_norm.weight":  # logits = (normed h * this) @ head.T: aim for a logit std of 4
        head_std = _embedding_std(spec) if spec.tied_output else 1 / np.sqrt(spec.n_embd)
        return np.float32(4 / (head_std * np.sqrt(spec.n_embd))) * (1 + 0.1 * noise)
    if name.endswith("norm.weight"):
        return (1 + 0.1 * noise) * _sharpen(name)
    if name.endswith(".bias"):
        return 0.2 * noise
    if name.endswith("attn_sinks.weight"):  # logits next to the attention scores' (std ≈ 2): a sink takes a share
        return 1 + noise
    return noise * weight_std(spec, name, shape)


def _sharpen(name: str) -> np.float32:
    return np.float32(np.sqrt(ATTENTION_SHARPNESS) if name.endswith(_QK_TENSORS) else 1.0)


def weight_std(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.float32:
    """The std of a 2-D weight's values: the embedding's, else sharpen/sqrt(fan_in) for a matrix (out, in)."""
    if name == "token_embd.weight":
        return np.float32(_embedding_std(spec))
    return _sharpen(name) / np.float32(np.sqrt(shape[-1]))


def _embedding_std(spec: SyntheticSpec) -> float:
    # std 1/sqrt(n_embd) as the model reads them; gemma3 multiplies embeddings by sqrt(n_embd) first
    return 1 / spec.n_embd if spec.arch == "gemma3" else 1 / np.sqrt(spec.n_embd)


def _plan(spec: SyntheticSpec) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    for name, shape in tensor_shapes(spec).items():
        yield name, shape, tensor_type(spec, name, shape)


# ------------------------------------------------------------------------------------------------ metadata

@functools.cache
def tokenizer_metadata() -> dict[str, Any]:
    """Every `tokenizer.*` key of the SmolLM2 GGUF (fetched once into the cache)."""
    from luce_compile.models import fetch

    source = read_gguf(fetch(TOKENIZER_SOURCE))
    try:
        return {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.")}
    finally:
        source.close()


def _value_type(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    """The GGUF type llama.cpp expects for a tokenizer value: token ids are UINT32 scalars (llama.cpp checks the
    type), token types INT32 arrays, scores FLOAT32 arrays, flags BOOL."""
    def scalar(v: Any) -> GGUFValueType:
        if isinstance(v, bool):
            return GGUFValueType.BOOL
        if isinstance(v, int):
            return GGUFValueType.UINT32
        return GGUFValueType.FLOAT32 if isinstance(v, float) else GGUFValueType.STRING

    if not isinstance(value, list):
        return scalar(value), None
    element = scalar(value[0])
    return GGUFValueType.ARRAY, GGUFValueType.INT32 if element == GGUFValueType.UINT32 else element


class _Writer(GGUFWriter):
    """GGUFWriter with one array of strings or numbers packed in one go: its per-element struct calls took ~1 s
    for the 98k strings of SmolLM2's vocabulary and merges, most of a tiny model's write time."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if vtype != GGUFValueType.ARRAY or sub_type not in _ARRAY_DTYPES:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<IIQ", vtype, sub_type, len(val)) if add_vtype else struct.pack("<IQ", sub_type, len(val))
        if sub_type == GGUFValueType.STRING:
            encoded = [v.encode("utf-8") for v in val]
            lengths = np.array([len(e) for e in encoded], dtype="<u8")
            return head + b"".join(n.tobytes() + e for n, e in zip(lengths, encoded, strict=True))
        return head + np.asarray(val, dtype=_ARRAY_DTYPES[sub_type]).tobytes()


_ARRAY_DTYPES = {GGUFValueType.STRING: None, GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4"}


def _write_metadata(w: GGUFWriter, spec: SyntheticSpec) -> None:
    w.add_name(f"luce synthetic {spec.arch}")
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_base)
    if spec.arch == "gemma3" or spec.head_size != spec.n_embd // spec.n_head:
        w.add_key_length(spec.head_size)  # the converters write these when config.json has head_dim
        w.add_value_length(spec.head_size)
    if spec.arch == "llama":
        w.add_vocab_size(spec.n_vocab)
        w.add_rope_dimension_count(spec.head_size)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
        if spec.sliding_window_pattern != SWA_PATTERN_DEFAULT[spec.arch]:
            w.add_sliding_window_pattern(spec.sliding_window_pattern)
    if spec.yarn_factor:  # what convert_hf_to_gguf writes for config.json's rope_scaling {"rope_type": "yarn", ...}
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)
    if spec.final_logit_softcap:
        w.add_final_logit_softcapping(spec.final_logit_softcap)
    w.add_file_type(_FILE_TYPES[spec.quant])
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_string(SPEC_KEY, spec.to_json())
    keys = _padded_tokenizer(spec.n_vocab)
    if spec.arch == "gpt-oss":  # o200k's pre-tokenizer, harmony's tokens and chat template, as real files have
        keys = harmony_tokenizer(keys, len(tokenizer_metadata()["tokenizer.ggml.tokens"]))
    for key, value in keys.items():
        vtype, sub_type = _value_type(value)
        w.add_key_value(key, value, vtype, sub_type)


def _padded_tokenizer(n_vocab: int) -> dict[str, Any]:
    """SmolLM2's tokenizer keys with the vocabulary padded to n_vocab tokens "[PAD<id>]" of type UNUSED, as
    llama.cpp's converter pads a vocabulary smaller than the embedding (Qwen's 151665 tokens to 151936 rows):
    neither llama.cpp nor our tokenizer cuts unused tokens out of text, and both detokenize them to nothing. A
    vocabulary already that long (the keys of a padded file, as the device scripts pass them) stays as it is."""
    keys = tokenizer_metadata()
    tokens = keys["tokenizer.ggml.tokens"]
    if len(tokens) > n_vocab:
        raise GGUFError(f"synthetic: the tokenizer has {len(tokens)} tokens, more than n_vocab {n_vocab}.")
    pad = range(len(tokens), n_vocab)
    if not pad:
        return keys
    padded = {**keys, "tokenizer.ggml.tokens": [*tokens, *(f"[PAD{i}]" for i in pad)],
              "tokenizer.ggml.token_type": [*keys["tokenizer.ggml.token_type"], *[TOKEN_TYPE_UNUSED] * len(pad)]}
    if "tokenizer.ggml.scores" in keys:
        padded["tokenizer.ggml.scores"] = [*keys["tokenizer.ggml.scores"], *[0.0] * len(pad)]
    return padded


def _tensor_bytes(spec: SyntheticSpec, name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType
                  ) -> np.ndarray:
    if spec.direct_blocks and len(shape) >= 2 and ggml_type in FILLERS:
        return random_blocks(_rng(spec, name), ggml_type, shape, float(weight_std(spec, name, shape)))
    return quantize(tensor_values(spec, name, shape), ggml_type)


def _tensor_data(spec: SyntheticSpec, plan: list[tuple[str, tuple[int, ...], GGMLQuantizationType]]
                 ) -> Iterator[np.ndarray]:
    """Each tensor's bytes in plan order, made by a thread per core (numpy releases the GIL while it generates and
    quantizes) at most one tensor per thread ahead of the writer, which bounds the memory. The bytes do not depend
    on the threads: each tensor has its own seed."""
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="synthetic") as pool:
        pending: deque = deque()
        for item in plan:
            pending.append(pool.submit(_tensor_bytes, spec, *item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_synthetic(spec: SyntheticSpec, path: str | Path) -> Path:
    """Write the model to `path` (atomically) and return it. Deterministic: the same spec gives the same bytes."""
    path = Path(path)
    plan = list(_plan(spec))  # checks every tensor's type before anything is written
    tmp = path.with_name(path.name + ".tmp")
    w = _Writer(tmp, spec.arch)
    _write_metadata(w, spec)
    for name, shape, ggml_type in plan:  # tensor infos first, then the data one tensor at a time
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = int(np.prod(shape)) // block * type_size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in _tensor_data(spec, plan):
        w.write_tensor_data(data)
    w.close()
    tmp.replace(path)
    log.info("wrote synthetic %s model (%d tensors) to %s", spec.arch, len(plan), path)
    return path


def cached_synthetic(spec_or_preset: SyntheticSpec | str, directory: str | Path | None = None) -> Path:
    """The model's file in a cache folder (default: <luce cache>/synthetic), written the first time. The file name
    holds a hash of the spec, so a changed spec never reuses a stale file."""
    from luce_compile.models import cache_dir

    spec = preset(spec_or_preset) if isinstance(spec_or_preset, str) else spec_or_preset
    directory = Path(directory) if directory is not None else cache_dir() / "synthetic"
    digest = zlib.crc32((spec.to_json() + _FORMAT_VERSION + _ARCH_FORMAT.get(spec.arch, "")).encode())
    path = directory / f"{spec.arch}-{spec.n_layer}x{spec.n_embd}-{spec.quant}-{digest:08x}.gguf"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        write_synthetic(spec, path)
    return path


_FORMAT_VERSION = "2"  # bump when the weights or metadata this module writes change
# per architecture, so that a change to one architecture's files does not rewrite every cached model
_ARCH_FORMAT = {"gpt-oss": "-harmony1"}  # "gpt-4o" pre-tokenizer, harmony tokens and template


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (f"usage: python -m luce_compile.synthetic PRESET[@TYPE] OUT.gguf\npresets: {', '.join(PRESETS)}\n"
             f"types: {', '.join(_FILE_TYPES)}")
    if len(argv) != 2 or argv[0].partition("@")[0] not in PRESETS:
        print(usage, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec = preset(argv[0])
    except UnsupportedError as err:
        print(f"{err}\n{usage}", file=sys.stderr)
        return 2
    path = write_synthetic(spec, argv[1])
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
