"""The committed megakernel records (benchmarks/results/megakernel/, scripts/megakernel_check.py on the H200): every
model that ran passed its checks within the script's bars, and the committed markdown's tables are the JSON
rendered by `megakernel_check.py report`. `timing-only-*` files are timings whose checks do not apply (their md says
why) and are not records."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = sorted((ROOT / "benchmarks" / "results" / "megakernel").glob("h200-*.json"))
sys.path.insert(0, str(ROOT / "scripts"))

import megakernel_check  # noqa: E402


@pytest.mark.unit
def test_there_are_records_to_check():
    assert RECORDS


@pytest.mark.unit
@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_megakernel_record(path: Path):
    raw = json.loads(path.read_text())
    for model, run in raw.items():
        r = run.get(model, run)
        assert r.get("ok") is True, (model, r.get("error") or r.get("oracle"))
        # the bar the run held it to: REL_TOL, or Q8_REL_TOL for 8-bit activations (megakernel_check says why)
        tol = r["oracle"].get("tol", megakernel_check.REL_TOL)
        assert tol in (megakernel_check.REL_TOL, megakernel_check.Q8_REL_TOL), model
        assert tol == megakernel_check.REL_TOL or path.name.startswith("h200-") and "q8" in path.name, model
        assert r["oracle"]["max_rel_err"] < tol and r["oracle"]["ids_mismatched"] == 0
        assert r["oracle"]["ids_checked"] >= 1, model
        assert r["batched"]["max_rel_diff"] <= megakernel_check.BATCH_TOL and r["batched"]["sizes"], model
        for t in r.get("timing", []):
            assert t["device_us_per_step"] > 0
            assert t["tok_s_device"] == pytest.approx(t["batch"] / t["device_us_per_step"] * 1e6, rel=2e-3, abs=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        megakernel_check.report(argparse.Namespace(json=str(path), date="", commit=""))
    rendered = [line for line in out.getvalue().splitlines() if line.startswith(("|", "- **"))]
    committed = [line for line in path.with_suffix(".md").read_text().splitlines() if line.startswith(("|", "- **"))]
    assert committed == rendered
