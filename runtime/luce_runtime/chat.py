"""Chat templates: the GGUF's Jinja template, or llama.cpp's built-in format when the GGUF has none.

A template is rendered the way transformers and llama-cpp-python render it (jinja2's immutable sandbox, trim_blocks,
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text). Without a template llama.cpp
falls back to ChatML (`llama_chat_apply_template(NULL)`), which is wrong for models that were never trained on it:
Gemma 3 270M's GGUF has no template, and its turns are `<start_of_turn>user ... <end_of_turn>`. So the fallback is
chosen from the vocabulary (the turn markers the model knows) and rendered exactly as llama.cpp's built-in format of
that name (llama-chat.cpp, llm_chat_apply_template).

For a prompt the server tokenizes, use `render_prompt`/`encode_chat`: like llama.cpp's server they drop a leading BOS
text (and a trailing EOS text) that the template wrote when the tokenizer adds that token itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from luce_runtime.errors import TokenizerError

if TYPE_CHECKING:
    from luce_runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Message = Mapping[str, Any]
_C_SPACE = " \t\n\v\f\r"  # llama-chat.cpp's trim() uses isspace() in the C locale


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Pass-through for HF's `{% generation %}` tag (training-only marker), as transformers and llama-cpp-python."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template: syntax error at line {e.lineno}: {e.message}; fix "
                             "tokenizer.chat_template or pass another template.") from None


# -- llama.cpp's built-in formats (llama-chat.cpp) ----------------------------------------------------------------
def _text(message: Message) -> str:
    """A message's content as one string; typed text parts are joined with newlines as llama.cpp's server does."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise TokenizerError(f"chat: message content must be a string or a list of parts, got {type(content).__name__}.")


def _chatml(messages: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|im_start|>{m['role']}\n{_text(m)}<|im_end|>\n" for m in messages]
    return "".join(out) + ("<|im_start|>assistant\n" if add_ass else "")


def _gemma(messages: Sequence[Message], add_ass: bool) -> str:
    # Gemma has no system role: llama.cpp folds system text into the next non-model turn
    out, system = [], ""
    for m in messages:
        role = m["role"]
        if role == "system":
            system += _text(m).strip(_C_SPACE)
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(_text(m).strip(_C_SPACE) + "<end_of_turn>\n")
    return "".join(out) + ("<start_of_turn>model\n" if add_ass else "")


def _llama3(messages: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_text(m).strip(_C_SPACE)}<|eot_id|>"
           for m in messages]
    return "".join(out) + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_ass else "")


BUILTIN_FORMATS: dict[str, Callable[[Sequence[Message], bool], str]] = {
    "chatml": _chatml, "gemma": _gemma, "llama3": _llama3}
# the token that identifies each format in a vocabulary, checked in this order; ChatML is llama.cpp's default
_FORMAT_EVIDENCE = (("gemma", "<start_of_turn>"), ("llama3", "<|start_header_id|>"), ("chatml", "<|im_start|>"))
_logged: set[tuple[str, str | None]] = set()


def fallback_format(vocab: Tokenizer | Collection[str] | None) -> str:
    """The built-in format for a model without a template, from the turn markers its vocabulary holds."""
    def has(text: str) -> bool:
        if vocab is None:
            return False
        return vocab.token_id(text) is not None if hasattr(vocab, "token_id") else text in vocab

    name, marker = next(((n, m) for n, m in _FORMAT_EVIDENCE if has(m)), ("chatml", None))
    if (name, marker) not in _logged:  # once per choice, not once per request
        _logged.add((name, marker))
        if marker:
            log.info("chat: no chat template in the model; its vocabulary has %s, so using llama.cpp's built-in "
                     "'%s' format", marker, name)
        else:
            log.warning("chat: no chat template and no known turn markers in the vocabulary; using ChatML as "
                        "llama.cpp does")
    return name


def render_chat(template: str | None, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", vocab: Tokenizer | Collection[str] | None = None,
                **extra: Any) -> str:
    """Render `messages` with a Jinja chat template, or with llama.cpp's built-in format when `template` is empty.

    `vocab` (a Tokenizer or a collection of token texts) picks the built-in format; `extra` goes to the template
    (tools, enable_thinking, ...). A template may also name a built-in format ("chatml", "gemma", "llama3").
    """
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"chat: every message needs a string 'role', got {m!r}.")
    if template in BUILTIN_FORMATS:
        return BUILTIN_FORMATS[template](messages, add_generation_prompt)
    if not template:
        return BUILTIN_FORMATS[fallback_format(vocab)](messages, add_generation_prompt)
    try:
        return _compile(template).render(messages=list(messages), bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template: rendering failed: {e}") from None


def render_prompt(tokenizer: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                  template: str | None = None, **extra: Any) -> str:
    """The prompt text to tokenize with `encode(..., add_special=True)`, as llama.cpp's server builds it.

    The template writes `bos_token` itself in many models; the tokenizer adds BOS too when the GGUF says so, so the
    rendered BOS (and an EOS the tokenizer would append) is removed to avoid doubling it.
    """
    text = render_chat(template or tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text, vocab=tokenizer, **extra)
    bos, eos = tokenizer.bos_text, tokenizer.eos_text
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]
    if tokenizer.add_eos and eos and text.endswith(eos):
        text = text[:-len(eos)]
    return text


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                template: str | None = None, **extra: Any) -> list[int]:
    """Token ids of a chat prompt: render_prompt, then tokenize with BOS/EOS as the GGUF asks and special tokens on."""
    text = render_prompt(tokenizer, messages, add_generation_prompt=add_generation_prompt, template=template, **extra)
    return tokenizer.encode(text, add_special=True, parse_special=True)
