"""SentencePiece-style BPE (tokenizer.ggml.model "llama"): llama.cpp's llm_tokenizer_spm_session.

The whole text fragment (spaces already written as ▁) is split into code points; adjacent pairs whose concatenation
is a vocabulary token are merged, highest score first (leftmost among equal scores), until no pair forms a token.
A code point that never formed a token is spelled with byte-fallback tokens <0xXX>.
"""

from __future__ import annotations

import heapq

from luce_runtime.tokenizer.vocab import Vocab, byte_token


def spm_encode(vocab: Vocab, text: str, out: list[int]) -> None:
    t2i, scores = vocab.token_to_id, vocab.scores
    syms = list(text)
    n = len(syms)
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            pair = syms[left] + syms[right]
            tid = t2i.get(pair)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, pair))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, pair = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != pair:
            continue  # outdated: one side has been merged since
        syms[left], syms[right] = pair, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    # llama.cpp's resegment also consults the merges it recorded, but a merged symbol is always a token by
    # construction, so only single code points outside the vocabulary reach the byte fallback
    for sym in syms:
        if not sym:
            continue
        tid = t2i.get(sym)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(byte_token(vocab, b) for b in sym.encode())
