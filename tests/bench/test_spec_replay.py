"""benchmarks/h200/spec_replay.py on the CPU with tiny models: the replay makes SpeculativeDecoder's engine calls with
the trace's acceptance forced, so it commits exactly 1 + sum(accepted + 1) tokens and leaves no sequence behind (the
GPU numbers themselves come from the device call)."""

from __future__ import annotations

import pytest

from tests.bench._load import load_benchmark_module

pytestmark = pytest.mark.e2e
replay_module = load_benchmark_module("h200/spec_replay")


def test_replay_commits_the_traced_tokens_and_times_verify(tiny):
    target, draft = tiny("tiny-qwen2"), tiny("tiny-qwen2", seed=7)
    steps = {"draft model": [(4, 4), (6, 1), (2, 0)], "prompt lookup": [(3, 3), (1, 0)]}
    trace = {"rows": [{"task": task, "name": f"{task}/0", "prompt_tokens": 20, "tokens": 12,
                       "drafters": {n: {"trace": s} for n, s in steps.items()}} for task in ("humaneval", "edit")]}
    doc = replay_module.replay(target.artifact, draft.artifact, trace, prompts=1)
    assert set(doc["target"]["verify_ms"]) == {str(s) for s in replay_module.VERIFY_ROWS}
    assert doc["target"]["decode_ms"] > 0 and doc["draft"]["decode_ms"] > 0
    assert [r["task"] for r in doc["rows"]] == ["humaneval", "edit"]
    for row in doc["rows"]:
        for name, s in steps.items():
            got = row["drafters"][name]
            assert got["tokens"] == 1 + sum(n + 1 for _, n in s) and got["accepted"] == sum(n for _, n in s)
            assert got["s"] > 0 and got["plain_s"] > 0
