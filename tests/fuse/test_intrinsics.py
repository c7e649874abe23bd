"""The megakernel's target intrinsics (fuse/emit_cuda/intrinsics.py): emitted under a ROCm target, the kernel calls
no CUDA or PTX intrinsic and takes every ordered memory operation from the linked LLVM IR functions; under no target
or a CUDA one, it is the CUDA kernel it always was. And the task programs planned for the AMD targets' CU counts
(64 on gfx1201, 40 on gfx1151) decode like the oracle in the simulator and run the counter protocol without a
deadlock, at the SmolLM2 shape too."""

from __future__ import annotations

import re

import pytest
from tvm.target import Target

from luce_compile.errors import UnsupportedError
from luce_compile.fuse.build import plan_programs, target_options
from luce_compile.fuse.emit_cuda import emit_megakernel, intrinsics
from luce_compile.fuse.options import MegakernelOptions
from luce_compile.fuse.program import build_program
from luce_compile.fuse.simulate import TaskSimulator
from luce_compile.graph.oracle import Oracle
from luce_compile.graph.registry import open_graph
from luce_compile.synthetic import cached_synthetic, preset
from luce_compile.targets import get_target
from tests.fuse.test_program import run_protocol
from tests.fuse.test_taskgraph import assert_decodes_like_oracle

ROCM = Target({"kind": "rocm", "mcpu": "gfx1201", "thread_warp_size": 32})
CUDA_ONLY = ("T.cuda.", "T.ptx.", "tirx.cuda.", "tirx.ptx.", "__dp4a", "__shfl")


def tiny_script(target: Target | None, **options) -> str:
    graph, _ = open_graph(cached_synthetic(preset("tiny-llama")))
    prog = build_program(graph, batch=2, n_sms=8, max_context=64, kv_chunk=16, merge_in_last=True)
    opts = MegakernelOptions(threads=256, **options)
    if target is None:
        return emit_megakernel(prog, options=opts).script()
    with target:
        return emit_megakernel(prog, options=opts).script()


@pytest.mark.unit
def test_rocm_kernel_calls_no_cuda_intrinsic():
    script = tiny_script(ROCM, q8_activations=True, prefetch_bytes=0)
    assert not [word for word in CUDA_ONLY if word in script]
    # every ordered operation of the protocol is one of the linked IR functions, each defined there
    called = set(re.findall(r'"(luce_\w+)"', script))
    assert called == {"luce_load_acquire_agent", "luce_atomic_add_agent", "luce_fence_acq_rel_agent",
                      "luce_fence_release_workgroup", "luce_fence_acquire_workgroup", "luce_fence_acq_rel_wavefront"}
    assert all(f"@{name}(" in intrinsics.AMDGPU_IR for name in called)
    for intrinsic in ("llvm.amdgcn.sudot4", "llvm.amdgcn.s.sleep", "llvm.readsteadycounter", "tvm_warp_shuffle"):
        assert intrinsic in script, intrinsic
    # every block barrier is fenced on both sides (TVM's ROCm storage sync alone is a bare s_barrier)
    lines = [line.strip() for line in script.splitlines()]
    syncs = [i for i, line in enumerate(lines) if line.startswith('T.tvm_storage_sync("shared"')]
    assert syncs and all("luce_fence_release_workgroup" in lines[i - 1] and "luce_fence_acquire_workgroup" in
                         lines[i + 1] for i in syncs)


@pytest.mark.unit
def test_cuda_kernel_is_the_same_with_or_without_a_cuda_target_in_scope():
    plain = tiny_script(None, q8_activations=True)
    scoped = tiny_script(Target({"kind": "cuda", "arch": "sm_86"}), q8_activations=True)
    assert plain == scoped
    assert "luce_" not in plain and "T.ptx.ld" in plain and "__dp4a" in plain


@pytest.mark.unit
def test_prefetch_is_refused_on_rocm_rather_than_dropped():
    with pytest.raises(UnsupportedError, match="prefetch"):
        tiny_script(ROCM, prefetch_bytes=4096)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gfx1201", "gfx1151"])
def test_amd_options_turn_off_what_the_isa_lacks(name):
    info = get_target(name)
    opts = target_options(MegakernelOptions(q8_activations=True, q8_mma=True, float_mma=True), info)
    assert (opts.q8_mma, opts.float_mma, opts.prefetch_bytes, opts.q8_activations) == (False, False, 0, True)
    assert opts.threads == info.facts["max_threads_per_block"] == 256
    assert opts.shared_kib * 1024 < info.facts["max_shared_memory_per_block"]


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gfx1201", "gfx1151"])
def test_amd_plans_decode_like_the_oracle(name, rng):
    """The tiny llama planned for the target's CUs (more queues than tasks in some stages) and run in the simulator
    in random and adversarial block orders: logits and ids as the oracle's."""
    info = get_target(name)
    path = cached_synthetic(preset("tiny-llama"))
    graph, _ = open_graph(path)
    opts = target_options(MegakernelOptions(batches=(2,), max_context=40, kv_chunk=8), info)
    prog = plan_programs(graph, info.facts, opts)[2]
    assert len(prog.queue_len) == info.facts["sm_count"]
    sim = TaskSimulator(prog.tg, prog.plan, Oracle(path))
    assert_decodes_like_oracle(path, graph, sim, rng, batch=2, steps=4, adversarial=lambda step: step % 2 == 1)


@pytest.mark.slow  # ~10 s each on 2 shared cores
@pytest.mark.parametrize("name", ["gfx1201", "gfx1151"])
@pytest.mark.parametrize("batch", [1, 8])
def test_amd_plans_of_smollm2_run_the_counter_protocol(name, batch, rng):
    """SmolLM2-135M's task tables as the AMD artifact ships them: every task of two steps runs after its
    dependencies in a random block interleaving, no deadlock (the kernel's spin-waits would hang there)."""
    info = get_target(name)
    graph, _ = open_graph(cached_synthetic(preset("smollm2-135m")))
    opts = target_options(MegakernelOptions(batches=(batch,)), info)
    prog = plan_programs(graph, info.facts, opts)[batch]
    order = run_protocol(prog, epochs=2, rng=rng)
    n = len(prog.tg.tasks)
    assert sorted(order) == sorted(list(range(n)) * 2)
    finished = {t: i for i, t in enumerate(order[:n])}
    assert all(finished[d] < finished[t.id] for t in prog.tg.tasks for d in t.deps)
