"""The H200 table from one device call of benchmarks/h200/run.sh: JSON, markdown and PNG under benchmarks/results/.

    .venv/bin/python benchmarks/h200/report.py RUN_OUT_DIR [RUN_OUT_DIR2] [--out benchmarks/results] [--command ..]

RUN_OUT_DIR is the call's $OUT as fetched here: gpu.csv, versions.txt and one folder per workload with check.json
(luce-compile vs the float64 oracle), ours.json (python -m luce_runtime.bench), torch.json
(benchmarks/peers/torch_peer.py), llama_bench.json (llama-bench -o json) and llama_batched.txt (llama-batched-bench
--output-format jsonl).

Every engine's row has the same metrics: decode tok/s at batch 1 and batch 8 (after a 512-token prompt), prefill
tok/s of 512 and 2048 tokens, and the fraction of the memory roofline at batch 1: bytes the engine's weights occupy
per decoded token (its own format: the GGUF's blocks for luce-compile and llama.cpp, bf16 for torch) over the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from luce_runtime.bench import roofline_tok_s, weight_bytes_per_token  # noqa: E402
from report import beside, write_results  # noqa: E402

OURS = "luce-compile"
BUILD_BEFORE_TUNING = "untuned, float32 activations"  # what runs before 2026-12-01 measured (no precision recorded)
WORKLOADS = ("smollm2-135m", "llama-1b-body", "llama-1b-body-bf16", "qwen3-0.6b")
ENGINES = (OURS, "llama.cpp", "torch")
PER_OP = "luce-compile per-op"  # the same artifact decoding without its megakernel (run.sh PEROP=1), when timed
METRICS = ("decode_b1", "decode_b8", "prefill_512", "prefill_2048")
RETURNS_IDS = ("each luce-compile decode step returns the next greedy ids, what a greedy caller gets: the megakernel's "
               "argmax on the device, the per-op path's on the host from its logits); llama.cpp by llama-bench's own "
               "timer. ")
METRIC_NAMES = {"decode_b1": "decode b=1", "decode_b8": "decode b=8", "prefill_512": "pp512", "prefill_2048": "pp2048"}


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() and path.stat().st_size else None


def ours_row(d: dict[str, Any]) -> dict[str, Any]:
    """luce_runtime.bench's BenchResult (prompt 512, batch 8, extra prefill 2048) → the table's metrics."""
    by_len = d.get("extra", {}).get("prefill_tok_s_by_len", {})
    return {"decode_b1": d["decode_tok_s"], "decode_b8": d["decode_batch_tok_s"] if d["batch"] == 8 else None,
            "prefill_512": d["prefill_tok_s"] if d["prompt_len"] == 512 else by_len.get("512"),
            "prefill_2048": by_len.get("2048"), "weight_bytes_per_token": d["weight_bytes_per_token"],
            "bandwidth_gb_s": d["bandwidth_gb_s"], "ttft_ms_512": d["ttft_ms"]} | (
                {"decode_path": d["extra"]["decode_path"]} if "decode_path" in d.get("extra", {}) else {})


def torch_row(d: dict[str, Any]) -> dict[str, Any]:
    return {"decode_b1": d["decode_tok_s"].get("1"), "decode_b8": d["decode_tok_s"].get("8"),
            "prefill_512": d["prefill_tok_s"].get("512"), "prefill_2048": d["prefill_tok_s"].get("2048"),
            "weight_bytes_per_token": d["weight_bytes_per_token"], "bandwidth_gb_s": d["bandwidth_gb_s"]}


def bench_rate(entry: dict[str, Any]) -> float:
    """A llama-bench record's tokens/s: the median of its samples (its mean carries a slow first sample)."""
    return statistics.median(entry["samples_ts"]) if entry.get("samples_ts") else entry["avg_ts"]


