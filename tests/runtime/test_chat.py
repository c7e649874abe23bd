"""Chat templates: Jinja rendering as transformers/llama-cpp-python, built-in formats as llama.cpp (llama-chat.cpp)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
from luce_runtime.chat import encode_chat, fallback_format, render_chat, render_prompt
from luce_runtime.errors import TokenizerError
from luce_runtime.tokenizer import Tokenizer

from tests.conftest import requires_llama_cpp
from tests.runtime.corpus import tiny_spm_metadata

CHATML_JINJA = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")
MESSAGES = [
    {"role": "system", "content": "  Be brief.\n"},
    {"role": "user", "content": "Hi there!\n"},
    {"role": "assistant", "content": " Hello. "},
    {"role": "user", "content": "What is 2+2? ünïcödé 😀"},
]
GEMMA_EXPECTED = ("<start_of_turn>user\nBe brief.\n\nHi there!<end_of_turn>\n"
                  "<start_of_turn>model\nHello.<end_of_turn>\n"
                  "<start_of_turn>user\nWhat is 2+2? ünïcödé 😀<end_of_turn>\n"
                  "<start_of_turn>model\n")


@pytest.mark.unit
def test_jinja_template_renders_like_transformers() -> None:
    out = render_chat(CHATML_JINJA, MESSAGES[1:2])
    assert out == "<|im_start|>user\nHi there!\n<|im_end|>\n<|im_start|>assistant\n"
    assert not render_chat(CHATML_JINJA, MESSAGES[1:2], add_generation_prompt=False).endswith("assistant\n")
    # trim_blocks/lstrip_blocks: block tags on their own lines leave no blank lines behind
    template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"
    assert render_chat("{{ messages[0] | tojson }}", [{"role": "user", "content": "é"}]) == \
        '{"role": "user", "content": "é"}'
    assert render_chat("{{ strftime_now('%Y') | length }}{{ bos_token }}{{ tools }}", [], bos_token="<s>",
                       tools=[1]) == "4<s>[1]"


@pytest.mark.unit
@pytest.mark.parametrize(("template", "needle"), [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}", "syntax error"),
    ("{{ ''.__class__.__mro__ }}", "rendering failed"),  # the sandbox refuses attribute tricks
])
def test_template_errors_are_tokenizer_errors(template: str, needle: str) -> None:
    with pytest.raises(TokenizerError, match=needle):
        render_chat(template, MESSAGES)


@pytest.mark.unit
def test_fallback_is_chosen_from_the_vocabulary(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="luce_runtime.chat"):
        assert fallback_format({"<start_of_turn>", "<end_of_turn>"}) == "gemma"
    assert fallback_format({"<|start_header_id|>"}) == "llama3"
    assert fallback_format({"<|im_start|>"}) == "chatml"
    assert fallback_format(set()) == "chatml"  # llama.cpp's own default
    assert render_chat(None, MESSAGES, vocab={"<start_of_turn>"}) == GEMMA_EXPECTED
    assert render_chat("", MESSAGES[1:2], vocab=None) == "<|im_start|>user\nHi there!\n<|im_end|>\n" \
        "<|im_start|>assistant\n"
    tok = Tokenizer.from_metadata(tiny_spm_metadata())  # its vocabulary has <start_of_turn>
    assert render_chat(None, MESSAGES, vocab=tok) == GEMMA_EXPECTED
    assert fallback_format(tok) == "gemma"


@pytest.mark.unit
def test_gemma_format_without_system_and_generation_prompt() -> None:
    out = render_chat("gemma", MESSAGES[1:3], add_generation_prompt=False)
    assert out == "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text",
                                                                                             "text": "b"}]}]
    assert render_chat("gemma", parts) == "<start_of_turn>user\na\nb<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(TokenizerError, match="role"):
        render_chat("gemma", [{"content": "no role"}])


@pytest.mark.unit
def test_render_prompt_does_not_double_bos() -> None:
    tok = Tokenizer.from_metadata(tiny_spm_metadata())  # adds BOS "<s>" itself
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
    assert render_chat(template, MESSAGES[1:2], bos_token=tok.bos_text, eos_token=tok.eos_text) == \
        "<s>Hi there!\n</s>"
    assert render_prompt(tok, MESSAGES[1:2], template=template) == "Hi there!\n</s>"  # add_eos is off: EOS stays
    ids = encode_chat(tok, [{"role": "user", "content": "hello"}], template=template)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1 and ids[-1] == tok.eos_id


# -- against llama.cpp and llama-cpp-python ------------------------------------------------------------------------
def _llama_cpp_builtin(name: str | None, messages: list[dict[str, str]], add_ass: bool) -> str:
    """llama_chat_apply_template: llama.cpp's C++ rendering of a built-in format (NULL → its default)."""
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages])
    tmpl = name.encode() if name else None
    n = llama_cpp.llama_chat_apply_template(tmpl, chat, len(messages), add_ass, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    n = llama_cpp.llama_chat_apply_template(tmpl, chat, len(messages), add_ass, buf, n + 1)
    return buf.raw[:n].decode()


CONVERSATIONS = [MESSAGES, MESSAGES[1:], MESSAGES[:2], MESSAGES[1:2],
                 [{"role": "user", "content": "<b>tags</b>\n\n\tand  spaces  "}]]


@requires_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("name", ["chatml", "gemma", "llama3", None])
@pytest.mark.parametrize("add_ass", [True, False])
def test_builtin_formats_match_llama_cpp(name: str | None, add_ass: bool) -> None:
    for messages in CONVERSATIONS:
        assert render_chat(name, messages, add_generation_prompt=add_ass) == \
            _llama_cpp_builtin(name, messages, add_ass)


@requires_llama_cpp
@pytest.mark.slow
def test_smollm2_gguf_template_matches_llama_cpp_python(smollm2_path: Path) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from luce_compile.gguf.reader import read_gguf

    tok = Tokenizer.from_metadata(read_gguf(smollm2_path).metadata)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    for add_ass in (True, False):
        ref = Jinja2ChatFormatter(tok.chat_template, eos_token=tok.eos_text, bos_token=tok.bos_text,
                                  add_generation_prompt=add_ass)
        for messages in CONVERSATIONS:
            ours = render_chat(tok.chat_template, messages, add_generation_prompt=add_ass, bos_token=tok.bos_text,
                               eos_token=tok.eos_text)
            assert ours == ref(messages=messages).prompt
    # SmolLM2's template adds its default system prompt; it has no BOS to strip (add_bos is false)
    prompt = render_prompt(tok, MESSAGES[1:2])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert encode_chat(tok, MESSAGES[1:2])[:2] == [tok.token_id("<|im_start|>"), tok.token_id("system")]


@pytest.mark.slow
def test_gemma3_without_template_uses_the_gemma_format(gemma3_path: Path) -> None:
    from luce_compile.gguf.reader import read_gguf

    tok = Tokenizer.from_metadata(read_gguf(gemma3_path).metadata)
    assert tok.chat_template is None
    assert render_prompt(tok, MESSAGES) == GEMMA_EXPECTED
    ids = encode_chat(tok, MESSAGES[1:2])
    start, end = tok.token_id("<start_of_turn>"), tok.token_id("<end_of_turn>")
    assert ids[:3] == [tok.bos_id, start, tok.token_id("user")]
    assert ids.count(end) == 1 and ids[-3:] == [start, tok.token_id("model"), tok.token_id("\n")]
    assert end in tok.eos_ids  # generation stops at the end of the model's turn
