"""The pair-merging loop both BPE flavours share: merge the best-ranked adjacent pair until none is left.

Byte-level BPE ranks a pair by its merge's position in `tokenizer.ggml.merges`; SentencePiece by minus the score
of the token the pair forms. Ties go to the leftmost pair (heap order on the position), as llama.cpp's queues do.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


def merge_pairs(symbols: list[str], rank: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols, lowest rank first; `rank(a, b)` is None where a+b may not merge."""
    syms = list(symbols)
    n = len(syms)
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            r = rank(syms[left], syms[right])
            if r is not None:
                heapq.heappush(heap, (r, left, right, syms[left] + syms[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, text = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
            continue  # outdated: one side has been merged since
        syms[left], syms[right] = text, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    return [s for s in syms if s]
