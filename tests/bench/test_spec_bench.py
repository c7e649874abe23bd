"""benchmarks/spec.py's bookkeeping: per-task sums, the table, the plot and the edit prompts (the timed run itself needs
the real pair and is a benchmark, not a test)."""

from __future__ import annotations

import pytest

from tests.bench._load import load_benchmark_module

spec = load_benchmark_module("spec")
report = load_benchmark_module("report")


def _run(s: float, drafted: int, accepted: int, steps: int, trace: list, identical: bool = True) -> dict:
    return {"s": s, "identical": identical, "drafted": drafted, "accepted": accepted, "steps": steps, "trace": trace}


DOC = {
    "meta": {"date": "2026-12-02T01:00:00+00:00", "cpu": "test cpu", "threads": 2, "load_avg_1m": 0.1,
             "load_avg_1m_end": 0.2, "luce_compile": "0", "target": "t.gguf", "draft": "d.gguf", "gen_len": 8,
             "draft_max": 4, "command": "python benchmarks/spec.py"},
    "rows": [
        {"task": "humaneval", "name": "HumanEval/0", "prompt_tokens": 50, "tokens": 8, "plain_s": 2.0,
         "drafters": {"draft model": _run(1.0, 6, 4, 3, [(4, 3), (2, 1)]),
                      "prompt lookup": _run(2.5, 2, 0, 8, [(2, 0)], identical=False) | {"parted": {"at": 3,
                                                                                              "gap": 0.004}}}},
        {"task": "humaneval", "name": "HumanEval/1", "prompt_tokens": 60, "tokens": 4, "plain_s": 1.0,
         "drafters": {"draft model": _run(0.5, 3, 3, 1, [(3, 3)]), "prompt lookup": _run(1.0, 0, 0, 4, [])}},
        {"task": "code-edit", "name": "HumanEval/0", "prompt_tokens": 90, "tokens": 8, "plain_s": 2.0,
         "drafters": {"draft model": _run(1.6, 4, 2, 4, [(4, 2)]), "prompt lookup": _run(0.8, 8, 7, 1, [(8, 7)])}},
    ],
}


def test_summary_sums_each_task_and_drafter():
    rows = {(s["task"], s["drafter"]): s for s in report.spec_summary(DOC)}
    he = rows[("humaneval", "draft model")]
    assert he["prompts"] == 2 and he["tokens"] == 12
    assert he["plain_tok_s"] == pytest.approx(12 / 3.0) and he["spec_tok_s"] == pytest.approx(12 / 1.5)
    assert he["speedup"] == pytest.approx(2.0)
    assert (he["drafted"], he["accepted"], he["identical"]) == (9, 7, 2)
    assert he["mean_accepted"] == pytest.approx(7 / 3)  # per verify step (the trace), not per target step
    assert he["tokens_per_step"] == pytest.approx((7 + 4) / 4)
    lookup = rows[("humaneval", "prompt lookup")]
    assert lookup["speedup"] == pytest.approx(3.0 / 3.5) and lookup["identical"] == 1
    assert lookup["max_parted_gap"] == 0.004 and he["max_parted_gap"] is None
    assert rows[("code-edit", "prompt lookup")]["speedup"] == pytest.approx(2.5)


def test_table_has_a_row_per_task_and_drafter(tmp_path):
    table = report.spec_table(DOC)
    assert table.count("\n| humaneval |") == 2 and table.count("\n| code-edit |") == 2
    assert "| 2.00x |" in table and "| 2 / 2 |" in table and "| 1 / 2 (parted at near ties: gap ≤ 0.40%" in table
    plot = load_benchmark_module("plot")
    assert plot.plot_spec(DOC, tmp_path / "spec.png").stat().st_size > 0


def test_timed_counts_from_the_first_token():
    ids, seconds = spec.timed(iter([3, 1, 2]))
    assert ids == [3, 1, 2] and 0 <= seconds < 1
    assert spec.timed(iter([])) == ([], 0.0)


def test_edit_prompts_hold_the_solution_and_one_change(monkeypatch):
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"doc\"\"\"\n",
                 "canonical_solution": f"    return x + {i}\n", "entry_point": f"f{i}"} for i in range(4)]
    monkeypatch.setattr(spec, "humaneval_problems", lambda: problems)

    class Tok:
        def encode(self, text, add_special=True):
            return list(text.encode())

    seen = []
    import luce_runtime.chat as chat

    monkeypatch.setattr(chat, "encode_chat", lambda tok, messages: seen.append(messages[0]["content"]) or [1])
    work = spec.prompts(Tok(), 2, 4)
    assert [w["task"] for w in work] == ["humaneval"] * 2 + ["code-edit"] * 4
    assert work[0]["ids"] == list(problems[0]["prompt"].encode())
    assert "`f0_v2`" in seen[0] and "return x + 0" in seen[0] and seen[3].startswith("Rename the function `f3`")


def test_parting_reports_plain_decodings_gap_where_the_ids_part():
    import contextlib

    import numpy as np

    class Engine:  # row i of the logits is what plain decoding sees before its i-th generated token
        rows = np.array([[0.0, 5.0, 1.0], [4.0, 3.99, 0.0], [1.0, 0.0, 2.0]])

        def __init__(self):
            self.fed = 0

        @contextlib.contextmanager
        def sequence(self):
            yield 0

        def prefill(self, seqs, prompts):
            return self.rows[:1]

        def decode(self, seqs, tokens):
            self.fed += 1
            return self.rows[self.fed:self.fed + 1]

    got = spec.parting(Engine(), [9, 9], [1, 0, 2], [1, 1, 2])
    assert got["at"] == 1 and got["gap"] == pytest.approx(0.01 / 4.0)
    assert spec.parting(Engine(), [9], [1, 0], [1, 0, 2]) == {"at": 2, "gap": None}
