"""Check and time a GPU artifact on the GPU machine, against reference logits computed on the build machine.

Two halves, because the GPU machine has no TVM compiler (only the TVM runtime files travel) and the working tree
that travels is capped at 64 MiB (a SmolLM2-135M-shape artifact's weights are ~100 MB):

  prepare (here):  python scripts/device_check.py prepare --preset smollm2-135m --target sm_90 --dir .device/smollm2
      writes the synthetic GGUF's spec name, the compiled artifact WITHOUT weights.bin, and reference.npz (the
      float64 oracle's logits after a prompt and after each of 64 greedy decode steps; for precision f16, the
      default on CUDA, the oracle rounds the operands of every matmul of more than 8 rows to float16 first, as
      the tensor-core kernels do); and once per --bundle dir
      the runtime bundle: the TVM runtime files (no libtvm_compiler.so) as a .tgz and the wheels the GPU machine
      lacks (apache-tvm-ffi for its Python 3.12, gguf).
  gemm (there):    python scripts/device_check.py gemm BUNDLE: a tuning bundle's GEMMs alone against numpy.
  attention-build (here) / attention (there): the prefill attention kernels alone (flash_prefill.py ragged and
      paged, attention_prefill.py, optionally TVM's) against float64 on ragged batches and a 32K prompt, then timed.
  run (there):     python scripts/device_check.py run .device/smollm2 --gguf /tmp/smollm2.gguf --out $OUT/x.json
      rebuilds weights.bin from the synthetic GGUF (generated there when --gguf does not exist, by the project's
      generator with the tokenizer keys from the artifact: it would otherwise fetch SmolLM2 for them; the sha256
      recorded at build time must match), loads the artifact with luce_runtime (TVM runtime only), and
      checks: prefill + 64 decode steps within 1e-3 relative of the oracle (1e-2 for f16: REL_TOL_F16 says why),
      greedy ids equal until the first
      near-tie, batched decode of 2, 5 and 8 sequences equal to each alone; then times decode (batch 1, median step
      after a 512-token prompt) and prefill of 512 and 2048 tokens (median, the 512 one up to the first token)
      with luce_runtime.bench, as `luce-compile bench` does. Prints and writes one JSON result.
      Where the artifact has megakernels, also tree verify (issue 39): a token tree of the oracle's greedy chain
      and runner-up siblings (tree_reference.npz, written by prepare) verified on the megakernel's rows against
      the per-op kernels' verify_tree of the same artifact and against the oracle; --tree-only runs that alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from luce_compile.checks import (  # the bars and comparisons every check against the oracle shares
    BATCH_TOL,
    REL_TOL,
    REL_TOL_F16,
    REL_TOL_Q8,
    REL_TOL_TF32,
    near_tie,
)
from luce_compile.checks import rel_err as _rel

ROOT = Path(__file__).resolve().parent.parent


# what a record of a model prepared without the oracle's reference says in place of that check
NO_REFERENCE = ("not run: the float64 oracle cannot hold this model on the 24 GiB build machine (prepare "
                "--no-reference); the batched and megakernel-vs-per-op checks ran")


# ---- prepare (build machine) --------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> None:
    from luce_runtime.kv_memory import sliding_window
    from luce_schedules.gpu.quant_gemm import LOW_BATCH

    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    out = Path(args.dir)
    gguf = cached_synthetic(args.preset)
    start = time.perf_counter()
    # the folder is this script's own output: a re-run replaces the artifact it wrote
    artifact = compile_model(gguf, args.target, out / "artifact", use_cache=not args.no_cache, overwrite=True,
                             precision=args.precision, megakernel=not args.no_megakernel,
                             megakernel_q8=args.megakernel_q8, megakernel_tf32=args.megakernel_tf32,
                             prefill_attention=args.prefill_attention, prefill_gemm=args.prefill_gemm,
                             sliding_megakernel=args.sliding_megakernel or None)
    build_s = time.perf_counter() - start
    manifest = json.loads((artifact / "manifest.json").read_text())
    precision = manifest["kernels"]["precision"]
    # what the build chose (the fast build rounds by default, --precision f32 is exact): the reference follows it
    options = manifest.get("megakernel", {}).get("options", {})
    megakernel_q8, megakernel_tf32 = bool(options.get("q8_activations")), bool(options.get("float_mma"))
    (artifact / "weights.bin").unlink()  # rebuilt there from the GGUF: it would not fit the 64 MiB transfer
    prompt = [int(t) for t in np.random.default_rng(args.seed).integers(1, 49152, args.prompt_len)]
    # precision f16: matmuls of more rows than the last low-batch bucket run on tensor cores
    from luce_compile.fuse.build import MMA_FLOAT_TYPES, q8_types

    q8 = q8_types(options)  # the megakernel decodes, rounding as llama.cpp
    tf32 = MMA_FLOAT_TYPES if megakernel_tf32 else ()  # and its F16/BF16 inputs to tf32
    logits = []
    (out / "reference.npz").unlink(missing_ok=True)  # a re-run without one must not keep an older model's
    (out / "tree_reference.npz").unlink(missing_ok=True)
    if args.reference:
        rounding = {"q8_types": q8, "q8_decode_only": True, "tf32_types": tf32,
                    "half_above": LOW_BATCH[-1][0] if precision == "f16" else None}
        # --prefill-gemm q8: those rows' matmuls of these types take 8-bit activations (llama.cpp's CUDA forms)
        q8_prefill = tuple(manifest["kernels"].get("prefill_gemm", {}).get("q8_types", ()))
        if q8_prefill:
            rounding["q8_above"] = q8_prefill
        moe_q8 = tuple(manifest["kernels"].get("prefill_gemm", {}).get("moe_q8_types", ()))
        if moe_q8:  # a prompt's expert matmuls on the grouped 8-bit GEMM
            rounding["moe_q8"] = moe_q8
            rounding["moe_above"] = manifest["kernels"]["prefill_gemm"]["moe_above_rows"]
        if manifest["kernels"].get("kv_cache") == "f16":  # compile's auto on a GPU: keys and values rounded
            rounding["half_kv"] = True
        ids, logits = _cached_oracle_trace(gguf, prompt, args.steps, **rounding)
        np.savez(out / "reference.npz", prompt=np.array(prompt, np.int32), ids=np.array(ids, np.int32), logits=logits)
        if not sliding_window(manifest["config"]):  # sliding-window layers verify chains only (check_window_verify)
            tokens = reference_tree(ids, logits)
            np.savez(out / "tree_reference.npz", tokens=np.array(tokens, np.int32),
                     parents=np.array(TREE_PARENTS, np.int32),
                     logits=_cached_oracle_tree(gguf, prompt, tokens, TREE_PARENTS, **rounding))
    (out / "spec.json").write_text(json.dumps({"preset": args.preset, "gguf_name": gguf.name, "target": args.target,
                                               "megakernel_q8": megakernel_q8,
                                               "prefill_gemm": manifest["kernels"].get("prefill_gemm",
                                                                                       {"choice": "f16"})["choice"],
                                               "megakernel_tf32": megakernel_tf32, "reference": args.reference,
                                               "precision": precision, "build_seconds": round(build_s, 1),
                                               "kv_cache": manifest["kernels"].get("kv_cache", "f32"),
                                               "prefill_attention": manifest["kernels"].get(
                                                   "prefill_attention", {}).get("choice", "wmma")}))
    if args.bundle:
        make_bundle(Path(args.bundle))
    print(json.dumps({"dir": str(out), "build_seconds": round(build_s, 1), "reference_rows": len(logits)}))


# The tree the tree verify check feeds (issue 39): nodes 0, 1, 3, 5 are the oracle's greedy chain (the path accepted
# and committed), 2 and 4 the runner-ups of positions 1 and 2 (siblings of 1 and 3), 6 a node under the rejected
# branch 2. Seven rows: within the megakernel's largest batch (8), a tree of three leaves and depth 3.
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2]
TREE_LEAF = 5


def reference_tree(ids: list[int], logits: np.ndarray) -> list[int]:
    """TREE_PARENTS' tokens from a greedy trace (logits[k]: after the prompt and ids[:k]; ids[k] its argmax)."""
    runner_up = [int(np.argsort(row)[-2]) for row in logits[:4]]
    return [ids[0], ids[1], runner_up[1], ids[2], runner_up[2], ids[3], runner_up[3]]


def _reference_cache(key: tuple, rounding: dict) -> Path:
    """Where the build cache keeps an oracle reference: by its key (model, prompt, ...), its rounding and the
    oracle's own source (with _rounding_oracle's, which lives here), so a workload prepared again after a kernel
    change reuses it and one after an oracle change does not."""
    import hashlib
    import inspect

    from luce_compile.models import cache_dir

    digest = hashlib.sha256(repr((*key, sorted(rounding.items()))).encode())
    for folder in ("graph", "gguf"):  # the graph builders, the oracle and its roundings, the block formats
        for source in sorted((ROOT / "luce_compile" / folder).rglob("*.py")):
            digest.update(source.read_bytes())
    digest.update(inspect.getsource(_rounding_oracle).encode())  # the build's roundings, written here
    return cache_dir() / "references" / f"{digest.hexdigest()[:24]}.npz"


def _save(path: Path, **arrays) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".tmp.npz"), **arrays)
    path.with_suffix(".tmp.npz").replace(path)


def _cached_oracle_trace(gguf: Path, prompt: list[int], steps: int, **rounding) -> tuple[list[int], np.ndarray]:
    """_oracle_trace, kept in the build cache (_reference_cache; the 1.5B's took 650 s on 2 cores)."""
    path = _reference_cache((gguf.name, prompt, steps), rounding)
    if path.is_file():
        with np.load(path) as npz:
            return [int(t) for t in npz["ids"]], npz["logits"]
    ids, logits = _oracle_trace(gguf, prompt, steps, **rounding)
    _save(path, ids=np.array(ids, np.int32), logits=logits)
    return ids, logits


