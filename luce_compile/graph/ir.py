"""The graph IR: a short, explicit list of typed ops over named tensors.

One IR feeds every consumer — the float64 oracle, the ONNX export, lowering to TensorIR and megakernel fusion — so
each op kind's semantics are defined once, here, in the docstring of `OpKind`. Activations are named values with
symbolic shapes: "B" is the batch, "S" the tokens of this step (a whole prompt in prefill, one in decode). Weights
are not values: an op names the GGUF tensors it reads (role → tensor name), so a kernel can read the raw quantized
blocks of that tensor; the graph records each one's TensorInfo (ggml type, numpy shape (out, in)).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod
from pathlib import Path
from typing import Any

from luce_compile.errors import GGUFError, LuceError, UnsupportedError
from luce_compile.gguf.config import ModelConfig
from luce_compile.gguf.reader import TensorInfo

Dim = int | str  # a concrete size, or a symbol: "B" (batch) or "S" (tokens in this step)


class GraphError(LuceError, ValueError):
    """A graph that breaks the IR's rules (a builder bug, or a hand-edited graph)."""


class OpKind(StrEnum):
    """Op kinds and their semantics (x: the first input; weights by role; shapes with symbolic B, S).

    embedding    tokens (B,S) int → (B,S,E): rows of weights["weight"] (V,E), times attrs["scale"].
    rms_norm     x (...,N) → x / sqrt(mean(x², -1) + eps) · weights["weight"] (N,). On (B,S,H,D) it normalizes
                 each head (qk norm).
    matmul       x (B,S,K) → x @ W.T (+ bias): weights["weight"] (N,K), optional weights["bias"] (N,).
    lm_head      like matmul, for the vocabulary projection (its own kind: decode only needs the last row).
    reshape      x → attrs["shape"]; same element count (symbolic dims must match in order).
    rope         x (B,S,H,D), positions (B,S) int → x with its first attrs["dim"] dims of each head rotated by
                 theta_i = pos · freq_scale · base^(-2i/dim) / freq_factors[i]; layout "norm" rotates
                 (x[2i], x[2i+1]), "neox" rotates (x[i], x[i+dim/2]) (ggml's GGML_ROPE_TYPE_NORMAL / NEOX).
                 YaRN where attrs["ext_factor"] is present and not 0 (ggml's rope_yarn): with theta_e = pos ·
                 base^(-2i/dim) and ramp_i = 1 − clamp((i − lo)/max(0.001, hi − lo), 0, 1),
                 theta_i = theta_e · (freq_scale · (1 − r) + r), r = ramp_i · ext_factor, and cos and sin are
                 multiplied by attrs["attn_factor"] · (1 + 0.1 ln(1/freq_scale)); lo = max(0, floor(c(beta_fast))),
                 hi = min(dim − 1, ceil(c(beta_slow))), c(b) = dim · ln(n_ctx_orig / (2π b)) / (2 ln base)
                 (ggml_rope_yarn_corr_dims; attrs "beta_fast", "beta_slow", "n_ctx_orig").
    scale        x → x · attrs["scale"].
    attention    q (B,S,H,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv), positions (B,S) → (B,S,H·Dv). The step's k, v are
                 appended to KV-cache slot attrs["layer"]; query head h reads kv head h // (H/Hkv). Scores
                 s = q·k; with attrs["softcap"] > 0, s = softcap·tanh(s/softcap); then s · attrs["scale"], masked,
                 softmax over keys, times v (llama.cpp's build_attn_mha, non-flash path). A key at position pk is
                 visible to a query at pq iff pk ≤ pq and, when attrs["sliding_window"] = w > 0, pq − pk < w
                 (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_STANDARD). With weights["sinks"] (H,) (gpt-oss's
                 attn_sinks), query head h's softmax has one more term, exp(sinks[h]) (the raw logit: not scaled,
                 not masked), in its denominator only (ggml_soft_max_add_sinks).
    add          a + b.
    glu          gate, up → act(gate) · up; attrs["activation"] "silu" (SwiGLU) or "gelu_tanh" (GeGLU, the tanh
                 form that ggml_gelu uses).
    softcap      x → cap · tanh(x / cap), cap = attrs["cap"] (final logit softcapping).
    moe          x (B,S,E) → (B,S,E), llama.cpp's build_moe_ffn: router logits l = x @ weights["gate_inp"].T
                 (n_expert, E) (+ weights["gate_inp_b"] (n_expert,)); the attrs["n_expert_used"] experts of largest
                 l; their weights w_j: with attrs["gating"] "softmax" (the default) p_j of p = softmax(l), divided by
                 Σ_j w_j when attrs["norm_w"]; with "softmax_weight" the softmax of the chosen l_j alone;
                 out = Σ_j w_j · down_j(glu(gate_j(x), up_j(x))) with expert j's rows of the stacked
                 weights["gate_exps"], ["up_exps"] (n_expert, F, E) and ["down_exps"] (n_expert, E, F), each plus
                 its row of weights["gate_exps_b"], ["up_exps_b"] (n_expert, F), ["down_exps_b"] (n_expert, E)
                 where given (ggml_add_id); glu = attrs["activation"]: "silu" or "gelu_tanh" as in glu, or
                 "swiglu_oai" (ggml_swiglu_oai): g = min(gate, limit), u = clamp(up, −limit, limit),
                 g · sigmoid(alpha · g) · (u + 1), alpha = attrs["alpha"], limit = attrs["limit"].
    """

    EMBEDDING = "embedding"
    RMS_NORM = "rms_norm"
    MATMUL = "matmul"
    LM_HEAD = "lm_head"
    RESHAPE = "reshape"
    ROPE = "rope"
    SCALE = "scale"
    ATTENTION = "attention"
    ADD = "add"
    GLU = "glu"
    SOFTCAP = "softcap"
    MOE = "moe"


