"""llama.cpp on the CPU through llama-cpp-python: the same GGUF, the same threads, timed like bench_engine (with
luce_runtime.timing; llama.cpp's CPU eval returns when its work is done, so there is no device to synchronize)."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from luce_runtime.timing import call_times, median_time


def bench_llama_cpp(gguf: Path, *, threads: int, prompt_len: int, gen_len: int, repeat: int = 3,
                    seed: int = 0, prefill_lens: tuple[int, ...] | list[int] = ()) -> dict:
    """Prefill tok/s (prompt_len random tokens in one eval; also once for each of prefill_lens, as luce-compile's
    bench does on the CPU) and batch-1 decode tok/s (median step)."""
    import llama_cpp

    longest = max([prompt_len, *prefill_lens])  # prefill_lens may be empty
    llm = llama_cpp.Llama(str(gguf), n_ctx=longest + gen_len + 16, n_batch=max(longest, 32),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    rng = np.random.default_rng(seed)
    vocab = llm.n_vocab()

    def prefill_seconds(n: int, repeat: int, warmup: int) -> float:
        prompts = iter([rng.integers(0, vocab, n).tolist() for _ in range(warmup + repeat)])

        def once() -> None:
            llm.reset()  # only rewinds the token count: nothing to time
            llm.eval(next(prompts))

        return median_time(once, repeat, warmup)

    ttft = prefill_seconds(prompt_len, repeat, warmup=1)
    by_len = {n: n / prefill_seconds(n, 1, warmup=0) for n in prefill_lens}
    prefill_seconds(prompt_len, 1, warmup=0)  # decode continues after a prompt_len prompt, as luce-compile's does
    steps = []
    token = int(rng.integers(0, vocab))
    llm.eval([token])  # warm-up step
    for _ in range(gen_len):
        steps += call_times(lambda t=token: llm.eval([t]), 1, warmup=0)
        # outside the timed region: llama-cpp-python hands the logits over as a Python list (slow to argmax)
        token = int(np.argmax(llm.eval_logits[-1]))
    return {"prefill_tok_s": prompt_len / ttft, "ttft_ms": ttft * 1e3, "decode_tok_s": 1 / statistics.median(steps),
            "extra": {"prefill_tok_s_by_len": by_len}, "version": llama_cpp.__version__}


def bench_llama_cpp_batched(gguf: Path, *, threads: int, prompt_len: int, gen_len: int, batch: int,
                            seed: int = 0) -> float:
    """Aggregate decode tok/s of `batch` sequences decoded together (one llama_decode per step, one token of each
    sequence, after a prompt_len prompt each), through llama-cpp-python's C API: its Llama class decodes one
    sequence. Median step; the argmax of each row happens outside the timed call, as in bench_llama_cpp."""
    import ctypes

    import llama_cpp as lc

    lc.llama_log_set(_QUIET, ctypes.c_void_p(0))  # the C API logs every tensor to stderr otherwise
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = lc.llama_context_default_params()
    params.n_ctx = batch * (prompt_len + gen_len + 16)
    params.n_batch = params.n_ubatch = max(prompt_len, batch)
    params.n_seq_max, params.kv_unified = batch, True  # one KV pool shared by all sequences, as ours
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    rows = lc.llama_batch_init(max(prompt_len, batch), 0, batch)
    rng = np.random.default_rng(seed)

    def submit(tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> None:
        for i, (t, p, s, want) in enumerate(zip(tokens, positions, seqs, logits, strict=True)):
            rows.token[i], rows.pos[i], rows.n_seq_id[i], rows.logits[i] = t, p, 1, want
            rows.seq_id[i][0] = s
        rows.n_tokens = len(tokens)
        if lc.llama_decode(ctx, rows) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")

    try:
        for s in range(batch):
            submit(rng.integers(0, n_vocab, prompt_len).tolist(), list(range(prompt_len)), [s] * prompt_len,
                   [False] * (prompt_len - 1) + [True])
        tokens, steps = rng.integers(0, n_vocab, batch).tolist(), []
        for step in range(gen_len + 1):  # the first step warms up
            positions = [prompt_len + step] * batch
            seconds = call_times(lambda t=tokens, p=positions: submit(t, p, list(range(batch)), [True] * batch),
                                 1, warmup=0)
            steps += seconds if step else []
            tokens = [int(np.argmax(np.ctypeslib.as_array(
                ctypes.cast(lc.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)), (n_vocab,))))
                for i in range(batch)]
    finally:
        lc.llama_batch_free(rows)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return batch / statistics.median(steps)


def _quiet(level: int, text: bytes, user_data: object) -> None:
    return None


try:
    import llama_cpp as _lc

    _QUIET = _lc.llama_log_callback(_quiet)  # kept alive here: the C library holds a pointer to it
except ImportError:  # the GPU machine has no llama-cpp-python; this module is for the CPU table
    _QUIET = None
