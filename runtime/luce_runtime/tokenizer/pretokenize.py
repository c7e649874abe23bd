"""Pre-tokenization for byte-level BPE: llama.cpp's `unicode_regex_split`, ported rule for rule.

llama.cpp does not run the tokenizer.json regexes as written. For the common ones (GPT-2, Llama 3, Qwen2) it runs
hand-written splitters (unicode.cpp `unicode_regex_split_custom_*`); any other regex runs through std::regex over a
"collapsed" copy of the text where every non-ASCII code point is replaced by one byte standing for its category
(0xD1 number, 0xD2 letter, ...), so `\\p{N}` becomes `[\\xD10-9]`. Both paths use llama.cpp's own Unicode tables
(unicode_data.py). Each regex splits every piece left by the previous one; matches and the gaps between them both
become pieces. Reproducing this, rather than using the original regexes, is what makes "a ½ cup" and "page ٣"
tokenize as llama.cpp does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from luce_runtime.errors import TokenizerError
from luce_runtime.tokenizer import unicode_data

# Per-code-point classes; 0 means "outside the current piece" (llama.cpp's all-zero flags).
NONE, UNDEF, NUMBER, LETTER, SEPARATOR, MARK, PUNCT, SYMBOL, CONTROL, SPACE = range(10)
_FLAG_TO_CLASS = {0x01: UNDEF, 0x02: NUMBER, 0x04: LETTER, 0x08: SEPARATOR, 0x10: MARK, 0x20: PUNCT, 0x40: SYMBOL,
                  0x80: CONTROL}
# The byte each class collapses to (unicode.cpp k_ucat_cpt; whitespace → \v, anything else → 0xD0).
_COLLAPSED = {NUMBER: "\xd1", LETTER: "\xd2", PUNCT: "\xd3", MARK: "\xd4", SYMBOL: "\xd5", SPACE: "\x0b"}
_UCAT_CLASS = {"N": NUMBER, "L": LETTER, "P": PUNCT, "M": MARK, "S": SYMBOL, "Lu": LETTER, "Ll": LETTER,
               "Lt": LETTER, "Lm": LETTER, "Lo": LETTER}
# The ASCII members of each category, added next to the collapsed byte (unicode.cpp k_ucat_map).
_UCAT_ASCII = {NUMBER: "0-9", LETTER: "A-Za-z", PUNCT: r"!-#%-*,-/:-;?-@\[-\]_\{\}", MARK: "",
               SYMBOL: r"\$\+<->\^`\|\~"}

GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
             r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o, gpt-oss), as llama.cpp rewrites tokenizer.json's regex for std::regex (llama-vocab.cpp,
# LLAMA_VOCAB_PRE_TYPE_GPT4O): `(?=[\p{L}])([^a-z])` stands for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}] and `(?=[\p{L}])([^A-Z])`
# for [\p{Ll}\p{Lm}\p{Lo}], the contractions are spelled out instead of (?i:...), and \p{M} is dropped from the
# letter classes. llama.cpp has no hand-written splitter for it: it runs through the collapsed std::regex path
# (_split_regex), where every non-ASCII letter is one byte that is neither a-z nor A-Z, so counts as both cases.
GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
            r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp LLAMA_VOCAB_PRE_TYPE: its regex list and the vocabulary flags it sets (llama-vocab.cpp)."""

    name: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


def _pre(names: str, regexes: tuple[str, ...], **flags: bool) -> dict[str, PreTokenizer]:
    return {n: PreTokenizer(n, regexes, **flags) for n in names.split()}


# tokenizer.ggml.pre → pre-tokenizer, for the types whose regexes this port covers (llama-vocab.cpp, impl::load and
# llm_tokenizer_bpe). Others llama.cpp knows are refused by name rather than tokenized differently.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_pre("default", DEFAULT_RES),
    **_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", (LLAMA3_RE,),
           ignore_merges=True, add_bos=True),
    **_pre("dbrx smaug-bpe", (LLAMA3_RE,)),
    **_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2", (QWEN2_RE,), clean_spaces=False),
    **_pre("stablelm2 megrez", (QWEN2_RE,)),
    **_pre("qwen35", (QWEN35_RE,), clean_spaces=False),
    **_pre("gpt-4o llama4 kanana2 talkie minimax-m2", (GPT4O_RE,), clean_spaces=False),
    **_pre("smollm command-r", (r"\p{N}", GPT2_RE), clean_spaces=False),
    **_pre("starcoder refact codeshell exaone minerva-7b mellum2", (r"\p{N}", GPT2_RE)),
    **_pre("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo jais "
           "exaone4", (GPT2_RE,)),
    **_pre("trillion granite-docling", (GPT2_RE,), clean_spaces=False),
    **_pre("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, "[0-9][0-9][0-9]")),
}


