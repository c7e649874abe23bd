"""Speculative decoding on the GPU, replayed (issue 14): the real pair's shapes as synthetic GGUFs (the real weights do
not travel), each step's acceptance taken from the CPU run's trace (benchmarks/spec.py's JSON). Runs on the GPU
machine (runtime and this tree; spec.sh's set-up):

    python3 benchmarks/h200/spec_replay.py TARGET_DIR DRAFT_DIR --trace spec.json [--prompts 8] [--out F]

TARGET_DIR and DRAFT_DIR are device_check workload folders whose artifact/ holds weights.bin (`device_check.py gguf`).
The target may be larger than the traced one (the 7B shape, qwen2.5-7b, against a trace of the 1.5B): the replay
forces the trace's acceptance, so it asks what that acceptance is worth at the target's cost. Its vocabulary may be
padded past the draft's (152064 rows against 151936, as the real files): prompts use the ids both have, and the
draft model is fed the target's ids folded into its own.
1. Verify cost: Engine.verify_greedy of S = 1, 2, 4, 8, 16 rows of one sequence after a 256-token prompt (the
   megakernel's rows up to its largest batch, where the artifact has one), beside one greedy decode step
   (Engine.decode_greedy, the megakernel where the engine chose it), medians; each rolled back after.
2. Replay: for the first --prompts prompts of each task of the trace, a random prompt of the same length; plain greedy
   decoding of as many tokens as the CPU run generated, then speculation through the one generation loop
   (luce_runtime.generation, which `run`, `bench` and `serve` step): the drafter makes its real engine calls (the
   draft model's sync and k - 1 greedy steps, or prompt lookup's scan) and then proposes, in place of its own
   tokens, the target's next n greedy ids and one it does not choose, so that the loop's own greedy verify
   (Engine.verify_greedy) accepts the trace's n of k (random weights would accept nothing). Tokens/s from the first
   generated token to the last, as on the CPU.
3. Trees (issue 39): the "draft tree" drafter's steps that verified a token tree (the trace's tree_trace: its parents
   and the node index of each accepted token) are proposed as that tree: the target's greedy ids on the accepted path
   (chain tokens or siblings, as the trace says), tokens the target does not choose at every other node, so that the
   loop's tree verify (Engine.verify_tree_greedy: the megakernel's rows where its kernels take trees, else the per-op
   kernels) and Engine.commit_tree accept exactly that path; its inner drafter is DraftModel(branch=the trace's), so
   the draft model's own steps (logits to the host for the runner-ups) are what they cost. Its other steps are chains.
   A tree is cut to the rows a verify takes at decode cost, as the loop cuts one (the path up to the first node cut);
   on an engine that verifies no trees (a megakernel built before issue 39) it is its chain, as the loop makes it.
The JSON: verify costs, per prompt and drafter the tokens, seconds, plain decoding's seconds, whether the ids equal
plain decoding's, how many steps accepted exactly what the trace says (`replayed`, of `steps`), and for trees the
acceptance per position; `tasks` sums them per task and drafter (tok/s plain and speculative, trees beside chains).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]

VERIFY_ROWS = (1, 2, 4, 8, 16)
DRAFTERS = ("draft model", "prompt lookup", "draft tree")
BRANCH = 0.1  # the draft tree's threshold where a trace does not say (benchmarks/spec.py's --branch default)


@dataclass(frozen=True)
class Step:
    """One verify step of a trace: k tokens drafted, n of them accepted; for a token tree its parents (the chain
    first, then the siblings, as Draft.parents) and path, the node index of each accepted token, root first."""

    k: int
    n: int
    parents: tuple[int, ...] | None = None
    path: tuple[int, ...] = ()

    @property
    def chain(self) -> int:
        """Tokens the drafter is asked for: a tree's leading chain (Draft.chain), all k of a chain."""
        from luce_runtime.speculative import chain_length

        return self.k if self.parents is None else chain_length(self.parents)

    def trimmed(self, chain: int, nodes: int | None = None) -> Step:
        """This step within `chain` chain tokens and `nodes` nodes in all: a tree keeps its first chain tokens, then
        its siblings whose parent stays, in order, and its path up to the first node cut; without a sibling left it
        is a chain (as DraftModel proposes one). A cut chain loses the runner-up of its first token cut too (a
        drafter asked for fewer tokens has none there, and it would read as the chain's next token)."""
        if self.parents is None:
            return Step(min(self.k, chain), min(self.n, chain))
        nodes = len(self.parents) if nodes is None else nodes
        c = min(self.chain, chain, nodes)
        keep: dict[int, int] = {}  # a kept node's index → its index in the cut tree
        parents: list[int] = []
        for i, p in enumerate(self.parents):
            stays = p == -1 or (p in keep and (p != c - 1 or c == self.chain))
            if len(parents) < nodes and (i < c or (i >= self.chain and stays)):
                keep[i] = len(parents)
                parents.append(-1 if p == -1 else keep[p])
        path: list[int] = []
        for node in self.path:
            if node not in keep:
                break
            path.append(keep[node])
        if len(parents) == c:
            return Step(c, len(path))
        return Step(len(parents), len(path), tuple(parents), tuple(path))


