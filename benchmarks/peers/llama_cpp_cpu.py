"""llama.cpp on the CPU through llama-cpp-python: the same GGUF, the same threads, timed like bench_engine."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np


def bench_llama_cpp(gguf: Path, *, threads: int, prompt_len: int, gen_len: int, repeat: int = 3,
                    seed: int = 0, prefill_lens: tuple[int, ...] | list[int] = ()) -> dict:
    """Prefill tok/s (prompt_len random tokens in one eval; also once for each of prefill_lens, as luce-compile's
    bench does on the CPU) and batch-1 decode tok/s (median step)."""
    import llama_cpp

    longest = max(prompt_len, *prefill_lens)
    llm = llama_cpp.Llama(str(gguf), n_ctx=longest + gen_len + 16, n_batch=max(longest, 32),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    rng = np.random.default_rng(seed)
    vocab = llm.n_vocab()

    def prefill(n: int = prompt_len) -> float:
        llm.reset()
        tokens = rng.integers(0, vocab, n).tolist()
        start = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - start

    prefill()  # warm-up
    ttft = statistics.median(prefill() for _ in range(repeat))
    by_len = {n: n / prefill(n) for n in prefill_lens}
    prefill()  # decode continues after a prompt_len prompt, as luce-compile's does
    steps = []
    token = int(rng.integers(0, vocab))
    llm.eval([token])  # warm-up step
    for _ in range(gen_len):
        start = time.perf_counter()
        llm.eval([token])
        steps.append(time.perf_counter() - start)
        # outside the timed region: llama-cpp-python hands the logits over as a Python list (slow to argmax)
        token = int(np.argmax(llm.eval_logits[-1]))
    return {"prefill_tok_s": prompt_len / ttft, "ttft_ms": ttft * 1e3, "decode_tok_s": 1 / statistics.median(steps),
            "extra": {"prefill_tok_s_by_len": by_len}, "version": llama_cpp.__version__}
