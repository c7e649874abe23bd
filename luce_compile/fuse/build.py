"""Build the megakernels of a model for a CUDA target: one persistent PrimFunc per batch size, in one module.

`megakernel_b{B}` runs one decode step of B sequences. The programs (task tables, arena layout, weight stacks) are
deterministic functions of the graph and these options, so the runtime side can rebuild and check them
(`program_fingerprint`)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luce_compile.errors import UnsupportedError
from luce_compile.fuse.plan import CostModel
from luce_compile.fuse.program import Program, build_program
from luce_compile.graph.ir import Graph

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegakernelOptions:
    batches: tuple[int, ...] = (1, 2, 4, 8)
    max_context: int = 4096
    page_size: int = 16
    # keys per attention task; longer contexts split into chunks merged by a second task. One 1024-key chunk (no
    # merge stage) measured slower on the H200: the chunk's keys run serially in one task (28 µs vs 6 + 9 µs)
    kv_chunk: int = 256
    # > 0: that many key chunks per (sequence, KV head), sized each step (TaskGraph.kv_splits); -1: even splits at
    # batch 1, chunks of kv_chunk above (build_task_graph)
    kv_splits: int = -1
    fold_merge: bool = False  # the O projection merges split attention partials (no merge tasks: build_program)
    kv_dtype: str = "float16"
    # bytes of each weight plane's tile (and of each attention chunk's keys/values) asked into L2 before a task's
    # wait, so the fetch overlaps the wait instead of following it; 0 turns it off
    prefetch_bytes: int = 64 * 1024
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


def kernel_name(batch: int) -> str:
    return f"megakernel_b{batch}"


def plan_programs(graph: Graph, facts: dict, options: MegakernelOptions) -> dict[int, Program]:
    """The program of every batch size, planned for the target's SM count and bandwidth."""
    n_sms = int(facts["sm_count"])
    cost = CostModel(bandwidth=facts["mem_bandwidth_gb_s"] * 1e9, n_sms=n_sms)
    return {b: build_program(graph, batch=b, n_sms=n_sms, max_context=options.max_context,
                             kv_chunk=options.kv_chunk, kv_splits=options.kv_splits, fold_merge=options.fold_merge,
                             page_size=options.page_size, cost=cost)
            for b in options.batches}


def program_fingerprint(prog: Program) -> str:
    """A hash of everything the kernel was compiled against (tables, layout, shapes)."""
    h = hashlib.sha256()
    for arr in (prog.tasks, prog.queue_len, prog.deps):
        h.update(np.ascontiguousarray(arr).tobytes())
    types = [prog.graph.weights[w].ggml_type.name for o in prog.opcodes for w in o.weights]
    h.update(repr((prog.arena_size, prog.n_counters, prog.lm_tiles, prog.page_size, sorted(prog.kv.items()),
                   prog.weight_args(), types)).encode())
    return h.hexdigest()[:16]


def compile_megakernels(graph: Graph, target_name: str, out: Path, options: MegakernelOptions) -> dict[int, Program]:
    """Emit and compile the megakernels into the shared library `out`; returns the programs by batch size."""
    import tvm

    from luce_compile.codegen.gpu_toolchain import gpu_toolchain
    from luce_compile.fuse.emit_cuda import emit_megakernel
    from luce_compile.targets import get_target

    info = get_target(target_name)
    if info.kind != "cuda":
        raise UnsupportedError(f"fuse: the megakernel is generated for CUDA targets so far, not {info.name}; "
                               "build with --no-megakernel.")
    programs = plan_programs(graph, info.facts, options)

    def emit(b: int, p: Program):
        try:
            return emit_megakernel(p, name=kernel_name(b), options=options)
        except UnsupportedError as e:
            if options.threads == 256 or "shared memory" not in str(e):
                raise
            log.info("megakernel_b%d: %s; 256 threads a block instead of %d", b, e, options.threads)
            return emit_megakernel(p, name=kernel_name(b), options=dataclasses.replace(options, threads=256))

    funcs = {kernel_name(b): emit(b, p) for b, p in programs.items()}
    for b, p in programs.items():  # the argument order callers must follow (the runtime passes them by position)
        p.param_names = [str(v.name) for v in funcs[kernel_name(b)].params]
    target = info.tvm_target()
    start = time.perf_counter()
    with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
        executable = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline="tirx")
    log.info("megakernels %s compiled in %.1f s", list(funcs), time.perf_counter() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out))
    return programs
