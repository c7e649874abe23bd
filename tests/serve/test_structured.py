"""Every json_schema response validates against its schema (jsonschema), on 120 schemas from a seeded generator,
sampled at temperature 1 through the official `openai` client, 8 requests at a time (batched decode with one grammar
state per sequence). Strings, arrays and integers are bounded so that every answer ends well inside max_tokens: a
truncated answer would be invalid JSON however good the constraint is."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

N_SCHEMAS = 120
WORDS = ["red", "green", "blue", "alpha", "beta", "x", "y", "mode", "auto", "none"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "null", "enum", "const", "anyOf"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        # multipleOf bounds the fraction's digits (a plain number may have as many as the model likes)
        return {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.25}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice([*WORDS, 7, True])}
    if kind == "anyOf":
        return {"anyOf": [_leaf(rng), {"type": "integer", "minimum": 0, "maximum": 9}]}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.3:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.45:
        return {"type": "array", "items": _node(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["id", "name", "size", "tags", "color", "ok", "info", "count", "kind", "note"],
                       rng.randint(1, 4))
    props = {n: _node(rng, depth) for n in names}
    required = names if rng.random() < 0.6 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(seed: int = 15) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng) for _ in range(N_SCHEMAS)]


def test_generated_schemas_are_valid_json_schemas():
    for s in schemas():
        jsonschema.Draft202012Validator.check_schema(s)


def test_every_json_schema_response_validates(server, oai):
    def ask(i_schema: tuple[int, dict[str, Any]]) -> tuple[int, str, str]:
        i, schema = i_schema
        r = oai.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Fill in this record."}], max_tokens=240,
            temperature=1.0, seed=i, response_format={"type": "json_schema",
                                                      "json_schema": {"name": f"s{i}", "schema": schema,
                                                                      "strict": True}})
        return i, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, enumerate(schemas())))
    all_schemas = schemas()
    for i, text, finish in results:
        assert finish == "stop", (i, finish, text, all_schemas[i])
        jsonschema.validate(json.loads(text), all_schemas[i])
