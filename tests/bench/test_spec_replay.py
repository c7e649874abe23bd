"""benchmarks/h200/spec_replay.py on the CPU with tiny models: the replay makes SpeculativeDecoder's engine calls with
the trace's acceptance forced, so it commits exactly 1 + sum(accepted + 1) tokens and leaves no sequence behind (the
GPU numbers themselves come from the device call). Token trees (issue 39): benchmarks/spec.py records each tree step's
shape and accepted path, and the replay's tree verify accepts exactly that path, with plain decoding's ids."""

from __future__ import annotations

import pytest

from tests.bench._load import load_benchmark_module

replay_module = load_benchmark_module("h200/spec_replay")
spec = load_benchmark_module("spec")
Step = replay_module.Step

# tree steps, each accepting through another kind of node: a sibling at depth 2, a sibling of the first token (the
# root's), the chain alone past a sibling, and nothing at all
TREE_STEPS = [
    ((5, 3), [-1, 0, 1, 0, 1], [0, 1, 4]),
    ((2, 1), None, None),
    ((3, 1), [-1, 0, -1], [2]),
    ((4, 3), [-1, 0, 1, 1], [0, 1, 2]),
    ((2, 0), [-1, -1], []),
]


def _tree_record(steps) -> dict:
    return {"trace": [k_n for k_n, _, _ in steps],
            "tree_trace": [{"step": i, "parents": p, "path": path} for i, (_, p, path) in enumerate(steps) if p]}


@pytest.mark.unit
def test_steps_of_reads_chains_and_trees_and_refuses_a_mismatch():
    steps = replay_module.steps_of(_tree_record(TREE_STEPS))
    assert steps[1] == Step(2, 1) and steps[0] == Step(5, 3, (-1, 0, 1, 0, 1), (0, 1, 4))
    assert [s.chain for s in steps] == [3, 2, 2, 3, 1]
    bad = _tree_record(TREE_STEPS)
    bad["trace"][0] = (5, 2)
    with pytest.raises(ValueError, match="step 0"):
        replay_module.steps_of(bad)


@pytest.mark.unit
def test_trimmed_keeps_the_chain_prefix_its_siblings_and_the_path_up_to_a_cut():
    tree = Step(5, 3, (-1, 0, 1, 0, 1), (0, 1, 4))
    assert tree.trimmed(3) == tree
    # chain cut to 2: node 2 goes and so does its runner-up (node 4, on the path: the path stops before it); the
    # sibling of node 1 (parent 0) stays and moves down one index
    assert tree.trimmed(2) == Step(3, 2, (-1, 0, 0), (0, 1))
    # 4 nodes: the last sibling (on the path) goes, so the path stops before it
    assert tree.trimmed(3, 4) == Step(4, 2, (-1, 0, 1, 0), (0, 1))
    # chain of 1: no sibling is left (the one of node 1 would read as the chain's second token): a chain
    assert tree.trimmed(1) == Step(1, 1)
    assert Step(3, 1, (-1, 0, -1), (2,)).trimmed(1) == Step(2, 1, (-1, -1), (1,))
    assert tree.trimmed(3, 3) == Step(3, 2)  # the chain alone: accepted up to the sibling
    assert Step(6, 4).trimmed(3, 3) == Step(3, 3)


@pytest.mark.unit
def test_cut_fits_the_decode_cost_rows_and_chains_where_no_tree_verifies():
    class Engine:
        verify_rows_at_decode_cost, verifies_trees = 4, True

    tree = Step(5, 3, (-1, 0, 1, 0, 1), (0, 1, 4))
    assert replay_module.cut(Engine(), [tree, Step(6, 5)]) == [Step(3, 2), Step(3, 3)]
    Engine.verify_rows_at_decode_cost = 0
    assert replay_module.cut(Engine(), [tree]) == [tree]
    Engine.verifies_trees = False
    assert replay_module.cut(Engine(), [tree, Step(3, 1, (-1, 0, -1), (2,))]) == [Step(3, 2), Step(2, 0)]


@pytest.mark.unit
def test_tree_tokens_put_the_target_ids_on_the_path_and_others_elsewhere():
    want = [10, 11, 12, 13]
    tokens = replay_module.tree_tokens(Step(5, 3, (-1, 0, 1, 0, 1), (0, 1, 4)), want, 100)
    assert tokens[0] == 10 and tokens[1] == 11 and tokens[4] == 12  # the path, by depth
    assert tokens[3] != 11 and tokens[2] != 12  # the path's siblings: not what the target chooses there


@pytest.mark.unit
def test_positions_count_chain_and_sibling_nodes_per_depth():
    pos = replay_module.positions([([-1, 0, 1, 0, 1], [0, 1, 4]), ([-1, 0, -1], [2])])
    assert pos[0] == {"chain": [1, 2], "sibling": [1, 1]}
    assert pos[1] == {"chain": [1, 2], "sibling": [0, 1]} and pos[2] == {"chain": [0, 1], "sibling": [1, 1]}
    assert replay_module.add_positions(pos, pos[:1])[0] == {"chain": [2, 4], "sibling": [2, 2]}


def _trace(rows: dict[str, dict], tokens: int = 24, meta: dict | None = None) -> dict:
    return {"meta": meta or {}, "rows": [{"task": task, "name": f"{task}/0", "prompt_tokens": 20, "tokens": tokens,
                                          "drafters": rows} for task in ("humaneval", "edit")]}


