"""The `luce-runtime` command line: run and serve compiled artifacts with the thin runtime alone (no compiler).

`luce-compile run` and `luce-compile serve` are these same commands: luce_compile/cli.py builds its `run` and `serve`
subcommands with the argument functions below and calls cmd_run / cmd_serve (its serve first compiles a GGUF into
an artifact). Only this module and luce_compile/cli.py print; everything else logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from luce_runtime import __version__
from luce_runtime.errors import LuceError


# ---- run ------------------------------------------------------------------------------------------------------------
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


def sampling_params(args: argparse.Namespace):
    from luce_runtime.sampler import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, seed=args.seed, max_tokens=args.n,
                          stop=tuple(args.stop or ()))


def speculative_decoder(engine, args: argparse.Namespace):
    """--spec ngram or --draft DRAFT_ART on a loaded target engine (the draft model gets the target's context)."""
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.speculative import DraftModel, NgramDrafter, SpeculativeDecoder

    if args.draft:
        draft = Engine(args.draft, EngineOptions(max_batch=1, max_context=engine.max_context))
        return SpeculativeDecoder(engine, DraftModel(draft, engine), draft_max=args.draft_max)
    return SpeculativeDecoder(engine, NgramDrafter(), draft_max=args.draft_max)


def kv_memory_arg(args: argparse.Namespace) -> int:
    from luce_runtime.kv_memory import parse_memory

    return parse_memory(args.kv_memory) if args.kv_memory else 0


def cmd_run(args: argparse.Namespace) -> int:
    from luce_runtime.artifact import load_artifact
    from luce_runtime.engine import Engine, EngineOptions, artifact_device
    from luce_runtime.kv_memory import plan_kv_pool, weights_bytes

    params = sampling_params(args)
    art = load_artifact(args.artifact)
    artifact_device(art)  # a GPU artifact on a machine without that GPU: refused before the pool is sized
    plan = plan_kv_pool(art.config, art.manifest["runtime"].get("kv_dtype", "float32"), art.manifest["target"]["kind"],
                        context=args.ctx, sequences=1, kv_memory=kv_memory_arg(args),
                        kv_head_dim=art.manifest["runtime"].get("kv_head_dim", 0), weights=weights_bytes(art.manifest))
    print(f"[{plan.describe()}]", file=sys.stderr)
    engine = Engine(art, EngineOptions(max_batch=1, max_context=plan.context))
    tok = engine.tokenizer
    ids = prompt_ids(tok, args.prompt, args.chat)
    if not (args.spec or args.draft):
        return print_generation(tok, ids, engine.generate(ids, params), args.json, "runtime")
    decoder = speculative_decoder(engine, args)
    return print_generation(tok, ids, decoder.generate(ids, params), args.json, f"runtime, {decoder.drafter.name}",
                            extra=lambda: {"spec": decoder.stats.to_dict()})


# ---- serve ----------------------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve args.artifact (an artifact directory or packed file; luce-compile serve compiles a GGUF first)."""
    from luce_runtime.serve import ServeOptions, serve
    from luce_runtime.serve.app import kv_plan

    options = ServeOptions(artifact=Path(args.artifact), max_batch=args.max_batch, max_context=args.ctx,
                           prefix_cache=args.prefix_cache, kv_memory=kv_memory_arg(args))
    plan = kv_plan(options)  # the pool Service makes: its batch and context passed on as they are
    print(f"serving {args.artifact} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    print(plan.describe(), file=sys.stderr, flush=True)
    serve(ServeOptions(artifact=Path(args.artifact), host=args.host, port=args.port, api_key=args.api_key,
                       max_batch=plan.sequences, max_context=plan.context, prefix_cache=args.prefix_cache,
                       kv_memory=kv_memory_arg(args),
                       max_waiting=args.max_waiting, max_body_bytes=int(args.max_body_mb * 2**20),
                       spec=args.spec, draft=args.draft, draft_max=args.draft_max, strict=args.strict,
                       aliases=tuple(args.alias or ()), temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                       log_format=args.log_format, deterministic=args.deterministic))
    return 0


# ---- arguments: one definition for luce-runtime and luce-compile --------------------------------------------------
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


def add_kv_memory_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--kv-memory", metavar="SIZE",
                   help="memory the KV cache may take, e.g. 8G or 512M (default: a quarter of the memory free "
                        "after the weights: the host's on the CPU, the GPU's on a GPU); the start line says how many "
                        "tokens it holds")


def add_run_args(s: argparse.ArgumentParser) -> None:
    """`run`'s arguments, ARTIFACT included."""
    s.add_argument("artifact", help="an artifact directory or packed file")
    s.add_argument("-p", "--prompt", required=True)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--ctx", type=int, default=0,
                   help="context length to allocate, up to the model's trained context (default: that, ≤ 4096)")
    add_kv_memory_arg(s)
    s.add_argument("--json", action="store_true", help='print {"prompt_ids", "ids", "text"} (and "spec")')
    add_sampling_args(s)
    add_spec_args(s)
    add_threads_arg(s)


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """`serve`'s arguments after ARTIFACT (whose help differs: luce-compile serve also takes a GGUF)."""
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    # the environment variable keeps the key out of the process list (`ps` shows every user the command line)
    s.add_argument("--api-key", default=os.environ.get("LUCE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1/* (default: the LUCE_API_KEY "
                        "environment variable, which other users cannot see in `ps` as they can a command line)")
    s.add_argument("--max-batch", type=int, default=0,
                   help="sequences decoded together (default: as many as the KV budget holds, at most 64)")
    s.add_argument("--ctx", type=int, default=0,
                   help="context per sequence, up to the model's trained context (default: that, ≤ 4096)")
    add_kv_memory_arg(s)
    s.add_argument("--prefix-cache", type=int, default=4, help="cached prompt prefixes (0: no prefix reuse)")
    s.add_argument("--max-waiting", type=int, default=0,
                   help="requests queued for a batch slot before the server answers 429 (default: 4 x max-batch)")
    s.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (default 4): 413 above")
    s.add_argument("--alias", action="append", metavar="NAME",
                   help="another model id the server answers to and lists (repeatable, as llama-server's --alias)")
    s.add_argument("--strict", action="store_true",
                   help="refuse unknown request fields (400), unknown model names (404) and max_tokens past the "
                        "context (400) instead of ignoring, answering and clamping them")
    # None: the GGUF's recommended sampling (general.sampling.*), else the API's defaults
    s.add_argument("--temperature", type=float, help="temperature of requests that set none (default: the GGUF's "
                                                     "recommendation, else 1)")
    s.add_argument("--top-p", type=float, help="top_p of requests that set none")
    s.add_argument("--top-k", type=int, help="top_k of requests that set none")
    s.add_argument("--min-p", type=float, help="min_p of requests that set none")
    s.add_argument("--repeat-penalty", type=float, help="repetition penalty of requests that set none")
    s.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="the access log on stderr, one line per request: text (default) or JSON objects")
    s.add_argument("--deterministic", action="store_true",
                   help="greedy and seeded requests give the same tokens alone or beside others (they then prefill "
                        "their whole prompt: no prefix reuse for them)")
    add_spec_args(s)
    add_threads_arg(s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="luce-runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"luce-runtime {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is done and every default filled in")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("run", help="generate text from a compiled artifact")
    add_run_args(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("serve", help="serve an artifact over OpenAI- and Anthropic-compatible HTTP")
    s.add_argument("artifact", help="an artifact directory or packed file (`luce-compile pack`)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    return p


def run_command(args: argparse.Namespace) -> int:
    """args.func with what every command shares (luce-compile's main calls it too): the thread count claimed before
    any kernel starts TVM's pool, logging, and errors printed as one line with exit status 2."""
    if getattr(args, "threads", None) is not None:
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


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
