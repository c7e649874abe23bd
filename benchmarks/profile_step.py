"""Where a decode step's time goes, kernel by kernel: the artifact's compiled decode function run under the Relax
VM's instrument hook, which is called before and after every call the function makes (kernels and runtime builtins
such as the paged-KV attention), each interval timed with the device synchronized (luce_runtime.timing's method).

    .venv/bin/python benchmarks/profile_step.py ART|MODEL [--context 128] [--batch 1] [--steps 16] [--top 25]

MODEL compiles for this machine first (as `luce-compile bench` does). Prints, per callee, calls and microseconds a
step and the share of the step, largest first, and the sum against the step's own wall time (the difference is the
VM's own work between calls and the hook's cost, ~1-2 us a call). On the CPU each kernel returns when done, so the
intervals are the kernels' times; on a GPU the per-op path runs CUDA graphs, which show as one call each.
`--json` writes the table as JSON. The megakernel is off here: it is one call, profiled by its own task clocks
(benchmarks/h200/engine_profile.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]


def profile_decode(artifact: str, *, context: int, batch: int, steps: int) -> dict:
    from luce_runtime.engine import Engine, EngineOptions

    engine = Engine(artifact, EngineOptions(max_batch=batch, max_context=context + 2 * steps + 8,
                                            prefill_chunk=max(context, 16), megakernel=False))
    sync = engine.device.sync
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    started: list[float] = []

    def instrument(func, symbol: str, before: bool, ret, *args) -> int:  # noqa: ANN001  (the VM's signature)
        sync()
        if before:
            started.append(time.perf_counter())
        else:
            totals[symbol] += time.perf_counter() - started.pop()
            calls[symbol] += 1
        return 0  # VMInstrumentReturnKind.kNoOp: run the call as usual

    rng = np.random.default_rng(0)
    vocab = int(engine.config["n_vocab"])
    seqs = [engine.add_sequence() for _ in range(batch)]
    engine.prefill(seqs, [rng.integers(0, vocab, context).tolist() for _ in seqs])
    tokens = rng.integers(0, vocab, batch).tolist()
    for _ in range(2):  # warm-up
        tokens = engine.decode_greedy(seqs, tokens)
    walls = []
    for profiled in (False, True):
        if profiled:
            engine.vm.set_instrument(instrument)
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            tokens = engine.decode_greedy(seqs, tokens)
            sync()
            if not profiled:
                walls.append(time.perf_counter() - t0)
    engine.vm.set_instrument(None)
    step_us = float(np.median(walls)) * 1e6
    rows = sorted(((s, calls[s] / steps, totals[s] / steps * 1e6) for s in totals), key=lambda r: -r[2])
    inside = sum(us for _, _, us in rows)
    return {"artifact": str(artifact), "target": engine.artifact.manifest["target"]["name"], "context": context,
            "batch": batch, "steps": steps, "step_us_unprofiled": round(step_us, 1),
            "step_us_in_calls": round(inside, 1),
            "callees": [{"symbol": s, "calls_per_step": n, "us_per_step": round(us, 1),
                         "share": round(us / inside, 4)} for s, n, us in rows]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an artifact directory, or a model to compile for this machine first")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    artifact = args.model
    if not (Path(artifact) / "manifest.json").is_file():
        from luce_compile.cli import serve_path

        artifact = str(serve_path(args.model, "cpu"))
    out = profile_decode(artifact, context=args.context, batch=args.batch, steps=args.steps)
    print(f"{out['target']}, batch {out['batch']}, context {out['context']}: step {out['step_us_unprofiled']:,.0f} us "
          f"unprofiled, {out['step_us_in_calls']:,.0f} us inside calls when profiled")
    print(f"{'us/step':>10} {'share':>7} {'calls':>6}  callee")
    for r in out["callees"][:args.top]:
        print(f"{r['us_per_step']:>10,.1f} {100 * r['share']:>6.1f}% {r['calls_per_step']:>6.1f}  {r['symbol']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
