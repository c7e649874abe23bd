"""schedules/cpu/elementwise.py (Injective): every function of a model that the other CPU rules leave and that has
no reduction is taken, and its outputs equal the unscheduled function's on random inputs, for one token and for a
prompt's worth: it only inlines, reorders, splits, vectorizes and parallelizes loops, so no sum is reordered. Equal
to the bit, except where inlining removed a rounding store: LLVM may then fuse a·b + c into one FMA (GELU's tanh
argument on Gemma 3), one rounding fewer: those values agree to 1e-6 of the output's scale.
RoPE's angle is computed outside its head loop (the transcendental hoisting) and its prompt form runs in parallel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from luce_schedules.cpu.elementwise import Injective
from tvm import tirx

from luce_compile.codegen.pipeline import pre_schedule_passes
from luce_compile.gguf.reader import read_gguf
from luce_compile.graph import build_graph
from luce_compile.lower.relax_model import LowerOptions, lower_graph
from luce_compile.synthetic import cached_synthetic, preset
from luce_compile.tune.workloads import first_rule, schedule_rules, unscheduled_funcs

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})


def _left_to_injective(model: str, precision: str) -> dict[str, tirx.PrimFunc]:
    graph = build_graph(read_gguf(cached_synthetic(preset(model))))
    mod, _ = lower_graph(graph, TARGET, LowerOptions(precision=precision))
    with TARGET:
        mod = tvm.transform.Sequential(pre_schedule_passes(TARGET))(mod)
    others = [r for r in schedule_rules(TARGET) if not isinstance(r, Injective)]
    return {name: f for name, f in unscheduled_funcs(mod) if first_rule(f, TARGET, others)[0] is None}


def _inputs(func: tirx.PrimFunc, tokens: int, rng: np.random.Generator) -> list[np.ndarray] | None:
    """Random arrays for the buffer arguments, symbolic dims bound to `tokens` (batch to 1); integers below
    min(2, tokens) so that indices stay in bounds. None when an argument is not a plain buffer of such dims."""
    arrays = []
    for buf in func.params:
        try:
            shape = buf.shape
        except AttributeError:  # a scalar argument
            return None
        dims = []
        for d in shape:
            if isinstance(d, tirx.IntImm):
                dims.append(int(d))
            elif isinstance(d, tirx.Var):
                dims.append(1 if str(d) == "batch" else tokens)
            else:
                return None
        dtype = str(buf.dtype)
        arrays.append(rng.standard_normal(dims).astype(dtype) if dtype.startswith("float")
                      else rng.integers(0, min(2, tokens), dims).astype(dtype))
    return arrays


def _run(func: tirx.PrimFunc, arrays: list[np.ndarray]) -> list[np.ndarray]:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    lib.mod["main"](*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize(("model", "precision"), [("tiny-llama", "int8"), ("tiny-qwen2", "f32"),
                                                  ("tiny-qwen3", "int8"), ("tiny-gemma3", "f32")])
def test_injective_functions_are_bit_identical_to_unscheduled(model, precision, rng):
    funcs = _left_to_injective(model, precision)
    taken = {name: sch for name, f in funcs.items() if (sch := Injective().apply(f, TARGET)) is not None}
    assert any(name.startswith("rope") for name in taken) and len(taken) >= 5, sorted(taken)
    checked = exact = 0
    for name, sch in sorted(taken.items()):
        for tokens in (1, 19):
            arrays = _inputs(funcs[name], tokens, rng)
            if arrays is None:
                break
            want, got = _run(funcs[name], arrays), _run(sch.mod["main"], arrays)
            for w, g in zip(want, got, strict=True):
                scale = float(np.abs(w).max()) if w.size else 0.0
                assert np.array_equal(w, g) or np.allclose(w, g, rtol=0, atol=1e-6 * scale), (name, tokens)
                exact += int(np.array_equal(w, g))
            checked += 1
    assert checked >= 10 and exact >= checked  # every output array compared, nearly all to the bit


def test_rope_hoists_its_angle_out_of_the_head_loop_and_runs_prompts_in_parallel():
    funcs = _left_to_injective("tiny-llama", "int8")
    name = next(n for n in funcs if n.startswith("rope"))
    script = Injective().apply(funcs[name], TARGET).mod["main"].script()
    loops = [line.strip() for line in script.splitlines() if line.strip().startswith("for ")]
    heads = int(funcs[name].params[0].shape[2])
    assert f"in range({heads}):" in loops[-1], loops  # the head loop innermost: the angle is invariant in it
    assert "T.parallel(" in script


def test_declines_reductions_and_other_targets():
    funcs = _left_to_injective("tiny-llama", "int8")
    norm = next(f for n, f in funcs.items() if n.startswith("rms_norm"))
    assert Injective().apply(norm, TARGET) is None
    add = next(f for n, f in funcs.items() if "add" in n)
    assert Injective().apply(add, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None
