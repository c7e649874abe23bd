"""luce_runtime.threads: the kernels run on one thread per physical core unless told otherwise. TVM's own default is
half the hardware threads on x86, which on a machine with one thread a core (this CI machine kind) halved every
CPU kernel's speed; each check runs a fresh interpreter, since TVM sizes its pool once, when it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from luce_runtime.threads import physical_cores

POOL = "import {first}, tvm; print(tvm.get_global_func('runtime.NumThreads')())"


def _pool_size(first: str, env: dict[str, str] | None = None) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"} | (env or {})
    out = subprocess.run([sys.executable, "-c", POOL.format(first=first)], env=environ, capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def test_physical_cores_counts_cores_this_process_may_use():
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    siblings = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
                for c in os.sched_getaffinity(0)}
    assert cores <= len(siblings) or cores == len(os.sched_getaffinity(0))


def test_the_runtime_and_the_compiler_size_tvms_pool_to_the_physical_cores():
    assert _pool_size("luce_runtime") == physical_cores()
    assert _pool_size("luce_compile") == physical_cores()


def test_the_users_thread_count_wins():
    assert _pool_size("luce_runtime", {"TVM_NUM_THREADS": "1"}) == 1


def test_cli_threads_flag_sets_the_pool_and_refuses_zero(tmp_path):
    from luce_compile.cli import main

    assert main(["run", str(tmp_path), "-p", "x", "--threads", "0"]) == 2
    code = ("import sys; from luce_compile.cli import build_parser; from luce_runtime.threads import claim_cores; "
            "a = build_parser().parse_args(['bench', 'm', '--threads', '1']); claim_cores(a.threads); "
            "import tvm; print(tvm.get_global_func('runtime.NumThreads')())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "1"
