"""The Relax pipeline per target family: TVM's default passes with our schedule rules applied after fusion.

CPU: TVM's pipeline (relax/backend/cpu_generic) legalizes, fuses and lowers, but leaves every TIR function
unscheduled (one thread, no vectors). Ours runs the same passes and, between fusion and lowering, gives each
PrimFunc to the ordered rule list of `luce_schedules` for its target family: the first rule that accepts it
schedules it; a function no rule accepts stays as it is (correct, slow) and is logged.

GPU (cuda, rocm): TVM's backend pipeline for the kind, with its dlight step replaced by ours — our rules first,
then dlight's defaults (Matmul, GEMV, Reduction, GeneralReduction, Fallback) for everything else. A GPU function
that no rule binds to threads would be compiled as host code and crash on device memory at run time (tvm-0.27
notes: the generic-pipeline trap), so `check_gpu_scheduled` fails the build instead, naming the functions.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import tvm
import tvm_ffi
from tvm import tirx
from tvm_ffi.structural import structural_visit

from luce_compile.errors import LuceError

if TYPE_CHECKING:
    from luce_compile.tune.records import Tuning

log = logging.getLogger(__name__)
CUDA_GRAPH_KEY = "relax.backend.use_cuda_graph"


def apply_schedule_rules(target: tvm.target.Target, tuning: Tuning | None = None) -> tvm.transform.Pass:
    """A module pass: schedule every unscheduled PrimFunc with the first rule of `luce_schedules` that takes it.

    A kernel whose rule has knobs is looked up in `tuning` (records from autotune_logs/) by its workload key: a
    record's knobs go to the rule, else the rule's defaults; either way the kernel is noted in `tuning`'s report.
    Nothing is searched here. On GPU targets, functions none of our rules take are left to dlight's defaults."""
    from luce_compile.tune.workloads import first_rule, schedule_rules, scheduled_func, tunable, unscheduled_funcs

    rules = schedule_rules(target)

    @tvm.transform.module_pass(opt_level=0, name="LuceApplyScheduleRules")
    def _apply(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        for name, func in unscheduled_funcs(mod):
            rule, result = first_rule(func, target, rules)
            if rule is None:
                # on the CPU nothing follows these rules: such a function runs as it is (correct, slow)
                log.log(logging.INFO if target.kind.name == "llvm" else logging.DEBUG,
                        "no schedule rule for %s: left %s", name,
                        "unscheduled" if target.kind.name == "llvm" else "to dlight's defaults")
                continue
            if tuning is not None and tunable(rule):
                result = _tuned(tuning, rule, name, func, target, result)
            mod[name] = scheduled_func(result)
            log.debug("%s ← %s", name, type(rule).__name__)
        return mod

    return _apply


def _tuned(tuning: Tuning, rule, name: str, func: tirx.PrimFunc, target: tvm.target.Target, default: object) -> object:
    """The rule's result with the knobs of func's record, if there is one and the rule takes them; else `default`
    (the rule's result with its defaults). A record the rule refuses is reported, and the build goes on."""
    from luce_compile.tune.records import KernelTuning
    from luce_compile.tune.workloads import SCHEDULE_ERRORS, workload_key

    key = workload_key(tuning.key_target, rule.name, name, func)
    kernel = KernelTuning(name, rule.name, key, tuning.lookup(key) if tuning.log_target else None)
    result = default
    if kernel.record is not None:
        try:
            knobs = kernel.record["knobs"]
            # a rule whose tuned knobs hold only near the extent they were measured at gets that extent too
            measured = getattr(rule, "apply_measured", None)
            tuned = (measured(func, target, knobs, kernel.record.get("measured_at") or {}) if measured
                     else rule.apply(func, target, knobs))
        except SCHEDULE_ERRORS as err:
            tuned, kernel.error = None, f"{type(err).__name__}: {err}"
        if tuned is None:
            kernel.error = kernel.error or "the rule declined these knobs"
            log.warning("tuning record %s for %s not applied (%s): rule defaults used; re-run `luce-compile tune` "
                        "for this target", kernel.record.get("_source"), name, kernel.error)
        else:
            result = tuned
            kernel.differs = rule.knobs(kernel.record["knobs"]) != rule.knobs()
    tuning.note(kernel)
    return result


@tvm_ffi.register_error
class UnscheduledError(LuceError, RuntimeError):
    """A GPU build would leave a TIR function unbound to threads (it would run as host code on device memory).

    Registered with tvm_ffi so that it keeps its type when raised inside a pass that tvm.compile runs."""


def thread_extents(func: tirx.PrimFunc) -> dict[str, int]:
    """The largest extent bound to each GPU thread tag (blockIdx.x, threadIdx.y, …) in a function; -1 if symbolic."""
    found: dict[str, int] = {}

    def note(tag: str, extent: tirx.PrimExpr) -> None:
        value = int(extent) if isinstance(extent, tirx.IntImm) else -1
        found[tag] = -1 if -1 in (value, found.get(tag)) else max(found.get(tag, 1), value)

    def on_for(node: tirx.For, visitor) -> None:
        if node.kind == tirx.ForKind.THREAD_BINDING and node.thread_binding is not None:
            note(node.thread_binding.thread_tag, node.extent)
        visitor.default_visit(node)

    def on_attr(node: tirx.AttrStmt, visitor) -> None:
        if node.attr_key == "thread_extent":
            note(node.node.thread_tag, node.value)
        visitor.default_visit(node)

    structural_visit(func.body, [(tirx.For, on_for), (tirx.AttrStmt, on_attr)])
    return found


def kernel_threads(func: tirx.PrimFunc) -> list[int]:
    """Threads per block of each kernel a function launches (its outermost thread-bound nests; a batch dispatch
    holds one per branch, each with its own block shape), 0 where an extent is symbolic."""
    counts: list[int] = []

    def is_launch(node) -> bool:
        if isinstance(node, tirx.AttrStmt):
            return node.attr_key == "thread_extent"
        return node.kind == tirx.ForKind.THREAD_BINDING and node.thread_binding is not None

    def on_node(node, visitor) -> None:
        if not is_launch(node):
            visitor.default_visit(node)
            return
        inner = thread_extents(tirx.PrimFunc([], node))
        threads = [v for tag, v in inner.items() if tag.startswith("threadIdx")]
        counts.append(0 if -1 in threads else _product(threads))

    structural_visit(func.body, [(tirx.For, on_node), (tirx.AttrStmt, on_node)])
    return counts


def check_gpu_scheduled(target: tvm.target.Target) -> tvm.transform.Pass:
    """A pass that raises UnscheduledError unless every PrimFunc is bound to GPU threads within the target's limit."""
    limit = int(target.attrs["max_num_threads"])

    @tvm.transform.module_pass(opt_level=0, name="LuceCheckGPUScheduled")
    def _check(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        unbound, too_wide = [], []
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            extents = thread_extents(func)
            if not any(tag.startswith(("threadIdx", "blockIdx")) for tag in extents):
                unbound.append(gv.name_hint)
                continue
            widest = max(kernel_threads(func), default=0)
            if widest > limit:
                too_wide.append(f"{gv.name_hint} ({widest} threads)")
        if unbound:
            raise UnscheduledError(
                f"build: {len(unbound)} TIR function(s) are not scheduled for the GPU ({target.kind.name}): "
                f"{', '.join(sorted(unbound))}. They would run as host code on device memory and crash. Add a "
                "schedule rule in schedules/gpu/ (or let dlight's Fallback take them: spatial functions only).")
        if too_wide:
            raise UnscheduledError(f"build: kernels use more threads per block than {target.kind.name} allows "
                                   f"({limit}): {', '.join(too_wide)}.")
        return mod

    return _check


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def gpu_schedule_rules(target: tvm.target.Target) -> list:
    """Our GPU rules, then dlight's defaults, in the order the schedule pass tries them."""
    from luce_schedules import rules_for
    from tvm.s_tir import dlight as dl

    return [*rules_for(target), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def pre_schedule_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """TVM's backend passes up to scheduling (library dispatch, legalize, fusion): what the schedule rules see. The
    tuner enumerates its workloads on the module these passes make, so its keys are the ones compile looks up."""
    if target.kind.name == "llvm":
        from tvm.relax.backend.cpu_generic import pipeline as backend

        return backend.library_dispatch_passes(target) + backend.legalize_passes(target)
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    else:
        from tvm.relax.backend.rocm import pipeline as backend
    # TVM's legalize step ends with dlight's own ApplyDefaultSchedule: ours replaces it
    legalize = [p for p in backend.legalize_passes(target) if p.info.name != "ApplyDefaultSchedule"]
    return backend.library_dispatch_passes(target) + legalize


def _gpu_passes(target: tvm.target.Target, tuning: Tuning | None = None) -> list[tvm.transform.Pass]:
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend
    else:
        from tvm.relax.backend.rocm import pipeline as backend
    # our rules (with their tuning records) first, then dlight's defaults for the functions none of them take
    schedule = [apply_schedule_rules(target, tuning), dl.ApplyDefaultSchedule(*gpu_schedule_rules(target)),
                check_gpu_scheduled(target)]
    return (pre_schedule_passes(target) + schedule + backend.dataflow_lower_passes(target)
            + backend.finalize_passes(target))


# TVM's CPU tree-attention kernels for the paged KV cache (relax/frontend/nn/llm/kv_cache.py) come without
# "tirx.noalias". With tree_attn_paged_kv_cpu in the same LLVM module, every other kernel ran ~1.7x slower: a
# Q4_1 1536x576 GEMV took 136 us instead of 80, its accumulators kept in memory (measured 2026-11-30, SmolLM2's
# module, 2 threads). Their buffers (queries, pages, indptrs, outputs) are distinct tensors the cache passes, as
# in TVM's own GPU kernels, which are noalias: declaring it is true, and restores the other kernels' speed.
NOALIAS_KV_KERNELS = ("tree_attn_paged_kv_cpu", "batch_tree_attn")


def mark_noalias(names: tuple[str, ...]) -> tvm.transform.Pass:
    """A module pass: set "tirx.noalias" on the PrimFuncs of these names (see NOALIAS_KV_KERNELS)."""

    @tvm.transform.module_pass(opt_level=0, name="LuceMarkNoalias")
    def _mark(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and gv.name_hint in names:
                mod[gv] = func.with_attr("tirx.noalias", True)
        return mod

    return _mark


def _cpu_passes(target: tvm.target.Target, tuning: Tuning | None = None) -> list[tvm.transform.Pass]:
    from tvm.relax.backend.cpu_generic import pipeline as backend

    return (pre_schedule_passes(target) + [apply_schedule_rules(target, tuning), mark_noalias(NOALIAS_KV_KERNELS)]
            + backend.dataflow_lower_passes(target) + backend.finalize_passes(target))


def relax_pipeline(target: tvm.target.Target, *, cuda_graph: bool = True,
                   tuning: Tuning | None = None) -> tvm.transform.Pass:
    """The Relax pipeline `tvm.compile` runs for a target: cpu (llvm), cuda or rocm (cuda_graph: see below).
    `tuning`: the records the schedule pass takes knobs from, and where it reports each kernel (None: defaults)."""
    kind = target.kind.name
    if kind not in ("llvm", "cuda", "rocm"):
        raise LuceError(f"build: no pipeline for TVM target kind {kind!r}; targets are llvm (cpu), cuda and rocm.")

    @tvm.transform.module_pass(opt_level=0, name="LucePipeline")
    def _pipeline(mod: tvm.ir.IRModule, ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target, _cuda_graph_context(ctx, kind == "cuda" and cuda_graph):
            passes = _cpu_passes(target, tuning) if kind == "llvm" else _gpu_passes(target, tuning)
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _cuda_graph_context(ctx: tvm.transform.PassContext, enable: bool):
    """The caller's pass context, plus RewriteCUDAGraph switched on for CUDA: the VM then captures each run of
    static-shape kernels between two runtime builtins (the KV cache's) as a CUDA graph and replays it. Measured on
    the H200 (SmolLM2-135M shape, batch-1 decode): 2.82 → 1.63 ms per token, logits bit-identical."""
    if not enable:
        return contextlib.nullcontext()
    config = dict(ctx.config)
    config.setdefault(CUDA_GRAPH_KEY, True)
    return tvm.transform.PassContext(opt_level=ctx.opt_level, required_pass=list(ctx.required_pass),
                                     disabled_pass=list(ctx.disabled_pass), config=config)