def llama_cpp_row(bench: list[dict[str, Any]] | None, batched: str | None, bytes_per_token: int | None) -> dict:
    """llama-bench's pp512/pp2048/tg128 (bench_rate: the median of its repetitions, as ours), and
    llama-batched-bench's S_TG at 1 and 8 parallel sequences (one run each): llama-bench's tg128 is the batch-1
    decode, batched-bench's pl=8 row the batch-8 one."""
    row: dict[str, Any] = {m: None for m in METRICS}
    for entry in bench or []:
        value = bench_rate(entry)
        if entry.get("n_gen") == 0 and entry.get("n_prompt") in (512, 2048):
            row[f"prefill_{entry['n_prompt']}"] = value
            row[f"prefill_{entry['n_prompt']}_mean"] = entry["avg_ts"]
        elif entry.get("n_prompt") == 0 and entry.get("n_gen"):
            row["decode_b1"] = value
            row["decode_b1_mean"] = entry["avg_ts"]
        row["model_size"] = entry.get("model_size")
    for line in (batched or "").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            row[f"batched_tg_b{entry['pl']}"] = entry["speed_tg"]
            if entry["pl"] == 8:
                row["decode_b8"] = entry["speed_tg"]
    row["weight_bytes_per_token"] = bytes_per_token or row.get("model_size")
    return row


def gguf_bytes_per_token(preset: str) -> int | None:
    """The synthetic GGUF's tensor bytes one decode step reads (an untied embedding table: one row), read from the
    copy this machine generated when preparing the run (the same bytes: run.sh checks the sha256)."""
    try:
        from luce_compile.gguf.reader import read_gguf
        from luce_compile.synthetic import PRESETS, cached_synthetic
    except ImportError:
        return None
    if preset not in PRESETS:  # not a synthetic workload: llama-bench's model_size (every tensor) stands in
        return None
    tensors = read_gguf(cached_synthetic(preset)).tensors.values()
    spec = PRESETS[preset]
    return weight_bytes_per_token([{"source_tensor": t.name, "nbytes": t.nbytes} for t in tensors], spec.tied_output,
                                  spec.n_expert, spec.n_expert_used)


def collect(*runs: Path) -> dict[str, Any]:
    """Every workload folder of the given run outputs. With several runs (a run split over device calls, or a
    re-measure of some engines after a change), each engine's row comes from the last run that measured it, and
    says which run that was (`run`: the index in `runs`)."""
    workloads: dict[str, Any] = {}
    order = {name: i for i, name in enumerate(WORKLOADS)}  # the issue's order; anything else after, by name
    for index, run in enumerate(runs):
        folders = sorted((p for p in run.iterdir() if p.is_dir() and (p / "ours.json").exists()),
                         key=lambda p: (order.get(p.name, len(order)), p.name))
        for folder in folders:
            w = workloads.setdefault(folder.name, {"engines": {}, "check": None, "weights": None})
            for engine, row in _engine_rows(folder).items():
                w["engines"][engine] = row | {"run": index}
            profile = _load(folder / "profile.json")
            if profile:
                w["profile"] = profile
            check = _load(folder / "check.json")
            if check:
                w["check"], w["weights"] = check.get("checks"), check.get("weights")
                if check.get("oracle"):  # device_check's word for a check it did not run (a model too large)
                    w["oracle_not_run"] = check["oracle"]
    for w in workloads.values():  # every table row in the same engine order
        w["engines"] = {e: w["engines"].get(e, {"error": "not run"}) for e in ENGINES} | (
            {PER_OP: w["engines"][PER_OP]} if PER_OP in w["engines"] else {})
    bandwidths = [e["bandwidth_gb_s"] for w in workloads.values() for e in w["engines"].values()
                  if e.get("bandwidth_gb_s")]
    bandwidth = statistics.median_high(bandwidths) if bandwidths else None
    for w in workloads.values():
        for e in w["engines"].values():
            if "error" not in e and bandwidth and e.get("weight_bytes_per_token") and e.get("decode_b1"):
                e["roofline_tok_s"] = roofline_tok_s(bandwidth, e["weight_bytes_per_token"])
                e["roofline_fraction"] = e["decode_b1"] / e["roofline_tok_s"]
    replays = [r for r in (_load(run / "spec-replay.json") for run in runs) if r]
    return {"workloads": workloads, "bandwidth_gb_s": bandwidth, "bandwidths_measured_gb_s": bandwidths} | (
        {"spec_replay": replays[-1]} if replays else {})


