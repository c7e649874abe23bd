"""The H200 prefill GEMM table (issue 12): each benchmark workload's matmuls above the low-batch buckets (prefill,
verify), every tensor-core candidate of gpu.quant_gemm (the hand mma.sync kernel at each tile, dlight's WMMA
tile) timed at 512 and 2048 rows, as TFLOPS beside the rule default; and every weight type's default kernel checked
against float64 numpy with the float16 operand rounding emulated (scripts/device_check.py gemm --all).

    .venv/bin/python benchmarks/h200/gemm_table.py prepare          (here: .gpucheck/tune/gemm-512, gemm-2048, a
                                                                     bundle each, and gemm-types for the check)
    device call, carry [".gpucheck/tune", ".gpucheck/h200/bundle"]:
        BUNDLES="gemm-512 gemm-2048" bash benchmarks/h200/tune.sh;
        python3 scripts/device_check.py gemm .gpucheck/tune/gemm-types --all --out $OUT/gemm-check.json
        (PYTHONPATH as tune.sh sets it)
    .venv/bin/python benchmarks/h200/gemm_table.py report <files_at>   (here: results/h200/<date>-gemm.md)

The 8-bit GEMM beside the float16 one (--prefill-gemm q8, schedules/gpu/mmq_gemm.py; benchmarks/README.md, "An 8-bit
prefill GEMM"): `prepare --part llama-3.1-8b --q8 --q8-types --trials 1` adds, for each matmul of the part, its q8
function (named ..._q8) beside the float16 one, both at their rule defaults, and gemm-q8-types, every type mmq_gemm
takes for the check (device_check gemm ... --rows 4 32 512 2048).

FLOPs = 2 · rows · n_out · n_in; each candidate the median of tune_bench's timing (inputs rotated past the L2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import write_results  # noqa: E402  (benchmarks/report.py: the JSON and markdown of a table)

# (workload, weight type, [(n_out, n_in)]): the distinct prefill matmuls of the four benchmark workloads
WORKLOADS = (
    ("llama-1b-body", "Q4_1", ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192))),
    ("llama-1b-body-bf16", "BF16", ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192))),
    ("smollm2-135m", "Q4_1", ((576, 576), (192, 576), (1536, 576), (576, 1536))),
    ("qwen3-0.6b", "Q8_0", ((2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072))),
    # issue 36: the Llama-3.1-8B Q4_K_M mix's matmuls (q/o, k/v, gate/up, down), in both of its types
    ("llama-3.1-8b", "Q4_K", ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))),
    ("llama-3.1-8b", "Q6_K", ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))),
)
Q8_SUFFIX = "_q8"  # the 8-bit GEMM's function of a matmul (lower/q8_gemm.q8_gemm_matmul)
CHECK_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
CHECK_SHAPE = (1000, 2048)  # n_out not a multiple of any tile: the clamped edge is checked too
ROWS = (512, 2048)
TUNE = ROOT / ".gpucheck" / "tune"


def function_name(ggml_type: str, n_out: int, n_in: int) -> str:
    return f"gemm_{ggml_type.lower()}_{n_out}x{n_in}"


def _module(kernels: list[tuple[str, int, int]], q8: bool = False, f16: bool = True):
    """The float16 tensor-core form of each matmul (f16) and, with q8, its 8-bit form where mmq_gemm takes the type."""
    import tvm

    from luce_compile.lower.q8_gemm import q8_gemm_format, q8_gemm_matmul
    from luce_compile.lower.quant_matmul import quant_matmul, with_tensor_core_twin

    funcs = {}
    for t, n, k in kernels:
        name = function_name(t, n, k)
        if f16:
            funcs[name] = with_tensor_core_twin(quant_matmul(t, n, k, name=name), t, n, k)
        if q8 and q8_gemm_format(t) is not None:
            funcs[name + Q8_SUFFIX] = q8_gemm_matmul(t, n, k, name=name + Q8_SUFFIX)
    return tvm.IRModule(funcs)


def prepare(args: argparse.Namespace) -> int:
    """One bundle per --part of WORKLOADS at the first of ROWS (two parts build in parallel on two cores), a copy of
    each at the other row counts (the same libraries), and gemm-types (every type's default kernel, for the check)."""
    from luce_compile.targets import get_target
    from luce_compile.tune.bundle import build_bundle, bundle_at_extents
    from luce_compile.tune.workloads import find_workloads

    info = get_target("sm_90")
    target = info.tvm_target()
    for part in args.part:
        names = [n for n in part.split(",") if n]
        timed = sorted({(t, n, k) for w, t, shapes in WORKLOADS if w in names or not names for n, k in shapes})
        stem = f"gemm-{'-'.join(names) or 'all'}"
        workloads = [w for w in find_workloads(_module(timed, q8=args.q8), target, info.name)
                     if w.rule == "gpu.quant_gemm"]
        index = build_bundle(workloads, info, f"{stem}-{ROWS[0]}", TUNE / f"{stem}-{ROWS[0]}", trials=args.trials,
                             logs_dir=Path(args.logs), extents={"batch": ROWS[0]}, progress=print)
        print(f"{stem}-{ROWS[0]}: {len(workloads)} GEMMs, {len(index['candidates'])} candidates")
        for rows in ROWS[1:]:
            bundle_at_extents(TUNE / f"{stem}-{ROWS[0]}", TUNE / f"{stem}-{rows}", {"batch": rows}, f"{stem}-{rows}")
    if args.types:
        checked = [(t, *CHECK_SHAPE) for t in CHECK_TYPES]
        workloads = [w for w in find_workloads(_module(checked), target, info.name) if w.rule == "gpu.quant_gemm"]
        index = build_bundle(workloads, info, "gemm-types", TUNE / "gemm-types", trials=1, logs_dir=Path(args.logs),
                             progress=print)
        print(f"gemm-types: {len(workloads)} GEMMs, {len(index['candidates'])} candidates")
    if args.q8_types:  # every type of the 8-bit GEMM, for device_check gemm (rows past the tile and 1000 features)
        checked = [(t, *CHECK_SHAPE) for t in CHECK_TYPES]
        workloads = [w for w in find_workloads(_module(checked, q8=True, f16=False), target, info.name)
                     if w.rule == "gpu.quant_gemm"]
        index = build_bundle(workloads, info, "gemm-q8-types", TUNE / "gemm-q8-types", trials=1,
                             logs_dir=Path(args.logs), progress=print)
        print(f"gemm-q8-types: {len(workloads)} GEMMs, {len(index['candidates'])} candidates")
    return 0


def _kernel_label(knobs: dict, function: str = "") -> str:
    if knobs.get("kernel", 1) == 0:
        return "WMMA (dlight tile)"
    tile = "x".join(str(knobs.get(k) or "auto") for k in ("tile_m", "tile_n", "tile_k"))
    return f"mmq int8 {tile}" if function.endswith(Q8_SUFFIX) else f"mma.sync f16 {tile}"


def report(args: argparse.Namespace) -> int:
    from luce_runtime.tune_bench import RESULTS_FORMAT, read_versioned

    run = Path(args.run)
    lines, doc = [], {"rows": []}
    files = sorted(p for p in run.glob("tune-gemm-*.json") if p.stem.rsplit("-", 1)[1].isdigit())
    if not files:
        raise SystemExit(f"gemm_table: no tune-gemm-*-<rows>.json in {run}; pass the fetched $OUT.")
    for path in files:
        rows = int(path.stem.rsplit("-", 1)[1])
        results = read_versioned(path, RESULTS_FORMAT, "", f"{path} is not a tune_bench results file.")
        doc.update(date=results.get("date") or results.get("created"), device=results.get("device"))
        for r in results["results"]:
            fn = r["key"].split("|")[2]
            n_out, n_in = (int(v) for v in fn.removesuffix(Q8_SUFFIX).rsplit("_", 1)[1].split("x"))
            us = r.get("time_us")
            doc["rows"].append({"function": fn, "rows": rows, "knobs": r["knobs"], "default": r["default"],
                                "time_us": us, "tflops": 2 * rows * n_out * n_in / us / 1e6 if us else None,
                                "error": r.get("error")})
    check_path = run / "gemm-check.json"
    checks = json.loads(check_path.read_text()) if check_path.exists() else []
    lines += [f"# H200 prefill GEMM table (issue 12): tensor-core candidates of gpu.quant_gemm ({doc['date']})", "",
              f"{doc['device']}. Command: `benchmarks/h200/gemm_table.py prepare; BUNDLES=\"gemm-512 gemm-2048\" "
              "bash benchmarks/h200/tune.sh; gemm_table.py report`. TFLOPS = 2·rows·n_out·n_in over the median "
              "time (luce_runtime.tune_bench: inputs rotated past the L2). `default` marks the rule default.", ""]
    for workload, t, shapes in WORKLOADS:
        lines += [f"## {workload} ({t})", "", "| n_out × n_in | rows | kernel | µs | TFLOPS |", "|---|---|---|---|---|"]
        for n, k in shapes:
            fn = function_name(t, n, k)
            for rows in ROWS:
                cands = sorted((r for r in doc["rows"] if r["function"] in (fn, fn + Q8_SUFFIX) and r["rows"] == rows
                                and r["time_us"]), key=lambda r: r["time_us"])
                for r in cands:
                    mark = " (default)" if r["default"] else ""
                    lines.append(f"| {n} × {k} | {rows} | {_kernel_label(r['knobs'], r['function'])}{mark} | "
                                 f"{r['time_us']:.1f} | {r['tflops']:.0f} |")
        lines.append("")
    if checks:
        lines += ["## Every weight type's default kernel against float64 (float16 operands emulated)", "",
                  "| function | rows | rel. error vs float16-operand float64 | vs plain float64 |", "|---|---|---|---|"]
        lines += [f"| {c['function']} | {c['rows']} | {c['vs_half']:.2e} | {c['vs_plain']:.2e} |"
                  for c in checks if "vs_half" in c]
    q8_checks = json.loads((run / "gemm-q8-check.json").read_text()) if (run / "gemm-q8-check.json").exists() else []
    if q8_checks:
        lines += ["", "## The 8-bit GEMM against float64 with its activations' 8-bit rounding emulated", "",
                  "| function | rows | rel. error vs 8-bit-rounded float64 | vs plain float64 | ok |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c['function']} | {c['rows']} | {c['vs_q8']:.2e} | {c['vs_plain']:.2e} | {c['ok']} |"
                  for c in q8_checks]
        checks = checks + q8_checks
    write_results(Path(args.out) / f"{str(doc['date'])[:10]}-gemm", doc | {"checks": checks}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare", help="build the GEMM bundles here")
    a.add_argument("--trials", type=int, default=40, help="candidates per GEMM (the whole space: 2 × 3 × 2 × 2)")
    a.add_argument("--part", nargs="+", default=[""], help="comma-separated workloads per bundle (default: all)")
    a.add_argument("--types", action="store_true", help="also gemm-types, every type's default for the check")
    a.add_argument("--q8", action="store_true", help="each matmul's 8-bit GEMM too (--prefill-gemm q8), beside it")
    a.add_argument("--q8-types", action="store_true", help="also gemm-q8-types: the 8-bit GEMM of every type it "
                   "takes, for device_check gemm")
    a.add_argument("--logs", default=str(ROOT / "autotune_logs"), help="trials already timed are left out")
    a.set_defaults(func=prepare)
    b = sub.add_parser("report", help="the table from what the device call brought back")
    b.add_argument("run", help="the fetched $OUT (tune-gemm-*.json, gemm-check.json)")
    b.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "h200"))
    b.set_defaults(func=report)
    args = p.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
