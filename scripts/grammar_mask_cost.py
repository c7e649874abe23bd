"""What grammar-constrained decoding costs per token on real vocabularies: llguidance (the runtime's choice) and,
when importable, outlines-core for comparison.

    .venv/bin/python scripts/grammar_mask_cost.py [--models smollm2-135m qwen2.5-coder-0.5b] [--json]
    # outlines-core is not a dependency; to compare: pip install --target /tmp/oc outlines-core, PYTHONPATH=/tmp/oc

For each tokenizer and schema: the one-time setup (llguidance's token trie per tokenizer; outlines-core's index per
schema), and per generated token the mask computation plus applying it to a float32 logits row (what the scheduler
does before sampling), walking the tokens of a valid instance of the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from luce_runtime.grammar import GrammarBackend, json_schema_grammar

from luce_compile.cli import load_tokenizer
from luce_compile.models import fetch

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                       "ok": {"type": "boolean"}},
                     "required": ["name", "age", "ok"], "additionalProperties": False},
                    {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested + enum + array": ({"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "t": {"type": "number"}, "note": {"type": "string"}}, "required": ["t", "note"]}}},
        "required": ["city", "days"]},
        {"city": "Rome", "days": [{"t": 21.5, "note": "sunny all day"}, {"t": -3, "note": "snow"}]}),
    "any JSON object": ({"type": "object"}, {"a": [1, 2, {"b": None}], "c": "text with \"quotes\""}),
}


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(x * 1e6 for x in xs)
    return {"mean_us": round(statistics.fmean(xs), 1), "p50_us": round(xs[len(xs) // 2], 1),
            "p99_us": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 1), "tokens": len(xs)}


def bench_llguidance(tok: Any, schema: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    t = time.perf_counter()
    c = GrammarBackend.of(tok).constraint(json_schema_grammar(schema))
    compile_s = time.perf_counter() - t
    logits = np.random.default_rng(0).standard_normal(tok.vocab_size).astype(np.float32)
    mask_t, apply_t = [], []
    for i in ids:
        t0 = time.perf_counter()
        allowed = c.allowed()
        t1 = time.perf_counter()
        np.where(allowed, logits, -np.inf)
        apply_t.append(time.perf_counter() - t1)
        mask_t.append(t1 - t0)
        assert allowed[i], f"token {i} of the instance was masked out"
        c.consume(i)
    return {"compile_ms": round(compile_s * 1e3, 2), "mask": _stats(mask_t), "apply": _stats(apply_t)}


def bench_outlines(tok: Any, schema: dict[str, Any], ids: list[int]) -> dict[str, Any] | None:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    eos = tok.eos_id
    pieces: dict[bytes, list[int]] = {}
    for t in range(tok.vocab_size):
        piece = tok.token_to_piece(t, special=False)
        if piece and t != eos:
            pieces.setdefault(piece, []).append(t)
    t = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(schema), r"( )?"), Vocabulary(eos, pieces))
    index_s = time.perf_counter() - t
    guide, mask = Guide(index), np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    mask_t = []
    for i in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        mask_t.append(time.perf_counter() - t0)
        guide.advance(i)
    return {"index_s": round(index_s, 2), "mask": _stats(mask_t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for model in args.models:
        tok = load_tokenizer(fetch(model))
        t = time.perf_counter()
        GrammarBackend.of(tok)
        trie_s = time.perf_counter() - t
        for name, (schema, instance) in SCHEMAS.items():
            # compact separators, as the grammar (JSON_OPTIONS) writes JSON
            ids = tok.encode(json.dumps(instance, separators=(", ", ": ")), add_special=False, parse_special=False)
            row = {"model": model, "vocab": tok.vocab_size, "trie_s": round(trie_s, 2), "schema": name,
                   "llguidance": bench_llguidance(tok, schema, ids), "outlines_core": bench_outlines(tok, schema, ids)}
            results.append(row)
            if not args.json:
                lg, oc = row["llguidance"], row["outlines_core"]
                print(f"{model:20s} vocab {tok.vocab_size:6d} {name:22s} llguidance: trie {trie_s:.2f} s, compile "
                      f"{lg['compile_ms']} ms, mask mean {lg['mask']['mean_us']} us p99 {lg['mask']['p99_us']} us, "
                      f"apply {lg['apply']['mean_us']} us"
                      + (f" | outlines-core: index {oc['index_s']} s, mask mean {oc['mask']['mean_us']} us"
                         if oc else ""))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
