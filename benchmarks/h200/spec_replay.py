"""Speculative decoding on the GPU, replayed (issue 14): the real pair's shapes as synthetic GGUFs (the real weights do
not travel), each step's acceptance taken from the CPU run's trace (benchmarks/spec.py's JSON). Runs on the GPU
machine (runtime and this tree; spec.sh's set-up):

    python3 benchmarks/h200/spec_replay.py TARGET_DIR DRAFT_DIR --trace spec.json [--prompts 8] [--out F]

TARGET_DIR and DRAFT_DIR are device_check workload folders whose artifact/ holds weights.bin (`device_check.py gguf`).
1. Verify cost: Engine.verify_greedy of S = 1, 2, 4, 8, 16 rows of one sequence after a 256-token prompt (the
   megakernel's rows up to its largest batch, where the artifact has one), beside one greedy decode step
   (Engine.decode_greedy, the megakernel where the engine chose it), medians; each rolled back after.
2. Replay: for the first --prompts prompts of each task of the trace, a random prompt of the same length; plain greedy
   decoding of as many tokens as the CPU run generated, then speculation making the engine calls SpeculativeDecoder
   makes (the draft model's sync and k - 1 greedy steps, or prompt lookup's free proposal; one greedy target verify
   of k + 1 rows, Engine.verify_greedy; the rollback of the rejected), with each step's drafted and
   accepted counts read from the trace, since random weights would accept nothing. Tokens/s from the first
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


class LookupReplay:
    """Prompt lookup's proposal costs a host scan of the history (microseconds): k tokens of the history, no device
    work. Which tokens does not matter: the trace says how many the target accepts."""

    name = "prompt lookup"

    def propose(self, history: list[int], k: int, sampler):
        from luce_runtime.speculative import Draft

        return Draft(list(history[-k:]))

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


def plain(engine, prompt: list[int], tokens: int) -> float:
    """Seconds from the first greedy token to the last of `tokens` (as Engine.generate decodes)."""
    with engine.sequence() as seq:
        token = int(np.argmax(engine.prefill([seq], [prompt])[0]))
        engine.device.sync()
        start = time.perf_counter()
        for _ in range(tokens - 1):
            token = engine.decode_greedy([seq], [token])[0]
        engine.device.sync()
        return time.perf_counter() - start


def speculative(engine, drafter, prompt: list[int], steps: list[tuple[int, int]]) -> tuple[int, float, int]:
    """(tokens, seconds from the first token to the last, drafts accepted) of speculation whose step i drafts
    steps[i][0] tokens and has steps[i][1] of them accepted: SpeculativeDecoder.step's engine calls, the acceptance
    forced (a step drafting more than the engine verifies at decode cost is cut to that, as the decoder cuts it)."""
    from luce_runtime.sampler import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(temperature=0))
    cheap = engine.verify_rows_at_decode_cost  # SpeculativeDecoder.step drafts at most one row fewer
    with engine.sequence() as seq:
        history = list(prompt)
        history.append(int(np.argmax(engine.prefill([seq], [history])[0])))
        engine.device.sync()
        start = time.perf_counter()
        accepted = 0
        for k, n in steps:
            if cheap > 1 and k >= cheap:
                k, n = cheap - 1, min(n, cheap - 1)
            accepted += n
            draft = drafter.propose(history, k, sampler)
            picks = engine.verify_greedy([seq], [[history[-1], *draft.tokens]])[0]  # as SpeculativeDecoder.step
            engine.rollback(seq, k - n)
            history += [*draft.tokens[:n], picks[n]]
        engine.device.sync()
        seconds = time.perf_counter() - start
        drafter.reset()
    return len(history) - len(prompt), seconds, accepted


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
    plain(engine, warm, 8)
    for d in drafters.values():
        speculative(engine, d, warm, [(4, 2), (2, 2)])
    for task in tasks:
        for r in [r for r in trace["rows"] if r["task"] == task][:prompts]:
            prompt = rng.integers(0, vocab, r["prompt_tokens"]).tolist()
            row = {"task": task, "name": r["name"], "prompt_tokens": r["prompt_tokens"], "drafters": {}}
            for name, drafter in drafters.items():
                steps = [tuple(s) for s in r["drafters"][name]["trace"]]
                tokens, seconds, accepted = speculative(engine, drafter, prompt, steps)
                row["drafters"][name] = {"tokens": tokens, "s": seconds, "plain_s": plain(engine, prompt, tokens),
                                         "steps": len(steps), "accepted": accepted}
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
