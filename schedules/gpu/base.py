"""What every GPU rule shares: knob handling, target limits and facts, and the guard that turns a primitive's
refusal into "not my function" (dlight's contract) instead of a crashed build."""

from __future__ import annotations

import logging

from luce_schedules.knobs import KnobbedRule, Knobs, fit  # noqa: F401  (fit is re-exported for the GPU rules)
from tvm import s_tir, tirx
from tvm.target import Target

from luce_compile.targets import facts_for

log = logging.getLogger(__name__)
GPU_KINDS = ("cuda", "rocm")


def max_threads(target: Target) -> int:
    return int(target.attrs["max_num_threads"])


def warp_size(target: Target) -> int:
    return int(target.attrs.get("thread_warp_size", 32))


def sm_count(target: Target, default: int = 64) -> int:
    """Streaming multiprocessors (CUDA) / compute units (ROCm) of the registry's hardware for this target."""
    return int(facts_for(target).get("sm_count", default))


class GPURule(KnobbedRule):
    """A knobbed dlight rule for GPU targets; subclasses implement `schedule` (None = not my function)."""

    def apply(self, func: tirx.PrimFunc, target: Target, knobs: Knobs | bool | None = None) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name not in GPU_KINDS:
            return None
        sch = s_tir.Schedule(func)
        try:
            done = self.schedule(sch, target, self.knobs(knobs))
        except s_tir.ScheduleError as err:  # matched, but a primitive refused: let the next rule try
            log.warning("%s declined %s after matching it: %s", self.name, func.attrs.get("global_symbol"), err)
            return None
        return sch if done else None

    def schedule(self, sch: s_tir.Schedule, target: Target, knobs: dict[str, int]) -> bool:
        raise NotImplementedError


def root_blocks(sch: s_tir.Schedule) -> list[s_tir.schedule.SBlockRV] | None:
    try:
        return list(sch.get_child_blocks(sch.get_sblock("root")))
    except (s_tir.ScheduleError, ValueError):
        return None


def bind_spatial(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, threads: int, vector: int = 1) -> None:
    """Fuse a spatial block's loops and spread them over blocks × threads (× `vector` elements per thread)."""
    fused = sch.fuse(*sch.get_loops(block))
    if vector > 1:
        bx, tx, vec = sch.split(fused, [None, threads, vector])
        sch.vectorize(vec)
    else:
        bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
