"""Prepare the H200 benchmark here (the build machine): everything `benchmarks/h200/run.sh` needs on the GPU machine.

    .venv/bin/python benchmarks/h200/prepare.py [--dir .gpucheck/h200] [--workloads smollm2-135m llama-1b-body ...]

Writes, under --dir (one folder to carry, < 64 MiB):
  <workload>/   the sm_90 artifact without weights.bin, the oracle's reference logits and spec.json
                (scripts/device_check.py prepare); weights and the GGUF are regenerated there from the spec;
  bundle/       the TVM runtime files and the wheels the GPU machine lacks (apache-tvm-ffi, gguf);
  peer/llama.cpp.tgz  llama.cpp's source, trimmed to the CUDA backend, from the llama-cpp-python sdist: peer code
                is fetched at benchmark time and never committed.
Then one device call: `bash benchmarks/h200/run.sh` with carry [".gpucheck/h200"] (the script's header says more).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers.llama_server import extract_llama_cpp, find_sdist  # noqa: E402  (the same sdist the CPU peers build)

WORKLOADS = ("smollm2-135m", "llama-1b-body", "llama-1b-body-bf16", "qwen3-0.6b")
# llama.cpp's tree less what a CUDA build of llama-bench never compiles (~7.6 MB left as .tgz)
KEEP = ("CMakeLists.txt", "cmake", "ggml", "src", "include", "common", "tools", "vendor", "licenses", "app", "LICENSE")
DROP_BACKENDS = ("cann", "et", "hexagon", "metal", "musa", "opencl", "openvino", "sycl", "virtgpu", "vulkan", "webgpu",
                 "zdnn", "zendnn", "hip", "rpc", "blas", "kompute", "cpu/kleidiai", "cpu/spacemit")


def pack_llama_cpp(src: Path, out: Path) -> Path:
    dropped = tuple(f"llama.cpp/ggml/src/ggml-{b}" for b in DROP_BACKENDS)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if info.name.startswith(dropped) or "/.git" in info.name else info

    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for name in KEEP:
            if (src / name).exists():
                tar.add(src / name, arcname=f"llama.cpp/{name}", filter=keep)
    return out


def prepare_untuned(workloads: list[str], target: str, out: Path) -> int:
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    for w in workloads:
        artifact = compile_model(cached_synthetic(w), target, out / w / "artifact", overwrite=True,
                                 use_tune_logs=False)
        (artifact / "weights.bin").unlink()  # the tuned artifact's, copied there (run.sh)
        print(f"{w}: {artifact}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=ROOT / ".gpucheck" / "h200")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--target", default="sm_90")
    p.add_argument("--work", type=Path, default=Path("/tmp/luce-h200-prepare"), help="where llama.cpp is unpacked")
    p.add_argument("--untuned", type=Path, help="only compile each workload without the tuning logs into this folder "
                   "(run.sh's UNTUNED: tuned vs untuned in one run); artifacts only, no reference, no weights")
    p.add_argument("--no-megakernel", action="store_true", help="compile the workloads without decode megakernels "
                   "(device_check.py prepare --no-megakernel)")
    p.add_argument("--precision", choices=("auto", "f32"), default="auto", help="compile's: auto is the default "
                   "build (tensor-core prefill, the megakernels' 8-bit and tf32 matvecs), f32 the exact one; the "
                   "references round as the build does (device_check.py prepare reads the manifest)")
    p.add_argument("--no-reference", action="store_true", help="no oracle reference (7B and up: the float64 "
                   "oracle does not fit this machine; device_check prepare --no-reference)")
    p.add_argument("--sliding-megakernel", action="store_true", help="models with sliding-window layers (gemma3-270m) "
                   "get their megakernels (device_check.py prepare --sliding-megakernel): the default on GPU targets, "
                   "kept for old commands")
    p.add_argument("--prefill-gemm", choices=("f16", "q8"), default=None, help="compile's (q8 by default): q8 = "
                   "llama.cpp's 8-bit activations in the GEMMs above 8 rows (schedules/gpu/mmq_gemm.py); the "
                   "references round as the build does")
    p.add_argument("--megakernel-q8", action="store_true", help="an alias kept for old commands: the default build "
                   "has it")
    p.add_argument("--megakernel-tf32", action="store_true", help="an alias kept for old commands: the default "
                   "build has it")
    p.add_argument("--prefill-attention", choices=("flash", "wmma"), default="flash",
                   help="compile's (device_check.py prepare --prefill-attention)")
    args = p.parse_args()
    if args.untuned:
        return prepare_untuned(args.workloads, args.target, args.untuned)
    args.work.mkdir(parents=True, exist_ok=True)
    for i, w in enumerate(args.workloads):
        # 32 prompt tokens and 16 decode steps keep each reference small (17 rows of the 49152-token vocabulary)
        bundle = ["--bundle", str(args.dir / "bundle")] if i == 0 else []
        subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "prepare", "--preset", w,
                        "--target", args.target, "--dir", str(args.dir / w), "--prompt-len", "32", "--steps", "16",
                        "--precision", args.precision, *bundle,
                        *(["--prefill-gemm", args.prefill_gemm] if args.prefill_gemm else []),
                        *(["--no-megakernel"] if args.no_megakernel else []),
                        # a 7B and up: not kept in the build cache too (an 8B Q8_0's weights are 8.7 GB, rebuilt on
                        # the device from the GGUF anyway; the cache's copy ran this disk full, 2026-12-07)
                        *(["--no-reference", "--no-cache"] if args.no_reference else []),
                        *(["--sliding-megakernel"] if args.sliding_megakernel else []),
                        *(["--megakernel-q8"] if args.megakernel_q8 else []),
                        *(["--megakernel-tf32"] if args.megakernel_tf32 else []),
                        "--prefill-attention", args.prefill_attention], check=True)
    tgz = pack_llama_cpp(extract_llama_cpp(find_sdist(), args.work), args.dir / "peer" / "llama.cpp.tgz")
    size = sum(f.stat().st_size for f in args.dir.rglob("*") if f.is_file())
    print(f"{args.dir}: {size / 2**20:.1f} MiB to carry (llama.cpp {tgz.stat().st_size / 2**20:.1f} MiB)")
    if size > 60 * 2**20:
        print("warning: the device tool carries at most 64 MiB per call; drop a workload", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
