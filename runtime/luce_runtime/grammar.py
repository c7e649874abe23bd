"""Grammar-constrained decoding: a token mask per step from llguidance (JSON schemas, Lark grammars).

    backend = GrammarBackend.of(tokenizer)          # one per tokenizer (building the token trie takes ~0.1-0.5 s)
    c = backend.constraint(json_schema_grammar(schema))
    logits = c.mask(logits)                         # disallowed tokens at -inf, before the sampler's chain
    c.consume(token)                                # after sampling; c.stopped: the grammar can only end now

Why llguidance (scripts/grammar_mask_cost.py measures it; README "Serving" has the numbers): it is a dependency-free
abi3 wheel (xgrammar needs torch, transformers and triton, too heavy for the thin runtime's lean install), it builds
its token trie from raw token bytes in well under a second, and it computes masks lazily per step (outlines-core
compiles a whole-vocabulary index per schema up front, seconds for a 150k vocabulary and some schemas). OpenAI's
own structured output, llama.cpp, vLLM and SGLang use it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import llguidance
import numpy as np

from luce_runtime.errors import LuceError
from luce_runtime.sampler import unpack_mask
from luce_runtime.tokenizer.vocab import CONTROL, USER_DEFINED

if TYPE_CHECKING:
    from luce_runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# JSON as models write it (Python's json.dumps separators), with no free whitespace: flexible whitespace lets a
# weak or random model emit newlines forever inside a valid object, so every response could end at max_tokens
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(LuceError, ValueError):
    """A schema or grammar that cannot be compiled (a bad request: the server answers 400)."""


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: every token's bytes, the end tokens, and a tokenize function (used to
    force grammar-fixed text as canonical tokens)."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids)
        self.bos_token_id = tok.bos_id
        # llguidance marks special tokens with a 0xff byte first (as its llama.cpp adapter does): the grammar's
        # `<|im_end|>` / `<tool_call>` syntax names them, and byte-level text rules never match them
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for t in range(tok.vocab_size):
            piece, attr = tok.token_to_piece(t, special=True), tok.vocab.attrs[t]
            if attr & CONTROL or (attr & USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
                self.special_token_ids.append(t)
            self.tokens.append(piece)

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"), add_special=False, parse_special=False)


class GrammarBackend:
    """llguidance's tokenizer view of one Tokenizer; makes a Constraint per request."""

    _cache: ClassVar[dict[int, GrammarBackend]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, tok: Tokenizer):
        self.vocab_size = tok.vocab_size
        self.eos_ids = sorted(tok.eos_ids)
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tok))
        self.lltok = llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=self.eos_ids)
        self._special = {tok.token_to_piece(t, special=True).decode("utf-8", "replace")
                         for t in wrapper.special_token_ids}

    @classmethod
    def of(cls, tok: Tokenizer) -> GrammarBackend:
        """The backend of `tok`, built once (thread-safe: the server builds it from worker threads)."""
        with cls._lock:
            backend = cls._cache.get(id(tok))
            if backend is None:
                backend = cls._cache[id(tok)] = cls(tok)
            return backend

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token: a grammar names it as <text>, not as a string literal."""
        return text in self._special

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher for `grammar` (from json_schema_grammar / lark_grammar); GrammarError if it is invalid."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise GrammarError(f"grammar: {messages[0]}")
        for m in messages:
            log.warning("grammar: %s", m)
        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def bits(self) -> np.ndarray:
        """The tokens the grammar allows next, packed: (vocab_size + 31) // 32 int32 words, token t is bit t % 32 of
        word t // 32 (a copy). A greedy step takes them to the device (Engine.decode_greedy: the megakernel's argmax
        skips the others), so no logits row has to come back to the host."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        return self._bits.copy()

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows next (an end token once it can end)."""
        return unpack_mask(self.bits(), self.vocab_size)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of (vocab,) logits with disallowed tokens at -inf, rows past the tokenizer's vocabulary too: for
        the host's sampler (sampled requests, logprobs)."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        allowed = self.allowed()
        out = np.full_like(x, -np.inf)
        n = min(x.shape[0], self.vocab_size)
        out[:n] = np.where(allowed[:n], x[:n], -np.inf)
        return out

    def consume(self, token: int) -> None:
        if token < 0:  # Engine.decode_greedy's answer when the mask allowed no token
            raise GrammarError("grammar: the mask allowed no token of the model's vocabulary")
        if not self.matcher.consume_token(token):
            self._check()
            raise GrammarError(f"grammar: token {token} is not allowed here (the mask was not applied?)")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow: generation ends here."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")


def json_schema_grammar(schema: dict[str, Any] | bool, *, lenient: bool = False) -> str:
    """The grammar of JSON text valid against `schema`. lenient: ignore keywords llguidance does not implement
    (tools from agents carry many) instead of refusing the schema."""
    options = {**JSON_OPTIONS, "lenient": lenient}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
    except ValueError as e:
        raise GrammarError(f"grammar: the JSON schema is invalid: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def lark_json(schema: dict[str, Any]) -> str:
    """A schema inlined in a Lark grammar (`%json {...}`), compiled with JSON_OPTIONS and lenient keywords."""
    merged = {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}
    return "%json " + json.dumps(merged)