@cache
def _class_table() -> bytes:
    """One byte per code point (1.1 MB, built once in a few ms): its class in llama.cpp's tables."""
    table = bytearray(0x110000)
    flat = unicode_data.RANGES_FLAGS
    for i in range(0, len(flat) - 2, 2):
        start, flags, end = flat[i], flat[i + 1], flat[i + 2]
        table[start:end] = bytes((_FLAG_TO_CLASS.get(flags, UNDEF),)) * (end - start)
    for cp in unicode_data.WHITESPACE:
        table[cp] = SPACE
    return bytes(table)


def classes(text: str) -> bytes:
    table = _class_table()
    return bytes([table[ord(c)] for c in text])


def _split_gpt2(text: str, cls: bytes, ini: int, end: int, out: list[int]) -> None:
    """unicode_regex_split_custom_gpt2 on text[ini:end] (GPT2_RE, plus a final \\s+ alternative)."""

    def at(p: int) -> int:
        return cls[p] if p < end else NONE

    pos = ini
    while pos < end:
        start, c = pos, text[pos]
        if c == "'" and pos + 1 < end and (text[pos + 1] in "stmd" or
                                           (pos + 2 < end and text[pos + 1:pos + 3] in ("re", "ve", "ll"))):
            pos += 2 if text[pos + 1] in "stmd" else 3
        else:
            f2 = at(pos + 1) if c == " " else cls[pos]
            if f2 not in (SPACE, NONE):
                # ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: one optional space, then a run of one kind
                pos += c == " "
                kind = f2 if f2 in (LETTER, NUMBER) else None
                while (at(pos) == kind) if kind else (at(pos) not in (SPACE, LETTER, NUMBER, NONE)):
                    pos += 1
            else:
                pos = _whitespace_run(text, cls, pos, end, newlines=False)
        out.append(pos - start)


def _whitespace_run(text: str, cls: bytes, pos: int, end: int, newlines: bool) -> int:
    """The end of `\\s*[\\r\\n]+` (when `newlines`), else `\\s+(?!\\S)`, else `\\s+`, else one code point."""
    n, last_nl = 0, 0
    while pos + n < end and cls[pos + n] == SPACE:
        if newlines and text[pos + n] in "\r\n":
            last_nl = pos + n + 1
        n += 1
    if last_nl:
        return last_nl
    if n > 1 and pos + n < end:
        return pos + n - 1
    return pos + max(n, 1)


# unicode_tolower maps no non-ASCII code point to r, e, v or l, so ASCII case folding is exact here
_CONTRACTIONS_CI = frozenset(a + b for pair in ("re", "ve", "ll") for a in (pair[0], pair[0].upper())
                             for b in (pair[1], pair[1].upper()))


def _split_llama3(text: str, cls: bytes, ini: int, end: int, out: list[int], max_digits: int,
                  letters: frozenset[int] = frozenset((LETTER,))) -> None:
    """unicode_regex_split_custom_llama3 (max_digits 3), _qwen2 (1) and _qwen35 (1, marks count as letters)."""

    def at(p: int) -> int:
        return cls[p] if p < end else NONE

    not_punct = letters | {SPACE, NUMBER}
    pos = ini
    while pos < end:
        start, c, f = pos, text[pos], cls[pos]
        if c == "'" and pos + 1 < end and (text[pos + 1] in "stmdSTMD" or (
                pos + 2 < end and text[pos + 1:pos + 3] in _CONTRACTIONS_CI)):
            pos += 2 if text[pos + 1] in "stmdSTMD" else 3  # (?i:'s|'t|'re|'ve|'m|'ll|'d)
        elif c not in "\r\n" and f != NUMBER and (f in letters or at(pos + 1) in letters):
            pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
            while at(pos) in letters:
                pos += 1
        elif f == NUMBER:  # \p{N}{1,3}: llama.cpp cuts the run into groups of max_digits, each its own piece
            while at(pos) == NUMBER and pos - start < max_digits:
                pos += 1
        elif (at(pos + 1) if c == " " else f) not in not_punct:
            pos += c == " "  # ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            while at(pos) not in not_punct and at(pos) != NONE:
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
        else:
            pos = _whitespace_run(text, cls, pos, end, newlines=True)
        out.append(pos - start)


