"""Attention sinks (gpt-oss's attn_sinks: a learned logit per query head in every softmax's denominator) through TVM's
paged KV cache, whose kernels take no per-layer input beyond q, k, v and the pages.

The sink rides in the rows: every cache row is the head's `head_dim` columns, then SINK_COLUMNS more (one CPU
vector). A query row carries its head's sink logit, then its position (mod 1024, then // 1024: exact in float16
too); a key row carries its position the same way; values carry zeros. The CPU kernels attend over the head's columns
only (schedules/cpu/attention_*.py, `d_att`) and fold the sink into a row's softmax in the one call that holds the
query's own key: TVM's cache splits a step's keys between calls and merges them by log-sum-exp - the step's new
tokens against themselves (the ragged kernel, causal: it always holds the query's own key), the keys already cached
(one paged call per fork depth), or, decoding, the pages only after appending the new token (the decode kernel
then checks that the last key's position is the query's). A token tree (speculative verify: TVM's tree kernels)
would lose the sinks; speculation refuses sliding-window models (luce_runtime.speculative), which gpt-oss is.

The cost: the cache's rows are 64 + 16 columns for gpt-oss's heads of 64, 25% more KV memory; the kernels read and
multiply only the 64. GPU targets are refused (their kernels are TVM's, or the megakernel's, without sinks).
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from luce_compile.errors import UnsupportedError
from luce_compile.gguf.config import ModelConfig

SINK_COLUMNS = 16  # one 16-lane float32 vector: the kernels' rows stay whole vectors (attention_prefill.LANES)


def kv_head_dim(config: ModelConfig) -> int:
    """The width of one head's row in the KV cache: the head, plus SINK_COLUMNS where the model has sinks."""
    return config.head_dim + (SINK_COLUMNS if config.attn_sinks else 0)


def check_sinks(config: ModelConfig, target_kind: str) -> None:
    """Refuse, before any work, a model with sinks where the module docstring's scheme does not hold."""
    if not config.attn_sinks:
        return
    if target_kind != "llvm":
        raise UnsupportedError(f"lower: {config.arch}'s attention sinks run in luce-compile's CPU attention kernels "
                               f"only; the {target_kind} target's attention kernels (TVM's, the megakernel's) have "
                               "no sink term. Compile with --target cpu.")
    if config.head_dim % SINK_COLUMNS or config.head_dim != config.head_dim_v:
        raise UnsupportedError(f"lower: attention sinks need one head size for keys and values, a multiple of "
                               f"{SINK_COLUMNS}; {config.arch} has {config.head_dim}/{config.head_dim_v}.")


POSITION_RADIX = 1024  # a position is written as (p mod 1024, p // 1024): both exact in float16 up to 2M tokens


def pad_with_sinks(q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, sinks: nn.Tensor, positions: nn.Tensor
                   ) -> tuple[nn.Tensor, ...]:
    """q (B,S,H,D), k and v (B,S,Hkv,D), sinks (H,), positions (B,S) int32 → the cache's rows, D + SINK_COLUMNS wide
    (module docstring): q [.., sink, position], k [.., position], v [.., zeros]."""
    b, s, h, _ = q.shape
    hkv = k.shape[2]
    p = op.astype(positions, "float32")  # exact below 2^24
    high = op.floor(p / float(POSITION_RADIX))
    pos = op.concat([op.reshape(p - high * float(POSITION_RADIX), (b, s, 1, 1)), op.reshape(high, (b, s, 1, 1))],
                    dim=3)  # (B,S,1,2)
    sink = op.broadcast_to(op.reshape(sinks, (1, 1, h, 1)), (b, s, h, 1))

    def row(x: nn.Tensor, *tail: nn.Tensor) -> nn.Tensor:
        tail = op.concat(list(tail), dim=3) if len(tail) > 1 else tail[0]
        width = tail.shape[3]
        return op.concat([x, op.pad(tail, [0, 0, 0, 0, 0, 0, 0, SINK_COLUMNS - width])], dim=3)

    return (row(q, sink, op.broadcast_to(pos, (b, s, h, 2))), row(k, op.broadcast_to(pos, (b, s, hkv, 2))),
            op.pad(v, [0, 0, 0, 0, 0, 0, 0, SINK_COLUMNS]))
