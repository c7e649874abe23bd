"""Attention sinks (gpt-oss's attn_sinks: a learned logit per query head in every softmax's denominator) through TVM's
paged KV cache, whose kernels take no per-layer input beyond q, k, v and the pages.

The sink rides in the rows: every cache row is the head's `head_dim` columns, then SINK_COLUMNS more (one CPU
vector). A query row carries its head's sink logit (padding column SINK), then its position (QUERY_POSITION: mod
1024, then // 1024: exact in float16 too); a key row carries its position the same way in other columns
(KEY_POSITION); values carry zeros. No column is non-zero in both a query's and a key's padding, so a kernel that
multiplies whole rows (TVM's, the GPU's flash kernels) gets the head's scores exactly, and values of zero add
nothing to O: only the kernels that fold the sink need to know the layout. The CPU kernels attend over the head's
columns only (schedules/cpu/attention_*.py, `d_att`). The sink is folded into a row's softmax in the one call that
holds the query's own key: TVM's cache splits a step's keys between calls and merges them by log-sum-exp - the step's
new tokens against themselves (the ragged kernel, causal: it always holds the query's own key), the keys already
cached (one paged call per fork depth), or, decoding, the pages only after appending the new token (the decode
kernel then checks that the last key's position is the query's). On CUDA the ragged and decode kernels are
schedules/gpu/flash_prefill.py's (float16 caches); the paged prefill may be TVM's (sliding windows). A token tree
(speculative verify: TVM's tree kernels) would lose the sinks; speculation refuses sliding-window models
(luce_runtime.speculative), which gpt-oss is.

The cost: the cache's rows are 64 + 16 columns for gpt-oss's heads of 64, 25% more KV memory; the CPU kernels read
and multiply only the 64, the GPU's all 80.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.config import ModelConfig

SINK_COLUMNS = 16  # one 16-lane float32 vector: the kernels' rows stay whole vectors (attention_prefill.LANES)
# padding columns, counted from head_dim: a query's sink logit and position, a key's position (module docstring)
SINK, KEY_POSITION, QUERY_POSITION = 0, 1, 3


def kv_head_dim(config: ModelConfig) -> int:
    """The width of one head's row in the KV cache: the head, plus SINK_COLUMNS where the model has sinks."""
    return config.head_dim + (SINK_COLUMNS if config.attn_sinks else 0)


def check_sinks(config: ModelConfig, target_kind: str, precision: str = "f32", kv_dtype: str = "float32") -> None:
    """Refuse, before any work, a model with sinks where the module docstring's scheme does not hold: kernels that
    fold the sink exist for the CPU and, on CUDA, for float16 caches (flash_prefill.py, the default build)."""
    from luce_schedules.gpu import flash_prefill

    if not config.attn_sinks:
        return
    if config.head_dim % SINK_COLUMNS or config.head_dim != config.head_dim_v:
        raise UnsupportedError(f"lower: attention sinks need one head size for keys and values, a multiple of "
                               f"{SINK_COLUMNS}; {config.arch} has {config.head_dim}/{config.head_dim_v}.")
    if target_kind == "llvm":
        return
    row = kv_head_dim(config)
    if target_kind == "cuda" and precision == "f16" and flash_prefill.supports(row, row, kv_dtype):
        return
    raise UnsupportedError(f"lower: {config.arch}'s attention sinks fold in luce-compile's attention kernels: the "
                           f"CPU's, and on CUDA the flash kernels of the default build (precision f16, a float16 KV "
                           f"cache, rows of {row} columns up to {flash_prefill.MAX_HEAD_DIM}); {target_kind} with "
                           f"precision {precision} and a {kv_dtype} cache has none. Compile with the default "
                           f"--precision and --kv-cache, or with --target cpu.")


POSITION_RADIX = 1024  # a position is written as (p mod 1024, p // 1024): both exact in float16 up to 2M tokens


def pad_with_sinks(q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, sinks: nn.Tensor, positions: nn.Tensor
                   ) -> tuple[nn.Tensor, ...]:
    """q (B,S,H,D), k and v (B,S,Hkv,D), sinks (H,), positions (B,S) int32 → the cache's rows, D + SINK_COLUMNS wide
    (module docstring): q [.., sink, 0, 0, position, 0..], k [.., 0, position, 0..], v [.., zeros]."""
    b, s, h, _ = q.shape
    hkv = k.shape[2]
    p = op.astype(positions, "float32")  # exact below 2^24
    high = op.floor(p / float(POSITION_RADIX))
    pos = op.concat([op.reshape(p - high * float(POSITION_RADIX), (b, s, 1, 1)), op.reshape(high, (b, s, 1, 1))],
                    dim=3)  # (B,S,1,2)
    sink = op.broadcast_to(op.reshape(sinks, (1, 1, h, 1)), (b, s, h, 1))

    def row(x: nn.Tensor, at: int, tail: nn.Tensor) -> nn.Tensor:  # x, then `tail` at padding column `at`
        width = tail.shape[3]
        return op.concat([x, op.pad(tail, [0, 0, 0, 0, 0, 0, at, SINK_COLUMNS - at - width])], dim=3)

    assert SINK == 0 and QUERY_POSITION == KEY_POSITION + 2  # the query's tail: sink, the key's two columns, position
    query_tail = op.concat([op.pad(sink, [0, 0, 0, 0, 0, 0, 0, 2]), op.broadcast_to(pos, (b, s, h, 2))], dim=3)
    return (row(q, SINK, query_tail), row(k, KEY_POSITION, op.broadcast_to(pos, (b, s, hkv, 2))),
            op.pad(v, [0, 0, 0, 0, 0, 0, 0, SINK_COLUMNS]))
