"""The decoder-layer factory every architecture builder shares.

llama, qwen2, qwen3 and gemma3 are the same pre-norm decoder; what llama.cpp hard-codes per architecture in
src/models/<arch>.cpp is a `DecoderStyle`, the numbers come from the ModelConfig. The order of the ops follows
those files exactly: q/k head norms before RoPE (qwen3, gemma3), gemma3's q scaling after RoPE with attention
scale 1, post-attention/post-FFN norms before the residual adds, and final logit softcapping after the LM head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from luce_compile.errors import GGUFError, UnsupportedError
from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, Graph, Op, OpKind, Value, validate

B, S = "B", "S"


@dataclass(frozen=True)
class DecoderStyle:
    """What an architecture's llama.cpp graph fixes, beyond the numbers in its metadata."""

    arch: str
    # q/k/v biases are read wherever the file has them (llama.cpp's create_tensor_qkv, shared by all four);
    # these are the other projections whose `.bias` this arch reads when present.
    optional_biases: frozenset[str] = frozenset()
    qk_norm: bool = False  # attn_q_norm / attn_k_norm are required, applied per head before RoPE
    post_norms: bool = False  # post_attention_norm / post_ffw_norm, before each residual add
    scale_q: bool = False  # q *= attention scale after RoPE, attention itself unscaled (gemma3.cpp)
    rope_freq_factors: bool = False  # llama 3's optional rope_freqs.weight divides each RoPE frequency
    attn_sinks: bool = False  # attn_sinks.weight: a logit per query head in every softmax (gpt-oss), required
    ffn_norm: str = "ffn_norm"  # the norm before the FFN (gpt-oss calls it post_attention_norm)


class _Builder:
    """Emits ops with unique value names (llama.cpp's callback names, prefixed by the block)."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, TensorInfo]):
        self.config, self.tensors = config, tensors
        self.ops: list[Op] = []
        self.weights: dict[str, TensorInfo] = {}
        self.names: set[str] = {TOKENS, POSITIONS}

    def emit(self, kind: OpKind, inputs: tuple[str, ...], name: str, weights: dict[str, str] | None = None,
             **attrs: object) -> str:
        assert name not in self.names, f"builder emitted {name!r} twice"
        weights = weights or {}
        for tensor in weights.values():
            if tensor not in self.tensors:
                raise GGUFError(f"graph ({self.config.arch}): the file has no tensor {tensor!r}, which the "
                                f"{self.config.arch} graph reads; the file does not match its architecture.")
            self.weights[tensor] = self.tensors[tensor]
        self.names.add(name)
        self.ops.append(Op(kind, inputs, (name,), weights, attrs))
        return name

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def linear(self, x: str, weight: str, name: str, bias: bool) -> str:
        weights = {"weight": f"{weight}.weight"}
        if bias:
            weights["bias"] = f"{weight}.bias"
        return self.emit(OpKind.MATMUL, (x,), name, weights)

    def norm(self, x: str, weight: str, name: str) -> str:
        return self.emit(OpKind.RMS_NORM, (x,), name, {"weight": weight}, eps=self.config.rms_eps)


def check_style(config: ModelConfig, style: DecoderStyle) -> None:
    """Refuse a config whose file contradicts what the architecture's graph needs, before any work."""
    if config.arch != style.arch:
        raise UnsupportedError(f"graph: the {style.arch} builder was given a {config.arch!r} model.")
    if style.qk_norm != config.qk_norm:
        what = "lacks attn_q_norm/attn_k_norm, which it requires" if style.qk_norm else \
            "has attn_q_norm/attn_k_norm, which its llama.cpp graph does not read"
        raise GGUFError(f"graph ({config.arch}): the file {what}; it is not a standard {config.arch} model.")
    if style.attn_sinks != config.attn_sinks:
        raise GGUFError(f"graph ({config.arch}): attention sinks are {config.attn_sinks} in the config but the "
                        f"{config.arch} graph {'needs' if style.attn_sinks else 'has no'} them.")
    if style.post_norms != config.post_norms:
        raise GGUFError(f"graph ({config.arch}): post-norms are {config.post_norms} in the config but the "
                        f"{config.arch} graph {'needs' if style.post_norms else 'has no'} them.")
    if config.rope_dim != config.head_dim:
        # the four llama.cpp graphs assert n_rot == head size (the IR's rope could rotate fewer dims)
        raise UnsupportedError(f"graph ({config.arch}): rope.dimension_count {config.rope_dim} != head size "
                               f"{config.head_dim} is not supported for {config.arch}.")


