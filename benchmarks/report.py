"""Shared result writing for the benchmark scripts: one JSON document ({"meta", "rows"}) and a markdown table.

Peers (llama.cpp) report timings only; their roofline fraction uses the roofline measured next to luce-compile on
the same GGUF in the same run (same weights read per token, same machine), so every row of a table has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OURS = "luce-compile"


def beside(stem: Path, suffix: str) -> Path:
    """stem + suffix: a stem's dots are its name's (llama-3.1-8b-...), not a suffix to replace."""
    return stem.with_name(stem.name + suffix)


def write_results(stem: Path, doc: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write stem.json (the document) and stem.md (its table); returns both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = beside(stem, ".json"), beside(stem, ".md")
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def model_rooflines(rows: list[dict[str, Any]]) -> dict[str, float]:
    """model → roofline tok/s measured by luce-compile's row for it (absent when that row failed)."""
    return {r["model"]: r["result"]["roofline_tok_s"] for r in rows
            if r["engine"] == OURS and r["result"].get("roofline_tok_s")}


def ours_vs(rows: list[dict[str, Any]], model: str, engine: str, key: str) -> float | None:
    """luce-compile's `key` over `engine`'s on `model` (None when either is missing)."""
    def value(name: str) -> float | None:
        for r in rows:
            if r["model"] == model and r["engine"] == name and key in r["result"]:
                return float(r["result"][key])
        return None

    ours, peer = value(OURS), value(engine)
    return ours / peer if ours is not None and peer else None


def prefill_at(result: dict[str, Any], n: int) -> float | None:
    """Prefill tok/s of an n-token prompt from a result's extra lengths (JSON turns their int keys into str)."""
    by_len = result.get("extra", {}).get("prefill_tok_s_by_len", {})
    value = by_len.get(n, by_len.get(str(n)))
    return float(value) if value is not None else None


