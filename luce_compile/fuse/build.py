"""Build the megakernels of a model for a GPU target (CUDA, or ROCm through LLVM's AMDGPU backend): one persistent
PrimFunc per batch size, in one module. The emitter's target-specific operations are fuse/emit_cuda/intrinsics.py's,
chosen by the target in scope while it emits.

`megakernel_b{B}` runs one decode step of B sequences. The programs (task tables, arena layout, weight stacks) are
deterministic functions of the graph and these options, so the runtime side can rebuild and check them
(`program_fingerprint`)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path

import numpy as np

from luce_compile.errors import UnsupportedError

# the options and their tables are fuse/options.py's, re-exported: scripts and benchmarks import them from here
from luce_compile.fuse.options import (  # noqa: F401
    MMA_FLOAT_TYPES,
    Q8_ORDER,
    SHARED_KIB_MAX,
    STATIC_KIB,
    MegakernelOptions,
    q8_types,
)
from luce_compile.fuse.plan import CostModel
from luce_compile.fuse.program import PROFILE_CLOCKS, Program, build_program
from luce_compile.graph.ir import LOGITS, Graph
from luce_compile.lower.quant_layout import plane_specs

log = logging.getLogger(__name__)


def _buffer_dtype(param) -> str:
    """A kernel argument's element dtype ("" for a scalar argument)."""
    try:
        return str(param.dtype)
    except AttributeError:  # tirx: dtype is only defined on buffer-typed vars
        return ""


def kernel_name(batch: int) -> str:
    return f"megakernel_b{batch}"


def plan_programs(graph: Graph, facts: dict, options: MegakernelOptions) -> dict[int, Program]:
    """The program of every batch size, planned for the target's SM count and bandwidth."""
    n_sms = int(facts["sm_count"])
    cost = CostModel(bandwidth=facts["mem_bandwidth_gb_s"] * 1e9, n_sms=n_sms)
    return {b: build_program(graph, batch=b, n_sms=n_sms, max_context=options.max_context,
                             kv_chunk=options.kv_chunk, kv_splits=options.kv_splits, kv_min_keys=options.kv_min_keys,
                             fold_merge=options.fold_merge, merge_in_last=options.merge_in_last,
                             page_size=options.page_size, cost=cost, balance_waves=options.balance_waves,
                             rope_pairs=options.rope_pairs, norm_partials=options.norm_partials)
            for b in options.batches}


def program_fingerprint(prog: Program) -> str:
    """A hash of everything the kernel was compiled against (tables, layout, shapes)."""
    h = hashlib.sha256()
    for arr in (prog.tasks, prog.queue_len, prog.deps):
        h.update(np.ascontiguousarray(arr).tobytes())
    types = [prog.graph.weights[w].ggml_type.name for o in prog.opcodes for w in o.weights]
    h.update(repr((prog.arena_size, prog.n_counters, prog.lm_tiles, prog.page_size, sorted(prog.kv.items()),
                   prog.weight_args(), types)).encode())
    if prog.graph.row_pairs:  # its q/k rows reordered, its RoPE interleaved (graph/rope_pairs.py): other code
        h.update(repr(sorted(prog.graph.row_pairs.items())).encode())
    return h.hexdigest()[:16]


def target_options(options: MegakernelOptions, info) -> MegakernelOptions:
    """The options as a target builds them: shared memory resolved (MegakernelOptions.for_target); on AMD, the
    tensor-core bodies off (they are PTX mma), no L2 prefetch (gfx11/gfx1201 have no prefetch instruction), q and k
    tiles of whole heads (rope_pairs gave the 8B's b=8 kernel 608 bytes of scratch a lane on gfx1151, over the
    bound of kernel_resources.py) and at most the threads a workgroup may have (TVM marks every ROCm kernel
    amdgpu-flat-work-group-size 1,256)."""
    options = options.for_target(info.facts)
    if info.kind != "rocm":
        return options
    return dataclasses.replace(options, q8_mma=False, float_mma=False, prefetch_bytes=0, prefetch_ahead=False,
                               rope_pairs=False,
                               threads=min(options.threads, int(info.facts["max_threads_per_block"])))


