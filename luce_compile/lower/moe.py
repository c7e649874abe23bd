"""Mixture of experts (OpKind.MOE, llama.cpp's build_moe_ffn) lowered for the CPU: only the chosen experts' rows are
read, per token.

One MOE op becomes, for R = B·S token rows and k = n_expert_used:
  router    logits (R, n_expert) = x @ ffn_gate_inp.T (+ its bias, gpt-oss): an ordinary matmul (the router is F32
            in every GGUF: llama-quantize never quantizes ffn_gate_inp), float32 as ggml's F32 vec_dot.
  route     `route_func`: softmax, the k largest (ggml_top_k: descending, the lower expert first on a tie), their
            probabilities, renormalized to sum 1 when norm_w. Gives ids (R, k) int32 and weights (R, k). gpt-oss's
            SOFTMAX_WEIGHT gating (the softmax of the k largest logits alone) is the same choice and the same weights
            as softmax then renormalized (p_j / Σ_chosen p = e^l_j / Σ_chosen e^l), so it takes norm_w.
  sort      `sort_func`: the P = R·k rows (token p // k, slot p % k) grouped by expert (a counting sort; none where
            P is known when compiling, a decode step of one sequence: its GEMVs take the rows in token order), so that
            consecutive rows of the expert matmuls read one expert's weights: a prompt reads each chosen expert's
            rows from memory about once, from cache for its other tokens (llama.cpp's mul_mat_id groups the same way).
  experts   `expert_matmul` / `int8_expert_matmul`: sorted row q dots weight row experts[q]·n_out + n of the stacked
            tensor, whose planes are (n_expert·n_out, …) (the GGUF's (expert, out, in) rows flattened: quant_layout
            repacks any leading dims as rows). gate and up read token tokens[q]'s input (quantized once, as ggml
            quantizes src1 once for mul_mat_id); down reads the sorted rows as they are.
  biases    gpt-oss's expert biases (expert, out), F32: each sorted row adds its expert's row (ggml_add_id) after
            gate, up and down.
  combine   down's rows back in token order (inverse), out (R, E) = Σ_j weights[:, j] · down[:, j].
Under precision int8 the expert matmuls take 8-bit activations with llama.cpp's vec_dot arithmetic (cpu_int8.int8_dot,
the same TE stages as every int8 matmul, with gathered weight rows); f32 keeps exact float32.

The expert matmuls carry EXPERT_ATTR for schedules/cpu/moe.py (int8: the int8 GEMV's vector body with gathered rows;
float32: a parallel schedule of the TE); routing and sorting are small and stay as written. On a GPU (cuda, rocm) the
sort is schedules/gpu/moe.expert_sort (a thread per expert, same order), the expert matmuls schedules/gpu/moe.py's
gathered GEMV, the routing schedules/gpu/moe.expert_route (one kernel: the TE form lowers to one a stage) and the
router's matmul dlight's; the megakernel takes no MoE graph (the engine decodes with these). On CUDA with
the 8-bit prefill GEMM (precision f16, --prefill-gemm q8) the expert matmuls of a dynamic row count also carry the
grouped 8-bit GEMM (GROUPED_ATTR), which takes calls of more than grouped_above(n_expert) sorted rows: a prompt's.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from luce_compile.errors import UnsupportedError
from luce_compile.graph.ir import Op
from luce_compile.lower.cpu_int8 import checked_int8_type, int8_dot, int8_format, quantize_q8
from luce_compile.lower.q8_gemm import q8_gemm_format, scratch_specs, scratch_tensors
from luce_compile.lower.quant_matmul import dequant_expr, weight_planes

F32 = "float32"
EXPERT_ATTR = "luce.moe_expert"  # marks the expert matmuls for schedules/{cpu,gpu}/moe.py (value: the weight type)
# an expert matmul that also has the grouped 8-bit GEMM form (schedules/gpu/moe.grouped_mmq_gemm), value (n_expert,
# gather): its quantized input is scratch after y, as q8_gemm_matmul's, written only by the grouped form
GROUPED_ATTR = "luce.moe_grouped"
# the grouped GEMM takes a call's rows where they average more than this an expert (grouped_above); fewer, and its
# tiles would hold mostly other experts' rows: the gathered GEMV reads each chosen row once
GROUPED_ROWS_PER_EXPERT = 4


def grouped_above(n_expert: int) -> int:
    """The most sorted rows an expert matmul with the grouped form runs on the gathered GEMV (float32 activations);
    above it, the grouped 8-bit GEMM (8-bit activations, lower/q8_gemm.py's forms): what an oracle emulates."""
    return GROUPED_ROWS_PER_EXPERT * n_expert


def _i64(*dims: int | tirx.Expr) -> tuple[tirx.Expr, ...]:
    return tuple(tirx.IntImm("int64", d) if isinstance(d, int) else d for d in dims)


def check_target(target_kind: str, arch: str) -> None:
    """MoE lowers for the CPU (llvm) and GPUs (cuda, rocm: schedules/gpu/moe.py); anything else is refused."""
    if target_kind not in ("llvm", "cuda", "rocm"):
        raise UnsupportedError(f"lower: {arch} (mixture of experts) has kernels for the CPU and CUDA/ROCm GPUs only, "
                               f"not {target_kind}. Compile with --target cpu or a GPU target.")


def route_func(n_expert: int, used: int, norm_w: bool, name: str) -> tirx.PrimFunc:
    """logits (R, n_expert) float32 → ids (R, used) int32, weights (R, used) float32 (module docstring). An expert's
    rank is the number of experts that beat it (larger probability, or equal and a lower index): n_expert² compares
    a token, 16k for 128 experts, nothing next to one expert's rows."""
    rows = tirx.Var("rows", "int64")
    logits = te.placeholder(_i64(rows, n_expert), F32, name="logits")
    e1 = te.reduce_axis(_i64(0, n_expert), name="e1")
    top = te.compute(_i64(rows), lambda r: te.max(logits[r, e1], axis=e1), name="top")
    ex = te.compute(_i64(rows, n_expert), lambda r, e: tirx.exp(logits[r, e] - top[r]), name="exp")
    e2 = te.reduce_axis(_i64(0, n_expert), name="e2")
    total = te.compute(_i64(rows), lambda r: te.sum(ex[r, e2], axis=e2), name="total")
    probs = te.compute(_i64(rows, n_expert), lambda r, e: ex[r, e] * (tirx.const(1.0, F32) / total[r]), name="probs")
    o = te.reduce_axis(_i64(0, n_expert), name="o")
    rank = te.compute(
        _i64(rows, n_expert),
        lambda r, e: te.sum(tirx.Select(tirx.Or(probs[r, o] > probs[r, e], tirx.And(probs[r, o] == probs[r, e], o < e)),
                                        1, 0), axis=o),
        name="rank")
    e3 = te.reduce_axis(_i64(0, n_expert), name="e3")
    ids = te.compute(_i64(rows, used), lambda r, j: te.sum(tirx.Select(rank[r, e3] == j, e3.var.astype("int32"), 0),
                                                           axis=e3), name="ids")
    e4 = te.reduce_axis(_i64(0, n_expert), name="e4")
    chosen = te.compute(_i64(rows, used), lambda r, j: te.sum(
        tirx.Select(rank[r, e4] == j, probs[r, e4], tirx.const(0.0, F32)), axis=e4), name="chosen")
    weights = chosen
    if norm_w:
        jj = te.reduce_axis(_i64(0, used), name="jj")
        norm = te.compute(_i64(rows), lambda r: te.sum(chosen[r, jj], axis=jj), name="norm")
        weights = te.compute(_i64(rows, used), lambda r, j: chosen[r, j] / norm[r], name="weights")
    return te.create_prim_func([logits, ids, weights]).with_attr("global_symbol", name)


def sort_func(n_expert: int, used: int, name: str) -> tirx.PrimFunc:
    """The (token, slot) rows grouped by expert, a counting sort (stable: tokens in order within an expert): ids (P,)
    int32 → experts (P,) the expert of sorted row q, tokens (P,) its token (its source row // used), inverse (P,)
    the sorted position of row p. Serial: P + n_expert steps, nothing next to the expert matmuls."""

    # fmt: off
    @T.prim_func(s_tir=True)
    def sort(ids_h: T.handle, experts_h: T.handle, tokens_h: T.handle, inverse_h: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True, "tirx.is_scheduled": True})
        rows = T.int64()
        ids = T.match_buffer(ids_h, (rows,), "int32")
        experts = T.match_buffer(experts_h, (rows,), "int32")
        tokens = T.match_buffer(tokens_h, (rows,), "int32")
        inverse = T.match_buffer(inverse_h, (rows,), "int32")
        with T.sblock("root"):  # Relax's pattern analysis wants one root block
            start = T.alloc_buffer((n_expert + 1,), "int32")
            for e in range(n_expert + 1):
                start[e] = 0
            for p in range(rows):
                start[ids[p] + 1] = start[ids[p] + 1] + 1
            for e in range(n_expert):
                start[e + 1] = start[e + 1] + start[e]
            for p in range(rows):
                q = start[ids[p]]
                experts[q] = ids[p]
                tokens[q] = T.Cast("int32", p // used)
                inverse[p] = q
                start[ids[p]] = q + 1
    # fmt: on

    return sort


def _gpu_route(n_expert: int, used: int, norm_w: bool, name: str) -> tirx.PrimFunc:
    """route_func's result on a GPU in one kernel: a thread per row (schedules/gpu/moe.expert_route)."""
    from luce_schedules.gpu.moe import expert_route

    return expert_route(n_expert, used, norm_w, name)


def _gpu_sort(n_expert: int, used: int, name: str) -> tirx.PrimFunc:
    """sort_func's result on a GPU: one block, a thread per expert (schedules/gpu/moe.expert_sort)."""
    from luce_schedules.gpu.moe import expert_sort

    return expert_sort(n_expert, used, name)


def _gathered(n_out: int, experts: te.Tensor, tokens: te.Tensor | None):
    """(activation row, weight row) of output row q and column n: tokens[q] (or q itself), expert experts[q]'s row n."""
    xrow = (lambda q: q) if tokens is None else (lambda q: tokens[q].astype("int64"))
    return xrow, (lambda q, n: experts[q].astype("int64") * n_out + n)


def _row_inputs(gather: bool) -> tuple[tirx.Var, tirx.Var, te.Tensor, te.Tensor | None]:
    p_rows = tirx.Var("rows", "int64")
    x_rows = tirx.Var("tokens", "int64") if gather else p_rows
    experts = te.placeholder(_i64(p_rows), "int32", name="experts")
    tokens = te.placeholder(_i64(p_rows), "int32", name="tokens") if gather else None
    return p_rows, x_rows, experts, tokens


def expert_matmul(qtype, n_expert: int, n_out: int, n_in: int, gather: bool, name: str,
                  grouped: bool = False) -> tirx.PrimFunc:
    """float32: (x (X, n_in), experts (P,) int32, [tokens (P,) int32], *planes (n_expert·n_out, …)) → y (P, n_out),
    y[q] = x[tokens[q] if gather else q] @ W[experts[q]].T, W dequantized in the kernel (quant_matmul.dequant_expr).
    `grouped`: also the grouped 8-bit GEMM's form above grouped_above rows (GROUPED_ATTR): the quantized input's
    scratch (lower/q8_gemm.scratch_specs, X rows) as more outputs after y, unused by this computation."""
    p_rows, x_rows, experts, tokens = _row_inputs(gather)
    x = te.placeholder(_i64(x_rows, n_in), F32, name="x")
    planes = weight_planes(qtype, n_expert * n_out, n_in)
    xrow, wrow = _gathered(n_out, experts, tokens)
    k = te.reduce_axis(_i64(0, n_in), name="k")
    y = te.compute(_i64(p_rows, n_out), lambda p, n: te.sum(
        x[xrow(p), k] * dequant_expr(qtype, planes, wrow(p, n), k), axis=k), name="expert_matmul")
    rows = [experts] if tokens is None else [experts, tokens]
    scratch = []
    if grouped:
        fmt = q8_gemm_format(qtype)
        scratch = [te.placeholder(_i64(x_rows, shape[1]), dtype, name=arg)
                   for arg, (shape, dtype) in scratch_specs(fmt, n_in).items()]
    func = te.create_prim_func([x, *rows, *planes.values(), y, *scratch]).with_attr("global_symbol", name)
    func = func.with_attr(EXPERT_ATTR, qtype.name)
    return func.with_attr(GROUPED_ATTR, [n_expert, int(gather)]) if grouped else func


def takes_grouped_gemm(m, qtype, n_in: int, n_rows) -> bool:  # noqa: ANN001  (the GraphModule)
    """Whether an expert matmul gets the grouped 8-bit GEMM form: CUDA with precision f16 and --prefill-gemm q8 (the
    dense matmuls' rule, relax_model._matmul_func), a weight type and K the 8-bit GEMM takes, rows known only at
    run time (a prompt; decode1's few rows are static)."""
    return (m.target.kind.name == "cuda" and m.precision == "f16" and m.options.prefill_gemm == "q8"
            and m.options.dtype == F32 and not isinstance(n_rows, int) and q8_gemm_format(qtype) is not None
            and n_in % 32 == 0)


def int8_expert_matmul(qtype, n_expert: int, n_out: int, n_in: int, gather: bool, name: str) -> tirx.PrimFunc:
    """8-bit activations: (xq, xd, [xs], [xb], [xi] of X rows, experts (P,), [tokens (P,)], *planes) → y (P, n_out),
    each row llama.cpp's vec_dot of its expert's weight row with its token's quantized row (cpu_int8.int8_dot)."""
    qtype, fmt = checked_int8_type(qtype, n_in)
    p_rows, x_rows, experts, tokens = _row_inputs(gather)
    acts = {n: te.placeholder(_i64(*shape), dtype, name=n) for n, (shape, dtype) in fmt.specs(n_in, x_rows).items()}
    planes = weight_planes(qtype, n_expert * n_out, n_in)
    xrow, wrow = _gathered(n_out, experts, tokens)
    y = int8_dot(qtype, acts, planes, p_rows, n_out, n_in, xrow, wrow)
    rows = [experts] if tokens is None else [experts, tokens]
    func = te.create_prim_func([*acts.values(), *rows, *planes.values(), y]).with_attr("global_symbol", name)
    return func.with_attr(EXPERT_ATTR, qtype.name)


def _experts(m, x: nn.Tensor, tensor: str, rows: list[nn.Tensor], n_rows) -> nn.Tensor:
    """The chosen experts' rows of one stacked tensor: rows = [experts] (x already in sorted order) or [experts,
    tokens] (x per token); x (X, K) → (n_rows, N) in sorted order."""
    info = m.graph.weights[tensor]
    n_expert, n, k = info.shape
    qname = info.ggml_type.name.lower()
    fmt = int8_format(info.ggml_type) if m.precision == "int8" else None
    gather = len(rows) == 2
    suffix = f"{qname}_{n_expert}x{n}x{k}{'_gather' if gather else ''}"
    out = nn.Tensor.placeholder((n_rows, n), F32)
    if fmt is None:
        grouped = takes_grouped_gemm(m, info.ggml_type, k, n_rows)
        func = m._kernel(("moe_mm", info.ggml_type, n_expert, n, k, gather, grouped), lambda: expert_matmul(
            info.ggml_type, n_expert, n, k, gather, f"expert_matmul_{suffix}{'_grouped' if grouped else ''}",
            grouped))
        if not grouped:
            return op.tensor_ir_op(func, func.attrs["global_symbol"], [x, *rows, *m._planes(tensor)], out)
        scratch = scratch_tensors(info.ggml_type, k, x.shape[0])
        return op.tensor_ir_op(func, func.attrs["global_symbol"], [x, *rows, *m._planes(tensor)], [out, *scratch])[0]
    key = (id(x), fmt)
    if key not in m._quantized:  # gate and up quantize their shared input once (cpu_int8.int8_linear's cache)
        quantize = m._kernel(("q8", fmt, k, "dynamic"), lambda: quantize_q8(k, fmt, batch="dynamic"))
        x_rows = x.shape[0]
        outs = [nn.Tensor.placeholder(shape, dtype) for shape, dtype in fmt.specs(k, x_rows).values()]
        m._quantized[key] = (x, op.tensor_ir_op(quantize, quantize.attrs["global_symbol"], [x], outs))
    quantized = list(m._quantized[key][1])
    func = m._kernel(("moe_int8", info.ggml_type, n_expert, n, k, gather), lambda: int8_expert_matmul(
        info.ggml_type, n_expert, n, k, gather, f"int8_expert_matmul_{suffix}"))
    return op.tensor_ir_op(func, func.attrs["global_symbol"], [*quantized, *rows, *m._planes(tensor)], out)


def _biased(m, y: nn.Tensor, o: Op, role: str, experts: nn.Tensor) -> nn.Tensor:
    """y (P, N) in sorted order plus each row's expert's row of the op's (n_expert, N) bias, where it has one."""
    if role not in o.weights:
        return y
    (bias,) = m._planes(o.weights[role])  # F32 (n_expert, N): the rows are taken as they are
    return y + op.take(bias, experts, axis=0)


def _glu(a, gate: nn.Tensor, up: nn.Tensor) -> nn.Tensor:  # noqa: ANN001  (the op's attrs)
    """The experts' gated activation (OpKind.MOE): SwiGLU, GeGLU or ggml_swiglu_oai."""
    if a["activation"] == "swiglu_oai":
        limit, floor = nn.Tensor.from_scalar(a["limit"], F32), nn.Tensor.from_scalar(-a["limit"], F32)
        g = op.minimum(gate, limit)
        u = op.minimum(op.maximum(up, floor), limit)
        return g * op.sigmoid(g * a["alpha"]) * (u + 1.0)
    return (op.silu(gate) if a["activation"] == "silu" else op.gelu(gate, approximate="tanh")) * up


def lower_moe(m, o: Op, ins: list, **_) -> nn.Tensor:
    """relax_model's lowering of one MOE op (module docstring); m is the GraphModule."""
    check_target(m.target.kind.name, m.graph.config.arch)
    a, w = o.attrs, o.weights
    x = ins[0]
    b, s, e = x.shape
    used = a["n_expert_used"]
    x2 = op.reshape(x, (b * s, e))  # (R, E)
    logits = m.linear(x2, w["gate_inp"], w.get("gate_inp_b"))  # (R, n_expert)
    norm = a["norm_w"] or a.get("gating", "softmax") == "softmax_weight"  # the same weights (module docstring)
    route_kernel = route_func if m.target.kind.name == "llvm" else _gpu_route
    route = m._kernel(("moe_route", a["n_expert"], used, norm), lambda: route_kernel(
        a["n_expert"], used, norm, f"moe_route_{a['n_expert']}_top{used}{'_norm' if norm else ''}"))
    ids, weights = op.tensor_ir_op(route, route.attrs["global_symbol"], [logits], [
        nn.Tensor.placeholder((b * s, used), "int32"), nn.Tensor.placeholder((b * s, used), F32)])
    rows = b * s * used
    flat = op.reshape(ids, (rows,))  # (P,): row p = token p // used, slot p % used
    if isinstance(rows, int):
        # rows known when compiling (a decode step of one sequence): a GEMV's rows are independent of their order,
        # so they stay in token order, with no sort and no gather back (two kernels a layer fewer)
        experts, tokens, inverse = flat, nn.Tensor.from_const(np.arange(rows, dtype=np.int32) // used), None
    else:
        sort_kernel = sort_func if m.target.kind.name == "llvm" else _gpu_sort
        sort = m._kernel(("moe_sort", a["n_expert"], used), lambda: sort_kernel(
            a["n_expert"], used, f"moe_sort_{a['n_expert']}_top{used}"))
        experts, tokens, inverse = op.tensor_ir_op(sort, sort.attrs["global_symbol"], [flat], [
            nn.Tensor.placeholder((rows,), "int32") for _ in range(3)])
    # rows grouped by expert: consecutive rows read one expert's weights, which stay in cache (prefill's grouping)
    gate = _biased(m, _experts(m, x2, w["gate_exps"], [experts, tokens], rows), o, "gate_exps_b", experts)  # (P, F)
    up = _biased(m, _experts(m, x2, w["up_exps"], [experts, tokens], rows), o, "up_exps_b", experts)
    down = _biased(m, _experts(m, _glu(a, gate, up), w["down_exps"], [experts], rows), o, "down_exps_b", experts)
    if inverse is not None:
        down = op.take(down, inverse, axis=0)  # (P, E), token order
    slots = op.reshape(down, (b * s, used, e)) * op.reshape(weights, (b * s, used, 1))
    return op.reshape(op.sum(slots, axis=1), (b, s, e))
