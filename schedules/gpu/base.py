"""What every GPU rule shares: knob handling, target limits and facts, and the guard that turns a primitive's
refusal into "not my function" (dlight's contract) instead of a crashed build."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import ClassVar

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from luce_compile.errors import UnsupportedError
from luce_compile.targets import facts_for

log = logging.getLogger(__name__)
Knobs = Mapping[str, int]
GPU_KINDS = ("cuda", "rocm")


def fit(extent: int, want: int) -> int:
    """The largest divisor of `extent` not above `want` (a split by it needs no bounds check)."""
    return max(d for d in range(1, min(extent, max(want, 1)) + 1) if extent % d == 0)


def max_threads(target: Target) -> int:
    return int(target.attrs["max_num_threads"])


def warp_size(target: Target) -> int:
    return int(target.attrs.get("thread_warp_size", 32))


def sm_count(target: Target, default: int = 64) -> int:
    """Streaming multiprocessors (CUDA) / compute units (ROCm) of the registry's hardware for this target."""
    return int(facts_for(target).get("sm_count", default))


class GPURule(ScheduleRule):
    """A dlight ScheduleRule with named knobs; subclasses implement `schedule` (None = not my function)."""

    name: ClassVar[str]
    DEFAULTS: ClassVar[dict[str, int]]
    SPACE: ClassVar[dict[str, tuple[int, ...]]]

    def knobs(self, knobs: Knobs | bool | None = None) -> dict[str, int]:
        """DEFAULTS overridden by `knobs` (a bool is dlight's `tunable` flag and means defaults)."""
        given = dict(knobs) if isinstance(knobs, Mapping) else {}
        unknown = set(given) - set(self.DEFAULTS)
        if unknown:
            raise UnsupportedError(f"schedules: {self.name} has no knob(s) {sorted(unknown)}; "
                                   f"its knobs are {sorted(self.DEFAULTS)}")
        return self.DEFAULTS | given

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
