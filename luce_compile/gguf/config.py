"""ModelConfig: everything the graph needs, read from GGUF metadata the way llama.cpp reads it.

The reference is llama.cpp's `llama_model::load_hparams` (src/llama-model.cpp) and the per-architecture loaders
in src/models/<arch>.cpp. Where a key is optional, the default is llama.cpp's, and each filled-in default is logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.reader import GGUFFile

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss")

# llama.cpp's llama_model_rope_type: NORM rotates adjacent pairs (x0,x1),(x2,x3)…; NEOX rotates halves (x_i, x_{i+d/2}).
ROPE_LAYOUT = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "qwen3moe": "neox",
               "gpt-oss": "neox"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head size (`key_length`, else n_embd / n_head)
    head_dim_v: int  # value head size (`value_length`, else head_dim)
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int  # leading dims of each head that are rotated (`rope.dimension_count`)
    rope_layout: str  # "norm" | "neox"
    rope_scale: float = 1.0  # linear position scale (1 / rope.scaling.factor)
    # per layer: True where attention is sliding-window (gemma3's local layers)
    sliding: tuple[bool, ...] = ()
    sliding_window: int = 0  # keys visible to a query on a sliding layer, itself included
    rope_base_local: float = 10000.0  # rope base on sliding layers
    rope_scale_local: float = 1.0  # position scale on sliding layers (llama.cpp's rope_freq_scale_train_swa)
    # YaRN (rope.scaling.type "yarn", gpt-oss): ggml_rope_ext's ext_factor (0 = off), attn_factor, beta_fast/slow
    # and the original context its correction dims come from (gguf/config._yarn says where each comes from)
    rope_yarn_ext_factor: float = 0.0
    rope_yarn_attn_factor: float = 1.0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_orig_ctx: int = 0
    attn_scale: float = 0.0  # multiplies q before q·k; 0 → 1/sqrt(head_dim)
    attn_logit_softcap: float = 0.0  # 0 = off
    final_logit_softcap: float = 0.0  # 0 = off
    attn_bias: bool = False  # q/k/v projections carry biases (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (qwen3, gemma3)
    attn_sinks: bool = False  # a learned logit per query head joins every softmax, weighting no value (gpt-oss)
    post_norms: bool = False  # RMSNorm after attention and after the FFN, before the residual add (gemma3)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (gemma: sqrt(n_embd))
    # gated FFN activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU) | "swiglu_oai" (gpt-oss's experts: ggml_swiglu_oai)
    activation: str = "silu"
    tied_output: bool = True  # no output.weight: the LM head is token_embd
    # mixture of experts (qwen3moe, gpt-oss): every layer's FFN is n_expert experts of width n_ff_exp, n_expert_used
    # chosen per token by the router logits. expert_gating "softmax" (qwen3moe): the largest softmax(logits), their
    # weights renormalized to sum 1 when expert_weights_norm; "softmax_weight" (gpt-oss): the largest logits, weighted
    # by the softmax of those alone. expert_bias: the router and every expert matrix carry biases (gpt-oss)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False
    expert_gating: str = "softmax"
    expert_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def q_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["sliding"] = tuple(d.get("sliding", ()))
        return cls(**d)


class _Keys:
    """Reads `{arch}.*` keys, logging each default it fills in."""

    def __init__(self, gguf: GGUFFile):
        self.gguf, self.arch = gguf, gguf.arch

    def need(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.gguf.metadata:
            raise GGUFError(f"GGUF {self.gguf.path}: required metadata key {full!r} is missing; the file was not "
                            "written by a llama.cpp converter for this architecture.")
        return self.gguf.metadata[full]

    def get(self, key: str, default: Any) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.gguf.metadata:
            return self.gguf.metadata[full]
        log.info("%s: %s not in the file, using %r", self.gguf.path.name, full, default)
        return default


def _positive_int(gguf: GGUFFile, name: str, value: Any) -> int:
    if isinstance(value, list):  # per-layer arrays: the dense models here use one value for all layers
        if not value or len(set(value)) != 1:
            raise UnsupportedError(f"GGUF {gguf.path}: per-layer {name} {value[:8]}… varies by layer; "
                                   "luce-compile supports one value for all layers.")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value > 1 << 24:
        raise GGUFError(f"GGUF {gguf.path}: {name} = {value!r} is not a sensible positive integer.")
    return value


def model_config(gguf: GGUFFile) -> ModelConfig:
    """Build the ModelConfig from the file's metadata and check the tensors against it."""
    arch = gguf.arch
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(f"GGUF {gguf.path}: architecture {arch!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHS)}).")
    k = _Keys(gguf)
    n_layer = _positive_int(gguf, "block_count", k.need("block_count"))
    n_embd = _positive_int(gguf, "embedding_length", k.need("embedding_length"))
    n_head = _positive_int(gguf, "attention.head_count", k.need("attention.head_count"))
    n_head_kv = _positive_int(gguf, "attention.head_count_kv", k.get("attention.head_count_kv", n_head))
    if n_head % n_head_kv:
        raise GGUFError(f"GGUF {gguf.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}.")
    head_dim = _positive_int(gguf, "attention.key_length", k.get("attention.key_length", n_embd // n_head))
    head_dim_v = _positive_int(gguf, "attention.value_length", k.get("attention.value_length", head_dim))
    rope_dim = _positive_int(gguf, "rope.dimension_count", k.get("rope.dimension_count", head_dim))
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(f"GGUF {gguf.path}: rope.dimension_count {rope_dim} must be even and ≤ head size {head_dim}.")
    token_embd = gguf.tensor("token_embd.weight")
    n_vocab = token_embd.shape[0]
    scaling_factor = float(k.get("rope.scaling.factor", 0.0) or 0.0)
    scaling_type = k.get("rope.scaling.type", "none" if not scaling_factor else "linear")
    # YaRN reaches the per-op RoPE kernel and the oracle; the megakernel's RoPE does not take it, so it is read only
    # for gpt-oss, whose graph (mixture of experts) never reaches the megakernel
    scaling_types = ("none", "linear", "yarn") if arch == "gpt-oss" else ("none", "linear")
    if scaling_type not in scaling_types:
        raise UnsupportedError(f"GGUF {gguf.path}: rope scaling {scaling_type!r} is not supported for {arch} "
                               f"({', '.join(scaling_types)}; YaRN is read for gpt-oss only).")
    cfg = dict(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        head_dim_v=head_dim_v, n_ff=_positive_int(gguf, "feed_forward_length", k.need("feed_forward_length")),
        n_vocab=n_vocab, n_ctx_train=_positive_int(gguf, "context_length", k.get("context_length", 4096)),
        rms_eps=float(k.need("attention.layer_norm_rms_epsilon")),
        rope_base=float(k.get("rope.freq_base", 10000.0)), rope_dim=rope_dim, rope_layout=ROPE_LAYOUT[arch],
        rope_scale=1.0 / scaling_factor if scaling_factor else 1.0,
        attn_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        tied_output="output.weight" not in gguf.tensors,
        sliding=(False,) * n_layer,
    )
    if arch == "gemma3":
        cfg.update(_gemma3(gguf, k, n_layer, n_embd, head_dim))
    if arch == "qwen3moe":
        cfg.update(_moe(gguf, k))
    if arch == "gpt-oss":
        cfg.update(_gptoss(gguf, k, n_layer, cfg))
    if scaling_type == "yarn":
        cfg.update(_yarn(gguf, k, scaling_factor, cfg["n_ctx_train"]))
    config = ModelConfig(**cfg)
    check_tensors(gguf, config)
    return config


def _gemma3(gguf: GGUFFile, k: _Keys, n_layer: int, n_embd: int, head_dim: int) -> dict[str, Any]:
    """src/models/gemma3.cpp: GeGLU, sqrt(n_embd) embedding scale, post norms, 5 local : 1 global layers."""
    window = int(k.get("attention.sliding_window", 0) or 0)
    sliding = _swa_pattern(gguf, k, n_layer, 6) if window > 0 else (False,) * n_layer
    # Gemma 3 27B scales queries by 1/sqrt(n_embd / n_head); the others by 1/sqrt(head_dim) (llama.cpp does the same)
    attn_scale = 1.0 / math.sqrt(n_embd / int(k.need("attention.head_count"))) if n_layer == 62 else \
        1.0 / math.sqrt(head_dim)
    return dict(
        sliding=sliding, sliding_window=window, rope_base_local=float(k.get("rope.freq_base_swa", 10000.0)),
        attn_scale=attn_scale, final_logit_softcap=float(k.get("final_logit_softcapping", 0.0) or 0.0),
        post_norms=True, embed_scale=math.sqrt(n_embd), activation="gelu_tanh",
    )


def _moe(gguf: GGUFFile, k: _Keys) -> dict[str, Any]:
    """llama_model::load_hparams for QWEN3MOE: expert_count and expert_used_count are required, the expert width is
    expert_feed_forward_length; qwen3moe.cpp calls build_moe_ffn with norm_w = true (expert_weights_norm, where a
    file says otherwise, wins)."""
    n_expert = _positive_int(gguf, "expert_count", k.need("expert_count"))
    used = _positive_int(gguf, "expert_used_count", k.need("expert_used_count"))
    if used > n_expert:
        raise GGUFError(f"GGUF {gguf.path}: expert_used_count {used} exceeds expert_count {n_expert}.")
    return dict(n_expert=n_expert, n_expert_used=used,
                n_ff_exp=_positive_int(gguf, "expert_feed_forward_length", k.need("expert_feed_forward_length")),
                expert_weights_norm=bool(k.get("expert_weights_norm", True)))


def _swa_pattern(gguf: GGUFFile, k: _Keys, n_layer: int, default: int) -> tuple[bool, ...]:
    """llama_hparams::set_swa_pattern: layer il slides when il % n < n - 1 (n = 0: all), or an explicit list."""
    pattern = k.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):  # an explicit per-layer list of booleans
        if len(pattern) < n_layer:
            raise GGUFError(f"GGUF {gguf.path}: sliding_window_pattern has {len(pattern)} entries, expected {n_layer}.")
        return tuple(bool(p) for p in pattern[:n_layer])
    n = int(pattern)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


def _gptoss(gguf: GGUFFile, k: _Keys, n_layer: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama_model_openai_moe::load_arch_hparams (src/models/openai-moe.cpp): sliding_window required, windowed and
    full layers alternating (pattern 2: even layers slide), the same RoPE base (freq_base_swa where written) and scale
    on both; the graph (openai-moe-iswa.cpp) is build_moe_ffn with SOFTMAX_WEIGHT gating, norm_w false, biased router
    and experts, ggml_swiglu_oai experts, and attention sinks."""
    if "blk.0.ffn_gate_up_exps.weight" in gguf.tensors:
        raise UnsupportedError(f"GGUF {gguf.path}: gpt-oss with fused ffn_gate_up_exps (convert_hf_to_gguf's "
                               "--fuse-gate-up-exps) is not supported; convert it with separate gate and up experts.")
    scale = float(k.get("expert_weights_scale", 0.0) or 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedError(f"GGUF {gguf.path}: gpt-oss expert_weights_scale {scale} is not supported (0 or 1).")
    moe = _moe(gguf, k)
    return dict(moe, expert_weights_norm=False, expert_gating="softmax_weight", expert_bias=True,
                activation="swiglu_oai", attn_sinks=True, attn_bias=True,
                sliding=_swa_pattern(gguf, k, n_layer, 2),
                sliding_window=_positive_int(gguf, "attention.sliding_window", k.need("attention.sliding_window")),
                rope_base_local=float(k.get("rope.freq_base_swa", cfg["rope_base"])),
                rope_scale_local=cfg["rope_scale"])


def _yarn(gguf: GGUFFile, k: _Keys, factor: float, n_ctx_train: int) -> dict[str, Any]:
    """YaRN as llama.cpp runs it (llama_context's constructor, ggml's rope_yarn): ext_factor is the file's
    yarn_ext_factor, else 1; with ext_factor on, llama.cpp sets attn_factor to get_mscale(factor) / (1 + 0.1 ln
    factor) = 1 (PR 17945 cancels ggml's own magnitude scale, which rope_yarn applies again: the net scale of cos and
    sin is 1 + 0.1 ln factor, what it always was), times rope.scaling.attn_factor. DeepSeek's yarn_log_multiplier
    (mscale_all_dims) is another formula, refused."""
    if not factor or factor < 1.0:
        raise GGUFError(f"GGUF {gguf.path}: rope.scaling.type yarn needs rope.scaling.factor >= 1, got {factor}.")
    if float(k.get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0):
        raise UnsupportedError(f"GGUF {gguf.path}: YaRN with yarn_log_multiplier (DeepSeek's mscale_all_dims) is not "
                               "supported.")
    ext_factor = float(k.get("rope.scaling.yarn_ext_factor", -1.0))
    ext_factor = 1.0 if ext_factor < 0 else ext_factor
    attn_factor = 1.0 if ext_factor else float(k.get("rope.scaling.yarn_attn_factor", 1.0))
    return dict(rope_yarn_ext_factor=ext_factor,
                rope_yarn_attn_factor=attn_factor * float(k.get("rope.scaling.attn_factor", 1.0)),
                rope_yarn_beta_fast=float(k.get("rope.scaling.yarn_beta_fast", 32.0)),
                rope_yarn_beta_slow=float(k.get("rope.scaling.yarn_beta_slow", 1.0)),
                rope_yarn_orig_ctx=int(k.get("rope.scaling.original_context_length", n_ctx_train)))


def _ffn_tensors(c: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    if not c.n_expert:
        return {b + "ffn_gate.weight": (c.n_ff, c.n_embd), b + "ffn_up.weight": (c.n_ff, c.n_embd),
                b + "ffn_down.weight": (c.n_embd, c.n_ff)}
    e, f = c.n_expert, c.n_ff_exp  # experts stacked: numpy (expert, out, in), ggml's ne (in, out, expert)
    shapes = {b + "ffn_gate_inp.weight": (e, c.n_embd), b + "ffn_gate_exps.weight": (e, f, c.n_embd),
              b + "ffn_up_exps.weight": (e, f, c.n_embd), b + "ffn_down_exps.weight": (e, c.n_embd, f)}
    if c.expert_bias:  # one bias row per expert: numpy (expert, out)
        shapes |= {b + "ffn_gate_inp.bias": (e,), b + "ffn_gate_exps.bias": (e, f), b + "ffn_up_exps.bias": (e, f),
                   b + "ffn_down_exps.bias": (e, c.n_embd)}
    return shapes


def expected_tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the graph reads, with its numpy shape (out, in)."""
    q_out, kv_out, v_out = c.n_head * c.head_dim, c.n_head_kv * c.head_dim, c.n_head_kv * c.head_dim_v
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.n_vocab, c.n_embd), "output_norm.weight": (c.n_embd,)}
    if not c.tied_output:
        shapes["output.weight"] = (c.n_vocab, c.n_embd)
    for i in range(c.n_layer):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (c.n_embd,), b + "attn_q.weight": (q_out, c.n_embd),
            b + "attn_k.weight": (kv_out, c.n_embd), b + "attn_v.weight": (v_out, c.n_embd),
            b + "attn_output.weight": (c.n_embd, c.n_head * c.head_dim_v),
        } | _ffn_tensors(c, b)
        # gpt-oss names its pre-FFN norm post_attention_norm (LLM_TENSOR_ATTN_POST_NORM, openai-moe.cpp)
        shapes[b + ("post_attention_norm.weight" if c.arch == "gpt-oss" else "ffn_norm.weight")] = (c.n_embd,)
        if c.arch == "gpt-oss":
            shapes |= {b + "attn_sinks.weight": (c.n_head,), b + "attn_output.bias": (c.n_embd,)}
        if c.attn_bias:
            shapes |= {b + "attn_q.bias": (q_out,), b + "attn_k.bias": (kv_out,), b + "attn_v.bias": (v_out,)}
        if c.qk_norm:
            shapes |= {b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,)}
        if c.post_norms:
            shapes |= {b + "post_attention_norm.weight": (c.n_embd,), b + "post_ffw_norm.weight": (c.n_embd,)}
    return shapes


def check_tensors(gguf: GGUFFile, config: ModelConfig) -> None:
    """Refuse a file whose tensors contradict its metadata, before any work is done on it."""
    for name, shape in expected_tensors(config).items():
        info = gguf.tensor(name)
        if info.shape != shape:
            raise GGUFError(f"GGUF {gguf.path}: tensor {name!r} has shape {info.shape}, but the metadata "
                            f"({config.arch}: n_embd={config.n_embd}, heads={config.n_head}/{config.n_head_kv}, "
                            f"head_dim={config.head_dim}, n_ff={config.n_ff}) implies {shape}.")
