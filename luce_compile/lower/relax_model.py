"""Lower a Graph to a Relax module: one nn.Module that interprets the graph's ops, and TVM's paged KV cache.

The module exports four functions, the runtime's whole contract (luce_runtime/contract.py: names, argument order,
version; the manifest's "runtime" section records it):
  create_kv_cache(max_batch, max_total_len, prefill_chunk, page_size, support_sliding) → PagedKVCache
  prefill(tokens (1, S) int32, logit_rows (N,) int32, kv, params) → (logits (N, V) f32, kv)
      S tokens of one or several sequences laid end to end (the cache's begin_forward says which); logits only for
      the rows asked (the last token of each sequence in a prefill; every token in a verify).
  decode(tokens (B, 1) int32, kv, params) → (logits (B, V) f32, kv): one token for each of B sequences.
  decode1(tokens (1, 1) int32, kv, params): the same for one sequence, with GEMV kernels (batch-1 latency).
  verify(tokens (1, S) int32, kv, params) → (logits (S, V) f32, kv): only where decode takes 8-bit activations
      (precision int8): prefill's graph with every row's logits, its matmuls decode's integer ones, so speculative
      drafts are judged with decode's arithmetic and at its per-row cost. Under int8 prefill's own matmuls are
      integer too (issue 13: 8-bit activations for every row count, as llama.cpp's prompt processing).
Weights are parameters in the planes layout of `lower/quant_layout.py` (never dequantized in memory); each matmul
and the embedding are our fused dequantizing TIR kernels; attention and RoPE'd keys live in TIRPagedKVCache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod

import tvm
from luce_runtime.contract import KV_PAGES_PROBE, REQUIRED_FUNCTIONS, Fn, KVCacheArgs
from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op, spec
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.reader import TensorInfo
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, YARN_ATTRS, Graph, Op, OpKind
from luce_compile.lower.attention_sinks import check_sinks, kv_head_dim, pad_with_sinks
from luce_compile.lower.cpu_int8 import int8_linear, resolve_precision
from luce_compile.lower.kv_cache import kv_cache_dtype
from luce_compile.lower.kv_layers import cache_layers
from luce_compile.lower.moe import check_target, lower_moe
from luce_compile.lower.q8_gemm import is_q8_gemm, q8_gemm_format, q8_gemm_matmul, scratch_tensors
from luce_compile.lower.quant_layout import plane_specs
from luce_compile.lower.quant_matmul import quant_embedding, quant_matmul, with_tensor_core_twin
from luce_compile.lower.rope import rope_func

PLANE_SEP = "::"
OPAQUE = 8  # relax.OpPatternKind.kOpaque  # parameter name = GGUF tensor name + "::" + plane name


def param_name(tensor: str, plane: str) -> str:
    return f"{tensor}{PLANE_SEP}{plane}"


@dataclass(frozen=True)
class LowerOptions:
    dtype: str = "float32"  # activations
    kv_cache: str = "f32"  # the KV cache's type: --kv-cache (lower/kv_cache.py)
    # matmuls of the types in cpu_int8.INT8_FORMATS (decode, verify and prefill): "int8" quantizes activations to
    # 8 bits as llama.cpp does and uses integer dot products (lower/cpu_int8.py); "f32" keeps the exact float32
    # kernels (for checks); "auto" is int8 on CPUs with AVX512-VNNI, else f32. compile_model resolves it (auto by
    # default); lowering on its own stays exact: int8 differs from the plain float64 oracle by the activation
    # rounding (~2e-2 of the logits).
    precision: str = "f32"
    # the prompt's attention on CUDA with precision f16 (prefill_attention_kernels): "flash" (the mma.sync kernels of
    # schedules/gpu/flash_prefill.py, ragged and paged; on the H100 4.4-7.8x the WMMA kernel's speed at 2K-32K
    # tokens, benchmarks/README.md) or "wmma" (attention_prefill.py's, ragged only, the earlier kernel); head dims
    # flash does not take fall back to wmma. The manifest's kernels.prefill_attention records the choice
    prefill_attention: str = "flash"
    # a model with sliding-window layers gets the cache layout through which the runtime's page probe reads its
    # pages (lower/kv_layers.py): what its megakernels need (compile_model's sliding_megakernel)
    probe_sliding_pages: bool = False
    # the matmuls of more than 8 rows on CUDA with precision f16 (prefill, verify): "f16" (schedules/gpu/mma_gemm.py,
    # float16 operands) or "q8" (mmq_gemm.py: llama.cpp's 8-bit activations on integer tensor cores, for the weight
    # types of lower/q8_gemm.py; compile_model's default on CUDA); the manifest's kernels.prefill_gemm records it.
    # Lowering on its own stays float16, as precision stays exact
    prefill_gemm: str = "f16"


def weight_specs(info: TensorInfo) -> dict[str, tuple[tuple[int, ...], str]]:
    """The parameters one GGUF tensor becomes: the planes of a matrix, or a 1-D vector (norms, biases) as is."""
    if len(info.shape) == 1:
        if info.ggml_type.name not in ("F32", "F16", "BF16"):
            raise UnsupportedError(f"lower: 1-D tensor {info.name} is {info.ggml_type.name}; norm and bias vectors "
                                   "must be F32, F16 or BF16 (re-export the model with llama.cpp's converter).")
        # BF16 vectors are widened to F32 when repacked (exact): the graph uses them as activation-dtype values
        dtype = {"F32": "float32", "F16": "float16", "BF16": "float32"}[info.ggml_type.name]
        return {"w": (info.shape, dtype)}
    # a stacked expert tensor (expert, out, in) is its experts' rows one after another (lower/moe.py)
    return plane_specs(info.ggml_type, prod(info.shape[:-1]), info.shape[-1])


class GraphModule(nn.Module):
    """The graph as an nn.Module: parameters are the weight planes, `_forward` walks the ops in order."""

    def __init__(self, graph: Graph, target: tvm.target.Target, options: LowerOptions = LowerOptions()):
        self.graph, self.target, self.options = graph, target, options
        self.planes: dict[str, list[str]] = {}
        params = {}
        for name, info in graph.weights.items():
            specs = weight_specs(info)
            self.planes[name] = list(specs)
            for plane, (shape, dtype) in specs.items():
                params[param_name(name, plane)] = nn.Parameter(shape, dtype)
        self.params = nn.ParameterDict(params)
        self._kernels: dict[tuple, tirx.PrimFunc] = {}
        self.precision = resolve_precision(options.precision, target)  # "auto" resolved (and logged) once
        self.kv_dtype = kv_cache_dtype(options.kv_cache)
        self.cache_layers = cache_layers(graph.config, options.probe_sliding_pages)
        self._quantized: dict = {}  # inputs already quantized to 8 bits (int8_linear's cache)

    # ---- exported functions -------------------------------------------------------------------------------------
    def create_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var, prefill_chunk_size: tirx.Var,
                        page_size: tirx.Var, support_sliding_window: tirx.Var) -> PagedKVCache:
        # the argument names and order are KVCacheArgs' (export_spec builds the signature from it)
        c = self.graph.config
        layers = self.cache_layers  # the model's layers are the cache's [first, first + n_layer) (kv_layers.py)
        head = kv_head_dim(c)  # the head's row in the cache: wider where it carries attention sinks
        with prefill_attention_tiles(self.target, c.head_dim, self.kv_dtype), \
                tensor_core_prefill_attention(self.target, self.precision, self.options.prefill_attention,
                                              c.head_dim if c.attn_sinks else None), \
                kv_pages_probe(), \
                cpu_attention(self.target, c.head_dim if c.attn_sinks else None, c.attn_sinks):
            return TIRPagedKVCache(
                attn_kind=list(layers.kinds), max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size, page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_partition=relax.ShapeExpr([layers.first, layers.first + c.n_layer]),
                num_hidden_layers=len(layers.kinds), num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv,
                qk_head_dim=head, v_head_dim=head if c.attn_sinks else c.head_dim_v, mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                # RoPE is the graph's own op (both layouts, per-layer bases): the cache stores keys already rotated.
                rope_mode=RopeMode.NONE, rope_scale=1, rope_theta=int(c.rope_base), rope_scaling={},
                rope_ext_factors=relax.prim_value(0), rotary_dim=c.rope_dim, enable_disaggregation=False,
                dtype=self.kv_dtype, target=self.target, layer_sliding_window_size=c.sliding_window or 1024,
            )

    def prefill(self, tokens: nn.Tensor, logit_rows: nn.Tensor, kv: PagedKVCache):
        return self._forward(tokens, kv, logit_rows), kv

    def decode(self, tokens: nn.Tensor, kv: PagedKVCache):
        return self._forward(tokens, kv, None), kv

    def decode1(self, tokens: nn.Tensor, kv: PagedKVCache):
        """decode for exactly one sequence: static shapes, so every matmul is a GEMV."""
        return self._forward(tokens, kv, None), kv

    def verify(self, tokens: nn.Tensor, kv: PagedKVCache):
        """prefill with every row's logits (under int8 prefill's matmuls are the integer ones too: cpu_int8)."""
        return self._forward(tokens, kv, None), kv

    # ---- the interpreter ----------------------------------------------------------------------------------------
    def _forward(self, tokens: nn.Tensor, kv: PagedKVCache, logit_rows: nn.Tensor | None) -> nn.Tensor:
        b, s = tokens.shape
        positions = op.reshape(kv.get_query_positions(b * s), (b, s))
        env: dict[str, nn.Tensor] = {TOKENS: tokens, POSITIONS: positions}
        for o in self.graph.ops:
            lower = _LOWER.get(o.kind)
            if lower is None:
                raise UnsupportedError(f"lower: op kind {o.kind} has no lowering yet.")
            env[o.outputs[0]] = lower(self, o, [env[i] for i in o.inputs], kv=kv, logit_rows=logit_rows)
        logits = env[LOGITS]
        return op.reshape(logits, (-1, logits.shape[-1])) if len(logits.shape) == 3 else logits

    def _kernel(self, key: tuple, make: Callable[[], tirx.PrimFunc]) -> tirx.PrimFunc:
        """Our hand-defined kernels, made once per shape. Marked opaque so that Relax's FuseOps leaves them whole:
        the schedule rules recognize them as written (fusing a bias or residual add in is a later optimisation)."""
        if key not in self._kernels:
            self._kernels[key] = make().with_attr("op_pattern", OPAQUE)
        return self._kernels[key]

    def _planes(self, tensor: str) -> list[nn.Tensor]:
        return [self.params[param_name(tensor, p)] for p in self.planes[tensor]]

    def linear(self, x: nn.Tensor, tensor: str, bias: str | None) -> nn.Tensor:
        """x (..., K) @ W.T (+ bias) with W read in its quantized planes by a fused dequantizing kernel."""
        info = self.graph.weights[tensor]
        n, k = info.shape
        lead = x.shape[:-1]
        x2 = op.reshape(x, (-1, k))
        # one row known at compile time (decode1) → the GEMV kernel and schedule; else the dynamic-batch GEMM
        batch = 1 if isinstance(x2.shape[0], int) and x2.shape[0] == 1 else "dynamic"
        kind = "gemv" if batch == 1 else "gemm"
        func = self._kernel(("mm", info.ggml_type, n, k, batch), lambda: self._matmul_func(info, n, k, batch, kind))
        out = nn.Tensor.placeholder((x2.shape[0], n), self.options.dtype)
        scratch = q8_gemm_scratch(func, info, k, x2.shape[0])
        y = op.tensor_ir_op(func, func.attrs["global_symbol"], [x2, *self._planes(tensor)],
                            [out, *scratch] if scratch else out)
        y = y[0] if scratch else y
        if bias is not None:
            y = y + self._vector(bias)
        return op.reshape(y, (*lead, n))

    def _matmul_func(self, info: TensorInfo, n: int, k: int, batch: int | str, kind: str) -> tirx.PrimFunc:
        dtype, name = self.options.dtype, f"{kind}_{info.ggml_type.name.lower()}_{n}x{k}"
        tensor_cores = self.precision == "f16" and batch == "dynamic"  # many rows (precision f16, CUDA)
        if tensor_cores and self.options.prefill_gemm == "q8" and dtype == "float32" and q8_gemm_format(info.ggml_type):
            return q8_gemm_matmul(info.ggml_type, n, k, name=name)
        func = quant_matmul(info.ggml_type, n, k, batch=batch, x_dtype=dtype, out_dtype=dtype, name=name)
        if tensor_cores:
            func = with_tensor_core_twin(func, info.ggml_type, n, k, x_dtype=dtype, out_dtype=dtype)
        return func

    def _vector(self, tensor: str) -> nn.Tensor:
        """A 1-D F32/F16 weight (norms, biases) as an activation-dtype vector."""
        (plane,) = self._planes(tensor)
        return plane if plane.dtype == self.options.dtype else op.astype(plane, self.options.dtype)


# TVM's GPU prefill-attention kernels (relax/frontend/nn/llm/_prefill_kernels.py) size their tiles for 2-byte
# caches: with our float32 cache they take 16 queries × 16 keys a block, ~1.6 TFLOPS on the H200, 80% of a
# 2048-token prefill of Llama-1B (ncu, 2026-12-01). Larger tiles, measured there (Llama-1B body, head dim 64,
# tuned tensor-core GEMMs, tok/s at 512 / 2048 tokens): 16×16 22.6k / 9.6k, 32×32 30.0k / 14.8k, 64×16 32.9k /
# 19.4k, 64×32 33.9k / 19.7k. The kernels keep their tiles in static shared memory (48 KiB): the largest that fits
# the head dimension is taken, in that order.
PREFILL_TILES = ((64, 32), (64, 16), (32, 32), (32, 16), (16, 16))  # (queries, keys) per block, best first
STATIC_SHARED_BYTES = 44 * 1024  # the 48 KiB static limit, less the kernels' small per-row arrays


def prefill_tiles(head_dim: int, dtype: str) -> tuple[int, int] | None:
    """The largest measured tile whose Q, K and V tiles and score tile fit static shared memory; None when none
    does (head dim 256 in float32: TVM's own 8×8 stays)."""
    size = 2 if dtype == "float16" else 4
    for queries, keys in PREFILL_TILES:
        if size * (queries * head_dim + 2 * keys * head_dim) + 4 * queries * keys <= STATIC_SHARED_BYTES:
            return queries, keys
    return None


@contextlib.contextmanager
def swapped(module: object, **replacements: object) -> Iterator[None]:
    """TIRPagedKVCache takes none of its kernels or tile heuristics as a parameter: the module attributes it calls
    are replaced for the duration and restored, whatever happens (the swaps below)."""
    originals = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)


