"""The megakernel's frame: the small builders, the kernel's arguments, the persistent loop over a block's queue
(per task: the row of the task table, the L2 prefetch, the waits on its counters, the opcode's body, the counters
it publishes), the profile clocks, the KV pages' addressing, and the bodies that are not matvecs: embed, row stages
and the LM head's argmax. MegakernelEmitter (this package's __init__) adds the rest as mixins, which share this
class's state on self."""

from __future__ import annotations

from contextlib import contextmanager

from tvm import DataType, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.sym import Analyzer
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.fuse import program as P
from luce_compile.fuse.emit_cuda import intrinsics as ix
from luce_compile.fuse.options import STATIC_KIB, MegakernelOptions
from luce_compile.fuse.taskgraph import TaskKind
from luce_compile.graph.ir import LOGITS, OpKind
from luce_compile.lower.quant_layout import plane_specs
from luce_compile.lower.quant_matmul import dequant_expr, exact_int_to_float

LINE = 128  # bytes per L2 prefetch
SPIN_LIMIT = 1 << 21  # polls (~1 µs each with the back-off) before a wait gives up: seconds
F32 = "float32"


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


class EmitterCore:
    def __init__(self, prog: P.Program, *, name: str, options: MegakernelOptions):
        self.p, self.name, self.kv_dtype = prog, name, options.kv_dtype
        self.prefetch_bytes, self.poll_sleep_ns = options.prefetch_bytes, options.poll_sleep_ns
        self.values = prog.values
        self.nb = prog.batch
        self.threads, self.warps = options.threads, options.threads // 32
        self.unroll_passes = options.unroll_passes
        self.k_slice_units = options.k_slice_units
        self.fewest_rounds = options.fewest_rounds
        self.interleave_slices = options.interleave_slices
        self.prefetch_ahead = options.prefetch_ahead
        self.q8 = options.q8_activations
        self.q8_by_block = options.q8_by_block
        self.q8_mma = options.q8_mma
        self.float_mma = options.float_mma
        self.float_mma_ahead = options.float_mma_ahead
        self.float_mma_tiles = options.float_mma_tiles
        self.attn_rows, self.attn_rows_slots = options.attn_rows, options.attn_rows_slots
        self.q8_codebooks = options.q8_codebooks
        self.q8_low_bits = options.q8_low_bits
        self.analyzer = Analyzer()  # _Granule's index simplification
        self.q8_batch = max(options.batches or (self.nb,))  # a stage's q8 choice is the same at every batch size
        # float32 words of shared memory: static up to 48 KiB, dynamic above (TVM's launch raises the limit)
        self.shared_floats = (options.shared_kib or STATIC_KIB) * 256  # 0: no target known here, the static
        # measured (benchmarks/README.md, run4's variants): 32 sums a lane are 10% faster at batch 8, 20% slower at 1
        self.accumulators = options.accumulators or (32 if self.nb >= 4 else 16)

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
        ix.block_sync()

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
            self.store(part, 0, ix.warp_reduce(value, how, self.lane))
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

    def args(self) -> None:
        p, nb = self.p, self.nb
        kv = p.kv
        # the KV pool is TVM's own: PagedKVCache keeps one page tensor per layer (pages, 2, kv heads, page size,
        # head dim), each a separate allocation, so the kernel takes layer 0's tensor flat and each layer's offset
        # from it in elements (int64: the allocations may lie far apart, before or after layer 0's)
        self.n_kv = tirx.Var("n_kv", "int64")
        # ids in [0, nb); element nb of the step's token_out is the gave-up marker (wait): one copy back per step
        # tells the host both the ids and whether every block finished. tokens and token_out swap between steps
        self.tokens = B.arg("tokens", B.buffer((nb + 1,), "int32"))
        self.lengths = B.arg("lengths", B.buffer((nb,), "int32"))
        # each row's page ids, as many as the caller's table has: the engine sizes it for its own context (the
        # kernel's maximum context is the model's, up to 131,072 tokens: 8,192 ids a row that a 4K engine never uses)
        self.max_pages = tirx.Var("max_pages", "int32")
        self.page_table = B.arg("page_table", B.buffer((nb, self.max_pages), "int32"))
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
        # a token tree's verify rows (Engine.verify_tree): a row's `lengths` is its slot (TVM lays a tree's nodes out
        # in consecutive slots), and bit k of its word here marks the key k slots before its own as another branch's:
        # its attention skips that key, and its RoPE position counts it out (position = slot - popcount, the
        # node's depth past the sequence). 0 for a decode step's rows and a chain's: the word is all a tree costs,
        # whatever its depth (up to 32 nodes)
        self.off_path = B.arg("off_path", B.buffer((nb,), "int32"))
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

    def build(self) -> tirx.PrimFunc:
        p = self.p
        with IRBuilder() as ib, B.prim_func():
            B.func_name(self.name)
            self.args()
            bx, tx = B.env_thread("blockIdx.x"), B.env_thread("threadIdx.x")
            with B.launch_thread(bx, len(p.queue_len)), B.launch_thread(tx, self.threads):
                self.tx, self.warp, self.lane = tx, tx // 32, tx % 32
                scope = ix.shared_scope(self.shared_floats)
                self.smem = B.alloc_buffer((self.shared_floats,), F32, scope=scope)
                # the same words as int32: the quantized activations (q8_activations)
                self.smem_i = B.decl_buffer((self.shared_floats,), "int32", data=self.smem.data, scope=scope)
                self.word_views: dict[tuple, tirx.Buffer] = {}  # weight planes as 32-bit words, by (buffer, word type)
                self.red = B.alloc_buffer((max(2, self.nb) * self.warps,), F32, scope="shared")  # cta_many
                self.redi = B.alloc_buffer((2 * self.warps,), "int32", scope="shared")
                self.part = B.alloc_buffer((self.warps * self.accumulators,), F32, scope="shared")  # K-slice sums
                self.trow = self.local("int32", p.tasks.shape[2])
                # the step's lengths, once a block: which attention chunks hold keys is known before their waits
                self.seq_len = B.alloc_buffer((self.nb,), "int32", scope="shared")
                with self.when(tx < self.nb):
                    self.store(self.seq_len, tx, self.lengths[tx])
                self.sync()
                spins = self.local("int32")  # a thread's wait budget: SPIN_LIMIT, then 0 after one gives up
                self.store(spins, 0, i32(SPIN_LIMIT))
                # 1: the task is an attention chunk with no keys this step (AttentionMixin.empty_chunk): no wait, no
                # body, only its counters (block-uniform: every thread computes it from the same row and lengths)
                skip = self.local("int32")
                split_attention = [op for op in p.opcodes if op.kind == TaskKind.ATTN_PARTIAL
                                   and p.tg.stages[op.stage].n_splits > 1]
                with B.serial(0, self.queue_len[bx]) as i:
                    self.bx, self.position = bx, i  # for the phase clocks (`phase`)
                    for c in range(p.tasks.shape[2]):
                        self.store(self.trow, c, self.tasks[bx, i, c])
                    self.stamp(bx, i, 0)
                    self.store(skip, 0, i32(0))
                    for op in split_attention:
                        with self.when(self.col(P.OPCODE) == op.index):
                            self.store(skip, 0, tirx.if_then_else(self.empty_chunk(op), i32(1), i32(0)))
                    with self.when(skip[0] == 0):
                        if self.prefetch_bytes:
                            for op in p.opcodes:
                                if op.kind in (TaskKind.MATVEC, TaskKind.ATTN_PARTIAL):
                                    with self.when(self.col(P.OPCODE) == op.index):
                                        self.prefetch(op)
                        # a thread per dependency: their polls are in flight together (thread 0 waiting on each in
                        # turn paid an L2 round trip per counter: 2-3 µs before an attention task that reads five
                        # QKV tiles); the barrier after passes every thread's acquire on to the block
                        start, n_deps = self.col(P.DEP_START), self.col(P.DEP_COUNT)
                        with B.serial(0, (n_deps + self.threads - 1) // self.threads) as it:
                            d = it * self.threads + tx
                            with self.when(d < n_deps):
                                self.wait(self.deps[start + d, 0], self.deps[start + d, 1] * self.epoch, bx, i,
                                          spins)
                        self.sync()
                    self.stamp(bx, i, 1)
                    with self.when(skip[0] == 0):
                        for op in p.opcodes:
                            with self.when(self.col(P.OPCODE) == op.index):
                                self.opcode(op)
                    self.sync()
                    self.stamp(bx, i, 2)
                    with self.when(tx == 0):  # CUTLASS's barrier: the block's writes (bar.sync), a release
                        # fence, then relaxed reductions (no round trip); fence.sc (__threadfence) costs more. A
                        # skipped task wrote nothing: no fence
                        with self.when(skip[0] == 0):
                            ix.fence_acq_rel()
                        for c in (P.COUNTER, P.STAGE_COUNTER):
                            ix.red_add(T.address_of(self.counters[self.col(c)]), i32(1))
                        if self.p.has_groups:
                            with self.when(self.col(P.GROUP_COUNTER) >= 0):
                                ix.red_add(T.address_of(self.counters[self.col(P.GROUP_COUNTER)]), i32(1))
        return ib.get()

    def phase(self, which: int) -> None:
        """A clock inside a task body, after a barrier: 3 = its input is in place, 4 = its main loop is done,
        5 = its epilogue is done (the rest, to clock 2, is its writes)."""
        self.stamp(self.bx, self.position, which)

    def stamp(self, bx, position, which: int) -> None:
        with self.when((self.tx == 0) & (self.profiling != 0)):
            # the global timer (ns, one clock for every SM): stages line up across SMs, handoffs can be measured
            self.store(self.profile, [bx, position, which], ix.global_timer_ns())

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
        ix.load_acquire(seen, addr)
        with B.While((seen[0] < target) & (n[0] < spins[0])):
            ix.sleep_ns(self.poll_sleep_ns)  # back-off: less L2 contention
            ix.load_acquire(seen, addr)
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
                ix.prefetch_l2(T.address_of(at(e)))

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
        if self.norm_partial(op, out) is not None:  # the block's own writes, read back after a barrier
            self.sync()
            self.norm_sums(op, out, lambda i, r: self.arena_at(op, out, i, lo + r), lo, n, self._max_tile(op),
                           self.nb, lambda i: i)

    def _max_tile(self, op: P.Opcode) -> int:
        return max(t.hi - t.lo for t in self.p.tg.tasks if t.stage == op.stage)

    def _each(self, total: int, body) -> None:
        with B.serial(0, (total + self.threads - 1) // self.threads) as it:
            idx = it * self.threads + self.tx
            with self.when(idx < total):
                body(idx)

    def rope_position(self, b) -> tirx.Expr:
        """Row b's RoPE position: its slot less the other branches' keys before it (off_path), as an int32."""
        return self.lengths[b] - ix.popcount(self.off_path[b])

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
                self.norm_sums(op, name, lambda i, k, slot=slot: self.smem[env(slot, 0, k)], i32(0), i32(w), w, 1,
                               lambda i: b)

    def argmax(self) -> None:
        b = self.col(P.ROW)
        tiles = max(1, self.p.lm_tiles)
        top, idx = self.block_argmax(tiles, tiles, lambda t: self.amax_val[b, t], lambda t: self.amax_idx[b, t])
        with self.when(self.tx == 0):
            self.store(self.token_out, b, idx[0])
            self.store(self.lengths_out, b, self.lengths[b] + 1)