def steps_of(record: dict) -> list[Step]:
    """A drafter's record of benchmarks/spec.py (its trace and, for trees, its tree_trace) as Steps."""
    trees = {t["step"]: t for t in record.get("tree_trace", ())}
    out = []
    for i, (k, n) in enumerate(record["trace"]):
        t = trees.get(i)
        if t is None:
            out.append(Step(k, n))
            continue
        if (len(t["parents"]), len(t["path"])) != (k, n):
            raise ValueError(f"spec_replay: the trace's tree at step {i} has {len(t['parents'])} nodes and a path of "
                             f"{len(t['path'])}, its step says {k} and {n}; the trace is inconsistent: rerun spec.py.")
        out.append(Step(k, n, tuple(t["parents"]), tuple(t["path"])))
    return out


def tree_tokens(step: Step, want: list[int], vocab: int) -> list[int]:
    """A tree's tokens: the target's greedy id at its depth (want[d]) at each node of the accepted path, elsewhere
    one it does not choose there (after a path node at depth d - 1 the target chooses want[d]: want[d] + 1 is never
    accepted; past the path any token is)."""
    on_path = set(step.path)
    return [want[d] if i in on_path else (want[d] + 1) % vocab if d < len(want) else 0
            for i, d in enumerate(depths(step.parents))]


def depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Each node's depth in a token tree: 0 for a root (parent -1), its parent's + 1 below it."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p == -1 else out[p] + 1)
    return out


class Forced:
    """A drafter whose step i proposes steps[i] (a Step) with exactly its acceptance: it makes its inner drafter's
    engine calls (their cost is the drafter's), then proposes the target's own next greedy ids (`target_ids`, its
    plain decoding of the same prompt) up to the accepted count, and a token after them that the target does not
    choose; a tree step, its tree with those ids on the trace's path (tree_tokens). Its `length` is the trace's k (a
    DraftLength for the loop). inner_vocab: the draft model's vocabulary where it is smaller than the target's (the
    history's ids are folded into it: the same cost, and no id past its embedding)."""

    def __init__(self, inner, prompt_len: int, target_ids: list[int], steps: list[Step], vocab: int,
                 inner_vocab: int | None = None):
        self.inner, self.prompt_len, self.target_ids, self.vocab = inner, prompt_len, target_ids, vocab
        self.inner_vocab = inner_vocab or vocab
        self.steps, self.step = steps, 0
        self.proposed: list[Step] = []  # each verify's step as proposed (after the loop's k)
        self.name = getattr(inner, "name", "lookup")

    @property
    def k(self) -> int:
        return self.steps[self.step].chain if self.step < len(self.steps) else 0

    def update(self, drafted: int, accepted: int) -> None:
        self.step += bool(drafted)

    def propose(self, history: list[int], k: int, sampler):
        from luce_runtime.speculative import Draft

        inner_history = history if self.inner_vocab >= self.vocab else [t % self.inner_vocab for t in history]
        fed = self.inner.propose(inner_history, k, sampler).fed
        step = self.steps[self.step].trimmed(k)
        self.proposed.append(step)
        at = len(history) - self.prompt_len  # the target's next id is target_ids[at]
        want = self.target_ids[at:at + step.n + 1]
        if step.parents is not None:
            return Draft(tree_tokens(step, want, self.vocab), fed=fed, parents=list(step.parents))
        miss = (want[-1] + 1) % self.vocab if len(want) > step.n else 0  # past the plain ids: any token
        return Draft([*want[:step.n], *[miss] * (step.k - step.n)], fed=fed)

    def reset(self) -> None:
        self.inner.reset()