@contextlib.contextmanager
def prefill_attention_tiles(target: tvm.target.Target, head_dim: int, dtype: str) -> Iterator[None]:
    """While TIRPagedKVCache builds its kernels, TVM's prefill tile heuristic answers with prefill_tiles (CUDA
    only: nothing was measured on ROCm), its config function swapped."""
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    tiles = prefill_tiles(head_dim, dtype)
    if target.kind.name != "cuda" or tiles is None:
        yield
        return
    original = _prefill_kernels._get_prefill_kernel_config
    queries, keys = tiles

    def config(h_kv, h_q, d, kv_dtype, tgt, **kwargs):  # noqa: ANN001, ANN003  (TVM's signature)
        num_blocks, load_vec, group_size, bdx, num_warps, _, _, _ = original(h_kv, h_q, d, kv_dtype, tgt, **kwargs)
        tile_y = d  # the output tile's width: a multiple of the head dimension that the threads divide evenly
        while (queries * tile_y) % (bdx * num_warps):
            tile_y += d
        return num_blocks, load_vec, group_size, bdx, num_warps, queries, tile_y, keys

    with swapped(_prefill_kernels, _get_prefill_kernel_config=config):
        yield


PREFILL_ATTENTION = ("flash", "wmma")


def q8_gemm_scratch(func: tirx.PrimFunc, info: TensorInfo, k: int, rows) -> list[nn.Tensor]:
    """The 8-bit GEMM's scratch outputs (its quantized input, lower/q8_gemm.py) where func is one, else []."""
    if not is_q8_gemm(func):
        return []
    return scratch_tensors(info.ggml_type, k, rows)


