"""PNG plots of the committed benchmark results, one per table, next to its JSON.

    .venv/bin/python benchmarks/plot.py [RESULTS_DIR]

- cpu-<date>.json → cpu-<date>.png: prefill and decode tok/s, ours vs peers, and % of the memory roofline.
- serve-<date>.json → serve-<date>.png: aggregate tok/s and p50 TTFT per number of clients.
- spec-<date>.json → spec-<date>.png: speculative speed-up and tokens per target step, per task and drafter.
- h200/<date>-<model>.json (scripts/device_check.py records) → h200/<date>.png: our decode and prefill tok/s, with
  llama.cpp's published anchors on the same H200 kind where known (not the same run: those records hold only ours,
  and no bandwidth, so no roofline panel).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the build machine or in CI
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
OURS = "luce-compile"
# shared/notes/references.md: llama.cpp CUDA (FA on) on one H200, 2026-11-30; tg128 decode and pp2048 prefill
H200_LLAMA_CPP_ANCHORS = {"smollm2-135m": {"decode b=1": 959.0, "prefill 2048": 51_800.0}}


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, fmt: str = "{:.0f}") -> None:
    """Bars for each series (engine) within each group (model), labelled with their values."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[fmt.format(v) if v else "" for v in values], fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def cpu_series(doc: dict, key: str, roofline: bool = False) -> tuple[list[str], dict[str, list[float]]]:
    """(models, engine → value per model); with roofline, decode tok/s as % of that model's measured roofline."""
    rows = [r for r in doc["rows"] if "error" not in r["result"]]
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    roofs = {r["model"]: r["result"]["roofline_tok_s"] for r in rows if r["engine"] == OURS}
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(models))
    for r in rows:
        value = r["result"].get(key, 0.0)
        if roofline:
            value = 100 * value / roofs[r["model"]] if r["model"] in roofs else 0.0
        series[r["engine"]][models.index(r["model"])] = value
    return [m.removeprefix("synthetic:") for m in models], dict(series)


def plot_cpu(doc: dict, out: Path) -> Path:
    meta = doc["meta"]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    grouped_bars(axes[0], *cpu_series(doc, "prefill_tok_s"), f"prefill tok/s ({meta['prompt_len']} tokens)")
    grouped_bars(axes[1], *cpu_series(doc, "decode_tok_s"), "decode tok/s (batch 1)", "{:.1f}")
    grouped_bars(axes[2], *cpu_series(doc, "decode_batch_tok_s"), "decode tok/s (batch 8, aggregate)", "{:.1f}")
    grouped_bars(axes[3], *cpu_series(doc, "decode_tok_s", roofline=True), "decode, % of memory roofline", "{:.1f}%")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    tuned = sorted(r["model"] for r in doc["rows"]
                   if r["engine"] == OURS and (r["result"].get("tuning") or {}).get("tuned"))  # as the table says
    tuning = f"tuned ({', '.join(tuned)})" if tuned else "untuned"
    fig.suptitle(f"CPU {meta['date'][:10]}: {meta['cpu']}, {meta['threads']} threads (load {meta['load_avg_1m']:.2f})"
                 f"; luce-compile {meta['luce_compile']} {tuning} vs llama.cpp {meta['llama_cpp']}", fontsize=10)
    return save(fig, out)


def plot_serve(doc: dict, out: Path) -> Path:
    meta, rows = doc["meta"], doc["rows"]
    clients = sorted({r["clients"] for r in rows})
    groups = [f"N={n}" for n in clients]
    servers = list(dict.fromkeys(r["server"] for r in rows))

    def series(key: str) -> dict[str, list[float]]:
        table = {(r["server"], r["clients"]): r[key] for r in rows}
        return {s: [table.get((s, n), 0.0) for n in clients] for s in servers}

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    grouped_bars(axes[0], groups, series("aggregate_tok_s"), "aggregate tok/s", "{:.1f}")
    grouped_bars(axes[1], groups, series("ttft_p50_ms"), "TTFT p50 (ms)")
    # a GPU run (serve.py --gpu) gave the servers no thread count
    machine = meta["gpu"].split(",")[0] if meta.get("gpu") else f"{meta['cpu']}, {meta['threads']} threads"
    fig.suptitle(f"Serving {meta['date'][:10]}: {meta['model']}, {machine}, "
                 f"{meta['requests']} requests per level", fontsize=10)
    return save(fig, out)