def _cached_oracle_tree(gguf: Path, prompt: list[int], tokens: list[int], parents: list[int],
                        **rounding) -> np.ndarray:
    """The oracle's logits of a token tree verified after the prompt (Oracle.tree_forward, each node's row rounded
    as a decode step's: the megakernel's verify rows are its decode rows), kept in the build cache."""
    path = _reference_cache((gguf.name, prompt, "tree", tokens, parents), rounding)
    if path.is_file():
        with np.load(path) as npz:
            return npz["logits"]
    oracle = _rounding_oracle(gguf, **rounding)
    oracle.prefill(prompt)
    oracle.decoding = True
    logits = oracle.tree_forward(tokens, parents).astype(np.float32)
    _save(path, logits=logits)
    return logits


def _oracle_trace(gguf: Path, prompt: list[int], steps: int, **rounding) -> tuple[list[int], np.ndarray]:
    """The oracle's greedy trace (_rounding_oracle says what `rounding` takes)."""
    oracle = _rounding_oracle(gguf, **rounding)
    rows = [oracle.prefill(prompt)[-1]]
    oracle.decoding = True
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(rows[-1])))
        rows.append(oracle.decode(ids[-1]))
    ids.append(int(np.argmax(rows[-1])))
    return ids, np.stack(rows).astype(np.float32)


def _rounding_oracle(gguf: Path, half_above: int | None = None, q8_types: tuple[str, ...] = (), half_kv: bool = False,
                     q8_decode_only: bool = False, tf32_types: tuple[str, ...] = (), q8_above: tuple[str, ...] = (),
                     moe_q8: tuple[str, ...] = (), moe_above: int | None = None):
    """The float64 oracle with the build's roundings emulated (its `decoding` set by the caller after a prefill);
    half_above=N rounds both operands of the matmuls of more than N rows to float16
    (precision f16's tensor-core GEMMs; the logits rows asked of the LM head stay float32, as in the build);
    q8_types: the weight types whose matmul inputs are rounded to llama.cpp's 8-bit blocks (the megakernel's
    q8_activations); half_kv: keys and values rounded to float16 as a float16 KV cache stores them (with 8-bit
    activations a check must emulate it: its ~1e-3 moves activations across rounding boundaries, and the logits
    by ~2e-2, measured on tiny-llama); q8_decode_only: the rounding in decode steps only (an artifact built with
    --megakernel-q8: the megakernel decodes, the per-op kernels prefill); tf32_types: the weight types whose matmul
    inputs are rounded to tf32 (the megakernel's float_mma), in decode steps only as well with q8_decode_only;
    q8_above: the weight types whose matmuls of more than half_above rows take 8-bit activations instead of float16
    operands (--prefill-gemm q8: lower/q8_gemm.py's forms, those of the megakernel's matvecs); moe_q8: the expert
    weight types whose MoE calls of more than moe_above sorted rows (tokens x experts used) take 8-bit activations
    (the grouped expert GEMM, schedules/gpu/moe.py), the same forms."""
    from luce_compile.graph.oracle import Oracle
    from luce_compile.graph.rounding import GgmlRounding

    class Base(GgmlRounding):
        def __init__(self, source):
            # the megakernel's 8-bit matvecs take q8_1 blocks for Q4_K too (llama.cpp's CUDA, not its CPU's q8_K)
            super().__init__(source, types=q8_types, gelu_table=False, tf32_types=tf32_types, gpu_q8_1=True)

    # 2-D operands: numpy's BLAS path (the same formula, ~20x faster)
    class FastOracle(Base if q8_types or tf32_types or q8_above or moe_q8 else Oracle):
        decoding = False
        moe_rows = 0

        def _moe(self, op, x):
            self.moe_rows = x.reshape(-1, x.shape[-1]).shape[0] * op.attrs["n_expert_used"]
            return super()._moe(op, x)

        def _moe_matmul(self, tensor, x, w, expert=None):
            kind = self.gguf.tensor(tensor).ggml_type.name
            if expert is not None and moe_above is not None and self.moe_rows > moe_above and kind in moe_q8:
                return self._rounded_moe_matmul(tensor, x, w, expert)
            return super()._moe_matmul(tensor, x, w, expert)

        def _plain_or_rounded(self, op, x2):
            if q8_decode_only and not self.decoding:
                return Oracle._matmul(self, op, x2)
            return super()._matmul(op, x2)

        def _matmul(self, op, x):
            x2 = x.reshape(-1, x.shape[-1])
            kind = self.gguf.tensor(op.weights["weight"]).ggml_type.name
            if half_above is not None and len(x2) > half_above and kind in q8_above:
                y = self._rounded_matmul(op, x2)  # the 8-bit GEMM's rounding, as the megakernel's (gpu_q8_1)
            elif half_above is not None and len(x2) > half_above:
                y = _half(x2) @ _half(self.weight(op.weights["weight"])).T
                y = y + self.weight(op.weights["bias"]) if "bias" in op.weights else y
            else:
                y = self._plain_or_rounded(op, x2)
            return y.reshape(*x.shape[:-1], y.shape[-1])

        def _attention(self, op, q, k, v, positions):
            if half_kv:
                k, v = _half(k), _half(v)
            # a prefill from an empty cache runs the tensor-core kernel: Q, K and V rounded to float16 there (the
            # cache keeps them float32; P's rounding is not emulated)
            if half_above is None or op.attrs["layer"] in self._kv or q.shape[1] < 2:
                return super()._attention(op, q, k, v, positions)
            out = super()._attention(op, _half(q), _half(k), _half(v), positions)
            self._kv[op.attrs["layer"]] = (k, v, self._kv[op.attrs["layer"]][2])
            return out

        def _sinks(self, op):  # attention sinks ride in the cache's query rows (lower/attention_sinks.py)
            sinks = super()._sinks(op)
            return _half(sinks) if half_kv and sinks is not None else sinks

        def _lm_head(self, op, x):  # the build computes only the last row's logits in a prefill
            y = self._plain_or_rounded(op, x.reshape(-1, x.shape[-1]))
            return y.reshape(*x.shape[:-1], y.shape[-1])

    return FastOracle(gguf)


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def make_bundle(bundle: Path) -> None:
    """The TVM runtime package as .tgz, plus wheels for the GPU machine's Python 3.12 (apache-tvm-ffi, gguf,
    llguidance)."""
    import tvm

    from luce_compile.runtime_wheel import compiler_only  # the luce-runtime wheel's selection, less its Python part

    bundle.mkdir(parents=True, exist_ok=True)
    pkg = Path(tvm.__file__).parent
    with tarfile.open(bundle / "tvm-runtime.tgz", "w:gz") as tar:
        tar.add(pkg, arcname="tvm", filter=lambda t: None if compiler_only(t.name) else t)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31)]
    platforms.append("--platform=manylinux2014_x86_64")
    # llguidance: the grammar module, which the served check's scheduler imports (its wheel is manylinux_2_31)
    for req in ("apache-tvm-ffi==0.1.14.post1", "gguf==0.19.*", "llguidance>=1.9,<2"):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(bundle), req],
                       check=True)


# ---- run (GPU machine) --------------------------------------------------------------------------------------------
def _load_runtime() -> None:
    """TVM's runtime only (never the compiler), with the CUDA device API registered."""
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    from luce_runtime.engine import load_device_api

    if not load_device_api("cuda"):
        raise SystemExit("device_check: the CUDA device API did not load (no driver, or TVM's CUDA runtime missing)")


def rebuild_weights(artifact: Path, gguf_path: Path) -> dict:
    """weights.bin from the GGUF: each plane made by the function the build wrote it with (quant_layout.weight_planes,
    BF16 vectors widened and rows reordered as the param says included), at the manifest's offsets."""
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.lower.quant_layout import weight_planes

    manifest = json.loads((artifact / "manifest.json").read_text())
    target = artifact / manifest["weights"]["file"]
    gguf, planes, current = read_gguf(gguf_path), {}, None
    with open(target, "wb") as f:
        for p in manifest["weights"]["params"]:
            if p["source_tensor"] != current:
                current = p["source_tensor"]
                info = gguf.tensor(current)
                planes = weight_planes(gguf.raw(current), info.ggml_type, len(info.shape), p.get("row_pairs", 0))
            f.seek(p["offset"])
            f.write(np.ascontiguousarray(planes[p["plane"]]).tobytes())
    return weights_status(artifact, gguf_path)


def weights_status(artifact: Path, gguf_path: Path) -> dict:
    """Whether weights.bin and the GGUF are the bytes the build machine's manifest names."""
    from luce_runtime.artifact import file_sha256

    manifest = json.loads((artifact / "manifest.json").read_text())
    target = artifact / manifest["weights"]["file"]
    return {"weights_sha_match": manifest["files"][target.name] == file_sha256(target),
            "gguf_sha_match": file_sha256(gguf_path) == manifest["source"]["gguf_sha256"]}


def generate_gguf(folder: Path, path: Path) -> None:
    """The preset's synthetic GGUF, with the tokenizer keys taken from the artifact: the generator would fetch the
    real SmolLM2 GGUF for them, and the GPU machine reaches no network."""
    import luce_compile.synthetic as synthetic

    spec = json.loads((folder / "spec.json").read_text())
    keys = json.loads((folder / "artifact" / "tokenizer.json").read_text())
    tokenizer = source_tokenizer({k: v for k, v in keys.items() if k.startswith("tokenizer.")})
    synthetic.tokenizer_metadata = lambda: tokenizer
    synthetic.write_synthetic(synthetic.preset(spec["preset"]), path)


def source_tokenizer(keys: dict) -> dict:
    """An artifact's tokenizer keys as the generator's source had them: its vocabulary cut before the rows the
    generator adds (the padding "[PAD<id>]" to n_vocab, gpt-oss's harmony tokens on the first of them), which the
    generator then adds again as it did on the build machine."""
    from luce_compile.synthetic_harmony import HARMONY_TOKENS

    tokens = keys["tokenizer.ggml.tokens"]
    n = next((i for i, t in enumerate(tokens) if t == f"[PAD{i}]" or t in HARMONY_TOKENS), len(tokens))
    return {k: v[:n] if isinstance(v, list) and len(v) == len(tokens) else v for k, v in keys.items()}


