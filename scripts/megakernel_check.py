"""Check and time the generated megakernels on the GPU machine (issue 11), runtime-only there.

  prepare (here):  python scripts/megakernel_check.py prepare [--dir .gpucheck/mk] [--models ...] [--batches 1 2 5 8]
      compiles every model's megakernels for sm_90 into <dir>/<model>/megakernel.so with the fingerprint of each
      batch size's program; tiny synthetic models of every architecture and weight type travel as GGUFs, the
      benchmark workloads as the spec, tokenizer and reference logits that benchmarks/h200/prepare.py wrote to
      .gpucheck/h200 (their GGUFs are regenerated there, byte for byte).
  run (there):     python scripts/megakernel_check.py run [--dir .gpucheck/mk] [--out $OUT/mk.json] [--time]
      per model: rebuilds the programs (checked against the fingerprints) and the stacked weights from the GGUF,
      then checks, one decode step per token from an empty cache (the megakernel has no prefill yet):
        oracle   logits after the prompt and after each teacher-forced greedy step vs the float64 oracle's
                 (reference.npz for the workloads; computed there for the tiny models), relative to the row's max;
                 greedy ids equal until the first near-tie
        batched  2, 5 and 8 sequences of different lengths stepped together vs each alone (the alone run's cache
                 copied in at each prompt's end)
      and with --time: device time per step (CUDA events over back-to-back launches that feed each step's ids
      and lengths to the next, nothing else launched) and the host's wall clock per step when each step's ids are
      copied to the host, at context 512 (or each of --contexts, within the build's --ctx), batch 1 and 8.
      --long N: the batched check's first sequence holds N tokens (a long context over many key chunks, stepped
      alone from an empty cache first: minutes for a large model, seconds for a tiny one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "runtime"))

from device_check import _load_runtime  # noqa: E402  (the same loading as device_check)

from luce_compile.checks import MEGAKERNEL_BATCH_TOL as BATCH_TOL  # noqa: E402  (the bars every check shares)
from luce_compile.checks import MEGAKERNEL_REL_TOL as REL_TOL  # noqa: E402
from luce_compile.checks import REL_TOL_Q8 as Q8_REL_TOL  # noqa: E402
from luce_compile.checks import REL_TOL_TF32 as TF32_REL_TOL  # noqa: E402
from luce_compile.checks import near_tie  # noqa: E402
from luce_compile.checks import rel_err as _rel  # noqa: E402

WORKLOADS = ("smollm2-135m", "llama-1b-body", "llama-1b-body-bf16", "qwen3-0.6b")
TINY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
TINY_ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3")
# types of 256-value super-blocks (and issue 40's), on a tiny llama whose every K is a multiple of 256: the K-quants'
# 8-bit and float-lane bodies, and the new types on float lanes (no 8-bit body yet)
WIDE_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")


def tiny_specs() -> dict:
    from luce_compile.synthetic import in_type, preset

    specs = {name: preset(name) for name in TINY_ARCHS}
    for q in TINY_TYPES:
        specs[f"tiny-llama-{q.lower()}"] = dataclasses.replace(preset("tiny-llama"), quant=q)
    for name in TINY_ARCHS[1:]:  # BF16 bodies of the other architectures: biases, q/k norms, post-norms (float_mma)
        specs[f"{name}-bf16"] = dataclasses.replace(preset(name), quant="BF16")
    wide = dataclasses.replace(preset("tiny-llama"), n_embd=256, n_ff=768)
    for q in WIDE_TYPES:
        specs[f"tiny-llama-256-{q.lower()}"] = in_type(wide, q)
    return specs


def options(max_context: int, batches: tuple[int, ...], variant: dict | None = None):
    from luce_compile.fuse.build import MegakernelOptions

    return MegakernelOptions(batches=batches, max_context=max_context, **(variant or {}))


# ---- prepare (build machine) --------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> int:
    from luce_compile.fuse.build import compile_megakernels, program_fingerprint
    from luce_compile.graph.registry import open_graph
    from luce_compile.graph.rope_pairs import interleave_rope_pairs
    from luce_compile.synthetic import cached_synthetic

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny = tiny_specs()
    models = args.models or [*tiny, *WORKLOADS]
    if any(m in tiny for m in models) or not args.data_from:  # the tiny GGUFs' tokenizer, the workloads' default
        tokenizer = ROOT / ".gpucheck" / "h200" / "smollm2-135m" / "artifact" / "tokenizer.json"
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    batches = tuple(args.batches)
    variant = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    summary = {}
    for name in models:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        if name in tiny:  # the GGUF is regenerated there from the spec (with the shared tokenizer keys)
            gguf = cached_synthetic(tiny[name])
            (folder / "synthetic.json").write_text(json.dumps(dataclasses.asdict(tiny[name])))
        else:  # a workload: its spec, tokenizer and reference stay in the folder it was built from
            gguf = cached_synthetic(name)
            src = ROOT / (args.data_from or ".gpucheck/h200") / name  # a megakernel_check build, or prepare.py's
            if args.data_from and not (out / "tokenizer.json").is_file():  # no shared one: the workload's own
                shutil.copyfile(src / "artifact" / "tokenizer.json", folder / "tokenizer.json")
            elif not args.data_from and (src / "artifact" / "tokenizer.json").read_bytes() != \
                    (out / "tokenizer.json").read_bytes():
                shutil.copyfile(src / "artifact" / "tokenizer.json", folder / "tokenizer.json")  # else the shared one
            # the spec travels with the variant: a call that carries only the variant (and a bundle) regenerates the
            # GGUF from it (one carried without its source folder found no spec.json, 2026-12-06)
            shutil.copyfile(src / "spec.json", folder / "spec.json")
            if not args.data_from:
                shutil.copyfile(src / "reference.npz", folder / "reference.npz")
            rounded = roundings(dataclasses.asdict(options(args.ctx, batches, variant)))
            source = json.loads((src / "build.json").read_text()).get("options", {}) if (src / "build.json").is_file() \
                else json.loads((src / "artifact" / "manifest.json").read_text())["megakernel"]["options"]
            # its own reference: the same prompt, the build's rounding emulated. The source's reference emulates the
            # source's (prepare.py's artifact: 8-bit activations), which a float build is not held to: checked
            # against it, a float build's f32 bar failed at 0.043 with a correct kernel (H100, 2026-12-07)
            if rounded != roundings(source) and (src / "reference.npz").is_file():  # (none: prepared --no-reference)
                from device_check import _oracle_trace

                plain = np.load(src / "reference.npz")
                ids, logits = _oracle_trace(gguf, [int(t) for t in plain["prompt"]], len(plain["ids"]) - 1,
                                            q8_types=rounded[0], tf32_types=rounded[1],
                                            half_kv=True)  # the kernel's float16 pages
                np.savez(folder / "reference.npz", prompt=plain["prompt"], ids=np.array(ids, np.int32),
                         logits=logits)
        graph = interleave_rope_pairs(open_graph(gguf)[0])  # as compile builds a GPU artifact's graph
        start = time.perf_counter()
        try:
            programs = compile_megakernels(graph, "sm_90", folder / "megakernel.so",
                                           options(args.ctx, batches, variant))
        except Exception as e:  # noqa: BLE001  (recorded: the run reports which models could not build)
            (folder / "build.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            summary[name] = f"error: {e}"
            print(name, "error", e)
            continue
        seconds = round(time.perf_counter() - start, 1)
        info = {"batches": list(batches), "max_context": args.ctx, "compile_seconds": seconds,
                "options": dataclasses.asdict(options(args.ctx, batches, variant)),
                "data_from": args.data_from,
                "fingerprints": {str(b): program_fingerprint(p) for b, p in programs.items()},
                "tasks": {str(b): len(p.tg.tasks) for b, p in programs.items()},
                "params": {str(b): p.param_names for b, p in programs.items()}}
        (folder / "build.json").write_text(json.dumps(info))
        summary[name] = info["compile_seconds"]
        print(name, info)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps(summary), f"{size / 2**20:.1f} MiB")
    return 0


# ---- run (GPU machine) ------------------------------------------------------------------------------------------
class Runner:
    """One compiled megakernel's program, launched by the runtime's own launcher (luce_runtime.megakernel.Kernel,
    what the engine runs) over a torch-held KV pool (float16 pages, each sequence's page table contiguous)."""

    def __init__(self, fn, prog, weights: list, torch, params: list[str], pool_tokens: int = 0):
        """pool_tokens: the positions each sequence's pages hold (0: the build's context): the kernel takes a page
        table of any width, as the engine sizes it, so a build for 131,072 tokens runs on a pool of what is used."""
        import tvm
        from luce_runtime.megakernel import KERNEL_ARGS, Kernel

        from luce_compile.fuse.build import kernel_spec, kernel_tables

        self.p, self.torch = prog, torch
        t, dev = torch, "cuda"
        b, kv = prog.batch, prog.kv
        self.max_pages = -(-min(pool_tokens or prog.tg.max_context, prog.tg.max_context) // prog.page_size)
        self.pages = t.zeros((kv["n_layers"], b * self.max_pages, 2, kv["kv_heads"], prog.page_size, kv["head_dim"]),
                             dtype=t.float16, device=dev)
        # the kernel takes the pool flat with each layer's offset (TVM's cache gives it one tensor per layer)
        layer_elems = self.pages[0].numel()
        self.kv_layer_offset = t.arange(kv["n_layers"], dtype=t.int64, device=dev) * layer_elems
        self.rows = [list(range(i * self.max_pages, (i + 1) * self.max_pages)) for i in range(b)]
        self.flat = self.pages.view(-1)  # one object: the launcher rebuilds its argument list when it changes
        prog.param_names = params
        weight_names = [n for n in params if n not in KERNEL_ARGS]  # in the order stacked_weights made them
        self.kernel = Kernel(fn, kernel_spec(prog), kernel_tables(prog), dict(zip(weight_names, weights, strict=True)),
                             tvm.cuda(0), self.max_pages)
        self.profiling = 0

    @property
    def vocab(self) -> int:
        return int(self.kernel.spec["vocab"])

    def start(self, tokens: list[int], lengths: list[int]) -> None:
        """Stage a step's inputs (one per sequence of the batch) and launch it."""
        self.kernel.stage(tokens, lengths, self.rows[:len(tokens)])
        self.kernel.launch(self.flat, self.kv_layer_offset, bool(self.profiling))

    def step(self, tokens: list[int], lengths: list[int]) -> tuple[np.ndarray, list[int]]:
        self.start(tokens, lengths)
        ids = self.kernel.finish()  # raises MegakernelError where a block gave up waiting
        return self.kernel.logits.numpy().astype(np.float64), [int(i) for i in ids]

    def relaunch(self) -> None:
        """The next greedy step from the last one's outputs on the device (no host work)."""
        self.kernel.relaunch(self.flat, self.kv_layer_offset, bool(self.profiling))


def stacked_weights(prog, gguf, torch) -> list:
    from luce_compile.graph.rope_pairs import reorder_rows
    from luce_compile.lower.quant_layout import weight_planes

    pairs = prog.graph.row_pairs  # rows reordered as the program's graph reads them (graph/rope_pairs.py)
    out = []
    for _, o, s in prog.weight_args():
        names = prog.stacked_tensors(o, s)
        info = gguf.tensor(names[0])
        if len(info.shape) == 1:
            vectors = [gguf.dequantize(n).astype(np.float32) for n in names]
            vectors = [reorder_rows(v, pairs[n]) if n in pairs else v for n, v in zip(names, vectors, strict=True)]
            out.append(torch.from_numpy(np.stack(vectors)).cuda())
            continue
        per = [weight_planes(gguf.raw(n), info.ggml_type, 2, pairs.get(n, 0)) for n in names]
        for plane in per[0]:
            out.append(torch.from_numpy(np.ascontiguousarray(np.stack([p[plane] for p in per]))).cuda())
    return out


def decode_trace(runner, prompt: list[int], forced: list[int] | None, steps: int):
    """Logits after the prompt and after each step (teacher-forced with `forced` when given), and the kernel's ids."""
    rows, ids = [], []
    logits = None
    for i, tok in enumerate(prompt):
        logits, out = runner.step([tok], [i])
    rows.append(logits[0])
    ids.append(out[0])
    n = len(prompt)
    for s in range(steps):
        tok = forced[s] if forced is not None else ids[-1]
        logits, out = runner.step([tok], [n + s])
        rows.append(logits[0])
        ids.append(out[0])
    return np.stack(rows), ids


def check_values(runner, gguf_path: Path, steps: int = 3) -> dict:
    """Every arena value after each of the first steps vs the oracle's value of the same name: the first wrong one
    names the task body to look at."""
    from luce_compile.graph.oracle import Oracle

    oracle = Oracle(gguf_path)
    tokens = [5, 17, 301][:steps]
    order = [o for op in oracle.graph.ops for o in op.outputs]
    worst: dict = {}
    for i, tok in enumerate(tokens):
        env = oracle.run(np.array([[tok]]), np.array([[i]]))
        oracle.n_past += 1
        runner.step([tok], [i])
        for name in order:
            if name not in runner.p.arena or name not in env:
                continue
            w = runner.p.width(name)
            got = runner.kernel.arena.numpy()[runner.p.arena[name]:runner.p.arena[name] + w].astype(np.float64)
            err = _rel(got, env[name].reshape(-1)[:w])
            if err > 1e-3 and "first_wrong" not in worst:
                want = env[name].reshape(-1)[:6].round(4).tolist()
                worst["first_wrong"] = {"step": i, "value": name, "rel_err": err, "got": got[:6].round(4).tolist(),
                                        "want": want}
    return worst or {"all_within": 1e-3}


def check_oracle(runner, ref: dict, tol: float = REL_TOL) -> dict:
    prompt, want_ids, want = [int(x) for x in ref["prompt"]], [int(x) for x in ref["ids"]], ref["logits"]
    got, ids = decode_trace(runner, prompt, want_ids, len(want) - 1)
    errs = [_rel(g, w) for g, w in zip(got, want.astype(np.float64), strict=True)]
    mism, checked = 0, 0
    for g_id, w_id, w_row in zip(ids, want_ids, want, strict=False):
        if near_tie(w_row, tol):  # teacher-forced: each row stands alone, so only near-ties are skipped
            continue
        checked += 1
        mism += g_id != w_id or g_id != int(np.argmax(w_row))
    return {"max_rel_err": max(errs), "rows": len(errs), "ids_checked": checked, "ids_mismatched": int(mism),
            "tol": tol, "ok": max(errs) < tol and mism == 0}


def roundings(options: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The weight types whose matmul inputs the build rounds to 8 bits, and those it rounds to tf32 (the oracle
    emulates both)."""
    from luce_compile.fuse.build import MMA_FLOAT_TYPES, q8_types

    return q8_types(options), MMA_FLOAT_TYPES if options.get("float_mma") else ()


def tiny_reference(gguf_path: Path, vocab: int, steps: int = 64, seed: int = 0,
                   rounded: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> dict:
    """The oracle's greedy trace, as device_check's reference.npz holds it (computed there: tiny models are fast)."""
    from device_check import _oracle_trace

    prompt = [int(t) for t in np.random.default_rng(seed).integers(1, min(vocab, 49152), 8)]
    ids, logits = _oracle_trace(gguf_path, prompt, steps, q8_types=rounded[0], tf32_types=rounded[1],
                                half_kv=any(rounded))
    return {"prompt": np.array(prompt), "ids": np.array(ids), "logits": logits}


def check_batched(runners: dict, vocab: int, sizes=(2, 5, 8), steps: int = 12, seed: int = 1,
                  long: int = 0, tol: float = BATCH_TOL) -> dict:
    """Sequences of different lengths stepped together vs each alone (alone runs give the batched run its cache),
    teacher-forced with the alone runs' ids. long > 0: the first sequence's prompt has that many tokens (its
    attention at depth splits into other chunks at each batch size than alone: issue 38's long contexts), where
    the sums differ in order by design and `tol` is the build's bar for that (run: REL_TOL_Q8 with 8-bit
    activations, whose rounding turns a 1e-7 difference at a boundary into ~1e-2 of the logits, REL_TOL_TF32 with
    tf32 matvecs); ids are then compared where the alone row is no near tie at `tol`. At short contexts every row's
    arithmetic is the same as alone: the bar is BATCH_TOL and every id counts."""
    torch = runners[1].torch
    rng = np.random.default_rng(seed)
    worst, mism, done = 0.0, 0, []
    for n in sizes:
        if n not in runners:
            continue
        batch, alone = runners[n], runners[1]
        prompts = [[int(t) for t in rng.integers(1, min(vocab, 49152), long if long and i == 0 else 3 + 2 * i)]
                   for i in range(n)]
        want_rows, want_ids = [], []
        for i, pr in enumerate(prompts):
            rows, ids = decode_trace(alone, pr, None, steps)
            want_rows.append(rows)
            want_ids.append(ids)
            # the alone run's cache holds the prompt at positions below its length: row i starts from it
            mp = batch.max_pages
            batch.pages[:, i * mp:(i + 1) * mp].copy_(alone.pages[:, 0:mp])
        lengths = [len(p) for p in prompts]
        for s in range(steps):
            logits, ids = batch.step([want_ids[i][s] for i in range(n)], [lengths[i] + s for i in range(n)])
            for i in range(n):
                want = want_rows[i][s + 1]
                worst = max(worst, _rel(logits[i], want))
                mism += ids[i] != want_ids[i][s + 1] and not (long and near_tie(want, tol))
        done.append(n)
        torch.cuda.synchronize()
    return {"sizes": done, "max_rel_diff": worst, "ids_mismatched": int(mism), "long": long, "tolerance": tol,
            "ok": worst < tol and mism == 0}


def time_runner(runner, context: int = 512, steps: int = 200) -> dict:
    torch = runner.torch
    # every position stays within the build's context (each phase restarts at `context` and steps up to 210 on)
    context = max(1, min(context, runner.max_pages * runner.p.page_size - 2 * steps - 16))
    runner.pages.normal_()  # values do not change the speed; positions below `context` are read
    b = runner.p.batch
    tokens = [int(t) for t in np.random.default_rng(0).integers(1, 1000, b)]
    runner.start(tokens, [context] * b)
    for _ in range(10):
        runner.relaunch()
    runner.start(tokens, [context] * b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        runner.relaunch()
    end.record()
    torch.cuda.synchronize()
    device_us = start.elapsed_time(end) * 1e3 / steps
    runner.start(tokens, [context] * b)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.relaunch()
        runner.kernel.finish()  # what a streaming server does: the ids reach the host every step
        walls.append(time.perf_counter() - t0)
    wall_us = float(np.median(walls)) * 1e6
    return {"batch": b, "context": context, "device_us_per_step": round(device_us, 1),
            "host_us_per_step": round(wall_us, 1), "tok_s_device": round(b / device_us * 1e6),
            "tok_s_host": round(b / wall_us * 1e6)}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def profile_step(runner, context: int = 512) -> dict:
    """One step with the clocks on (the GPU's global timer, ns), summarized by luce_compile.fuse.program's
    profile_summary."""
    from luce_compile.fuse.program import profile_summary

    b = runner.p.batch
    context = max(1, min(context, runner.max_pages * runner.p.page_size - 16))
    runner.profiling = 1
    runner.start([1] * b, [context] * b)
    runner.kernel.finish()
    runner.profiling = 0
    return profile_summary(runner.p, runner.kernel.profile.numpy())


def run_model(folder: Path, args, torch, tvm_ffi) -> dict:
    from luce_compile.fuse.build import plan_programs, program_fingerprint
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph.registry import open_graph
    from luce_compile.graph.rope_pairs import interleave_rope_pairs
    from luce_compile.targets import get_target

    build = json.loads((folder / "build.json").read_text())
    if "error" in build:
        return {"build_error": build["error"], "ok": False}

    def data(name: str) -> Path:
        """A model's data file: its own (a variant's reference with its rounding emulated), else that of the build
        it was made from, and so on; a tokenizer may be the shared one of its folder."""
        at, info = folder, build
        while not (at / name).is_file() and info.get("data_from"):
            if not (ROOT / info["data_from"] / folder.name).is_dir():
                break  # a model the source build does not have (a tiny one: its GGUF travels as a spec)
            at = ROOT / info["data_from"] / folder.name
            # a megakernel_check build, or device_check prepare's workload folder (the end of the chain)
            info = json.loads((at / "build.json").read_text()) if (at / "build.json").is_file() else {}
        return at / name if (at / name).is_file() or name != "tokenizer.json" else at.parent / name
    gguf_path = Path(args.work) / f"{folder.name}.gguf"
    if (folder / "synthetic.json").is_file() and not gguf_path.is_file():
        import luce_compile.synthetic as synthetic

        keys = json.loads((folder.parent / "tokenizer.json").read_text())
        synthetic.tokenizer_metadata = lambda: {k: v for k, v in keys.items() if k.startswith("tokenizer.")}
        spec = json.loads((folder / "synthetic.json").read_text())
        synthetic.write_synthetic(synthetic.SyntheticSpec(**spec), gguf_path)
    if not gguf_path.is_file():  # a workload: device_check regenerates it from the preset and its tokenizer
        from device_check import generate_gguf

        staging = Path(args.work) / f"{folder.name}-spec"
        (staging / "artifact").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data("spec.json"), staging / "spec.json")
        shutil.copyfile(data("tokenizer.json"), staging / "artifact" / "tokenizer.json")
        generate_gguf(staging, gguf_path)
    say(f"{folder.name}: GGUF ready")
    graph = interleave_rope_pairs(open_graph(gguf_path)[0])
    variant = {k: v for k, v in build.get("options", {}).items() if k not in ("batches", "max_context")}
    programs = plan_programs(graph, get_target("sm_90").facts,
                             options(build["max_context"], tuple(build["batches"]), variant))
    result: dict = {"tasks": build["tasks"]}
    for b, p in programs.items():
        if program_fingerprint(p) != build["fingerprints"][str(b)]:
            return {"error": f"the program for batch {b} differs from the compiled one", "ok": False}
    say(f"{folder.name}: programs match")
    mod = tvm_ffi.load_module(str((folder / "megakernel.so").resolve()))
    gguf = read_gguf(gguf_path)
    weights = stacked_weights(programs[1], gguf, torch)  # the same stacks for every batch size
    say(f"{folder.name}: weights stacked")
    # each sequence's pages: what the checks and timings reach (an 8B's 131,072-token pool at b=8 would be 137 GB)
    pool = max(4096, *(c + 432 for c in (args.contexts or [512])), args.long + 64)
    runners = {b: Runner(mod[f"megakernel_b{b}"], p, weights, torch, build["params"][str(b)], pool)
               for b, p in programs.items()}
    ref_path = data("reference.npz")
    rounded = roundings(build.get("options", {}))
    t0 = time.perf_counter()
    runners[1].step([1], [0])
    torch.cuda.synchronize()
    say(f"{folder.name}: first step done in {time.perf_counter() - t0:.2f} s")
    if args.no_oracle and not ref_path.is_file():  # 7B and up: the float64 oracle would take hours here
        result["oracle"] = {"skipped": "no reference (prepared with --no-reference) and --no-oracle", "ok": True}
    else:
        ref = dict(np.load(ref_path)) if ref_path.is_file() else tiny_reference(gguf_path, runners[1].vocab,
                                                                                rounded=rounded)
        result["oracle"] = check_oracle(runners[1], ref, Q8_REL_TOL if rounded[0] else REL_TOL)
    say(f"{folder.name}: oracle {result['oracle']}")
    if not result["oracle"]["ok"]:  # name the first wrong value (the oracle of a 1B model costs a minute)
        result["values"] = check_values(runners[1], gguf_path)
        say(f"{folder.name}: values {result['values']}")
    result["batched"] = check_batched(runners, runners[1].vocab)
    say(f"{folder.name}: batched {result['batched']}")
    if args.long:
        if args.long + 16 > build["max_context"]:
            result["batched_long"] = {"skipped": f"--long {args.long} past the build's context {build['max_context']}",
                                      "ok": True}
        else:
            result["batched_long"] = check_batched(runners, runners[1].vocab, sizes=(2, 8), steps=4, long=args.long,
                                                   tol=Q8_REL_TOL if rounded[0] else TF32_REL_TOL if rounded[1]
                                                   else BATCH_TOL)
        say(f"{folder.name}: batched at depth {args.long} {result['batched_long']}")
    result["check_seconds"] = round(time.perf_counter() - t0, 1)
    if args.time:
        contexts = args.contexts or [512]
        result["timing"] = [time_runner(runners[b], c) for c in contexts for b in (1, 8) if b in runners]
        result["profile_b1"] = profile_step(runners[1])
        if 8 in runners:
            result["profile_b8"] = profile_step(runners[8])
        for c in contexts:  # where a long context's step goes (the attention's share), per batch size
            if c != 512:
                for b in (1, 8):
                    if b in runners:
                        result[f"profile_b{b}_ctx{c}"] = profile_step(runners[b], c)
    result["ok"] = result["oracle"]["ok"] and result["batched"]["ok"] and result.get("batched_long", {}).get("ok", True)
    return result


def run(args: argparse.Namespace) -> int:
    _load_runtime()
    import torch
    import tvm_ffi

    Path(args.work).mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    folders = sorted(p for p in Path(args.dir).iterdir() if (p / "build.json").is_file())
    if args.models:
        folders = [f for f in folders if f.name in args.models]
    for folder in folders:
        t0 = time.perf_counter()
        try:
            results[folder.name] = run_model(folder, args, torch, tvm_ffi)
        except Exception as e:  # noqa: BLE001  (one model's failure must not hide the others' results)
            results[folder.name] = {"error": f"{type(e).__name__}: {e}", "ok": False}
        results[folder.name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(folder.name, json.dumps(results[folder.name]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if all(r.get("ok") for k, r in results.items() if isinstance(r, dict)) else 1


# llama.cpp CUDA on the same kind of H200, decode tok/s b=1 / b=8 (benchmarks/results/h200-2026-11-30-run3.md): the
# megakernel is not in the engine yet, so benchmarks/h200/run.sh cannot time it beside llama.cpp in one run
PEER = {"smollm2-135m": (953, 4458), "llama-1b-body": (1169, 4728), "llama-1b-body-bf16": (869, 3795),
        "qwen3-0.6b": (818, 3760)}
MIB_PER_TOKEN = {"smollm2-135m": 92.1, "llama-1b-body": 640.3, "llama-1b-body-bf16": 2048.3, "qwen3-0.6b": 497.5}
BANDWIDTH_GB_S = 4225  # device copy, measured in run3


def report(args: argparse.Namespace) -> int:
    """mk.json from the device → the markdown table (stdout)."""
    raw = json.loads(Path(args.json).read_text())  # {model: the run's result file: {device, date, model: {...}}}
    res = {m: r.get(m, r) for m, r in raw.items()}
    first = next(iter(raw.values()), {})
    lines = [f"# H200: the generated megakernel ({args.date})", "",
             f"{first.get('device', 'NVIDIA H200')}; `bash benchmarks/h200/megakernel.sh` (TIME=1), luce-compile "
             f"{args.commit}. Synthetic random-weight GGUFs at the real shapes; decode from context 512; device time "
             "per step from CUDA events over 200 back-to-back launches (each feeding the next its ids and lengths), "
             "host time per step with the ids copied to the host every step. llama.cpp: "
             "results/h200-2026-11-30-run3.md (2026-11-30, the same kind of machine; not this run: these runs time "
             "the kernel alone).", "",
             "| workload | b | device µs/step | tok/s (device) | tok/s (host) | % roofline (b=1) | llama.cpp tok/s "
             "| ours / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for name in WORKLOADS:
        r = res.get(name, {})
        for t in r.get("timing", []):
            peer = PEER[name][0 if t["batch"] == 1 else 1]
            roof = (MIB_PER_TOKEN[name] * 2**20 / (BANDWIDTH_GB_S * 1e9)) / (t["device_us_per_step"] * 1e-6)
            lines.append(f"| {name} | {t['batch']} | {t['device_us_per_step']:,} | {t['tok_s_device']:,} | "
                         f"{t['tok_s_host']:,} | {f'{roof:.1%}' if t['batch'] == 1 else ''} | {peer:,} | "
                         f"{t['tok_s_host'] / peer:.2f}× |")
    lines += ["", "Correctness in the same run (one decode step per token from an empty cache; logits vs the float64 "
              "oracle relative to the row's largest; batched vs each sequence alone):", "",
              "| model | max rel. err vs oracle | ids checked / mismatched | batched sizes | batched max diff | ok |",
              "|---|---|---|---|---|---|"]
    for name, r in res.items():
        if not isinstance(r, dict):
            continue
        o, b = r.get("oracle", {}), r.get("batched", {})
        err = r.get("error") or r.get("build_error")
        if err:
            lines.append(f"| {name} | {err[:60]} | | | | no |")
            continue
        lines.append(f"| {name} | {o.get('max_rel_err', float('nan')):.1e} | {o.get('ids_checked')} / "
                     f"{o.get('ids_mismatched')} | {b.get('sizes')} | {b.get('max_rel_diff', float('nan')):.1e} | "
                     f"{'yes' if r.get('ok') else 'no'} |")
    prof = {n: r["profile_b1"] for n, r in res.items() if isinstance(r, dict) and "profile_b1" in r}
    if prof:
        clock = next(iter(prof.values())).get("clock", "clock64")
        lines += ["", f"Per-task profile of one b=1 step ({clock} per task; wait = from the task's start to its "
                  "dependencies met, body = the task itself; means per task):", ""]
        for name, p in prof.items():
            def phases(v: dict) -> str:
                ph = v.get("phases_us")
                return f" [{', '.join(f'{k} {x}' for k, x in ph.items())}]" if ph else ""

            ops = "; ".join(f"{k}: {v['tasks']} × (wait {v['wait_us']} + body {v['body_us']} µs{phases(v)})"
                            for k, v in p["opcodes"].items())
            lines.append(f"- **{name}**: step span {p['span_us']} µs, per SM {p['mean_sm_body_us']} µs in bodies "
                         f"and {p['mean_sm_wait_us']} µs waiting. {ops}")
        staged = {n: p["stages"] for n, p in prof.items() if "stages" in p}
        if staged:
            lines += ["", "The step's critical path by stage (means over the layers; handoff = from the previous "
                      "stage's last task's end to this stage's first body; span = from there to its last task's end):",
                      ""]
            for name, st in staged.items():
                parts = "; ".join(f"{k}: {v['stages']} × (handoff {v['handoff_us']} + span {v['span_us']} µs)"
                                  for k, v in st.items())
                lines.append(f"- **{name}**: {parts}")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", default=str(ROOT / ".gpucheck" / "mk"))
    p.add_argument("--models", nargs="*")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 5, 8])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--data-from", help="a variant: read the workloads' spec, tokenizer and reference from this "
                   "folder's build (relative to the repository) instead of carrying copies")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=INT",
                   help="MegakernelOptions fields for a variant to time against the default (prefetch_bytes=0, "
                   "kv_chunk=128, poll_sleep_ns=0, ...)")
    p.set_defaults(func=prepare)
    r = sub.add_parser("run")
    r.add_argument("--dir", default=str(ROOT / ".gpucheck" / "mk"))
    r.add_argument("--models", nargs="*")
    r.add_argument("--out")
    r.add_argument("--work", default="/tmp/mk-work")
    r.add_argument("--time", action="store_true")
    r.add_argument("--contexts", nargs="*", type=int, help="with --time: the contexts to time at (default 512), each "
                   "within the build's --ctx (a context past it is timed just under it)")
    r.add_argument("--long", type=int, default=0, help="also step the batched check with a first sequence of this "
                   "many tokens (at most the build's --ctx)")
    r.add_argument("--no-oracle", action="store_true", help="skip the oracle check of a model with no reference "
                   "(a 7B or larger, prepared with --no-reference); batched vs alone still runs")
    r.set_defaults(func=run)
    t = sub.add_parser("report")
    t.add_argument("json")
    t.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    t.add_argument("--commit", default="")
    t.set_defaults(func=report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
