"""Speculative decoding on the GPU, replayed (issue 14): the real pair's shapes as synthetic GGUFs (the real weights do
not travel), each step's acceptance taken from the CPU run's trace (benchmarks/spec.py's JSON). Runs on the GPU
machine (runtime and this tree; spec.sh's set-up):

    python3 benchmarks/h200/spec_replay.py TARGET_DIR DRAFT_DIR --trace spec.json [--prompts 8] [--out F]

TARGET_DIR and DRAFT_DIR are device_check workload folders whose artifact/ holds weights.bin (`device_check.py gguf`).
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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]

VERIFY_ROWS = (1, 2, 4, 8, 16)
DRAFTERS = ("draft model", "prompt lookup")


class Forced:
    """A drafter whose step i proposes steps[i][0] tokens of which the target accepts steps[i][1]: it makes its
    inner drafter's engine calls (their cost is the drafter's), then proposes the target's own next greedy ids
    (`target_ids`, its plain decoding of the same prompt) up to the accepted count and a token after them that the
    target does not choose. Its `length` is the trace's k (a DraftLength for the loop)."""

    def __init__(self, inner, prompt_len: int, target_ids: list[int], steps: list[tuple[int, int]], vocab: int):
        self.inner, self.prompt_len, self.target_ids, self.vocab = inner, prompt_len, target_ids, vocab
        self.steps, self.step = steps, 0
        self.name = getattr(inner, "name", "lookup")

    @property
    def k(self) -> int:
        return self.steps[self.step][0] if self.step < len(self.steps) else 0

    def update(self, drafted: int, accepted: int) -> None:
        self.step += bool(drafted)

    def propose(self, history: list[int], k: int, sampler):
        from luce_runtime.speculative import Draft

        fed = self.inner.propose(history, k, sampler).fed
        n = min(self.steps[self.step][1], k)
        at = len(history) - self.prompt_len  # the target's next id is target_ids[at]
        want = self.target_ids[at:at + n + 1]
        miss = (want[-1] + 1) % self.vocab if len(want) > n else 0  # past the plain ids: any token
        return Draft([*want[:n], *[miss] * (k - n)], fed=fed)

    def reset(self) -> None:
        self.inner.reset()


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


def cut(engine, steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The trace's steps as the loop drafts them: at most one row fewer than the engine verifies at decode cost."""
    cheap = engine.verify_rows_at_decode_cost
    return [(min(k, cheap - 1), min(n, cheap - 1)) if cheap > 1 else (k, n) for k, n in steps]


def speculative(engine, drafter, prompt: list[int], steps: list[tuple[int, int]],
                target_ids: list[int]) -> tuple[int, float, int]:
    """(tokens, seconds from the first token to the last, drafts accepted) of speculation through the generation
    loop whose step i drafts steps[i][0] tokens and has steps[i][1] of them accepted (Forced)."""
    from luce_runtime.generation import GenerationLoop, Speculating, generate
    from luce_runtime.sampler import SamplingParams

    steps = cut(engine, steps)
    forced = Forced(drafter, len(prompt), target_ids, steps, int(engine.config["n_vocab"]))
    loop = GenerationLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=1 + sum(n + 1 for _, n in steps))
    ids, start = [], None
    # Forced is both the drafter and its draft length (the trace's k)
    for t in generate(engine, prompt, params, Speculating(forced, forced, timed=False), loop, ignore_eos=True):
        ids.append(t)
        if len(ids) == 1:  # the first token is the prefill's
            engine.device.sync()
            start = time.perf_counter()
    engine.device.sync()
    return len(ids), time.perf_counter() - start, loop.stats.accepted


def replay(target_artifact: Path, draft_artifact: Path, trace: dict, prompts: int) -> dict:
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.speculative import DraftModel

    rng = np.random.default_rng(0)
    longest = max(r["prompt_tokens"] + r["tokens"] for r in trace["rows"]) + 64
    engine = Engine(target_artifact, EngineOptions(max_batch=2, max_context=max(longest, 512)))
    draft = Engine(draft_artifact, EngineOptions(max_batch=2, max_context=engine.max_context))
    vocab = int(engine.config["n_vocab"])
    out: dict = {"target_decode_path": engine.decode_path, "draft_decode_path": draft.decode_path,
                 "target_verify_rows_at_decode_cost": engine.verify_rows_at_decode_cost,
                 "target": verify_costs(engine, vocab, rng), "draft": verify_costs(draft, vocab, rng), "rows": []}
    print(f"verify costs: {json.dumps(out['target'])}", file=sys.stderr)
    drafters = {"draft model": DraftModel(draft, engine), "prompt lookup": LookupReplay()}
    tasks = list(dict.fromkeys(r["task"] for r in trace["rows"]))
    warm = rng.integers(0, vocab, 32).tolist()
    _, warm_ids = plain(engine, warm, 8, extra=16)
    for d in drafters.values():
        speculative(engine, d, warm, [(4, 2), (2, 2)], warm_ids)
    for task in tasks:
        for r in [r for r in trace["rows"] if r["task"] == task][:prompts]:
            prompt = rng.integers(0, vocab, r["prompt_tokens"]).tolist()
            row = {"task": task, "name": r["name"], "prompt_tokens": r["prompt_tokens"], "drafters": {}}
            for name, drafter in drafters.items():
                steps = cut(engine, [tuple(s) for s in r["drafters"][name]["trace"]])
                tokens = 1 + sum(n + 1 for _, n in steps)
                plain_s, target_ids = plain(engine, prompt, tokens, extra=max((k for k, _ in steps), default=0) + 1)
                tokens, seconds, accepted = speculative(engine, drafter, prompt, steps, target_ids)
                row["drafters"][name] = {"tokens": tokens, "s": seconds, "plain_s": plain_s, "steps": len(steps),
                                         "accepted": accepted}
            out["rows"].append(row)
            print(f"{task} {r['name']}: " + ", ".join(f"{n} {d['tokens']} tokens {d['plain_s'] / d['s']:.2f}x"
                                                       for n, d in row["drafters"].items()), file=sys.stderr)
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
