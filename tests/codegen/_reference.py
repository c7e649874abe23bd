"""Checking a compiled artifact against the float64 oracle: the oracle's greedy run of a prompt (its trace), the
engine's logits on the same tokens, and the comparison the end-to-end tests assert.

Tolerances (REL_TOL, NEAR_TIE) are luce_compile/checks.py's, which says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from luce_runtime.engine import Engine

from luce_compile.checks import NEAR_TIE, REL_TOL, rel_err, top2_margin  # noqa: F401  (re-exported to the tests)
from luce_compile.graph.oracle import Oracle

log = logging.getLogger(__name__)

# what was measured, printed at the end of the session (conftest's terminal summary)
RESULTS: list[RunResult] = []


@dataclass
class Trace:
    """The oracle's greedy continuation: logits[0] after the prompt, logits[i] after i greedy tokens ids[:i]."""

    prompt: list[int]
    logits: list[np.ndarray]  # each (V,) float64
    ids: list[int] = field(default_factory=list)  # ids[i] = argmax(logits[i])

    @property
    def margins(self) -> list[float]:
        return [top2_margin(row) for row in self.logits]

    def first_tie(self) -> int:
        """Index of the first near-tie (len(logits) when there is none): greedy ids are compared before it."""
        return next((i for i, m in enumerate(self.margins) if m < NEAR_TIE), len(self.logits))


def oracle_trace(oracle: Oracle, prompt: list[int], steps: int) -> Trace:
    """Prefill the prompt, then `steps` greedy decode steps on the oracle (steps + 1 rows of logits)."""
    trace = Trace(list(prompt), [oracle.prefill(prompt)[-1]])
    for _ in range(steps):
        trace.ids.append(int(np.argmax(trace.logits[-1])))
        trace.logits.append(oracle.decode(trace.ids[-1]))
    trace.ids.append(int(np.argmax(trace.logits[-1])))
    return trace


def engine_logits(engine: Engine, prompt: list[int], fed: list[int]) -> list[np.ndarray]:
    """The engine's logits after the prompt and after each token of `fed` (the oracle's ids: teacher forcing keeps
    both on one path even past a near-tie)."""
    seq = engine.add_sequence()
    try:
        rows = [engine.prefill([seq], [prompt])[0]]
        rows += [engine.decode([seq], [t])[0] for t in fed]
        return rows
    finally:
        engine.remove_sequence(seq)


@dataclass(frozen=True)
class RunResult:
    label: str
    prompt_len: int
    steps: int  # decode steps compared (logit rows − 1)
    max_rel: float
    ids_matched: int  # greedy ids equal to the oracle's: every row that is not a near-tie
    first_tie: int  # row of the first near-tie (steps + 1 if none): a free-running greedy run may diverge there


def compare(label: str, trace: Trace, rows: list[np.ndarray], tol: float = REL_TOL) -> RunResult:
    """Assert every row within tol of the oracle's, and the greedy id equal wherever the oracle's top-2 margin is at
    least NEAR_TIE: both sides were fed the oracle's tokens, so rows after a near-tie are still on one path."""
    assert len(rows) <= len(trace.logits), "more engine rows than the oracle computed"
    errs = [rel_err(got, want) for got, want in zip(rows, trace.logits, strict=False)]
    worst = int(np.argmax(errs))
    assert errs[worst] <= tol, (f"{label}: logits after {worst} decode steps differ from the oracle by "
                                f"{errs[worst]:.2e} relative (> {tol:.0e}); all errors: {np.round(errs, 8)}")
    margins = trace.margins
    checked = [i for i in range(len(rows)) if margins[i] >= NEAR_TIE]
    wrong = [i for i in checked if int(np.argmax(rows[i])) != trace.ids[i]]
    assert not wrong, (f"{label}: greedy ids differ from the oracle's after decode steps {wrong} (engine "
                       f"{[int(np.argmax(rows[i])) for i in wrong]}, oracle {[trace.ids[i] for i in wrong]}, "
                       f"oracle margins {[round(margins[i], 3) for i in wrong]} >= {NEAR_TIE})")
    result = RunResult(label, len(trace.prompt), len(rows) - 1, max(errs), len(checked), trace.first_tie())
    RESULTS.append(result)
    log.info("%s", result)
    return result


def check_against_oracle(label: str, engine: Engine, oracle: Oracle | Trace, prompt: list[int],
                         steps: int, tol: float = REL_TOL) -> RunResult:
    """Prefill + `steps` greedy decode steps on engine and oracle; assert they agree (see compare)."""
    trace = oracle if isinstance(oracle, Trace) else oracle_trace(oracle, prompt, steps)
    rows = engine_logits(engine, prompt, trace.ids[:steps])
    return compare(label, trace, rows, tol)


def summary_lines() -> list[str]:
    lines = [f"{'run':44} {'prompt':>6} {'steps':>5} {'max rel err':>11} {'ids ok':>6} {'1st tie':>7}"]
    for r in RESULTS:
        tie = "-" if r.first_tie > r.steps else str(r.first_tie)
        lines.append(f"{r.label:44} {r.prompt_len:6} {r.steps:5} {r.max_rel:11.2e} {r.ids_matched:6} {tie:>7}")
    return lines
