"""How many threads the CPU kernels run on: one per physical core this process may use, llama.cpp's default.

TVM's thread pool, left alone, takes std::thread::hardware_concurrency() / 2 on x86 (it assumes two hyper-threads
a core). On a machine with one thread a core (most cloud VMs; this project's 2-vCPU Zen 3 CI machine) every kernel
then ran on half the cores: `luce-compile run` on SmolLM2 decoded at about half the speed `benchmarks/cpu.py`
measured with TVM_NUM_THREADS=2. TVM reads TVM_NUM_THREADS once, when its pool starts (the first parallel kernel),
and cannot grow the pool after, so the count goes into the environment before anything runs: `luce_runtime`'s
import does it (`claim_cores`), and `--threads N` or TVM_NUM_THREADS set by the user win.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

ENV = "TVM_NUM_THREADS"


def _usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _cgroup_limit() -> int | None:
    """The container's CPU quota (cgroup v2 cpu.max, "QUOTA PERIOD"), rounded up; None when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core counted once), at most the
    cgroup's CPU quota; the CPU count where the topology cannot be read."""
    cpus = _usable_cpus()
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package, core = ((topology / name).read_text().strip() for name in ("physical_package_id", "core_id"))
            cores.add((package, core))
        except OSError:
            cores = set()
            break
    count = len(cores) or len(cpus)
    limit = _cgroup_limit()
    return max(1, min(count, limit) if limit else count)


def claim_cores(threads: int | None = None) -> int:
    """Set the kernels' thread count before TVM's pool starts: `threads` if given, else the user's TVM_NUM_THREADS,
    else `physical_cores()`. Returns the count the pool will take (if it has not started yet)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, not {threads}")
        os.environ[ENV] = str(threads)
    elif not os.environ.get(ENV):  # unset or empty (TVM takes an empty value as unset)
        os.environ[ENV] = str(physical_cores())
    value = os.environ[ENV]
    return int(value) if value.isdigit() else physical_cores()  # TVM ignores what is not a number