def prefill_attention_kernels(target: tvm.target.Target, precision: str, choice: str, head_dim: int, head_dim_v: int,
                              dtype: str, page_size: int = 16) -> dict[str, str]:
    """Which kernel serves a prompt's attention: "ragged" (a prefill from an empty cache) and "paged" (a later chunk
    against its cached pages; sliding-window layers keep TVM's), each "flash 8x64" (flash_prefill.py, warps x keys),
    "wmma 4x32" (attention_prefill.py) or "tvm" (TVM's SIMT kernels). CUDA with precision f16 only."""
    from luce_schedules.gpu import attention_prefill, flash_prefill

    if choice not in PREFILL_ATTENTION:
        raise ValueError(f"lower: prefill attention {choice!r} is not one of {PREFILL_ATTENTION}")
    if target.kind.name != "cuda" or precision != "f16":
        return {"ragged": "tvm", "paged": "tvm"}
    if choice == "flash" and flash_prefill.supports(head_dim, head_dim_v, dtype):
        tile = flash_prefill.default_tile(head_dim, head_dim_v)
        paged = "tvm" if head_dim != head_dim_v else f"flash {tile.warps}x{tile.keys}"
        return {"ragged": f"flash {tile.warps}x{tile.keys}", "paged": paged}
    if attention_prefill.supports(head_dim, head_dim_v, dtype):
        tile = attention_prefill.default_tile(head_dim, head_dim_v)
        return {"ragged": f"wmma {tile.warps}x{tile.keys}", "paged": "tvm"}
    return {"ragged": "tvm", "paged": "tvm"}