def long_rows(folder: Path) -> dict[str, dict[str, Any]]:
    """run.sh LONG=N: each engine's prefill of an N-token prompt (`prefill_N`) and decode of one sequence at depth
    N (`decode_b1_ctxN`); ours from bench --prompt-len N (its TTFT prompt and the decode after it), llama.cpp's
    from llama-bench -p N -n 0 and -p 0 -n 32 -d N (bench_rate, as the table's)."""
    rows: dict[str, dict[str, Any]] = {}
    ours = _load(folder / "ours-long.json")
    if ours:
        n = ours["prompt_len"]
        rows[OURS] = {f"prefill_{n}": ours["prefill_tok_s"], f"decode_b1_ctx{n}": ours["decode_tok_s"]}
    elif (folder / "ours-long.err").is_file():
        rows[OURS] = {"long_error": (folder / "ours-long.err").read_text()[-2000:]}
    for name in ("llama_long_prefill.json", "llama_long_decode.json"):
        for entry in _load(folder / name) or []:
            value = bench_rate(entry)
            if entry.get("n_gen") == 0 and entry.get("n_prompt"):
                rows.setdefault("llama.cpp", {})[f"prefill_{entry['n_prompt']}"] = value
            elif entry.get("n_gen") and entry.get("n_depth"):
                rows.setdefault("llama.cpp", {})[f"decode_b1_ctx{entry['n_depth']}"] = value
    return rows


def _engine_rows(folder: Path) -> dict[str, dict[str, Any]]:
    """The engines this folder holds results (or errors) for; an engine with no files in it was not run there."""
    rows: dict[str, dict[str, Any]] = {}
    ours = _load(folder / "ours.json")
    rows[OURS] = ours_row(ours) if ours else {"error": (folder / "ours.err").read_text()[-2000:]}
    if (folder / "ours-perop.json").is_file():
        per_op = _load(folder / "ours-perop.json")
        rows[PER_OP] = ours_row(per_op) if per_op else {"error": (folder / "ours-perop.err").read_text()[-2000:]}
    if (folder / "llama_bench.json").is_file():
        batched = (folder / "llama_batched.txt").read_text() if (folder / "llama_batched.txt").is_file() else None
        rows["llama.cpp"] = llama_cpp_row(_load(folder / "llama_bench.json"), batched,
                                          gguf_bytes_per_token(folder.name))
    if (folder / "torch.json").is_file() or (folder / "torch.log").is_file():
        torch_d = _load(folder / "torch.json")
        rows["torch"] = torch_row(torch_d) if torch_d else {"error": (folder / "torch.log").read_text()[-2000:]}
    for engine, extra in long_rows(folder).items():
        if engine in rows and "error" not in rows[engine]:
            rows[engine] |= extra
    return rows


def ratio(ours: dict[str, Any], peer: dict[str, Any], metric: str) -> float | None:
    a, b = ours.get(metric), peer.get(metric)
    return a / b if a and b else None


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return format(v, spec) if v is not None else "n/a"


def gpu_label(meta: dict[str, Any]) -> str:
    """The GPU the run measured on, short ("H100", "H200"), from nvidia-smi's name in gpu.csv: the device tool lends
    either, and a table must not call an H100 run "H200"."""
    name = str(meta.get("gpu", "")).split(",")[0]
    return next((w for w in name.replace("NVIDIA", "").split() if w[:1].isalpha() and any(c.isdigit() for c in w)),
                name.strip() or "GPU")


