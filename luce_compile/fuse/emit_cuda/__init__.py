"""Emit the megakernel: one persistent TIRx PrimFunc that runs a Program's task table (fuse/program.py).

One block per SM, 512 threads (16 warps). Each block walks its queue of the task table; per task, a thread per
counter waits on the task's counters (acquire), the block runs the task's opcode, and thread 0 publishes (fence,
then the task's and its stage's counters). Opcode bodies are generated from the op kinds of their first stage, in
TensorIR through TVMScript's IR builder; the dequantization of every weight type is `quant_matmul.dequant_expr`,
the same expression the per-op kernels use.

Task bodies:
  matvec        the prologue RMS norm's scale per sequence (a block reduction), the input staged in shared memory
                (transposed by 8-value granule so a warp's lanes read consecutive words) when it fits; each warp
                runs several rows at once for all sequences, lanes stride over granules, a warp sum per output; the
                tile's outputs go to shared memory, where the epilogue ops run (elementwise, per-head norms,
                RoPE); then the values other stages read go to the arena, keys/values to their pages, and the LM
                head's tile leaves its best logit per sequence. With q8_activations, the tiles of Q4_0/1, Q5_0/1,
                Q8_0 and Q4_K weights quantize the input into 8-bit blocks instead (a thread per 8 features,
                16-byte loads) and dot 8-bit words (dp4a), a lane per 32-value block of a row where K >= 1,024
                (q8_by_block), else per 8 values; with q8_mma on integer tensor cores (mma.m16n8k32, a warp per
                16 rows). F32/F16/BF16 rows are read as 16-byte words
  row           a whole-row op (gemma's post-norms) and its epilogue, for one sequence, in shared memory
  attn_partial  one (sequence, KV head, key chunk): lanes own keys for the scores (online softmax per warp), own
                dimensions for p·v; the warps' partials merge in shared memory; one chunk writes the output,
                several write (o, max, sum) partials that the last of them to finish combines (merge_in_last: an
                arrival counter), or else a merge task (split = -1). With attn_rows: each key's row across a
                warp's lanes instead (8-byte words, every K and V load of a step in flight first, q·k
                reduce-scattered over the lanes)
  embed         rows of the embedding table, dequantized, times the scale
  argmax        per sequence, the best of the LM-head tiles (lowest index on ties, as numpy's argmax); with
                `masked` set, only over the tokens whose bit is set in the step's `allowed` words (a grammar's
                mask, llguidance's packing: token t is bit t % 32 of word t // 32), so a constrained greedy step
                still returns only ids

The emitter is one class, MegakernelEmitter, whose parts are mixins in the modules of this package; they share
their state on self (the program, the options, the kernel's arguments and shared buffers):
  core          small builders, arguments, the persistent loop, waits, clocks, L2 prefetch, opcode dispatch,
                embed, row stages, argmax
  matvec        the matvec frame: input staging, a unit's matmuls by one of the bodies below, the tile's writes
  norm_partials a norm input's chunk sums of squares, written by its writers and read for 1/rms (norm_partials)
  float_lanes   float32 lanes (dequantized in registers; float weights as 16-byte words)
  q8            8-bit activations: quantize_q8, the dp4a passes, the block scales
  q8_mma        8-bit activations on integer tensor cores
  float_mma     F16/BF16 weights on tf32 tensor cores
  attention     attention partials and their merges
  attention_rows  the attention partial with key rows across lanes (attn_rows)
  epilogue      element-wise ops, per-head norms, RoPE on a tile in shared memory
The options are luce_compile/fuse/options.py's MegakernelOptions.
"""

from __future__ import annotations

from tvm import tirx

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda.attention import AttentionMixin
from luce_compile.fuse.emit_cuda.core import F32, LINE, SPIN_LIMIT, EmitterCore, f32, i32
from luce_compile.fuse.emit_cuda.epilogue import EpilogueMixin
from luce_compile.fuse.emit_cuda.float_lanes import FLOAT_WORDS, FloatLanesMixin, _Granule
from luce_compile.fuse.emit_cuda.float_mma import MMA_CHUNK, MMA_MIN_CHUNKS, MMA_TILES, FloatMmaMixin, tf32
from luce_compile.fuse.emit_cuda.matvec import MatvecMixin
from luce_compile.fuse.emit_cuda.norm_partials import NormPartialsMixin
from luce_compile.fuse.emit_cuda.q8 import Q8_BLOCK, Q8_OFFSET, QUANT_AHEAD, Q8Mixin, _fifth_bits, _sixth_bits, dp4a
from luce_compile.fuse.emit_cuda.q8_mma import MMA_MIN_BLOCKS, Q8MmaMixin
from luce_compile.fuse.options import MegakernelOptions

__all__ = ["F32", "FLOAT_WORDS", "LINE", "MMA_CHUNK", "MMA_MIN_BLOCKS", "MMA_MIN_CHUNKS", "MMA_TILES", "Q8_BLOCK",
           "Q8_OFFSET", "QUANT_AHEAD", "SPIN_LIMIT", "MegakernelEmitter", "MegakernelOptions", "_Granule",
           "_fifth_bits", "_sixth_bits", "dp4a", "emit_megakernel", "f32", "i32", "tf32"]


class MegakernelEmitter(MatvecMixin, NormPartialsMixin, FloatLanesMixin, Q8Mixin, Q8MmaMixin, FloatMmaMixin,
                        AttentionMixin, EpilogueMixin, EmitterCore):
    """One megakernel's TIRx PrimFunc from a Program and the options (`build`)."""


def emit_megakernel(prog: P.Program, *, name: str = "megakernel",
                    options: MegakernelOptions | None = None) -> tirx.PrimFunc:
    em = MegakernelEmitter(prog, name=name, options=options or MegakernelOptions())
    return em.build()
