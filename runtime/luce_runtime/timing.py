"""How everything here is timed, in one place: host wall-clock around each call, the device synchronized first.

A sample is `clock()` before and after one call of fn, with `sync()` (the device's: `tvm.device(...).sync()`, via
`Engine.device`) run before the clock starts and before it stops. So the interval holds all the device work the call
queued and none that was queued before it: what a caller sees, on a GPU as on the CPU (where TVM's sync returns at
once). luce_runtime.bench (luce-compile bench, benchmarks/, benchmarks/h200/run.sh) and scripts/device_check.py
take their numbers from here, so one table never mixes two methods; reports give the median of the samples
(robust to the odd descheduled call on a shared machine).

Only the standard library at import: the GPU machine's peers (benchmarks/peers/torch_peer.py) import it without TVM.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

Clock = Callable[[], float]
Sync = Callable[[], None]


def _no_sync() -> None:
    """A device whose calls return only when their work is done (numpy, llama-cpp-python's CPU eval)."""


def call_times(fn: Callable[[], object], repeat: int, warmup: int = 1, *, sync: Sync | None = None,
               clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of each of `repeat` calls of fn(), after `warmup` untimed ones; the device synchronized before the
    clock starts and before it stops (sync; clock: injectable for tests)."""
    if repeat <= 0:
        raise ValueError(f"timing: repeat must be positive, got {repeat}")
    if warmup < 0:
        raise ValueError(f"timing: warmup must be 0 or more, got {warmup}")
    sync = sync or _no_sync
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return times


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 1, *, sync: Sync | None = None,
                clock: Clock = time.perf_counter) -> float:
    """The median of `call_times`: seconds per call."""
    return statistics.median(call_times(fn, repeat, warmup, sync=sync, clock=clock))
