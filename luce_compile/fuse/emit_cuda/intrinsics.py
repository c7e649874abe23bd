"""The megakernel's target intrinsics: the few operations of the task program that differ between NVIDIA GPUs (PTX
through TVM's CUDA backend) and AMD RDNA (wave32; LLVM's AMDGPU backend through TVM's ROCm codegen). The emitter
calls these functions instead of `T.cuda.*` / `T.ptx.*`; everything else it emits (buffers, loops, 16-byte vector
loads, the dequantization expressions) is target-neutral TIR.

Which target: the one in scope (`with target:`, as TVM's own passes read it; fuse/build.py emits inside it). No
ROCm target in scope means CUDA, so the CUDA source is what it was before this module existed (a test compares).

On AMDGPU, TVM 0.27's LLVM codegen can emit LLVM *intrinsics* (`call_llvm_intrin`) but not LLVM *instructions* with
a memory ordering: it has no atomic load, no `fence`, and its only atomic is `atomicrmw add monotonic` at system
scope (src/backend/rocm/codegen/llvm/codegen_amdgpu.cc), and no inline assembly. Those pieces are written here as
small LLVM IR functions (`AMDGPU_IR`) that the build links into the kernel the way TVM links the ROCm device
libraries (ocml): `tvm_callback_rocm_bitcode_path` lists the file, TVM parses it (text IR is accepted), links the
functions the kernel calls and marks them always-inline. The rest are LLVM intrinsics called directly.

What each maps to (CUDA | AMDGPU, gfx11 / gfx12 instructions as llvm-objdump shows them):
  load_acquire   ld.acquire.gpu            | load atomic acquire, syncscope agent: global_load glc + waitcnt +
                                             buffer_gl1_inv/gl0_inv (gfx11) | global_load scope:SCOPE_DEV +
                                             global_inv scope:SCOPE_DEV (gfx12)
  fence_acq_rel  fence.acq_rel.gpu         | fence syncscope("agent") acq_rel
  red_add        red.relaxed.gpu.add       | atomicrmw add syncscope("agent") monotonic, result unused
  atomic_add     atomicAdd (old value)     | the same, returning the old value
  sleep_ns       nanosleep                 | s_sleep (units of ~64 clocks)
  global_timer   %globaltimer (ns)         | llvm.readsteadycounter (s_sendmsg_rtn_b64 REALTIME, a 100 MHz
                                             constant clock on RDNA: ticks x 10 = ns)
  dot4           __dp4a                    | llvm.amdgcn.sudot4 signed x signed (v_dot4_i32_iu8: gfx11, gfx12)
  popcount       __popc                    | llvm.ctpop.i32 (TVM 0.27 lowers tirx.popcount for neither)
  shfl_xor       __shfl_xor_sync           | TVM's tvm_warp_shuffle, which its ROCm rules lower to ds_bpermute
  warp_reduce    TVM's xor butterfly       | the same butterfly (16, 8, 4, 2, 1) over shfl_xor: the same sums
  warp_sync      __syncwarp                | a wavefront-scope fence (the wave runs in lockstep: only the
                                             compiler must not move shared-memory accesses across it)
  block_sync     __syncthreads             | workgroup release fence, TVM's storage sync (s_barrier), acquire
                                             fence (HIP's __syncthreads): that sync alone is a bare s_barrier, which
                                             LLVM marks IntrNoMem (shared-memory accesses may move across it) and
                                             which gfx10+ does not precede with a wait (its back-off barrier)
  prefetch_l2    prefetch.global.L2        | none: gfx11/gfx1201 have no prefetch instruction (gfx1250's
                                             global_prefetch is not theirs); the build turns prefetch_bytes off
  shared_scope   dynamic above 48 KiB      | static LDS always: a workgroup may allocate up to 64 KiB without
                                             opting in, and TVM's ROCm dynamic LDS is marked experimental
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.tirx.script.builder import ir as B

from luce_compile.errors import UnsupportedError
from luce_compile.lower.quant_matmul import byte_perm, table16_bytes  # noqa: F401  (the emitter's, as ix.*)

CUDA_STATIC_SHARED_FLOATS = 12 * 1024  # 48 KiB: CUDA's static shared memory without opting in
S_SLEEP_NS = 32  # one s_sleep unit: ~64 clocks (RDNA3/4 ISA guides), ~32 ns at the cards' ~2 GHz
REALTIME_NS = 10  # RDNA's REALTIME counter runs at 100 MHz (HIP's wall_clock64 rate): 10 ns a tick

# The ordered memory operations TVM's LLVM codegen cannot emit, as LLVM IR (LLVM 22's text syntax: TVM 0.27 links
# LLVM 22.1). Pointers are global (addrspace 1), as TVM's AMDGPU codegen types the kernel's buffers.
AMDGPU_IR = """\
; luce-compile: ordered memory operations for the megakernel (fuse/emit_cuda/intrinsics.py)
define linkonce_odr i32 @luce_load_acquire_agent(ptr addrspace(1) %p) {
  %v = load atomic i32, ptr addrspace(1) %p syncscope("agent") acquire, align 4
  ret i32 %v
}
define linkonce_odr i32 @luce_atomic_add_agent(ptr addrspace(1) %p, i32 %v) {
  %old = atomicrmw add ptr addrspace(1) %p, i32 %v syncscope("agent") monotonic, align 4
  ret i32 %old
}
define linkonce_odr i32 @luce_fence_acq_rel_agent() {
  fence syncscope("agent") acq_rel
  ret i32 0
}
define linkonce_odr i32 @luce_fence_release_workgroup() {
  fence syncscope("workgroup") release
  ret i32 0
}
define linkonce_odr i32 @luce_fence_acquire_workgroup() {
  fence syncscope("workgroup") acquire
  ret i32 0
}
define linkonce_odr i32 @luce_fence_acq_rel_wavefront() {
  fence syncscope("wavefront") acq_rel
  ret i32 0
}
"""
AMDGPU_IR_FILE = "luce_megakernel_amdgpu.ll"


def is_rocm(target=None) -> bool:
    """Whether the target (else the one in scope) is AMD's; no target in scope means CUDA."""
    import tvm

    target = target or tvm.target.Target.current(allow_none=True)
    return target is not None and target.kind.name == "rocm"


