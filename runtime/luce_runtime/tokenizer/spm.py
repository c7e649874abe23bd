"""SentencePiece-style BPE (tokenizer.ggml.model "llama"): llama.cpp's llm_tokenizer_spm_session.

The whole text fragment (spaces already written as ▁) is split into code points; adjacent pairs whose concatenation
is a vocabulary token are merged, highest score first (leftmost among equal scores), until no pair forms a token.
A code point that never formed a token is spelled with byte-fallback tokens <0xXX>.
"""

from __future__ import annotations

from luce_runtime.tokenizer.merge import merge_pairs
from luce_runtime.tokenizer.vocab import Vocab, byte_token


def spm_encode(vocab: Vocab, text: str, out: list[int]) -> None:
    t2i, scores = vocab.token_to_id, vocab.scores

    def rank(a: str, b: str) -> float | None:
        tid = t2i.get(a + b)
        return None if tid is None else -scores[tid]

    syms = merge_pairs(list(text), rank)
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