@pytest.mark.e2e
def test_replay_commits_the_traced_tokens_and_times_verify(tiny):
    """Chains replay as before: each step's count of the trace accepted, plain decoding's ids."""
    target, draft = tiny("tiny-qwen2"), tiny("tiny-qwen2", seed=7)
    steps = {"draft model": [(4, 4), (6, 1), (2, 0)], "prompt lookup": [(3, 3), (1, 0)]}
    doc = replay_module.replay(target.artifact, draft.artifact, _trace({n: {"trace": s} for n, s in steps.items()},
                                                                       tokens=12), prompts=1)
    assert set(doc["target"]["verify_ms"]) == {str(s) for s in replay_module.VERIFY_ROWS}
    assert doc["target"]["decode_ms"] > 0 and doc["draft"]["decode_ms"] > 0
    assert [r["task"] for r in doc["rows"]] == ["humaneval", "edit"]
    for row in doc["rows"]:
        for name, s in steps.items():
            got = row["drafters"][name]
            assert got["tokens"] == 1 + sum(n + 1 for _, n in s) and got["accepted"] == sum(n for _, n in s)
            assert got["s"] > 0 and got["plain_s"] > 0
            assert got["replayed"] == got["steps"] == len(s) and got["identical"] and "positions" not in got
    assert {(t["task"], t["drafter"]) for t in doc["tasks"]} == {(t, n) for t in ("humaneval", "edit") for n in steps}


@pytest.mark.e2e
def test_replay_verifies_the_traced_trees_beside_chains(tiny):
    """A tree step's verify accepts exactly the trace's path (siblings included), chains beside it theirs, and the
    ids are plain decoding's; the report has tree positions and the three drafters per task."""
    target, draft = tiny("tiny-llama"), tiny("tiny-llama", quant="Q4_0")
    record = _tree_record(TREE_STEPS)
    rows = {"draft model": {"trace": [(3, 2), (2, 2)]}, "draft tree": record, "prompt lookup": {"trace": [(2, 1)]}}
    doc = replay_module.replay(target.artifact, draft.artifact, _trace(rows, meta={"branch": 0.05}), prompts=1)
    assert doc["target_verifies_trees"]
    for row in doc["rows"]:
        got = row["drafters"]["draft tree"]
        assert got["tokens"] == 1 + sum(n + 1 for (_, n), _, _ in TREE_STEPS)
        assert got["accepted"] == sum(n for (_, n), _, _ in TREE_STEPS)
        assert got["replayed"] == got["steps"] == len(TREE_STEPS) and got["identical"]
        assert got["tree_steps"] == 4
        sibling_accepted = sum(p["sibling"][0] for p in got["positions"])
        assert sibling_accepted == 2 and sum(p["chain"][0] for p in got["positions"]) == 3 + 2 + 0
        assert row["drafters"]["draft model"]["identical"] and row["drafters"]["prompt lookup"]["replayed"] == 1
    tasks = {(t["task"], t["drafter"]): t for t in doc["tasks"]}
    assert set(tasks) == {(t, n) for t in ("humaneval", "edit") for n in rows}
    assert tasks[("edit", "draft tree")]["positions"][0] == {"chain": [2, 4], "sibling": [1, 2]}
    assert "positions" not in tasks[("edit", "draft model")]


@pytest.mark.e2e
def test_spec_records_trees_that_the_replay_accepts_again(tiny, engine_of):
    """benchmarks/spec.py's record of a tree drafter (DraftModel with branch): each tree step's parents and path agree
    with its trace entry and form a path from the root; a chain drafter's record keeps the old keys. Replayed, every
    step accepts what was recorded, with plain decoding's ids."""
    from luce_runtime.sampler import SamplingParams
    from luce_runtime.speculative import DraftModel, SpeculativeDecoder

    target, draft = tiny("tiny-llama"), tiny("tiny-llama", quant="Q4_0")
    engine, draft_engine = engine_of(target), engine_of(draft)
    params = SamplingParams(temperature=0, max_tokens=32)
    prompt = list(range(5, 25))
    plain_ids = list(engine.generate(prompt, params))
    records = {}
    for name, branch in (("draft model", 0.0), ("draft tree", 0.05)):
        decoder = SpeculativeDecoder(engine, DraftModel(draft_engine, engine, branch=branch), draft_max=4,
                                     timed_length=False)
        ids, records[name] = spec.run_drafter(decoder, prompt, params)
        assert ids == plain_ids
    assert "tree_trace" not in records["draft model"] and "tree_steps" not in records["draft model"]
    tree = records["draft tree"]
    assert tree["tree_trace"] and len(tree["tree_trace"]) == tree["tree_steps"]
    for t in tree["tree_trace"]:
        assert tuple(tree["trace"][t["step"]]) == (len(t["parents"]), len(t["path"]))
        assert all(t["parents"][node] == (t["path"][i - 1] if i else -1) for i, node in enumerate(t["path"]))
    steps = replay_module.steps_of(tree)
    assert sum(s.n for s in steps) == tree["accepted"]
    doc = replay_module.replay(target.artifact, draft.artifact,
                               {"meta": {"branch": 0.05}, "rows": [{"task": "t", "name": "t/0", "prompt_tokens": 20,
                                                                    "tokens": 32, "drafters": records}]}, prompts=1)
    for name, record in records.items():
        got = doc["rows"][0]["drafters"][name]
        assert got["tokens"] == 1 + sum(n + 1 for _, n in record["trace"])  # the CPU run's plain steps aside
        assert got["replayed"] == got["steps"] == len(record["trace"]) and got["identical"], (name, got)
        assert got["accepted"] == record["accepted"]
    assert doc["rows"][0]["drafters"]["draft tree"]["tree_steps"] == tree["tree_steps"]
