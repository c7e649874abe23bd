"""lower/q8_gemm.py and --prefill-gemm: which weight types the 8-bit prefill GEMM takes and with which activations,
the function the Relax module calls (the quantized input as scratch outputs after y), and how the option travels
from compile_model into the lowering and the manifest. The kernel itself: tests/schedules/test_gpu_mmq_gemm.py."""

from __future__ import annotations

import re

import pytest
import tvm

from luce_compile.errors import LuceError
from luce_compile.graph.rounding import ACTIVATION_ROUNDING, GPU_Q8_0_TYPES, GPU_Q8_1_TYPES, Q8_1_TYPES, q8_0
from luce_compile.lower.cpu_int8 import INT8_FORMATS
from luce_compile.lower.q8_gemm import Q8_GEMM_ACTIVATIONS, Q8_GEMM_ATTR, q8_gemm_format, q8_gemm_matmul
from luce_compile.lower.quant_matmul import GGML_TYPE_ATTR, TENSOR_CORE_TWIN

pytestmark = pytest.mark.unit
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                          "max_threads_per_block": 1024, "thread_warp_size": 32})


@pytest.mark.parametrize("qtype", sorted(Q8_GEMM_ACTIVATIONS))
def test_activations_are_what_the_emulating_oracle_rounds(qtype):
    """The kernel's activations per type are the emulating oracle's gpu_q8_1 forms (graph/rounding.GgmlRounding), so
    a reference for a --prefill-gemm q8 build rounds as the kernel does: Q8_1 (with the sums) for the types with a
    minimum per 32 values, q8_0's values for the others; in the CPU build's order of the 32 values."""
    fmt = q8_gemm_format(qtype)
    assert fmt.block == 32 and fmt.with_sum == (qtype in Q8_1_TYPES + GPU_Q8_1_TYPES)
    if not fmt.with_sum:
        assert qtype in GPU_Q8_0_TYPES or ACTIVATION_ROUNDING[qtype] is q8_0
    assert fmt.order == INT8_FORMATS[fmt_type(qtype)].order == ("natural" if qtype == "Q8_0" else "nibbles")


def fmt_type(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def test_types_without_the_kernel():
    assert q8_gemm_format("BF16") is None and q8_gemm_format("F32") is None and q8_gemm_format("F16") is None
    # the codebook types take q8_0 activations (6d5964d), MXFP4 too (its E8M0 exponent for d)
    assert q8_gemm_format("IQ4_XS").name == "Q8_0" and q8_gemm_format("MXFP4").name == "Q8_0"
    with pytest.raises(ValueError, match="does not take BF16"):
        q8_gemm_matmul("BF16", 64, 256, name="g")


def test_q3_k_and_q2_k_take_q8_0_activations():
    """Issue 40's 2- and 3-bit K-quants: Q3_K (a signed scale per 16 values, no minimum) dots its centred quants
    (q − 4) against q8_0 values; Q2_K's minima per 16 values take sums the kernel forms from the quants, so its
    activations are q8_0's too, without the per-32 sums (no xs scratch)."""
    from luce_compile.lower.q8_gemm import Q8_GEMM_OFFSET

    assert q8_gemm_format("Q3_K").name == q8_gemm_format("Q2_K").name == "Q8_0"
    assert Q8_GEMM_OFFSET["Q3_K"] == 4 and "Q2_K" not in Q8_GEMM_OFFSET
    for qtype in ("Q3_K", "Q2_K"):
        assert [p.name for p in q8_gemm_matmul(qtype, 64, 512, name="g").params][-2:] == ["xq", "xd"]


def test_the_function_takes_its_scratch_after_y_and_marks_its_twin():
    func = q8_gemm_matmul("Q4_K", 64, 512, name="gemm_q4_k_64x512")
    names = [p.name for p in func.params]
    assert names[0] == "x" and names[-3:] == ["xq", "xd", "xs"]
    shapes = {p.name: ([str(d) for d in p.shape], str(p.dtype)) for p in func.params}
    assert shapes["xq"] == (["batch", "T.int64(512)"], "int8") and shapes["xs"] == (["batch", "T.int64(16)"], "float32")
    twin = func.attrs[TENSOR_CORE_TWIN]
    assert bool(twin.attrs[Q8_GEMM_ATTR]) and str(twin.attrs[GGML_TYPE_ATTR]) == "Q4_K"
    assert [p.name for p in q8_gemm_matmul("Q6_K", 64, 512, name="g").params][-2:] == ["xq", "xd"]  # no sums


@pytest.fixture(scope="module")
def tiny_graph():
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph.registry import build_graph
    from luce_compile.synthetic import SyntheticSpec, cached_synthetic

    return build_graph(read_gguf(cached_synthetic(SyntheticSpec(quant="Q4_1", n_embd=256, n_ff=512))))


@pytest.mark.parametrize("choice", ["q8", "f16"])
def test_lowering_passes_the_choice_to_every_matmul_of_more_rows(choice, tiny_graph):
    """With q8 every dynamic-batch matmul of a type the kernel takes is q8_gemm_matmul's function (its call gives
    Relax three more outputs) and the manifest's record lists the types; decode1's GEMVs and f16 builds are
    unchanged."""
    from luce_compile.codegen.compile import prefill_gemm_record
    from luce_compile.lower.relax_model import LowerOptions, lower_graph

    mod, _ = lower_graph(tiny_graph, CUDA, LowerOptions(precision="f16", prefill_gemm=choice))
    gemms = {gv.name_hint: f for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith("gemm_")}
    assert gemms
    marked = {name for name, f in gemms.items() if Q8_GEMM_ATTR in f.attrs[TENSOR_CORE_TWIN].attrs}
    types = {t.ggml_type.name for name, t in tiny_graph.weights.items() if len(t.shape) == 2}
    record = prefill_gemm_record(mod, LowerOptions(precision="f16", prefill_gemm=choice))
    assert record["choice"] == choice
    if choice == "q8":
        assert marked == set(gemms) and record["q8_types"] == sorted(types & set(Q8_GEMM_ACTIVATIONS))
        calls = re.findall(r"R\.call_tir\((gemm_\w+), .*?out_ty=(\[[^\]]*\]|R\.Tensor\([^)]*\))",
                           mod["prefill"].script())
        assert calls and all(out.startswith("[") and 'dtype="int8"' in out for _, out in calls)
    else:
        assert not marked and record["q8_types"] == []
    assert not any(name.startswith("gemv_") and TENSOR_CORE_TWIN in f.attrs
                   for name, f in ((gv.name_hint, f) for gv, f in mod.functions_items())
                   if isinstance(f, tvm.tirx.PrimFunc))


def test_compile_refuses_q8_where_there_is_no_tensor_core_gemm(tmp_path):
    """Refused before any work (the GGUF is not even read): a CPU target, and CUDA with the exact precision."""
    from luce_compile.codegen.compile import compile_model

    for target, precision in (("cpu", "auto"), ("sm_90", "f32")):
        with pytest.raises(LuceError, match="--prefill-gemm q8"):
            compile_model(tmp_path / "missing.gguf", target, tmp_path / "out", precision=precision,
                          prefill_gemm="q8")
    with pytest.raises(ValueError, match="not one of"):
        compile_model(tmp_path / "missing.gguf", "sm_90", tmp_path / "out", prefill_gemm="int4")