def _attention_block(b: _Builder, style: DecoderStyle, il: int, x: str) -> str:
    """attn_norm → q/k/v → (head norms) → RoPE → (q scale) → attention → output projection → (post norm) → +x."""
    c, p = b.config, f"blk.{il}."
    h = b.norm(x, p + "attn_norm.weight", p + "attn_norm")
    heads = {"q": (c.n_head, c.head_dim), "k": (c.n_head_kv, c.head_dim), "v": (c.n_head_kv, c.head_dim_v)}
    qkv = {}
    for t, (n, d) in heads.items():
        flat = b.linear(h, p + f"attn_{t}", p + f"{t.upper()}cur", bias=c.attn_bias)
        qkv[t] = b.emit(OpKind.RESHAPE, (flat,), p + f"{t.upper()}cur_heads", shape=(B, S, n, d))
    sliding = c.sliding[il] if c.sliding else False
    # llama.cpp's get_rope_freq_base/scale: sliding layers use the local base and scale (gemma3: no scaling)
    rope = dict(layout=c.rope_layout, dim=c.rope_dim, base=c.rope_base_local if sliding else c.rope_base,
                freq_scale=c.rope_scale_local if sliding else c.rope_scale)
    if c.rope_yarn_ext_factor or c.rope_yarn_attn_factor != 1.0:  # YaRN: cparams, the same on every layer
        rope |= dict(ext_factor=c.rope_yarn_ext_factor, attn_factor=c.rope_yarn_attn_factor,
                     beta_fast=c.rope_yarn_beta_fast, beta_slow=c.rope_yarn_beta_slow, n_ctx_orig=c.rope_yarn_orig_ctx)
    rope_w = {"freq_factors": "rope_freqs.weight"} if style.rope_freq_factors and b.has("rope_freqs.weight") else {}
    for t in ("q", "k"):
        if style.qk_norm:
            qkv[t] = b.norm(qkv[t], p + f"attn_{t}_norm.weight", p + f"{t.upper()}cur_normed")
        qkv[t] = b.emit(OpKind.ROPE, (qkv[t], POSITIONS), p + f"{t.upper()}cur_rope", rope_w, **rope)
    scale = c.q_scale
    if style.scale_q:
        qkv["q"] = b.emit(OpKind.SCALE, (qkv["q"],), p + "Qcur_scaled", scale=scale)
        scale = 1.0
    sinks = {"sinks": p + "attn_sinks.weight"} if style.attn_sinks else {}
    att = b.emit(OpKind.ATTENTION, (qkv["q"], qkv["k"], qkv["v"], POSITIONS), p + "kqv_out", sinks,
                 n_head=c.n_head, n_head_kv=c.n_head_kv, scale=scale,
                 sliding_window=c.sliding_window if sliding else 0, softcap=c.attn_logit_softcap, layer=il)
    out = b.linear(att, p + "attn_output", p + "attn_out",
                   bias="attn_output" in style.optional_biases and b.has(p + "attn_output.bias"))
    if style.post_norms:
        out = b.norm(out, p + "post_attention_norm.weight", p + "attn_post_norm")
    return b.emit(OpKind.ADD, (out, x), p + "ffn_inp")


def _ffn_block(b: _Builder, style: DecoderStyle, il: int, x: str) -> str:
    """ffn_norm → act(gate) · up → down → (post norm) → +x (llama.cpp's build_ffn with LLM_FFN_PAR)."""
    p = f"blk.{il}."

    def bias(t: str) -> bool:
        return t in style.optional_biases and b.has(p + t + ".bias")

    h = b.norm(x, p + f"{style.ffn_norm}.weight", p + "ffn_norm")
    if b.config.n_expert:  # qwen3moe.cpp: the FFN is build_moe_ffn, the same norm before and residual add after
        return b.emit(OpKind.ADD, (_moe(b, il, h), x), p + "l_out")
    gate = b.linear(h, p + "ffn_gate", p + "ffn_gate", bias("ffn_gate"))
    up = b.linear(h, p + "ffn_up", p + "ffn_up", bias("ffn_up"))
    act = b.emit(OpKind.GLU, (gate, up), p + "ffn_glu", activation=b.config.activation)
    out = b.linear(act, p + "ffn_down", p + "ffn_out", bias("ffn_down"))
    if style.post_norms:
        out = b.norm(out, p + "post_ffw_norm.weight", p + "ffn_post_norm")
    return b.emit(OpKind.ADD, (out, x), p + "l_out")


# ggml_swiglu_oai's constants in build_moe_ffn (LLM_FFN_SWIGLU_OAI_MOE: "TODO: move to hparams?")
SWIGLU_OAI = {"alpha": 1.702, "limit": 7.0}


def _moe(b: _Builder, il: int, h: str) -> str:
    """build_moe_ffn: router, chosen experts, their weighted sum (OpKind.MOE); biases where the config has them."""
    c, p = b.config, f"blk.{il}."
    roles = ("gate_inp", "gate_exps", "up_exps", "down_exps")
    weights = {r: p + f"ffn_{r}.weight" for r in roles}
    if c.expert_bias:
        weights |= {f"{r}_b": p + f"ffn_{r}.bias" for r in roles}
    attrs = dict(n_expert=c.n_expert, n_expert_used=c.n_expert_used, norm_w=c.expert_weights_norm,
                 activation=c.activation)
    if c.expert_gating != "softmax":
        attrs["gating"] = c.expert_gating
    if c.activation == "swiglu_oai":
        attrs |= SWIGLU_OAI
    return b.emit(OpKind.MOE, (h,), p + "ffn_moe_out", weights, **attrs)


def build_decoder(config: ModelConfig, tensors: Mapping[str, TensorInfo], style: DecoderStyle) -> Graph:
    """The whole forward step of a decoder-only model: tokens, positions (B,S) → logits (B,S,V)."""
    check_style(config, style)
    b = _Builder(config, tensors)
    x = b.emit(OpKind.EMBEDDING, (TOKENS,), "inp_embd", {"weight": "token_embd.weight"}, scale=config.embed_scale)
    for il in range(config.n_layer):
        x = _ffn_block(b, style, il, _attention_block(b, style, il, x))
    x = b.norm(x, "output_norm.weight", "result_norm")
    head = {"weight": "token_embd.weight" if config.tied_output else "output.weight"}
    if "output" in style.optional_biases and b.has("output.bias"):
        head["bias"] = "output.bias"
    name = LOGITS if not config.final_logit_softcap else "result_output"
    x = b.emit(OpKind.LM_HEAD, (x,), name, head)
    if config.final_logit_softcap:
        x = b.emit(OpKind.SOFTCAP, (x,), LOGITS, cap=config.final_logit_softcap)
    graph = Graph(config, b.ops, {TOKENS: Value((B, S), "int32"), POSITIONS: Value((B, S), "int32")},
                  (LOGITS,), b.weights)
    validate(graph, tensors)
    return graph