def positions(trees: list[tuple[list[int], list[int]]]) -> list[dict[str, list[int]]]:
    """Acceptance per tree position, from verified trees' (parents, path): for each depth d (the d-th draft after the
    pending token), [accepted, proposed] of chain tokens and of siblings there."""
    out: list[dict[str, list[int]]] = []
    for parents, path in trees:
        chain = Step(len(parents), len(path), tuple(parents), tuple(path)).chain
        on_path = set(path)
        for i, d in enumerate(depths(parents)):
            while len(out) <= d:
                out.append({"chain": [0, 0], "sibling": [0, 0]})
            kind = out[d]["chain" if i < chain else "sibling"]
            kind[0] += i in on_path
            kind[1] += 1
    return out


def add_positions(a: list[dict[str, list[int]]], b: list[dict[str, list[int]]]) -> list[dict[str, list[int]]]:
    out = [{k: list(v) for k, v in d.items()} for d in a]
    for d, pos in enumerate(b):
        if d == len(out):
            out.append({"chain": [0, 0], "sibling": [0, 0]})
        for kind, (acc, prop) in pos.items():
            out[d][kind][0] += acc
            out[d][kind][1] += prop
    return out


class LookupReplay:
    """Prompt lookup's proposal costs a host scan of the history (microseconds), no device work."""

    name = "prompt lookup"

    def __init__(self):
        from luce_runtime.speculative import NgramDrafter

        self.ngram = NgramDrafter()

    def propose(self, history: list[int], k: int, sampler):
        return self.ngram.propose(history, k, sampler)

    def reset(self) -> None:
        pass


def verify_costs(engine, vocab: int, rng: np.random.Generator, context: int = 256, repeat: int = 10) -> dict:
    """Median ms of one greedy decode step and of a verify of each S in VERIFY_ROWS, one sequence at `context`."""
    from luce_runtime.timing import median_time

    sync = engine.device.sync
    with engine.sequence() as seq:
        engine.prefill([seq], [rng.integers(0, vocab, context).tolist()])
        fed = rng.integers(0, vocab, max(VERIFY_ROWS)).tolist()

        def decode() -> None:
            engine.decode_greedy([seq], fed[:1])
            engine.rollback(seq, 1)

        def verify(s: int) -> None:
            engine.verify_greedy([seq], [fed[:s]])
            engine.rollback(seq, s)

        out = {"context": context, "decode_ms": median_time(decode, repeat, warmup=2, sync=sync) * 1e3}
        # the rows of a verify against the same tokens decoded one by one (both greedy, the paths the engine chose):
        # on the megakernel they are one kernel's rows, so the ids must agree (a near tie aside on other paths)
        rows = min(8, max(VERIFY_ROWS))
        (verified,) = engine.verify_greedy([seq], [fed[:rows]])
        engine.rollback(seq, rows)
        decoded = [engine.decode_greedy([seq], [t])[0] for t in fed[:rows]]
        engine.rollback(seq, rows)
        out["verify_ids_equal_decode"] = {"rows": rows, "equal": sum(a == b for a, b in zip(verified, decoded,
                                                                                             strict=True))}
        out["verify_ms"] = {str(s): median_time(lambda s=s: verify(s), repeat, warmup=2, sync=sync) * 1e3
                            for s in VERIFY_ROWS}
    return out


def plain(engine, prompt: list[int], tokens: int, extra: int = 0) -> tuple[float, list[int]]:
    """(seconds from the first greedy token to the `tokens`-th, the greedy ids of tokens + extra): plain decoding
    through the generation loop, as Engine.generate decodes (no id ends it: a set number of tokens)."""
    from luce_runtime.generation import generate
    from luce_runtime.sampler import SamplingParams

    ids, start, seconds = [], None, 0.0
    for t in generate(engine, prompt, SamplingParams(temperature=0, max_tokens=tokens + extra), ignore_eos=True):
        ids.append(t)
        if len(ids) == 1:
            engine.device.sync()
            start = time.perf_counter()
        if len(ids) == tokens:
            engine.device.sync()
            seconds = time.perf_counter() - start
    return seconds, ids


