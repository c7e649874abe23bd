"""The oracle: a plain float64 numpy executor of the graph IR, the reference every compiled kernel is checked against.

It shares nothing with the compiler below the graph: weights are dequantized one tensor at a time
(`GGUFFile.dequantize`) and kept as float64, every op is the textbook formula from `OpKind`'s docstring, and the
KV cache is a growing array per attention slot. float64 makes its own rounding negligible (~1e-13 relative), so any
difference a kernel shows against it is the kernel's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from luce_compile.errors import LuceError
from luce_compile.gguf.reader import GGUFFile
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, YARN_ATTRS, Graph, Op
from luce_compile.graph.registry import open_graph
from luce_compile.graph.rope_pairs import reorder_rows

log = logging.getLogger(__name__)

_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)
_GELU_COEF_A = 0.044715  # ggml_gelu's tanh approximation


def silu(x: np.ndarray) -> np.ndarray:
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))  # = x · sigmoid(x), without exp overflow


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_COEF_A * x * x)))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """ggml_swiglu_oai: the gate clamped above at limit, the up clamped to ±limit and shifted by 1."""
    g = np.minimum(gate, limit)
    return g / (1.0 + np.exp(-alpha * g)) * (np.clip(up, -limit, limit) + 1.0)


def yarn_factors(dim: int, base: float, freq_scale: float, ext_factor: float, attn_factor: float, beta_fast: float,
                 beta_slow: float, n_ctx_orig: int) -> tuple[np.ndarray, float]:
    """YaRN (OpKind.ROPE's docstring): per rotated pair i, the factor that multiplies pos · base^(-2i/dim), and the
    magnitude of cos and sin. The pairs below lo keep their full frequency, those above hi are interpolated by
    freq_scale, a linear ramp between."""
    def corr(beta: float) -> float:  # the pair whose wavelength fits n_ctx_orig / beta times in the original context
        return dim * np.log(n_ctx_orig / (2 * np.pi * beta)) / (2 * np.log(base))

    lo, hi = max(0.0, np.floor(corr(beta_fast))), min(dim - 1.0, np.ceil(corr(beta_slow)))
    ramp = 1.0 - np.clip((np.arange(dim // 2) - lo) / max(0.001, hi - lo), 0.0, 1.0)
    r = ramp * ext_factor
    mscale = attn_factor * (1.0 + 0.1 * np.log(1.0 / freq_scale)) if ext_factor else attn_factor
    return freq_scale * (1.0 - r) + r, mscale


def rope(x: np.ndarray, positions: np.ndarray, layout: str, dim: int, base: float, freq_scale: float,
         freq_factors: np.ndarray | None = None, yarn: dict | None = None) -> np.ndarray:
    """x (B,S,H,D), positions (B,S): rotate the first `dim` dims of each head (ggml_rope_ext; `yarn`: the op's
    ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig, else ext_factor 0)."""
    inv_freq = base ** (-2.0 * np.arange(dim // 2) / dim)  # (dim/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    scale, mscale = (freq_scale, 1.0) if yarn is None else yarn_factors(dim, base, freq_scale, **yarn)
    theta = positions[..., None].astype(np.float64) * (inv_freq * scale)  # (B,S,dim/2)
    cos, sin = mscale * np.cos(theta)[:, :, None, :], mscale * np.sin(theta)[:, :, None, :]  # (B,S,1,dim/2)
    i0 = np.arange(0, dim, 2) if layout == "norm" else np.arange(dim // 2)  # first of each rotated pair
    i1 = i0 + (1 if layout == "norm" else dim // 2)
    x0, x1 = x[..., i0], x[..., i1]
    out = x.copy()
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
              sliding_window: int = 0, softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """q (B,S,H,D) against all keys k (B,L,Hkv,D), v (B,L,Hkv,Dv) at positions q_pos (B,S), k_pos (B,L); sinks (H,):
    one more logit per query head in each softmax's denominator."""
    b, s, h, d = q.shape
    hkv = k.shape[2]
    # query head h reads kv head h // rep, as ggml_mul_mat broadcasts k over q's heads
    qg = q.reshape(b, s, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)  # (B,Hkv,rep,S,D)
    scores = qg @ k.transpose(0, 2, 3, 1)[:, :, None]  # (B,Hkv,rep,S,L)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    scores = scores * scale
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # (B,S,L)
    visible = delta >= 0
    if sliding_window:
        visible &= delta < sliding_window
    scores = np.where(visible[:, None, None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(1, hkv, h // hkv, 1, 1)  # query head h = (kv head, its rank in the group)
        top = np.maximum(top, sink)
    probs = np.exp(scores - top)
    den = probs.sum(axis=-1, keepdims=True) + (np.exp(sink - top) if sinks is not None else 0.0)
    probs /= den
    out = probs @ v.transpose(0, 2, 1, 3)[:, :, None]  # (B,Hkv,rep,S,Dv)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h * v.shape[3])


class Oracle:
    """Runs a graph in float64 for one sequence at a time, with a KV cache.

    `prefill(tokens)` starts a new sequence; `decode(token)` and `forward(tokens)` continue it."""

    def __init__(self, source: Graph | GGUFFile | str | Path):
        self.graph, self.gguf = open_graph(source)
        self.config = self.graph.config
        self._weights: dict[str, np.ndarray] = {}
        self._kv: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # slot → k, v, positions
        self.n_past = 0

    def weight(self, name: str) -> np.ndarray:
        """A weight dequantized to float64, cached (the models the oracle runs are small)."""
        if name not in self._weights:
            w = self.gguf.dequantize(name).astype(np.float64)
            if name in self.graph.row_pairs:  # the graph's rows are reordered (graph/rope_pairs.py)
                w = reorder_rows(w, self.graph.row_pairs[name])
            self._weights[name] = w
        return self._weights[name]

    def reset(self) -> None:
        self._kv.clear()
        self.n_past = 0

    def prefill(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """A new sequence: logits (T, vocab) for every prompt position."""
        self.reset()
        return self.forward(tokens)

    def decode(self, token: int) -> np.ndarray:
        """One more token of the current sequence: logits (vocab,)."""
        return self.forward([token])[0]

    def forward(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Append tokens to the current sequence (positions n_past…): logits (T, vocab)."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)  # (B=1, S)
        if ids.size == 0:
            raise LuceError("oracle: forward() needs at least one token.")
        positions = self.n_past + np.arange(ids.shape[1]).reshape(1, -1)
        logits = self.run(ids, positions)[LOGITS][0]
        self.n_past += ids.shape[1]
        return logits

    def tree_forward(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """The logits (n, vocab) a token tree appended to the current sequence gets in one tree verify (the runtime's
        Engine.verify_tree): row i after node i's path from the root (parents[i] an earlier node, -1 for a root),
        each root-to-leaf path run as a chain of its own from the current cache, which is left as it was."""
        n = len(tokens)
        if len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
            raise LuceError(f"oracle: a token tree needs one earlier node (or -1) as each node's parent; got {parents}")
        saved, out = (dict(self._kv), self.n_past), [None] * n
        for leaf in sorted(set(range(n)) - set(parents)):
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            self._kv, self.n_past = dict(saved[0]), saved[1]
            for node, row in zip(path, self.forward([tokens[i] for i in path]), strict=True):
                out[node] = row
        self._kv, self.n_past = saved
        return np.stack(out)

    def generate(self, prompt_ids: list[int], n: int, greedy: bool = True, temperature: float = 1.0,
                 seed: int = 0) -> list[int]:
        """n new tokens after the prompt: argmax, or sampled from softmax(logits / temperature)."""
        rng = np.random.default_rng(seed)
        logits, out = self.prefill(prompt_ids)[-1], []
        for i in range(n):
            if greedy:
                token = int(np.argmax(logits))
            else:
                p = np.exp((logits - logits.max()) / temperature)
                token = int(rng.choice(p.size, p=p / p.sum()))
            out.append(token)
            if i + 1 < n:
                logits = self.decode(token)
        return out

    def stream_greedy(self, prompt_ids: list[int], n: int, stop_ids: Iterable[int] = ()) -> Iterator[int]:
        """Up to n greedy tokens after the prompt, one at a time, ending before a stop token (for the CLI)."""
        stop = set(stop_ids)
        logits = self.prefill(prompt_ids)[-1]
        for i in range(n):
            token = int(np.argmax(logits))
            if token in stop:
                return
            yield token
            if i + 1 < n:
                logits = self.decode(token)

    def run(self, tokens: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """Every value of one step: tokens, positions (B,S) → {value name: float64 array}. Extends the KV cache."""
        env: dict[str, np.ndarray] = {TOKENS: tokens, POSITIONS: positions}
        for op in self.graph.ops:
            env[op.outputs[0]] = getattr(self, f"_{op.kind.value}")(op, *(env[n] for n in op.inputs))
        return env

    def _embedding(self, op: Op, tokens: np.ndarray) -> np.ndarray:
        table = self.weight(op.weights["weight"])
        if tokens.min() < 0 or tokens.max() >= table.shape[0]:
            raise LuceError(f"oracle: token ids {tokens.min()}..{tokens.max()} fall outside the vocabulary "
                            f"0..{table.shape[0] - 1}; they must come from this model's tokenizer.")
        return table[tokens] * op.attrs["scale"]

    def _rms_norm(self, op: Op, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weight(op.weights["weight"]), op.attrs["eps"])

    def _matmul(self, op: Op, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight(op.weights["weight"]).T
        return y + self.weight(op.weights["bias"]) if "bias" in op.weights else y

    _lm_head = _matmul

    def _reshape(self, op: Op, x: np.ndarray) -> np.ndarray:
        return x.reshape(*x.shape[:2], *op.attrs["shape"][2:])  # the leading (B,S) stay as they are

    def _rope(self, op: Op, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        factors = self.weight(op.weights["freq_factors"]) if "freq_factors" in op.weights else None
        a = op.attrs
        yarn = {n: a[n] for n in YARN_ATTRS} if "ext_factor" in a else None
        return rope(x, positions, a["layout"], a["dim"], a["base"], a["freq_scale"], factors, yarn)

    def _scale(self, op: Op, x: np.ndarray) -> np.ndarray:
        return x * op.attrs["scale"]

    def _attention(self, op: Op, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
        a = op.attrs
        if a["layer"] in self._kv:  # keys and values of the earlier steps of this sequence, then this step's
            k0, v0, p0 = self._kv[a["layer"]]
            k, v, k_pos = np.concatenate([k0, k], 1), np.concatenate([v0, v], 1), np.concatenate([p0, positions], 1)
        else:
            k_pos = positions
        self._kv[a["layer"]] = (k, v, k_pos)
        return attention(q, k, v, positions, k_pos, a["scale"], a["sliding_window"], a["softcap"], self._sinks(op))

    def _sinks(self, op: Op) -> np.ndarray | None:
        """The attention's sink logits (gpt-oss), or None."""
        return self.weight(op.weights["sinks"]) if "sinks" in op.weights else None

    def _add(self, op: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def _glu(self, op: Op, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        act = silu if op.attrs["activation"] == "silu" else gelu_tanh
        return act(gate) * up

    def _softcap(self, op: Op, x: np.ndarray) -> np.ndarray:
        cap = op.attrs["cap"]
        return cap * np.tanh(x / cap)

    def _moe_matmul(self, tensor: str, x: np.ndarray, w: np.ndarray, expert: int | None = None) -> np.ndarray:
        """x (T,K) @ w.T for expert `expert`'s rows w (N,K) of `tensor` (or the router's, expert None): GgmlRounding
        rounds x here."""
        return x @ w.T

    def _bias(self, op: Op, role: str, expert: int | None = None) -> np.ndarray | float:
        """The op's bias row for a role (an expert's row of a stacked one), 0 where it has none."""
        if role not in op.weights:
            return 0.0
        b = self.weight(op.weights[role])
        return b if expert is None else b[expert]

    def _moe(self, op: Op, x: np.ndarray) -> np.ndarray:
        """build_moe_ffn (OpKind.MOE), token by token: only the chosen experts' rows are read."""
        a, names = op.attrs, op.weights
        xs = x.reshape(-1, x.shape[-1])  # (T, E)
        logits = self._moe_matmul(names["gate_inp"], xs, self.weight(names["gate_inp"]))  # (T, n_expert)
        logits = logits + self._bias(op, "gate_inp_b")
        chosen, weights = route(logits, a["n_expert_used"], a.get("gating", "softmax"), a["norm_w"])
        gate, up, down = (self.weight(names[r]) for r in ("gate_exps", "up_exps", "down_exps"))
        out = np.zeros_like(xs)
        for t, experts in enumerate(chosen):
            row = xs[t:t + 1]
            for j, e in enumerate(experts):
                g = self._moe_matmul(names["gate_exps"], row, gate[e], e) + self._bias(op, "gate_exps_b", e)
                u = self._moe_matmul(names["up_exps"], row, up[e], e) + self._bias(op, "up_exps_b", e)
                y = self._moe_matmul(names["down_exps"], expert_glu(a, g, u), down[e], e)
                out[t] += weights[t, j] * (y[0] + self._bias(op, "down_exps_b", e))
        return out.reshape(x.shape)



def route(logits: np.ndarray, k: int, gating: str, norm_w: bool) -> tuple[np.ndarray, np.ndarray]:
    """The router's choice (OpKind.MOE): (T, k) expert ids, largest first (ggml_argsort_top_k), and their weights."""
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # softmax keeps the order: top-k of the logits
    picked = np.take_along_axis(logits, chosen, -1)
    if gating == "softmax":  # p_j of the softmax over every expert
        top = logits.max(-1, keepdims=True)
        weights = np.exp(picked - top) / np.exp(logits - top).sum(-1, keepdims=True)
    else:  # "softmax_weight": the softmax of the chosen logits alone
        weights = np.exp(picked - picked[:, :1])
        weights /= weights.sum(-1, keepdims=True)
    if norm_w:
        weights = weights / weights.sum(-1, keepdims=True)
    return chosen, weights


def expert_glu(attrs, gate: np.ndarray, up: np.ndarray) -> np.ndarray:  # noqa: ANN001  (an op's attrs)
    """An expert's gated activation: attrs["activation"] of OpKind.MOE."""
    if attrs["activation"] == "swiglu_oai":
        return swiglu_oai(gate, up, attrs["alpha"], attrs["limit"])
    return (silu if attrs["activation"] == "silu" else gelu_tanh)(gate) * up