def compile_megakernels(graph: Graph, target_name: str, out: Path, options: MegakernelOptions) -> dict[int, Program]:
    """Emit and compile the megakernels into the shared library `out`; returns the programs by batch size."""
    import tempfile

    import tvm

    from luce_compile.codegen.gpu_toolchain import gpu_toolchain
    from luce_compile.codegen.kernel_resources import check_megakernels
    from luce_compile.fuse.emit_cuda import MegakernelEmitter, emit_megakernel, intrinsics
    from luce_compile.targets import get_target

    info = get_target(target_name)
    if info.kind not in ("cuda", "rocm"):
        raise UnsupportedError(f"fuse: the megakernel is generated for GPU targets (CUDA, ROCm), not {info.name}; "
                               "build with --no-megakernel.")
    options = target_options(options, info)
    programs = plan_programs(graph, info.facts, options)
    target = info.tvm_target()

    launch: dict[str, tuple[int, int]] = {}  # kernel → (threads a block, dynamic shared bytes the launch asks)

    def emit(b: int, p: Program):
        used = options
        try:
            func = emit_megakernel(p, name=kernel_name(b), options=options)
        except UnsupportedError as e:
            if options.threads == 256 or "shared memory" not in str(e):
                raise
            log.info("megakernel_b%d: %s; 256 threads a block instead of %d", b, e, options.threads)
            used = dataclasses.replace(options, threads=256)
            func = emit_megakernel(p, name=kernel_name(b), options=used)
        floats = (used.shared_kib or STATIC_KIB) * 256  # the emitter's shared buffer (emit_cuda/core.py)
        launch[kernel_name(b)] = (used.threads, 4 * floats if intrinsics.shared_scope(floats) == "shared.dyn" else 0)
        return func

    with target:  # the intrinsics the emitter calls are the target's
        if options.q8_activations:  # a stage keeps float inputs at every batch size if one program cannot fit them
            misfits = frozenset().union(*(MegakernelEmitter(p, name=kernel_name(b), options=options).q8_misfit_stages()
                                          for b, p in programs.items()))
            for p in programs.values():
                p.q8_misfits = misfits
        funcs = {kernel_name(b): emit(b, p) for b, p in programs.items()}
    for b, p in programs.items():  # the argument order callers must follow (the runtime passes them by position)
        func = funcs[kernel_name(b)]
        p.param_names = [str(v.name) for v in func.params]
        p.param_dtypes = {str(v.name): _buffer_dtype(v) for v in func.params}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="luce-mk-") as tmp:
        extra_ir = ()
        if info.kind == "rocm":  # the ordered memory operations TVM's LLVM codegen cannot emit, linked in
            extra_ir = (str(Path(tmp) / intrinsics.AMDGPU_IR_FILE),)
            Path(extra_ir[0]).write_text(intrinsics.AMDGPU_IR)
        with gpu_toolchain(info.kind, info.archs or (info.name,), info.name, extra_ir), target:
            executable = tvm.compile(tvm.IRModule(funcs), target=target, tir_pipeline="tirx")
    log.info("megakernels %s compiled in %.1f s", list(funcs), time.perf_counter() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(out))
    # registers, spills, shared memory / LDS and threads against the target's limits, read from the binary
    resources = check_megakernels(out, info, launch)
    for b, p in programs.items():
        p.resources = [r for r in resources if r.kernel == kernel_name(b)]
        for r in p.resources:
            log.info("%s on %s: %d threads, %d registers, %d B shared + %d B dynamic, %d B spilled (%d stores)",
                     r.kernel, r.arch, r.threads, r.registers, r.static_shared, r.dynamic_shared, r.spill_bytes,
                     r.spill_stores)
    return programs


def kernel_spec(p: Program) -> dict:
    """What the runtime's launcher (luce_runtime.megakernel.Kernel) needs of a compiled program: the manifest's
    kernel entry less its weights' names, and the task tables it uploads (`kernel_tables`)."""
    return {"name": kernel_name(p.batch), "batch": p.batch, "params": p.param_names, "param_dtypes": p.param_dtypes,
            "arena_size": int(p.arena_size), "n_counters": int(p.n_counters), "lm_tiles": int(p.lm_tiles),
            "logits_at": int(p.arena[LOGITS]), "vocab": int(p.width(LOGITS)), "n_queues": int(len(p.queue_len)),
            "profile_clocks": PROFILE_CLOCKS, "gave_up_marker": True, "fingerprint": program_fingerprint(p),
            # kernels built since 2026-12-06 take a page table of any width (the caller's context), not max_context's
            "page_table_any_width": True}


