"""schedules/gpu/quant_gemm.py: a symbolic batch branches at run time between low-batch GEMVs and the tiled matmul.

Structure only here (no GPU): which schedule each batch range gets, and that every branch is a complete GPU
schedule. The numbers are checked on the GPU machine (scripts/device_check.py: 2, 5 and 8 sequences decoded together
equal each alone; the oracle through prefill), and every GPU build of tests/codegen compiles the dispatch for real.
"""

from __future__ import annotations

import re

import pytest
from luce_schedules.gpu.quant_gemm import LOW_BATCH, Dispatched, QuantGEMM
from tvm import s_tir, tirx
from tvm.target import Target

from luce_compile.lower.quant_matmul import quant_matmul

TARGET = Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                 "max_threads_per_block": 1024, "thread_warp_size": 32})


def _branches(func: tirx.PrimFunc) -> list[tuple[int, str]]:
    """(batch limit, the branch's script) for each run-time test of the batch, outermost first, and the final else.
    TVMScript is the readable walk of the IR here: TVM 0.27's Python API has no statement visitor."""
    text = func.script()
    heads = list(re.finditer(r"if T\.tvm_thread_invariant\((\w+) <= T\.int64\((\d+)\)\):", text))
    cuts = [m.start() for m in heads] + [len(text)]
    return [(int(m.group(2)), text[m.end():cuts[i + 1]]) for i, m in enumerate(heads)]


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "BF16"])
def test_symbolic_batch_dispatches_on_the_batch(qtype):
    func = quant_matmul(qtype, 256, 512)
    out = QuantGEMM().apply(func, TARGET)
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], Dispatched)
    scheduled = out[0].mod["main"]
    assert int(scheduled.attrs["tirx.HoistIfThenElseExprWithBlock"]) == 1
    branches = _branches(scheduled)
    # outermost first: batch ≤ 2, then ≤ 8, then the tiled matmul
    assert [limit for limit, _ in branches] == [limit for limit, _ in LOW_BATCH]
    for _, text in branches:  # each branch is a whole GPU schedule: bound to blocks and threads
        assert 'thread="blockIdx.x"' in text and 'thread="threadIdx.x"' in text
    assert "shared" in branches[-1][1].split("else:")[-1]  # Matmul stages its tiles in shared memory
    # the params are func's own: every branch reads and writes the caller's buffers
    assert list(scheduled.params) == list(func.params)


@pytest.mark.unit
@pytest.mark.parametrize("batch", [2, 64])
def test_static_batch_keeps_the_tiled_matmul(batch):
    out = QuantGEMM().apply(quant_matmul("Q4_1", 256, 512, batch=batch), TARGET)
    assert isinstance(out, s_tir.Schedule)
    text = out.mod["main"].script()
    assert "tvm_thread_invariant" not in text and 'scope="shared' in text


@pytest.mark.unit
def test_batch_one_is_left_to_the_gemv_rule():
    assert QuantGEMM().apply(quant_matmul("Q4_1", 256, 512, batch=1), TARGET) is None
