"""Long context on the CPU (issue 38): a 16K-token prompt prefilled in 512-token chunks, then decode at that depth,
luce-compile (one build per --kv-cache type) and llama.cpp (llama-cpp-python, flash attention, f16 KV: llama-bench's
`-fa 1` default cache) in the same run, each engine in its own subprocess, one after the other.

    nice .venv/bin/python benchmarks/long_context.py --model qwen2.5-coder-0.5b --prompt-len 16384 --kv-cache f32 f16

Each 512-token chunk is timed on its own, so the growth with depth is visible: a chunk at depth c costs its GEMMs
(constant) plus its attention over c cached keys (linear in c), so the whole prompt's time is quadratic in its
length. Decode: the median of --gen greedy steps after the prompt. Writes benchmarks/results/cpu-<date>-long-context
.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
CHUNK = 512


def ours(gguf: Path, kv_cache: str, prompt: list[int], gen: int) -> dict:
    from luce_compile.codegen.compile import compile_model
    from luce_compile.models import cache_dir

    art = compile_model(gguf, "cpu", cache_dir() / "bench" / f"{gguf.stem}.cpu.kv{kv_cache}", overwrite=True,
                        kv_cache=kv_cache)
    from luce_runtime.engine import Engine, EngineOptions

    engine = Engine(art, EngineOptions(max_batch=1, max_context=len(prompt) + gen + 16, prefill_chunk=CHUNK))
    seq = engine.add_sequence()
    chunks = []
    for at in range(0, len(prompt), CHUNK):
        start = time.perf_counter()
        logits = engine.prefill([seq], [prompt[at:at + CHUNK]])[0]
        chunks.append(time.perf_counter() - start)
    token, steps = int(np.argmax(logits)), []
    for _ in range(gen):
        start = time.perf_counter()
        token = engine.decode_greedy([seq], [token])[0]
        steps.append(time.perf_counter() - start)
    manifest = json.loads((Path(art) / "manifest.json").read_text())
    return {"chunk_s": chunks, "decode_step_s": steps, "precision": manifest["kernels"]["precision"],
            "kv_dtype": manifest["runtime"]["kv_dtype"]}


def llama_cpp(gguf: Path, prompt: list[int], gen: int, threads: int) -> dict:
    import llama_cpp as lc

    llm = lc.Llama(str(gguf), n_ctx=len(prompt) + gen + 16, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads,
                   n_threads_batch=threads, flash_attn=True, verbose=False)
    chunks = []
    for at in range(0, len(prompt), CHUNK):
        start = time.perf_counter()
        llm.eval(prompt[at:at + CHUNK])
        chunks.append(time.perf_counter() - start)
    token, steps = int(np.argmax(llm.eval_logits[-1])), []
    for _ in range(gen):
        start = time.perf_counter()
        llm.eval([token])
        steps.append(time.perf_counter() - start)
        token = int(np.argmax(llm.eval_logits[-1]))  # outside the timed call (a Python list)
    return {"chunk_s": chunks, "decode_step_s": steps, "version": lc.__version__, "kv_dtype": "float16"}


def summary(r: dict, prompt_len: int) -> dict:
    return {"prefill_s": sum(r["chunk_s"]), "prefill_tok_s": prompt_len / sum(r["chunk_s"]),
            "first_chunk_s": r["chunk_s"][0], "last_chunk_s": r["chunk_s"][-1],
            "decode_tok_s": 1 / statistics.median(r["decode_step_s"])}


def markdown(doc: dict) -> str:
    n = doc["prompt_len"]
    lines = [f"# Long context on the CPU, {doc['model']}, {doc['date']}", "", f"`{doc['command']}` ({doc['cpu']}, "
             f"{doc['threads']} threads): a {n:,}-token prompt of random ids in {CHUNK}-token chunks, then "
             f"{doc['gen']} greedy decode steps at depth {n:,} (median).", "",
             f"| engine | KV | prefill {n:,} (s) | tok/s | first chunk (s) | last chunk (s) | decode at {n:,} tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in doc["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | | error: {r['error'][-200:]!r} | | | | |")
            continue
        s = r["summary"]
        lines.append(f"| {name} | {r['kv_dtype']} | {s['prefill_s']:.1f} | {s['prefill_tok_s']:.1f} | "
                     f"{s['first_chunk_s']:.2f} | {s['last_chunk_s']:.2f} | {s['decode_tok_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache", nargs="+", default=["f32", "f16"], help="luce-compile builds to run")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--only", help=argparse.SUPPRESS)  # "ours:<kv>" or "llama.cpp": one engine, JSON on stdout
    args = p.parse_args()
    from luce_compile.cli import resolve_model

    gguf = resolve_model(args.model)
    vocab = 151_000 if "qwen" in gguf.name.lower() else 32_000  # ids every tokenizer of the family has
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_len).tolist()
    if args.only:
        r = (llama_cpp(gguf, prompt, args.gen, args.threads) if args.only == "llama.cpp" else
             ours(gguf, args.only.split(":")[1], prompt, args.gen))
        print(json.dumps(r))
        return 0
    engines = [f"ours:{kv}" for kv in args.kv_cache] + ([] if args.no_llama_cpp else ["llama.cpp"])
    env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    runs = {}
    for engine in engines:
        cmd = [sys.executable, __file__, "--only", engine, "--model", args.model, "--prompt-len",
               str(args.prompt_len), "--gen", str(args.gen), "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            runs[engine] = {"error": out.stderr[-2000:]}
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        runs[engine] = r | {"summary": summary(r, args.prompt_len)}
        print(engine, runs[engine]["summary"], file=sys.stderr, flush=True)
    from report import write_results

    from luce_compile.targets import host_cpu

    doc = {"model": gguf.name, "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
           "cpu": host_cpu(), "threads": args.threads, "prompt_len": args.prompt_len, "gen": args.gen, "runs": runs}
    md = markdown(doc)
    write_results(ROOT / "results" / f"cpu-{datetime.now(UTC):%Y-%m-%d}-long-context", doc, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
