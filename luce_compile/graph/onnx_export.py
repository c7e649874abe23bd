"""Export the dequantized graph as a float32 ONNX model: onnxruntime then gives a third, independent reference.

The export is the prefill of whole sequences without a KV cache: inputs `tokens` and `positions` (B,S) int64,
output `logits` (B,S,V) float32. It uses standard opset-17 ops only (Gather, MatMul, Transpose, ReduceMean, Sqrt,
Softmax, Tanh, Sigmoid, Where, …). Each GGUF weight becomes one float32 initializer under its GGUF name, in its
numpy shape; linear layers multiply by a Transpose of it (constant-folded by onnxruntime), so a tied embedding is
stored once. RoPE reads cos/sin tables computed in float64, so the export's only rounding is float32 arithmetic.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from luce_compile.errors import LuceError, UnsupportedError
from luce_compile.gguf.reader import GGUFFile
from luce_compile.graph.ir import LOGITS, POSITIONS, TOKENS, Graph, Op, OpKind
from luce_compile.graph.registry import open_graph


class MissingExtraError(LuceError, ImportError):
    """ONNX export's packages are an extra: compiling, running and serving never need them."""


_INSTALL_ONNX = "ONNX export needs the onnx extra: pip install -e '.[onnx]' (onnx, onnxruntime)"

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as err:
    raise MissingExtraError(f"{_INSTALL_ONNX}; {err}.") from err

log = logging.getLogger(__name__)

OPSET = 17
MAX_PARAMS = 200_000_000  # float32 initializers of larger models approach protobuf's 2 GB limit, and crawl on CPU
DEFAULT_MAX_POSITIONS = 4096  # rows of the RoPE tables when the caller does not say