def check_oracle(engine, ref, tol: float = REL_TOL) -> dict:
    prompt, ids, want = [int(t) for t in ref["prompt"]], [int(t) for t in ref["ids"]], ref["logits"]
    seq = engine.add_sequence()
    rows = [engine.prefill([seq], [prompt])[0]]
    rows += [engine.decode([seq], [t])[0] for t in ids[:len(want) - 1]]  # teacher-forced with the oracle's ids
    engine.remove_sequence(seq)
    errs = [_rel(g, w) for g, w in zip(rows, want, strict=True)]
    first_tie = next((i for i, w in enumerate(want) if near_tie(w, tol)), len(want))
    mismatched = [i for i in range(first_tie) if int(np.argmax(rows[i])) != ids[i]]
    return {"steps": len(want) - 1, "max_rel_err": max(errs), "prefill_rel_err": errs[0],
            "ids_checked": first_tie, "ids_mismatched": mismatched,
            "tolerance": tol, "ok": max(errs) <= tol and not mismatched}


def torch_reference(gguf: Path, prompt_len: int = 32, steps: int = 16, seed: int = 0) -> dict:
    """The independent reference for a model the float64 oracle cannot hold (7B and up): benchmarks/peers'
    torch forward on the GGUF's dequantized weights in float32 on this GPU (TF32 off), greedy from a random prompt;
    the same {prompt, ids, logits} as the oracle's reference.npz."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers.torch_peer import KVCache, Transformer

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Transformer(gguf, device=dev, dtype=torch.float32, max_seq=prompt_len + steps + 16)
    cache = KVCache.allocate(model.config, 1, prompt_len + steps + 1, model.device, model.dtype)
    vocab = int(model.config.n_vocab)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(1, min(vocab, 32000), prompt_len)]
    with torch.no_grad():
        rows = [model.prefill(torch.tensor(prompt, device=dev), cache, 0)]
        ids = [int(rows[-1].argmax())]
        for s in range(steps):
            rows.append(model.decode(torch.tensor([ids[-1]], device=dev),
                                     torch.tensor([prompt_len + s], device=dev), cache)[0])
            ids.append(int(rows[-1].argmax()))
    logits = torch.stack(rows).double().cpu().numpy()
    del model, cache
    torch.cuda.empty_cache()
    return {"prompt": np.array(prompt), "ids": np.array(ids), "logits": logits}


def check_batched(engine, sizes: tuple[int, ...] = (2, 5, 8), steps: int = 16, seed: int = 1,
                  joint_prefill: bool = True) -> dict:
    """Decode n sequences together, then each alone from the same prompt and tokens: the same logits. The sizes
    cover each branch of the batched matmuls (schedules/gpu/quant_gemm.py: ≤ 2, ≤ 8 padded to a bucket of 4), and
    prompts of 4..40 tokens send short prefills through the small-batch branches too. Precision f16 prefills each
    sequence alone first (joint_prefill=False): a prompt's rows take tensor cores or not depending on what it is
    prefilled with, which is a rounding difference by design, not a batching error."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for n_seq in sizes:
        prompts = [[int(t) for t in rng.integers(1, 49152, int(n))] for n in rng.integers(4, 40, n_seq)]
        seqs = [engine.add_sequence() for _ in prompts]
        if joint_prefill:
            last = engine.prefill(seqs, prompts)
        else:
            last = np.stack([engine.prefill([s], [p])[0] for s, p in zip(seqs, prompts, strict=True)])
        fed, together = [], []
        for _ in range(steps):
            tokens = [int(t) for t in np.argmax(last, axis=-1)]
            fed.append(tokens)
            last = engine.decode(seqs, tokens)
            together.append(last)
        for s in seqs:
            engine.remove_sequence(s)
        for i, prompt in enumerate(prompts):
            s = engine.add_sequence()
            engine.prefill([s], [prompt])
            for step in range(steps):
                worst = max(worst, _rel(engine.decode([s], [fed[step][i]])[0], together[step][i]))
            engine.remove_sequence(s)
    return {"sequences": list(sizes), "steps": steps, "max_rel_diff": worst, "ok": worst <= BATCH_TOL}


def random_masks(rng: np.random.Generator, logits: np.ndarray) -> list[np.ndarray]:
    """A grammar-like token mask per row, packed as decode_greedy takes them: a random share of the vocabulary
    (from a few tokens to most), the row's own argmax taken out half the time (the masked argmax must then find
    another), and a last row of several that allows nothing (its id must be -1)."""
    n, vocab = logits.shape
    out = []
    for r in range(n):
        allowed = rng.random(vocab) < rng.choice([1e-3, 0.05, 0.5, 0.95])
        if rng.random() < 0.5:
            allowed[int(np.argmax(logits[r]))] = False
        if n > 1 and r == n - 1:
            allowed[:] = False
        out.append(np.packbits(np.pad(allowed, (0, -vocab % 32)), bitorder="little").view(np.int32))
    return out


def check_paths(engine, per_op, steps: int = 64, seed: int = 2, tol: float = BATCH_TOL) -> dict:
    """The megakernel's decode against the per-op kernels' on the same artifact: one prefill each (the same
    kernels), then greedy steps teacher-forced with the per-op ids, at batch 1 and at 3 sequences (the batch-4
    kernel with a repeated padding row). Both decode in float32 over the same float32 pages; they differ only in
    summation order, so the logits must agree to 1e-4 of the row's largest (BATCH_TOL) and the ids until a near tie.
    The megakernel's argmax on the device (decode_greedy) must be the argmax of its own logits, every id, and on
    every other step the argmax over a random token mask's allowed tokens (grammar-constrained decoding). A
    megakernel with 8-bit activations (--megakernel-q8) differs by their rounding: `tol` = REL_TOL_Q8; one with tf32
    inputs (--megakernel-tf32): REL_TOL_TF32. A model with a sliding window W takes prompts of W - 8 to W + 24
    tokens: the steps cross the window."""
    from luce_runtime.sampler import masked_argmax

    rng = np.random.default_rng(seed)
    worst, mismatched, checked, device_ids, device_mismatched, masked_ids = 0.0, 0, 0, 0, 0, 0
    window = engine.sliding_window
    lengths = (max(8, window - 8), window + 24) if window else (8, 40)
    for n_seq in (1, 3):
        prompts = [[int(t) for t in rng.integers(1, 49152, int(n))] for n in rng.integers(*lengths, n_seq)]
        rows = {}
        for which, eng in (("op", per_op), ("mk", engine)):  # the per-op ids first: the megakernel is fed them
            seqs = [eng.add_sequence() for _ in prompts]
            last = np.stack([eng.prefill([s], [p])[0] for s, p in zip(seqs, prompts, strict=True)])
            out = [last]
            for step in range(steps):
                tokens = [int(t) for t in np.argmax(rows["op"][step] if which == "mk" else last, axis=-1)]
                last = eng.decode(seqs, tokens)
                out.append(last)
            for s in seqs:
                eng.remove_sequence(s)
            rows[which] = out
        # the megakernel's own argmax on the device (Engine.decode_greedy: only ids come back), on the same inputs
        seqs = [engine.add_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts, strict=True):
            engine.prefill([s], [p])
        for step in range(steps):
            # odd steps masked as a grammar would (decode_greedy's `allowed`): the argmax over the allowed tokens
            masks = random_masks(rng, rows["mk"][step + 1]) if step % 2 else None
            ids = engine.decode_greedy(seqs, [int(t) for t in np.argmax(rows["op"][step], axis=-1)], masks)
            want = (np.argmax(rows["mk"][step + 1], axis=-1) if masks is None else
                    masked_argmax(rows["mk"][step + 1], np.stack(masks)))
            device_ids += len(ids)
            masked_ids += len(ids) if masks is not None else 0
            device_mismatched += sum(int(i) != int(w) for i, w in zip(ids, want, strict=True))
        for s in seqs:
            engine.remove_sequence(s)
        for got, want in zip(rows["mk"][1:], rows["op"][1:], strict=True):
            for g, w in zip(got, want, strict=True):
                worst = max(worst, _rel(g, w))
                if not near_tie(w, tol):
                    checked += 1
                    mismatched += int(np.argmax(g)) != int(np.argmax(w))
    return {"steps": steps, "sequences": [1, 3], "max_rel_diff": worst, "ids_checked": checked,
            "ids_mismatched": mismatched, "device_ids": device_ids, "device_ids_mismatched": device_mismatched,
            "device_ids_masked": masked_ids,
            "tolerance": tol, "ok": worst <= tol and mismatched == 0 and device_mismatched == 0}


