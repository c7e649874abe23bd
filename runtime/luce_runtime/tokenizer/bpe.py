"""Byte-level BPE (tokenizer.ggml.model "gpt2"): llama.cpp's llm_tokenizer_bpe_session, word by word.

Each word from the pre-tokenizer is written in GPT-2's byte alphabet (every UTF-8 byte shown as one printable code
point), split into code points, and merged greedily: always the adjacent pair with the lowest merge rank, the
leftmost first among equal ranks. The result for a word depends only on the word, so words are cached.
"""

from __future__ import annotations

from functools import cache

from luce_runtime.tokenizer.merge import merge_pairs
from luce_runtime.tokenizer.pretokenize import split_words
from luce_runtime.tokenizer.vocab import Vocab

_WORD_CACHE_LIMIT = 200_000  # words; a few tens of MB at most, cleared when full


@cache
def byte_encoder() -> dict[int, str]:
    """GPT-2's bytes → printable code points (unicode.cpp unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def byte_decoder() -> dict[str, int]:
    return {ch: b for b, ch in byte_encoder().items()}


@cache
def _latin1_to_gpt2() -> dict[int, str]:
    # str.translate table: a UTF-8 byte seen as a latin-1 character → its GPT-2 code point
    return dict(byte_encoder())


def encode_bytes(word: str) -> str:
    return word.encode("utf-8").decode("latin-1").translate(_latin1_to_gpt2())


class BPE:
    def __init__(self, vocab: Vocab) -> None:
        assert vocab.pre is not None, "BPE needs a pre-tokenizer"
        self.vocab = vocab
        self.regexes = vocab.pre.regexes
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        for word in split_words(text, self.regexes):
            ids = self._cache.get(word)
            if ids is None:
                if len(self._cache) >= _WORD_CACHE_LIMIT:
                    self._cache.clear()
                ids = self._cache[word] = tuple(self._word(encode_bytes(word)))
            out.extend(ids)

    def _word(self, word: str) -> list[int]:
        t2i = self.vocab.token_to_id
        if self.vocab.ignore_merges and word in t2i:
            return [t2i[word]]
        out: list[int] = []
        for sym in self._merge(word):
            tid = t2i.get(sym)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp looks each raw byte up as a one-byte text: only ASCII bytes can be found, the rest are dropped
            out.extend(t2i[chr(b)] for b in sym.encode() if b < 0x80 and chr(b) in t2i)
        return out

    def _merge(self, word: str) -> list[str]:
        ranks = self.vocab.bpe_ranks
        return merge_pairs(list(word), lambda a, b: ranks.get((a, b)))
