"""Emit the megakernel: one persistent TIRx PrimFunc that runs a Program's task table (fuse/program.py).

One block per SM, 512 threads (16 warps). Each block walks its queue of the task table; per task, a thread per
counter waits on the task's counters (acquire), the block runs the task's opcode, and thread 0 publishes (fence,
then the task's and its stage's counters). Opcode bodies are generated from the op kinds of their first stage, in
TensorIR through TVMScript's IR builder; the dequantization of every weight type is `quant_matmul.dequant_expr`,
the same expression the per-op kernels use.

Task bodies:
  matvec        the prologue RMS norm's scale per sequence (a block reduction), the input staged in shared memory
                (transposed by 8-value granule so a warp's lanes read consecutive words) when it fits; each warp
                runs several rows at once for all sequences, lanes stride over granules, a warp sum per output; the
                tile's outputs go to shared memory, where the epilogue ops run (elementwise, per-head norms,
                RoPE); then the values other stages read go to the arena, keys/values to their pages, and the LM
                head's tile leaves its best logit per sequence. With q8_activations, the tiles of Q4_0/1, Q5_0/1,
                Q8_0 and Q4_K weights quantize the input into 8-bit blocks instead (a thread per 8 features,
                16-byte loads) and dot 8-bit words (dp4a), a lane per 32-value block of a row where K >= 1,024
                (q8_by_block), else per 8 values; with q8_mma on integer tensor cores (mma.m16n8k32, a warp per
                16 rows). F32/F16/BF16 rows are read as 16-byte words
  row           a whole-row op (gemma's post-norms) and its epilogue, for one sequence, in shared memory
  attn_partial  one (sequence, KV head, key chunk): lanes own keys for the scores (online softmax per warp), own
                dimensions for p·v; the warps' partials merge in shared memory; one chunk writes the output,
                several write (o, max, sum) partials that the last of them to finish combines (merge_in_last: an
                arrival counter), or else a merge task (split = -1)
  embed         rows of the embedding table, dequantized, times the scale
  argmax        per sequence, the best of the LM-head tiles (lowest index on ties, as numpy's argmax); with
                `masked` set, only over the tokens whose bit is set in the step's `allowed` words (a grammar's
                mask, llguidance's packing: token t is bit t % 32 of word t // 32), so a constrained greedy step
                still returns only ids
"""

from __future__ import annotations

import math
from contextlib import contextmanager

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.sym import Analyzer
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.build import MMA_FLOAT_TYPES, Q8_ORDER, STATIC_KIB, MegakernelOptions
from luce_compile.fuse.taskgraph import TaskKind
from luce_compile.graph.ir import LOGITS, Op, OpKind
from luce_compile.lower.quant_layout import as_ggml_type, plane_specs
from luce_compile.lower.quant_matmul import dequant_expr, exact_int_to_float

LINE = 128  # bytes per L2 prefetch
SPIN_LIMIT = 1 << 21  # polls (~1 µs each with the back-off) before a wait gives up: seconds
F32 = "float32"
Q8_BLOCK = 32  # activations per 8-bit block (ggml's QK8_0 = QK8_1)
QUANT_AHEAD = 4  # quantize_q8: granules a thread loads before it quantizes any (8 floats each in registers)
MMA_MIN_BLOCKS = 8  # q8_mma: the fewest 32-value blocks a warp's slice of K takes
FLOAT_WORDS = ("F32", "F16", "BF16")  # weight types whose matvec granules are read as 16-byte words
MMA_CHUNK = 32  # float_mma: K values a warp takes per (16 rows, chunk): 4 lanes x one 16-byte word of 8 values
MMA_MIN_CHUNKS = 8  # float_mma: the fewest chunks a warp's slice of K takes
MMA_TILES = 4  # float_mma: (matmul, 16-row tile) fragments a warp accumulates at once; more tiles take rounds


# the 8-bit path's types stored unsigned with an offset (w = d·(q − offset)): the dot starts at −offset·Σq_x (Q6_K's
# per 16 values, each sub-block's sum then scaled by its int8 scale)
Q8_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}