def markdown(doc: dict[str, Any]) -> str:
    meta, res = doc["meta"], doc["results"]
    runs = meta.get("runs", [])
    same = "same run" if len(runs) <= 1 else f"{len(runs)} runs on the same machine kind"
    lines = [f"# {gpu_label(meta)}: luce-compile vs llama.cpp CUDA vs torch, {same} ({meta['date']})", "",
             f"{meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}); llama.cpp as vendored by "
             f"llama-cpp-python {meta['llama_cpp_python']} (built there: CUDA arch 90, FA on, f16 KV); "
             f"luce-compile {meta['luce_compile']} (TVM {meta['tvm']}, {meta.get('build', BUILD_BEFORE_TUNING)}, "
             + ("decode of 1-8 sequences in one generated megakernel a step; prefill and the per-op row's decode: "
                "CUDA graphs per layer)." if _megakernel_decoded(res) else "CUDA graphs per layer)."), "",
             f"Command: `{meta['command']}`", "",
             "Synthetic random-weight GGUFs at the real shapes (speed does not depend on the values), the same file "
             "for all three engines. Decode after a 512-token prompt; b=8 is the aggregate of 8 sequences. torch "
             "runs bf16 weights dequantized from the same GGUF (static KV cache, the whole decode step in one CUDA "
             "graph; prefill: the better of eager and one replayed CUDA graph per prompt). luce-compile and torch are "
             "timed alike (luce_runtime.timing: host wall-clock, the GPU synchronized around each call; "
             + (RETURNS_IDS if _records_decode_path(res) else "luce-compile's calls return their logits, what a "
                "caller sees); llama.cpp by llama-bench's own timer. ") +
             "% roofline: decode b=1 over (bandwidth / the engine's weight bytes per "
             "token), bandwidth = "
             f"{_fmt(res['bandwidth_gb_s'], ',.0f')} GB/s measured in this run (device copy, read + write).", "",
             "| workload | engine | MiB/token | decode b=1 tok/s | % roofline | decode b=8 tok/s | pp512 tok/s | "
             "pp2048 tok/s | ours / peer (b=1, b=8, pp512, pp2048) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if len(runs) > 1:  # rows say which run measured them
        lines[-3:-3] = ["", "Runs: " + "; ".join(f"run {i + 1}: {r}" for i, r in enumerate(runs))
                        + ". Each engine's row comes from the last run that measured it."]
    for name, w in res["workloads"].items():
        ours = w["engines"][OURS]
        for engine, e in w["engines"].items():
            if "error" in e:  # an engine the run skipped (run.sh LLAMA_CPP=0) says so; a failure points to the JSON
                said = "not run" if e["error"] == "not run" else "error: see the JSON"
                lines.append(f"| {name} | {engine} | {said} | | | | | | |")
                continue
            ratios = "" if engine == OURS or "error" in ours else ", ".join(
                _fmt(ratio(ours, e, m), ".2f") + "×" for m in METRICS)
            mib = e["weight_bytes_per_token"] / 2**20 if e.get("weight_bytes_per_token") else None
            roof = 100 * e["roofline_fraction"] if e.get("roofline_fraction") else None
            label = f"{engine} (run {e['run'] + 1})" if len(runs) > 1 else engine
            lines.append(f"| {name} | {label} | {_fmt(mib, '.1f')} | {_fmt(e['decode_b1'])} | {_fmt(roof, '.1f')}% | "
                         f"{_fmt(e['decode_b8'])} | {_fmt(e['prefill_512'])} | {_fmt(e['prefill_2048'])} | "
                         f"{ratios} |")
    sizes = sorted({n for w in res["workloads"].values() for n in _batched_sizes(w.get("check"))})
    with_paths = any("megakernel_vs_per_op" in (w.get("check") or {}) for w in res["workloads"].values())
    masked = any("device_ids_masked" in ((w.get("check") or {}).get("megakernel_vs_per_op") or {})
                 for w in res["workloads"].values())  # records from before device masks keep their header
    lines += ["", "luce-compile's correctness in the run that timed it (scripts/device_check.py: prefill + decode "
              "steps teacher-forced against the float64 oracle's logits; "
              f"{', '.join(map(str, sizes)) or 'n/a'} sequences decoded together vs each alone):", "",
              "| workload | max rel. err vs oracle | greedy ids checked / mismatched | batched vs alone | "
              + ("megakernel vs per-op decode (max rel. diff; ids differing; device argmax ids differing"
                 + (", of them under a random token mask" if masked else "") + ") | "
                 if with_paths else "") + "ok |",
              "|---|---|---|---|---|" + ("---|" if with_paths else "")]
    for name, w in res["workloads"].items():
        c = w.get("check") or {}
        o, b, m = c.get("oracle", {}), c.get("batched", {}), c.get("megakernel_vs_per_op")
        # a model too large for the oracle (prepare --no-reference) passes on the checks it ran
        ok = bool((o.get("ok") or "oracle" not in c and w.get("oracle_not_run")) and b.get("ok")
                  and (m is None or m.get("ok")))
        paths = "not run" if m is None else (
            f"{_fmt(m.get('max_rel_diff'), '.1e')}; {m.get('ids_mismatched')} of {m.get('ids_checked')}; "
            f"{m.get('device_ids_mismatched', 'n/a')} of {m.get('device_ids', 'n/a')}"
            + (f" ({m['device_ids_masked']} masked)" if m.get("device_ids_masked") else ""))
        lines.append(f"| {name} | {_fmt(o.get('max_rel_err'), '.1e')} | {o.get('ids_checked', 'n/a')} / "
                     f"{len(o.get('ids_mismatched', [])) if o else 'n/a'} | {_fmt(b.get('max_rel_diff'), '.1e')} | "
                     + (f"{paths} | " if with_paths else "") + f"{'yes' if ok else 'NO'} |")
    lines += _long_lines(res["workloads"])
    lines += _profile_lines(res["workloads"])
    lines += spec_replay_lines(res.get("spec_replay"))
    return "\n".join(lines) + "\n"


def long_lengths(row: dict[str, Any]) -> set[int]:
    """The long-context lengths an engine's row holds: its decode_b1_ctxN keys and its prefill_N past pp2048."""
    decode = {int(k.removeprefix("decode_b1_ctx")) for k in row if k.startswith("decode_b1_ctx")}
    prefill = {int(k.removeprefix("prefill_")) for k in row if re.fullmatch(r"prefill_\d+", k)}
    return decode | {n for n in prefill if n > 2048}


def _long_lines(workloads: dict[str, Any]) -> list[str]:
    """The long-context section (run.sh LONG=N): prefill of an N-token prompt and decode at depth N, per engine."""
    rows = []
    for name, w in workloads.items():
        ours = w["engines"][OURS]
        for engine, e in w["engines"].items():
            for n in sorted(long_lengths(e)):
                pre, dec = f"prefill_{n}", f"decode_b1_ctx{n}"
                vs = "" if engine == OURS else ", ".join(_fmt(ratio(ours, e, m), ".2f") + "×" for m in (pre, dec))
                rows.append(f"| {name} | {engine} | {n:,} | {_fmt(e.get(pre))} | {_fmt(e.get(dec), ',.1f')} | {vs} |")
    if not rows:
        return []
    return ["", "Long context (run.sh LONG=N, one sequence): prefill of an N-token prompt in one call, then decode at "
            "depth N (ours: bench --prompt-len N, its KV cache as built; llama.cpp: llama-bench -fa 1 -p N, "
            "and -d N -n 32, its f16 KV cache):", "",
            "| workload | engine | tokens | prefill tok/s | decode b=1 tok/s at depth | "
            "ours / peer (prefill, decode) |",
            "|---|---|---|---|---|---|", *rows]


def spec_replay_lines(replay: dict[str, Any] | None) -> list[str]:
    """benchmarks/h200/spec_replay.py's verify costs and replayed speed-ups (issue 14)."""
    if not replay:
        return []
    t, d = replay["target"], replay["draft"]
    lines = ["", "Speculative decoding replayed (benchmarks/h200/spec_replay.py): the pair's shapes, each step's "
             "drafted and accepted counts from the CPU run's trace. Verify of S rows of one sequence after a "
             f"{t['context']}-token prompt, against one greedy decode step (target: {replay['target_decode_path']}; "
             f"draft: {replay['draft_decode_path']}):", "",
             "| S rows | target verify ms | × a target decode step | draft verify ms |", "|---|---|---|---|",
             f"| decode step | {t['decode_ms']:.3f} | 1.00 | {d['decode_ms']:.3f} |"]
    for rows, ms in t["verify_ms"].items():
        lines.append(f"| {rows} | {ms:.3f} | {ms / t['decode_ms']:.2f} | {d['verify_ms'][rows]:.3f} |")
    if "verify_ids_equal_decode" in t:  # replays since 2026-12-04
        lines += [""] + [f"{who}: a verify's {e['rows']} greedy ids equal decoding the same tokens one by one at "
                         f"{e['equal']} of {e['rows']} rows."
                         for who, e in (("Target", t["verify_ids_equal_decode"]),
                                        ("Draft", d["verify_ids_equal_decode"]))]
    lines += ["", "| task | drafter | prompts | tokens | plain tok/s | speculative tok/s | speed-up | tokens per "
              "target step |", "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in replay["rows"]:
        for name, r in row["drafters"].items():
            groups.setdefault((row["task"], name), []).append(r)
    for (task, name), rs in groups.items():
        tokens, plain_s, spec_s = (sum(r[k] for r in rs) for k in ("tokens", "plain_s", "s"))
        steps, accepted = sum(r["steps"] for r in rs), sum(r["accepted"] for r in rs)
        lines.append(f"| {task} | {name} | {len(rs)} | {tokens} | {tokens / plain_s:,.0f} | {tokens / spec_s:,.0f} | "
                     f"{plain_s / spec_s:.2f}× | {(accepted + steps) / steps if steps else 0:.2f} |")
    return lines + tree_position_lines(replay.get("tasks", []))


def tree_position_lines(tasks: list[dict[str, Any]]) -> list[str]:
    """The replayed token trees' acceptance per position (spec_replay.py's `positions`, issue 39): at each depth
    after the pending token, the chain's tokens and the siblings accepted of those proposed."""
    trees = [t for t in tasks if t.get("positions")]
    if not trees:
        return []
    lines = ["", "Token trees replayed (the draft tree's steps: the trace's tree shape, its accepted path through the "
             "chain or a sibling): accepted / proposed at each depth after the pending token.", "",
             "| task | drafter | tree steps | steps replayed exactly | depth | chain | siblings |",
             "|---|---|---|---|---|---|---|"]
    for t in trees:
        for d, pos in enumerate(t["positions"]):
            (ca, cp), (sa, sp) = pos["chain"], pos["sibling"]
            lines.append(f"| {t['task']} | {t['drafter']} | {t['tree_steps']} | {t['replayed']} / {t['steps']} | {d} | "
                         f"{ca} / {cp} | {sa} / {sp} |")
    return lines


def _records_decode_path(res: dict[str, Any]) -> bool:
    """Runs since the megakernel went into the engine record each row's decode path; their decode steps return
    greedy ids (bench_engine's Engine.decode_greedy), earlier ones the logits."""
    return any("decode_path" in e for w in res["workloads"].values() for e in w["engines"].values())


def _megakernel_decoded(res: dict[str, Any]) -> bool:
    return any(str(w["engines"][OURS].get("decode_path", "")).startswith("megakernel")
               for w in res["workloads"].values())


def _profile_lines(workloads: dict[str, Any]) -> list[str]:
    """The megakernel's device time a step beside the host's (benchmarks/h200/engine_profile.py), and where one
    step's time goes: the opcodes by their share of the SMs' busy time."""
    profiled = {n: w["profile"] for n, w in workloads.items() if w.get("profile")}
    if not profiled:
        return []
    lines = ["", "The megakernel's decode step (benchmarks/h200/engine_profile.py, after a "
             f"{next(iter(profiled.values()))['context']}-token prompt): host = wall clock of Engine.decode_greedy, "
             "device = the kernel's span in its own task clocks (GPU global timer); per SM, the mean time in task "
             "bodies and in dependency waits; the opcodes taking most body time (tasks × mean body):", "",
             "| workload | b | host µs/step | device µs/step | host − device | per SM: bodies / waits µs | "
             "top opcodes (tasks × body µs) |", "|---|---|---|---|---|---|---|"]
    for name, prof in profiled.items():
        for b, r in prof["batches"].items():
            s = r["profile"]
            top = sorted(s["opcodes"].items(), key=lambda kv: -kv[1]["tasks"] * kv[1]["body_us"])[:3]
            tops = "; ".join(f"{k}: {v['tasks']} × {v['body_us']:.1f}" for k, v in top)
            lines.append(f"| {name} | {b} | {r['host_us_per_step']:,.1f} | {r['device_us_per_step']:,.1f} | "
                         f"{r['host_us_per_step'] - r['device_us_per_step']:,.1f} | {s['mean_sm_body_us']:,.1f} / "
                         f"{s['mean_sm_wait_us']:,.1f} | {tops} |")
    return lines


def _batched_sizes(check: dict[str, Any] | None) -> list[int]:
    sequences = ((check or {}).get("batched") or {}).get("sequences", [])
    return sequences if isinstance(sequences, list) else [sequences]


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt
    from plot import grouped_bars, save

    res = doc["results"]
    names = list(res["workloads"])
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))
    for ax, metric in zip(axes, METRICS, strict=False):
        series = {e: [res["workloads"][n]["engines"][e].get(metric) or 0.0 for n in names] for e in ENGINES}
        grouped_bars(ax, names, series, f"{METRIC_NAMES[metric]} tok/s")
    series = {e: [100 * (res["workloads"][n]["engines"][e].get("roofline_fraction") or 0.0) for n in names]
              for e in ENGINES}
    grouped_bars(axes[4], names, series, "decode b=1, % of memory roofline", "{:.1f}")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=15)
    meta = doc["meta"]
    runs = len(meta.get("runs", [])) or 1
    fig.suptitle(f"{gpu_label(meta)}, {'one run' if runs == 1 else f'{runs} runs'} ({meta['date'][:16]}): "
                 "luce-compile "
                 f"({meta.get('build', BUILD_BEFORE_TUNING)}) vs llama.cpp CUDA vs torch bf16", fontsize=9)
    return save(fig, out)


