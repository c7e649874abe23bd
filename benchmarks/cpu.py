"""CPU table: luce-compile (compiled for this CPU) next to llama.cpp on the same GGUF files, same threads, one run.

    .venv/bin/python benchmarks/cpu.py [--models smollm2-135m synthetic:qwen3-0.6b ...] [--threads 2] [--batch 8]

Each engine runs in its own subprocess (TVM's and llama.cpp's thread pools would otherwise compete), one after the
other. Writes benchmarks/results/cpu-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from report import cpu_table, write_results  # noqa: E402

# the real models (issue 13 adds Qwen2.5-Coder-0.5B), then issue 6's workloads as synthetic GGUFs of real shapes
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "synthetic:llama-1b-body",
          "synthetic:llama-1b-body-bf16", "synthetic:qwen3-0.6b")


def run_one(engine: str, model: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--only", engine, "--models", model, "--threads", str(args.threads),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--batch", str(args.batch),
           "--prefill-lens", *map(str, args.prefill_lens), *(["--no-tune-logs"] if args.no_tune_logs else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(engine: str, model: str, args: argparse.Namespace) -> dict:
    from luce_compile.cli import resolve_model

    gguf = resolve_model(model)
    if engine == "llama.cpp":
        from peers.llama_cpp_cpu import bench_llama_cpp, bench_llama_cpp_batched

        result = bench_llama_cpp(gguf, threads=args.threads, prompt_len=args.prompt_len, gen_len=args.gen_len,
                                 prefill_lens=args.prefill_lens)
        if args.batch > 1:
            result["batch"] = args.batch
            result["decode_batch_tok_s"] = bench_llama_cpp_batched(
                gguf, threads=args.threads, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch)
        return result
    from luce_compile.codegen.compile import compile_model
    from luce_compile.models import cache_dir

    art = compile_model(gguf, "cpu", cache_dir() / "bench" / f"{gguf.stem}.cpu", overwrite=True,  # our cache
                        use_tune_logs=not args.no_tune_logs)
    from luce_runtime.bench import bench_artifact

    result = bench_artifact(art, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch, repeat=3,
                            prefill_lens=args.prefill_lens, prefill_repeat=1).to_dict()
    tuning = json.loads((art / "manifest.json").read_text())["kernels"].get("tuning") or {}
    result["tuning"] = {k: tuning.get(k) for k in ("log_target", "tuned", "default")}  # what the header says
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[512, 2048], help="also time prefill of these")
    p.add_argument("--only", choices=["luce-compile", "llama.cpp"])
    p.add_argument("--no-tune-logs", action="store_true",
                   help="build luce-compile with the rule defaults (tuned vs untuned; the records otherwise apply)")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args()
    if args.only:
        print(json.dumps(measure(args.only, args.models[0], args)))
        return 0
    import llama_cpp
    import tvm
    from luce_runtime.bench import machine_load

    import luce_compile

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": platform.processor() or _cpu_name(),
            "threads": args.threads, "load_avg_1m": machine_load(), "luce_compile": luce_compile.__version__,
            "tvm": tvm.__version__, "llama_cpp": llama_cpp.__version__, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "prefill_lens": args.prefill_lens, "command": "python benchmarks/cpu.py " + " ".join(sys.argv[1:])}
    rows = [{"model": m, "engine": e, "result": run_one(e, m, args)}
            for m in args.models for e in ("luce-compile", "llama.cpp")]
    markdown = cpu_table(rows, meta)
    write_results(args.out / f"cpu-{meta['date'][:10]}", {"meta": meta, "rows": rows}, markdown)
    print(markdown)
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