def check_tree(engine, per_op, prompt: list[int], tokens: list[int], parents: list[int], leaf: int,
               next_token: int, want: np.ndarray | None = None, want_after: np.ndarray | None = None,
               tol: float = REL_TOL, path_tol: float = BATCH_TOL) -> dict:
    """Tree verify (issue 39) on the megakernel's verify rows against the per-op kernels' (TVM's tree attention
    mask) on the same artifact, and against the oracle's tree forward (`want`, each node's row after its path):
    each engine prefills the prompt, verifies the tree in one forward (Engine.verify_tree), commits the path to
    `leaf` (TVM's commit moves its keys and values to consecutive slots) and decodes next_token (`want_after`: the
    oracle's logits after prompt + path + next_token). The megakernel's device argmax (verify_tree_greedy, only ids
    back) must be the argmax of its own logits; the rest within `tol` of the oracle (the run's bar: the build's
    roundings are emulated) and `path_tol` of the per-op path (check_paths' bar), ids equal but at near ties."""
    if not engine._tree_on_megakernel(len(tokens)):
        return {"ok": False, "error": f"the megakernel does not verify this tree ({len(tokens)} nodes; verifies_trees "
                f"{engine.verifies_trees}, decode path: {engine.decode_path}): an artifact built before issue 39?"}
    got = {}
    for which, eng in (("mk", engine), ("op", per_op)):
        seq = eng.add_sequence()
        try:
            eng.prefill([seq], [prompt])
            rows = eng.verify_tree(seq, tokens, parents)
            eng.commit_tree(seq, leaf)
            got[which] = np.concatenate([rows, eng.decode([seq], [next_token])])  # the tree's rows, then the step's
        finally:
            eng.remove_sequence(seq)
    seq = engine.add_sequence()
    try:
        engine.prefill([seq], [prompt])
        device_ids = engine.verify_tree_greedy(seq, tokens, parents)
        engine.commit_tree(seq, leaf)
    finally:
        engine.remove_sequence(seq)

    def compare(rows: np.ndarray, ref: np.ndarray, bar: float) -> dict:
        errs = [_rel(g, w) for g, w in zip(rows, ref, strict=True)]
        fair = [i for i, w in enumerate(ref) if not near_tie(w, bar)]
        wrong = [i for i in fair if int(np.argmax(rows[i])) != int(np.argmax(ref[i]))]
        return {"max_rel_err": max(errs), "rows": len(errs), "ids_checked": len(fair), "ids_mismatched": wrong,
                "tolerance": bar, "ok": max(errs) <= bar and not wrong}

    out = {"tokens": tokens, "parents": parents, "leaf": leaf, "on_megakernel": True,
           "vs_per_op": compare(got["mk"], got["op"].astype(np.float64), path_tol),
           "device_ids_mismatched": [i for i, t in enumerate(device_ids) if t != int(np.argmax(got["mk"][i]))]}
    if want is not None:
        out["vs_oracle"] = compare(got["mk"], np.concatenate([want, want_after[None]]).astype(np.float64), tol)
    out["ok"] = out["vs_per_op"]["ok"] and not out["device_ids_mismatched"] and out.get("vs_oracle", {}).get("ok", True)
    return out


def tree_check(engine, per_op, folder: Path, tol: float, path_tol: float) -> dict:
    """check_tree on the prepared tree (tree_reference.npz, TREE_PARENTS after reference.npz's prompt), or where
    the folder has no oracle reference (prepare --no-reference) on the same shape of tree built from the per-op
    engine's own greedy chain, against the per-op path only. An error is the check's result (the per-op tree
    attention had not run on a GPU before this check): the other checks' results are still written."""
    try:
        return _tree_check(engine, per_op, folder, tol, path_tol)
    except Exception as e:  # noqa: BLE001  (recorded in the result, as megakernel_check records a model's)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _tree_check(engine, per_op, folder: Path, tol: float, path_tol: float) -> dict:
    if (folder / "tree_reference.npz").is_file():
        ref, tree = np.load(folder / "reference.npz"), np.load(folder / "tree_reference.npz")
        prompt, ids = [int(t) for t in ref["prompt"]], [int(t) for t in ref["ids"]]
        path = [0, 1, 3, 5]  # TREE_LEAF's nodes: the chain ids[0..3]; the step after it feeds ids[4]
        assert [int(tree["tokens"][i]) for i in path] == ids[:4], "the tree's greedy chain is the trace's"
        return check_tree(engine, per_op, prompt, [int(t) for t in tree["tokens"]], TREE_PARENTS, TREE_LEAF, ids[4],
                          tree["logits"], ref["logits"][5], tol=tol, path_tol=path_tol)
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(1, min(per_op.vocab_size, 32000), 32)]
    seq = per_op.add_sequence()
    try:
        rows = [per_op.prefill([seq], [prompt])[0]]
        for _ in range(4):
            rows.append(per_op.decode([seq], [int(np.argmax(rows[-1]))])[0])
    finally:
        per_op.remove_sequence(seq)
    ids = [int(np.argmax(r)) for r in rows]
    return check_tree(engine, per_op, prompt, reference_tree(ids, np.stack(rows)), TREE_PARENTS, TREE_LEAF, ids[4],
                      path_tol=path_tol)


def window_prefill_engines(artifact: Path) -> dict:
    """The two per-op engines check_window_prefill compares: prompts in chunks past the window, and a token a call."""
    from luce_runtime.engine import Engine, EngineOptions

    context = _check_context(artifact)
    return {name: Engine(artifact, EngineOptions(max_batch=2, max_context=context, megakernel=False,
                                                 sliding_prefill_chunks=chunks))
            for name, chunks in (("chunks", True), ("token", False))}


def check_window_prefill(engines: dict, tol: float, past: int = 200, steps: int = 8, seed: int = 7) -> dict:
    """A prompt W + `past` tokens long on the per-op kernels in prefill chunks past the sliding window W
    (EngineOptions.sliding_prefill_chunks: the paged prefill kernel windows each row to its cached keys) against the
    same prompt a token a call past the first chunk (the decode kernel, which windows through the page table: what
    such artifacts run today), then `steps` teacher-forced decode steps on each: the last prompt row and every step
    within `tol` (the chunks' 8-bit GEMMs against the decode GEMVs: the build's prefill tolerance), ids equal but at
    near ties. A kernel that attends past a row's window moves them by O(1). Passing on a device is what lets a build
    say sliding_prefill_chunks for its target (luce_compile/codegen/compile.py). `engines`: window_prefill_engines'."""
    window, context = engines["chunks"].sliding_window, engines["chunks"].max_context
    if not window or window + past + steps > context:
        return {"ok": True, "skipped": f"window {window}, context {context}"}
    rng = np.random.default_rng(seed)
    vocab = engines["chunks"].vocab_size
    prompt = [int(t) for t in rng.integers(1, vocab, window + past)]
    forced = [int(t) for t in rng.integers(1, vocab, steps)]
    rows, chunk = {}, {}
    for name, engine in engines.items():
        seq = engine.add_sequence()
        rows[name] = [engine.prefill([seq], [prompt])[0]]
        chunk[name] = engine.chunk_limit(seq)  # tokens a call past the window: the two routes differ here
        rows[name] += [engine.decode([seq], [t])[0] for t in forced]
        engine.remove_sequence(seq)
    errs = [_rel(a, b) for a, b in zip(rows["chunks"], rows["token"], strict=True)]
    ties = [near_tie(b, tol) for b in rows["token"]]
    mismatched = [i for i, (a, b) in enumerate(zip(rows["chunks"], rows["token"], strict=True))
                  if not ties[i] and int(np.argmax(a)) != int(np.argmax(b))]
    return {"window": window, "prompt": len(prompt), "chunk_past_window": chunk, "steps": steps,
            "max_rel_diff": max(errs),
            "prefill_rel_diff": errs[0], "ids_mismatched": mismatched, "tolerance": tol,
            "ok": max(errs) <= tol and not mismatched and chunk["chunks"] > 1 and chunk["token"] == 1}


