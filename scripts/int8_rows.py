"""Per-row cost of the CPU's int8 matmuls (issue 13): how much 2..16 activation rows cost against one.

    python scripts/int8_rows.py kernel Q4_K:8960x1536,Q6_K:1536x8960 1,2,4,8,16
    python scripts/int8_rows.py model ART      # an int8 artifact: decode of B sequences, verify of S rows

`kernel` times the scheduled kernel (schedules/cpu/int8_gemv.py) alone on random weights, medians of 7 x 5 calls;
`model` prefills 64 random tokens into 8 sequences and times one step of each, medians of 5 (rolled back after
each). The machine is shared: note `uptime` beside the numbers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (random weights, activations)


def kernel(shapes: str, rows_list: str) -> None:
    import tvm
    from luce_schedules.cpu.int8_gemv import Int8GEMV

    from luce_compile.lower.cpu_int8 import int8_format, int8_matmul, quantize_q8
    from luce_compile.lower.quant_layout import repack
    from tests.lower.test_cpu_int8 import HOST, activations, run
    from tests.lower.test_quant_matmul import random_raw

    rng = np.random.default_rng(0)
    for spec in shapes.split(","):
        kind, dims = spec.split(":")
        n_out, n_in = (int(d) for d in dims.split("x"))
        fmt = int8_format(kind)
        planes = [tvm.runtime.tensor(p) for p in repack(random_raw(kind, n_out, n_in, rng), kind).values()]
        libs = {}
        for batch in (1, "dynamic"):
            sch = Int8GEMV().apply(int8_matmul(kind, n_out, n_in, batch=batch), HOST)
            libs[batch] = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=HOST).mod
        for rows in (int(r) for r in rows_list.split(",")):
            x = np.concatenate([activations(rng, n_in) for _ in range(rows)])
            outs = list(fmt.specs(n_in, rows).values())
            q = [tvm.runtime.tensor(v) for v in run(quantize_q8(n_in, fmt, batch="dynamic"), x, outs=outs)]
            y = tvm.runtime.tensor(np.zeros((rows, n_out), "float32"))
            for batch in (1, "dynamic") if rows == 1 else ("dynamic",):
                timer = libs[batch].time_evaluator("main", tvm.cpu(), number=5, repeat=7)
                us = np.median(timer(*q, *planes, y).results) * 1e6
                print(f"{kind} {n_out}x{n_in} rows {rows:2d} ({batch} kernel): {us:9.1f} us", flush=True)


def model(art: str) -> None:
    from luce_runtime.engine import Engine, EngineOptions

    engine = Engine(art, EngineOptions(max_batch=9, max_context=1024))
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 5000, 64)]
    seqs = [engine.add_sequence() for _ in range(8)]
    engine.prefill(seqs, [prompt] * 8)

    def median_ms(step) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return 1000 * sorted(times)[2]

    def decode(b: int) -> None:
        engine.decode(seqs[:b], [7] * b)
        for s in seqs[:b]:
            engine.rollback(s, 1)

    def verify(rows: int) -> None:
        engine.verify([seqs[0]], [[7] * rows])
        engine.rollback(seqs[0], rows)

    decode(1), verify(1)  # warm up
    for b in (1, 2, 4, 8):
        print(f"{art}: decode B={b}: {median_ms(lambda b=b: decode(b)):.1f} ms", flush=True)
    for rows in (1, 2, 4, 8, 16):
        print(f"{art}: verify S={rows}: {median_ms(lambda rows=rows: verify(rows)):.1f} ms", flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "kernel" and len(sys.argv) == 4:
        kernel(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "model":
        model(sys.argv[2])
    else:
        sys.exit(__doc__)
