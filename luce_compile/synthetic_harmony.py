"""What a synthetic gpt-oss file carries so that it tokenizes and chats as a real one: llama.cpp's "gpt-4o"
pre-tokenizer, harmony's special tokens and a harmony chat template.

A real gpt-oss GGUF has o200k's 201088 tokens with the harmony specials at 199998-200012 (`<|start|>` 200006, ...)
and OpenAI's chat template. The synthetic files keep SmolLM2's vocabulary (synthetic.py) and its merges, so the
specials go into the padding right after its 49152 tokens, typed CONTROL as the converter types them; llama.cpp
(and luce_runtime's vocab.py) then apply their gpt-oss rules by text: `<|channel|>`, `<|message|>`, `<|start|>` and
`<|constrain|>` print, and `<|end|>` leaves the end-of-generation set while `<|return|>` and `<|call|>` stay.

The template is written here, not copied: OpenAI's (llama.cpp's models/templates/openai-gpt-oss-120b.jinja) renders
the tools as TypeScript and builtin tools too. This one keeps what the server relies on: the `Reasoning: <effort>`
line from `reasoning_effort`, instructions and tools in a developer message, earlier turns' reasoning dropped except
on a tool-call turn that no final answer follows (passed as `thinking`), calls as `to=functions.NAME` commentary
messages, results as `functions.NAME` messages, and `<|start|>assistant` as the generation prompt.
"""

from __future__ import annotations

from typing import Any

from luce_compile.errors import GGUFError

# in o200k_harmony's id order; each goes where SmolLM2's vocabulary ends
HARMONY_TOKENS = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")
TOKEN_TYPE_CONTROL = 3

HARMONY_TEMPLATE = """\
{#- harmony (gpt-oss), written for luce-compile's synthetic gpt-oss files -#}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else "medium" -%}
{{- "<|start|>system<|message|>You are a synthetic gpt-oss model with random weights.\\n" -}}
{{- "Reasoning: " + effort + "\\n\\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}
  {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- if messages and messages[0].role in ("system", "developer") -%}
  {%- set instructions, turns = messages[0].content, messages[1:] -%}
{%- else -%}
  {%- set instructions, turns = "", messages -%}
{%- endif -%}
{%- if instructions or tools -%}
  {{- "<|start|>developer<|message|>" -}}
  {%- if instructions -%}
    {{- "# Instructions\\n\\n" + instructions + "\\n\\n" -}}
  {%- endif -%}
  {%- if tools -%}
    {{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" -}}
    {%- for t in tools -%}
      {{- "// " + t.function.description + "\\n" -}}
      {{- "type " + t.function.name + " = (_: " + t.function.parameters | tojson + ") => any;\\n\\n" -}}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
  {%- endif -%}
  {{- "<|end|>" -}}
{%- endif -%}
{%- set last = namespace(name=none) -%}
{%- for m in turns -%}
  {%- if m.role == "user" -%}
    {{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}
  {%- elif m.role == "assistant" and m.tool_calls -%}
    {%- set later = namespace(final=false) -%}
    {%- for f in turns[loop.index:] if f.role == "assistant" and not f.tool_calls -%}
      {%- set later.final = true -%}
    {%- endfor -%}
    {%- set thought = m.thinking or m.content -%}
    {%- if thought and not later.final -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + thought + "<|end|>" -}}
    {%- endif -%}
    {%- for c in m.tool_calls -%}
      {{- "<|start|>assistant to=functions." + c.function.name + "<|channel|>commentary json<|message|>" -}}
      {{- c.function.arguments | tojson + "<|call|>" -}}
      {%- set last.name = c.function.name -%}
    {%- endfor -%}
  {%- elif m.role == "assistant" -%}
    {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
  {%- elif m.role == "tool" -%}
    {{- "<|start|>functions." + last.name + " to=assistant<|channel|>commentary<|message|>" -}}
    {{- m.content | tojson + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|start|>assistant" -}}
{%- endif -%}
"""


def harmony_tokenizer(keys: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """SmolLM2's tokenizer keys, padded to the model's rows (the first n_tokens are SmolLM2's), made gpt-oss's:
    the harmony specials on the first padding rows, BOS and EOS as o200k_harmony sets them, the "gpt-4o"
    pre-tokenizer and the harmony template."""
    tokens, types = list(keys["tokenizer.ggml.tokens"]), list(keys["tokenizer.ggml.token_type"])
    if len(tokens) < n_tokens + len(HARMONY_TOKENS):
        raise GGUFError(f"synthetic: gpt-oss needs {len(HARMONY_TOKENS)} rows past the tokenizer's {n_tokens} "
                         f"tokens for harmony's special tokens; n_vocab is {len(tokens)}.")
    for i, text in enumerate(HARMONY_TOKENS, start=n_tokens):
        tokens[i], types[i] = text, TOKEN_TYPE_CONTROL
    return {**keys, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.pre": "gpt-4o", "tokenizer.chat_template": HARMONY_TEMPLATE,
            "tokenizer.ggml.bos_token_id": n_tokens + HARMONY_TOKENS.index("<|startoftext|>"),
            "tokenizer.ggml.eos_token_id": n_tokens + HARMONY_TOKENS.index("<|return|>")}
