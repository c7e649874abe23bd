"""The vocabulary as llama.cpp loads it from the GGUF `tokenizer.*` keys (llama-vocab.cpp, llama_vocab::impl::load).

Besides the token list this reproduces what llama.cpp infers: the defaults per tokenizer model and pre-tokenizer
(BOS/EOS ids, add_bos, clean_spaces, ...), the end-of-generation set found from token texts, the CONTROL attribute
forced onto end-of-turn tokens, "unused" control tokens, and the list of special tokens that are cut out of the text
before tokenization (longest first).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from luce_runtime.errors import TokenizerError
from luce_runtime.tokenizer.pretokenize import PRE_TOKENIZERS, PreTokenizer

log = logging.getLogger(__name__)

# llama.h llama_token_attr
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 1 << 7, 1 << 8
# GGUF tokenizer.ggml.token_type (llama_token_type) → attribute; anything else is UNDEFINED
_TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# Token texts llama.cpp recognises when the GGUF does not name the token (impl::load, "auto-detect special tokens").
_AUTO_TEXTS: dict[str, frozenset[str]] = {
    "eot": frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                      "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")),
    "eom": frozenset(("<|eom_id|>",)),
    "fim_pre": frozenset(("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                          "<|code_prefix|>", "<|prefix|>")),
    "fim_suf": frozenset(("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                          "<|code_suffix|>", "<|suffix|>")),
    "fim_mid": frozenset(("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                          "<|code_middle|>", "<|middle|>")),
    "fim_pad": frozenset(("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": frozenset(("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": frozenset(("<|file_sep|>",)),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# GGUF key suffix → special-token role, in llama.cpp's order (the deprecated prefix/suffix/middle keys win last)
_ID_KEYS = (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"), ("eom_token_id", "eom"),
            ("unknown_token_id", "unk"), ("seperator_token_id", "sep"), ("padding_token_id", "pad"),
            ("mask_token_id", "mask"), ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
            ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"), ("fim_rep_token_id", "fim_rep"),
            ("fim_sep_token_id", "fim_sep"), ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
            ("middle_token_id", "fim_mid"))
# Default ids per tokenizer model before the GGUF keys are read (impl::load)
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    attrs: list[int]
    scores: list[float]
    token_to_id: dict[str, int]
    pre: PreTokenizer | None  # BPE only
    bpe_ranks: dict[tuple[str, str], int] = field(default_factory=dict)
    ids: dict[str, int | None] = field(default_factory=dict)  # role (bos, eos, eot, ...) → id
    eog_ids: frozenset[int] = frozenset()
    special_ids: list[int] = field(default_factory=list)  # cut out of the text before tokenizing, longest first
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    clean_spaces: bool = False
    ignore_merges: bool = False

    @property
    def is_bpe(self) -> bool:
        return self.model == "gpt2"


def _get(md: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = md.get(f"tokenizer.{key}", default)
    if value is not default and not isinstance(value, kind):
        raise TokenizerError(f"tokenizer: metadata key tokenizer.{key} is {type(value).__name__}, expected "
                             f"{kind}; the GGUF (or the artifact's tokenizer.json) is damaged, regenerate it.")
    return value


def _list(md: Mapping[str, Any], key: str, kind: type | tuple[type, ...], n: int | None) -> list[Any] | None:
    values = _get(md, key, list)
    if values is None:
        return None
    if n is not None and len(values) < n:
        raise TokenizerError(f"tokenizer: tokenizer.{key} has {len(values)} entries for {n} tokens; the GGUF is "
                             "damaged, regenerate it.")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"tokenizer: tokenizer.{key} holds values other than {kind}; regenerate the GGUF.")
    return values


def _model_and_pre(md: Mapping[str, Any]) -> tuple[str, PreTokenizer | None]:
    model = _get(md, "ggml.model", str)
    if model is None:
        raise TokenizerError("tokenizer: the metadata has no tokenizer.ggml.model; it needs a GGUF with a vocabulary.")
    if model == "llama":
        return model, None
    if model != "gpt2":
        raise TokenizerError(f"tokenizer: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2' "
                             "byte-level BPE, 'llama' SentencePiece).")
    pre_name = _get(md, "ggml.pre", str) or ""
    if not pre_name:
        log.warning("tokenizer: no tokenizer.ggml.pre, using 'default' as llama.cpp does (quality may suffer)")
        pre_name = "default"
    if pre_name not in PRE_TOKENIZERS:
        raise TokenizerError(f"tokenizer: pre-tokenizer tokenizer.ggml.pre={pre_name!r} is not supported "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))}); llama.cpp refuses names it does "
                             "not know too, so check the GGUF's converter.")
    return model, PRE_TOKENIZERS[pre_name]


def _read_tokens(md: Mapping[str, Any]) -> tuple[list[str], list[int], list[float], dict[str, int]]:
    tokens = _list(md, "ggml.tokens", str, None)
    if not tokens:
        raise TokenizerError("tokenizer: tokenizer.ggml.tokens is missing or empty; the GGUF has no vocabulary.")
    n = len(tokens)
    if not all(tokens):  # llama.cpp renames empty tokens so that every text maps back to one id
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _list(md, "ggml.token_type", int, n)
    attrs = [_TYPE_TO_ATTR.get(t, UNDEFINED) for t in types[:n]] if types else [NORMAL] * n
    scores = _list(md, "ggml.scores", (float, int), n)
    token_to_id = {t: i for i, t in enumerate(tokens)}
    if len(token_to_id) != n:
        raise TokenizerError(f"tokenizer: tokenizer.ggml.tokens has {n - len(token_to_id)} duplicate texts; llama.cpp "
                             "refuses such a vocabulary too.")
    return tokens, attrs, [float(s) for s in scores[:n]] if scores else [0.0] * n, token_to_id


def _read_merges(md: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    merges = _list(md, "ggml.merges", str, None)
    if merges is None:
        raise TokenizerError("tokenizer: a 'gpt2' BPE vocabulary needs tokenizer.ggml.merges; regenerate the GGUF.")
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        pos = merge.find(" ", 1)  # from 1: a merge may start with a space token
        pair = (merge[:pos], merge[pos + 1:]) if pos >= 0 else ("", "")
        ranks.setdefault(pair, rank)  # std::unordered_map::emplace keeps the first rank
    return ranks


def _flags(md: Mapping[str, Any], vocab: Vocab) -> None:
    """add_bos/add_eos/add_space_prefix/clean_spaces: the model's defaults, then the GGUF's keys."""
    if vocab.is_bpe:
        pre = vocab.pre
        vocab.clean_spaces, vocab.ignore_merges, vocab.add_bos = pre.clean_spaces, pre.ignore_merges, pre.add_bos
    else:
        vocab.add_space_prefix, vocab.add_bos = True, True
    for key, attr in (("add_space_prefix", "add_space_prefix"), ("add_bos_token", "add_bos"),
                      ("add_eos_token", "add_eos")):
        value = _get(md, f"ggml.{key}", bool)
        if value is not None:
            setattr(vocab, attr, value)


def _special_ids(md: Mapping[str, Any], vocab: Vocab) -> None:
    n = len(vocab.tokens)
    ids: dict[str, int | None] = dict.fromkeys(_AUTO_TEXTS, None)
    ids.update(dict.fromkeys(("bos", "eos", "unk", "sep", "pad", "mask")), **_DEFAULT_IDS[vocab.model])
    for role, default in ids.items():
        if default is not None and default >= n:
            ids[role] = None  # a default outside a small vocabulary is disabled
    for key, role in _ID_KEYS:
        value = _get(md, f"ggml.{key}", int)
        if value is None:
            continue
        if 0 <= value < n:
            ids[role] = value
        else:
            log.warning("tokenizer: bad special token tokenizer.ggml.%s = %d, using default %s", key, value, ids[role])
    vocab.ids = ids


def _auto_detect(vocab: Vocab) -> None:
    """Find unnamed EOT/EOM/FIM tokens by text, mark "unused" controls, and build the EOG set (as llama.cpp)."""
    ids, attrs = vocab.ids, vocab.attrs
    for role, texts in _AUTO_TEXTS.items():
        if ids[role] is None:
            # llama.cpp walks an unordered_map, so which of several candidates wins is unspecified; take the lowest
            found = sorted(vocab.token_to_id[t] for t in texts if t in vocab.token_to_id)
            if found:
                ids[role] = found[0]
                attrs[found[0]] |= CONTROL
    for i, text in enumerate(vocab.tokens):
        if attrs[i] & CONTROL and "unused" in text:
            attrs[i] |= UNUSED
    eog = {ids[r] for r in ("fim_pad", "fim_rep", "fim_sep") if ids[r] is not None}
    for text in _EOG_TEXTS:
        i = vocab.token_to_id.get(text)
        if i is not None:
            eog.add(i)
            attrs[i] |= CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # llama.cpp's gpt-oss hack
        if text in vocab.token_to_id:
            attrs[vocab.token_to_id[text]] = USER_DEFINED
    eog.update(ids[r] for r in ("eos", "eot", "eom") if ids[r] is not None)
    vocab.eog_ids = frozenset(_eog_workarounds(vocab, eog))


def _eog_workarounds(vocab: Vocab, eog: set[int]) -> set[int]:
    """llama.cpp's two text-based corrections of the EOG set (o200k_harmony/solar-open <|end|>, gemma4/plamo </s>)."""
    texts = {vocab.tokens[i]: i for i in eog if 0 <= i < len(vocab.tokens)}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        vocab.attrs[texts["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        vocab.attrs[texts["</s>"]] = NORMAL
    return eog


def _per_model_attrs(md: Mapping[str, Any], vocab: Vocab) -> None:
    """The lstrip/rstrip attributes llama.cpp sets by model name (the GGUF does not carry them)."""
    name = str(md.get("general.name", "")).lower()
    pre = str(md.get("tokenizer.ggml.pre", ""))
    arch = str(md.get("general.architecture", ""))
    t2i, attrs = vocab.token_to_id, vocab.attrs
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in t2i:
            attrs[t2i["<mask>"]] |= LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in vocab.special_ids:
            attrs[i] |= RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in t2i:
                attrs[t2i[text]] = attrs[t2i[text]] | RSTRIP if on else attrs[t2i[text]] & ~RSTRIP
    elif "modern-bert" in name and "[MASK]" in t2i:
        attrs[t2i["[MASK]"]] |= LSTRIP


def load_vocab(md: Mapping[str, Any]) -> Vocab:
    """Build the vocabulary from GGUF metadata (plain JSON values), as llama.cpp's llama_vocab::impl::load does."""
    model, pre = _model_and_pre(md)
    tokens, attrs, scores, token_to_id = _read_tokens(md)
    vocab = Vocab(model, tokens, attrs, scores, token_to_id, pre)
    if vocab.is_bpe:
        vocab.bpe_ranks = _read_merges(md)
    _flags(md, vocab)
    _special_ids(md, vocab)
    _auto_detect(vocab)
    special = [i for i, a in enumerate(attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
    # longest (in UTF-8 bytes) first; llama.cpp's std::sort leaves ties unordered, ties here stay in id order
    special.sort(key=lambda i: -len(tokens[i].encode()))
    vocab.special_ids = special
    _per_model_attrs(md, vocab)
    return vocab


def byte_token(vocab: Vocab, byte: int) -> int:
    """llama_vocab::byte_to_token for SentencePiece: <0xXX>, else the single byte as text."""
    tid = vocab.token_to_id.get(f"<0x{byte:02X}>")
    if tid is None:
        tid = vocab.token_to_id.get(chr(byte)) if byte < 0x80 else None
    if tid is None:
        raise TokenizerError(f"tokenizer: the vocabulary has no byte-fallback token <0x{byte:02X}> for a character "
                             "it cannot spell; llama.cpp fails here too. The GGUF's vocabulary is incomplete.")
    return tid


def check_ids(vocab: Vocab, ids: Sequence[int]) -> None:
    n = len(vocab.tokens)
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise TokenizerError(f"tokenizer: token ids {bad[:5]} are outside the vocabulary of {n} tokens.")
