"""Tokenizer test corpus: the strings where tokenizers tend to disagree with llama.cpp.

Each entry is (name, text); names make test ids readable. Keep entries short except PROSE, so a failure points at
the feature that broke.
"""

from __future__ import annotations

_PROSE = """\
The lighthouse keeper had kept the same routine for thirty-one years. Every evening at dusk he climbed the
ninety-seven steps, trimmed the wick, polished the great lens until it threw the last of the daylight back at the
sea, and wrote three lines in the log: the time, the weather, and whatever he had seen. Most nights it was nothing
worth recording - a fishing boat heading home, gulls arguing over a crate that had washed up on the rocks, the
ferry from the mainland running ten minutes late again. But he wrote it down anyway, because the log was the only
thing on the island that would outlast him, and he wanted it to be honest.

In the spring of 1987 the company sent a young engineer named Clara to install an automatic lamp. She arrived with
two crates of equipment, a toolbox that weighed more than she did, and a stack of manuals she never opened. "You
won't need to climb those stairs anymore," she told him on the first day, not unkindly. He said he'd think about
it. She laughed, and he decided he liked her.

It took her six weeks. The old clockwork had to come out piece by piece; the new controller was the size of a
shoebox and ran on a battery that charged from panels bolted to the gallery rail. On the last night she showed
him how it worked: a light sensor, a timer, a relay that clicked once when the sun went down. "It'll do this every
night for twenty years," she said, "whether anyone's watching or not."

He watched anyway. He climbed the stairs at dusk out of habit, sat on the bench by the lens, and listened for the
click. When it came, he wrote in the log - the time, the weather, and one more line: "Lamp lit itself. Clara's
machine works." Then, because it seemed wrong to leave the page so empty, he added what he'd seen: a container
ship far out on the horizon, its deck lights strung like beads; a seal on the lower rocks; the ferry, on time for
once. He kept writing for eleven more years. The log is in the county museum now, all forty-two volumes of it,
and the last entry reads simply: "Clear skies. Light's on. Nothing to report, and that's the best news there is."

Questions people ask about it: Was he lonely? (He said no.) Did he ever leave? (Twice, for weddings.) What did he
do with the wages? He saved 83% of them, bought a small boat for £1,250, and named it after the engineer. It's
still moored in the harbour - paint peeling, engine long gone - with CLARA in faded letters on the stern.
"""

