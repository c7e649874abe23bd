"""The engine's megakernel decode step on the GPU: device time beside the host's wall clock, and where one step's
time goes, task by task (issue 11). Runs on the GPU machine (runtime and this tree; run.sh's set-up):

    python3 benchmarks/h200/engine_profile.py WORKLOAD_DIR --gguf W.gguf [--context 512] [--steps 64] [--out F]

WORKLOAD_DIR is one of .gpucheck/h200's (its artifact/ and spec); the GGUF the one run.sh generated there (the
programs are planned again from it and must match the compiled kernels' fingerprints, to name each task's opcode).
For batch 1 and 8, after prompts of `context` random tokens:
- host µs a step: median wall clock of Engine.decode_greedy (luce_runtime.timing, as the H200 table);
- device µs a step: median span of the kernel's own task clocks (first task's start to the last task's end, the
  GPU's global timer) over the same number of steps with the clocks on (the stamps cost a few ns a task);
- one step's profile (luce_compile.fuse.program.profile_summary): per opcode and per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]


def _span_us(clocks: np.ndarray) -> float:
    stamped = clocks[..., :3]
    return float(stamped[:, :, 2].max() - stamped[stamped > 0].min()) / 1e3


def planned_programs(manifest: dict, gguf: Path) -> dict:
    """The megakernel programs an artifact was compiled from, planned again here from its GGUF and manifest (the
    graph as compile built it: its NEOX rows interleaved where the manifest says so, graph/rope_pairs.py)."""
    from luce_compile.fuse.build import MegakernelOptions, plan_programs
    from luce_compile.graph.registry import open_graph
    from luce_compile.graph.rope_pairs import interleave_rope_pairs
    from luce_compile.targets import get_target

    graph, _ = open_graph(gguf)
    if manifest["kernels"].get("rope_rows_interleaved"):
        graph = interleave_rope_pairs(graph)
    section = manifest["megakernel"]
    return plan_programs(graph, get_target(manifest["target"]["name"]).facts,
                         MegakernelOptions(**{k: (tuple(v) if isinstance(v, list) else v)
                                              for k, v in section["options"].items()}))


def profile_engine(workload: Path, gguf: Path, context: int, steps: int) -> dict:
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.timing import call_times

    from luce_compile.fuse.build import program_fingerprint
    from luce_compile.fuse.program import profile_summary

    engine = Engine(workload / "artifact", EngineOptions(max_batch=8, max_context=context + steps + 16,
                                                         megakernel=True))  # every kernel, whichever is faster
    mk = engine.megakernel
    if mk is None:
        raise SystemExit(f"engine_profile: {workload} decodes without a megakernel: {engine.decode_path}")
    section = engine.artifact.manifest["megakernel"]
    programs = planned_programs(engine.artifact.manifest, gguf)
    rng = np.random.default_rng(0)
    vocab = int(engine.config["n_vocab"])
    out: dict = {"context": context, "steps": steps, "batches": {}}
    for b in (1, 8):
        if mk.kernel_for(b) != b:
            continue
        if program_fingerprint(programs[b]) != section["kernels"][str(b)]["fingerprint"]:
            raise SystemExit(f"engine_profile: the batch-{b} program planned here differs from the compiled one")
        seqs = [engine.add_sequence() for _ in range(b)]
        engine.prefill(seqs, [rng.integers(0, vocab, context).tolist() for _ in seqs])
        tokens = rng.integers(0, vocab, b).tolist()

        def step(seqs: list[int] = seqs, tokens: list[int] = tokens) -> None:
            tokens[:] = engine.decode_greedy(seqs, tokens)

        host = call_times(step, steps // 2, warmup=2, sync=engine.device.sync)
        mk.profiling = True
        spans = []
        for _ in range(steps // 2):
            step()
            spans.append(_span_us(mk.profile()))
        summary = profile_summary(programs[b], mk.profile())
        mk.profiling = False
        for s in seqs:
            engine.remove_sequence(s)
        host_us, device_us = float(np.median(host)) * 1e6, float(np.median(spans))
        out["batches"][str(b)] = {"host_us_per_step": round(host_us, 1), "device_us_per_step": round(device_us, 1),
                                  "tok_s_host": round(b / host_us * 1e6, 1),
                                  "tok_s_device": round(b / device_us * 1e6, 1), "profile": summary}
        print(f"b={b}: host {host_us:.1f} us, device {device_us:.1f} us a step", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    text = json.dumps(profile_engine(args.workload, args.gguf, args.context, args.steps), indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