class _Emitter:
    """Collects ONNX nodes and initializers; names every intermediate uniquely."""

    def __init__(self, gguf: GGUFFile, max_positions: int):
        self.gguf, self.max_positions = gguf, max_positions
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.cache: dict[object, str] = {}  # shared subgraphs: rope tables, masks
        self.n = 0

    def node(self, op_type: str, inputs: list[str], name: str | None = None, **attrs: object) -> str:
        self.n += 1
        out = name or f"{op_type.lower()}_{self.n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self.n}_{op_type}", **attrs))
        return out

    def const(self, value: np.ndarray | float | list[int], dtype: type = np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = ("const", arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.cache:
            self.cache[key] = f"const_{len(self.inits)}"
            self.inits[self.cache[key]] = numpy_helper.from_array(arr, self.cache[key])
        return self.cache[key]

    def weight(self, name: str) -> str:
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(self.gguf.dequantize(name).astype(np.float32), name)
        return name

    def linear(self, x: str, op: Op, out: str) -> str:
        wt = self.cache.get(("T", op.weights["weight"]))
        if wt is None:
            wt = self.cache[("T", op.weights["weight"])] = self.node("Transpose", [self.weight(op.weights["weight"])])
        y = self.node("MatMul", [x, wt], None if "bias" in op.weights else out)
        return self.node("Add", [y, self.weight(op.weights["bias"])], out) if "bias" in op.weights else y

    def scale(self, x: str, s: float, out: str | None = None) -> str:
        return self.node("Mul", [x, self.const(s)], out)


def _rms_norm(e: _Emitter, op: Op, x: str, out: str) -> str:
    ms = e.node("ReduceMean", [e.node("Mul", [x, x])], axes=[-1], keepdims=1)
    rms = e.node("Sqrt", [e.node("Add", [ms, e.const(op.attrs["eps"])])])
    return e.node("Mul", [e.node("Div", [x, rms]), e.weight(op.weights["weight"])], out)


def _rope_tables(e: _Emitter, op: Op) -> tuple[str, str]:
    """cos/sin (max_positions, dim/2) as initializers, gathered by position → (B,S,1,dim/2)."""
    a = op.attrs
    key = ("rope", a["dim"], a["base"], a["freq_scale"], op.weights.get("freq_factors"))
    if key not in e.cache:
        inv_freq = a["freq_scale"] * a["base"] ** (-2.0 * np.arange(a["dim"] // 2) / a["dim"])
        if "freq_factors" in op.weights:
            inv_freq = inv_freq / e.gguf.dequantize(op.weights["freq_factors"]).astype(np.float64)
        theta = np.arange(e.max_positions, dtype=np.float64)[:, None] * inv_freq
        cos, sin = (e.node("Unsqueeze", [e.node("Gather", [e.const(t), POSITIONS]), e.const([2], np.int64)])
                    for t in (np.cos(theta), np.sin(theta)))
        e.cache[key] = (cos, sin)
    return e.cache[key]


def _rope(e: _Emitter, op: Op, x: str, out: str, head_dim: int) -> str:
    dim, norm = op.attrs["dim"], op.attrs["layout"] == "norm"
    cos, sin = _rope_tables(e, op)
    i64 = np.int64

    def part(start: int, end: int, step: int) -> str:
        return e.node("Slice", [x, e.const([start], i64), e.const([end], i64), e.const([-1], i64),
                                e.const([step], i64)])

    x0, x1 = (part(0, dim, 2), part(1, dim, 2)) if norm else (part(0, dim // 2, 1), part(dim // 2, dim, 1))
    r0 = e.node("Sub", [e.node("Mul", [x0, cos]), e.node("Mul", [x1, sin])])
    r1 = e.node("Add", [e.node("Mul", [x0, sin]), e.node("Mul", [x1, cos])])
    if norm:  # interleave back: (B,S,H,dim/2,2) → (B,S,H,dim)
        pairs = e.node("Concat", [e.node("Unsqueeze", [r, e.const([-1], i64)]) for r in (r0, r1)], axis=-1)
        rotated = e.node("Reshape", [pairs, e.const([0, 0, 0, dim], i64)])
    else:
        rotated = e.node("Concat", [r0, r1], axis=-1)
    if dim == head_dim:
        return e.node("Identity", [rotated], out)
    return e.node("Concat", [rotated, part(dim, head_dim, 1)], out, axis=-1)


def _visible(e: _Emitter, window: int) -> str:
    """(B,1,1,S,S) bool: key j visible to query i iff 0 ≤ pos_i − pos_j (< window when sliding)."""
    if ("mask", window) not in e.cache:
        i64 = np.int64
        delta = e.node("Sub", [e.node("Unsqueeze", [POSITIONS, e.const([2], i64)]),
                               e.node("Unsqueeze", [POSITIONS, e.const([1], i64)])])  # (B,S,S)
        vis = e.node("GreaterOrEqual", [delta, e.const(0, i64)])
        if window:
            vis = e.node("And", [vis, e.node("Less", [delta, e.const(window, i64)])])
        e.cache[("mask", window)] = e.node("Unsqueeze", [vis, e.const([1, 2], i64)])
    return e.cache[("mask", window)]


def _attention(e: _Emitter, op: Op, q: str, k: str, v: str, out: str) -> str:
    a, i64 = op.attrs, np.int64
    h, hkv = a["n_head"], a["n_head_kv"]
    qg = e.node("Reshape", [q, e.const([0, 0, hkv, h // hkv, -1], i64)])  # (B,S,Hkv,rep,D)
    qg = e.node("Transpose", [qg], perm=[0, 2, 3, 1, 4])  # (B,Hkv,rep,S,D)
    kt = e.node("Unsqueeze", [e.node("Transpose", [k], perm=[0, 2, 3, 1]), e.const([2], i64)])  # (B,Hkv,1,D,S)
    s = e.node("MatMul", [qg, kt])  # (B,Hkv,rep,S,S)
    if a["softcap"]:
        s = e.scale(e.node("Tanh", [e.scale(s, 1.0 / a["softcap"])]), a["softcap"])
    if a["scale"] != 1.0:
        s = e.scale(s, a["scale"])
    s = e.node("Where", [_visible(e, a["sliding_window"]), s, e.const(-np.inf)])
    p = e.node("Softmax", [s], axis=-1)
    vt = e.node("Unsqueeze", [e.node("Transpose", [v], perm=[0, 2, 1, 3]), e.const([2], i64)])  # (B,Hkv,1,S,Dv)
    o = e.node("Transpose", [e.node("MatMul", [p, vt])], perm=[0, 3, 1, 2, 4])  # (B,S,Hkv,rep,Dv)
    return e.node("Reshape", [o, e.const([0, 0, -1], i64)], out)


def _glu(e: _Emitter, op: Op, gate: str, up: str, out: str) -> str:
    if op.attrs["activation"] == "silu":
        act = e.node("Mul", [gate, e.node("Sigmoid", [gate])])
    else:  # ggml_gelu: 0.5·x·(1 + tanh(sqrt(2/π)·x·(1 + 0.044715·x²)))
        inner = e.node("Add", [e.const(1.0), e.scale(e.node("Mul", [gate, gate]), 0.044715)])
        t = e.node("Tanh", [e.scale(e.node("Mul", [gate, inner]), float(np.sqrt(2.0 / np.pi)))])
        act = e.node("Mul", [e.scale(gate, 0.5), e.node("Add", [e.const(1.0), t])])
    return e.node("Mul", [act, up], out)


def _emit(e: _Emitter, op: Op, graph: Graph) -> None:
    ins, out = list(op.inputs), op.outputs[0]
    match op.kind:
        case OpKind.EMBEDDING:
            rows = e.node("Gather", [e.weight(op.weights["weight"]), TOKENS], None if op.attrs["scale"] != 1 else out)
            if op.attrs["scale"] != 1:
                e.scale(rows, op.attrs["scale"], out)
        case OpKind.RMS_NORM:
            _rms_norm(e, op, ins[0], out)
        case OpKind.MATMUL | OpKind.LM_HEAD:
            e.linear(ins[0], op, out)
        case OpKind.RESHAPE:
            assert tuple(op.attrs["shape"][:2]) == ("B", "S"), op
            e.node("Reshape", [ins[0], e.const([0, 0, *op.attrs["shape"][2:]], np.int64)], out)
        case OpKind.ROPE:
            _rope(e, op, ins[0], out, graph.config.head_dim)
        case OpKind.SCALE:
            e.scale(ins[0], op.attrs["scale"], out)
        case OpKind.ATTENTION:
            _attention(e, op, *ins[:3], out)
        case OpKind.ADD:
            e.node("Add", ins, out)
        case OpKind.GLU:
            _glu(e, op, *ins, out)
        case OpKind.SOFTCAP:
            e.scale(e.node("Tanh", [e.scale(ins[0], 1.0 / op.attrs["cap"])]), op.attrs["cap"], out)
        case _:
            raise UnsupportedError(f"onnx export: op kind {op.kind} has no ONNX translation yet.")


def export_onnx(source: Graph | GGUFFile | str | Path, path: str | Path | None = None,
                max_positions: int | None = None) -> onnx.ModelProto:
    """The graph as a float32 ONNX model (saved to `path` when given). Positions must stay below max_positions
    (default: the training context, at most 4096)."""
    graph, gguf = open_graph(source)
    if graph.n_params > MAX_PARAMS:
        raise UnsupportedError(
            f"onnx export: {graph.config.arch} model {gguf.path.name} has {graph.n_params / 1e6:.0f} M parameters; "
            f"the export is for small models (≤ {MAX_PARAMS // 1_000_000} M), since it stores every weight as "
            "float32. Use the oracle (luce_compile.graph.oracle) as the reference for larger models.")
    e = _Emitter(gguf, max_positions or min(graph.config.n_ctx_train, DEFAULT_MAX_POSITIONS))
    for op in graph.ops:
        _emit(e, op, graph)
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, ["B", "S"]) for n in (TOKENS, POSITIONS)]
    logits = helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["B", "S", graph.config.n_vocab])
    body = helper.make_graph(e.nodes, f"luce_{graph.config.arch}", ints, [logits], list(e.inits.values()))
    model = helper.make_model(body, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="luce-compile")
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, str(path))
        log.info("onnx export: wrote %s (%d nodes, %.1f M parameters)", path, len(e.nodes), graph.n_params / 1e6)
    return model


def run_onnx(model: onnx.ModelProto | str | Path, tokens: np.ndarray, positions: np.ndarray | None = None
             ) -> np.ndarray:
    """Logits (B,S,V) from onnxruntime on the CPU. Only basic graph optimizations (constant folding), so that
    onnxruntime's fused kernels do not change the arithmetic being compared."""
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise MissingExtraError(f"{_INSTALL_ONNX}; {err}.") from err

    tokens = np.atleast_2d(np.asarray(tokens, dtype=np.int64))
    if positions is None:
        positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int64), tokens.shape)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    blob = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
    return session.run([LOGITS], {TOKENS: tokens, POSITIONS: np.ascontiguousarray(positions, dtype=np.int64)})[0]