@dataclass(frozen=True)
class Value:
    """An activation's type: symbolic shape and dtype ("float": the executor picks the precision; "int32")."""

    shape: tuple[Dim, ...]
    dtype: str = "float"


@dataclass(frozen=True)
class Op:
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: Mapping[str, str] = field(default_factory=dict)  # role ("weight", "bias", …) → GGUF tensor name
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        w = "".join(f" {r}={n}" for r, n in self.weights.items())
        a = "".join(f" {k}={v!r}" for k, v in self.attrs.items())
        return f"{', '.join(self.outputs)} = {self.kind}({', '.join(self.inputs)}){w}{a}"


TOKENS, POSITIONS, LOGITS = "tokens", "positions", "logits"
YARN_ATTRS = ("ext_factor", "attn_factor", "beta_fast", "beta_slow", "n_ctx_orig")  # a rope op's YaRN (OpKind)


@dataclass
class Graph:
    """A whole model's forward step. `inputs` are tokens and positions (B,S); `outputs` the logits (B,S,V)."""

    config: ModelConfig
    ops: list[Op]
    inputs: dict[str, Value]
    outputs: tuple[str, ...]
    weights: dict[str, TensorInfo]  # every GGUF tensor the ops read
    source: Path | None = None  # the GGUF file it was built from (the oracle and export read weights there)
    # tensor → head size: rows reordered within each head so NEOX RoPE pairs are neighbours (graph/rope_pairs.py);
    # every reader of such a weight reorders it (rope_pairs.reorder_rows)
    row_pairs: dict[str, int] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        return sum(info.n_elements for info in self.weights.values())

    def values(self) -> dict[str, Value]:
        """Every value's type, inferred op by op (raises GraphError where the graph is inconsistent)."""
        return infer_types(self)

    def attention_ops(self) -> list[Op]:
        return [op for op in self.ops if op.kind == OpKind.ATTENTION]

    def describe(self) -> str:
        """One line per op: for reading, logging and golden tests."""
        return "\n".join(str(op) for op in self.ops)


