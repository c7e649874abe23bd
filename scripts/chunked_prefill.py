"""Time a prompt prefilled in chunks (the engine's default prefill_chunk, 512, as serving runs it): every chunk after
the first attends to the cached prefix through the cache's paged prefill kernel, which `luce-compile bench` (one
call per prompt) never runs. Prints tok/s per prompt length, the median of `--repeat` prompts after a warm-up.

    .venv/bin/python scripts/chunked_prefill.py ARTIFACT [--lens 2048] [--chunk 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    from luce_runtime.engine import Engine, EngineOptions

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--lens", type=int, nargs="+", default=[2048])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    engine = Engine(args.artifact, EngineOptions(max_batch=1, max_context=max(args.lens) + 8, prefill_chunk=args.chunk))
    rng = np.random.default_rng(0)
    for n in args.lens:
        times = []
        for i in range(args.repeat + 1):  # the first is a warm-up
            seq = engine.add_sequence()
            tokens = rng.integers(1, 1000, n).tolist()
            start = time.perf_counter()
            engine.prefill([seq], [tokens])
            if i:
                times.append(time.perf_counter() - start)
            engine.remove_sequence(seq)
        print(f"prefill {n} tokens in chunks of {args.chunk}: {n / float(np.median(times)):.1f} tok/s "
              f"(median of {args.repeat}: {float(np.median(times)):.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
