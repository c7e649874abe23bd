"""The megakernel's options (MegakernelOptions) and the tables its precision choices read (Q8_ORDER,
MMA_FLOAT_TYPES): a module of data that the emitter (fuse/emit_cuda), the build (fuse/build.py) and the runtime
side's checks import without importing each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from luce_compile.fuse.taskgraph import KV_MIN_KEYS

# q8_activations: the weight types whose matvecs take 8-bit activations, and the order of a 32-value block's quants
# in the words they read (emit_cuda.quantize_q8); here so that the runtime side (the checks' oracle) needs no
# compiler import
Q8_ORDER = {"Q4_0": "nibbles", "Q4_1": "nibbles", "Q5_0": "nibbles", "Q5_1": "nibbles", "Q8_0": "natural",
            "Q4_K": "nibbles", "Q5_K": "nibbles", "Q6_K": "nibbles"}
# q8_codebooks: the codebook types, whose 4-bit indices the 8-bit bodies look up to signed bytes first
Q8_CODEBOOK_ORDER = {"IQ4_NL": "nibbles", "IQ4_XS": "nibbles"}
# q8_low_bits: the 2- and 3-bit K-quants (lower/quant_layout._2bit's slots give their quants in nibbles order)
Q8_LOW_BIT_ORDER = {"Q3_K": "nibbles", "Q2_K": "nibbles"}


def q8_types(options: dict) -> tuple[str, ...]:
    """The weight types whose megakernel matvecs take 8-bit activations under `options` (MegakernelOptions as a
    dict, or an artifact manifest's megakernel options): what the checks' oracle rounds."""
    if not options.get("q8_activations"):
        return ()
    return tuple(Q8_ORDER) + (tuple(Q8_CODEBOOK_ORDER) if options.get("q8_codebooks") else ()) + \
        (tuple(Q8_LOW_BIT_ORDER) if options.get("q8_low_bits") else ())
# float_mma: the weight types whose matvecs run on tf32 tensor cores, which hold them exactly (10 mantissa bits and
# float32's exponent range); their inputs are rounded to tf32 (the oracle emulates it: graph/rounding.tf32)
MMA_FLOAT_TYPES = ("F16", "BF16")


# GPU builds of models with sliding-window layers (Gemma 3) get decode megakernels, and the cache layout through which
# the runtime hands them TVM's pages (lower/kv_layers.py; no memory cost). Run on the H100 (2026-12-07, benchmarks/
# README.md "What the device said (2026-12-07, fourth session)"): gemma3-270m's checks passed (oracle 0.056 at 0.1,
# batched = alone, megakernel vs per-op 0.030, window_verify), decode 795 tok/s at b=1 against the per-op path's 295.
# The default of compile_model on GPU targets; CPU builds keep their own layout unless asked (sliding_megakernel=True).
SLIDING_MEGAKERNEL = True

STATIC_KIB = 44  # shared memory without opting in (under 48 KiB, with room for the kernel's static buffers)
# 200 lets the 8B's K = 14,336 down projection take 8-bit inputs at b=8 (the float body took 5.8 of a 12.5 ms step);
# with interleave_slices the 8B's b=8 step went 12,181 -> 8,379 µs on the H200 (96 vs 44 measured no faster at b=1)
SHARED_KIB_MAX = 200


@dataclass(frozen=True)
class MegakernelOptions:
    batches: tuple[int, ...] = (1, 2, 4, 8)
    max_context: int = 4096
    page_size: int = 16
    # with kv_splits = 0: keys per attention task; longer contexts split into chunks merged by a second task
    kv_chunk: int = 256
    # > 0: that many key chunks per (sequence, KV head), sized each step (TaskGraph.kv_splits); -1: as many even
    # splits as fill the SMs once at the batch size (build_task_graph); 0: chunks of kv_chunk
    kv_splits: int = -1
    # an even split's shortest chunk of keys (TaskGraph.kv_min_keys): a task's fixed cost outweighs fewer keys
    kv_min_keys: int = KV_MIN_KEYS
    fold_merge: bool = False  # the O projection merges split attention partials (no merge tasks: build_program)
    # the last key chunk of a (sequence, KV head) to finish merges the partials (an arrival counter), not a merge
    # task that waits on them: one handoff fewer per layer (measured on the H200, context 512: SmolLM2 780 -> 737 µs
    # a step at b=1, 1,813 -> 1,553 at b=8; the 1B body 678 -> 627, 1,971 -> 1,789; Qwen3 890 -> 834, 2,090 -> 1,840)
    merge_in_last: bool = True
    # a unit capped to more tiles than the SMs (the LM head at b=8) takes whole waves of even tiles (build_program):
    # measured on the H200, the LM head's stage at b=8 93 -> 71 µs on SmolLM2, 103 -> 82 on the 1B, 59 -> 47 on Qwen3
    balance_waves: bool = True
    # q and k tiles may split heads where RoPE pairs neighbouring features (Llama's layout): the QKV stage of an 8B
    # (32 + 8 heads of 128) then spreads over every SM instead of 62 of 132 (H200, the 8B: 3,450 -> 3,366 µs a step
    # at b=1, 8,379 -> 7,595 at b=8)
    rope_pairs: bool = True
    kv_dtype: str = "float16"
    # attention reads each key's row across a warp's lanes (fuse/emit_cuda/attention_rows.py): 8-byte words for
    # float16 heads of 128, every K and V load of a warp's 8 keys in flight before any is used, the GQA group's
    # heads from one load, q·k reduce-scattered over the lanes. Off: a lane per key for q·k and a 2-byte load a key
    # and dimension for p·v, the body that read the 8B's f16 pages at ~5 GB/s an SM at depth 32K on the H100
    # (10.2 ms a step against 3.9 at depth 512: benchmarks/README.md). With norm_partials, on the H100's 8B Q4_K_M:
    # -11% a step at b=1 and depth 512, -28% at b=8 and depth 32K (3,721 -> 3,316 and 27,002 -> 19,416 µs)
    attn_rows: bool = True
    attn_rows_slots: int = 0  # with attn_rows: key rows a lane loads a step (K and V each); 0: the emitter's rule
    # bytes of each weight plane's tile (and of each attention chunk's keys/values) asked into L2 before a task's
    # wait, so the fetch overlaps the wait instead of following it; 0 turns it off
    prefetch_bytes: int = 64 * 1024
    # a lane matvec's pass asks L2 for the next pass's (or the next step's) weight blocks before its own arithmetic;
    # measured slower on the H200 (the 8B at b=1 3,366 -> 3,589 µs: the LM head 142 -> 185 µs a task), so off
    prefetch_ahead: bool = False
    poll_sleep_ns: int = 32  # back-off between two polls of a counter
    # float32 partial sums a lane keeps in a matvec step (rows x matmuls x sequences); 0: 16 below batch 4, 32 from
    # it (the emitter's rule, measured on the H200)
    accumulators: int = 0
    # per block (one block per SM); 512 (4 warps a scheduler) measured 7-13% faster than 256 (run6), which is kept
    # where a stage's shared memory does not fit 16 warps (attention of large head groups)
    threads: int = 512
    # a matvec's K passes are unrolled up to this many (every load of a step in flight at once); ncu (run6) puts 20%
    # of the warps' time in instruction-cache misses of the unrolled loops: 1 is the variant to time next
    unroll_passes: int = 4
    # a lane matvec's warps split K into slices of at least this many lane units (granules or 32-value blocks) a
    # lane row; more units a slice: fewer slices, so fewer partial sums meeting at a barrier and more rows a warp
    k_slice_units: int = 32
    # a lane matvec's K split chosen for the fewest memory rounds (steps x passes) a warp takes, where K leaves the
    # rule above a nearly empty last pass (matvec.k_split: the 7B's K = 18,944 down projection, 2 x 2 -> 1 x 3
    # rounds); not measured yet (benchmarks/README, "The GPU work waiting"), so off
    fewest_rounds: bool = False
    # a lane matvec's K slices take turns along K (pass p of slice s reads units (p·split + s)·32 + lane), so a
    # pass of a group's warps reads each row's next split·32 units as one run; off: each slice a contiguous range
    # (a pass reads split runs a row, one per slice, far apart). With shared_kib 200, measured on the H200: the 8B's
    # b=1 step 6,231 -> 3,450 µs, its K = 14,336 down projection 74 -> 25 µs a task (Q4_K), 63 -> 17 (Q6_K)
    interleave_slices: bool = True
    # matvecs of Q4_0/1, Q5_0/1, Q8_0, Q4_K weights take 8-bit activations (llama.cpp's q8_0/q8_1 blocks of 32, as
    # its CUDA mmvq: Q4_K too, where its CPU takes q8_K) and integer dot products (dp4a): ~4x fewer instructions per
    # weight than dequantizing to float32
    q8_activations: bool = False
    # with q8_activations and K >= 1,024: a lane per 32-value block of a row (16-byte loads), not per 8 values
    # (measured on the H200: the 1B body 1,199 -> 921 us a step at b=1, 4,329 -> 3,107 at b=8)
    q8_by_block: bool = True
    # with q8_activations: IQ4_NL and IQ4_XS take 8-bit activations too, their indices looked up to int8 values by
    # three byte permutes a word (intrinsics.table16_bytes, llama.cpp's get_int_from_table_16) and dotted with dp4a;
    # without it they run the float lanes. Checked on the H100 (2026-12-07): tiny llamas in IQ4_NL / IQ4_XS within
    # 0.018 / 0.020 of the oracle (bar 0.1), batched = alone; the 8B IQ4_XS 5.7 ms a step at b=1 (the float lanes
    # 11.3, llama.cpp 3.1). A manifest without the key (older builds) ran the float lanes (q8_types)
    q8_codebooks: bool = True
    # with q8_activations: Q3_K and Q2_K take 8-bit activations too (llama.cpp's vec_dot_q3_K_q8_1 / q2_K_q8_1: the 2
    # low bits in quant_layout._2bit's slots, Q3_K's third from its hmask, offset 4, a signed scale per 16; Q2_K's
    # scale and minimum per 16 against the 16 activations' integer sum); without it they run the float lanes.
    # Checked on the H100 (2026-12-07): tiny llamas in Q2_K / Q3_K within 0.027 / 0.021 of the oracle (bar 0.1),
    # batched = alone. A manifest without the key (older builds) ran the float lanes (q8_types)
    q8_low_bits: bool = True
    # with q8_activations: the matvecs' integer dot products on tensor cores (mma.m16n8k32 s8, 16 rows x a block x
    # 8 sequences an instruction) instead of dp4a, at every batch size
    q8_mma: bool = False
    # matvecs of F16/BF16 weights on tf32 tensor cores (mma.m16n8k8: 16 rows x 8 values x 8 sequences an
    # instruction, float32 sums), the input rounded to tf32 (10 mantissa bits), at every batch size
    float_mma: bool = False
    float_mma_ahead: int = 0  # chunks of 32 values whose loads a float_mma warp issues at once; 0: the emitter's rule
    float_mma_tiles: int = 0  # (matmul, 16-row tile) fragments a float_mma warp accumulates at once; 0: MMA_TILES
    # shared memory a block, KiB: 44 is static (under the 48 KiB that needs no opt-in); more is dynamic shared
    # memory, up to 99 KiB on sm_86/sm_120 and 227 on sm_90 (one block an SM: it costs no occupancy). 0: the
    # target's (for_target): 128 where it allows (then the 1B's K = 8,192 down projection takes 8-bit inputs at
    # batch 8 as well: 743 -> 667 µs a step at b=1 on the H200), else what it allows
    shared_kib: int = 0
    # the tasks that write an RMS norm's input (the embedding, the residual adds) also write each 32 features' sum
    # of squares per row (fuse/taskgraph.py NORM_CHUNK), so the norm's matvec tiles sum 128 floats a row (4,096
    # features) for 1/rms instead of every tile squaring the whole input: on the H100's 8B profile at b=8 the
    # normed stages spent 16-17 µs a task in their input phase against 4 for the O projection (benchmarks/README.md).
    # Every matvec body (8-bit, float lanes, float_mma) reads them. A different float32 order of the sum than the
    # per-tile one: SmolLM2's float build stays at 3.4e-4 of the oracle (H100, 2026-12-07; without both 3.6e-4)
    norm_partials: bool = True

    def for_target(self, facts: dict) -> MegakernelOptions:
        """These options with shared_kib = 0 resolved for a target's facts (targets.py)."""
        if self.shared_kib:
            return self
        opt_in = int(facts.get("max_shared_memory_opt_in", 48 << 10)) >> 10
        # 4 KiB left for the static buffers (up to 3,712 bytes: SmolLM2 at b8 on sm_120); with 3, the sm_120 b8
        # kernel asked 102,016 bytes of the 101,376 a block may have (codegen/kernel_resources.py's check)
        return dataclasses.replace(self, shared_kib=min(SHARED_KIB_MAX, opt_in - 4) if opt_in > 48 else STATIC_KIB)