CUSTOM_SPLITTERS: dict[str, Callable[[str, bytes, int, int, list[int]], None]] = {
    GPT2_RE: _split_gpt2,
    LLAMA3_RE: lambda t, c, i, e, o: _split_llama3(t, c, i, e, o, 3),
    QWEN2_RE: lambda t, c, i, e, o: _split_llama3(t, c, i, e, o, 1),
    QWEN35_RE: lambda t, c, i, e, o: _split_llama3(t, c, i, e, o, 1, frozenset((LETTER, MARK))),
}


@cache
def _compile(regex: str) -> tuple[re.Pattern[str], bool]:
    """The std::regex llama.cpp would build: collapsed when the regex names a Unicode category (unicode.cpp)."""
    if not re.search(r"\\p\{(?:N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}", regex):
        return re.compile(regex, re.ASCII), False
    if any(ord(ch) >= 128 for ch in regex):
        raise TokenizerError(f"tokenizer: regex {regex!r} mixes Unicode categories and non-ASCII characters, "
                             "which llama.cpp refuses too; regenerate the GGUF with a supported pre-tokenizer.")
    out, inside, i = [], False, 0
    while i < len(regex):
        ch = regex[i]
        m = re.match(r"\\p\{(\w{1,2})\}", regex[i:])
        if ch == "[" and (i == 0 or regex[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and regex[i - 1] != "\\":
            inside = False
        elif m and m.group(1) in _UCAT_CLASS:
            cls = _UCAT_CLASS[m.group(1)]
            body = _COLLAPSED[cls] + _UCAT_ASCII[cls]
            out.append(body if inside else f"[{body}]")
            i += m.end()
            continue
        out.append(ch)
        i += 1
    # re.ASCII: std::regex's \s and \d are the C locale's (ASCII), and collapsed bytes are never \s or \w
    return re.compile("".join(out), re.ASCII), True


def _split_regex(regex: str, text: str, cls: bytes, pieces: list[int]) -> list[int]:
    """unicode_regex_split_stl: each match and each gap between matches becomes a piece, within every piece."""
    pattern, collapsed = _compile(regex)
    if collapsed:
        subject = "".join(c if c < "\x80" else _COLLAPSED.get(k, "\xd0") for c, k in zip(text, cls, strict=True))
    else:
        subject = "".join(c if c < "\x80" or k != SPACE else "\x0b" for c, k in zip(text, cls, strict=True))
    out: list[int] = []
    start = 0
    for length in pieces:
        # each piece is searched on its own, as llama.cpp's regex_iterator over [start, start + length) does
        prev = 0
        for m in pattern.finditer(subject[start:start + length]):
            if m.start() > prev:
                out.append(m.start() - prev)
            if m.end() > m.start():
                out.append(m.end() - m.start())
            prev = m.end()
        if prev < length:
            out.append(length - prev)
        start += length
    return out


def split_words(text: str, regexes: tuple[str, ...]) -> list[str]:
    """The words BPE merges within (unicode_regex_split without the byte encoding)."""
    if not text:
        return []
    cls = classes(text)
    pieces = [len(text)]
    for regex in regexes:
        custom = CUSTOM_SPLITTERS.get(regex)
        if custom is None:
            pieces = _split_regex(regex, text, cls, pieces)
            continue
        out: list[int] = []
        start = 0
        for length in pieces:
            custom(text, cls, start, start + length, out)
            start += length
        pieces = out
    words, start = [], 0
    for length in pieces:
        words.append(text[start:start + length])
        start += length
    return words