def decode_attention_kernel(target: tvm.target.Target, precision: str, sinks: bool, group: int, head_dim: int,
                            dtype: str) -> str:
    """Which kernel serves the per-op path's decode attention: "flash 1x128/8" (flash_prefill.paged_decode, row warps x
    keys a step / warps sharing them: CUDA's for attention sinks), "cpu" (schedules/cpu/attention_decode.py) or
    "tvm"."""
    from luce_schedules.cpu.attention_prefill import supports
    from luce_schedules.gpu import flash_prefill

    if target.kind.name == "llvm":
        return "cpu" if supports(head_dim, head_dim, dtype) else "tvm"
    if sinks and target.kind.name == "cuda" and precision == "f16":
        tile = flash_prefill.decode_tile(group, head_dim)
        return f"flash {tile.warps}x{tile.keys}/{tile.splits}"
    return "tvm"


@contextlib.contextmanager
def tensor_core_prefill_attention(target: tvm.target.Target, precision: str, choice: str = "flash",
                                  d_att: int | None = None) -> Iterator[None]:
    """With precision f16 on CUDA, the cache's prefill kernels are ours, as prefill_attention_kernels says: the
    ragged one (a prefill from an empty cache: all of pp512/pp2048's attention) and, with "flash", the paged one (every
    later chunk of a long prompt; issue 38: on tensor cores at every chunk). The factories are swapped; what ours do
    not take keeps TVM's. WMMA's was 7-49x TVM's at 2048 tokens on the H200 (benchmarks/results/h200/
    2026-12-01-attention.md). `d_att`: the rows carry attention sinks after the head's d_att columns
    (attention_sinks.py): the ragged and decode kernels are flash_prefill.py's, which fold them in (check_sinks
    refused any build where they cannot be)."""
    from luce_schedules.gpu import attention_prefill, flash_prefill
    from tvm.relax.frontend.nn.llm import kv_cache

    from luce_compile.targets import facts_for

    if target.kind.name != "cuda" or precision != "f16":
        yield
        return
    ragged_tvm, paged_tvm = kv_cache._attention_prefill_ragged, kv_cache._attention_prefill
    sm_count = int(facts_for(target).get("sm_count", 0)) or 132  # the registry's; an unknown arch: an H100/H200's

    def ragged(h_kv, h_q, d_qk, d_v, dtype, rope_scaling, tgt):  # noqa: ANN001, ANN202  (TVM's signature)
        kind = prefill_attention_kernels(target, precision, choice, d_qk, d_v, dtype)["ragged"]
        if kind.startswith("flash") or d_att is not None:
            return flash_prefill.ragged_prefill(h_kv, h_q, d_qk, d_v, dtype, d_att=d_att)
        if kind.startswith("wmma"):
            return attention_prefill.ragged_prefill(h_kv, h_q, d_qk, d_v, dtype,
                                                    tile=attention_prefill.default_tile(d_qk, d_v), sm_count=sm_count)
        return ragged_tvm(h_kv, h_q, d_qk, d_v, dtype, rope_scaling, tgt)

    def paged(h_kv, h_q, d, dtype, sliding_window, rope_scaling, tgt, page_size=16, sliding_window_size=1024):  # noqa: ANN001, ANN202
        kind = prefill_attention_kernels(target, precision, choice, d, d, dtype)["paged"]
        if kind.startswith("flash") and not sliding_window:
            return flash_prefill.paged_prefill(h_kv, h_q, d, dtype, page_size=page_size)
        return paged_tvm(h_kv, h_q, d, dtype, sliding_window, rope_scaling, tgt, page_size, sliding_window_size)

    def decode(h_kv, h_q, d, dtype, sliding_window, rope_scaling, tgt, page_size=16):  # noqa: ANN001, ANN202
        return flash_prefill.paged_decode(h_kv, h_q, d, dtype, sliding_window, page_size=page_size, d_att=d_att)

    factories = {"_attention_prefill_ragged": ragged, "_attention_prefill": paged}
    if d_att is not None:  # TVM's decode kernel (the models without sinks keep it) has no sink term
        factories["_attention_decode"] = decode
    with swapped(kv_cache, **factories):
        yield