def _same_elements(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    def split(s: tuple[Dim, ...]) -> tuple[tuple[str, ...], int]:
        return tuple(d for d in s if isinstance(d, str)), prod(d for d in s if isinstance(d, int))

    return split(a) == split(b)


def _weight_shape(graph: Graph, op: Op, role: str) -> tuple[int, ...]:
    name = op.weights.get(role)
    if name is None:
        raise GraphError(f"graph: op {op} needs a {role!r} weight.")
    if name not in graph.weights:
        raise GraphError(f"graph: op {op} reads weight {name!r}, which is not in graph.weights.")
    return graph.weights[name].shape


def _expect(op: Op, what: str, got: Any, want: Any) -> None:
    if got != want:
        raise GraphError(f"graph: op {op}: {what} is {got}, expected {want}.")


def _infer_linear(g: Graph, op: Op, ins: list[Value]) -> Value:
    n, k = _weight_shape(g, op, "weight")
    _expect(op, "input's last dim", ins[0].shape[-1], k)
    if "bias" in op.weights:
        _expect(op, "bias shape", _weight_shape(g, op, "bias"), (n,))
    return Value((*ins[0].shape[:-1], n))


def _infer_rope(g: Graph, op: Op, ins: list[Value]) -> Value:
    x, pos = ins
    _expect(op, "rank of x", len(x.shape), 4)
    _expect(op, "positions shape", pos.shape, x.shape[:2])
    dim = op.attrs["dim"]
    if op.attrs["layout"] not in ("norm", "neox") or dim % 2 or not 0 < dim <= x.shape[-1]:
        raise GraphError(f"graph: op {op}: layout must be norm|neox and dim even and ≤ head size {x.shape[-1]}.")
    if "freq_factors" in op.weights:
        _expect(op, "freq_factors shape", _weight_shape(g, op, "freq_factors"), (dim // 2,))
    return x


def _infer_attention(g: Graph, op: Op, ins: list[Value]) -> Value:
    q, k, v, pos = ins
    h, hkv = op.attrs["n_head"], op.attrs["n_head_kv"]
    _expect(op, "q heads", q.shape[2:3], (h,))
    _expect(op, "k shape", k.shape, (*q.shape[:2], hkv, q.shape[3]))
    _expect(op, "v shape", v.shape[:3], (*q.shape[:2], hkv))
    _expect(op, "positions shape", pos.shape, q.shape[:2])
    if h % hkv:
        raise GraphError(f"graph: op {op}: n_head {h} is not a multiple of n_head_kv {hkv}.")
    if "sinks" in op.weights:
        _expect(op, "sinks shape", _weight_shape(g, op, "sinks"), (h,))
    return Value((*q.shape[:2], h * v.shape[3]))


MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
MOE_GATINGS = ("softmax", "softmax_weight")


def _infer_moe(g: Graph, op: Op, x: Value) -> Value:
    e, used = op.attrs["n_expert"], op.attrs["n_expert_used"]
    n_embd = x.shape[-1]
    _expect(op, "router shape", _weight_shape(g, op, "gate_inp"), (e, n_embd))
    f = _weight_shape(g, op, "up_exps")[1]
    for role, shape in (("gate_exps", (e, f, n_embd)), ("up_exps", (e, f, n_embd)), ("down_exps", (e, n_embd, f))):
        _expect(op, f"{role} shape", _weight_shape(g, op, role), shape)
    for role, shape in (("gate_inp_b", (e,)), ("gate_exps_b", (e, f)), ("up_exps_b", (e, f)),
                        ("down_exps_b", (e, n_embd))):
        if role in op.weights:
            _expect(op, f"{role} shape", _weight_shape(g, op, role), shape)
    if not 0 < used <= e or op.attrs["activation"] not in MOE_ACTIVATIONS or \
            op.attrs.get("gating", "softmax") not in MOE_GATINGS:
        raise GraphError(f"graph: op {op}: needs 0 < n_expert_used ≤ n_expert, an activation of {MOE_ACTIVATIONS} "
                         f"and a gating of {MOE_GATINGS}.")
    return x


def _infer_one(g: Graph, op: Op, ins: list[Value]) -> Value:
    """The output type of one single-output op, checking its inputs and weights."""
    x = ins[0]
    match op.kind:
        case OpKind.EMBEDDING:
            _expect(op, "tokens dtype", x.dtype, "int32")
            return Value((*x.shape, _weight_shape(g, op, "weight")[1]))
        case OpKind.RMS_NORM:
            _expect(op, "weight shape", _weight_shape(g, op, "weight"), (x.shape[-1],))
            return x
        case OpKind.MATMUL | OpKind.LM_HEAD:
            return _infer_linear(g, op, ins)
        case OpKind.RESHAPE:
            shape = tuple(op.attrs["shape"])
            if not _same_elements(x.shape, shape):
                raise GraphError(f"graph: op {op}: cannot reshape {x.shape} to {shape}.")
            return Value(shape, x.dtype)
        case OpKind.ROPE:
            return _infer_rope(g, op, ins)
        case OpKind.ATTENTION:
            return _infer_attention(g, op, ins)
        case OpKind.ADD | OpKind.GLU:
            _expect(op, "second input's shape", ins[1].shape, x.shape)
            if op.kind == OpKind.GLU and op.attrs["activation"] not in ("silu", "gelu_tanh"):
                raise GraphError(f"graph: op {op}: activation must be silu or gelu_tanh.")
            return x
        case OpKind.SCALE | OpKind.SOFTCAP:
            return x
        case OpKind.MOE:
            return _infer_moe(g, op, x)
    raise GraphError(f"graph: op {op} has an unknown kind.")


_ARITY = {OpKind.ROPE: 2, OpKind.ATTENTION: 4, OpKind.ADD: 2, OpKind.GLU: 2}


def infer_types(graph: Graph) -> dict[str, Value]:
    """Walk the ops in order: every input defined before use, every name defined once, every weight present with
    the shape its op needs. Returns the type of every value."""
    env: dict[str, Value] = dict(graph.inputs)
    for op in graph.ops:
        if len(op.inputs) != _ARITY.get(op.kind, 1) or len(op.outputs) != 1:
            raise GraphError(f"graph: op {op} takes {_ARITY.get(op.kind, 1)} inputs and gives 1 output.")
        missing = [n for n in op.inputs if n not in env]
        if missing:
            raise GraphError(f"graph: op {op} reads {missing} before any op produces them.")
        if op.outputs[0] in env:
            raise GraphError(f"graph: op {op} redefines {op.outputs[0]!r}; every value is defined once.")
        env[op.outputs[0]] = _infer_one(graph, op, [env[n] for n in op.inputs])
    for name in graph.outputs:
        if name not in env:
            raise GraphError(f"graph: output {name!r} is never produced.")
    return env


def validate(graph: Graph, file_tensors: Mapping[str, TensorInfo] | None = None) -> dict[str, Value]:
    """Check the graph (see infer_types), that it reads exactly graph.weights, that each attention op owns its own
    KV-cache slot, and, given the file's tensors, that the file holds each weight as recorded and nothing the
    graph would ignore (llama.cpp also refuses a file with tensors its architecture does not read)."""
    values = infer_types(graph)
    used = {name for op in graph.ops for name in op.weights.values()}
    if used != set(graph.weights):
        raise GraphError(f"graph: graph.weights lists {sorted(set(graph.weights) - used)[:5]} that no op reads.")
    slots = [op.attrs["layer"] for op in graph.attention_ops()]
    if len(set(slots)) != len(slots):
        raise GraphError(f"graph: attention ops share KV-cache slots {slots}.")
    if file_tensors is not None:
        for name, info in graph.weights.items():
            if name not in file_tensors or file_tensors[name].shape != info.shape:
                got = file_tensors[name].shape if name in file_tensors else "missing"
                raise GGUFError(f"graph: the file's tensor {name!r} is {got}, the graph needs {info.shape}.")
        extra = sorted(set(file_tensors) - used)
        if extra:
            raise UnsupportedError(
                f"graph ({graph.config.arch}): the file has tensors the {graph.config.arch} graph does not read: "
                f"{extra[:6]}{'…' if len(extra) > 6 else ''}. They mean a model variant luce-compile does not "
                "implement; ignoring them would compute wrong logits.")
    return values