def _void(name: str) -> None:
    # the IR functions return a dummy i32: TVM's call_extern declares the callee from the call's dtype
    B.evaluate(tirx.call_extern("int32", name))


def load_acquire(dst: tirx.Buffer, addr: tirx.Expr) -> None:
    """dst[0] = *addr, an acquire load at device scope: later reads see what the releasing writer wrote."""
    if is_rocm():
        B.buffer_store(dst, tirx.call_extern("int32", "luce_load_acquire_agent", addr), [0])
    else:
        B.evaluate(T.ptx.ld.acquire.gpu.global_.b32(dst[0], addr))


def fence_acq_rel() -> None:
    """A device-scope acquire-release fence (before a release add, after an acquiring atomic)."""
    if is_rocm():
        _void("luce_fence_acq_rel_agent")
    else:
        B.evaluate(T.ptx.fence.acq_rel.gpu())


def red_add(addr: tirx.Expr, value: tirx.Expr) -> None:
    """*addr += value, relaxed at device scope, result unused."""
    if is_rocm():
        B.evaluate(tirx.call_extern("int32", "luce_atomic_add_agent", addr, value))
    else:
        B.evaluate(T.ptx.red.relaxed.gpu.global_.add.s32(addr, value))


def atomic_add(addr: tirx.Expr, value: tirx.Expr) -> tirx.Expr:
    """*addr += value, relaxed at device scope; the old value."""
    if is_rocm():
        return tirx.call_extern("int32", "luce_atomic_add_agent", addr, value)
    return T.cuda.atomic_add(addr, value)