@contextlib.contextmanager
def cpu_attention(target: tvm.target.Target, d_att: int | None = None, sinks: bool = False) -> Iterator[None]:
    """On the CPU (llvm), the cache's attention kernels are schedules/cpu's: parallel and vectorized where TVM's run
    on one thread, scalar. Prefill (attention_prefill.py; benchmarks/README.md, issue 13: pp512 3.2x on SmolLM2 and
    Qwen3-0.6B; 5.6x for SmolLM2's 2048 tokens in 512-token chunks): the ragged kernel takes a prompt's own tokens,
    the paged ones (plain and sliding-window) a cached prefix. Decode (attention_decode.py): one token a sequence
    against its pages. Swapped as tensor_core_prefill_attention swaps CUDA's; a dtype or head size they do not take
    keeps TVM's. `d_att`, `sinks`: the cache's rows carry attention sinks after d_att columns (attention_sinks.py);
    the kernels then must be ours (the check refuses before anything is built)."""
    from luce_schedules.cpu.attention_decode import paged_decode_cpu
    from luce_schedules.cpu.attention_prefill import paged_prefill_cpu, ragged_prefill_cpu, supports
    from tvm.relax.frontend.nn.llm import kv_cache

    if target.kind.name != "llvm":
        yield
        return
    originals = kv_cache._attention_prefill_ragged_cpu, kv_cache._attention_prefill_cpu, kv_cache._attention_decode_cpu

    def ours(d: int, dtype: str) -> bool:
        if sinks and not supports(d, d, dtype):
            raise UnsupportedError(f"lower: attention sinks need luce-compile's CPU attention kernels, which do not "
                                   f"take head size {d} in {dtype}.")
        return supports(d, d, dtype)

    def ragged(h_kv, h_q, d_qk, d_v, dtype, rope_scaling):  # noqa: ANN001, ANN202  (TVM's signature)
        if d_qk != d_v or not ours(d_qk, dtype):
            return originals[0](h_kv, h_q, d_qk, d_v, dtype, rope_scaling)
        return ragged_prefill_cpu(h_kv, h_q, d_qk, dtype=dtype, d_att=d_att, sink=sinks)

    def paged(h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=16, sliding_window_size=1024):  # noqa: ANN001, ANN202
        if not ours(d, dtype):
            return originals[1](h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size, sliding_window_size)
        return paged_prefill_cpu(h_kv, h_q, d, sliding_window, page_size, sliding_window_size, dtype=dtype,
                                 d_att=d_att)

    def decode(h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size=16):  # noqa: ANN001, ANN202
        if not ours(d, dtype):
            return originals[2](h_kv, h_q, d, dtype, sliding_window, rope_scaling, page_size)
        return paged_decode_cpu(h_kv, h_q, d, sliding_window, page_size, dtype=dtype, d_att=d_att, sink=sinks)

    # TVM's llvm branch passes its two tree-attention kernels in the other order than the runtime takes them (paged
    # first, as the CUDA branch does): "Expected 16 arguments ... tree_attn_paged_kv_cpu" at a tree verify
    # (notes/tvm-0.27.md). Each factory swapped for the other puts them where the runtime calls them.
    with swapped(kv_cache, _attention_prefill_ragged_cpu=ragged, _attention_prefill_cpu=paged,
                 _attention_decode_cpu=decode, tree_attn_cpu=kv_cache.tree_attn_with_paged_kv_cache_cpu,
                 tree_attn_with_paged_kv_cache_cpu=kv_cache.tree_attn_cpu):
        yield


