"""The torch peer: what a user would run instead of luce-compile on a GPU, gpt-fast style, on the same GGUF file.

    python benchmarks/peers/torch_peer.py MODEL.gguf --out OUT.json [--prompt-lens 512 2048] [--gen-len 128]
                                                      [--batches 1 8]

Every weight is dequantized with the project's own reader (luce_compile.gguf, which imports no TVM) and kept in
bf16 on the GPU, so this peer reads 16 bits per weight where the GGUF may hold 4.5: that is what a torch user pays,
and its roofline is computed from the bytes it really reads. The model follows the project's graph builders
(luce_compile/graph/decoder.py): config from model_config(), llama.cpp's RoPE layouts (NORM: adjacent pairs on the
GGUF's permuted q/k rows for llama; NEOX: halves for qwen2/qwen3), qwen2's q/k/v biases and untied head, qwen3's
per-head q/k RMSNorm before RoPE.

Prefill runs one sequence at a time with sdpa(is_causal=True) (torch picks cuDNN's flash kernel on the H200), timed
both eager and replayed as one CUDA graph per prompt length. Decode is gpt-fast's: a static KV cache, the whole batch
step (positions are a device tensor, one per sequence) captured in one CUDA graph and replayed; attention reads the
whole static cache under a mask built from the positions, because a graph cannot slice the cache to a
data-dependent length. torch.compile is off by default (--compile: ~40 s per batch size on the H200, and the GPU
machine's calls are 10 minutes). The forward is device- and dtype-agnostic so tests run it on the CPU in fp32.

JSON keys: prefill_tok_s / prefill_eager_tok_s / prefill_ms per prompt length; decode_tok_s (all sequences together)
and decode_step_ms (one step = one token of every sequence) per batch; bandwidth_gb_s (2 GiB device copy, read +
write), weight_bytes_per_token (bf16), roofline_tok_s, roofline_fraction (batch-1 decode over the roofline),
achieved_gb_s; first_token (greedy after the seed-0 prompt of decode_prompt_len ids), versions.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "runtime")) if p not in sys.path]

from luce_runtime.bench import roofline_tok_s  # noqa: E402  (numpy only: no TVM on the GPU machine)
from luce_runtime.timing import call_times  # noqa: E402

from luce_compile.errors import UnsupportedError  # noqa: E402
from luce_compile.gguf.config import ModelConfig, model_config  # noqa: E402
from luce_compile.gguf.reader import GGUFFile, read_gguf  # noqa: E402
from luce_compile.graph.decoder import DecoderStyle, check_style  # noqa: E402
from luce_compile.graph.llama import STYLE as LLAMA  # noqa: E402
from luce_compile.graph.qwen2 import STYLE as QWEN2  # noqa: E402
from luce_compile.graph.qwen3 import STYLE as QWEN3  # noqa: E402

STYLES: dict[str, DecoderStyle] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}
# sdpa's fused kernels want the mask's last dim aligned; 64 also keeps each head's cache in whole 128-byte lines.
SEQ_ALIGN = 64


@dataclass
class Layer:
    attn_norm: Tensor
    wqkv: Tensor  # (q_out + kv_out + v_out, n_embd): q, k, v stacked so one GEMM reads the normed input once
    bqkv: Tensor | None
    qk_norm: Tensor | None  # (H + Hkv, head_dim): qwen3's q_norm for each q head, then k_norm for each k head
    wo: Tensor
    bo: Tensor | None
    ffn_norm: Tensor
    w13: Tensor  # (2·n_ff, n_embd): gate then up, one GEMM
    b13: Tensor | None
    w2: Tensor
    b2: Tensor | None


@dataclass
class KVCache:
    """Static per-layer caches, (B, n_head_kv, max_seq, head_dim); sequence b owns row b."""

    k: list[Tensor]
    v: list[Tensor]
    key_pos: Tensor  # (max_seq,) 0..max_seq-1, to build decode masks on the device

    @classmethod
    def allocate(cls, c: ModelConfig, batch: int, max_seq: int, device: torch.device | str,
                 dtype: torch.dtype) -> KVCache:
        max_seq = -(-max_seq // SEQ_ALIGN) * SEQ_ALIGN
        # zeros, not empty: masked slots still enter P·V with weight 0, and 0·NaN would poison the output
        k = [torch.zeros(batch, c.n_head_kv, max_seq, c.head_dim, device=device, dtype=dtype) for _ in range(c.n_layer)]
        v = [torch.zeros(batch, c.n_head_kv, max_seq, c.head_dim_v, device=device, dtype=dtype)
             for _ in range(c.n_layer)]
        return cls(k, v, torch.arange(max_seq, device=device))

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def clear(self) -> None:
        for t in self.k + self.v:
            t.zero_()


class Transformer:
    """llama / qwen2 / qwen3 forward over dequantized weights: prefill one sequence, decode a batch."""

    def __init__(self, gguf: GGUFFile | str | Path, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, max_seq: int = 4096):
        self.gguf = gguf if isinstance(gguf, GGUFFile) else read_gguf(gguf)
        self.config = c = model_config(self.gguf)
        if c.arch not in STYLES:
            raise UnsupportedError(f"torch peer: architecture {c.arch!r} is not implemented here "
                                   f"(supported: {', '.join(STYLES)}); benchmark it with luce-compile and llama.cpp.")
        self.style = STYLES[c.arch]
        check_style(c, self.style)  # the same refusals as the project's graph builder (e.g. rope_dim == head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.loaded: list[str] = []  # GGUF tensors held on the device, for weight_bytes_per_token
        # NEOX rotates (x_i, x_{i+D/2}). Reordering each q/k head's dims to (0, D/2, 1, D/2+1, …) at load turns it
        # into NORM's adjacent pairs, so one complex multiply serves both; q·k is unchanged by a shared reordering.
        d = c.head_dim
        self.qk_perm = torch.arange(d).view(2, d // 2).t().flatten() if c.rope_layout == "neox" else None
        self.layers = [self._load_layer(i) for i in range(c.n_layer)]
        self.token_embd = self._w("token_embd.weight")
        self.output_norm = self._w("output_norm.weight")
        self.output = self.token_embd if c.tied_output else self._w("output.weight")
        self.output_bias = self._opt("output.bias", "output")
        self.rope = self._rope_table(max_seq)

    # --- loading -----------------------------------------------------------------------------------------------
    def _w(self, name: str) -> Tensor:
        a = self.gguf.dequantize(name)  # float32, numpy shape (out, in)
        a = a if a.flags.writeable else a.copy()  # F32 tensors may be views of the read-only map
        self.loaded.append(name)
        # to the device in fp32, convert there: the GPU converts faster than the host
        return torch.from_numpy(a).to(self.device).to(self.dtype)

    def _opt(self, name: str, proj: str) -> Tensor | None:
        """An optional bias, read where the project's graph for this arch reads it (DecoderStyle.optional_biases)."""
        if proj in self.style.optional_biases and name in self.gguf.tensors:
            return self._w(name)
        return None

    def _qk_rows(self, t: Tensor, n_head: int) -> Tensor:
        """A q or k weight/bias (n_head·D, …) with each head's rows in the NORM order (see qk_perm)."""
        if self.qk_perm is None:
            return t
        return t.unflatten(0, (n_head, self.config.head_dim))[:, self.qk_perm].flatten(0, 1)

    def _load_layer(self, i: int) -> Layer:
        c, p = self.config, f"blk.{i}."
        qkv = [self._qk_rows(self._w(p + "attn_q.weight"), c.n_head),
               self._qk_rows(self._w(p + "attn_k.weight"), c.n_head_kv), self._w(p + "attn_v.weight")]
        bqkv = qk_norm = None
        if c.attn_bias:
            bqkv = torch.cat([self._qk_rows(self._w(p + "attn_q.bias"), c.n_head),
                              self._qk_rows(self._w(p + "attn_k.bias"), c.n_head_kv), self._w(p + "attn_v.bias")])
        if c.qk_norm:
            q_norm, k_norm = (self._qk_rows(self._w(p + f"attn_{t}_norm.weight"), 1) for t in "qk")
            qk_norm = torch.cat([q_norm.expand(c.n_head, -1), k_norm.expand(c.n_head_kv, -1)])
        gate, up = self._w(p + "ffn_gate.weight"), self._w(p + "ffn_up.weight")
        b_gate, b_up = self._opt(p + "ffn_gate.bias", "ffn_gate"), self._opt(p + "ffn_up.bias", "ffn_up")
        if (b_gate is None) != (b_up is None):  # one fused GEMM needs both or neither; zeros stand in
            b_gate = torch.zeros_like(gate[:, 0]) if b_gate is None else b_gate
            b_up = torch.zeros_like(up[:, 0]) if b_up is None else b_up
        return Layer(
            attn_norm=self._w(p + "attn_norm.weight"), wqkv=torch.cat(qkv), bqkv=bqkv, qk_norm=qk_norm,
            wo=self._w(p + "attn_output.weight"), bo=self._opt(p + "attn_output.bias", "attn_output"),
            ffn_norm=self._w(p + "ffn_norm.weight"), w13=torch.cat([gate, up]),
            b13=None if b_gate is None else torch.cat([b_gate, b_up]),
            w2=self._w(p + "ffn_down.weight"), b2=self._opt(p + "ffn_down.bias", "ffn_down"),
        )

    def _rope_table(self, max_seq: int) -> Tensor:
        """(cos, sin) per position and pair, (max_seq, D/2, 2) fp32, computed in fp64 as the oracle does
        (ggml_rope_ext with ext_factor 0)."""
        c = self.config
        inv_freq = c.rope_scale * c.rope_base ** (-2.0 * np.arange(c.rope_dim // 2) / c.rope_dim)
        if self.style.rope_freq_factors and "rope_freqs.weight" in self.gguf.tensors:  # llama 3's per-dim factors
            inv_freq = inv_freq / self.gguf.dequantize("rope_freqs.weight").astype(np.float64)
        theta = np.arange(max_seq, dtype=np.float64)[:, None] * inv_freq
        return torch.from_numpy(np.stack([np.cos(theta), np.sin(theta)], axis=-1)).float().to(self.device)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every tensor loaded, at this model's dtype, the tied LM head once;
        an untied embedding table only contributes the looked-up row."""
        c, itemsize = self.config, self.token_embd.element_size()
        elements = sum(self.gguf.tensor(name).n_elements for name in self.loaded)
        if not c.tied_output:
            elements -= (c.n_vocab - 1) * c.n_embd
        return elements * itemsize

    # --- the forward ---------------------------------------------------------------------------------------------
    def _rms(self, x: Tensor, w: Tensor | None) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.config.rms_eps)

    def _rope(self, x: Tensor, cs: Tensor) -> Tensor:
        """x (B,S,N,D) in NORM order, cs (…,D/2,2) cos/sin broadcastable to it: each pair (x0,x1) as x0 + i·x1 times
        cos + i·sin. In fp32: bf16 angles would drift with the position."""
        xf = x.float().unflatten(-1, (-1, 2))  # (B,S,N,D/2,2)
        if torch.compiler.is_compiling():  # inductor fuses real arithmetic; complex ops would fall back to eager
            x0, x1, cos, sin = xf[..., 0], xf[..., 1], cs[..., 0], cs[..., 1]
            return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x)
        rotated = torch.view_as_complex(xf) * torch.view_as_complex(cs)  # one kernel instead of six
        return torch.view_as_real(rotated).flatten(-2).type_as(x)

    def _qkv(self, layer: Layer, h: Tensor, cs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (B,S,E) normed → q (B,S,H,D), k (B,S,Hkv,D), v (B,S,Hkv,Dv), head norms and RoPE applied."""
        c = self.config
        n_qk = c.n_head + c.n_head_kv
        qk, v = F.linear(h, layer.wqkv, layer.bqkv).split([n_qk * c.head_dim, c.n_head_kv * c.head_dim_v], dim=-1)
        qk = qk.unflatten(-1, (n_qk, c.head_dim))  # (B,S,H+Hkv,D): q heads then k heads, normed and rotated together
        if layer.qk_norm is not None:  # qwen3: RMSNorm over each head, before RoPE
            qk = self._rms(qk, None) * layer.qk_norm
        qk = self._rope(qk, cs)
        return qk[:, :, :c.n_head], qk[:, :, c.n_head:], v.unflatten(-1, (c.n_head_kv, c.head_dim_v))

    def _block(self, layer: Layer, x: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor], cs: Tensor) -> Tensor:
        """One pre-norm decoder layer; `attend` takes q, k, v (B,S,heads,D) and returns (B,S,H·Dv)."""
        x = x + F.linear(attend(*self._qkv(layer, self._rms(x, layer.attn_norm), cs)), layer.wo, layer.bo)
        gate, up = F.linear(self._rms(x, layer.ffn_norm), layer.w13, layer.b13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.w2, layer.b2)

    def _head(self, x: Tensor) -> Tensor:
        return F.linear(self._rms(x, self.output_norm), self.output, self.output_bias)

    def prefill(self, tokens: Tensor, cache: KVCache, slot: int, all_logits: bool = False) -> Tensor:
        """A new sequence of S tokens (S,) into cache row `slot`: logits (V,) of the last token, or (S, V)."""
        s = tokens.shape[0]
        cs = self.rope[:s, None]  # (S,1,D/2,2): broadcast over B=1 and heads
        x = F.embedding(tokens[None], self.token_embd)  # (1,S,E)
        for i, layer in enumerate(self.layers):
            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (1,heads,S,D)
                cache.k[i][slot, :, :s] = k[0]
                cache.v[i][slot, :, :s] = v[0]
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.config.q_scale,
                                                     enable_gqa=True)  # (1,H,S,Dv)
                return out.transpose(1, 2).reshape(1, s, -1)

            x = self._block(layer, x, attend, cs)
        return self._head(x[0] if all_logits else x[0, -1])

    def decode(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """One token per sequence: tokens, positions (B,) on the device → logits (B, V). No host syncs (graphable)."""
        c = self.config
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        cs = self.rope[positions][:, None, None]  # (B,1,1,D/2,2)
        # additive mask (B,1,1,L): sequence b sees cache slots 0..positions[b]; the rest hold stale or zero rows
        hidden = cache.key_pos[None] > positions[:, None]  # (B,L)
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
        mask = mask[:, None, None]
        x = F.embedding(tokens[:, None], self.token_embd)  # (B,1,E)
        for i, layer in enumerate(self.layers):
            def attend(q: Tensor, k: Tensor, v: Tensor, i: int = i) -> Tensor:
                cache.k[i][rows, :, positions] = k[:, 0]  # (B,Hkv,D) into slot positions[b] of row b
                cache.v[i][rows, :, positions] = v[:, 0]
                # GQA without repeating the cache: the n_rep query heads of one kv head are that head's "queries".
                # torch picks cuDNN's attention on the H200: in the graph it beat mem-efficient (1.80 vs 2.59 ms a
                # step, SmolLM2 shape, batch 1) and the math path (2.81 ms).
                qg = q.reshape(b, c.n_head_kv, c.n_rep, c.head_dim)  # (B,Hkv,rep,D); head h reads kv h // rep
                out = F.scaled_dot_product_attention(qg, cache.k[i], cache.v[i], attn_mask=mask,
                                                     scale=c.q_scale)  # (B,Hkv,rep,Dv)
                return out.reshape(b, 1, c.n_head * c.head_dim_v)

            x = self._block(layer, x, attend, cs)
        return self._head(x[:, 0])


class DecodeStep:
    """The whole batch's decode step with static buffers: tokens, positions → logits; then the greedy tokens and
    positions + 1 are written back into the inputs, so consecutive steps generate with no host in the loop.
    On CUDA the step is captured once as one CUDA graph (graph=True) and each step() is a replay.

    Build it before prefilling into `cache`: capturing runs the step on dummy inputs, so it clears the cache."""

    def __init__(self, model: Transformer, cache: KVCache, graph: bool = True, compile: bool = False):
        self.model, self.cache = model, cache
        dev = model.device
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(cache.batch, dtype=torch.long, device=dev)
        self.logits = torch.zeros(cache.batch, model.config.n_vocab, dtype=model.dtype, device=dev)
        self._decode = torch.compile(model.decode, fullgraph=True, dynamic=False) if compile else model.decode
        self._run = cuda_graph(self._step) if graph else self._step
        cache.clear()

    def _step(self) -> None:
        self.logits.copy_(self._decode(self.tokens, self.positions, self.cache))
        self.tokens.copy_(self.logits.argmax(dim=-1))
        self.positions.add_(1)

    def start(self, tokens: Tensor | list[int], positions: Tensor | list[int]) -> None:
        """Set the next input token and its position (= tokens already in the cache) of every sequence."""
        self.tokens.copy_(torch.as_tensor(tokens))
        self.positions.copy_(torch.as_tensor(positions))

    def step(self) -> Tensor:
        self._run()
        return self.logits


def cuda_graph(fn: Callable[[], None], warmup: int = 3) -> Callable[[], None]:
    """fn captured as one CUDA graph; returns its replay. Warm-up runs on a side stream first (torch's CUDA-graph
    recipe), so cuBLAS handles and workspaces are allocated outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# --- the benchmark ---------------------------------------------------------------------------------------------------
def cuda_times(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeat` calls after warm-up, timed as luce-compile is (luce_runtime.timing: host
    wall-clock, the GPU synchronized before and after each call), so the table compares engines, not timers."""
    return call_times(fn, repeat, warmup, sync=torch.cuda.synchronize)


def device_bandwidth_gb_s(n_bytes: int = 2 << 30, repeat: int = 10) -> float:
    """A device-to-device copy of 2 GiB (far past the 60 MB L2): read + write bytes per second, median."""
    src = torch.ones(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = statistics.median(cuda_times(lambda: dst.copy_(src), repeat))
    return 2 * n_bytes / seconds / 1e9


def bench_prefill(model: Transformer, prompt_lens: tuple[int, ...], repeat: int,
                  rng: np.random.Generator) -> dict[str, dict[str, float]]:
    """Prefill tok/s per prompt length: eager (as gpt-fast runs it) and as one replayed CUDA graph (no launch cost)."""
    cache = KVCache.allocate(model.config, 1, max(prompt_lens), model.device, model.dtype)
    out: dict[str, dict[str, float]] = {"prefill_tok_s": {}, "prefill_eager_tok_s": {}, "prefill_ms": {}}
    for n in prompt_lens:
        tokens = torch.from_numpy(rng.integers(0, model.config.n_vocab, n)).to(model.device)
        eager = statistics.median(cuda_times(lambda t=tokens: model.prefill(t, cache, 0), repeat))
        logits = torch.empty(model.config.n_vocab, dtype=model.dtype, device=model.device)
        replay = cuda_graph(lambda t=tokens, o=logits: o.copy_(model.prefill(t, cache, 0)), warmup=1)
        graphed = statistics.median(cuda_times(replay, repeat))
        out["prefill_eager_tok_s"][str(n)] = n / eager
        out["prefill_tok_s"][str(n)] = n / min(graphed, eager)  # the peer at its best
        out["prefill_ms"][str(n)] = min(graphed, eager) * 1e3
        del replay
        torch.cuda.empty_cache()
    return out


def bench_decode(model: Transformer, batch: int, prompt_len: int, gen_len: int, rng: np.random.Generator,
                 compile: bool = False) -> float:
    """Median seconds per replayed decode step of `batch` sequences after prompt_len-token prompts."""
    warmup = 3
    cache = KVCache.allocate(model.config, batch, prompt_len + gen_len + warmup + 1, model.device, model.dtype)
    step = DecodeStep(model, cache, graph=True, compile=compile)
    first = []
    for b in range(batch):
        prompt = torch.from_numpy(rng.integers(0, model.config.n_vocab, prompt_len)).to(model.device)
        first.append(model.prefill(prompt, cache, b).argmax())
    step.start(torch.stack(first), [prompt_len] * batch)
    times = cuda_times(step.step, gen_len, warmup=warmup)
    return statistics.median(times)


def bench(gguf_path: str | Path, *, prompt_lens: tuple[int, ...] = (512, 2048), gen_len: int = 128,
          batches: tuple[int, ...] = (1, 8), repeat: int = 5, device: str = "cuda", decode_prompt_len: int = 512,
          seed: int = 0, compile: bool = False) -> dict[str, Any]:
    """Prefill tok/s per prompt length, decode tok/s per batch, bandwidth, roofline: one JSON-able dict."""
    if not (str(device).startswith("cuda") and torch.cuda.is_available()):
        raise RuntimeError(f"torch peer: bench() synchronizes CUDA and replays CUDA graphs, but device={device!r} "
                           f"(CUDA available: {torch.cuda.is_available()}); run it on the GPU machine.")
    torch.manual_seed(seed)
    start = time.perf_counter()
    max_seq = max(*prompt_lens, decode_prompt_len + gen_len + 8)
    model = Transformer(gguf_path, device=device, dtype=torch.bfloat16, max_seq=max_seq + SEQ_ALIGN)
    load_s = time.perf_counter() - start
    bandwidth = device_bandwidth_gb_s()
    torch.cuda.empty_cache()  # give the copy's 4 GiB back before the caches are allocated
    weight_bytes = model.weight_bytes_per_token()
    # the cross-check prompt is bench_engine's first one (default_rng(seed).integers(0, vocab, len)), so the greedy
    # token can be compared with luce-compile's and llama.cpp's on the same ids
    prompt = np.random.default_rng(seed).integers(0, model.config.n_vocab, decode_prompt_len)
    cache = KVCache.allocate(model.config, 1, decode_prompt_len, model.device, model.dtype)
    first_token = int(model.prefill(torch.from_numpy(prompt).to(model.device), cache, 0).argmax())
    del cache
    rng = np.random.default_rng(seed + 1)
    result: dict[str, Any] = bench_prefill(model, tuple(prompt_lens), repeat, rng)
    steps = {b: bench_decode(model, b, decode_prompt_len, gen_len, rng, compile) for b in batches}
    roof = roofline_tok_s(bandwidth, weight_bytes)
    decode_1 = 1 / steps[1] if 1 in steps else None
    return result | {
        "name": "torch", "model": Path(gguf_path).name, "arch": model.config.arch, "dtype": "bfloat16",
        "decode_tok_s": {str(b): b / s for b, s in steps.items()},
        "decode_step_ms": {str(b): s * 1e3 for b, s in steps.items()},  # = ms per token of each sequence
        "bandwidth_gb_s": bandwidth, "weight_bytes_per_token": weight_bytes, "roofline_tok_s": roof,
        "roofline_fraction": decode_1 and decode_1 / roof, "achieved_gb_s": decode_1 and decode_1 * weight_bytes / 1e9,
        "first_token": first_token, "first_token_prompt": {"seed": seed, "len": decode_prompt_len},
        "prompt_lens": list(prompt_lens), "gen_len": gen_len, "batches": list(batches), "repeat": repeat,
        "decode_prompt_len": decode_prompt_len, "cuda_graph": True, "compile": compile, "load_s": load_s,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "gpu": torch.cuda.get_device_name(torch.device(device))},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="gpt-fast-style torch peer on a GGUF (bf16, static KV, CUDA graphs).")
    p.add_argument("gguf", type=Path)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--decode-prompt-len", type=int, default=512, help="prompt before the timed decode steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step before capture (slow start)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = bench(args.gguf, prompt_lens=tuple(args.prompt_lens), gen_len=args.gen_len, batches=tuple(args.batches),
                   repeat=args.repeat, decode_prompt_len=args.decode_prompt_len, compile=args.compile)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