def cut(engine, steps: list[Step]) -> list[Step]:
    """The trace's steps as the loop drafts them: at most one row fewer than the engine verifies at decode cost (a
    tree's nodes too: GenerationLoop._shape), and chains only on an engine that verifies no trees."""
    if not engine.verifies_trees:  # the loop verifies a tree's chain alone (GenerationLoop._shape)
        steps = [s.trimmed(s.chain, s.chain) for s in steps]
    cheap = engine.verify_rows_at_decode_cost
    return [s.trimmed(cheap - 1, cheap - 1) for s in steps] if cheap > 1 else steps


def speculative(engine, drafter, prompt: list[int], steps: list[Step], target_ids: list[int]) -> dict:
    """Speculation through the generation loop whose step i drafts steps[i] and has exactly its acceptance (Forced):
    {tokens, s (from the first token to the last), accepted, ids, steps, replayed (verifies that accepted exactly what
    the step says: its count, and a tree's path), trees (each verified tree's parents and path)}."""
    from luce_runtime.generation import GenerationLoop, Speculating, generate
    from luce_runtime.sampler import SamplingParams

    steps = cut(engine, steps)
    inner_vocab = getattr(getattr(drafter, "engine", None), "vocab_size", None)
    forced = Forced(drafter, len(prompt), target_ids, steps, engine.vocab_size, inner_vocab)
    loop = GenerationLoop(engine)
    loop.trace, loop.trees = [], {}
    # the loop drafts no more than the generation may still take: room past the trace's tokens lets each step draft
    # its k (the CPU run's plain steps, not in the trace, had left that room), and the replay stops at its tokens
    tokens, room, left = 1 + sum(s.n + 1 for s in steps), 0, 0
    for s in reversed(steps):
        left += s.n + 1
        room = max(room, s.chain + 1 - left)
    params = SamplingParams(temperature=0, max_tokens=tokens + room)
    ids, start = [], None
    # Forced is both the drafter and its draft length (the trace's k)
    gen = generate(engine, prompt, params, Speculating(forced, forced, timed=False), loop, ignore_eos=True)
    for t in gen:
        ids.append(t)
        if len(ids) == 1:  # the first token is the prefill's
            engine.device.sync()
            start = time.perf_counter()
        if len(ids) == tokens:
            break
    engine.device.sync()
    seconds = time.perf_counter() - start
    gen.close()  # the sequences go back (untimed)
    trees = [loop.trees[i] for i in sorted(loop.trees)]
    replayed = sum((k, n) == (s.k, s.n) and loop.trees.get(i) == (None if s.parents is None else
                                                                   (list(s.parents), list(s.path)))
                   for i, ((k, n), s) in enumerate(zip(loop.trace, forced.proposed, strict=False)))
    return {"tokens": len(ids), "s": seconds, "accepted": loop.stats.accepted, "ids": ids, "steps": len(steps),
            "replayed": replayed, "trees": trees}


def drafters_of(engine, draft, trace: dict) -> dict:
    """The trace's drafters that the replay knows, each with its real engine calls. The draft model is not checked
    for the target's vocabulary: a synthetic pair's are SmolLM2's padded to each n_vocab (the ids they share mean
    the same), and Forced folds the target's other ids into the draft's."""
    from luce_runtime.speculative import DraftModel

    names = {name for r in trace["rows"] for name in r["drafters"]}
    make = {"draft model": lambda: DraftModel(draft, engine, checked=True), "prompt lookup": LookupReplay,
            "draft tree": lambda: DraftModel(draft, engine, checked=True,
                                             branch=trace.get("meta", {}).get("branch", BRANCH))}
    return {name: make[name]() for name in DRAFTERS if name in names}