def build_description(*runs: Path) -> str:
    """How the measured artifacts were built, from the checks' specs (device_check prepare records the precision;
    its tuning summary, where the run has one)."""
    specs = [_load(f / "check.json") or {"spec": _load(f / "spec.json") or {}} for run in runs
             for f in sorted(run.iterdir()) if (f / "check.json").is_file() or (f / "spec.json").is_file()]
    precisions = sorted({(s or {}).get("spec", {}).get("precision", "f32") for s in specs})
    tuned = [s["tuning"] for s in specs if s and s.get("tuning")]
    words = {"f16": "float16 tensor-core GEMMs above 8 rows, float32 elsewhere", "f32": "float32 activations"}
    text = "; ".join(words.get(p, p) for p in precisions)
    if tuned:
        text += f"; {sum(t['tuned'] for t in tuned)} kernels tuned, {sum(t['default'] for t in tuned)} default"
    # the default build's since 2026-12-06 (the flags' names kept: test_records reads the tolerance from them)
    if any((s or {}).get("spec", {}).get("megakernel_q8") for s in specs):
        text += "; the megakernels' quantized matvecs with llama.cpp's 8-bit activations (--megakernel-q8)"
    if any((s or {}).get("spec", {}).get("megakernel_tf32") for s in specs):
        text += "; the megakernels' F16/BF16 matvecs on tf32 tensor cores (--megakernel-tf32)"
    if any((s or {}).get("spec", {}).get("prefill_gemm") == "q8" for s in specs):
        text += "; llama.cpp's 8-bit activations in the GEMMs above 8 rows, integer tensor cores (--prefill-gemm q8)"
    kv = sorted({(s or {}).get("spec", {}).get("kv_cache") for s in specs} - {None})
    if kv:
        text += f"; KV cache {', '.join(kv)}"
    return text