def prefill_applies_window(target: tvm.target.Target, head_dim: int, head_dim_v: int, dtype: str,
                           sinks: bool) -> bool:
    """Whether the cache's prefill over cached keys applies sliding windows, so that prompts past a window may go in
    chunks (the runtime contract's sliding_prefill_chunks; else a token a call past the window). On the CPU:
    cpu_attention's kernel, for a head size and cache dtype it takes. On CUDA: checked on the H100 for Gemma 3
    (scripts/device_check.py window_prefill, 2026-12-07: chunks past the window equal a token a call within the f16
    build's tolerance, ids equal); not yet with attention sinks (gpt-oss), whose check waits for a device."""
    from luce_schedules.cpu.attention_prefill import supports

    if target.kind.name == "cuda":
        return not sinks
    return target.kind.name == "llvm" and supports(head_dim, head_dim_v, dtype)


@contextlib.contextmanager
def kv_pages_probe() -> Iterator[None]:
    """The cache's debug_get_kv becomes the runtime's KV_PAGES_PROBE (luce_runtime.contract says why): an extern
    function the VM looks up by name when it loads the module (the factory swapped)."""
    from tvm.relax.frontend.nn.llm import kv_cache

    with swapped(kv_cache, _kv_cache_debug_get_kv=lambda *_args: relax.ExternFunc(KV_PAGES_PROBE)):
        yield