CORPUS: list[tuple[str, str]] = [
    # digits, long numbers, non-ASCII numerals (smollm splits every \p{N} on its own; llama3 groups by three)
    ("digits", "0 1 12 123 1234 12345 123456 1234567"),
    ("long_number", "3.14159265358979323846264338327950288419716939937510 and 1,000,000,000.00"),
    ("half_cup", "a ½ cup"),
    ("arabic_indic_digit", "page ٣"),
    ("vulgar_fraction", "10 ⅓"),
    ("superscripts", "²³ x² + y³ = z⁴"),
    ("roman_and_circled", "Ⅻ ⑦ ⒛ 𝟘𝟙𝟚"),
    ("devanagari_digits", "१२३ and ๑๒๓"),
    # code, tabs, CRLF, whitespace runs
    ("code_tabs", "def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n\treturn -x\n"),
    ("code_crlf", "int main() {\r\n    printf(\"hi\\n\");\r\n    return 0;\r\n}\r\n"),
    ("json", '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}'),
    ("spaces_run", "a  b   c    d     e          f"),
    ("newlines_run", "line1\n\nline2\n\n\n\nline3\n \n  \n"),
    ("mixed_whitespace", " \t \n\r\n\u00a0\u2003\u3000x\u2028y\u0085z"),
    ("trailing_spaces", "trailing   "),
    ("leading_spaces", "   leading"),
    ("leading_trailing", "  both sides  "),
    ("empty", ""),
    ("single_space", " "),
    ("two_spaces", "  "),
    ("single_newline", "\n"),
    ("tab_only", "\t"),
    # accents, NFC vs NFD
    ("accents_nfc", "café naïve résumé Ångström São Paulo"),
    ("accents_nfd", "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m"),
    ("combining_stack", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f"),
    # scripts
    ("cjk", "我爱自然语言处理。今天天气很好！"),
    ("japanese", "こんにちは、世界。カタカナとひらがなと漢字。"),
    ("korean", "안녕하세요 세계! 한국어 토큰화 테스트입니다."),
    ("thai", "สวัสดีครับ ภาษาไทยไม่มีการเว้นวรรค"),
    ("hindi", "नमस्ते दुनिया, यह एक परीक्षण है।"),
    ("arabic", "مرحبا بالعالم، هذا اختبار."),
    ("hebrew", "שלום עולם, זה מבחן."),
    ("greek", "Γειά σου Κόσμε! Αυτό είναι ένα τεστ."),
    ("cyrillic", "Привет, мир! Это тест токенизатора."),
    ("mixed_scripts", "Hello世界Привет123مرحبا🙂end"),
    # emoji: ZWJ sequences, skin tones, flags, keycaps
    ("emoji_simple", "I ❤️ tokenizers 😀😃😄"),
    ("emoji_zwj", "👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🧑🏽‍🚀"),
    ("emoji_skin_tones", "👍🏻 👍🏼 👍🏽 👍🏾 👍🏿"),
    ("emoji_flags", "🇺🇸🇫🇷🇯🇵 🇩🇪"),
    ("emoji_keycap", "1️⃣ #️⃣ *️⃣"),
    # contractions, upper-case ones too
    ("contractions", "it's don't they're we've I'm you'll he'd"),
    ("contractions_upper", "IT'S DON'T THEY'RE WE'VE I'M YOU'LL HE'D It'S"),
    ("case_runs", "HelloWorld XMLHttpRequest iPhone getHTTPResponseCode McDONALD's ÉCOLE Éclair ǅemal"),
    ("slash_after_newline", "a/b\n/c\r\n//d ./e?\n/"),
    ("apostrophes", "'s 't 're ' ' '' rock 'n' roll O'Neil 'quoted'"),
    ("detok_cleanup", "Hello , world ! Is it ? Yes . He said ' hi ' and 's 'm 're 've 'll 'd"),
    # special tokens written in the text
    ("chatml", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ("gemma_turns", "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"),
    ("bos_eos_text", "<bos>text<eos> <s>x</s> <|endoftext|>"),
    ("harmony", "<|start|>assistant<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
                "<|message|>Hi<|return|> <|constrain|>json<|call|>"),
    ("special_glued", "a<|im_end|>b<end_of_turn>c<bos><bos>"),
    ("special_partial", "<|im_start <|im_end| <start_of_turn <unused0> [multimodal] <pad>"),
    ("html_tags", "<table><tr><td>cell</td></tr></table> <b>bold</b> <h1>T</h1>"),
    # odd text
    ("replacement_char", "\ufffd\ufffd bad \ufffd bytes"),
    ("byte_order_mark", "\ufeffBOM at start"),
    ("control_chars", "bell\x07 null\x00 esc\x1b[0m del\x7f"),
    ("private_use", "\ue000\uf8ff \U000f0000"),
    ("unassigned", "\u0378 \U0001fbff \U000e01f0"),
    ("very_long_word", "pneumonoultramicroscopicsilicovolcanoconiosis" * 8),
    ("long_repeat", "a" * 300 + " " + "ab" * 150),
    ("punctuation_run", "!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@"),
    ("urls", "https://example.com/path?q=1&r=two#frag mailto:someone@example.org"),
    ("math", "∀x∈ℝ: x² ≥ 0 ⇒ √x ∈ ℝ⁺ ∪ {0}; ∑ᵢ aᵢ ≈ ∫ f(x) dx"),
    ("currency", "$5 €10 £20 ¥30 ₹40 ₿0.001"),
    ("fullwidth", "ＡＢＣ１２３！？"),
    ("prose", _PROSE),
]


def texts() -> list[str]:
    return [text for _, text in CORPUS]


# -- tiny synthetic vocabularies for fast unit tests (GGUF metadata as plain JSON values) ---------------------------
def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's 256 byte symbols in byte order (printable bytes stand for themselves, the rest move to U+0100...)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "e l", "Ġ ,"]
BPE_EXTRA = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld", "el", "Ġ,"]
BPE_SPECIAL = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 1), ("<tool>", 4)]


def tiny_bpe_metadata(pre: str = "gpt-2", **keys: object) -> dict[str, object]:
    """Byte alphabet (ids 0-255), a few merged tokens, then specials; <|im_end|> is typed NORMAL on purpose."""
    tokens = gpt2_byte_alphabet() + BPE_EXTRA + [t for t, _ in BPE_SPECIAL]
    types = [1] * (256 + len(BPE_EXTRA)) + [k for _, k in BPE_SPECIAL]
    md: dict[str, object] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                             "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(BPE_MERGES),
                             "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
                             "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>")}
    md.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return md


SPM_PIECES = [("▁", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("a", -2.0), ("b", -2.0),
              ("c", -2.0), ("▁h", -3.0), ("▁he", -4.0), ("▁hel", -5.0), ("▁hell", -6.0), ("▁hello", -7.0),
              ("ab", -1.0), ("bc", -2.0), ("aa", -1.0), ("'", -2.0), ("<start_of_turn>", 0.0), ("\n", 0.0)]


def tiny_spm_metadata(**keys: object) -> dict[str, object]:
    """<unk> <s> </s>, the 256 byte-fallback tokens <0xXX>, then SPM_PIECES (turn marker CONTROL, "\n" USER_DEFINED)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(SPM_PIECES) - 2) + [3, 4]
    scores = [0.0] * 259 + [s for _, s in SPM_PIECES]
    md: dict[str, object] = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                             "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores}
    md.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return md