def _fifth_bits(qh: tirx.Expr, gg) -> tuple[tirx.Expr, tirx.Expr]:
    """A Q5 block's fifth bits (qh: bit j of element j of the 32) for granule gg's two nibble words: the even
    elements 8gg + 2i go to bit 4 of byte i of the low-nibble word, the odd ones 8gg + 2i + 1 of the high one."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    x = qh >> (u(8 * gg) if isinstance(gg, int) else (gg * 8).astype("uint32"))

    def spread(v: tirx.Expr) -> tirx.Expr:  # bits 0, 2, 4, 6 → 4, 12, 20, 28
        return ((v & u(1)) << u(4)) | ((v & u(4)) << u(10)) | ((v & u(16)) << u(16)) | ((v & u(64)) << u(22))

    return spread(x), spread(x >> u(1))


def _sixth_bits(qh: tirx.Expr, shift) -> tuple[tirx.Expr, tirx.Expr]:
    """A Q6_K granule's two high bits (qh >> shift: bits 2i of element i of the granule's 8) for its two nibble
    words: the even elements 2i go to bits 4-5 of byte i of the low-nibble word, the odd ones of the high one."""
    u = lambda v: tirx.const(v, "uint32")  # noqa: E731
    x = qh >> (u(shift) if isinstance(shift, int) else shift.astype("uint32"))

    def spread(v: tirx.Expr) -> tirx.Expr:  # bit pairs at 0, 4, 8, 12 → 4, 12, 20, 28
        return ((v & u(0x3)) << u(4)) | ((v & u(0x30)) << u(8)) | ((v & u(0x300)) << u(12)) | \
            ((v & u(0x3000)) << u(16))

    return spread(x), spread(x >> u(2))


def dp4a(a: tirx.Expr, b: tirx.Expr, c: tirx.Expr) -> tirx.Expr:
    """c + the dot of the four signed bytes of a and b (CUDA's __dp4a)."""
    return tirx.call_pure_extern("int32", "__dp4a", a, b, c)


def tf32(v: tirx.Expr) -> tirx.Expr:
    """v rounded to tf32 (10 mantissa bits, to nearest, ties away from zero: cvt.rna.tf32.f32), as a float32 whose 13
    low mantissa bits are zero: what mma.m16n8k8.tf32 reads of a register (it ignores those bits, a truncation)."""
    bits = tirx.reinterpret("uint32", v)
    return tirx.reinterpret(F32, (bits + tirx.const(0x1000, "uint32")) & tirx.const(0xFFFFE000, "uint32"))


def i32(v: int) -> tirx.IntImm:
    return tirx.const(v, "int32")


def f32(v: float) -> tirx.FloatImm:
    return tirx.const(v, F32)


@contextmanager
def _nothing():
    yield


class _Stacked:
    """A plane of a weight stacked over layers, indexed like the unstacked plane (for dequant_expr)."""

    def __init__(self, buf: tirx.Buffer, layer: tirx.Expr):
        self.buf, self.layer = buf, layer

    def __getitem__(self, idx):
        return self.buf[(self.layer, *idx)] if isinstance(idx, tuple) else self.buf[self.layer, idx]


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


class MegakernelEmitter:
    def __init__(self, prog: P.Program, *, name: str, options: MegakernelOptions):
        self.p, self.name, self.kv_dtype = prog, name, options.kv_dtype
        self.prefetch_bytes, self.poll_sleep_ns = options.prefetch_bytes, options.poll_sleep_ns
        self.values = prog.values
        self.nb = prog.batch
        self.threads, self.warps = options.threads, options.threads // 32
        self.unroll_passes = options.unroll_passes
        self.q8 = options.q8_activations
        self.q8_by_block = options.q8_by_block
        self.q8_mma = options.q8_mma
        self.float_mma = options.float_mma
        self.float_mma_ahead = options.float_mma_ahead
        self.float_mma_tiles = options.float_mma_tiles
        self.analyzer = Analyzer()  # _Granule's index simplification
        self.q8_batch = max(options.batches or (self.nb,))  # a stage's q8 choice is the same at every batch size
        # float32 words of shared memory: static up to 48 KiB, dynamic above (TVM's launch raises the limit)
        self.shared_floats = (options.shared_kib or STATIC_KIB) * 256  # 0: no target known here, the static
        # measured (benchmarks/README.md, run4's variants): 32 sums a lane are 10% faster at batch 8, 20% slower at 1
        self.accumulators = options.accumulators or (32 if self.nb >= 4 else 16)

    # ---- small builders -----------------------------------------------------------------------------------------
    def local(self, dtype: str = F32, n: int = 1) -> tirx.Buffer:
        return B.alloc_buffer((n,), dtype, scope="local")

    @staticmethod
    def store(buf: tirx.Buffer, idx, value) -> None:
        B.buffer_store(buf, value, idx if isinstance(idx, list) else [idx])

    @staticmethod
    @contextmanager
    def when(cond):
        with B.If(cond), B.Then():
            yield

    @staticmethod
    def sync() -> None:
        B.evaluate(T.tvm_storage_sync("shared"))

    def cta(self, value: tirx.Expr, how: str, dtype: str = F32) -> tirx.Expr:
        """A block-wide sum/max/min, in every thread."""
        return self.cta_many([value], how, dtype)[0]

    def cta_many(self, values: list[tirx.Expr], how: str, dtype: str = F32) -> tirx.Buffer:
        """Block-wide sums/maxima/minima of several values, in every thread, with one barrier pair for all of them:
        warp results, then the warps in turn, so each is the same to the bit as reduced on its own (TVM's
        cta_reduce redefines the warp helpers warp_reduce defines: nvcc rejects a kernel that uses both)."""
        scratch = self.red if dtype == F32 else self.redi
        for i, value in enumerate(values):
            part = self.local(dtype)  # every lane shuffles: the reduction must not sink into the lane-0 branch
            self.store(part, 0, T.cuda.warp_reduce(value, how, 32))
            with self.when(self.lane == 0):
                self.store(scratch, i * self.warps + self.warp, part[0])
        self.sync()
        out = self.local(dtype, len(values))
        for i in range(len(values)):
            self.store(out, i, scratch[i * self.warps])
            for w in range(1, self.warps):
                x = scratch[i * self.warps + w]
                self.store(out, i, out[i] + x if how == "sum" else (tirx.max(out[i], x) if how == "max"
                                                                     else tirx.min(out[i], x)))
        self.sync()
        return out

    def col(self, c: int) -> tirx.Expr:
        return self.trow[c]

    # ---- arguments ----------------------------------------------------------------------------------------------
    def args(self) -> None:
        p, nb = self.p, self.nb
        kv = p.kv
        max_pages = -(-p.tg.max_context // p.page_size)
        # the KV pool is TVM's own: PagedKVCache keeps one page tensor per layer (pages, 2, kv heads, page size,
        # head dim), each a separate allocation, so the kernel takes layer 0's tensor flat and each layer's offset
        # from it in elements (int64: the allocations may lie far apart, before or after layer 0's)
        self.n_kv = tirx.Var("n_kv", "int64")
        # ids in [0, nb); element nb of the step's token_out is the gave-up marker (wait): one copy back per step
        # tells the host both the ids and whether every block finished. tokens and token_out swap between steps
        self.tokens = B.arg("tokens", B.buffer((nb + 1,), "int32"))
        self.lengths = B.arg("lengths", B.buffer((nb,), "int32"))
        self.page_table = B.arg("page_table", B.buffer((nb, max_pages), "int32"))
        self.pages = B.arg("pages", B.buffer((self.n_kv,), self.kv_dtype))
        self.kv_offset = B.arg("kv_layer_offset", B.buffer((kv["n_layers"],), "int64"))
        self.arena = B.arg("arena", B.buffer((p.arena_size,), F32))
        self.amax_val = B.arg("amax_val", B.buffer((nb, max(1, p.lm_tiles)), F32))
        self.amax_idx = B.arg("amax_idx", B.buffer((nb, max(1, p.lm_tiles)), "int32"))
        self.token_out = B.arg("token_out", B.buffer((nb + 1,), "int32"))
        # the next step's lengths: a greedy loop swaps (tokens, lengths) with (token_out, lengths_out) and launches
        # nothing else between steps
        self.lengths_out = B.arg("lengths_out", B.buffer((nb,), "int32"))
        self.tasks = B.arg("tasks", B.buffer(tuple(int(d) for d in p.tasks.shape), "int32"))
        self.queue_len = B.arg("queue_len", B.buffer((len(p.queue_len),), "int32"))
        self.deps = B.arg("deps", B.buffer(tuple(int(d) for d in p.deps.shape), "int32"))
        self.counters = B.arg("counters", B.buffer((p.n_counters,), "int32"))
        # per block: (queue position + 1, counter, target, value seen) of a wait that gave up (see `wait`)
        self.status = B.arg("status", B.buffer((len(p.queue_len), 4), "int32"))
        # per task (block, queue position): ns when its wait began, when its body began, when it finished;
        # written only when `profiling` is nonzero
        self.profile = B.arg("profile", B.buffer((len(p.queue_len), int(p.tasks.shape[1]), P.PROFILE_CLOCKS),
                                                 "int64"))
        self.profiling = B.arg("profiling", tirx.Var("profiling", "int32"))
        self.epoch = B.arg("epoch", tirx.Var("epoch", "int32"))
        # a grammar's token mask per sequence, read by the LM head's argmax only when `masked` is nonzero: a row
        # whose mask allows none of a tile's tokens leaves (lowest float, INT32_MAX) there, and the step's id is
        # INT32_MAX when it allows none at all (the runtime reports that row)
        self.allowed = B.arg("allowed", B.buffer((nb, -(-p.width(LOGITS) // 32)), "int32"))
        self.masked = B.arg("masked", tirx.Var("masked", "int32"))
        self.weights: dict[tuple[int, int], dict[str, tirx.Buffer] | tirx.Buffer] = {}
        for name, o, s in p.weight_args():
            op = p.opcodes[o]
            info = p.graph.weights[op.weights[s]]
            g = len(op.stages)
            if len(info.shape) == 1:  # norms, biases, rope factors: float32 vectors
                self.weights[(o, s)] = B.arg(name, B.buffer((g, info.shape[0]), F32))
            else:
                specs = plane_specs(info.ggml_type, *info.shape)
                self.weights[(o, s)] = {pl: B.arg(f"{name}_{pl}", B.buffer((g, *shape), dt))
                                        for pl, (shape, dt) in specs.items()}

    def weight(self, op: P.Opcode, tensor: str):
        return self.weights[(op.index, op.weights.index(tensor))]

    def vector(self, op: P.Opcode, tensor: str, i) -> tirx.Expr:
        return self.weight(op, tensor)[self.col(P.LAYER), i]

    def dequant(self, op: P.Opcode, tensor: str, n, k) -> tirx.Expr:
        planes = {pl: _Stacked(buf, self.col(P.LAYER)) for pl, buf in self.weight(op, tensor).items()}
        return dequant_expr(self.p.graph.weights[tensor].ggml_type, planes, n, k, exact_int_to_float)

    # ---- the kernel ---------------------------------------------------------------------------------------------
    def build(self) -> tirx.PrimFunc:
        p = self.p
        with IRBuilder() as ib, B.prim_func():
            B.func_name(self.name)
            self.args()
            bx, tx = B.env_thread("blockIdx.x"), B.env_thread("threadIdx.x")
            with B.launch_thread(bx, len(p.queue_len)), B.launch_thread(tx, self.threads):
                self.tx, self.warp, self.lane = tx, tx // 32, tx % 32
                scope = "shared.dyn" if self.shared_floats > 12 * 1024 else "shared"
                self.smem = B.alloc_buffer((self.shared_floats,), F32, scope=scope)
                # the same words as int32: the quantized activations (q8_activations)
                self.smem_i = B.decl_buffer((self.shared_floats,), "int32", data=self.smem.data, scope=scope)
                self.word_views: dict[tuple, tirx.Buffer] = {}  # weight planes as 32-bit words, by (buffer, word type)
                self.red = B.alloc_buffer((max(2, self.nb) * self.warps,), F32, scope="shared")  # cta_many
                self.redi = B.alloc_buffer((2 * self.warps,), "int32", scope="shared")
                self.part = B.alloc_buffer((self.warps * self.accumulators,), F32, scope="shared")  # K-slice sums
                self.trow = self.local("int32", p.tasks.shape[2])
                spins = self.local("int32")  # a thread's wait budget: SPIN_LIMIT, then 0 after one gives up
                self.store(spins, 0, i32(SPIN_LIMIT))
                with B.serial(0, self.queue_len[bx]) as i:
                    self.bx, self.position = bx, i  # for the phase clocks (`phase`)
                    for c in range(p.tasks.shape[2]):
                        self.store(self.trow, c, self.tasks[bx, i, c])
                    self.stamp(bx, i, 0)
                    if self.prefetch_bytes:
                        for op in p.opcodes:
                            if op.kind in (TaskKind.MATVEC, TaskKind.ATTN_PARTIAL):
                                with self.when(self.col(P.OPCODE) == op.index):
                                    self.prefetch(op)
                    # a thread per dependency: their polls are in flight together (thread 0 waiting on each in
                    # turn paid an L2 round trip per counter: 2-3 µs before an attention task that reads five QKV
                    # tiles); the barrier after passes every thread's acquire on to the block
                    start, n_deps = self.col(P.DEP_START), self.col(P.DEP_COUNT)
                    with B.serial(0, (n_deps + self.threads - 1) // self.threads) as it:
                        d = it * self.threads + tx
                        with self.when(d < n_deps):
                            self.wait(self.deps[start + d, 0], self.deps[start + d, 1] * self.epoch, bx, i, spins)
                    self.sync()
                    self.stamp(bx, i, 1)
                    for op in p.opcodes:
                        with self.when(self.col(P.OPCODE) == op.index):
                            self.opcode(op)
                    self.sync()
                    self.stamp(bx, i, 2)
                    with self.when(tx == 0):  # CUTLASS's barrier: the block's writes (bar.sync), a release
                        # fence, then relaxed reductions (no round trip); fence.sc (__threadfence) costs more
                        B.evaluate(T.ptx.fence.acq_rel.gpu())
                        for c in (P.COUNTER, P.STAGE_COUNTER):
                            B.evaluate(T.ptx.red.relaxed.gpu.global_.add.s32(
                                T.address_of(self.counters[self.col(c)]), i32(1)))
                        if self.p.has_groups:
                            with self.when(self.col(P.GROUP_COUNTER) >= 0):
                                B.evaluate(T.ptx.red.relaxed.gpu.global_.add.s32(
                                    T.address_of(self.counters[self.col(P.GROUP_COUNTER)]), i32(1)))
        return ib.get()

    def phase(self, which: int) -> None:
        """A clock inside a task body, after a barrier: 3 = its input is in place, 4 = its main loop is done,
        5 = its epilogue is done (the rest, to clock 2, is its writes)."""
        self.stamp(self.bx, self.position, which)

    def stamp(self, bx, position, which: int) -> None:
        with self.when((self.tx == 0) & (self.profiling != 0)):
            # the global timer (ns, one clock for every SM): stages line up across SMs, handoffs can be measured
            self.store(self.profile, [bx, position, which], T.cuda.mov_sreg(64, "globaltimer"))

    def wait(self, counter, target, bx, position, spins) -> None:
        """Spin (one thread a dependency) until counters[counter] >= target. Acquire loads (served by L2,
        coherent) order the task's reads after the producers' writes; the block's barrier after the wait passes
        that on to every thread (CUTLASS's generic barrier does the same). A wait that exceeds the thread's budget
        records itself in `status` and the step's epoch in token_out[nb], and gives up; that thread's later waits
        give up at once: a planning bug or a block that is not resident becomes an error the host reports, not a
        hung GPU."""
        seen, n = self.local("int32"), self.local("int32")
        addr = T.address_of(self.counters[counter])
        self.store(n, 0, i32(0))
        # loads, not atomic read-modify-writes: up to 132 pollers of one counter would queue their atomics at L2
        # ahead of the producers' increments
        B.evaluate(T.ptx.ld.acquire.gpu.global_.b32(seen[0], addr))
        with B.While((seen[0] < target) & (n[0] < spins[0])):
            B.evaluate(T.cuda.nano_sleep(i32(self.poll_sleep_ns)))  # back-off: less L2 contention
            B.evaluate(T.ptx.ld.acquire.gpu.global_.b32(seen[0], addr))
            self.store(n, 0, n[0] + 1)
        with self.when(seen[0] < target):
            self.store(self.status, [bx, 0], position + 1)
            self.store(self.status, [bx, 1], counter)
            self.store(self.status, [bx, 2], target)
            self.store(self.status, [bx, 3], seen[0])
            self.store(self.token_out, self.nb, self.epoch)  # the step's marker: read with the ids
            self.store(spins, 0, i32(0))

    def prefetch(self, op: P.Opcode) -> None:
        """Ask L2 for what the task will read that no task of this step writes (its weight rows; the keys and
        values of its chunk but the newest), before its wait: the fetch runs while the producers finish."""
        st = self.p.tg.stages[op.stage]
        if op.kind == TaskKind.MATVEC:
            lo, hi = self.col(P.LO), self.col(P.HI)
            for u, unit in enumerate(st.units):
                with self.when(self.col(P.UNIT) == u):
                    for m in unit.matmuls:
                        for buf in self.weight(op, m.weights["weight"]).values():
                            cols = int(buf.shape[2])
                            self._prefetch_range(lambda e, buf=buf, cols=cols: buf[self.col(P.LAYER), lo, e],
                                                 (hi - lo) * cols, op.max_rows[u] * cols, buf.dtype)
        elif op.kind == TaskKind.ATTN_PARTIAL:
            att = st.attention
            window = int(att.attrs.get("sliding_window") or 0)
            chunk = self._chunk_max(st, window)
            ps, d = self.p.page_size, self.p.kv["head_dim"]
            b, g, split = self.col(P.ROW), self.col(P.LO), self.col(P.SPLIT)
            kv_lo, kv_hi = self._chunk(st, window, b, split)
            kv_hi = tirx.min(kv_hi, self.lengths[b])  # the newest key is this step's: written after the wait
            per_page = ps * d
            with self.when((split >= 0) & (kv_hi > kv_lo)):
                p_lo = kv_lo // ps
                n_pages = (kv_hi - 1) // ps - p_lo + 1

                def at(e):  # e: element offset in the chunk's (page, K|V) blocks, each ps x d contiguous
                    blk = e // per_page
                    page = self.page_table[b, p_lo + blk // 2]
                    r = e % per_page
                    return self.kv_at(self.col(P.KV_LAYER), page, blk % 2, g, r // d, r % d)
                self._prefetch_range(at, n_pages * 2 * per_page, (chunk // ps + 1) * 2 * per_page, self.kv_dtype,
                                     contiguous=False)

    def _prefetch_range(self, at, n, n_max: int, dtype: str, contiguous: bool = True) -> None:
        """L2 prefetches over elements [0, n) of `at(e)` (n <= n_max), one per 128-byte line, capped at
        prefetch_bytes (a stage's whole prefetch, 132 tasks x planes, must stay well inside the 50 MB L2);
        threads stride over lines. `contiguous`: the elements are one range in memory (otherwise
        each line of `at` is still contiguous: the blocks are whole lines)."""
        size = DataType(str(dtype)).bits // 8
        per_line = LINE // size
        cap = self.prefetch_bytes // size
        lines = -(-min(n_max, cap) // per_line) + (1 if contiguous else 0)  # +1: a range need not start on a line
        n = tirx.min(n, i32(cap))
        with B.serial(0, -(-lines // self.threads)) as it:
            t = it * self.threads + self.tx
            with self.when(t * per_line < n + (per_line if contiguous else 0)):
                e = tirx.min(t * per_line, n - 1)
                B.evaluate(T.ptx.prefetch.global_.L2(T.address_of(at(e))))

    def opcode(self, op: P.Opcode) -> None:
        if op.kind == TaskKind.ARGMAX:
            return self.argmax()
        st = self.p.tg.stages[op.stage]
        if op.kind == TaskKind.EMBED:
            return self.embed(op, st)
        if op.kind == TaskKind.MATVEC:
            return self.matvec(op, st)
        if op.kind == TaskKind.ROW:
            return self.row(op, st)
        if op.kind == TaskKind.ATTN_PARTIAL:
            return self.attention(op, st)
        raise UnsupportedError(f"fuse: no megakernel body for {op.kind}")

    def arena_at(self, op: P.Opcode, name: str, b, i) -> tirx.Expr:
        return self.arena[self.col(op.slot(name)) + b * self.p.width(name) + i]

    # ---- embed --------------------------------------------------------------------------------------------------
    def embed(self, op: P.Opcode, st) -> None:
        emb = st.ops[0]
        out, table = emb.outputs[0], emb.weights["weight"]
        lo, hi = self.col(P.LO), self.col(P.HI)
        n = hi - lo
        with B.serial(0, (self.nb * self._max_tile(op) + self.threads - 1) // self.threads) as it:
            idx = it * self.threads + self.tx
            b, r = idx // n, idx % n
            with self.when(idx < self.nb * n):
                val = self.dequant(op, table, self.tokens[b], lo + r) * f32(emb.attrs["scale"])
                self.store(self.arena, self.col(op.slot(out)) + b * self.p.width(out) + lo + r, val)

    def _max_tile(self, op: P.Opcode) -> int:
        return max(t.hi - t.lo for t in self.p.tg.tasks if t.stage == op.stage)

    # ---- matvec -------------------------------------------------------------------------------------------------
    def matvec(self, op: P.Opcode, st) -> None:
        nb = self.nb
        k_in = self.p.width(st.input)
        granules = k_in // 8
        if k_in % 8:
            raise UnsupportedError(f"fuse: a matvec input of {k_in} features is not a multiple of 8")
        env_need = max(self._env_floats(st, u, rows) for u, rows in enumerate(op.max_rows))
        staged = nb * k_in + env_need + nb <= self.shared_floats
        if env_need + nb > self.shared_floats:
            raise UnsupportedError(f"fuse: a matvec tile of stage {op.stage} needs {env_need} floats of shared "
                                   "memory; build with --no-megakernel")
        rstd_at = self.shared_floats - nb  # per-sequence 1/rms of the prologue norm
        x_name = st.input
        norm_w = st.prologue.weights["weight"] if st.prologue is not None else None

        def rstd_of(b, total) -> None:  # thread 0 keeps sequence b's 1/rms
            with self.when(self.tx == 0):
                eps = f32(st.prologue.attrs["eps"])
                self.store(self.smem, rstd_at + b, tirx.rsqrt(total / f32(k_in) + eps))

        def xval(b: int, k) -> tirx.Expr:
            v = self.arena_at(op, x_name, b, k)
            if st.prologue is not None:
                v = v * self.smem[rstd_at + b] * self.vector(op, norm_w, k)
            return v

        def rstd_all(parts: tirx.Buffer) -> None:  # every sequence's 1/rms from its thread sums (one reduction)
            sums = self.cta_many([parts[b] for b in range(nb)], "sum")
            for b in range(nb):
                rstd_of(b, sums[b])
            self.sync()

        def rstd_from_arena() -> None:  # each sequence's 1/rms from its input in the arena (not staged)
            rstd_all(self._granule_squares(granules, lambda b, k: self.arena_at(op, x_name, b, k)))

        def x_at(b, k) -> tirx.Expr:  # transposed by granule: xs[(b*8 + j) * G + g] = x[b, 8g + j]
            return (b * 8 + k % 8) * granules + k // 8

        order = self._q8_order(st, k_in)
        q8_words = nb * self._q8_words(k_in)
        if order is not None:
            if q8_words + env_need + nb > self.shared_floats:
                raise UnsupportedError(f"fuse: stage {op.stage}'s 8-bit input and tile need {q8_words + env_need} "
                                       "floats of shared memory; build with a larger shared_kib or without "
                                       "q8_activations")
            if st.prologue is not None:  # the norm's 1/rms per sequence, in the float path's order
                rstd_from_arena()
            self.quantize_q8(order, k_in,
                             # the slot's offset is a multiple of P.ALIGN (4 floats); said so, TVM emits one 16-byte
                             # load, not a gather of four
                             lambda b: self.col(op.slot(x_name)) // P.ALIGN * P.ALIGN + b * k_in,
                             None if st.prologue is None else (lambda b: self.smem[rstd_at + b],
                                                               self.weight(op, norm_w)))
            self.sync()
            self.phase(3)
            for u, unit in enumerate(st.units):
                with self.when(self.col(P.UNIT) == u):
                    self.matvec_unit(op, st, u, unit, k_in, True, xval, q8_words, q8=order)
            return
        if self._float_mma(st, k_in):
            self._float_mma_matvec(op, st, k_in, env_need, rstd_at, rstd_all, rstd_from_arena, xval)
            return
        if st.merged >= 0 and not staged:
            raise UnsupportedError(f"fuse: stage {op.stage} merges attention partials but its input does not "
                                   "fit shared memory; plan it without fold_merge")
        if staged:
            self._stage_input(op, st, k_in, x_at, rstd_at, rstd_all)
        elif st.prologue is not None:  # the norm's scale per sequence; the body reads the arena (xval)
            rstd_from_arena()
        env_base = nb * k_in if staged else 0
        self.phase(3)
        for u, unit in enumerate(st.units):
            with self.when(self.col(P.UNIT) == u):
                self.matvec_unit(op, st, u, unit, k_in, staged, xval, env_base)

    def _stage_input(self, op: P.Opcode, st, k_in: int, at, rstd_at: int, rstd_all, finish=None) -> None:
        """A matvec stage's input in shared memory, sequence b's feature k at word at(b, k): the attention's split
        partials merged (Stage.merged), or the arena read once, raw, then the prologue norm's scale in place;
        `finish` (float_mma's tf32 rounding) on every value last. Ends on a barrier."""
        nb, granules = self.nb, k_in // 8

        def done(v: tirx.Expr) -> tirx.Expr:
            return finish(v) if finish is not None else v

        if st.merged >= 0:  # the attention's split partials merged here, into shared memory (no merge tasks)
            att = self.p.tg.stages[st.merged]
            dv = k_in // att.attention.attrs["n_head"]
            partials = self.p.partials[self.p.opcodes[self.p.stage_opcode[st.merged]].stage]

            def merged(idx) -> None:
                b, g = idx // granules, idx % granules
                for j in range(8):
                    k = g * 8 + j
                    self.store(self.smem, at(b, k), done(self.merged_value(att, partials, b, k // dv, k % dv)))
            self._each(nb * granules, merged)
            self.sync()
            return

        # a thread takes a granule (8 features): in the transposed layout the stores of a warp's lanes land in
        # consecutive words, where a feature a thread put 8 lanes on one bank (ncu: half the kernel's shared
        # wavefronts were conflicts)
        def keep(b, k):
            self.store(self.smem, at(b, k), self.arena_at(op, st.input, b, k))
            return self.smem[at(b, k)]  # the stored value: the arena is read once

        parts = self._granule_squares(granules, keep, square=st.prologue is not None)
        if st.prologue is not None:
            rstd_all(parts)
        else:
            self.sync()
        if st.prologue is None and finish is None:
            return
        norm_w = st.prologue.weights["weight"] if st.prologue is not None else None

        def scale(idx) -> None:  # the norm's scale in xval's order, then `finish`, in place
            b, g = idx // granules, idx % granules
            for j in range(8):
                v = self.smem[at(b, g * 8 + j)]
                if norm_w is not None:
                    v = v * self.smem[rstd_at + b] * self.vector(op, norm_w, g * 8 + j)
                self.store(self.smem, at(b, g * 8 + j), done(v))
        self._each(nb * granules, scale)
        self.sync()

    def _granule_squares(self, granules: int, value, square: bool = True) -> tirx.Buffer:
        """A thread's granules of every sequence's row (8 features each, in turn), value(b, k) giving sequence b's
        feature k; returns the thread's sum of their squares per sequence (`square`). The sequences are the inner
        loop, so all their loads are in flight at once (a loop over sequences outside took a round trip and a
        block reduction each: 7-14 µs at batch 8 on the H200); each sequence's sum keeps one order, so a batch
        gives each sequence the 1/rms it gets alone, to the bit."""
        part = self.local(F32, self.nb)
        for b in range(self.nb):
            self.store(part, b, f32(0))
        with B.serial(0, -(-granules // self.threads)) as it:
            g = it * self.threads + self.tx
            with self.when(g < granules):
                for b in range(self.nb):
                    for j in range(8):
                        v = self.local()
                        self.store(v, 0, value(b, g * 8 + j))  # one load, squared
                        if square:
                            self.store(part, b, part[b] + v[0] * v[0])
        return part

    def _env_slots(self, st, u: int) -> dict[str, int]:
        """Shared-memory slots of a unit's values (a reshape shares its input's slot)."""
        unit = st.units[u]
        slots: dict[str, int] = {}
        for m in unit.matmuls:
            slots[m.outputs[0]] = len(set(slots.values()))
        for e in unit.epilogue:
            if e.kind == OpKind.RESHAPE:
                slots[e.outputs[0]] = slots[e.inputs[0]]
            else:
                slots[e.outputs[0]] = len(set(slots.values()))
        return slots

    def _env_floats(self, st, u: int, rows: int) -> int:
        return len(set(self._env_slots(st, u).values())) * self.nb * rows

    def matvec_unit(self, op: P.Opcode, st, u: int, unit, k_in: int, staged: bool, xval, env_base: int,
                    q8: str | None = None, mma_x=None) -> None:
        nb, rows_max = self.nb, op.max_rows[u]
        self._cur_rows_max = rows_max
        lo, hi = self.col(P.LO), self.col(P.HI)
        slots = self._env_slots(st, u)

        def env(slot: int, b, r) -> tirx.Expr:
            return env_base + (slot * nb + b) * rows_max + r

        env_end = env_base + self._env_floats(st, u, rows_max)
        if mma_x is not None:
            self._float_mma_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, env_end, mma_x, env_base)
        elif q8 is not None and self.q8_mma:
            self._mma_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, env_end)
        else:
            self._lane_matmuls(op, unit, k_in, rows_max, lo, hi, env, slots, staged, xval, q8)
        self.sync()
        self.phase(4)
        self.epilogue(op, unit.epilogue, slots, env, lo, hi - lo, rows_max, nb, lambda i: i)  # ends on a barrier
        self.phase(5)
        # the values other stages read → the arena; keys and values → their pages; the LM head → argmax partials
        n = hi - lo
        for name, slot in slots.items():
            if name in op.outputs:
                w = self.p.width(name)
                self._each(nb * rows_max, lambda idx, slot=slot, name=name, w=w: self._write_out(
                    op, name, slot, env, idx, n, rows_max, lo, w))
            if name in self.p.tg.kv_slots:
                which = 0 if self.p.tg.kv_slots[name][1] == "k" else 1
                self._each(nb * rows_max, lambda idx, slot=slot, which=which: self._append_kv(
                    slot, env, idx, n, rows_max, lo, which))
        if any(m.kind == OpKind.LM_HEAD for m in unit.matmuls):
            last = unit.epilogue[-1].outputs[0] if unit.epilogue else unit.matmuls[0].outputs[0]
            self.lm_partial(slots[last], env, n, rows_max, lo)

    def _lane_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, staged: bool, xval,
                      q8: str | None) -> None:
        """The tile's matmuls into shared memory (env), a lane per granule or 32-value block of a row."""
        nb, granules = self.nb, k_in // 8
        n_m = len(unit.matmuls)
        # The block's warps split K into `split` slices (enough granules per slice to keep 32 lanes busy) and the
        # rows into self.warps / split groups; a warp accumulates `rows` rows at once (`accumulators` sums a lane):
        # every weight load of a pass is independent of the others, so all of them are in flight together
        # With 8-bit activations and K of 1,024 or more, a lane takes a whole 32-value block of a row (one 16-byte
        # load of Q4 quants) instead of an 8-value granule (4 bytes): 4x the bytes in flight per load
        by_block = self.q8_by_block and q8 is not None and k_in // Q8_BLOCK >= 32
        units = k_in // Q8_BLOCK if by_block else granules  # what a lane takes per pass
        split = 1
        while split < self.warps and units // (2 * split) >= 32:
            split *= 2
        groups = self.warps // split
        per_slice = -(-units // split)
        rows = max(1, min(-(-rows_max // groups), self.accumulators // (n_m * nb)))
        steps = -(-rows_max // (groups * rows))
        passes = -(-per_slice // 32)
        slice_, group = self.warp % split, self.warp // split
        g_end = tirx.min((slice_ + 1) * per_slice, units)
        acc = self.local(F32, n_m * rows * nb)
        xv = self.local(F32, 8 * nb)
        wv = self.local(F32, 8)
        with B.serial(0, steps) as s:
            r0 = lo + (s * groups + group) * rows
            for a in range(n_m * rows * nb):
                self.store(acc, a, f32(0))
            loop = B.unroll if passes <= self.unroll_passes else B.serial
            with loop(0, passes) as gi:
                g = slice_ * per_slice + gi * 32 + self.lane
                exact = split == 1 and units % 32 == 0
                with _nothing() if exact else self.when(g < g_end):
                    if by_block:
                        self._q8_block_pass(op, unit, rows, r0, hi, g, granules, k_in, acc)
                    elif q8 is not None:
                        self._q8_pass(op, unit, rows, r0, hi, g, granules, k_in, acc)
                    else:
                        self._float_pass(op, unit, rows, r0, hi, g, granules, staged, xval, acc, xv, wv)
            n_acc = n_m * rows * nb
            for a in range(n_acc):
                self.store(acc, a, T.cuda.warp_sum(acc[a]))
            if split > 1:  # the slices' sums meet in shared memory
                with self.when(self.lane == 0):
                    for a in range(n_acc):
                        self.store(self.part, (group * n_acc + a) * split + slice_, acc[a])
                self.sync()
            for m_i, m in enumerate(unit.matmuls):
                for r in range(rows):
                    with self.when((self.lane == 0) & (slice_ == 0) & (r0 + r < hi)):
                        for b in range(nb):
                            a = (m_i * rows + r) * nb + b
                            y = acc[a]
                            for k in range(1, split):
                                y = y + self.part[(group * n_acc + a) * split + k]
                            if "bias" in m.weights:
                                y = y + self.vector(op, m.weights["bias"], r0 + r)
                            self.store(self.smem, env(slots[m.outputs[0]], b, r0 + r - lo), y)
            if split > 1:
                self.sync()  # the next step's partials overwrite these

    # ---- 8-bit activations on tensor cores (q8_mma) ---------------------------------------------------------------
    def _mma_split(self, k_in: int) -> int:
        """Warps that split a matvec's K into slices of at least MMA_MIN_BLOCKS 32-value blocks: a function of K
        alone, so every batch size sums a row's blocks in one order (batched equal to alone)."""
        blocks, split = k_in // Q8_BLOCK, 1
        while split < self.warps and blocks // (2 * split) >= MMA_MIN_BLOCKS:
            split *= 2
        return split

    def _quad_transpose(self, w: tirx.Buffer, at: list[int], tig) -> None:
        """w[at[0..3]] of the 4 lanes of a quad (tig = lane % 4) transposed: lane tig ends with the words at[tig]
        of lanes 0..3, in order. Two butterfly steps (lane xor 1, then xor 2), each swapping 2 words a lane with
        one shuffle per word; every lane of the warp must arrive."""
        for bit in (1, 2):
            odd = (tig & bit) != 0
            # pairs (j, j + bit), j & bit == 0: a lane with the bit clear keeps j and takes j + bit, one with it set
            # the other way round
            pairs = [(j, j + bit) for j in range(4) if j & bit == 0]
            got = self.local("uint32", 2)
            for n, (lo_, hi_) in enumerate(pairs):
                send = tirx.Select(odd, w[at[lo_]], w[at[hi_]])
                self.store(got, n, T.cuda._shfl_xor_sync(tirx.const(0xFFFFFFFF, "uint32"), send, bit, 32))
            for n, (lo_, hi_) in enumerate(pairs):
                self.store(w, at[lo_], tirx.Select(odd, got[n], w[at[lo_]]))
                self.store(w, at[hi_], tirx.Select(odd, w[at[hi_]], got[n]))

    def _mma_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, env_end: int) -> None:
        """The tile's matmuls into shared memory (env) with integer tensor cores: one mma.m16n8k32 (s8 x s8 ->
        s32) per 16 rows x one 32-value block x the batch's 8-bit inputs (its 8 columns; the columns past the batch
        repeat its last sequence, their results unused), then each of the 16 x 8 sums scaled as the dp4a body does
        (d_w·(d_x·Σ) [+ m_w·s_x], `_q8_accumulate`). The integer sums are llama.cpp's (Q4_0 as q − 8 per byte);
        dp4a took a lane 8 instructions per (row, block, sequence), one mma does 128 of them.

        Fragments (PTX ISA, mma.m16n8k32 .s8): lane = 4·quad + tig holds A rows quad and quad + 8, B column quad,
        C rows quad, quad + 8 x columns 2·tig, 2·tig + 1. A block's k order is free as long as A and B share it:
        lane tig takes granule tig of the block (the 4 quants of its word with h = 0, then h = 1), which is the
        word the Q4 planes keep per granule (low nibbles h = 0, high h = 1) and two words of Q8_0, and the words
        quantize_q8 writes per (sequence, h, granule).

        Loads: a warp takes 4 blocks of a row at a time, lane tig the whole block tig in 16-byte words (two for
        Q8_0), and a 4 x 4 transpose of words across the quad's lanes (`_quad_transpose`, 4 shuffles) gives each
        lane granule tig of the 4 blocks. Each lane loading its own granule word took 4-byte loads, half a sector
        each: the 1B body's step went 621 -> 1,115 µs at b=1 (the lane-per-block dp4a body reads 16 bytes)."""
        nb, n_m = self.nb, len(unit.matmuls)
        blocks, granules = k_in // Q8_BLOCK, k_in // 8
        split = self._mma_split(k_in)
        groups = self.warps // split
        per_slice = -(-blocks // (4 * split)) * 4  # whole 4-block loads a slice; the last ones may end early
        slice_, group = self.warp % split, self.warp // split
        tiles_m = -(-rows_max // 16)
        per_warp = -(-tiles_m // groups)  # 16-row tiles of each matmul a warp takes
        quad, tig = self.lane // 4, self.lane % 4
        layer = self.col(P.LAYER)
        types = self._weight_types(unit)
        acc = self.local(F32, n_m * per_warp * 4)
        for i in range(n_m * per_warp * 4):
            self.store(acc, i, f32(0))
        bq, a = self.local("uint32", 8), self.local("uint32", 16)  # per block of the 4: B's 2 words, A's 4
        wq, d = self.local("uint32", 8), self.local("uint32", 4)
        zero = self.local("uint32", 4)
        for i in range(4):
            self.store(zero, i, tirx.const(0, "uint32"))
        column = tirx.min(quad, nb - 1)  # the sequence whose 8-bit input this lane gives B
        mask, four = tirx.const(0x0F0F0F0F, "uint32"), tirx.const(4, "uint32")
        high, eights = tirx.const(0x80808080, "uint32"), tirx.const(0x08080808, "uint32")
        ragged = blocks % (4 * split) != 0  # some 4-block load runs past K: its blocks past K take no mma
        loop = B.unroll if per_slice <= 16 else B.serial
        with loop(0, per_slice // 4) as j:
            blk0 = slice_ * per_slice + 4 * j
            with _nothing() if not ragged else self.when(blk0 < blocks):  # warp-uniform
                for bb in range(4):
                    for h in range(2):
                        blk = tirx.min(blk0 + bb, blocks - 1) if ragged else blk0 + bb
                        self.store(bq, 2 * bb + h, tirx.reinterpret("uint32", self.smem_i[(column * 2 + h) * granules
                                                                                       + blk * 4 + tig]))
                own = tirx.min(blk0 + tig, blocks - 1) if ragged else blk0 + tig  # the block this lane loads
                for m_i, m in enumerate(unit.matmuls):
                    planes = self.weight(op, m.weights["weight"])
                    q8_0 = types[m_i] == "Q8_0"
                    words = self._word_view(planes["qs"])
                    for t in range(per_warp):
                        tile = group + t * groups
                        with _nothing() if tiles_m % groups == 0 else self.when(tile < tiles_m):  # warp-uniform
                            rows = [tirx.min(lo + tile * 16 + quad + 8 * i, hi - 1) for i in range(2)]
                            for i, row in enumerate(rows):  # a[4bb + 0/1]: h = 0 of rows quad, quad + 8; 2/3: h = 1
                                per_block = 8 if q8_0 else 4  # words of a block
                                for half in range(per_block // 4):
                                    B.buffer_store(wq, words.vload([layer, row, own * per_block + half * 4],
                                                                   "uint32x4"), [tirx.Ramp(i32(half * 4), i32(1), 4)])
                                if q8_0:  # words 2g + h: transpose each h's four words
                                    for h in range(2):
                                        self._quad_transpose(wq, [h, 2 + h, 4 + h, 6 + h], tig)
                                        for bb in range(4):
                                            self.store(a, 4 * bb + 2 * h + i, wq[2 * bb + h])
                                else:
                                    self._quad_transpose(wq, [0, 1, 2, 3], tig)
                                    for bb in range(4):
                                        for h, q in enumerate((wq[bb] & mask, (wq[bb] >> four) & mask)):
                                            if types[m_i] == "Q4_0":  # q − 8 per byte: no borrow crosses a byte
                                                q = ((q | high) - eights) ^ high
                                            self.store(a, 4 * bb + 2 * h + i, q)
                            for bb in range(4):
                                blk = blk0 + bb
                                with self.when(blk < blocks) if ragged else _nothing():  # warp-uniform
                                    B.evaluate(T.ptx["mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"](
                                        *(d[i] for i in range(4)), *(a[4 * bb + i] for i in range(4)),
                                        bq[2 * bb], bq[2 * bb + 1], *(zero[i] for i in range(4))))
                                    for r, row in enumerate(rows):
                                        dw, mw = self._q8_block_scales(planes, types[m_i], layer, row, blk)
                                        for c in range(2):
                                            self._q8_accumulate(acc, ((m_i * per_warp + t) * 2 + r) * 2 + c,
                                                                tirx.reinterpret("int32", d[2 * r + c]), dw, mw,
                                                                tirx.min(2 * tig + c, nb - 1), blk, k_in,
                                                                lanes_per_block=1)
        self._mma_results(op, unit, lambda i: acc[i], per_warp, split, rows_max, lo, hi, env, slots,
                          self.nb * self._q8_words(k_in), env_end, "q8_mma")

    def _mma_results(self, op, unit, acc, per_warp: int, split: int, rows_max: int, lo, hi, env, slots,
                     input_floats: int, env_end: int, option: str, first_tile=0) -> None:
        """A tensor-core tile's results into shared memory (env), with the bias where there is one. acc(i) is the
        lane's result i = ((matmul · per_warp + tile) · 2 + r) · 2 + c: row quad + 8r, sequence 2·tig + c of its
        16 x 8 fragment (the C layout of mma.m16n8k*). Where `split` warps took slices of K, their sums meet in
        shared memory, added in slice order (the input's `input_floats` if they fit there, else after env_end).
        The warp's tiles are first_tile + group + t·groups."""
        nb, n_m = self.nb, len(unit.matmuls)
        groups = self.warps // split
        slice_, group = self.warp % split, self.warp // split
        quad, tig = self.lane // 4, self.lane % 4
        n = hi - lo

        def each_result(body) -> None:  # body(m_i, m, acc index, tile row, sequence) for the lane's valid results
            for m_i, m in enumerate(unit.matmuls):
                for t in range(per_warp):
                    for r in range(2):
                        for c in range(2):
                            rr, b = (first_tile + group + t * groups) * 16 + quad + 8 * r, 2 * tig + c
                            with self.when((rr < n) & (b < nb)):
                                body(m_i, m, ((m_i * per_warp + t) * 2 + r) * 2 + c, rr, b)

        def with_bias(m, rr, y) -> tirx.Expr:
            return y + self.vector(op, m.weights["bias"], lo + rr) if "bias" in m.weights else y

        if split == 1:
            each_result(lambda m_i, m, i, rr, b: self.store(self.smem, env(slots[m.outputs[0]], b, rr),
                                                             with_bias(m, rr, acc(i))))
            return
        # the slices' sums meet in shared memory, added in slice order: where the input was if it fits there
        # (every warp is past its loop after the barrier), else after the tile's values
        need = split * n_m * nb * rows_max
        part_at = 0 if need <= input_floats else env_end
        if part_at + need > self.shared_floats - nb:
            raise UnsupportedError(f"fuse: the tensor-core matvec's {split} K slices need {need} floats of shared "
                                   f"memory; build with a larger shared_kib or without {option}")

        def part(s, m_i, b, rr):
            return part_at + ((s * n_m + m_i) * nb + b) * rows_max + rr

        self.sync()
        each_result(lambda m_i, m, i, rr, b: self.store(self.smem, part(slice_, m_i, b, rr), acc(i)))
        self.sync()
        for m_i, m in enumerate(unit.matmuls):
            def total(idx, m_i=m_i, m=m) -> None:
                b, rr = idx // rows_max, idx % rows_max
                with self.when(rr < n):
                    y = self.smem[part(0, m_i, b, rr)]
                    for s_ in range(1, split):
                        y = y + self.smem[part(s_, m_i, b, rr)]
                    self.store(self.smem, env(slots[m.outputs[0]], b, rr), with_bias(m, rr, y))
            self._each(nb * rows_max, total)

    # ---- float weights on tensor cores (float_mma) ----------------------------------------------------------------
    def _float_mma(self, st, k_in: int) -> bool:
        """Whether the stage's matvecs run on tf32 tensor cores: the option is on, K is whole chunks of 32 and every
        weight is F16 or BF16 (exact in tf32, so only the activations round). A function of the stage alone:
        every batch size computes a sequence alike (batched equal to alone)."""
        if not self.float_mma or k_in % MMA_CHUNK:
            return False
        return all(t in MMA_FLOAT_TYPES for unit in st.units for t in self._weight_types(unit))

    def _float_mma_split(self, k_in: int) -> int:
        """Warps that split K into slices of at least MMA_MIN_CHUNKS chunks: a function of K alone (one summation
        order at every batch size)."""
        chunks, split = k_in // MMA_CHUNK, 1
        while split < self.warps and chunks // (2 * split) >= MMA_MIN_CHUNKS:
            split *= 2
        return split

    def _float_mma_matvec(self, op: P.Opcode, st, k_in: int, env_need: int, rstd_at: int, rstd_all,
                          rstd_from_arena, xval) -> None:
        """The input (norm applied, rounded to tf32) in shared memory a sequence a row, rows padded by 4 floats so
        that a quarter warp's 16-byte loads of B fragments (4 lanes of one sequence, 2 sequences) hit distinct
        banks; where it does not fit, the B fragments are read from the arena and rounded in registers (the same
        values: staging changes no bit)."""
        nb, stride = self.nb, k_in + P.ALIGN
        staged = nb * stride + env_need + nb <= self.shared_floats
        if staged:
            self._stage_input(op, st, k_in, lambda b, k: b * stride + k, rstd_at, rstd_all, finish=tf32)
        else:
            if st.merged >= 0:
                raise UnsupportedError(f"fuse: stage {op.stage} merges attention partials but its input does not "
                                       "fit shared memory; plan it without fold_merge")
            if st.prologue is not None:
                rstd_from_arena()
        env_base = nb * stride if staged else 0

        def x_granule(xb: tirx.Buffer, at: int, b, k) -> None:  # sequence b's values k..k+7 into xb[at..at+7]
            if staged:
                for h in range(2):
                    B.buffer_store(xb, self.smem.vload([b * stride + k + 4 * h], "float32x4"),
                                   [tirx.Ramp(i32(at + 4 * h), i32(1), 4)])
            else:
                for j in range(8):
                    self.store(xb, at + j, tf32(xval(b, k + j)))

        self.phase(3)
        for u, unit in enumerate(st.units):
            with self.when(self.col(P.UNIT) == u):
                self.matvec_unit(op, st, u, unit, k_in, staged, xval, env_base, mma_x=x_granule)

    def _float_mma_matmuls(self, op, unit, k_in: int, rows_max: int, lo, hi, env, slots, env_end: int, x_granule,
                           input_floats: int) -> None:
        """The tile's matmuls into shared memory (env) on tf32 tensor cores: mma.m16n8k8 (16 rows x 8 values x
        the batch's 8 columns, float32 accumulators), F16/BF16 weights exact, the input rounded to tf32. The
        columns past the batch repeat its last sequence (their results unused): at batch 1, 7 of 8 columns are
        waste, but a tensor-core instruction does a warp's 1,024 multiply-adds.

        Fragments (PTX ISA, mma.m16n8k8 .tf32): lane = 4·quad + tig holds A rows quad, quad + 8 at k slots tig and
        tig + 4, B column quad at the same slots. The k order is free as long as A and B share it: in a chunk of 32
        values, lane tig takes values 8·tig .. 8·tig + 7 (one 16-byte word of each of its two rows, one float4 pair
        of its sequence's input), and mma j (of 4) puts value 8·tig + 2j in slot tig and 8·tig + 2j + 1 in slot
        tig + 4: for BF16 the low and high halves of word j, no shuffles. A warp takes 16-row tiles of every matmul
        over its slice of K (`_float_mma_split`), `ahead` chunks' loads issued before their mmas."""
        nb, n_m = self.nb, len(unit.matmuls)
        chunks = k_in // MMA_CHUNK
        split = self._float_mma_split(k_in)
        groups = self.warps // split
        per_slice = -(-chunks // split)
        slice_, group = self.warp % split, self.warp // split
        tiles_m = -(-rows_max // 16)
        per_warp = -(-tiles_m // groups)  # tiles of each matmul a warp takes, in rounds of per_round
        # fragments a warp accumulates at once (which tiles a warp takes together, never a sum's order: any rule
        # keeps batched equal to alone). Measured on the H200, the BF16 1B body at b=1 / b=8, device µs a step:
        # 2 fragments 1,037 / 1,338, 4 975 / 1,458, 8 1,084 / 1,397
        tiles = self.float_mma_tiles or (MMA_TILES // 2 if self.nb >= 8 else MMA_TILES)
        per_round = min(per_warp, max(1, tiles // n_m))
        rounds = -(-per_warp // per_round)
        if rounds > 1:  # the slices' sums cannot go where the input is: later rounds read it
            input_floats = 0
        quad, tig = self.lane // 4, self.lane % 4
        layer = self.col(P.LAYER)
        types = self._weight_types(unit)
        # chunks whose loads a warp issues before their mmas (8 words of A a lane per matmul and tile): measured on
        # the H200, the BF16 1B body's b=1 step 988 µs with 1 (at most 32 words a lane), 948 with 2, 972 with 4
        ahead = self.float_mma_ahead or min(per_slice, 2)
        acc = self.local(F32, n_m * per_round * 4)
        xb = self.local(F32, 8 * ahead)
        wq = self.local("uint32", 8 * n_m * per_round * ahead)
        a, bq = self.local("uint32", 4), self.local("uint32", 2)
        column = tirx.min(quad, nb - 1)  # the sequence whose input this lane gives B
        sixteen, high, low = tirx.const(16, "uint32"), tirx.const(0xFFFF0000, "uint32"), tirx.const(0xFFFF, "uint32")
        words = [self._word_view(self.weight(op, m.weights["weight"])["w"]) for m in unit.matmuls]

        def w_at(c_, m_i, t, i, j) -> int:
            return (((c_ * n_m + m_i) * per_round + t) * 2 + i) * 4 + j

        def value(c_, m_i, t, i, j, odd: bool) -> tirx.Expr:  # value 2j + odd of row quad + 8i's word, tf32 bits
            w = wq[w_at(c_, m_i, t, i, j)]
            if types[m_i] == "BF16":  # the top half of a float32
                return w & high if odd else w << sixteen
            half = (w >> sixteen if odd else w & low).astype("uint16")
            return tirx.reinterpret("uint32", tirx.reinterpret("float16", half).astype(F32))

        steps = -(-per_slice // ahead)
        exact = per_slice % ahead == 0 and chunks % split == 0  # every chunk a step takes is in the slice and in K
        loop = B.unroll if steps <= self.unroll_passes else B.serial
        with B.serial(0, rounds) as rnd:
            first_tile = rnd * per_round * groups
            for i in range(n_m * per_round * 4):
                self.store(acc, i, f32(0))
            whole = tiles_m % (groups * per_round) == 0  # every tile of every round is a tile of the matmul

            def tile_of(t):
                return first_tile + group + t * groups

            with loop(0, steps) as s:
                c0 = slice_ * per_slice + s * ahead
                for c_ in range(ahead):  # loads first: every word of the step in flight at once
                    c = tirx.min(c0 + c_, chunks - 1)  # past K: a valid chunk, its mma skipped
                    x_granule(xb, 8 * c_, column, c * MMA_CHUNK + tig * 8)
                    for m_i in range(n_m):
                        for t in range(per_round):
                            tile = tirx.min(tile_of(t), tiles_m - 1)
                            for i in range(2):
                                row = tirx.min(lo + tile * 16 + quad + 8 * i, hi - 1)
                                B.buffer_store(wq, words[m_i].vload([layer, row, (c * 4 + tig) * 4], "uint32x4"),
                                               [tirx.Ramp(i32(w_at(c_, m_i, t, i, 0)), i32(1), 4)])
                for c_ in range(ahead):
                    in_slice = (s * ahead + c_ < per_slice) & (c0 + c_ < chunks)  # warp-uniform
                    with _nothing() if exact else self.when(in_slice):
                        for j in range(4):
                            self.store(bq, 0, tirx.reinterpret("uint32", xb[8 * c_ + 2 * j]))
                            self.store(bq, 1, tirx.reinterpret("uint32", xb[8 * c_ + 2 * j + 1]))
                            for m_i in range(n_m):
                                for t in range(per_round):
                                    with _nothing() if whole else self.when(tile_of(t) < tiles_m):  # warp-uniform
                                        for n_, (i, odd) in enumerate(((0, False), (1, False), (0, True), (1, True))):
                                            self.store(a, n_, value(c_, m_i, t, i, j, odd))
                                        d = [acc[(m_i * per_round + t) * 4 + r] for r in range(4)]
                                        B.evaluate(T.ptx["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"](
                                            *d, *(a[r] for r in range(4)), bq[0], bq[1], *d))
            self._mma_results(op, unit, lambda i: acc[i], per_round, split, rows_max, lo, hi, env, slots,
                              input_floats, env_end, "float_mma", first_tile=first_tile)

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

    def _word_view(self, buf: tirx.Buffer, word: str = "uint32") -> tirx.Buffer:
        """A weight plane (layers, n_out, n_in) of 8-, 16- or 32-bit values as 32-bit words (layers, n_out, words)
        of dtype `word` (int32 for the signed Q8_0 quants that dp4a takes)."""
        key = (id(buf), word)
        if key not in self.word_views:
            g, n_out, n_in = (int(d) for d in buf.shape)
            words = n_in * DataType(buf.dtype).bits // 32
            self.word_views[key] = B.decl_buffer((g, n_out, words), word, data=buf.data)
        return self.word_views[key]

    # ---- 8-bit activations (q8_activations): llama.cpp's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 -------------
    @staticmethod
    def _q8_words(k_in: int) -> int:
        """Shared-memory words of one sequence's 8-bit input: the quants (4 a word), d and s/4 per block."""
        return k_in // 4 + 2 * (k_in // Q8_BLOCK)

    def _q8_scales_at(self, k_in: int) -> tuple[int, int]:
        """Where d and s/4 of the 8-bit input's blocks start in shared memory (after every sequence's quants)."""
        words = self.nb * 2 * (k_in // 8)
        return words, words + self.nb * (k_in // Q8_BLOCK)

    def _weight_types(self, unit) -> list[str]:
        return [as_ggml_type(self.p.graph.weights[m.weights["weight"]].ggml_type).name for m in unit.matmuls]

    def _q8_accumulate(self, acc, a: int, total, dw, mw, b: int, blk, k_in: int, lanes_per_block: int) -> None:
        """acc[a] += d_w·(d_x·Σ) [+ m_w·s_x], the block's min term split over the lanes that share the block
        (s/4 is stored: 4 granule lanes add it once each; a lane with the whole block multiplies it by 4, exactly)."""
        d_at, s_at = self._q8_scales_at(k_in)
        blocks = k_in // Q8_BLOCK
        y = acc[a] + dw * (self.smem[d_at + b * blocks + blk] * exact_int_to_float(total))
        if mw is not None:
            s = self.smem[s_at + b * blocks + blk]
            y = y + mw * (s if lanes_per_block == 4 else s * f32(4))
        self.store(acc, a, y)

    @staticmethod
    def _q8_block_scales(planes, ggml_type: str, layer, row, blk) -> tuple[tirx.Expr, tirx.Expr | None]:
        """A 32-value block's (d_w, m_w) as float32, w = d_w·q + m_w (m_w None: Q4_0/Q8_0/Q6_K have no minimum). A
        Q4_K/Q5_K sub-block is a Q4_1/Q5_1 block with d_w = d·sc and m_w = −dmin·mn (llama.cpp's vec_dot_q4_K_q8_1;
        both products exact in float32). Q6_K's d_w is its super-block's d: the passes scale each 16 values' integer
        sum by their int8 scale (llama.cpp's vec_dot_q6_K_q8_1)."""
        if ggml_type in ("Q4_K", "Q5_K"):
            sb = blk // 8  # the 256-value super-block
            d = planes["d"][layer, row, sb].astype(F32) * exact_int_to_float(planes["sc"][layer, row, blk])
            m = planes["dmin"][layer, row, sb].astype(F32) * exact_int_to_float(planes["mn"][layer, row, blk])
            return d, f32(0) - m
        if ggml_type == "Q6_K":  # the int8 scale of each 16 values multiplies the integer sums (the passes)
            return planes["d"][layer, row, blk // 8].astype(F32), None
        mw = planes["m"][layer, row, blk].astype(F32) if ggml_type in ("Q4_1", "Q5_1") else None
        return planes["d"][layer, row, blk].astype(F32), mw

    def _q8_order(self, st, k_in: int) -> str | None:
        """The activation order the stage's matmuls take ("nibbles" for Q4/Q5 types, "natural" for Q8_0), or None
        where it keeps float32 activations: the option is off, a weight type has no integer body here, the types
        want different orders, the input is merged from attention partials, or the largest batch's 8-bit input
        would take more than 3/4 of the shared memory. The choice depends on the stage and the build's largest
        batch only, so every batch size computes a sequence alike (batched equal to alone)."""
        if not self.q8 or st.merged >= 0 or self.q8_batch * self._q8_words(k_in) > self.shared_floats * 3 // 4:
            return None
        types = {t for unit in st.units for t in self._weight_types(unit)}
        if self.q8_mma and types & {"Q5_0", "Q5_1", "Q5_K", "Q6_K"}:  # the tensor-core body takes no high bits
            return None
        orders = {Q8_ORDER.get(t) for t in types}
        return orders.pop() if len(orders) == 1 and None not in orders else None

    def quantize_q8(self, order: str, k_in: int, base, norm) -> None:
        """The input (with its norm) as 8-bit blocks of 32 in shared memory, each sequence's rows on their own, as
        ggml's x86 quantize_row_q8_0/q8_1 (lower/cpu_int8.py: the CPU build's, which the emulating oracle follows):
        q = rint(x · 127/amax), d = fp16(amax/127), s = fp16(d · Σq) from the float32 d.
        A thread per (sequence, granule of 8 features): a block's 4 granules are a quad of lanes, whose amax and Σq
        take two shuffles each, and a thread writes its granule's two words whole. Up to QUANT_AHEAD granules a
        thread are loaded before any is quantized (their loads in flight together). A warp per block took two warp
        reductions a block: at b=8 the 1B's down projection spent 18 of its 29 µs a task here (shuffles at one
        warp instruction a clock an SM; a thread per block, with 32 dependent loads, took 4-5 µs a task).
        base(b): the arena index of sequence b's input; norm: None or the prologue norm's (1/rms of b, γ plane, a
        float32 vector), applied as xval does, (x · 1/rms) · γ. A granule is read as two 16-byte words (γ too):
        8 floats a thread, lanes 32 bytes apart, were 8 loads of 32 sectors each a warp instead of 2.
        Layout (32-bit words): word (b·2 + h)·G + g holds 4 quants of granule g (8 features): for "nibbles" its
        features 2j + h (j = 0..3: the bytes of a Q4 word masked or shifted), for "natural" 4h + j; then d per
        (b, block), then s/4 per (b, block) (each of a block's 4 granule lanes adds m·s/4)."""
        nb, granules, blocks = self.nb, k_in // 8, k_in // Q8_BLOCK
        d_at, s_at = self._q8_scales_at(k_in)
        total = nb * granules  # a multiple of 4 (K is of whole blocks): a quad is all in range or all past it
        n_it = -(-total // self.threads)
        ahead = min(n_it, QUANT_AHEAD)
        vals = self.local(F32, ahead * 8)
        amax, inv = self.local(), self.local()
        q, qsum, word = self.local("int32", 8), self.local("int32"), self.local("int32", 2)
        full = tirx.const(0xFFFFFFFF, "uint32")
        gam = self.local(F32, 8) if norm is not None else None
        with B.serial(0, -(-n_it // ahead)) as it:
            for u in range(ahead):
                at = tirx.min((it * ahead + u) * self.threads + self.tx, total - 1)  # past the end: unused
                b, k0 = at // granules, at % granules * 8
                for half in range(2):
                    B.buffer_store(vals, self.arena.vload([base(b) + k0 + half * 4], "float32x4"),
                                   [tirx.Ramp(i32(u * 8 + half * 4), i32(1), 4)])
                if norm is not None:
                    rstd, gamma = norm
                    for half in range(2):
                        B.buffer_store(gam, gamma.vload([self.col(P.LAYER), k0 + half * 4], "float32x4"),
                                       [tirx.Ramp(i32(half * 4), i32(1), 4)])
                    for j in range(8):
                        self.store(vals, u * 8 + j, vals[u * 8 + j] * rstd(b) * gam[j])
            for u in range(ahead):  # every lane runs the shuffles; only the stores are guarded
                at = (it * ahead + u) * self.threads + self.tx
                m = tirx.abs(vals[u * 8])
                for j in range(1, 8):
                    m = tirx.max(m, tirx.abs(vals[u * 8 + j]))
                self.store(amax, 0, m)
                for lane_mask in (1, 2):
                    self.store(amax, 0, tirx.max(amax[0], T.cuda._shfl_xor_sync(full, amax[0], lane_mask, 32)))
                self.store(inv, 0, tirx.Select(amax[0] > f32(0), f32(127) / amax[0], f32(0)))
                for j in range(8):
                    self.store(q, j, tirx.nearbyint(vals[u * 8 + j] * inv[0]).astype("int32"))
                self.store(qsum, 0, q[0] + q[1] + q[2] + q[3] + q[4] + q[5] + q[6] + q[7])
                for lane_mask in (1, 2):
                    self.store(qsum, 0, qsum[0] + T.cuda._shfl_xor_sync(full, qsum[0], lane_mask, 32))
                for h in range(2):
                    feats = [2 * j + h for j in range(4)] if order == "nibbles" else [4 * h + j for j in range(4)]
                    byte = [tirx.reinterpret("uint32", q[f]) & tirx.const(0xFF, "uint32") for f in feats]
                    w = byte[0]
                    for j in range(1, 4):  # unsigned: a quant's byte shifted to the top is no signed overflow
                        w = w | (byte[j] << tirx.const(8 * j, "uint32"))
                    self.store(word, h, tirx.reinterpret("int32", w))
                with self.when(at < total):
                    b, g = at // granules, at % granules
                    for h in range(2):
                        self.store(self.smem_i, (b * 2 + h) * granules + g, word[h])
                    with self.when(g % 4 == 0):
                        blk = g // 4
                        d = amax[0] / f32(127)
                        self.store(self.smem, d_at + b * blocks + blk, d.astype("float16").astype(F32))
                        self.store(self.smem, s_at + b * blocks + blk,
                                   (d * qsum[0].astype(F32)).astype("float16").astype(F32) * f32(0.25))

    def _q8_pass(self, op, unit, rows: int, r0, hi, g, granules: int, k_in: int, acc) -> None:
        """One granule of `rows` rows of each matmul against every sequence's 8-bit activations: two dp4a a
        (row, sequence), then d_w·(d_x·Σ) [+ m_w·s_x/4]. Q4_0 dots the stored unsigned quants and starts the sum
        at −8·Σq_x (the integer of ggml's Σ(q − 8)·q_x)."""
        nb = self.nb
        blk = g // 4
        xw, xsum, wl = self.local("int32", 2 * nb), self.local("int32", nb), self.local("int32", 2)
        types = self._weight_types(unit)
        for b in range(nb):
            for h in range(2):
                self.store(xw, 2 * b + h, self.smem_i[(b * 2 + h) * granules + g])
            if any(t in Q8_OFFSET for t in types):  # Σq_x, for the types stored with an offset
                ones = i32(0x01010101)
                self.store(xsum, b, dp4a(xw[2 * b + 1], ones, dp4a(xw[2 * b], ones, i32(0))))
        for m_i, m in enumerate(unit.matmuls):
            planes = self.weight(op, m.weights["weight"])
            layer = self.col(P.LAYER)
            for r in range(rows):
                row = tirx.min(r0 + r, hi - 1)  # past the tile: a valid row, its result unused
                if types[m_i] == "Q8_0":
                    words = self._word_view(planes["qs"], "int32")
                    w = [words[layer, row, 2 * g], words[layer, row, 2 * g + 1]]
                else:
                    qs = planes["qs"][layer, row, g]
                    mask = tirx.const(0x0F0F0F0F, "uint32")
                    w = [qs & mask, (qs >> tirx.const(4, "uint32")) & mask]
                    if types[m_i] == "Q6_K":  # its two high bits into bits 4-5 of each quant's byte
                        high = _sixth_bits(planes["qh"][layer, row, g // 2], (g % 2) * 16)
                        w = [a | e for a, e in zip(w, high, strict=True)]
                    elif "qh" in planes:  # Q5: each quant's fifth bit into its byte's bit 4
                        w = [a | e for a, e in zip(w, _fifth_bits(planes["qh"][layer, row, blk], g % 4),
                                                   strict=True)]
                    w = [tirx.reinterpret("int32", v) for v in w]
                self.store(wl, 0, w[0])
                self.store(wl, 1, w[1])
                dw, mw = self._q8_block_scales(planes, types[m_i], layer, row, blk)
                for b in range(nb):
                    a = (m_i * rows + r) * nb + b
                    off = Q8_OFFSET.get(types[m_i])
                    start = i32(-off) * xsum[b] if off else i32(0)
                    total = dp4a(wl[1], xw[2 * b + 1], dp4a(wl[0], xw[2 * b], start))
                    if types[m_i] == "Q6_K":  # a granule lies in one sub-block of 16
                        total = total * planes["sc"][layer, row, g // 2].astype("int32")
                    self._q8_accumulate(acc, a, total, dw, mw, b, blk, k_in, lanes_per_block=4)

    def _q8_block_pass(self, op, unit, rows: int, r0, hi, blk, granules: int, k_in: int, acc) -> None:
        """Block `blk` (32 values) of `rows` rows of each matmul against every sequence's 8-bit activations: the
        block's quants in one or two 16-byte loads, eight dp4a a (row, sequence), then d_w·(d_x·Σ) [+ m_w·s_x]."""
        nb = self.nb
        xw, xsum = self.local("int32", 8 * nb), self.local("int32", 2 * nb)
        wq, wi = self.local("uint32", 4), self.local("int32", 8)
        types = self._weight_types(unit)
        ones = i32(0x01010101)
        for b in range(nb):
            for h in range(2):
                for gg in range(4):
                    self.store(xw, b * 8 + h * 4 + gg, self.smem_i[(b * 2 + h) * granules + blk * 4 + gg])
            if any(t in Q8_OFFSET for t in types):  # Σq_x of each half (16 values), for the types with an offset
                for half in range(2):
                    total = i32(0)
                    for gg in (2 * half, 2 * half + 1):
                        total = dp4a(xw[b * 8 + 4 + gg], ones, dp4a(xw[b * 8 + gg], ones, total))
                    self.store(xsum, 2 * b + half, total)
        layer = self.col(P.LAYER)
        mask, four = tirx.const(0x0F0F0F0F, "uint32"), tirx.const(4, "uint32")
        for m_i, m in enumerate(unit.matmuls):
            planes = self.weight(op, m.weights["weight"])
            for r in range(rows):
                row = tirx.min(r0 + r, hi - 1)  # past the tile: a valid row, its result unused
                if types[m_i] == "Q8_0":  # words 2gg (features 8gg..8gg+3) and 2gg+1 of granule gg
                    words = self._word_view(planes["qs"], "int32")
                    for half in range(2):
                        B.buffer_store(wi, words.vload([layer, row, blk * 8 + half * 4], "int32x4"),
                                       [tirx.Ramp(i32(half * 4), i32(1), 4)])
                    pairs = [(wi[2 * gg], wi[2 * gg + 1]) for gg in range(4)]
                else:  # one word per granule: the low nibbles are its even features, the high ones its odd
                    B.buffer_store(wq, planes["qs"].vload([layer, row, blk * 4], "uint32x4"),
                                   [tirx.Ramp(i32(0), i32(1), 4)])
                    six = types[m_i] == "Q6_K"  # two high bits an element, a word per 16 (else Q5: one, per 32)
                    qh = [planes["qh"][layer, row, 2 * blk + i] for i in range(2)] if six else \
                        [planes["qh"][layer, row, blk]] if "qh" in planes else None
                    for gg in range(4):
                        w = [wq[gg] & mask, (wq[gg] >> four) & mask]
                        if six:
                            w = [a | e for a, e in zip(w, _sixth_bits(qh[gg // 2], 16 * (gg % 2)), strict=True)]
                        elif qh is not None:
                            w = [a | e for a, e in zip(w, _fifth_bits(qh[0], gg), strict=True)]
                        self.store(wi, 2 * gg, tirx.reinterpret("int32", w[0]))
                        self.store(wi, 2 * gg + 1, tirx.reinterpret("int32", w[1]))
                    pairs = [(wi[2 * gg], wi[2 * gg + 1]) for gg in range(4)]
                dw, mw = self._q8_block_scales(planes, types[m_i], layer, row, blk)
                off = Q8_OFFSET.get(types[m_i])
                for b in range(nb):
                    a = (m_i * rows + r) * nb + b
                    # one integer sum a half of 16 values (Q6_K scales each by its own int8 scale)
                    halves = [i32(-off) * xsum[2 * b + h] if off else i32(0) for h in range(2)]
                    for gg, (w0, w1) in enumerate(pairs):
                        halves[gg // 2] = dp4a(w1, xw[b * 8 + 4 + gg], dp4a(w0, xw[b * 8 + gg], halves[gg // 2]))
                    if types[m_i] == "Q6_K":
                        total = halves[0] * planes["sc"][layer, row, 2 * blk].astype("int32") + \
                            halves[1] * planes["sc"][layer, row, 2 * blk + 1].astype("int32")
                    else:
                        total = halves[0] + halves[1]
                    self._q8_accumulate(acc, a, total, dw, mw, b, blk, k_in, lanes_per_block=1)

    def _each(self, total: int, body) -> None:
        with B.serial(0, (total + self.threads - 1) // self.threads) as it:
            idx = it * self.threads + self.tx
            with self.when(idx < total):
                body(idx)

    def _write_out(self, op, name, slot, env, idx, n, rows_max, lo, w) -> None:
        b, r = idx // rows_max, idx % rows_max
        with self.when(r < n):
            self.store(self.arena, self.col(op.slot(name)) + b * w + lo + r, self.smem[env(slot, b, r)])

    def _append_kv(self, slot, env, idx, n, rows_max, lo, which) -> None:
        d = self.p.kv["head_dim"]
        b, r = idx // rows_max, idx % rows_max
        with self.when(r < n):
            pos = self.lengths[b]
            page = self.page_table[b, pos // self.p.page_size]
            f = lo + r
            self.store(self.pages, self.kv_index(self.col(P.KV_LAYER), page, which, f // d, pos % self.p.page_size,
                                                 f % d), self.smem[env(slot, b, r)].astype(self.kv_dtype))

    def kv_index(self, layer, page, which, head, slot, c) -> tirx.Expr:
        """Element (page, K|V, head, slot, feature) of a layer's pages in TVM's layout, from layer 0's start."""
        kv, ps = self.p.kv, self.p.page_size
        within = (((page.astype("int64") * 2 + which) * kv["kv_heads"] + head) * ps + slot) * kv["head_dim"] + c
        return self.kv_offset[layer] + within

    def kv_at(self, layer, page, which, head, slot, c) -> tirx.Expr:
        return self.pages[self.kv_index(layer, page, which, head, slot, c)]

    def block_argmax(self, extent: int, n, value, index, ok=None) -> tuple[tirx.Buffer, tirx.Buffer]:
        """The largest value(i) over i < n (extent bounds n) where ok(i) holds, and the lowest index(i) that has
        it, in every thread: each thread scans its items (ties keep the lower index), then a block max and a block
        min of the indices holding it. None qualifying: (lowest float, INT32_MAX)."""
        best, arg = self.local(), self.local("int32")
        self.store(best, 0, tirx.min_value(F32))
        self.store(arg, 0, i32(2**31 - 1))
        with B.serial(0, -(-extent // self.threads)) as it:
            i = it * self.threads + self.tx
            with self.when((i < n) if ok is None else ((i < n) & ok(i))):
                v, k = value(i), index(i)
                with self.when((v > best[0]) | ((v == best[0]) & (k < arg[0]))):
                    self.store(best, 0, v)
                    self.store(arg, 0, k)
        top = self.local()
        self.store(top, 0, self.cta(best[0], "max"))
        first = self.cta(tirx.if_then_else(best[0] == top[0], arg[0], i32(2**31 - 1)), "min", "int32")
        idx = self.local("int32")
        self.store(idx, 0, first)
        return top, idx

    def lm_partial(self, slot: int, env, n, rows_max: int, lo) -> None:
        """Per sequence: the tile's best logit and its index (the lowest on ties), among the allowed tokens when
        the step is masked."""
        with B.serial(0, self.nb) as b:
            def allowed(r):  # `||` in CUDA: an unmasked step reads no mask word
                t = lo + r
                return (self.masked == 0) | (((self.allowed[b, t // 32] >> (t % 32)) & 1) != 0)

            top, idx = self.block_argmax(rows_max, n, lambda r: self.smem[env(slot, b, r)], lambda r: lo + r,
                                         allowed)
            with self.when(self.tx == 0):
                self.store(self.amax_val, [b, self.col(P.TILE)], top[0])
                self.store(self.amax_idx, [b, self.col(P.TILE)], idx[0])
            self.sync()

    # ---- row-local ops on a tile in shared memory ---------------------------------------------------------------
    def epilogue(self, op: P.Opcode, ops: tuple[Op, ...], slots, env, lo, n, rows_max: int, n_rows: int,
                 batch_row) -> None:
        """`ops` on features [lo, lo+n) of `n_rows` tile rows; tile row i is batch row batch_row(i). Every op is one
        loop over (row, feature): no copy of the code per sequence."""
        for e in ops:
            if e.kind == OpKind.RESHAPE:
                continue
            out = slots[e.outputs[0]]

            def load(name: str, i, r, name_slot=slots):
                if name in name_slot:
                    return self.smem[env(name_slot[name], i, r)]
                return self.arena_at(op, name, batch_row(i), lo + r)

            if e.kind == OpKind.RMS_NORM:
                self.head_norm(op, e, slots, env, out, n, n_rows, load)
            elif e.kind == OpKind.ROPE:
                self.rope(op, e, env, out, n, n_rows, batch_row, lo, load)
            else:
                self._each(n_rows * rows_max, lambda idx, e=e, out=out: self._elementwise(
                    op, e, env, out, idx // rows_max, idx % rows_max, n, load))
            self.sync()

    def _elementwise(self, op, e: Op, env, out: int, i, r, n, load) -> None:
        with self.when(r < n):
            x = load(e.inputs[0], i, r)
            match e.kind:
                case OpKind.SCALE:
                    y = x * f32(e.attrs["scale"])
                case OpKind.SOFTCAP:
                    cap = f32(e.attrs["cap"])
                    y = cap * tirx.tanh(x / cap)
                case OpKind.ADD:
                    y = x + load(e.inputs[1], i, r)
                case OpKind.GLU:
                    if e.attrs["activation"] == "silu":
                        act = x / (f32(1) + tirx.exp(-x))
                    else:  # gelu, tanh form (ggml_gelu)
                        act = f32(0.5) * x * (f32(1) + tirx.tanh(f32(math.sqrt(2 / math.pi)) *
                                                                  (x + f32(0.044715) * x * x * x)))
                    y = act * load(e.inputs[1], i, r)
                case _:
                    raise UnsupportedError(f"fuse: no megakernel epilogue for {e.kind}")
            self.store(self.smem, env(out, i, r), y)

    def head_norm(self, op, e: Op, slots, env, out: int, n, n_rows: int, load) -> None:
        """RMS norm over each head (4-D input) or over the whole row (3-D: row stages), one warp per (row, head)."""
        d = int(self.p.graph.weights[e.weights["weight"]].shape[0])
        eps = f32(e.attrs["eps"])
        heads = n // d
        with B.serial(0, (n_rows * max(1, self._cur_rows_max // d) + self.warps - 1) // self.warps) as it:
            pair = it * self.warps + self.warp
            i, h = pair // tirx.max(heads, 1), pair % tirx.max(heads, 1)
            def each_feature(body) -> None:  # the warp's lanes over the head's features: body(feature, x)
                with B.serial(0, -(-d // 32)) as dd:
                    c = dd * 32 + self.lane
                    with self.when(c < d):
                        body(c, load(e.inputs[0], i, h * d + c))

            with self.when(pair < n_rows * heads):
                part = self.local()
                self.store(part, 0, f32(0))
                each_feature(lambda c, v: self.store(part, 0, part[0] + v * v))
                scale = self.local()
                self.store(scale, 0, tirx.rsqrt(T.cuda.warp_sum(part[0]) / f32(d) + eps))
                each_feature(lambda c, v: self.store(self.smem, env(out, i, h * d + c),
                                                     v * scale[0] * self.vector(op, e.weights["weight"], c)))

    def rope(self, op, e: Op, env, out: int, n, n_rows: int, batch_row, lo, load) -> None:
        a = e.attrs
        d = int(self.values[e.inputs[0]].shape[-1])
        dim, half = a["dim"], a["dim"] // 2
        rows_max = self._cur_rows_max

        def body(idx):
            i, r = idx // rows_max, idx % rows_max
            pos = self.lengths[batch_row(i)].astype(F32)
            with self.when(r < n):
                c = (lo + r) % d  # the feature within its head (tiles start on a head)
                x = load(e.inputs[0], i, r)
                if a["layout"] == "norm":
                    p_i, first = c // 2, c % 2 == 0
                    partner = tirx.if_then_else(first, r + 1, r - 1)
                else:
                    p_i, first = c % half, c < half
                    partner = tirx.if_then_else(first, r + half, r - half)
                inv = f32(a["freq_scale"]) * tirx.pow(f32(a["base"]), f32(-2.0 / dim) * p_i.astype(F32))
                if "freq_factors" in e.weights:  # clamped: features past `dim` are not rotated
                    inv = inv / self.vector(op, e.weights["freq_factors"], tirx.min(p_i, half - 1))
                theta = pos * inv
                y = load(e.inputs[0], i, tirx.if_then_else(c < dim, partner, r))
                rot = tirx.if_then_else(first, x * tirx.cos(theta) - y * tirx.sin(theta),
                                        y * tirx.sin(theta) + x * tirx.cos(theta))
                self.store(self.smem, env(out, i, r), tirx.if_then_else(c < dim, rot, x))

        self._each(n_rows * rows_max, body)

    # ---- row stages ---------------------------------------------------------------------------------------------
    def row(self, op: P.Opcode, st) -> None:
        first = st.ops[0]
        w = self.p.width(first.outputs[0])
        slots: dict[str, int] = {}
        for e in st.ops:
            slots[e.outputs[0]] = slots[e.inputs[0]] if e.kind == OpKind.RESHAPE else len(set(slots.values()))
        if len(set(slots.values())) * w > self.shared_floats:
            raise UnsupportedError(f"fuse: a row stage of {w} features does not fit shared memory")
        b = self.col(P.ROW)

        def env(slot: int, i, r) -> tirx.Expr:
            return slot * w + r

        self._cur_rows_max = w
        if first.kind == OpKind.RMS_NORM:  # the whole-row norm: a block reduction
            part = self.local()
            self.store(part, 0, f32(0))
            self._each(w, lambda k: self.store(part, 0, part[0] + self.arena_at(op, first.inputs[0], b, k)
                                               * self.arena_at(op, first.inputs[0], b, k)))
            total = self.cta(part[0], "sum")
            scale = self.local()
            self.store(scale, 0, tirx.rsqrt(total / f32(w) + f32(first.attrs["eps"])))
            self._each(w, lambda k: self.store(self.smem, env(slots[first.outputs[0]], 0, k),
                                               self.arena_at(op, first.inputs[0], b, k) * scale[0]
                                               * self.vector(op, first.weights["weight"], k)))
            self.sync()
            rest = st.ops[1:]
        else:
            rest = st.ops
        self.epilogue(op, tuple(rest), slots, env, i32(0), i32(w), w, 1, lambda i: b)
        for name, slot in slots.items():
            if name in op.outputs:
                self._each(w, lambda k, slot=slot, name=name: self.store(
                    self.arena, self.col(op.slot(name)) + b * w + k, self.smem[env(slot, 0, k)]))

    # ---- attention ----------------------------------------------------------------------------------------------
    def attention(self, op: P.Opcode, st) -> None:
        att = st.attention
        a = att.attrs
        q_name = att.inputs[0]
        h, hkv = a["n_head"], a["n_head_kv"]
        group, d = h // hkv, self.p.kv["head_dim"]
        per_lane = -(-d // 32)  # dimensions per lane in p·v (the last may be partial for heads under 32)
        n_splits = st.n_splits
        window = int(a.get("sliding_window") or 0)
        chunk = self._chunk_max(st, window)
        # shared: q (group, d) | p (warps, group, 32) | o (warps, group, d) | m, l (warps, group)
        q_at, p_at = 0, group * d
        o_at = p_at + self.warps * group * 32
        ml_at = o_at + self.warps * group * d
        if ml_at + 2 * self.warps * group > self.shared_floats:
            raise UnsupportedError("fuse: attention's partials for this head group do not fit shared memory")
        b, g, split = self.col(P.ROW), self.col(P.LO), self.col(P.SPLIT)
        partials = self.p.partials.get(op.stage)
        with self.when(split >= 0):
            self._attn_partial(op, att, q_name, b, g, split, group, d, per_lane, chunk, window, n_splits,
                               q_at, p_at, o_at, ml_at, partials)
            if st.merged_by_last:
                self._merge_if_last(op, att, b, g, group, d, n_splits, partials)
        if partials is not None and not st.merged_by_last:
            with self.when(split < 0):
                self._attn_merge(op, att, b, g, group, d, n_splits, partials)

    def _chunk_max(self, st, window: int) -> int:
        """The most keys one attention task of the stage reads (a static bound for its loops)."""
        span = min(window, self.p.tg.max_context) if window else self.p.tg.max_context
        return self.p.tg.chunk_keys(span) if st.n_splits > 1 else self.p.tg.max_context

    def _visible(self, window: int, b) -> tuple[tirx.Expr, tirx.Expr]:
        """Sequence b's first visible key this step and how many keys it sees (with this step's)."""
        pos = self.lengths[b]
        first = tirx.max(pos - (window - 1), 0) if window else i32(0)
        return first, pos + 1 - first

    def _chunk(self, st, window: int, b, split) -> tuple[tirx.Expr, tirx.Expr]:
        """The keys [lo, hi) of sequence b's chunk `split` this step (TaskGraph.chunk_keys, as the simulator)."""
        first, span = self._visible(window, b)
        if st.n_splits == 1:
            return first, first + span
        chunk = self.p.tg.chunk_keys(span, tirx.max)
        kv_lo = first + split * chunk
        return kv_lo, tirx.min(first + span, kv_lo + chunk)

    def _attn_partial(self, op, att, q_name, b, g, split, group, d, per_lane, chunk, window, n_splits,
                      q_at, p_at, o_at, ml_at, partials) -> None:
        a = att.attrs
        ps, layer = self.p.page_size, self.col(P.KV_LAYER)
        kv_lo, kv_hi = self._chunk(self.p.tg.stages[op.stage], window, b, split)
        hd = a["n_head"] * d
        self._each(group * d, lambda idx: self.store(
            self.smem, q_at + idx, self.arena[self.col(op.slot(q_name)) + b * hd + g * group * d + idx]))
        self.sync()
        self.phase(3)
        m, lsum = self.local(F32, group), self.local(F32, group)
        o = self.local(F32, group * per_lane)
        s = self.local(F32, group)
        for hh in range(group):
            self.store(m, hh, tirx.min_value(F32))
            self.store(lsum, hh, f32(0))
            for c in range(per_lane):
                self.store(o, hh * per_lane + c, f32(0))
        waves = -(-chunk // (self.warps * 32))
        # a lane's key row in 16-byte loads (all in flight at once) where the head's rows are whole vectors: as
        # 32-bit words (TVM's CUDA codegen has no float16x8 type), each value taken out of its word
        bits = DataType(self.kv_dtype).bits
        per_word = 32 // bits
        vec = 4 if d % (4 * per_word) == 0 else 0
        krow, page = self.local("uint32", max(1, d // per_word)), self.local("int32")
        n_pages = 32 // ps + (2 if 32 % ps else 1)  # pages a warp's 32 consecutive keys can touch
        pages_of = self.local("int32", n_pages)
        words = B.decl_buffer((self.n_kv // per_word,), "uint32", data=self.pages.data) if vec else None

        def key_value(c):
            if not vec:
                return self.kv_at(layer, page[0], 0, g, slot, c).astype(F32)
            w = krow[c // per_word]
            if per_word == 1:
                return tirx.reinterpret(self.kv_dtype, w).astype(F32)
            part = (w >> tirx.const(bits * (c % per_word), "uint32")) & tirx.const((1 << bits) - 1, "uint32")
            return tirx.reinterpret(self.kv_dtype, part.astype(f"uint{bits}")).astype(F32)

        with B.serial(0, waves) as wv:
            base = kv_lo + (wv * self.warps + self.warp) * 32
            with self.when(base < kv_hi):  # warp-uniform: every lane reaches the shuffles
                j = base + self.lane
                valid = j < kv_hi
                jc = tirx.min(j, kv_hi - 1)  # past the chunk: a visible key's address, its weight 0
                self.store(page, 0, self.page_table[b, jc // ps])
                slot = jc % ps
                # the row's first word as a multiple of the vector (exact: rows start on multiples of d), which is
                # what lets TVM's codegen emit one 16-byte load instead of four gathered words
                row16 = self.kv_index(layer, page[0], 0, g, slot, 0) // (vec * per_word)
                for i in range(d // (vec * per_word) if vec else 0):
                    B.buffer_store(krow, words.vload([(row16 + i) * vec], f"uint32x{vec}"),
                                   [tirx.Ramp(i32(i * vec), i32(1), vec)])
                for hh in range(group):
                    self.store(s, hh, f32(0))
                for c in range(d):
                    kval = key_value(c)
                    for hh in range(group):
                        self.store(s, hh, s[hh] + self.smem[q_at + hh * d + c] * kval)
                for hh in range(group):
                    score = s[hh]
                    if a["softcap"]:
                        cap = f32(a["softcap"])
                        score = cap * tirx.tanh(score / cap)
                    score = tirx.if_then_else(valid, score * f32(a["scale"]), tirx.min_value(F32))
                    self.store(s, hh, score)
                    score = s[hh]  # the stored score: `score` above reads s[hh], which the store just replaced
                    m_new = self.local()
                    self.store(m_new, 0, tirx.max(m[hh], T.cuda.warp_max(score)))
                    pv = self.local()
                    self.store(pv, 0, tirx.if_then_else(valid, tirx.exp(score - m_new[0]), f32(0)))
                    corr = self.local()
                    self.store(corr, 0, tirx.exp(m[hh] - m_new[0]))
                    self.store(lsum, hh, lsum[hh] * corr[0] + T.cuda.warp_sum(pv[0]))
                    self.store(self.smem, p_at + (self.warp * group + hh) * 32 + self.lane, pv[0])
                    for c in range(per_lane):
                        self.store(o, hh * per_lane + c, o[hh * per_lane + c] * corr[0])
                    self.store(m, hh, m_new[0])
                B.evaluate(T.cuda.warp_sync())
                # p·v without a branch a key: the warp's 32 keys lie on at most 32 / ps + 1 pages, read once; a key
                # past the chunk reads a clamped visible key with weight 0; so all 32 keys' loads can be in flight
                # at once (a branch and a page-table load a key made them 64 dependent round trips)
                first_page = base // ps
                last = (kv_hi - 1) // ps
                for i in range(n_pages):
                    self.store(pages_of, i, self.page_table[b, tirx.min(first_page + i, last)])
                with B.unroll(0, 32) as kk:
                    jk = tirx.min(base + kk, kv_hi - 1)
                    pg = pages_of[0]
                    for i in range(1, n_pages):
                        pg = tirx.Select(jk // ps - first_page >= i, pages_of[i], pg)
                    # the key's value row once into a register, each value once: written inline, the address
                    # (page select, layer offset) was repeated in every head's FMA, 1.4 MB of the Qwen2.5-Coder-
                    # 1.5B shape's 5.2 MB batch-1 kernel (6 heads a group x 128 dims x 32 keys)
                    row = self.local("int64")
                    self.store(row, 0, self.kv_index(layer, pg, 1, g, jk % ps, 0))
                    for c in range(per_lane):
                        v = self.local()
                        self.store(v, 0, self.pages[row[0] + tirx.min(c * 32 + self.lane, d - 1)].astype(F32))
                        for hh in range(group):
                            i = hh * per_lane + c
                            self.store(o, i, o[i] + self.smem[p_at + (self.warp * group + hh) * 32 + kk] * v[0])
                B.evaluate(T.cuda.warp_sync())
        self.phase(4)  # thread 0's warp's keys done (the others may still run)
        # the warps' partials → shared, then one (max, sum, o) per head
        for hh in range(group):
            with self.when(self.lane == 0):
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2, m[hh])
                self.store(self.smem, ml_at + (self.warp * group + hh) * 2 + 1, lsum[hh])
            for c in range(per_lane):
                with self.when(c * 32 + self.lane < d):
                    self.store(self.smem, o_at + (self.warp * group + hh) * d + c * 32 + self.lane,
                               o[hh * per_lane + c])
        self.sync()
        self.phase(5)  # every warp's partials in shared memory: the rest is the combine and its writes
        out = att.outputs[0]

        def combine(idx) -> None:
            hh, c = idx // d, idx % d
            mx, den, num = self.local(), self.local(), self.local()
            self.store(mx, 0, tirx.min_value(F32))
            for w in range(self.warps):
                self.store(mx, 0, tirx.max(mx[0], self.smem[ml_at + (w * group + hh) * 2]))
            self.store(den, 0, f32(0))
            self.store(num, 0, f32(0))
            for w in range(self.warps):
                sc = tirx.exp(self.smem[ml_at + (w * group + hh) * 2] - mx[0])
                self.store(den, 0, den[0] + sc * self.smem[ml_at + (w * group + hh) * 2 + 1])
                self.store(num, 0, num[0] + sc * self.smem[o_at + (w * group + hh) * d + c])
            head = g * group + hh
            if partials is None:
                self.store(self.arena, self.col(op.slot(out)) + b * (att.attrs["n_head"] * d) + head * d + c,
                           num[0] / den[0])
            else:
                h = att.attrs["n_head"]
                base = (b * n_splits + split) * h
                self.store(self.arena, partials.o + (base + head) * d + c, num[0])
                with self.when(c == 0):
                    self.store(self.arena, partials.ml + (base + head) * 2, mx[0])
                    self.store(self.arena, partials.ml + (base + head) * 2 + 1, den[0])

        self._each(group * d, combine)

    def merged_value(self, att_stage, partials: P.AttentionPartials, b, head, c) -> tirx.Expr:
        """Feature c of `head`'s attention output for sequence b, from its split partials (o unnormalized, running
        max and sum): the merge task's value, and the O projection's input when its tiles merge (Stage.merged).
        Only the splits that hold keys this step are read (the others' partials are empty)."""
        att, n_splits = att_stage.attention, att_stage.n_splits
        h, d = att.attrs["n_head"], int(self.values[att.inputs[2]].shape[-1])
        _, span = self._visible(int(att.attrs.get("sliding_window") or 0), b)
        chunk = self.p.tg.chunk_keys(span, tirx.max)
        active = tirx.min(i32(n_splits), (span + chunk - 1) // chunk)
        mx, den, num = self.local(), self.local(), self.local()
        self.store(mx, 0, tirx.min_value(F32))
        with B.serial(0, active) as j:
            self.store(mx, 0, tirx.max(mx[0], self.arena[partials.ml + ((b * n_splits + j) * h + head) * 2]))
        self.store(den, 0, f32(0))
        self.store(num, 0, f32(0))
        with B.serial(0, active) as j:
            at = (b * n_splits + j) * h + head
            sc = self.local()
            self.store(sc, 0, tirx.exp(self.arena[partials.ml + at * 2] - mx[0]))
            self.store(den, 0, den[0] + sc[0] * self.arena[partials.ml + at * 2 + 1])
            self.store(num, 0, num[0] + sc[0] * self.arena[partials.o + at * d + c])
        return num[0] / den[0]

    def _merge_if_last(self, op, att, b, g, group, d, n_splits, partials) -> None:
        """Merged by the last chunk (Stage.merged_by_last): thread 0 releases the block's partials, adds 1 to the
        (sequence, KV head)'s arrival counter, and the chunk that brings it to n_splits x epoch acquires the
        others' partials and merges them, where a merge task would have waited for them (a handoff: poll, barrier,
        its loads after). The task publishes after this, so its consumers see the merged output."""
        self.sync()  # every thread's partial writes issued
        with self.when(self.tx == 0):
            B.evaluate(T.ptx.fence.acq_rel.gpu())
            before = self.local("int32")
            self.store(before, 0, T.cuda.atomic_add(T.address_of(self.counters[self.col(P.ARRIVAL)]), i32(1)))
            last = before[0] == i32(n_splits) * self.epoch - 1
            with self.when(last):
                B.evaluate(T.ptx.fence.acq_rel.gpu())  # acquire: the other chunks' partials, for every thread
            self.store(self.redi, 0, tirx.if_then_else(last, i32(1), i32(0)))
        self.sync()
        with self.when(self.redi[0] == 1):
            self._attn_merge(op, att, b, g, group, d, n_splits, partials)

    def _attn_merge(self, op, att, b, g, group, d, n_splits, partials) -> None:
        h = att.attrs["n_head"]
        out = att.outputs[0]

        def merge(idx) -> None:
            hh, c = idx // d, idx % d
            head = g * group + hh
            self.store(self.arena, self.col(op.slot(out)) + b * (h * d) + head * d + c,
                       self.merged_value(self.p.tg.stages[op.stage], partials, b, head, c))

        self._each(group * d, merge)

    # ---- argmax -------------------------------------------------------------------------------------------------
    def argmax(self) -> None:
        b = self.col(P.ROW)
        tiles = max(1, self.p.lm_tiles)
        top, idx = self.block_argmax(tiles, tiles, lambda t: self.amax_val[b, t], lambda t: self.amax_idx[b, t])
        with self.when(self.tx == 0):
            self.store(self.token_out, b, idx[0])
            self.store(self.lengths_out, b, self.lengths[b] + 1)


def emit_megakernel(prog: P.Program, *, name: str = "megakernel",
                    options: MegakernelOptions | None = None) -> tirx.PrimFunc:
    em = MegakernelEmitter(prog, name=name, options=options or MegakernelOptions())
    return em.build()
