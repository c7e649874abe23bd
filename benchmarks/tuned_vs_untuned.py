"""Tuned against untuned, end to end on this CPU: both builds of a model (`compile` with the shipped tuning records,
and with `--no-tune-logs`) loaded in one process and their calls alternated, so that both see the same machine.
Separate processes minutes apart are too noisy on a shared 2-core machine for a 5% effect (benchmarks/README.md,
Tuning). Every number is a median of luce_runtime.timing samples.

    .venv/bin/python benchmarks/tuned_vs_untuned.py [--models smollm2-135m ...] [--steps 48] [--batch 8]
        [--prompt-len 128] [--prefill-len 512] [--threads 2] [--out benchmarks/results]

Per model: a greedy decode step at batch 1 and at --batch after --prompt-len-token prompts (each step alternates the
two builds), and the prefill of one --prefill-len prompt (3 alternating rounds). Writes tune-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]
BUILDS = ("untuned", "tuned")


def build(model: str, tuned: bool) -> tuple[Path, dict]:
    """The artifact (compile's cache: an unchanged build is not rebuilt) and its manifest's tuning report."""
    from luce_compile.cli import resolve_model
    from luce_compile.codegen.compile import compile_model
    from luce_compile.models import cache_dir

    gguf = resolve_model(model)
    out = cache_dir() / "bench" / f"{gguf.stem}.cpu-{'tuned' if tuned else 'untuned'}"
    art = compile_model(gguf, "cpu", out, overwrite=True, use_tune_logs=tuned)
    tuning = json.loads((art / "manifest.json").read_text())["kernels"].get("tuning") or {}
    return art, {k: tuning.get(k) for k in ("log_target", "tuned", "default", "files")}


def alternate(engines: dict, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Median seconds of a greedy decode step of len(prompts) sequences, the builds' steps alternated."""
    from luce_runtime.timing import call_times

    state = {}
    for name, engine in engines.items():
        seqs = [engine.add_sequence() for _ in prompts]
        engine.prefill(seqs, prompts)
        state[name] = (seqs, [p[-1] for p in prompts])
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(steps + 1):  # the first step of each is a warm-up
            for name, engine in engines.items():
                seqs, tokens = state[name]

                def step(engine=engine, seqs=seqs, tokens=tokens) -> None:
                    tokens[:] = engine.decode_greedy(seqs, tokens)

                times[name] += call_times(step, 1, warmup=0, sync=engine.device.sync)
    finally:
        for name, engine in engines.items():
            for s in state[name][0]:
                engine.remove_sequence(s)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def alternate_prefill(engines: dict, prompt: list[int], rounds: int = 3) -> dict[str, float]:
    from luce_runtime.timing import call_times

    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds + 1):  # the first round is a warm-up
        for name, engine in engines.items():
            def once(engine=engine) -> None:
                seq = engine.add_sequence()
                try:
                    engine.prefill([seq], [prompt])
                finally:
                    engine.remove_sequence(seq)

            times[name] += call_times(once, 1, warmup=0, sync=engine.device.sync)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def measure(model: str, args: argparse.Namespace) -> dict:
    arts = {name: build(model, name == "tuned") for name in BUILDS}
    # after the builds: luce_runtime loads TVM's runtime alone, and the compiler's relax does not import after it
    import numpy as np
    from luce_runtime.engine import Engine, EngineOptions

    longest = max(args.prompt_len, args.prefill_len)
    engines = {name: Engine(art, EngineOptions(max_batch=args.batch, max_context=longest + args.steps + 8))
               for name, (art, _) in arts.items()}
    vocab = int(engines["tuned"].config["n_vocab"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    one = alternate(engines, prompts[:1], args.steps)
    many = alternate(engines, prompts, args.steps)
    prefill = alternate_prefill(engines, rng.integers(0, vocab, args.prefill_len).tolist())
    return {"model": model, "tuning": {name: info for name, (_, info) in arts.items()},
            "decode_tok_s": {n: 1 / one[n] for n in BUILDS},
            "decode_batch_tok_s": {n: args.batch / many[n] for n in BUILDS},
            "prefill_tok_s": {n: args.prefill_len / prefill[n] for n in BUILDS}}


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"# Tuned vs untuned on the CPU ({meta['date']})", "",
             f"{meta['cpu']}, {meta['threads']} threads; both builds in one process, their calls alternated; "
             f"prompt {meta['prompt_len']} tokens, medians of {meta['steps']} decode steps, 3 prefills.", "",
             f"Command: `{meta['command']}`", "",
             f"| model | kernels tuned | decode tok/s (b=1) untuned / tuned | decode tok/s (b={meta['batch']}) "
             f"untuned / tuned | pp{meta['prefill_len']} tok/s untuned / tuned |", "|---|---|---|---|---|"]
    for r in rows:
        t = r["tuning"]["tuned"]
        cells = [f"{r[k]['untuned']:.1f} / {r[k]['tuned']:.1f} ({r[k]['tuned'] / r[k]['untuned'] - 1:+.1%})"
                 for k in ("decode_tok_s", "decode_batch_tok_s", "prefill_tok_s")]
        lines.append(f"| {r['model']} | {t['tuned']}/{t['tuned'] + t['default']} ({t['log_target']}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before luce_runtime starts TVM's pool
    from cpu import _cpu_name
    from report import write_results

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": platform.processor() or _cpu_name(),
            "threads": args.threads, "steps": args.steps, "batch": args.batch, "prompt_len": args.prompt_len,
            "prefill_len": args.prefill_len,
            "command": "python benchmarks/tuned_vs_untuned.py " + " ".join(sys.argv[1:])}
    rows = [measure(m, args) for m in args.models]
    markdown = table(rows, meta)
    write_results(args.out / f"tune-{meta['date'][:10]}", {"meta": meta, "rows": rows}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
