"""Ids → text as llama.cpp does it: token_to_piece per token, detokenize's clean-up, and a streaming decoder.

A piece is raw bytes: a byte-fallback token is one byte of a UTF-8 sequence, so text only exists once the bytes are
joined. The streaming decoder therefore hands out only complete UTF-8 characters and keeps the rest for later.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

from luce_runtime.tokenizer.bpe import byte_decoder
from luce_runtime.tokenizer.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Vocab

if TYPE_CHECKING:
    from luce_runtime.tokenizer.core import Tokenizer

# detokenize's clean_up_tokenization_spaces, pass by pass (llama-vocab.cpp impl::detokenize): " ?" " !" " ." " ,"
# lose the space; " ' " becomes "'"; " 's" " 'm" " 're" " 've" lose the space.
_CLEAN_PASSES = ((re.compile(rb" (?=[?!.,])"), b""), (re.compile(rb" ' "), b"'"),
                 (re.compile(rb" '(?=[sm]|re|ve)"), b"'"))
# No clean-up rule spans a cut after a byte outside this set, so text before such a cut can be cleaned for good.
_UNSAFE_BEFORE_CUT = frozenset(b" 'rv")


def _hex_prefix(text: str) -> int:
    """strtol(text, 16) on the two characters after "<0x": the leading hex digits, 0 when there are none."""
    digits = ""
    for ch in text[3:5]:
        if ch not in "0123456789abcdefABCDEF":
            break
        digits += ch
    return int(digits, 16) if digits else 0


def piece_bytes(vocab: Vocab, tid: int) -> bytes:
    """token_to_piece(special=True): what llama.cpp caches for every token at load time."""
    attr, text = vocab.attrs[tid], vocab.tokens[tid]
    if attr & (UNKNOWN | CONTROL | USER_DEFINED):
        return text.encode()
    if attr & NORMAL:
        return _normal_text(text) if vocab.is_bpe else text.replace("\u2581", " ").encode()
    if attr & BYTE:
        return bytes((_hex_prefix(text) & 0xFF,))
    return b""  # UNUSED and UNDEFINED tokens print nothing


def _normal_text(text: str) -> bytes:
    """llama_decode_text: GPT-2 code points back to bytes, with llama.cpp's marker for a code point outside them."""
    decoder = byte_decoder()
    out = bytearray()
    for ch in text:
        b = decoder.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)


def clean_spaces(data: bytes) -> bytes:
    for pattern, repl in _CLEAN_PASSES:
        data = pattern.sub(repl, data)
    return data


def safe_cut(data: bytes | bytearray) -> int:
    """The longest prefix of `data` whose clean-up cannot change when more bytes arrive."""
    cut = len(data)
    while cut > 0 and data[cut - 1] in _UNSAFE_BEFORE_CUT:
        cut -= 1
    return cut


class StreamDecoder:
    """Feed ids one at a time; get back only complete UTF-8 text, so every chunk is valid on its own.

    The chunks (plus `flush()`) concatenate to `tokenizer.decode(ids, special, strip_leading_space=...)`.
    `strip_leading_space=None` follows llama.cpp's detokenize (drop the first piece's leading space when the
    vocabulary adds a space prefix); a server streaming a continuation of a prompt passes False.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False, strip_leading_space: bool | None = None) -> None:
        self._tok = tokenizer
        self._special = special
        self._strip = tokenizer.vocab.add_space_prefix if strip_leading_space is None else strip_leading_space
        self._clean = tokenizer.vocab.clean_spaces
        self._pending = bytearray()  # raw pieces not yet cleaned (only with clean-up)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        piece = self._tok.token_to_piece(token_id, special=self._special)
        if self._strip and piece[:1] == b" ":
            piece = piece[1:]
        self._strip = False
        if not self._clean:
            return self._utf8.decode(piece)
        self._pending += piece
        cut = safe_cut(self._pending)
        ready = clean_spaces(bytes(self._pending[:cut]))
        del self._pending[:cut]
        return self._utf8.decode(ready)

    def flush(self) -> str:
        """The rest: held-back clean-up window and any incomplete UTF-8 (as U+FFFD, as decode() shows it)."""
        ready = clean_spaces(bytes(self._pending)) if self._pending else b""
        self._pending.clear()
        return self._utf8.decode(ready, final=True)
