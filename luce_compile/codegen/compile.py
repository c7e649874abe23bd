"""The codegen stage: GGUF → graph → Relax module → tvm.compile for one target → artifact on disk.

Every step before writing can fail (an unsupported op, a type without a kernel); the artifact is written to a
temporary directory and renamed into place only when all of it succeeded. A content-addressed cache keyed by the
GGUF's sha256, the target and the compiler's own source makes a second compile of the same model instant.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from luce_runtime.contract import RuntimeContract
from luce_runtime.tokenizer import Tokenizer

import luce_compile
from luce_compile.artifact.writer import check_destination, move_into_place, write_artifact
from luce_compile.codegen.device_binaries import export_checked
from luce_compile.codegen.gpu_toolchain import gpu_toolchain
from luce_compile.codegen.pipeline import relax_pipeline
from luce_compile.errors import LuceError
from luce_compile.fuse.options import SLIDING_MEGAKERNEL
from luce_compile.gguf.reader import GGUFFile, read_gguf
from luce_compile.graph import build_graph
from luce_compile.graph.ir import Graph
from luce_compile.graph.rope_pairs import interleave_rope_pairs
from luce_compile.lower.attention_sinks import kv_head_dim
from luce_compile.lower.cpu_int8 import resolve_precision
from luce_compile.lower.kv_cache import kv_cache_dtype, resolve_kv_cache
from luce_compile.lower.moe import EXPERT_ATTR, GROUPED_ATTR, grouped_above
from luce_compile.lower.q8_gemm import check_prefill_gemm, is_q8_gemm
from luce_compile.lower.quant_layout import weight_planes
from luce_compile.lower.quant_matmul import GGML_TYPE_ATTR, TENSOR_CORE_TWIN
from luce_compile.lower.relax_model import (
    PLANE_SEP,
    LowerOptions,
    decode_attention_kernel,
    exported_functions,
    lower_graph,
    prefill_applies_window,
    prefill_attention_kernels,
)
from luce_compile.models import cache_dir
from luce_compile.targets import TargetInfo, get_target
from luce_compile.tune.records import Tuning, default_logs_dir

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
GPU_KINDS = ("cuda", "rocm")  # the TVM kinds whose artifacts carry decode megakernels (fuse/build.py)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def compiler_fingerprint() -> str:
    """A hash of the compiler's own source and TVM's version: a cached artifact is reused only by the same compiler."""
    import tvm

    digest = hashlib.sha256(tvm.__version__.encode())
    roots = [Path(luce_compile.__file__).parent, Path(luce_compile.__file__).parent.parent / "schedules"]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def compile_model(gguf_path: str | Path, target: str, out_dir: str | Path, *, use_cache: bool = True,
                  overwrite: bool = False, progress: Progress | None = None, precision: str = "auto",
                  tune_logs: Path | None = None, use_tune_logs: bool = True, megakernel: bool = True,
                  megakernel_q8: bool | None = None, megakernel_tf32: bool | None = None,
                  kv_cache: str = "auto", prefill_attention: str = "flash", prefill_gemm: str | None = None,
                  sliding_megakernel: bool | None = None) -> Path:
    """Compile a GGUF model for a target into an artifact directory at out_dir.

    An existing out_dir is replaced only if it is an artifact and `overwrite` is set (the CLI's --force); anything
    else there is refused before any work, so a user's folder is never deleted (artifact.writer.check_destination).
    `precision` is the decode matmuls' (LowerOptions.precision): "auto" takes llama.cpp's 8-bit activations and
    integer dot products where the CPU has them, "f32" the exact float32 kernels (oracle checks), "int8" insists.
    Tunable kernels take the knobs of their records in `tune_logs` (default: the shipped autotune_logs/; a target
    without records of its own takes the nearest measured target's), or their rule defaults with use_tune_logs off;
    nothing is searched here. The manifest's kernels.tuning says what each kernel got. On GPU targets the decode
    step is also built as megakernels (fuse/build.py; the engine runs them for batches up to 8), unless
    `megakernel` is off (--no-megakernel); the manifest's "megakernel" section says why a build has none.
    `megakernel_q8`: the megakernels' quantized matvecs (every type but F32/F16/BF16) take llama.cpp's 8-bit
    activations and integer dot products (MegakernelOptions.q8_activations); the per-op kernels keep float
    activations. `megakernel_tf32`: the megakernels' F16/BF16 matvecs run on tf32 tensor cores, their inputs rounded
    to tf32 (MegakernelOptions.float_mma; CUDA only). Both default (None) to on where the precision resolves to f16
    (CUDA's auto: the fast build, as llama.cpp's CUDA backend rounds by default) and off with f32, the exact build the
    oracle checks; the manifest's megakernel options record the choice. `kv_cache`: the KV cache's type (--kv-cache,
    lower/kv_cache.py: auto is f16 on a GPU's fast build (precision f16) and f32 otherwise), recorded as the
    manifest's kernels.kv_cache and the runtime contract's kv_dtype. `prefill_attention`: the prompt's attention
    kernels on CUDA with precision f16 (--prefill-attention, LowerOptions.prefill_attention: "flash" by default,
    "wmma" the earlier kernel), recorded per kernel as the manifest's kernels.prefill_attention.
    `sliding_megakernel`: a model with sliding-window layers (Gemma 3) gets decode megakernels too, and on every
    target the cache layout through which the runtime hands them TVM's pages (lower/kv_layers.py; a CPU build with
    it is how that layout is checked here); None: fuse/options.SLIDING_MEGAKERNEL on GPU targets with megakernels.
    `prefill_gemm`: the matmuls of more than 8 rows on CUDA with precision f16 (--prefill-gemm,
    LowerOptions.prefill_gemm): "q8" (llama.cpp's 8-bit activations on integer tensor cores, lower/q8_gemm.py, for
    the weight types it takes; other types keep float16) or "f16" (float16 operands for every type); None: q8 where
    it applies (CUDA with precision f16), as llama.cpp's MMQ prefills. Recorded with the types it served as the
    manifest's kernels.prefill_gemm.
    """
    say = progress or (lambda _msg: None)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_destination(out_dir, overwrite)  # before minutes of work, and again when the result is moved into place
    info = get_target(target)
    for flag, on, kinds, which in (("--megakernel-q8", megakernel_q8, GPU_KINDS, "GPU"),
                                   ("--megakernel-tf32", megakernel_tf32, ("cuda",), "CUDA")):
        if on and (info.kind not in kinds or not megakernel):
            raise LuceError(f"compile: {flag} changes the decode megakernels, which only {which} targets build; "
                            f"{info.name}{'' if megakernel else ' with --no-megakernel'} has none. Drop the flag.")
    precision = resolve_precision(precision, info.tvm_target())  # refuses int8 where it cannot run, before work
    fast = precision == "f16"  # the GPU's default build: the megakernels round as llama.cpp's CUDA kernels do
    if prefill_gemm is None:  # the 8B Q4_K_M on the H100: pp512 6,828 -> 8,641 tok/s, 1.12x llama.cpp (2026-12-07)
        prefill_gemm = "q8" if fast and info.kind == "cuda" else "f16"
    if check_prefill_gemm(prefill_gemm) != "f16" and not (fast and info.kind == "cuda"):
        raise LuceError(f"compile: --prefill-gemm {prefill_gemm} changes the tensor-core GEMM of the matmuls of more "
                        f"than 8 rows, which only CUDA targets with precision f16 have; {info.name} with precision "
                        f"{precision} has none. Drop the flag or use --precision f16 on a CUDA target.")
    say("hashing the model")
    gguf_sha = file_sha256(gguf_path)
    kv_cache = resolve_kv_cache(kv_cache, info.kind in GPU_KINDS and precision == "f16")
    kv_cache_dtype(kv_cache)  # refuses a KV cache type that is not built, before work
    megakernel_q8 = fast if megakernel_q8 is None else megakernel_q8
    megakernel_tf32 = (fast and info.kind == "cuda") if megakernel_tf32 is None else megakernel_tf32
    if sliding_megakernel is None:  # GPU builds by default; a CPU build asks for the layout (how it is checked here)
        sliding_megakernel = SLIDING_MEGAKERNEL and info.kind in GPU_KINDS and megakernel
    tuning = load_tuning(info, tune_logs, use_tune_logs)
    # the records are part of the key: new records (or --no-tune-logs) make a new build, never a stale reuse
    key = (f"{gguf_sha[:24]}-{info.name}-{precision}-{compiler_fingerprint()}-{tuning.digest()}"
           f"{'' if megakernel or info.kind not in GPU_KINDS else '-nomk'}"
           f"{'-mkq8' if megakernel and megakernel_q8 and info.kind in GPU_KINDS else ''}"
           f"{'-mktf32' if megakernel and megakernel_tf32 and info.kind == 'cuda' else ''}"
           f"{'' if kv_cache == 'f32' else f'-kv{kv_cache}'}"
           f"{'' if prefill_attention == 'flash' else f'-pa{prefill_attention}'}"
           f"{'' if prefill_gemm == 'f16' else f'-pg{prefill_gemm}'}"
           f"{'-mksw' if sliding_megakernel else ''}")
    cached = cache_dir() / "artifacts" / key
    if use_cache and (cached / "manifest.json").is_file():
        say(f"reusing the cached build {cached}")
        try:
            say(_cached_summary(cached))
            _copy_tree(cached, out_dir, overwrite)  # out_dir changes only once the whole copy is in place
            os.utime(cached)  # the cache keeps the most recently used builds (_prune)
            return out_dir
        except OSError as e:  # another compile pruned it meanwhile (seen with two compiles sharing the cache)
            say(f"the cached build went away while it was copied ({e.__class__.__name__}); building it again")
    gguf = read_gguf(gguf_path)
    graph = build_graph(gguf)  # refuses unsupported models before any work
    if info.kind in GPU_KINDS and megakernel:  # NEOX pairs as neighbours: the megakernel's q/k tiles split heads
        graph = interleave_rope_pairs(graph)
    # the runtime must load the tokenizer the artifact carries (a pre-tokenizer it lacks, as Kimi K2's kimi-k2, would
    # otherwise be refused only when the finished artifact is loaded): refused here, in ~0.1 s
    Tokenizer.from_metadata(_tokenizer_metadata(gguf))
    lower = LowerOptions(precision=precision, kv_cache=kv_cache, prefill_attention=prefill_attention,
                         prefill_gemm=prefill_gemm, probe_sliding_pages=sliding_megakernel)
    built = _build(gguf, graph, info, gguf_sha, say, lower, tuning, megakernel, megakernel_q8, megakernel_tf32)
    try:
        # out_dir's copy first, from the private build (a concurrent compile may prune the cache at any time);
        # then the build itself moves into the cache (ours: a stale entry is replaced): written twice, not three times
        _copy_tree(built, out_dir, overwrite, move=not use_cache)
        if use_cache:
            _copy_tree(built, cached, overwrite=True, move=True)
            _prune(cached.parent, keep=KEEP_CACHED)
    finally:
        shutil.rmtree(built.parent, ignore_errors=True)  # the mkdtemp work folder _build made
    return out_dir


def load_tuning(info: TargetInfo, tune_logs: Path | None, use_tune_logs: bool) -> Tuning:
    """The records a build takes knobs from: tune_logs (must exist when given), else the shipped logs when present."""
    if not use_tune_logs:
        return Tuning.load(info.name, None)
    if tune_logs is None:
        shipped = default_logs_dir()
        return Tuning.load(info.name, shipped if shipped.is_dir() else None)
    return Tuning.load(info.name, Path(tune_logs))


def _cached_summary(cached: Path) -> str:
    import json

    tuning = json.loads((cached / "manifest.json").read_text())["kernels"].get("tuning")
    if not tuning:
        return "kernels: built before tuning records were reported"
    # the words of Tuning.summary, which a fresh build prints: a reused build reads the same
    if not tuning["files"]:
        return f"kernels: 0 tuned (no tuning logs), {tuning['default']} with rule defaults (the cached build's)"
    return (f"kernels: {tuning['tuned']} tuned from {', '.join(tuning['files'])}, {tuning['default']} with rule "
            "defaults (the cached build's)")


def _build(gguf: GGUFFile, graph: Graph, info: TargetInfo, gguf_sha: str, say: Progress,
           options: LowerOptions, tuning: Tuning | None = None, megakernel: bool = True,
           megakernel_q8: bool = False, megakernel_tf32: bool = False) -> Path:
    import tvm

    target = info.tvm_target()
    kv_dtype = kv_cache_dtype(options.kv_cache)
    say(f"lowering {len(graph.ops)} ops")
    mod, params = lower_graph(graph, target, options)
    say(f"compiling for {info.name} ({target.kind.name})")
    start = time.perf_counter()
    # GPU targets: a stand-in libcuda / nvcc fatbin hook / lld + device libraries, so real binaries get embedded
    with gpu_toolchain(info.kind, info.archs, info.name), target:
        executable = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target, tuning=tuning))
    compile_s = time.perf_counter() - start
    log.info("tvm.compile took %.1f s", compile_s)
    if tuning is not None:
        say(tuning.summary())
    work = Path(tempfile.mkdtemp(prefix="luce-build-"))
    library = work / "model.so"
    binaries = export_checked(executable, info, library)  # refuses a GPU library without real device binaries
    extra_files: dict[str, Path] = {}
    megakernel_fields: dict = {}  # the manifest's "megakernel" section: GPU targets only
    if info.kind in GPU_KINDS and megakernel:
        from luce_compile.fuse.build import artifact_megakernels

        say("generating the decode megakernels")
        megakernel_fields["megakernel"], extra_files = artifact_megakernels(graph, info.name, work, kv_dtype,
                                                                            q8_activations=megakernel_q8,
                                                                            float_mma=megakernel_tf32,
                                                                            sliding=options.probe_sliding_pages)
    elif info.kind in GPU_KINDS:
        megakernel_fields["megakernel"] = {"skipped": "built with --no-megakernel"}
    say("writing the artifact (weights repacked into kernel planes)")
    c = graph.config
    kv_head = kv_head_dim(c) if c.attn_sinks else 0  # the cache's rows, where wider than the head (attention sinks)
    contract = RuntimeContract(kv_dtype=kv_dtype, kv_head_dim=kv_head,
                               sliding_prefill_chunks=prefill_applies_window(
                                   target, kv_head or c.head_dim, kv_head or c.head_dim_v, kv_dtype,
                                   sinks=bool(c.attn_sinks)),
                               functions=tuple(str(f) for f in exported_functions(options.precision)))
    manifest = {
        "source": {"file_name": gguf.path.name, "gguf_sha256": gguf_sha, "size": gguf.path.stat().st_size},
        "config": graph.config.to_dict(),
        "target": _target_fields(info, target),
        "kernels": {"module": "model.so", "functions": list(contract.functions), "compile_seconds": round(compile_s, 2),
                    "precision": options.precision, "kv_cache": options.kv_cache,
                    "prefill_attention": {"choice": options.prefill_attention, **prefill_attention_kernels(
                        target, options.precision, options.prefill_attention, kv_head or c.head_dim,
                        kv_head or c.head_dim_v, kv_dtype)},
                    "decode_attention": decode_attention_kernel(
                        target, options.precision, c.attn_sinks, c.n_head // c.n_head_kv, kv_head or c.head_dim,
                        kv_dtype),
                    "prefill_gemm": prefill_gemm_record(mod, options),
                    "rope_rows_interleaved": bool(graph.row_pairs),  # graph/rope_pairs.py
                    **({"tuning": tuning.to_manifest()} if tuning else {}),
                    **({"device_binaries": binaries.to_manifest()} if binaries else {})},
        "runtime": contract.to_manifest(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **megakernel_fields,
    }
    return write_artifact(work / "artifact", manifest_fields=manifest, weights=_weights(gguf, params, graph.row_pairs),
                          export_fn=lambda path: shutil.copyfile(library, path),
                          tokenizer_metadata=_tokenizer_metadata(gguf), extra_files=extra_files)


def prefill_gemm_record(mod, options: LowerOptions) -> dict:  # noqa: ANN001  (the lowered tvm.IRModule)
    """The manifest's kernels.prefill_gemm: the choice, and the weight types whose matmuls of more than 8 rows take
    the 8-bit GEMM, read from the lowered module (the others keep the float16 one): what an oracle reference for the
    build must emulate (scripts/device_check.py prepare)."""
    from tvm.tirx import PrimFunc

    q8 = sorted({str(f.attrs[TENSOR_CORE_TWIN].attrs[GGML_TYPE_ATTR]) for _, f in mod.functions_items()
                 if is_q8_gemm(f)})
    record = {"choice": options.prefill_gemm, "q8_types": q8}
    # mixture of experts: the expert matmuls with the grouped 8-bit GEMM, which takes their calls of more than
    # moe_above_rows sorted rows (lower/moe.grouped_above)
    grouped = [f for _, f in mod.functions_items() if isinstance(f, PrimFunc) and f.attrs
               and GROUPED_ATTR in f.attrs]
    if grouped:
        record["moe_q8_types"] = sorted({str(f.attrs[EXPERT_ATTR]) for f in grouped})
        record["moe_above_rows"] = grouped_above(int(grouped[0].attrs[GROUPED_ATTR][0]))
    return record


def _target_fields(info: TargetInfo, target) -> dict:
    from luce_compile.targets import host_cpu

    fields = {"name": info.name, "kind": info.kind, "tvm_target": _plain(target.export())}
    if info.kind == "llvm":
        fields["host_cpu"] = host_cpu()
    return fields


def _plain(value):
    """TVM containers (Map, Array) → JSON-ready Python values."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return [_plain(v) for v in value]


def _weights(gguf: GGUFFile, params: list[tuple[str, tuple[int, ...], str]],
             row_pairs: dict[str, int]) -> Iterator[tuple[str, np.ndarray, dict]]:
    """Each parameter, in the order the VM functions take them: a plane of a repacked GGUF tensor, its rows
    reordered where the graph's are (graph/rope_pairs.py; the param's "row_pairs" says so to device_check)."""
    planes_of: dict[str, dict[str, np.ndarray]] = {}
    for name, shape, dtype in params:
        tensor, plane = name.split(PLANE_SEP)
        info = gguf.tensor(tensor)
        if tensor not in planes_of:  # repack once per tensor; the planes of one tensor are consecutive
            planes_of.clear()
            planes_of[tensor] = weight_planes(gguf.raw(tensor), info.ggml_type, len(info.shape),
                                              row_pairs.get(tensor, 0))
        array = planes_of[tensor][plane].reshape(shape)
        if str(array.dtype) != dtype:
            raise AssertionError(f"plane {name} is {array.dtype}, the kernel expects {dtype}")
        meta = {"source_tensor": tensor, "ggml_type": info.ggml_type.name, "plane": plane}
        yield name, array, meta | ({"row_pairs": row_pairs[tensor]} if tensor in row_pairs else {})


def _tokenizer_metadata(gguf: GGUFFile) -> dict:
    # llama.cpp sets some special-token attributes by model name, so the name travels with the tokenizer keys; the
    # model's recommended sampling (general.sampling.*) too: serve applies it to requests that set none
    return {k: v for k, v in gguf.metadata.items()
            if k.startswith(("tokenizer.", "general.sampling.")) or k in ("general.name", "general.architecture")}


KEEP_CACHED = 24  # artifacts kept in the build cache (each is roughly the size of its GGUF)


def _prune(folder: Path, keep: int) -> None:
    """Drop all but the `keep` most recently written or reused cached builds."""
    entries = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _copy_tree(src: Path, dst: Path, overwrite: bool, move: bool = False) -> None:
    """Copy an artifact to dst through a fresh sibling folder swapped into place: an interrupted copy never leaves
    half an artifact at dst, and nothing at dst is deleted unless the guard allows it. `move`: src is not needed
    after, so it is renamed there where both share a file system (a 17 GB artifact is not written twice), and
    copied only across file systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        tmp = staging / dst.name
        if move:
            shutil.move(src, tmp)
        else:
            shutil.copytree(src, tmp)
        move_into_place(tmp, dst, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