def kernel_tables(p: Program) -> dict[str, np.ndarray]:
    """The program's task tables as megakernel.npz holds them (b{B}_tasks, b{B}_queue_len, b{B}_deps)."""
    return {f"b{p.batch}_{field}": np.ascontiguousarray(getattr(p, field), dtype=np.int32)
            for field in ("tasks", "queue_len", "deps")}


MODULE_FILE = "megakernel.so"
TABLES_FILE = "megakernel.npz"


def artifact_megakernels(graph: Graph, target_name: str, work: Path, kv_dtype: str,
                         q8_activations: bool = False, float_mma: bool = False,
                         sliding: bool = False) -> tuple[dict, dict[str, Path]]:
    """Compile the megakernels for an artifact: the manifest's "megakernel" section and the files it names
    (luce_runtime/megakernel.py reads both). The section says why when there is none: a target or model the
    generator does not cover yet is built without one, and the engine runs the per-op path.

    Sliding-window layers (Gemma 3): TVM 0.27's cache keeps every page of such a model (no ring: lower/kv_layers.py)
    and its per-op kernels read a window's suffix of them; the megakernel reads the whole page table and applies
    each row's window itself (emit_cuda/attention.py _visible, by the row's position), so both read the same pages.
    The runtime learns those pages through its probe only with the cache layout `sliding` asks the lowering for
    (LowerOptions.probe_sliding_pages): without it (compile_model(sliding_megakernel=False)), none."""
    from luce_compile.lower.relax_model import param_name

    if graph.config.sliding_window and any(graph.config.sliding or ()) and not sliding:
        return {"skipped": "sliding-window layers: built without their cache layout (compile_model("
                           "sliding_megakernel=False)); the default GPU build has both"}, {}
    from luce_compile.targets import get_target

    # the model's whole trained context (issue 38; was capped at 4,096): nothing in the kernel grows with it but the
    # attention's split count (TaskGraph.chunk_keys: at most KV_MAX_WAVES waves of the splits that fill the SMs), and
    # the page table is as wide as the engine's context; the engine's --ctx and its KV pool bound the real contexts
    options = target_options(MegakernelOptions(max_context=int(graph.config.n_ctx_train),
                                               kv_dtype=kv_dtype, q8_activations=q8_activations,
                                               float_mma=float_mma), get_target(target_name))
    try:
        programs = compile_megakernels(graph, target_name, work / MODULE_FILE, options)
    except UnsupportedError as e:
        log.info("no megakernel: %s", e)
        return {"skipped": str(e)}, {}
    tables: dict[str, np.ndarray] = {}
    kernels = {}
    for b, p in programs.items():
        tables.update(kernel_tables(p))
        weights = {}
        for name, o, slot in p.weight_args():
            layers = p.stacked_tensors(o, slot)
            if len(p.graph.weights[layers[0]].shape) == 1:
                weights[name] = [param_name(t, "w") for t in layers]
            else:
                for plane in plane_specs(p.graph.weights[layers[0]].ggml_type, *p.graph.weights[layers[0]].shape):
                    weights[f"{name}_{plane}"] = [param_name(t, plane) for t in layers]
        kernels[str(b)] = {**kernel_spec(p), "weights": weights}
    np.savez_compressed(work / TABLES_FILE, **tables)  # mostly zeros: 6.5 MB -> 0.5 MB for SmolLM2
    kv = next(iter(programs.values())).kv
    section = {"module": MODULE_FILE, "tables": TABLES_FILE, "batches": sorted(programs),
               "max_context": options.max_context, "page_size": options.page_size, "kv_dtype": kv_dtype,
               "kv": dict(kv), "options": dataclasses.asdict(options), "kernels": kernels}
    # what each kernel asks of the GPU, per arch, as checked against the target (codegen/kernel_resources.py)
    section["resources"] = [r.to_manifest() for p in programs.values() for r in p.resources]
    return section, {MODULE_FILE: work / MODULE_FILE, TABLES_FILE: work / TABLES_FILE}