def replay(target_artifact: Path, draft_artifact: Path, trace: dict, prompts: int) -> dict:
    from luce_runtime.engine import Engine, EngineOptions

    rng = np.random.default_rng(0)
    longest = max(r["prompt_tokens"] + r["tokens"] for r in trace["rows"]) + 64
    engine = Engine(target_artifact, EngineOptions(max_batch=2, max_context=max(longest, 512)))
    draft = Engine(draft_artifact, EngineOptions(max_batch=2, max_context=engine.max_context))
    vocab = min(engine.vocab_size, draft.vocab_size)  # prompts of ids both models have
    out: dict = {"target_decode_path": engine.decode_path, "draft_decode_path": draft.decode_path,
                 "target_verify_rows_at_decode_cost": engine.verify_rows_at_decode_cost,
                 "target_verifies_trees": engine.verifies_trees,
                 "target": verify_costs(engine, engine.vocab_size, rng),
                 "draft": verify_costs(draft, draft.vocab_size, rng), "rows": []}
    print(f"verify costs: {json.dumps(out['target'])}", file=sys.stderr)
    drafters = drafters_of(engine, draft, trace)
    warm = rng.integers(0, vocab, 32).tolist()
    _, warm_ids = plain(engine, warm, 8, extra=16)
    for d in drafters.values():  # every path's kernels loaded once, a tree's verify too
        speculative(engine, d, warm, [Step(4, 2), Step(3, 2, (-1, 0, 0), (0, 2)), Step(2, 2)], warm_ids)
    for task in dict.fromkeys(r["task"] for r in trace["rows"]):
        for r in [r for r in trace["rows"] if r["task"] == task][:prompts]:
            prompt = rng.integers(0, vocab, r["prompt_tokens"]).tolist()
            row = {"task": task, "name": r["name"], "prompt_tokens": r["prompt_tokens"], "drafters": {}}
            for name, drafter in drafters.items():
                steps = cut(engine, steps_of(r["drafters"][name]))
                tokens = 1 + sum(s.n + 1 for s in steps)
                plain_s, target_ids = plain(engine, prompt, tokens, extra=max((s.k for s in steps), default=0) + 1)
                got = speculative(engine, drafter, prompt, steps, target_ids)
                row["drafters"][name] = {"tokens": got["tokens"], "s": got["s"], "plain_s": plain_s,
                                         "steps": got["steps"], "accepted": got["accepted"],
                                         "replayed": got["replayed"],
                                         "identical": got["ids"] == target_ids[:got["tokens"]],
                                         **({"tree_steps": len(got["trees"]), "positions": positions(got["trees"])}
                                            if got["trees"] else {})}
            out["rows"].append(row)
            print(f"{task} {r['name']}: " + ", ".join(f"{n} {d['tokens']} tokens {d['plain_s'] / d['s']:.2f}x"
                                                       for n, d in row["drafters"].items()), file=sys.stderr)
    out["tasks"] = summary(out["rows"])
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per task and drafter: prompts, tokens, plain and speculative tok/s (total tokens over total seconds), the
    speed-up, tokens per target step, steps replayed exactly, ids equal plain decoding's; for trees, the tree steps and
    the acceptance per position (positions)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        for name, d in row["drafters"].items():
            groups.setdefault((row["task"], name), []).append(d)
    out = []
    for (task, name), ds in groups.items():
        tokens, plain_s, spec_s = (sum(d[k] for d in ds) for k in ("tokens", "plain_s", "s"))
        steps, accepted = sum(d["steps"] for d in ds), sum(d["accepted"] for d in ds)
        entry = {"task": task, "drafter": name, "prompts": len(ds), "tokens": tokens, "plain_tok_s": tokens / plain_s,
                 "spec_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
                 "tokens_per_step": (accepted + steps) / steps if steps else 0.0,
                 "replayed": sum(d["replayed"] for d in ds), "steps": steps,
                 "identical": sum(d["identical"] for d in ds)}
        if any("positions" in d for d in ds):
            entry["tree_steps"] = sum(d.get("tree_steps", 0) for d in ds)
            pos: list[dict[str, list[int]]] = []
            for d in ds:
                pos = add_positions(pos, d.get("positions", []))
            entry["positions"] = pos
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", type=Path)
    p.add_argument("draft", type=Path)
    p.add_argument("--trace", type=Path, required=True, help="benchmarks/spec.py's JSON (results/spec-<date>.json)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per task replayed (the trace's first N)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    doc = replay(args.target / "artifact", args.draft / "artifact", json.loads(args.trace.read_text()), args.prompts)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