def check_window_verify(engine, per_op, tol: float = BATCH_TOL, rounds: int = 6, rows: int = 6, keep: int = 2,
                        seed: int = 5) -> dict:
    """A model with sliding-window layers (issue 40.3), past its window W: a prompt of W + 24 tokens, then rounds of
    a verify of `rows` tokens on the megakernel's rows (each row windows the keys by its own position), of which
    `keep` stay (a rollback inside the window, as rejected drafts), against the per-op engine decoding the same
    tokens one by one and rolling back alike (its kernels read TVM's suffix of the pages); then both roll back W + 3
    tokens (past the window: TVM keeps every page) and decode 8 teacher-forced steps. Rows within `tol` of the
    per-op path, ids equal but at near ties. Then greedy speculation (prompt lookup, chains) on the megakernel
    gives plain greedy decoding's ids."""
    from luce_runtime.sampler import SamplingParams
    from luce_runtime.speculative import NgramDrafter, SpeculativeDecoder

    rng = np.random.default_rng(seed)
    window = engine.sliding_window
    prompt = [int(t) for t in rng.integers(1, 49152, window + 24)]
    seqs = {"mk": engine.add_sequence(), "op": per_op.add_sequence()}
    worst, checked, mismatched = 0.0, 0, 0

    def compare(got: np.ndarray, want: np.ndarray) -> None:
        nonlocal worst, checked, mismatched
        for g, w in zip(got, want, strict=True):
            worst = max(worst, _rel(g, w))
            if not near_tie(w, tol):
                checked += 1
                mismatched += int(np.argmax(g)) != int(np.argmax(w))

    try:
        last = per_op.prefill([seqs["op"]], [prompt])[0]
        engine.prefill([seqs["mk"]], [prompt])
        for _ in range(rounds):
            fed = [int(np.argmax(last)), *(int(t) for t in rng.integers(1, 49152, rows - 1))]
            (got,) = engine.verify([seqs["mk"]], [fed])
            want = np.stack([per_op.decode([seqs["op"]], [t])[0] for t in fed])
            compare(got, want)
            engine.rollback(seqs["mk"], rows - keep)
            per_op.rollback(seqs["op"], rows - keep)
            last = want[keep - 1]
        for eng in (engine, per_op):
            eng.rollback(seqs["mk" if eng is engine else "op"], window + 3)
        fed = [int(t) for t in rng.integers(1, 49152, 8)]
        compare(np.stack([engine.decode([seqs["mk"]], [t])[0] for t in fed]),
                np.stack([per_op.decode([seqs["op"]], [t])[0] for t in fed]))
    finally:
        engine.remove_sequence(seqs["mk"])
        per_op.remove_sequence(seqs["op"])
    decoder = SpeculativeDecoder(engine, NgramDrafter(), draft_max=6, timed_length=False)
    params = SamplingParams(temperature=0, max_tokens=64)
    words = [int(t) for t in rng.integers(1, 49152, 12)]
    repeated = (words * (window // 12 + 4))[:window + 36]  # prompt lookup finds its drafts in the repeats
    same = list(decoder.generate(repeated, params)) == list(engine.generate(repeated, params))
    return {"window": window, "verify_rows": rows, "rounds": rounds, "max_rel_diff": worst, "ids_checked": checked,
            "ids_mismatched": mismatched, "tolerance": tol, "speculation_equals_plain": same,
            "drafted": decoder.stats.drafted, "accepted": decoder.stats.accepted,
            "ok": worst <= tol and mismatched == 0 and same and decoder.stats.accepted > 0}


def _served(scheduler, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of `prompts`, submitted together to a running scheduler."""
    import asyncio

    from luce_runtime.sampler import SamplingParams
    from luce_runtime.serve.scheduler import GenRequest

    async def generate() -> list[list[int]]:
        loop, queues, outs = asyncio.get_running_loop(), [], []
        for p in prompts:
            q: asyncio.Queue = asyncio.Queue()
            scheduler.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=max_tokens), q, loop))
            queues.append(q)
        for q in queues:
            tokens = []
            while (ev := await asyncio.wait_for(q.get(), 300)).kind == "delta":
                tokens.append(ev.token)
            if ev.kind != "done":
                raise RuntimeError(f"served request ended with {ev.kind}: {ev}")
            outs.append(tokens)
        return outs
    return asyncio.run(generate())


def check_served_invariance(artifact: Path, n: int = 8, max_tokens: int = 24, chunk: int = 64,
                            seed: int = 3) -> dict:
    """Issue 37.5 on this device: `serve --deterministic`'s scheduler with 8 concurrent greedy requests (prompts of
    several prefill chunks sharing a system prefix, so forks and joint prefills are on offer) against each request
    alone on a fresh scheduler. Equal tokens, or the first request that differs."""
    from luce_runtime.engine import Engine, EngineOptions
    from luce_runtime.serve.scheduler import Scheduler

    def scheduler() -> Scheduler:
        engine = Engine(artifact, EngineOptions(max_batch=2 * n, max_context=1024, prefill_chunk=chunk,
                                                batch_invariant=True))
        s = Scheduler(engine, max_batch=n, prefix_cache=4, deterministic=True)
        s.start()
        return s

    rng = np.random.default_rng(seed)
    vocab = int(json.loads((artifact / "manifest.json").read_text())["config"]["n_vocab"])
    system = [int(t) for t in rng.integers(1, min(vocab, 32000), 2 * chunk + 5)]
    prompts = [system + [int(t) for t in rng.integers(1, min(vocab, 32000), 7 + 13 * i)] for i in range(n)]
    together_s = scheduler()
    try:
        together = _served(together_s, prompts, max_tokens)
        seen = together_s.stats()
    finally:
        together_s.stop()
    differing = []
    for i, (p, got) in enumerate(zip(prompts, together, strict=True)):
        alone_s = scheduler()
        try:
            if _served(alone_s, [p], max_tokens) != [got]:
                differing.append(i)
        finally:
            alone_s.stop()
    return {"requests": n, "max_tokens": max_tokens, "max_batch_seen": int(seen.get("max_batch_seen", 0)),
            "batched_steps": int(seen.get("batched_steps", 0)), "differing": differing, "ok": not differing}


def time_engine(engine, prompt_len: int = 512, prefill_lens: tuple[int, ...] = (2048,), steps: int = 128) -> dict:
    """Decode (batch 1, after a prompt_len prompt) and prefill speed, measured by luce_runtime.bench.bench_engine:
    the method and the medians of `luce-compile bench` and the H200 table, written in this record's fields."""
    from luce_runtime.bench import bench_engine

    t = bench_engine(engine, prompt_len=prompt_len, gen_len=steps, batch=1, prefill_lens=prefill_lens)
    by_len = {prompt_len: t["prefill_tok_s"]} | t.get("prefill_by_len", {})
    return {"decode": {"batch": 1, "steps": steps, "ms_per_token": 1e3 / t["decode_tok_s"],
                       "tok_s": t["decode_tok_s"]},
            "prefill": [{"tokens": n, "chunk": engine.options.prefill_chunk, "seconds": n / tok_s, "tok_s": tok_s}
                        for n, tok_s in by_len.items()]}


def _environment() -> dict:
    import tvm
    import tvm_ffi

    env = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "python": platform.python_version(),
           "tvm": tvm.__version__, "tvm_ffi": getattr(tvm_ffi, "__version__", "?")}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        env["gpu"] = q.stdout.strip()
    return env


def run(args: argparse.Namespace) -> int:
    _load_runtime()
    from luce_runtime.engine import Engine, EngineOptions

    folder = Path(args.dir)
    artifact = folder / "artifact"
    result = {"spec": json.loads((folder / "spec.json").read_text()), "environment": _environment()}
    gguf = Path(args.gguf or f"/tmp/{result['spec']['gguf_name']}")
    if not gguf.is_file():
        generate_gguf(folder, gguf)
    # weights.bin may exist already (`gguf` made it, or an earlier run): its sha is checked either way
    result["weights"] = (weights_status(artifact, gguf) if (artifact / "weights.bin").is_file()
                         else rebuild_weights(artifact, gguf))
    start = time.perf_counter()
    # megakernel=True: every batch size it has a kernel for runs it (the default measures and may keep the per-op
    # path for some), so the checks below cover each kernel
    engine = Engine(artifact, EngineOptions(max_batch=8, max_context=_check_context(artifact), megakernel=True))
    result["load_seconds"] = round(time.perf_counter() - start, 2)
    kernels = engine.artifact.manifest["kernels"]
    result["manifest_kernels"] = kernels.get("device_binaries")
    if kernels.get("tuning"):  # how many kernels took tuning records (the H200 report says so)
        result["tuning"] = {k: kernels["tuning"][k] for k in ("tuned", "default", "files")}
    half = result["spec"].get("precision", "f32") == "f16"
    mk_options = engine.artifact.manifest.get("megakernel", {}).get("options", {})
    q8, tf32 = bool(mk_options.get("q8_activations")), bool(mk_options.get("float_mma"))
    q8_prefill = result["spec"].get("prefill_gemm", "f16") == "q8"  # 8-bit activations in the prefill GEMMs
    tol = REL_TOL_Q8 if q8 or q8_prefill else REL_TOL_F16 if half else REL_TOL
    path_tol = REL_TOL_Q8 if q8 else REL_TOL_TF32 if tf32 else BATCH_TOL  # the megakernel against the per-op path
    if args.tree_only:
        return _tree_only(engine, artifact, folder, result, args, tol, path_tol)
    checks = {"batched": check_batched(engine, joint_prefill=not half)}
    if result["spec"].get("reference", True):
        checks["oracle"] = check_oracle(engine, np.load(folder / "reference.npz"), tol)
    else:  # prepare --no-reference: the checks that need no oracle still run, and the record says what did not
        result["oracle"] = NO_REFERENCE
        # torch in float32 on the dequantized weights, not emulating the 8-bit or float16 roundings: the bar is the
        # one the megakernel's 8-bit matvecs keep against the float per-op path (REL_TOL_Q8, luce_compile/checks)
        checks["torch_reference"] = check_oracle(engine, torch_reference(gguf),
                                                 REL_TOL_Q8 if q8 or q8_prefill else REL_TOL_F16)
    result["decode_path"] = engine.decode_path
    if engine.sliding_window:  # the two routes agree: what lets a build say sliding_prefill_chunks
        checks["window_prefill"] = check_window_prefill(window_prefill_engines(artifact), tol)
    if engine.megakernel is not None:
        per_op = _per_op_engine(artifact)
        checks["megakernel_vs_per_op"] = check_paths(engine, per_op, tol=path_tol)
        if engine.sliding_window:  # no token trees on sliding layers: chains, rollbacks and speculation instead
            checks["window_verify"] = check_window_verify(engine, per_op, tol=path_tol)
        else:
            checks["tree_verify"] = tree_check(engine, per_op, folder, tol, path_tol)
        del per_op
    result["checks"] = checks
    if not args.no_timing:
        result["timing"] = time_engine(engine)
    if args.served:  # the check's schedulers make engines of their own
        del engine
        if args.out:  # the checks so far, kept if this one takes the process down
            Path(args.out).write_text(json.dumps(result, indent=2))
        try:
            checks["served_invariance"] = check_served_invariance(artifact)
        except Exception as e:  # noqa: BLE001  (recorded: a check that cannot run fails, the others stand)
            checks["served_invariance"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return _report(result, args.out)


def _per_op_engine(artifact: Path):
    """The same artifact on the per-op kernels only: what the megakernel's checks compare against."""
    from luce_runtime.engine import Engine, EngineOptions

    return Engine(artifact, EngineOptions(max_batch=8, max_context=_check_context(artifact), megakernel=False))


def _check_context(artifact: Path) -> int:
    """The checks' context: 4,096, or the model's trained context where shorter (the tiny presets train 2,048)."""
    return min(4096, int(json.loads((artifact / "manifest.json").read_text())["config"]["n_ctx_train"]))


def _report(result: dict, out: str | None) -> int:
    """Print the run's result (and write it to `out`); 0 when every check passed."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0 if all(c["ok"] for c in result["checks"].values()) else 1


def _tree_only(engine, artifact: Path, folder: Path, result: dict, args, tol: float, path_tol: float) -> int:
    """run --tree-only: the tree verify check alone (tree_check), one JSON result."""
    result["decode_path"] = engine.decode_path
    result["checks"] = {"tree_verify": {"ok": False, "error": f"no megakernel: {engine.decode_path}"}
                        if engine.megakernel is None else
                        tree_check(engine, _per_op_engine(artifact), folder, tol, path_tol)}
    return _report(result, args.out)


def check_gemms(args: argparse.Namespace) -> int:
    """Every rule-default GEMM of a tuning bundle (`luce-compile tune ... --bundle`; with --all every candidate) on
    fresh random weights (the project's quantizer, gguf/quants.py, repacked as the build repacks) and activations,
    at a few row counts: each branch of the batch dispatch against float64 numpy, plain and with float16 operands
    (the tensor cores' rounding, exactly), or for the 8-bit GEMM (--prefill-gemm q8: a function whose arguments end
    with the quantized input's scratch) with its activations rounded to 8 bits as the oracle rounds them
    (graph/rounding.gpu_q8_matmul), held to REL_TOL_Q8_GEMM above the low-batch buckets."""
    _load_runtime()
    import tvm
    from gguf import GGMLQuantizationType
    from luce_runtime.tune_bench import read_index

    from luce_compile.checks import REL_TOL_Q8_GEMM
    from luce_compile.gguf.quants import dequantize, quantize
    from luce_compile.graph.rounding import gpu_q8_matmul
    from luce_compile.lower.quant_layout import repack

    bundle = Path(args.bundle)
    index = read_index(bundle)
    workloads = {w["key"]: w for w in index["workloads"]}
    device, rng, rows = tvm.cuda(0), np.random.default_rng(args.seed), []
    for cand in index["candidates"]:
        w = workloads[cand["key"]]
        if not (cand.get("default") or args.all) or "library" not in cand or w["rule"] != "gpu.quant_gemm":
            continue
        qtype = GGMLQuantizationType[w["weight_type"]]
        names = [a["name"] for a in w["args"]]
        y_at = names.index("xq") - 1 if "xq" in names else len(names) - 1  # the 8-bit GEMM's scratch follows y
        n_in, n_out = w["args"][0]["shape"][1], w["args"][y_at]["shape"][1]
        w_float = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = quantize(w_float, qtype).reshape(n_out, -1)
        wq = dequantize(raw, qtype).reshape(n_out, n_in).astype(np.float64)
        planes = [tvm.runtime.tensor(np.ascontiguousarray(v), device) for v in repack(raw, qtype).values()]
        fn = tvm.runtime.load_module(str((bundle / cand["library"]).resolve()))[cand["function"]]
        for batch in args.rows:
            x = rng.standard_normal((batch, n_in)).astype(np.float32)
            out = tvm.runtime.tensor(np.zeros((batch, n_out), np.float32), device)
            scratch = [tvm.runtime.tensor(np.zeros((batch, a["shape"][1]), a["dtype"]), device)
                       for a in w["args"][y_at + 1:]]
            fn(tvm.runtime.tensor(x, device), *planes, out, *scratch)
            got = out.numpy()
            plain = x.astype(np.float64) @ wq.T
            row = {"function": cand["function"], "knobs": cand.get("knobs"), "rows": batch,
                   "vs_plain": _rel(got, plain)}
            if scratch:  # above the buckets the 8-bit GEMM; at or below them the float32 GEMVs (plain)
                row["vs_q8"] = _rel(got, gpu_q8_matmul(x.astype(np.float64), wq, qtype.name, raw))
                row["ok"] = (row["vs_q8"] if batch > LOW_BATCH_ROWS else row["vs_plain"]) <= REL_TOL_Q8_GEMM
            else:
                row["vs_half"] = _rel(got, _half(x.astype(np.float64)) @ _half(wq).T)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("ok", True) for r in rows) else 1


# schedules/gpu/quant_gemm.LOW_BATCH's last limit (not importable there: the GPU machine has no TVM compiler)
LOW_BATCH_ROWS = 8


# ---- prefill attention (schedules/gpu/flash_prefill.py, attention_prefill.py) ---------------------------------------
# (h_kv, h_q, head dim): SmolLM2, Llama-1B, Qwen3-0.6B, Llama-3.1-8B, Gemma-3-1B, plain multi-head, and head dims
# whose WMMA P·V takes narrower passes (96: Phi-3's; 80)
ATTENTION_SHAPES = ((3, 9, 64), (8, 32, 64), (8, 16, 128), (8, 32, 128), (1, 4, 256), (4, 4, 64), (8, 32, 96),
                    (2, 8, 80))
ATTN_OUT_TOL, ATTN_LSE_TOL = 2e-3, 1e-3  # tests/schedules/test_gpu_flash_prefill.py says why (lse: GPU exp2/log2)
PAGE = 16
# (h_kv, h_q, head dim) of models with attention sinks: gpt-oss-20b/120b. Their kernels (flash_prefill.py's ragged
# with d_att, paged_decode) take the cache's rows, the head + lower/attention_sinks.SINK_COLUMNS; TVM's decode kernel
# on the same rows (no sinks) is built beside them to time against
SINK_SHAPES = ((8, 64, 64),)
SINK_COLUMNS, SINK, KEY_POSITION, QUERY_POSITION = 16, 0, 1, 3  # lower/attention_sinks.py's (no compiler there)
# (h_kv, h_q, head dim) whose per-op decode (MoE models, batches past the megakernel's) may take paged_decode without
# sinks instead of TVM's decode kernel (10-12x slower at gpt-oss's shape on the H100): Qwen3-30B-A3B, Llama-3.1-8B,
# Qwen2.5-7B (a group of 7), Qwen2.5-14B (5), SmolLM2 (3, head 64). Both built and timed the sink shapes' way
DECODE_SHAPES = ((4, 32, 128), (8, 32, 128), (4, 28, 128), (8, 40, 128), (3, 9, 64))


def _attention_kernels(h_kv, h_q, d, dtype, info, target, with_tvm: bool) -> dict:
    """name → (PrimFunc, paged, tile) of every kernel built for one shape: the flash kernels (ragged and paged,
    float16 caches), the WMMA one, TVM's (float32 as before, or with_tvm)."""
    from luce_schedules.gpu import attention_prefill, flash_prefill
    from tvm.relax.frontend.nn.llm import _decode_kernels, _prefill_kernels

    from luce_compile.lower import attention_sinks
    from luce_compile.lower.relax_model import prefill_attention_tiles

    assert (SINK_COLUMNS, SINK, KEY_POSITION, QUERY_POSITION) == (attention_sinks.SINK_COLUMNS, attention_sinks.SINK,
                                                                 attention_sinks.KEY_POSITION,
                                                                 attention_sinks.QUERY_POSITION)

    kernels = {}
    if (h_kv, h_q, d) in SINK_SHAPES and dtype == "float16":
        row = d + SINK_COLUMNS
        kernels["flash_sink"] = (flash_prefill.ragged_prefill(h_kv, h_q, row, row, dtype, d_att=d), False, None)
        kernels["flash_decode_sink"] = (flash_prefill.paged_decode(h_kv, h_q, row, dtype, False, page_size=PAGE,
                                                                   d_att=d), "decode", None)
        kernels["tvm_decode"] = (_decode_kernels._attention_decode(h_kv, h_q, row, dtype, False, {}, target,
                                                                   page_size=PAGE), "decode", None)
        return kernels
    if (h_kv, h_q, d) in DECODE_SHAPES and dtype == "float16":
        kernels["flash_decode"] = (flash_prefill.paged_decode(h_kv, h_q, d, dtype, False, page_size=PAGE), "decode",
                                   None)
        kernels["tvm_decode"] = (_decode_kernels._attention_decode(h_kv, h_q, d, dtype, False, {}, target,
                                                                   page_size=PAGE), "decode", None)
        return kernels
    if flash_prefill.supports(d, d, dtype):
        tile = flash_prefill.default_tile(d, d)
        kernels["flash"] = (flash_prefill.ragged_prefill(h_kv, h_q, d, d, dtype), False, [tile.warps, tile.keys])
        kernels["flash_paged"] = (flash_prefill.paged_prefill(h_kv, h_q, d, dtype, page_size=PAGE), True,
                                  [tile.warps, tile.keys])
    if attention_prefill.supports(d, d, dtype):
        tile = attention_prefill.default_tile(d, d)
        kernels["tensor_core"] = (attention_prefill.ragged_prefill(h_kv, h_q, d, d, dtype, tile=tile,
                                                                   sm_count=int(info.facts["sm_count"])), False,
                                  [tile.warps, tile.keys])
    if dtype == "float32" or with_tvm:
        with prefill_attention_tiles(target, d, dtype):
            kernels["tvm_tiled"] = (_prefill_kernels._attention_prefill_ragged(h_kv, h_q, d, d, dtype, {}, target),
                                    False, None)
        kernels["tvm_default"] = (_prefill_kernels._attention_prefill_ragged(h_kv, h_q, d, d, dtype, {}, target),
                                  False, None)
        kernels["tvm_paged"] = (_prefill_kernels._attention_prefill(h_kv, h_q, d, dtype, False, {}, target), True,
                                None)
    return kernels


def build_attention(args: argparse.Namespace) -> int:
    """Build machine: the prefill attention kernels (_attention_kernels) for every shape of ATTENTION_SHAPES in the
    cache's type (--dtype), each a library of its own, and index.json."""
    import tvm

    from luce_compile.codegen.device_binaries import export_checked
    from luce_compile.codegen.gpu_toolchain import gpu_toolchain
    from luce_compile.targets import get_target

    info = get_target(args.target)
    target = info.tvm_target()
    out = Path(args.dir)
    (out / "lib").mkdir(parents=True, exist_ok=True)
    entries = []
    shapes = [tuple(int(x) for x in a.split(",")) for a in args.shapes] if args.shapes else \
        ATTENTION_SHAPES + SINK_SHAPES + DECODE_SHAPES
    for h_kv, h_q, d in shapes:
        for name, (func, paged, tile) in _attention_kernels(h_kv, h_q, d, args.dtype, info, target,
                                                            args.tvm).items():
            lib = f"lib/{name}_{h_kv}_{h_q}_{d}.so"
            symbol = {False: "batch_prefill_ragged_kv", True: "batch_prefill_paged_kv",
                      "decode": "batch_decode_paged_kv"}[paged]
            with gpu_toolchain(info.kind, info.archs, info.name), target:
                export_checked(tvm.compile(tvm.IRModule({symbol: func}), target=target), info, out / lib)
            sinks = {"d_att": d, "d": d + SINK_COLUMNS} if (h_kv, h_q, d) in SINK_SHAPES else \
                {"d_att": d, "d": d} if paged == "decode" else {"d": d}
            entries.append({"kernel": name, "h_kv": h_kv, "h_q": h_q, "dtype": args.dtype, "paged": paged,
                            "function": symbol, "library": lib, "tile": tile, **sinks})
            print(entries[-1], flush=True)
    (out / "index.json").write_text(json.dumps({"target": info.name, "entries": entries}, indent=1))
    return 0


def _attention_reference(q, k, v, q_lens, kv_lens, causal: bool, sm_scale: float, rows=None):
    """float64 ragged attention: per sequence, each query head against its KV head, keys at most kv - qo + row.
    `rows`: only these query rows (of a single sequence; the others stay zero), for 32K-token checks."""
    h_q, h_kv = q.shape[1], k.shape[1]
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    lse = np.zeros(q.shape[:2])
    qs, ks = 0, 0
    for qn, kn in zip(q_lens, kv_lens, strict=True):
        pick = np.arange(qn) if rows is None else np.asarray(rows)
        for h in range(h_q):
            s = q[qs + pick, h].astype(np.float64) @ k[ks:ks + kn, h // (h_q // h_kv)].astype(np.float64).T * sm_scale
            if causal:
                s = np.where(np.arange(kn)[None, :] <= pick[:, None] + kn - qn, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[qs + pick, h] = p @ v[ks:ks + kn, h // (h_q // h_kv)].astype(np.float64) / p.sum(axis=1,
                                                                                                  keepdims=True)
            lse[qs + pick, h] = (m[:, 0] + np.log(p.sum(axis=1))) / np.log(2)
        qs, ks = qs + qn, ks + kn
    return out, lse


class _AttentionCall:
    """One kernel's arguments on the device: ragged (q, k, v by indptr) or paged (k, v scattered into shuffled pages
    of PAGE tokens, TVM's layout (pages, 2, h_kv, PAGE, d), the last page partly filled)."""

    def __init__(self, entry: dict, device, rng):
        self.entry, self.device, self.rng = entry, device, rng

    def tensor(self, a):
        import tvm

        return tvm.runtime.tensor(np.ascontiguousarray(a), self.device)

    def __call__(self, fn, q, k, v, q_lens, kv_lens, causal, sm_scale):
        dtype = self.entry.get("dtype", "float32")
        indptr = lambda n: self.tensor(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))  # noqa: E731
        out = self.tensor(np.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype))
        lse = self.tensor(np.zeros(q.shape[:2], np.float32))
        zeros_q, zeros_b = self.tensor(np.zeros(q.shape[0], np.int32)), self.tensor(np.zeros(len(q_lens), np.int32))
        tail = (out, lse, int(causal), 0, 1.0, 1e4, float(sm_scale))
        if not self.entry.get("paged"):
            argv = (self.tensor(q.astype(dtype)), indptr(q_lens), self.tensor(k.astype(dtype)),
                    self.tensor(v.astype(dtype)), indptr(kv_lens), zeros_q, zeros_b, *tail)
        else:
            counts = [-(-n // PAGE) for n in kv_lens]
            order = self.rng.permutation(sum(counts)).astype(np.int32)  # page indirection exercised
            pages = np.zeros((sum(counts) + 1, 2, k.shape[1], PAGE, k.shape[2]), dtype)
            start, ks = 0, 0
            for n, c in zip(kv_lens, counts, strict=True):
                for j in range(c):
                    span = slice(ks + j * PAGE, ks + min((j + 1) * PAGE, n))
                    width = span.stop - span.start
                    pages[order[start + j], 0, :, :width] = k[span].transpose(1, 0, 2)
                    pages[order[start + j], 1, :, :width] = v[span].transpose(1, 0, 2)
                start, ks = start + c, ks + n
            last = np.array([n - (c - 1) * PAGE for n, c in zip(kv_lens, counts, strict=True)], np.int32)
            if self.entry["paged"] == "decode":  # TVM's decode signature: a query a sequence, no indptr, no causal
                argv = (self.tensor(q.astype(dtype)), self.tensor(pages), indptr(counts), self.tensor(order),
                        self.tensor(last), zeros_b, zeros_b, out, lse, 0, 1.0, 1e4, float(sm_scale))
            else:
                argv = (self.tensor(q.astype(dtype)), indptr(q_lens), self.tensor(pages), indptr(counts),
                        self.tensor(order), self.tensor(last), zeros_b, zeros_q, *tail)
        fn(*argv)
        return out.numpy().astype(np.float64), lse.numpy(), argv


def _sink_inputs(rng, q_lens, kv_lens, h_kv: int, h_q: int, d_att: int, owns: list[bool], columns: int = SINK_COLUMNS):
    """Q, K, V rows as lower/attention_sinks.pad_with_sinks lays them out (float16): the head's d_att columns, then a
    query's sink logit and position and a key's position in the padding (values zero there); each sequence's keys at
    positions 0.., its queries the last of them, or one past its last key where owns[b] is False (the call does not
    hold the query's own key: no sink folded). Returns q, k, v and the sinks (Σq, h_q) each query row folds in (-inf:
    none). `columns` 0: plain rows of a model without sinks (none folded)."""
    width = d_att + columns
    q, k, v = (np.zeros((sum(n), h, width), np.float16) for n, h in ((q_lens, h_q), (kv_lens, h_kv), (kv_lens, h_kv)))
    for a, n, h in ((q, q_lens, h_q), (k, kv_lens, h_kv), (v, kv_lens, h_kv)):
        a[..., :d_att] = rng.standard_normal((sum(n), h, d_att)).astype(np.float16)
    if not columns:
        return q, k, v, np.full((sum(q_lens), h_q), -np.inf)
    sink = (rng.standard_normal(h_q) * 3).astype(np.float16)
    q[..., d_att + SINK] = sink
    split = lambda pos: np.stack([pos % 1024, pos // 1024], -1)  # noqa: E731  (attention_sinks.POSITION_RADIX)
    folded = np.full((sum(q_lens), h_q), -np.inf)
    qs = ks = 0
    for b, (qn, kn) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k[ks:ks + kn, :, d_att + KEY_POSITION:d_att + KEY_POSITION + 2] = split(np.arange(kn))[:, None]
        q_pos = np.arange(kn - qn, kn) + (0 if owns[b] else 1)
        q[qs:qs + qn, :, d_att + QUERY_POSITION:d_att + QUERY_POSITION + 2] = split(q_pos)[:, None]
        if owns[b]:
            folded[qs:qs + qn] = sink.astype(np.float64)
        qs, ks = qs + qn, ks + kn
    return q, k, v, folded


def _sink_reference(q, k, v, q_lens, kv_lens, causal: bool, sm_scale: float, folded, d_att: int):
    """float64 attention over the head's d_att columns with each row's folded sink (natural log, -inf: none) as one
    more key of value 0: (output, base-2 log-sum-exp)."""
    want, lse = _attention_reference(q[..., :d_att], k[..., :d_att], v[..., :d_att], q_lens, kv_lens, causal, sm_scale)
    total = np.logaddexp2(lse, folded / np.log(2))
    return want * np.exp2(lse - total)[..., None], total


def _check_sinks(e: dict, fn, call, rng, tokens: list[int], number: int, repeat: int, module, device) -> list[dict]:
    """A kernel of SINK_SHAPES on the cache's rows with sinks: flash_sink (ragged, every row folds its sink),
    flash_decode_sink (where the pages end at the query's own key), tvm_decode (no sinks: the padding must add
    nothing to its scores); against float64 over the head's columns with the sink as one more key of value 0. Then
    the decode kernels timed at each of `tokens` keys, batch 1 and 8. DECODE_SHAPES' kernels (rows of the head
    alone, d_att = d) the same way, no sink anywhere."""
    h_kv, h_q, d_att = e["h_kv"], e["h_q"], e["d_att"]
    columns = e["d"] - d_att
    sm_scale, rows = 1 / np.sqrt(d_att), []
    decode = e["paged"] == "decode"
    if decode:
        kv_cases = [(1, 70, 300, 1000, 5000)]
        cases = [((1,) * len(kv), kv, [b != 1 for b in range(len(kv))], False) for kv in kv_cases]
    else:
        cases = [((1, 17, 100, 300),) * 2 + ([True] * 4, True), ((5, 130),) * 2 + ([True] * 2, True)]
    for q_lens, kv_lens, owns, causal in cases:
        q, k, v, folded = _sink_inputs(rng, q_lens, kv_lens, h_kv, h_q, d_att, owns, columns)
        if e["kernel"].startswith("tvm"):
            folded[:] = -np.inf  # TVM's kernel has no sink term
        got, got_lse, _ = call(fn, q, k, v, q_lens, kv_lens, causal, sm_scale)
        want, want_lse = _sink_reference(q, k, v, q_lens, kv_lens, causal, sm_scale, folded, d_att)
        row = {**{x: e[x] for x in ("kernel", "h_kv", "h_q", "d", "d_att")}, "q_lens": list(q_lens),
               "kv_lens": list(kv_lens), "owns": owns, "vs_half": _rel(got[..., :d_att], want),
               "padding_max": float(np.abs(got[..., d_att:]).max()) if columns else 0.0,
               "lse_vs_half": float(np.abs(got_lse - want_lse).max())}
        row["ok"] = row["vs_half"] < ATTN_OUT_TOL and row["lse_vs_half"] < ATTN_LSE_TOL and row["padding_max"] == 0
        rows.append(row)
        print(json.dumps(row), flush=True)
    if decode:
        for n in tokens:
            for batch in (1, 8):
                q, k, v, _ = _sink_inputs(rng, (1,) * batch, (n,) * batch, h_kv, h_q, d_att, [True] * batch, columns)
                _, _, argv = call(fn, q, k, v, (1,) * batch, (n,) * batch, False, sm_scale)
                timer = module.time_evaluator(e["function"], device, number=number, repeat=repeat)
                seconds = float(np.median(timer(*argv).results))
                rows.append({**{x: e[x] for x in ("kernel", "h_kv", "h_q", "d", "d_att")}, "tokens": n,
                             "batch": batch, "us": seconds * 1e6,
                             "gb_per_s": batch * n * h_kv * 2 * e["d"] * 2 / seconds / 1e9})  # K and V rows read
                print(json.dumps(rows[-1]), flush=True)
    return rows


def check_attention(args: argparse.Namespace) -> int:
    """GPU machine: every kernel of an `attention-build` folder on fresh random ragged batches (several sequences, a
    cached prefix, causal and not; Q, K, V in the cache's type) against float64, then one --long-token causal
    sequence (its first, last and random rows against float64); then timed (TVM's time_evaluator, median of
    repeats) at each of --tokens, one causal sequence: ragged kernels on the whole prompt, paged ones on its last
    --chunk tokens over the whole prompt's pages (a chunked prefill's last chunk). Non-zero exit when a flash kernel
    misses ATTN_OUT_TOL / ATTN_LSE_TOL."""
    _load_runtime()
    import tvm

    folder = Path(args.dir)
    index = json.loads((folder / "index.json").read_text())
    device, rng, rows, failed = tvm.cuda(0), np.random.default_rng(args.seed), [], False

    def tensors(q_lens, kv_lens, h_kv, h_q, d, dtype):
        q, k, v = (rng.standard_normal((sum(n), h, d)).astype(np.float32).astype(dtype)
                   for n, h in ((q_lens, h_q), (kv_lens, h_kv), (kv_lens, h_kv)))
        return q, k, v

    cases = [((1, 17, 100, 300), (1, 17, 100, 300), True), ((37, 64, 5), (77, 64, 200), True),
             ((45, 130), (45, 200), False), ((513,), (513,), True), ((1, 1, 3), (40, 1, 70), True)]
    for e in index["entries"]:
        module = tvm.runtime.load_module(str((folder / e["library"]).resolve()))
        fn, call = module[e.get("function", "batch_prefill_ragged_kv")], _AttentionCall(e, device, rng)
        if "d_att" in e:
            sink_rows = _check_sinks(e, fn, call, rng, args.tokens, args.number, args.repeat, module, device)
            failed |= not all(r["ok"] for r in sink_rows if "ok" in r)
            rows += sink_rows
            continue
        h_kv, h_q, d, dtype = e["h_kv"], e["h_q"], e["d"], e.get("dtype", "float32")
        sm_scale = 1 / np.sqrt(d)
        long = [((args.long,), (args.long,), True)] if args.long and not e["kernel"].startswith("tvm") else []
        for q_lens, kv_lens, causal in cases + long:
            q, k, v = tensors(q_lens, kv_lens, h_kv, h_q, d, dtype)
            got, got_lse, _ = call(fn, q, k, v, q_lens, kv_lens, causal, sm_scale)
            pick = None
            if len(q_lens) == 1 and q_lens[0] > 4096:  # first, last and random rows of a long prompt
                n = q_lens[0]
                pick = np.unique(np.concatenate([np.arange(16), np.arange(n - 16, n), rng.integers(0, n, 32)]))
                got, got_lse = got[pick], got_lse[pick]
            half, half_lse = _attention_reference(*(_half(a) for a in (q, k, v)), q_lens, kv_lens, causal, sm_scale,
                                                  rows=pick)
            if pick is not None:
                half, half_lse = half[pick], half_lse[pick]
            row = {**{x: e[x] for x in ("kernel", "h_kv", "h_q", "d")}, "dtype": dtype, "q_lens": list(q_lens),
                   "kv_lens": list(kv_lens), "causal": causal, "rows_checked": None if pick is None else len(pick),
                   "vs_half": _rel(got, half), "lse_vs_half": float(np.abs(got_lse - half_lse).max())}
            row["ok"] = row["vs_half"] < ATTN_OUT_TOL and row["lse_vs_half"] < ATTN_LSE_TOL
            failed |= e["kernel"].startswith("flash") and not row["ok"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        for n in args.tokens:
            if e["kernel"].startswith("tvm") and n > 2048:
                continue  # float32 SIMT: seconds a call at 8K, minutes at 32K
            q_n = min(n, args.chunk) if e.get("paged") else n
            q, k, v = tensors((q_n,), (n,), h_kv, h_q, d, dtype)
            _, _, argv = call(fn, q, k, v, (q_n,), (n,), True, sm_scale)
            timer = module.time_evaluator(e.get("function", "batch_prefill_ragged_kv"), device, number=args.number,
                                          repeat=args.repeat)
            seconds = float(np.median(timer(*argv).results))
            visible = q_n * (n - q_n) + q_n * (q_n + 1) / 2  # causal: each query sees the keys before it
            flops = 4 * h_q * d * visible  # QKᵀ and PV
            rows.append({**{x: e[x] for x in ("kernel", "h_kv", "h_q", "d")}, "dtype": dtype, "tokens": n,
                         "queries": q_n, "us": seconds * 1e6, "tflops": flops / seconds / 1e12})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


def make_gguf(args: argparse.Namespace) -> int:
    """Write the synthetic GGUF and the artifact's weights.bin from it (the benchmark does this for every workload in
    parallel up front, so a workload it times without checking it loads too); where it writes weights.bin, print
    the sha checks and fail when either differs from the manifest."""
    folder, gguf = Path(args.dir), Path(args.gguf)
    if not gguf.is_file():
        generate_gguf(folder, gguf)
    if not (folder / "artifact" / "weights.bin").is_file():
        status = rebuild_weights(folder / "artifact", gguf)
        print(json.dumps(status))
        return 0 if all(status.values()) else 1  # not the build machine's bytes: nothing measured on them counts
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build machine: artifact (without weights), reference logits, bundle")
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--target", default="sm_90")
    p.add_argument("--dir", required=True)
    p.add_argument("--bundle", help="also write the runtime bundle (TVM runtime .tgz + wheels) here")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--no-megakernel", action="store_true", help="build without the decode megakernels (compile's "
                   "--no-megakernel): a Q4_K_M mix's per-layer weight types make a 13 MB megakernel source that nvcc "
                   "takes over 10 minutes to compile")
    p.add_argument("--megakernel-q8", action="store_const", const=True, default=None,
                   help="compile's --megakernel-q8 (the default with precision auto/f16); the reference rounds as "
                   "the manifest says the build's megakernels do")
    p.add_argument("--megakernel-tf32", action="store_const", const=True, default=None,
                   help="compile's --megakernel-tf32 (likewise)")
    p.add_argument("--precision", choices=("auto", "f16", "f32"), default="auto",
                   help="as compile's: auto is f16 (tensor-core prefill) on CUDA; the reference emulates it")
    p.add_argument("--sliding-megakernel", action="store_true", help="a model with sliding-window layers (Gemma 3) "
                   "gets its megakernels (compile_model's sliding_megakernel: the default on GPU targets; kept for "
                   "old commands)")
    p.add_argument("--prefill-gemm", choices=("f16", "q8"), default=None,
                   help="as compile's (q8 by default on CUDA with precision f16): q8 = 8-bit activations in the "
                   "GEMMs of more than 8 rows; the reference rounds those matmuls' inputs as the manifest's "
                   "kernels.prefill_gemm says")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="no oracle trace (7B and up: the float64 oracle needs ~8 bytes a weight, more than this "
                   "machine has); `run` then checks batched vs alone and megakernel vs per-op only")
    p.add_argument("--prefill-attention", choices=("flash", "wmma"), default="flash",
                   help="compile's: the prompt's attention kernels on CUDA (the reference is the same either way)")
    p.set_defaults(func=prepare)
    r = sub.add_parser("run", help="GPU machine: rebuild weights, check against the reference, time")
    r.add_argument("dir")
    r.add_argument("--gguf", help="the synthetic GGUF generated there (needed when weights.bin is absent)")
    r.add_argument("--out", help="also write the JSON result here")
    r.add_argument("--no-timing", action="store_true")
    r.add_argument("--served", action="store_true", help="also check `serve --deterministic`: 8 concurrent greedy "
                   "requests against each alone (batch invariance on this device)")
    r.add_argument("--tree-only", action="store_true", help="only the tree verify check (issue 39): a token tree on "
                   "the megakernel's rows against the per-op verify_tree and the oracle")
    r.set_defaults(func=run)
    k = sub.add_parser("gemm", help="GPU machine: a tuning bundle's default GEMMs against numpy, per batch branch")
    k.add_argument("bundle")
    k.add_argument("--rows", type=int, nargs="+", default=[4, 32, 512])
    k.add_argument("--all", action="store_true", help="every candidate of the bundle, not only the rule defaults")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out")
    k.set_defaults(func=check_gemms)
    ab = sub.add_parser("attention-build", help="build machine: prefill attention kernels (ours, TVM's) per shape")
    ab.add_argument("--dir", required=True)
    ab.add_argument("--target", default="sm_90")
    ab.add_argument("--shapes", nargs="*", help="h_kv,h_q,d each (default: ATTENTION_SHAPES)")
    ab.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                    help="the KV cache's type (float16: the GPU default; flash kernels take only it)")
    ab.add_argument("--tvm", action="store_true", help="also TVM's kernels (always with float32)")
    ab.set_defaults(func=build_attention)
    a = sub.add_parser("attention", help="GPU machine: prefill attention kernels against float64, then timed")
    a.add_argument("dir")
    a.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    a.add_argument("--chunk", type=int, default=2048, help="queries of a paged kernel's timed call (the last chunk)")
    a.add_argument("--long", type=int, default=32768, help="one causal sequence this long checked (sampled rows); 0: "
                                                           "none")
    a.add_argument("--number", type=int, default=10)
    a.add_argument("--repeat", type=int, default=5)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out")
    a.set_defaults(func=check_attention)
    g = sub.add_parser("gguf", help="GPU machine: only generate the synthetic GGUF of a prepared folder and its "
                                    "artifact's weights")
    g.add_argument("dir")
    g.add_argument("--gguf", required=True)
    g.set_defaults(func=make_gguf)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
