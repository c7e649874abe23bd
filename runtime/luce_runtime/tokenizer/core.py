"""The tokenizer the runtime serves with: llama.cpp's tokenize/detokenize, built from GGUF `tokenizer.*` metadata."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from luce_runtime.errors import TokenizerError
from luce_runtime.tokenizer.bpe import BPE
from luce_runtime.tokenizer.decode import clean_spaces, piece_bytes
from luce_runtime.tokenizer.spm import spm_encode
from luce_runtime.tokenizer.vocab import CONTROL, LSTRIP, RSTRIP, UNKNOWN, Vocab, check_ids, load_vocab

log = logging.getLogger(__name__)

_C_SPACE = frozenset(" \t\n\v\f\r")  # isspace() in the C locale, which llama.cpp's lstrip/rstrip use


class Tokenizer:
    """Text ↔ token ids exactly as llama.cpp (llama_tokenize / llama_token_to_piece / llama_detokenize)."""

    def __init__(self, vocab: Vocab, chat_template: str | None = None) -> None:
        self.vocab = vocab
        self.chat_template = chat_template
        self._pieces: dict[int, bytes] = {}
        log.info("tokenizer: %s, %d tokens, pre %s, bos %s eos %s, add_bos %s, eog %s", vocab.model,
                 len(vocab.tokens), vocab.pre.name if vocab.pre else "-", self.bos_id, self.eos_id, vocab.add_bos,
                 sorted(vocab.eog_ids))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata (or its tokenizer.* keys as stored in an artifact): plain JSON values only."""
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError("tokenizer: tokenizer.chat_template must be a string; regenerate the GGUF.")
        return cls(load_vocab(md), template)

    # -- properties -------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.ids["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.ids["eot"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.ids["pad"]

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation (llama.cpp's EOG set: EOS, EOT, EOM and end-of-turn texts)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @cached_property
    def bos_text(self) -> str:
        return "" if self.bos_id is None else self.token_to_piece(self.bos_id, special=True).decode(errors="replace")

    @cached_property
    def eos_text(self) -> str:
        return "" if self.eos_id is None else self.token_to_piece(self.eos_id, special=True).decode(errors="replace")

    @cached_property
    def _bpe(self) -> BPE:
        return BPE(self.vocab)

    def token_id(self, text: str) -> int | None:
        """The id whose raw vocabulary text is `text`, if any."""
        return self.vocab.token_to_id.get(text)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    # -- encode -----------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize(text, add_special, parse_special): BOS/EOS only where the vocabulary asks for them."""
        vocab = self.vocab
        out: list[int] = []
        if add_special and vocab.add_bos:
            out.append(self._required("bos"))
        prev_special = True  # SentencePiece puts the space prefix at the start and after each special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif vocab.is_bpe:
                self._bpe.encode(frag, out)
            else:
                prefix = " " if vocab.add_space_prefix and prev_special else ""
                spm_encode(vocab, (prefix + frag).replace(" ", "\u2581"), out)
                prev_special = False
        if add_special and vocab.add_eos:
            out.append(self._required("eos"))
        return out

    def _required(self, role: str) -> int:
        tid = self.vocab.ids[role]
        if tid is None:
            raise TokenizerError(f"tokenizer: the vocabulary asks for a {role.upper()} token but has none; "
                                 f"set tokenizer.ggml.{role}_token_id in the GGUF.")
        return tid

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: cut special-token texts out of the text, longest token first.

        Without parse_special only USER_DEFINED tokens are cut (as in llama.cpp and HF tokenizers).
        """
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise TokenizerError(f"tokenizer: the text is not valid Unicode ({e.reason} at {e.start}); lone "
                                 "surrogates cannot be tokenized.") from None
        frags: list[str | int] = [text] if text else []
        vocab = self.vocab
        for tid in vocab.special_ids:
            attr = vocab.attrs[tid]
            token = vocab.tokens[tid]
            if (not parse_special and attr & (CONTROL | UNKNOWN)) or token not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or token not in frag:
                    new.append(frag)
                else:
                    _split_fragment(frag, token, tid, attr, new)
            frags = new
        return frags

    # -- decode -----------------------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """llama_token_to_piece(lstrip=0): raw bytes; control/unknown tokens are empty unless `special`."""
        attr = self.vocab.attrs[token_id]
        if not special and attr & (UNKNOWN | CONTROL):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = piece_bytes(self.vocab, token_id)
        return piece

    def detokenize(self, ids: Sequence[int], *, special: bool = False, remove_special: bool = False,
                   strip_leading_space: bool | None = None) -> bytes:
        """llama_detokenize(ids, remove_special, unparse_special=special) as bytes.

        strip_leading_space=None is llama.cpp's rule (drop the first piece's leading space when the vocabulary adds
        a space prefix); pass False to decode a continuation.
        """
        check_ids(self.vocab, ids)
        vocab = self.vocab
        strip = vocab.add_space_prefix if strip_leading_space is None else strip_leading_space
        ids = list(ids)
        if remove_special and vocab.add_bos and ids and ids[0] == vocab.ids["bos"]:
            strip, ids = False, ids[1:]
        if remove_special and vocab.add_eos and ids and ids[-1] == vocab.ids["eos"]:
            ids = ids[:-1]
        pieces = [self.token_to_piece(t, special) for t in ids]
        if strip and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        data = b"".join(pieces)
        return clean_spaces(data) if vocab.clean_spaces else data

    def decode(self, ids: Sequence[int], special: bool = False, *, strip_leading_space: bool | None = None) -> str:
        """detokenize as text; bytes that do not form UTF-8 show as U+FFFD."""
        return self.detokenize(ids, special=special, strip_leading_space=strip_leading_space).decode(
            "utf-8", errors="replace")


def _split_fragment(frag: str, token: str, tid: int, attr: int, out: list[str | int]) -> None:
    """Split one raw fragment on every occurrence of a special token, honouring its lstrip/rstrip attributes."""
    base, end = 0, len(frag)
    while (match := frag.find(token, base)) >= 0:
        left_end = match
        if attr & LSTRIP:
            while left_end > base and frag[left_end - 1] in _C_SPACE:
                left_end -= 1
        if left_end > base:
            out.append(frag[base:left_end])
        out.append(tid)
        base = match + len(token)
        if attr & RSTRIP:  # the whitespace after the token is dropped, and the search goes on after it
            while base < end and frag[base] in _C_SPACE:
                base += 1
    if base < end:
        out.append(frag[base:])