def plot_spec(doc: dict, out: Path) -> Path:
    from report import spec_summary

    summary = spec_summary(doc)
    tasks = list(dict.fromkeys(s["task"] for s in summary))
    drafters = list(dict.fromkeys(s["drafter"] for s in summary))
    table = {(s["task"], s["drafter"]): s for s in summary}

    def series(key: str) -> dict[str, list[float]]:
        return {d: [table[(t, d)][key] for t in tasks] for d in drafters}

    plain = {"plain decoding": [table[(t, drafters[0])]["plain_tok_s"] for t in tasks]}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    grouped_bars(axes[0], tasks, plain | series("spec_tok_s"), "tok/s", "{:.1f}")
    grouped_bars(axes[1], tasks, series("speedup"), "speed-up over plain decoding", "{:.2f}x")
    grouped_bars(axes[2], tasks, series("tokens_per_step"), "tokens per target step", "{:.2f}")
    meta = doc["meta"]
    fig.suptitle(f"Speculative decoding {meta['date'][:10]}: {meta['target']} with {meta['draft']} or prompt lookup, "
                 f"{meta['cpu']}, {meta['threads']} threads", fontsize=10)
    return save(fig, out)


def h200_series(records: list[dict]) -> tuple[list[str], dict[str, dict[str, list[float]]]]:
    """(models, panel → engine → value per model) for decode b=1 and each prefill length."""
    models = [r["spec"]["preset"] for r in records]
    panels: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * len(models)))
    for i, r in enumerate(records):
        panels["decode b=1"][OURS][i] = r["timing"]["decode"]["tok_s"]
        for p in r["timing"]["prefill"]:
            panels[f"prefill {p['tokens']}"][OURS][i] = p["tok_s"]
        for panel, value in H200_LLAMA_CPP_ANCHORS.get(models[i], {}).items():
            panels[panel]["llama.cpp (anchor)"][i] = value
    return models, {k: dict(v) for k, v in panels.items()}


def plot_h200(records: list[dict], out: Path) -> Path:
    models, panels = h200_series(records)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4))
    for ax, (panel, series) in zip(axes, panels.items(), strict=True):
        grouped_bars(ax, models, series, f"{panel} tok/s")
    env = records[0]["environment"]
    fig.suptitle(f"H200 {env['date'][:10]}: {env['gpu']}; luce-compile untuned (TVM {env['tvm']}); "
                 "llama.cpp bars are published anchors, not this run", fontsize=10)
    return save(fig, out)


def save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all(results: Path) -> list[Path]:
    """Every table under results/ → its PNG; returns the files written."""
    written = [plot_cpu(json.loads(p.read_text()), p.with_suffix(".png")) for p in sorted(results.glob("cpu-*.json"))]
    written += [plot_serve(json.loads(p.read_text()), p.with_suffix(".png"))
                for p in sorted(results.glob("serve-*.json"))]
    written += [plot_spec(json.loads(p.read_text()), p.with_suffix(".png"))
                for p in sorted(results.glob("spec-*.json"))]
    by_date: dict[str, list[dict]] = defaultdict(list)
    for p in sorted((results / "h200").glob("*.json")):
        record = json.loads(p.read_text())
        # device_check's model records; kernel micro-benchmarks are not tables, tiny-llama is a correctness fixture
        if "timing" in record and "spec" in record and not record["spec"]["preset"].startswith("tiny"):
            by_date[record["environment"]["date"][:10]].append(record)
    written += [plot_h200(records, results / "h200" / f"{date}.png") for date, records in sorted(by_date.items())]
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for path in plot_all(Path(args[0]) if args else ROOT / "results"):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
