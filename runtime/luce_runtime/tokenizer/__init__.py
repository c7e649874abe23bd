"""Tokenization identical to llama.cpp (llama-vocab.cpp, unicode.cpp), from the GGUF `tokenizer.*` metadata.

    tok = Tokenizer.from_metadata(gguf_metadata)
    ids = tok.encode("Hello", add_special=True, parse_special=True)
    text = tok.decode(ids)
    stream = StreamDecoder(tok, strip_leading_space=False)  # feed(id) -> str, flush() -> str

Supported: byte-level BPE ("gpt2") with llama.cpp's pre-tokenizers (pretokenize.PRE_TOKENIZERS) and
SentencePiece ("llama") with byte fallback.
"""

from luce_runtime.tokenizer.core import Tokenizer
from luce_runtime.tokenizer.decode import StreamDecoder
from luce_runtime.tokenizer.pretokenize import PRE_TOKENIZERS

__all__ = ["PRE_TOKENIZERS", "StreamDecoder", "Tokenizer"]