def _run_label(run: Path) -> str:
    """The run's date and luce-compile commit: run.sh's date.txt; before it wrote one, its first check's clock,
    else the time its commit.txt was written there (the tarball keeps it)."""
    date = next((json.loads((d / "check.json").read_text())["environment"]["date"]
                 for d in sorted(run.iterdir()) if (d / "check.json").is_file()), None)
    if (run / "date.txt").is_file():
        date = (run / "date.txt").read_text().strip()
    elif date is None and (run / "commit.txt").is_file():
        date = datetime.fromtimestamp((run / "commit.txt").stat().st_mtime, UTC).isoformat(timespec="seconds")
    commit = (run / "commit.txt").read_text().strip() if (run / "commit.txt").is_file() else ""
    return f"{date or '?'} {commit}".strip()


def tuned_vs_untuned(runs: tuple[Path, ...], stem: Path, command: str) -> str:
    """Each workload's artifact compiled with the tuning logs (ours.json) and without (ours-untuned.json), timed one
    after the other in the same call (run.sh with UNTUNED=...): markdown and JSON at `stem`."""
    rows = {}
    for run in runs:
        for folder in sorted(f for f in run.iterdir() if (f / "ours-untuned.json").is_file()):
            rows[folder.name] = {kind: ours_row(d) if (d := _load(folder / name)) else {}
                                 for kind, name in (("tuned", "ours.json"), ("untuned", "ours-untuned.json"))}
    if not rows:
        raise SystemExit("report: no workload has ours-untuned.json (run.sh with UNTUNED=...)")
    doc = {"meta": {"runs": [_run_label(r) for r in runs], "command": command, "build": build_description(*runs)},
           "workloads": rows}
    metrics = ("decode_b1", "decode_b8", "prefill_512", "prefill_2048")
    lines = [f"# H200: tuned vs untuned, end to end ({doc['meta']['runs'][0]})", "",
             f"luce-compile alone ({doc['meta']['build']}); each workload's artifact compiled with the shipped "
             "tuning logs (autotune_logs/sm_90) and with `--no-tune-logs`, same weights, timed one after the other "
             "in one device call (luce_runtime.bench: decode after a 512-token prompt, b=8 aggregate; prefill of 512 "
             "and 2048 tokens).", "", f"Command: `{command}`", "",
             "| workload | " + " | ".join(f"{METRIC_NAMES[m]} tuned / untuned" for m in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for name, r in rows.items():
        cells = []
        for m in metrics:
            t, u = r["tuned"].get(m), r["untuned"].get(m)
            cells.append(f"{_fmt(t, ',.0f')} / {_fmt(u, ',.0f')} ({t / u:.2f}×)" if t and u else "n/a")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stem.parent.mkdir(parents=True, exist_ok=True)
    beside(stem, ".json").write_text(json.dumps(doc, indent=1))
    text = "\n".join(lines) + "\n"
    beside(stem, ".md").write_text(text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, nargs="+", help="the fetched $OUT of each device call of this run")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--name", help="file name stem under --out (default <gpu>-<date of the first run>, e.g. "
                                  "h100-2026-12-06)")
    p.add_argument("--command", default="bash benchmarks/h200/run.sh  # device call, carry [\".gpucheck/h200\"]")
    p.add_argument("--tuned-vs-untuned", type=Path, metavar="STEM",
                   help="only write the tuned vs untuned record (runs of run.sh with UNTUNED=...) at STEM.md/.json")
    args = p.parse_args()
    if args.tuned_vs_untuned:
        print(tuned_vs_untuned(tuple(args.run), args.tuned_vs_untuned, args.command))
        return 0
    import importlib.metadata

    import tvm

    import luce_compile

    results = collect(*args.run)
    first = args.run[0]
    gpu = (first / "gpu.csv").read_text().splitlines()[-1] if (first / "gpu.csv").is_file() else "?"
    py, torch_v, cuda = ((first / "versions.txt").read_text().split() + ["?"] * 3)[:3]
    runs = [_run_label(run) for run in args.run]
    date = runs[0].split(" ")[0]
    meta = {"date": date, "gpu": gpu, "python": py, "torch": torch_v, "cuda": cuda,
            "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
            "luce_compile": luce_compile.__version__, "tvm": tvm.__version__, "command": args.command,
            "runs": runs, "build": build_description(*args.run)}
    doc = {"meta": meta, "results": results}
    stem = args.out / (args.name or f"{gpu_label(meta).lower()}-{date[:10]}")
    table = markdown(doc)
    write_results(stem, doc, table)
    plot(doc, beside(stem, ".png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