def sleep_ns(ns: int) -> None:
    """Back off for about `ns` nanoseconds."""
    if is_rocm():
        B.evaluate(tirx.call_llvm_intrin("void", "llvm.amdgcn.s.sleep", tirx.const(max(1, ns // S_SLEEP_NS), "int32")))
    else:
        B.evaluate(T.cuda.nano_sleep(tirx.const(ns, "int32")))


def global_timer_ns() -> tirx.Expr:
    """A clock in nanoseconds that every SM / CU reads alike (the profile's phase clocks)."""
    if is_rocm():
        return tirx.call_llvm_intrin("int64", "llvm.readsteadycounter") * tirx.const(REALTIME_NS, "int64")
    return T.cuda.mov_sreg(64, "globaltimer")


def dot4(a: tirx.Expr, b: tirx.Expr, c: tirx.Expr) -> tirx.Expr:
    """c + the dot product of the four signed bytes of a and of b (int32)."""
    if is_rocm():
        yes, no = tirx.const(True, "bool"), tirx.const(False, "bool")
        return tirx.call_llvm_pure_intrin("int32", "llvm.amdgcn.sudot4", yes, a, yes, b, c, no)
    return tirx.call_pure_extern("int32", "__dp4a", a, b, c)


def popcount(x: tirx.Expr) -> tirx.Expr:
    """The set bits of an int32."""
    if is_rocm():
        return tirx.call_llvm_pure_intrin("int32", "llvm.ctpop.i32", x)
    return tirx.call_pure_extern("int32", "__popc", x)


def shfl_xor(value: tirx.Expr, lane_mask: int, lane: tirx.Expr) -> tirx.Expr:
    """value from lane (lane ^ lane_mask) of the warp; every lane of the warp must take part."""
    if is_rocm():
        return tirx.call_intrin(value.ty, "tirx.tvm_warp_shuffle", tirx.const(-1, "int32"), value,
                                lane ^ lane_mask, tirx.const(32, "int32"), tirx.const(32, "int32"))
    return T.cuda._shfl_xor_sync(tirx.const(0xFFFFFFFF, "uint32"), value, lane_mask, 32)


def warp_reduce(value: tirx.Expr, how: str, lane: tirx.Expr | None = None) -> tirx.Expr:
    """The warp's sum / max / min of value, in every lane (a butterfly over lanes 16, 8, 4, 2, 1)."""
    if not is_rocm():
        return T.cuda.warp_reduce(value, how, 32)
    if lane is None:
        raise UnsupportedError("fuse: a warp reduction on AMDGPU needs the lane index")
    step = {"sum": lambda x, y: x + y, "max": tirx.max, "min": tirx.min}[how]
    for mask in (16, 8, 4, 2, 1):
        value = step(value, shfl_xor(value, mask, lane))
    return value


def warp_sync() -> None:
    """Order the warp's shared-memory accesses around this point (CUDA's __syncwarp)."""
    if is_rocm():  # a wave32 wavefront runs in lockstep: only the compiler's ordering is needed
        _void("luce_fence_acq_rel_wavefront")
    else:
        B.evaluate(T.cuda.warp_sync())


def block_sync() -> None:
    """The block's barrier, ordering its shared-memory accesses (CUDA's __syncthreads)."""
    if is_rocm():
        _void("luce_fence_release_workgroup")
    B.evaluate(T.tvm_storage_sync("shared"))  # TVM's passes know this barrier (ROCm: s_barrier)
    if is_rocm():
        _void("luce_fence_acquire_workgroup")


def can_prefetch_l2() -> bool:
    return not is_rocm()


def prefetch_l2(addr: tirx.Expr) -> None:
    if is_rocm():
        raise UnsupportedError("fuse: gfx11/gfx1201 have no L2 prefetch instruction; build with prefetch_bytes=0")
    B.evaluate(T.ptx.prefetch.global_.L2(addr))


def shared_scope(floats: int) -> str:
    """The storage scope of the block's shared buffer of `floats` float32 words."""
    if is_rocm():
        return "shared"
    return "shared.dyn" if floats > CUDA_STATIC_SHARED_FLOATS else "shared"
