"""The float32 matvec body: a lane per 8-value granule of a row, the weights dequantized in registers
(`quant_matmul.dequant_expr`, the per-op kernels' expression; each plane word loaded once a granule: _Granule),
F32/F16/BF16 rows read as 16-byte words."""

from __future__ import annotations

from tvm import DataType, tirx
from tvm.tirx.script.builder import ir as B

from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda.core import F32, i32
from luce_compile.lower.quant_matmul import dequant_expr, exact_int_to_float

FLOAT_WORDS = ("F32", "F16", "BF16")  # weight types whose matvec granules are read as 16-byte words


class _Granule:
    """The planes of a stacked weight while one granule (8 values) is dequantized, and the integer-to-float
    conversion: the eight dequant_expr calls of a granule read the same quant word and the same scales (K-quants:
    d, dmin, sc, mn; Q5/Q6: the high-bit word) and convert the same scale integers, each of them eight times in the
    CUDA the IR builder writes. Here each distinct load and each conversion of a loaded scale goes into a register
    once (the source of a K-quant matvec shrinks several-fold, and with it nvcc's time); the arithmetic is
    dequant_expr's, so the values are the same to the bit."""

    def __init__(self, planes: dict[str, tirx.Buffer], layer: tirx.Expr, analyzer):
        self.layer, self.analyzer = layer, analyzer
        self.cache: dict[tuple, tirx.Buffer] = {}  # load (or conversion) key → the register holding it
        self.planes = {name: _GranulePlane(self, buf) for name, buf in planes.items()}

    def once(self, key: tuple, dtype: str, value: tirx.Expr) -> tirx.Expr:
        if key not in self.cache:
            reg = B.alloc_buffer((1,), dtype, scope="local")
            B.buffer_store(reg, value, [i32(0)])
            self.cache[key] = reg
        return self.cache[key][0]

    def int_to_float(self, value: tirx.Expr) -> tirx.Expr:
        # a load is a tvm.ir.expr.TensorLoad in TVM 0.27, its buffer in `source`; TIR variables compare by
        # building an expression, not by identity: same_as, not a dict
        src = getattr(value, "source", None)
        key = next((k for k, reg in self.cache.items() if src is not None and src.same_as(reg)), None)
        if key is not None:  # a loaded integer (a scale, a min; Q8_0's quant): converted once
            return self.once(("itof", *key), F32, exact_int_to_float(value))
        return exact_int_to_float(value)


class _GranulePlane:
    def __init__(self, granule: _Granule, buf: tirx.Buffer):
        self.granule, self.buf = granule, buf

    def __getitem__(self, idx):
        g = self.granule
        idx = tuple(g.analyzer.simplify(i) for i in idx)
        return g.once((self.buf.name, *(str(i) for i in idx)), self.buf.dtype, self.buf[(g.layer, *idx)])


class FloatLanesMixin:
    def _float_pass(self, op, unit, rows: int, r0, hi, g, granules: int, staged: bool, xval, acc, xv, wv) -> None:
        """One granule (8 features) of `rows` rows of each matmul, dequantized to float32, times every sequence."""
        nb = self.nb
        for b in range(nb):
            for j in range(8):
                x = self.smem[(b * 8 + j) * granules + g] if staged else xval(b, g * 8 + j)
                self.store(xv, b * 8 + j, x)
        types = self._weight_types(unit)
        if any(t not in FLOAT_WORDS for t in types):
            # the granule index in a register: its eight values' indices are then `g * 8 + j`, whose blocks
            # (k // 32, k // 256) the analyzer sees are one (_Granule loads each word once)
            g_reg = self.local("int32")
            self.store(g_reg, 0, g)
            g = g_reg[0]
        for m_i, m in enumerate(unit.matmuls):
            for r in range(rows):
                row = tirx.min(r0 + r, hi - 1)  # past the tile: a valid row, its result unused
                if types[m_i] in FLOAT_WORDS:
                    self._float_words(self.weight(op, m.weights["weight"])["w"], types[m_i], row, g, wv)
                else:  # the granule dequantized once, into registers, for every sequence; each plane's word
                    # loaded once for its eight values
                    gr = _Granule(self.weight(op, m.weights["weight"]), self.col(P.LAYER), self.analyzer)
                    for j in range(8):
                        self.store(wv, j, dequant_expr(types[m_i], gr.planes, row, g * 8 + j, gr.int_to_float))
                for j in range(8):
                    for b in range(nb):
                        a = (m_i * rows + r) * nb + b
                        self.store(acc, a, acc[a] + wv[j] * xv[b * 8 + j])

    def _float_words(self, plane: tirx.Buffer, ggml_type: str, row, g, wv) -> None:
        """Granule g of a float weight row into wv as float32, read as 16-byte words (one for F16/BF16, two for
        F32): the element-wise dequant read each value alone (eight 2-byte loads a granule for BF16: the 1B body's
        BF16 step spent 977 of its 1,433 µs in matvec bodies at 1.4 TB/s on the H200). The values are the ones
        dequant_expr gives, so the sums are the same to the bit."""
        words = self._word_view(plane)
        layer = self.col(P.LAYER)
        per_granule = 8 * DataType(plane.dtype).bits // 32  # words of 8 values
        wq = self.local("uint32", per_granule)
        for i in range(0, per_granule, 4):
            B.buffer_store(wq, words.vload([layer, row, g * per_granule + i], "uint32x4"),
                           [tirx.Ramp(i32(i), i32(1), 4)])
        sixteen, low, high = tirx.const(16, "uint32"), tirx.const(0xFFFF, "uint32"), tirx.const(0xFFFF0000, "uint32")
        for j in range(8):
            if ggml_type == "F32":
                v = tirx.reinterpret(F32, wq[j])
            elif ggml_type == "BF16":  # the top half of a float32: the low value shifted up, the high one masked
                v = tirx.reinterpret(F32, wq[j // 2] << sixteen if j % 2 == 0 else wq[j // 2] & high)
            else:  # F16: little-endian halves of the word
                half = wq[j // 2] & low if j % 2 == 0 else wq[j // 2] >> sixteen
                v = tirx.reinterpret("float16", half.astype("uint16")).astype(F32)
            self.store(wv, j, v)