def _embedding(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    tokens = ins[0]
    b, s = tokens.shape
    tensor = o.weights["weight"]
    info = m.graph.weights[tensor]
    v, e = info.shape
    func = m._kernel(("embed", info.ggml_type, v, e), lambda: quant_embedding(
        info.ggml_type, v, e, out_dtype=m.options.dtype, name=f"embed_{info.ggml_type.name.lower()}_{v}x{e}"))
    flat = op.reshape(tokens, (b * s,))
    out = nn.Tensor.placeholder((b * s, e), m.options.dtype)
    x = op.tensor_ir_op(func, func.attrs["global_symbol"], [flat, *m._planes(tensor)], out)
    x = op.reshape(x, (b, s, e))
    return x * o.attrs["scale"] if o.attrs.get("scale", 1.0) != 1.0 else x


def _rms_norm(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    return op.rms_norm(ins[0], m._vector(o.weights["weight"]), axes=-1, epsilon=o.attrs["eps"])


def _matmul(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    return _linear(m, ins[0], o.weights["weight"], o.weights.get("bias"))


def _linear(m: GraphModule, x: nn.Tensor, tensor: str, bias: str | None) -> nn.Tensor:
    """The integer-dot GEMV where the precision asks for it and applies (cpu_int8.int8_linear), else m.linear."""
    if m.precision == "int8":
        y = int8_linear(m, x, tensor, m._quantized)
        if y is not None:
            return y + m._vector(bias) if bias is not None else y
    return m.linear(x, tensor, bias)


def _lm_head(m: GraphModule, o: Op, ins: list, logit_rows: nn.Tensor | None, **_) -> nn.Tensor:
    x = ins[0]
    x = op.reshape(x, (-1, x.shape[-1]))  # (B·S, E)
    if logit_rows is not None:  # prefill/verify: only the rows whose logits are wanted reach the LM head
        x = op.take(x, logit_rows, axis=0)
    return _linear(m, x, o.weights["weight"], o.weights.get("bias"))


def _reshape(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    x = ins[0]
    b, s = x.shape[0], x.shape[1]
    shape = [b if d == "B" else s if d == "S" else d for d in o.attrs["shape"]]
    return op.reshape(x, shape)


def _rope(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    x, positions = ins
    factors = o.weights.get("freq_factors")  # llama 3's rope_freqs.weight: a float32 vector input
    _, _, h, d = x.shape
    a = o.attrs
    yarn = {n: a[n] for n in YARN_ATTRS} if "ext_factor" in a else None
    key = ("rope", a["layout"], h, d, a["dim"], a["base"], a["freq_scale"], bool(factors),
           tuple(sorted(yarn.items())) if yarn else None)
    func = m._kernel(key, lambda: rope_func(
        a["layout"], h, d, a["dim"], a["base"], a["freq_scale"], dtype=m.options.dtype,
        name=f"rope_{a['layout']}_{h}x{d}_{int(a['base'])}{'_ff' if factors else ''}{'_yarn' if yarn else ''}",
        freq_factors=bool(factors), yarn=yarn))
    out = nn.Tensor.placeholder(x.shape, m.options.dtype)
    extra = []
    if factors:
        (plane,) = m._planes(factors)
        extra = [plane if plane.dtype == "float32" else op.astype(plane, "float32")]
    return op.tensor_ir_op(func, func.attrs["global_symbol"], [x, positions, *extra], out)


def _attention(m: GraphModule, o: Op, ins: list, kv: PagedKVCache, **_) -> nn.Tensor:
    q, k, v, positions = ins
    a = o.attrs
    if a.get("softcap"):
        raise UnsupportedError("lower: attention logit softcapping is not supported by the paged KV cache kernels.")
    if q.shape[-1] != v.shape[-1]:
        raise UnsupportedError("lower: different key and value head sizes are not supported yet.")
    b, s, h, d = q.shape
    if "sinks" in o.weights:  # the sink logits and the positions ride in the rows' padding (attention_sinks.py)
        q, k, v = pad_with_sinks(q, k, v, m._vector(o.weights["sinks"]), positions)
    qkv = op.concat([q, k, v], dim=2)  # (B, S, H + 2·Hkv, D): the cache appends k, v and attends
    if m.kv_dtype != qkv.dtype:  # the cache takes q, k, v and gives its output in its own dtype (--kv-cache f16)
        qkv = op.astype(qkv, m.kv_dtype)
    out = kv.attention_with_fused_qkv(m.cache_layers.first + a["layer"], qkv, a["n_head"], sm_scale=a["scale"])
    if "sinks" in o.weights:
        out = op.split(out, [d], axis=3)[0]  # (B, S, H, D): the padding columns (zeros) dropped
    if out.dtype != m.options.dtype:
        out = op.astype(out, m.options.dtype)
    return op.reshape(out, (b, s, h * d))


def _glu(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    gate, up = ins
    act = op.silu(gate) if o.attrs["activation"] == "silu" else op.gelu(gate, approximate="tanh")
    return act * up


def _softcap(m: GraphModule, o: Op, ins: list, **_) -> nn.Tensor:
    cap = o.attrs["cap"]
    return op.tanh(ins[0] / cap) * cap


_LOWER: dict[OpKind, Callable[..., nn.Tensor]] = {
    OpKind.EMBEDDING: _embedding,
    OpKind.RMS_NORM: _rms_norm,
    OpKind.MATMUL: _matmul,
    OpKind.LM_HEAD: _lm_head,
    OpKind.RESHAPE: _reshape,
    OpKind.ROPE: _rope,
    OpKind.SCALE: lambda m, o, ins, **_: ins[0] * o.attrs["scale"],
    OpKind.ATTENTION: _attention,
    OpKind.ADD: lambda m, o, ins, **_: ins[0] + ins[1],
    OpKind.GLU: _glu,
    OpKind.SOFTCAP: _softcap,
    OpKind.MOE: lower_moe,
}


def exported_functions(precision: str) -> tuple[Fn, ...]:
    """The functions a build exports: the required ones, and verify where decode's matmuls are int8 (under f32 it
    would be prefill itself, which the engine then calls)."""
    return REQUIRED_FUNCTIONS + ((Fn.VERIFY,) if precision == "int8" else ())


def export_spec(graph: Graph, precision: str = "f32") -> dict:
    """The signatures nn.Module.export_tvm builds (precision resolved: "int8" or "f32")."""
    none = {"param_mode": "none", "effect_mode": "none"}
    packed = {"param_mode": "packed", "effect_mode": "none"}
    kv = spec.Object(object_type=PagedKVCache)
    specs = {
        Fn.CREATE_KV_CACHE.value: {**dict.fromkeys(KVCacheArgs.names(), int), "$": none},
        Fn.PREFILL.value: {"tokens": spec.Tensor([1, "seq_len"], "int32"),
                           "logit_rows": spec.Tensor(["n_rows"], "int32"), "kv": kv, "$": packed},
        Fn.DECODE.value: {"tokens": spec.Tensor(["batch", 1], "int32"), "kv": kv, "$": packed},
        Fn.DECODE1.value: {"tokens": spec.Tensor([1, 1], "int32"), "kv": kv, "$": packed},
        Fn.VERIFY.value: {"tokens": spec.Tensor([1, "seq_len"], "int32"), "kv": kv, "$": packed},
    }
    return {str(f): specs[str(f)] for f in exported_functions(precision)}


def check_graph(graph: Graph, target: tvm.target.Target, options: LowerOptions = LowerOptions()) -> None:
    """Refuse, before any work, a graph this target cannot run, naming every missing piece."""
    checks = [lambda: check_sinks(graph.config, target.kind.name, resolve_precision(options.precision, target),
                                  kv_cache_dtype(options.kv_cache))]
    if any(o.kind == OpKind.MOE for o in graph.ops):
        checks.insert(0, lambda: check_target(target.kind.name, graph.config.arch))
    problems = []
    for check in checks:
        try:
            check()
        except UnsupportedError as e:
            problems.append(str(e))
    if problems:
        raise UnsupportedError(" ".join(problems))


def lower_graph(graph: Graph, target: tvm.target.Target, options: LowerOptions = LowerOptions()):
    """Graph → (Relax IRModule, [(param name, shape, dtype)] in the packed order the functions take)."""
    check_graph(graph, target, options)
    module = GraphModule(graph, target, options)
    with target:
        mod, named_params = module.export_tvm(spec=export_spec(graph, module.precision))
    # export_tvm names them after the ParameterDict attribute: "params.<tensor>::<plane>"
    params = [(name.removeprefix("params."), tuple(int(d) for d in p.shape), str(p.dtype)) for name, p in named_params]
    return mod, params
