"""Check and time the GPU expert matmuls (schedules/gpu/moe.py) on the GPU machine, runtime-only there.

  prepare (here):  python scripts/moe_gemm_check.py prepare [--dir .gpucheck/moe-gemm]
      builds each case's expert matmul as the model build does (lower/moe.expert_matmul with the grouped form,
      scheduled by ExpertGEMV: the gathered GEMV up to grouped_above rows, the grouped 8-bit GEMM above) for sm_90
      into <dir>/<case>.so, and for the checked cases random stacked weights (the project's quantizer, repacked as the
      build repacks), routing and activations with the expected outputs (<case>.npz):
        grouped rows  mmq_blocks.emulate of each expert's rows: the kernel's own arithmetic, held bit for bit
        GEMV rows     float64 on the dequantized weights, held to checks.REL_TOL_GEMV (float32 sums)
  run (there):     python scripts/moe_gemm_check.py run [--dir .gpucheck/moe-gemm] [--out $OUT/moe-gemm.json]
      runs every case against its expected outputs, then times the timed cases (Qwen3-30B-A3B's expert shapes at a
      512-token prompt, random bytes as weights) with CUDA events: microseconds a call and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "runtime"))


# (case, type, experts, n_out, n_in, gather, tokens, used): checked against expected outputs (prompts of 40 tokens
# and of 6: above and at or below grouped_above(8) = 32 rows)
CHECKED = (("q4k_gate", "Q4_K", 8, 192, 512, True, 40, 3), ("q6k_down", "Q6_K", 8, 256, 512, False, 40, 3),
           ("q80_gate", "Q8_0", 8, 64, 256, True, 40, 2), ("iq4xs_gate", "IQ4_XS", 8, 128, 512, True, 40, 3),
           ("q3k_gate", "Q3_K", 8, 128, 512, True, 40, 3), ("q2k_down", "Q2_K", 8, 128, 512, False, 40, 3),
           ("mxfp4_gate", "MXFP4", 8, 128, 512, True, 40, 3), ("q4k_decode", "Q4_K", 8, 192, 512, True, 6, 3))
# Qwen3-30B-A3B's expert matmuls at a 512-token prompt (128 experts, 8 used): gate/up (768 x 2048, gathered) and
# down (2048 x 768); gpt-oss-20b's (32 experts, 4 used, MXFP4: 2880 x 2880 each); timed only
TIMED = (("a3b_gate", "Q4_K", 128, 768, 2048, True, 512, 8), ("a3b_down_q4k", "Q4_K", 128, 2048, 768, False, 512, 8),
         ("a3b_down_q6k", "Q6_K", 128, 2048, 768, False, 512, 8),
         ("oss20b_gate", "MXFP4", 32, 2880, 2880, True, 512, 4))
# prepare --tiles M,N ...: each timed case's grouped kernel alone at these tiles too (<case>_m<M>n<N>), to time
# against the dispatched function's default


def routed_rows(rng: np.random.Generator, tokens: int, used: int, n_expert: int,
                absent: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The sort's result for random routing (expert `absent` never chosen where there are more than `used` + 1
    experts: a tile's absent expert): experts (P,) ascending, tokens (P,)."""
    choices = [e for e in range(n_expert) if e != absent or n_expert <= used + 1]
    ids = np.stack([rng.choice(choices, used, replace=False) for _ in range(tokens)]).reshape(-1).astype(np.int32)
    order = np.argsort(ids, kind="stable")
    return ids[order], (order // used).astype(np.int32)


def random_raw(qtype: str, rows: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF rows of a type through the project's quantizer (small, checked cases)."""
    from gguf import GGMLQuantizationType

    from luce_compile.gguf.quants import quantize

    w = (rng.standard_normal((rows, n_in)) * 0.05).astype(np.float32)
    return quantize(w, GGMLQuantizationType[qtype]).reshape(rows, -1)


def prepare(args: argparse.Namespace) -> int:
    import tvm
    from gguf import GGMLQuantizationType
    from luce_schedules.gpu import mmq_blocks
    from luce_schedules.gpu.moe import ExpertGEMV, grouped_mmq_gemm

    from luce_compile.codegen.gpu_toolchain import gpu_toolchain
    from luce_compile.gguf.quants import dequantize
    from luce_compile.lower.moe import expert_matmul, grouped_above
    from luce_compile.lower.quant_layout import repack
    from luce_compile.targets import get_target

    info = get_target(args.target)
    target = info.tvm_target()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    index = []
    variants = [(c[0] + f"_m{m}n{n}", *c[1:], (m, n)) for c in TIMED for m, n in args.tiles]
    for checked, cases in ((True, CHECKED), (False, TIMED), (False, variants)):
        for name, qtype, n_expert, n_out, n_in, gather, tokens, used, *tile in cases:
            if tile:  # the grouped kernel alone, at this tile
                main = grouped_mmq_gemm(qtype, n_expert, n_out, n_in, gather, tile_m=tile[0][0], tile_n=tile[0][1])
            else:
                func = expert_matmul(GGMLQuantizationType[qtype], n_expert, n_out, n_in, gather, name, grouped=True)
                with target:
                    (dispatched,) = ExpertGEMV().apply(func, target)
                main = dispatched.mod["main"]
            with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
                built = tvm.compile(tvm.IRModule({name: main.with_attr("global_symbol", name)}), target=target)
            built.export_library(str(out / f"{name}.so"))
            entry = {"case": name, "type": qtype, "experts": n_expert, "n_out": n_out, "n_in": n_in, "gather": gather,
                     "tokens": tokens, "used": used, "checked": checked,
                     "grouped": tokens * used > grouped_above(n_expert),
                     "scratch": [[list(shape), dtype] for shape, dtype in
                                 _scratch_specs(qtype, n_in)]}
            if checked:
                raw = random_raw(qtype, n_expert * n_out, n_in, rng)
                planes = repack(raw, qtype)
                experts, rows_token = routed_rows(rng, tokens, used, n_expert)
                x = (rng.standard_normal((tokens if gather else len(experts), n_in))
                     * 2.0 ** rng.integers(-4, 4, (1, n_in // 32)).repeat(32, axis=1)).astype(np.float32)
                rows_x = x[rows_token] if gather else x
                if entry["grouped"]:
                    want = np.zeros((len(experts), n_out), np.float32)
                    for e in sorted(set(experts.tolist())):
                        mine = experts == e
                        sub = {k: v[e * n_out:(e + 1) * n_out] for k, v in planes.items()}
                        want[mine] = mmq_blocks.emulate(qtype, sub, rows_x[mine])
                else:
                    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n_expert, n_out, n_in)
                    want = np.einsum("pk,pnk->pn", rows_x.astype(np.float64), w[experts].astype(np.float64))
                np.savez(out / f"{name}.npz", x=x, experts=experts, tokens=rows_token, want=want,
                         plane_names=np.array(list(planes)), **{f"plane_{k}": v for k, v in planes.items()})
            index.append(entry)
            print(json.dumps(entry), flush=True)
    (out / "index.json").write_text(json.dumps({"target": args.target, "cases": index}, indent=1))
    return 0


def _scratch_specs(qtype: str, n_in: int) -> list[tuple[tuple, str]]:
    """(columns per row, dtype) of the quantized input's scratch arguments (lower/q8_gemm.scratch_specs)."""
    from luce_compile.lower.q8_gemm import q8_gemm_format, scratch_specs

    return [((shape[1],), dtype) for shape, dtype in scratch_specs(q8_gemm_format(qtype), n_in).values()]


def _timed_inputs(c: dict, rng: np.random.Generator) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """Random stacked weights with trained weights' scales (synthetic_blocks: any type, its scales finite, none
    subnormal), routing and activations of a timed case."""
    from gguf import GGMLQuantizationType

    from luce_compile.lower.quant_layout import repack
    from luce_compile.synthetic_blocks import random_blocks

    qtype = GGMLQuantizationType[c["type"]]
    raw = random_blocks(rng, qtype, (c["experts"] * c["n_out"], c["n_in"]), std=0.02)
    experts, rows_token = routed_rows(rng, c["tokens"], c["used"], c["experts"])
    x = rng.standard_normal((c["tokens"] if c["gather"] else len(experts), c["n_in"])).astype(np.float32)
    return repack(raw, qtype), experts, rows_token, x


def run(args: argparse.Namespace) -> int:
    from device_check import _load_runtime

    from luce_compile.checks import REL_TOL_GEMV, rel_err

    _load_runtime()
    import tvm

    folder = Path(args.dir)
    index = json.loads((folder / "index.json").read_text())
    device = tvm.cuda(0)
    rng = np.random.default_rng(args.seed)
    results, inputs = [], {}  # a timed shape's random inputs, shared by its tile variants
    for c in index["cases"]:
        fn = tvm.runtime.load_module(str((folder / f"{c['case']}.so").resolve()))[c["case"]]
        if c["checked"]:
            npz = np.load(folder / f"{c['case']}.npz")
            planes = {str(k): npz[f"plane_{k}"] for k in npz["plane_names"]}
            x, experts, rows_token, want = npz["x"], npz["experts"], npz["tokens"], npz["want"]
        else:
            shape = tuple(c[k] for k in ("type", "experts", "n_out", "n_in", "gather", "tokens", "used"))
            if shape not in inputs:
                inputs[shape] = _timed_inputs(c, rng)
            planes, experts, rows_token, x = inputs[shape]
            want = None
        dev = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), device)  # noqa: E731
        y = dev(np.zeros((len(experts), c["n_out"]), np.float32))
        args_ = [dev(x), dev(experts), *([dev(rows_token)] if c["gather"] else []),
                 *(dev(p) for p in planes.values()), y,
                 *(dev(np.zeros((x.shape[0], *shape), dtype)) for shape, dtype in c["scratch"])]
        fn(*args_)
        device.sync()
        row = {k: c[k] for k in ("case", "type", "experts", "n_out", "n_in", "gather", "tokens", "used", "grouped")}
        row["rows"] = len(experts)
        if want is not None:
            got = y.numpy()
            if c["grouped"]:
                row["mismatches"] = int((got != want).sum())
                row["max_abs_diff"] = float(np.abs(got - want).max())
                row["ok"] = row["mismatches"] == 0
            else:
                row["rel_err"] = rel_err(got, want)
                row["ok"] = row["rel_err"] <= REL_TOL_GEMV
        else:
            for _ in range(3):
                fn(*args_)
            device.sync()
            start = time.perf_counter()
            for _ in range(args.repeat):
                fn(*args_)
            device.sync()
            us = (time.perf_counter() - start) / args.repeat * 1e6
            row["us_per_call"] = round(us, 1)
            row["tflops"] = round(2 * len(experts) * c["n_out"] * c["n_in"] / us / 1e6, 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("ok", True) for r in results) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    a = sub.add_parser("prepare", help="build machine: the cases' kernels and expected outputs")
    a.add_argument("--dir", default=str(ROOT / ".gpucheck" / "moe-gemm"))
    a.add_argument("--target", default="sm_90")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--tiles", nargs="*", default=[], type=lambda v: tuple(int(x) for x in v.split(",")),
                   metavar="M,N", help="also each timed case's grouped kernel alone at these tiles")
    a.set_defaults(func=prepare)
    r = sub.add_parser("run", help="GPU machine: each case against its expected outputs, then the timed cases")
    r.add_argument("--dir", default=str(ROOT / ".gpucheck" / "moe-gemm"))
    r.add_argument("--out")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--repeat", type=int, default=20)
    r.set_defaults(func=run)
    args = p.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
