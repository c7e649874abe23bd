"""KV cache quantization accuracy as llama.cpp's PR 7412 measured it: KL divergence and top-1 agreement of the
next-token distribution with a q8_0 or q4_0 KV cache against the f16 one, over real text, on llama.cpp itself
(llama-cpp-python, flash attention on: quantized V needs it).

    nice .venv/bin/python benchmarks/kv_accuracy.py --model qwen2.5-coder-0.5b --tokens 4096 --window 2048

The text is Python's own documentation (pydoc_data/topics.py: English prose with code, shipped with CPython), cut
into windows of --window tokens, each evaluated from an empty cache; every position's distribution is compared.
Writes benchmarks/results/kv-accuracy-<date>-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
KV_TYPES = ("f16", "q8_0", "q4_0")


def real_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


BLOCK = 128  # rows turned into float64 log-probabilities at a time (a row is 152K values on Qwen: 1.2 MB)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray) -> tuple[list[float], list[bool]]:
    """Per row: KL(softmax(ref) ‖ softmax(other)) and whether the two argmaxes agree (logits (rows, V))."""
    kl, same = [], []
    for at in range(0, len(ref), BLOCK):
        p, q = log_softmax(ref[at:at + BLOCK]), log_softmax(other[at:at + BLOCK])
        kl += (np.exp(p) * (p - q)).sum(-1).tolist()
        same += (p.argmax(-1) == q.argmax(-1)).tolist()
    return kl, same


def measure(gguf: Path, n_tokens: int, window: int, threads: int) -> dict:
    import llama_cpp as lc

    types = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0}
    models = {t: lc.Llama(str(gguf), n_ctx=window, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          type_k=types[t], type_v=types[t], flash_attn=True, logits_all=True, verbose=False)
              for t in KV_TYPES}
    tokens = models["f16"].tokenize(real_text().encode(), add_bos=False)[:n_tokens]
    kl = {t: [] for t in KV_TYPES[1:]}
    top1 = {t: [] for t in KV_TYPES[1:]}
    for start in range(0, len(tokens) - window + 1, window):
        chunk = tokens[start:start + window]
        for llm in models.values():
            llm.reset()
            llm.eval(chunk)
        ref = models["f16"].scores[:len(chunk)]  # (rows, V) float32 logits, llama-cpp-python's own buffer
        for t in KV_TYPES[1:]:
            a, b = compare(ref, models[t].scores[:len(chunk)])  # KL(f16 ‖ t) per position
            kl[t] += a
            top1[t] += b
        print(f"window at {start}: " + ", ".join(f"{t} KL {np.mean(kl[t]):.5f}" for t in kl), file=sys.stderr)
    return {t: {"kl_mean": float(np.mean(kl[t])), "kl_p99": float(np.percentile(kl[t], 99)),
                "top1": float(np.mean(top1[t])), "positions": len(kl[t])} for t in kl} | {
        "llama_cpp": lc.__version__, "tokens": len(tokens), "window": window}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from luce_compile.cli import resolve_model

    gguf = resolve_model(args.model)
    result = {"model": gguf.name, "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), **measure(gguf, args.tokens, args.window, args.threads)}
    stem = ROOT / "results" / f"kv-accuracy-{datetime.now(UTC):%Y-%m-%d}-{args.model}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [f"| {t} | {result[t]['kl_mean']:.5f} | {result[t]['kl_p99']:.4f} | {100 * result[t]['top1']:.2f}% |"
            for t in KV_TYPES[1:]]
    md = (f"# KV cache quantization accuracy, {gguf.name} (llama.cpp {result['llama_cpp']})\n\n"
          f"`{result['command']}`: {result['tokens']} tokens of Python's documentation in windows of "
          f"{result['window']}, next-token distributions against the f16 KV cache.\n\n"
          "| KV type | KL mean | KL p99 | top-1 agreement |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    Path(f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