def _num(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def _row(r: dict[str, Any], roofs: dict[str, float], rows: list[dict[str, Any]], lens: list[int]) -> str:
    res = r["result"]
    if "error" in res:
        return f"| {r['model']} | {r['engine']} | error |" + " |" * (5 + len(lens))
    roof = roofs.get(r["model"])
    roof_text = f"{100 * res['decode_tok_s'] / roof:.1f}%" if roof else ""
    batch = f"{res['decode_batch_tok_s']:.1f} (B={res['batch']})" if "decode_batch_tok_s" in res else "n/a"
    ratio = "" if r["engine"] == OURS else _ratio_text(ours_vs(rows, r["model"], r["engine"], "decode_tok_s"))
    extra = "".join(f" {_num(prefill_at(res, n))} |" for n in lens)
    return (f"| {r['model']} | {r['engine']} | {res['prefill_tok_s']:.1f} |{extra} {res['decode_tok_s']:.1f} | "
            f"{batch} | {res['ttft_ms']:.1f} | {roof_text} | {ratio} |")


def _ratio_text(ratio: float | None) -> str:
    return f"{ratio:.2f}×" if ratio is not None else ""


def _tuning_text(rows: list[dict[str, Any]]) -> str:
    """Which of our builds took tuning records: "untuned" when none did (and for tables from before it was kept)."""
    tuned = {r["model"]: r["result"]["tuning"] for r in rows
             if r["engine"] == OURS and (r["result"].get("tuning") or {}).get("tuned")}
    if not tuned:
        return "untuned"
    folders = sorted({t["log_target"] for t in tuned.values()})
    counts = ", ".join(f"{m} {t['tuned']}/{t['tuned'] + t['default']}" for m, t in tuned.items())
    return f"kernels tuned from autotune_logs/{', '.join(folders)}: {counts}"


def cpu_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The CPU table: one row per (model, engine), with % of roofline and ours/peer decode ratio."""
    roofs = model_rooflines(rows)
    lens = [int(n) for n in meta.get("prefill_lens", [])]
    lines = [f"# CPU: luce-compile vs llama.cpp ({meta['date']})", "",
             f"{meta['cpu']}, {meta['threads']} threads, load before {meta['load_avg_1m']:.2f}; "
             f"luce-compile {meta['luce_compile']} (TVM {meta['tvm']}, {_tuning_text(rows)}), "
             f"llama-cpp-python {meta['llama_cpp']}; "
             f"prompt {meta['prompt_len']} tokens, {meta['gen_len']} decode steps.", "",
             f"Command: `{meta['command']}`", "",
             "% roofline: decode tok/s (b=1) over memory bandwidth / weight bytes per token, both measured in this "
             "run. Ratio: luce-compile decode tok/s over the peer's.", "",
             "| model | engine | prefill tok/s (pp" + str(meta["prompt_len"]) + ") | "
             + "".join(f"pp{n} tok/s | " for n in lens)
             + "decode tok/s (b=1) | decode tok/s (b=B) | TTFT ms | % roofline | luce-compile / peer (decode) |",
             "|---|---|---|" + "---|" * len(lens) + "---|---|---|---|---|"]
    lines += [_row(r, roofs, rows, lens) for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Regenerate the markdown next to a results JSON: python benchmarks/report.py benchmarks/results/cpu-DATE.json"""
    import sys

    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    for path in paths:
        doc = json.loads(path.read_text())
        path.with_suffix(".md").write_text(cpu_table(doc["rows"], doc["meta"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def spec_summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """benchmarks/spec.py's rows summed per (task, drafter): tokens/s over the tasks' prompts together (total tokens
    over total seconds, plain and speculative), the speed-up, acceptance, and how many prompts gave plain decoding's
    ids."""
    out = []
    tasks = list(dict.fromkeys(r["task"] for r in doc["rows"]))
    drafters = list(dict.fromkeys(name for r in doc["rows"] for name in r["drafters"]))
    for task in tasks:
        rows = [r for r in doc["rows"] if r["task"] == task]
        tokens, plain_s = sum(r["tokens"] for r in rows), sum(r["plain_s"] for r in rows)
        for name in drafters:
            runs = [r["drafters"][name] for r in rows]
            spec_s = sum(d["s"] for d in runs)
            drafted, accepted = sum(d["drafted"] for d in runs), sum(d["accepted"] for d in runs)
            steps, verifies = sum(d["steps"] for d in runs), sum(len(d["trace"]) for d in runs)
            gaps = [d["parted"]["gap"] for d in runs if (d.get("parted") or {}).get("gap") is not None]
            out.append({"task": task, "drafter": name, "prompts": len(rows), "tokens": tokens,
                        "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
                        "drafted": drafted, "accepted": accepted,
                        "mean_accepted": accepted / verifies if verifies else 0.0,
                        "tokens_per_step": (accepted + steps) / steps if steps else 0.0,
                        "identical": sum(d["identical"] for d in runs), "max_parted_gap": max(gaps) if gaps else None})
    return out


def spec_table(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [f"# Speculative decoding on the CPU, {meta['date'][:10]}", "",
             f"{meta['cpu']}, {meta['threads']} threads, load {meta['load_avg_1m']:.2f} → "
             f"{meta.get('load_avg_1m_end', float('nan')):.2f}; luce-compile {meta['luce_compile']}. Target "
             f"{meta['target']}, draft {meta['draft']}; greedy, up to {meta['gen_len']} tokens a prompt, draft length "
             f"adapted up to {meta['draft_max']}. Tokens/s from each generation's first token to its last.", "",
             f"Command: `{meta['command']}`", "",
             "| task | drafter | prompts | tokens | plain tok/s | speculative tok/s | speed-up | drafts accepted "
             "| mean accepted per verify | tokens per target step | ids equal plain decoding's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in spec_summary(doc):
        lines.append(f"| {s['task']} | {s['drafter']} | {s['prompts']} | {s['tokens']} | {s['plain_tok_s']:.2f} | "
                     f"{s['spec_tok_s']:.2f} | {s['speedup']:.2f}x | {s['accepted']} / {s['drafted']} | "
                     f"{s['mean_accepted']:.2f} | {s['tokens_per_step']:.2f} | {s['identical']} / {s['prompts']}"
                     + ("" if s["max_parted_gap"] is None else
                        f" (parted at near ties: gap ≤ {100 * s['max_parted_gap']:.2f}% of the largest logit)")
                     + " |")
    return "\n".join(lines) + "\n"
