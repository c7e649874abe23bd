"""Where luce-compile's decode step spends its GPU time: per-kernel durations of a few decode steps under Nsight
Compute, grouped by kernel. Runs on the GPU machine after benchmarks/h200/run.sh's set-up (or standalone):

    ncu --clock-control none --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum \
        --csv --page raw python3 benchmarks/h200/profile_decode.py ARTIFACT --batch 8 > decode_b8.csv
    .venv/bin/python benchmarks/h200/profile_decode.py --summarize decode_b8.csv       (here)

Only the timed steps are profiled (cudaProfilerStart/Stop around them); the prompt is 512 tokens, as in the table.
`--prefill N` profiles one prefill of N tokens instead (after a warm-up prefill of the same length; summarize with
--steps 1): where pp512/pp2048 go, GEMMs against attention.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
from collections import defaultdict
from pathlib import Path


def profile(artifact: str, batch: int, steps: int, prefill: int = 0) -> None:
    import ctypes

    import numpy as np

    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    from luce_runtime.engine import Engine, EngineOptions

    engine = Engine(artifact, EngineOptions(max_batch=batch, max_context=max(1024, prefill + 16), prefill_chunk=512))
    cudart = ctypes.CDLL(next(str(p) for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
                              for p in sorted(Path(d).glob("libcudart.so*"))))
    rng = np.random.default_rng(0)
    if prefill:
        for profiled in (False, True):
            seq = engine.add_sequence()
            if profiled:
                cudart.cudaProfilerStart()
            engine.prefill([seq], [rng.integers(0, 49152, prefill).tolist()])
            engine.device.sync()
            engine.remove_sequence(seq)
        cudart.cudaProfilerStop()
        return
    seqs = [engine.add_sequence() for _ in range(batch)]
    engine.prefill(seqs, [rng.integers(0, 49152, 512).tolist() for _ in seqs])
    tokens = rng.integers(0, 49152, batch).tolist()
    for _ in range(3):  # warm-up: CUDA graphs captured, allocator settled
        tokens = np.argmax(engine.decode(seqs, tokens), axis=-1).tolist()
    cudart.cudaProfilerStart()
    for _ in range(steps):
        tokens = np.argmax(engine.decode(seqs, tokens), axis=-1).tolist()
    engine.device.sync()
    cudart.cudaProfilerStop()


def summarize(path: Path, steps: int) -> str:
    """ncu's raw CSV → kernel name, launches per step, µs per step, share; sorted by time."""
    text = path.read_text()
    start = text.index('"ID"')  # ncu prints its own log lines before the table
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for r in rows[1:]:  # the first row holds the units
        name = r["Kernel Name"].split("(")[0]
        total[name] += float(r["gpu__time_duration.sum"].replace(",", ""))  # ncu writes 4,224
        count[name] += 1
    unit = rows[0]["gpu__time_duration.sum"]
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
    grand = sum(total.values())
    lines = [f"{path.name}: {len(rows) - 1} kernels over {steps} steps, {grand * scale / steps:.1f} µs of kernel time "
             "per step", "| kernel | launches/step | µs/step | share |", "|---|---|---|---|"]
    for name, t in sorted(total.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name[:80]} | {count[name] / steps:.0f} | {t * scale / steps:.1f} | {100 * t / grand:.1f}% |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    p.add_argument("--summarize", type=Path, help="print the per-kernel table of an ncu CSV")
    args = p.parse_args()
    if args.summarize:
        print(summarize(args.summarize, args.steps))
    else:
        profile(args.artifact, args.batch, args.steps, args.prefill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
