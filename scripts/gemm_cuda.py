"""The CUDA source TVM generates for one prefill GEMM (the tensor-core twin of lower/quant_matmul.py, scheduled by
schedules/gpu/tensor_gemm.py), with a count of the instructions that matter, so a schedule change can be judged
by reading, before any GPU time is spent (benchmarks/README.md, "Prefill GEMM: what the WMMA kernel does").

    .venv/bin/python scripts/gemm_cuda.py Q4_1 2048 8192 [--knobs '{"warps_m": 2}'] [-o gemm.cu]

Prints the source's counts (WMMA calls, 16-byte and scalar weight loads, 64-bit index arithmetic,
__syncthreads) and writes the source itself with -o. Needs no GPU, but nvcc (the CUDA toolkit), as every sm_* build
does: the source is read from the compiled module.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import tvm
from luce_schedules.gpu.tensor_gemm import TensorCoreGEMM

from luce_compile.codegen.device_binaries import device_sources
from luce_compile.codegen.gpu_toolchain import gpu_toolchain
from luce_compile.lower.quant_matmul import quant_matmul
from luce_compile.targets import get_target


def gemm_source(qtype: str, n_out: int, n_in: int, knobs: dict[str, int] | None = None,
                target_name: str = "sm_90") -> str:
    """The generated CUDA of the float16 twin of quant_matmul(qtype, n_out, n_in) with the rule's knobs."""
    info = get_target(target_name)
    target = info.tvm_target()
    twin = quant_matmul(qtype, n_out, n_in, compute_dtype="float16")
    sch = TensorCoreGEMM().apply(twin, target, knobs)
    if sch is None:
        raise SystemExit(f"gemm_cuda: the tensor-core rule declines {qtype} {n_out}x{n_in} with knobs {knobs}")
    with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
        built = tvm.compile(sch.mod, target=target)
    return "\n".join(source for kind, source in device_sources(built) if kind == "cuda")


def counts(source: str) -> dict[str, int]:
    """What a reader checks first in a GEMM's source (text counts of the generated code, not executed counts)."""
    return {
        "wmma mma_sync": source.count("wmma::mma_sync"),
        "wmma load_matrix_sync": source.count("wmma::load_matrix_sync"),
        "uint4/float4 loads from weights or x":
            len(re.findall(r"\*\((?:uint4|float4)\*\)\((?:qs|x|w|d|m)_ptr", source)),
        "scalar plane loads gathered into vectors (make_half4/make_uint4 of loads)":
            len(re.findall(r"make_(?:half4|uint4)\((?:qs|d|m|w|sc|mn|qh)_ptr", source)),
        "int64 index expressions": source.count("(int64_t)"),
        "__syncthreads": source.count("__syncthreads"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("qtype", help="GGML weight type (Q4_1, Q8_0, BF16, Q4_K, ...)")
    p.add_argument("n_out", type=int)
    p.add_argument("n_in", type=int)
    p.add_argument("--knobs", default=None, help="tensor_gemm knobs as JSON (the rule's defaults otherwise)")
    p.add_argument("--target", default="sm_90")
    p.add_argument("-o", "--out", type=Path, help="write the CUDA source here")
    args = p.parse_args(argv)
    source = gemm_source(args.qtype, args.n_out, args.n_in, json.loads(args.knobs) if args.knobs else None,
                         args.target)
    if args.out:
        args.out.write_text(source)
    for name, value in counts(source).items():
        print(f"{value:8d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
