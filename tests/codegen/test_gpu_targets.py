"""GPU targets built here without a GPU: real device binaries for every target, each extracted and checked.

A tiny synthetic llama builds for sm_86, sm_90, sm_120 (cubins in a fatbin), all three in one fatbin, and
gfx1201/gfx1151 (wave32 HSACO). The checks re-extract the binaries from the artifact's model.so by their magic
bytes and read them with the vendor tools (cuobjdump, llvm-readelf/llvm-objdump), independently of what the build
wrote in the manifest. The build must refuse a module that would run unscheduled TIR as host code, and a library
that carries CUDA source instead of a binary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tvm
from tvm import relax, te, tirx

from luce_compile.codegen.device_binaries import DeviceBinaryError, check_library, extract_binaries
from luce_compile.codegen.pipeline import UnscheduledError, check_gpu_scheduled, relax_pipeline, thread_extents
from luce_compile.errors import LuceError
from luce_compile.targets import TARGETS, get_target

GPU_TARGETS = ["sm_86", "sm_90", "sm_120", "gfx1201", "gfx1151", "sm_86,sm_90,sm_120"]


@pytest.fixture(scope="module")
def tiny_gguf() -> Path:
    from luce_compile.synthetic import cached_synthetic

    return cached_synthetic("tiny-llama")


@pytest.fixture(scope="module")
def built(tiny_gguf, tmp_path_factory):
    """target name → artifact dir, each compiled once per module (and reused from compile_model's cache)."""
    from luce_compile.codegen.compile import compile_model

    folder = tmp_path_factory.mktemp("gpu")
    cache: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in cache:
            cache[name] = compile_model(tiny_gguf, name, folder / name.replace(",", "+"))
        return cache[name]

    return build


@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_TARGETS)
def test_tiny_model_builds_real_binaries(name, built):
    artifact = built(name)
    info = get_target(name)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"]["kind"] == info.kind
    # compile's --kv-cache auto: float16 pages in the fast build (CUDA's), as llama.cpp's default cache; float32 in
    # an exact one (ROCm's precision resolves to f32)
    fast = manifest["kernels"]["precision"] == "f16"
    assert manifest["kernels"]["kv_cache"] == ("f16" if fast else "f32") and fast == (info.kind == "cuda")
    assert manifest["runtime"]["kv_dtype"] == ("float16" if fast else "float32")
    report = check_library(artifact / "model.so", info)  # re-extracted and re-read with the vendor tools
    (binary,) = report.binaries
    want_archs = sorted(info.archs or (info.name,))
    assert binary.kind == ("fatbin" if info.kind == "cuda" else "hsaco")
    assert sorted(binary.archs) == want_archs
    recorded = manifest["kernels"]["device_binaries"]
    assert report.kernels == recorded["kernels"] >= 40  # the model's own kernels plus the KV cache's
    for arch in want_archs:  # every arch carries the same kernels, ours among them
        kernels = set(binary.kernels[arch])
        assert len(kernels) == report.kernels
        assert any(k.startswith("gemv_") for k in kernels) and any(k.startswith("gemm_") for k in kernels)
        assert any(k.startswith("embed_") for k in kernels) and any(k.startswith("rope_") for k in kernels)
        assert any("batch_decode_paged_kv" in k for k in kernels)  # the cache's GPU attention, not a CPU one
    if info.kind == "rocm":
        assert set(binary.wave_sizes) == {32} and len(binary.wave_sizes) == report.kernels
    assert b'extern "C" __global__' not in (artifact / "model.so").read_bytes()


@pytest.mark.slow
def test_fatbin_holds_one_cubin_per_arch(built):
    """The 3-arch fatbin is the three single-arch builds' kernels side by side (same kernel set for each arch)."""
    multi = check_library(built("sm_86,sm_90,sm_120") / "model.so", get_target("sm_86,sm_90,sm_120"))
    single = check_library(built("sm_90") / "model.so", get_target("sm_90"))
    (fat,), (one,) = multi.binaries, single.binaries
    assert set(fat.kernels["sm_90"]) == set(one.kernels["sm_90"])
    assert set(fat.kernels["sm_86"]) == set(fat.kernels["sm_120"]) == set(fat.kernels["sm_90"])
    assert len(fat.data) > 2 * len(one.data)  # three cubins, not one


def _unscheduled_module(mark_scheduled: bool = True) -> tvm.IRModule:
    """A Relax function calling a PrimFunc that (by default) claims to be scheduled but binds no GPU thread."""
    x = te.placeholder((1024,), "float32", name="x")
    y = te.compute((1024,), lambda i: x[i] * 2.0, name="y")
    double = te.create_prim_func([x, y]).with_attr("global_symbol", "double")
    if mark_scheduled:
        double = double.with_attr("tirx.is_scheduled", True)
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((1024,), "float32"))
    with bb.function("main", [a]):
        with bb.dataflow():
            gv = bb.add_func(double, "double")
            out = bb.emit_output(relax.call_tir(gv, [a], relax.TensorType((1024,), "float32")))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.unit
@pytest.mark.parametrize("name", ["sm_90", "gfx1201"])
def test_unscheduled_tir_fails_the_build(name):
    target = get_target(name).tvm_target()
    with pytest.raises(UnscheduledError, match=r"not scheduled for the GPU.*double"):
        relax_pipeline(target)(_unscheduled_module())


@pytest.mark.unit
def test_schedule_check_counts_threads():
    target = get_target("gfx1201").tvm_target()  # 256 threads per block at most (see targets.ROCM_MAX_THREADS)
    x = te.placeholder((4096,), "float32", name="x")
    y = te.compute((4096,), lambda i: x[i] + 1.0, name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    bx, tx = sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 512])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    assert thread_extents(sch.mod["main"]) == {"blockIdx.x": 8, "threadIdx.x": 512}
    with pytest.raises(UnscheduledError, match=r"more threads per block.*\(256\).*512 threads"):
        check_gpu_scheduled(target)(tvm.IRModule({"wide": sch.mod["main"]}))


@pytest.mark.unit
def test_gpu_pipeline_schedules_every_function_it_keeps():
    """The same module with a plain (unmarked) PrimFunc: dlight's Fallback binds it, and the check passes."""
    mod = _unscheduled_module(mark_scheduled=False)
    target = get_target("sm_90").tvm_target()
    out = relax_pipeline(target)(mod)
    funcs = [f for _, f in out.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert funcs and all("threadIdx.x" in thread_extents(f) for f in funcs)
    assert isinstance(out["main"], relax.Function)


# Runs in a fresh interpreter, *without* the toolchain set-up: TVM's CUDA runtime library cannot load (no
# libcuda.so.1), so tvm.compile embeds CUDA source. The checker must refuse that library.
SOURCE_ONLY = """
import sys, tvm
from tvm import te
from tvm.s_tir import dlight as dl
x = te.placeholder((256,), "float32", name="x")
y = te.compute((256,), lambda i: x[i] + 1.0, name="y")
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
mod = tvm.IRModule({"add1": te.create_prim_func([x, y]).with_attr("global_symbol", "add1")})
with target:
    mod = dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)
    tvm.compile(mod, target=target).export_library(sys.argv[1])
"""


@pytest.mark.slow
def test_library_with_cuda_source_is_refused(tmp_path):
    # asked in a fresh process: this one may hold the stand-in libcuda.so.1 the GPU builds loaded
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("a CUDA driver is installed: TVM embeds real binaries without the stub here")
    lib = tmp_path / "source_only.so"
    proc = subprocess.run([sys.executable, "-c", SOURCE_ONLY, str(lib)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b'extern "C" __global__' in lib.read_bytes()
    assert not [b for b in extract_binaries(lib.read_bytes()) if b.kind in ("fatbin", "cubin")]
    with pytest.raises(DeviceBinaryError, match="holds no fatbin/cubin device binary.*CUDA source"):
        check_library(lib, get_target("sm_90"))


@pytest.mark.unit
def test_registry_facts_and_multi_arch():
    for name in ("sm_86", "sm_120", "gfx1201", "gfx1151"):
        assert TARGETS[name].status == "compiled"
    # sm_90 ran on the lent H200: its record must be committed (tests/codegen/test_gpu_device.py checks it passed)
    assert TARGETS["sm_90"].status == "measured"
    multi = get_target("sm_120,sm_86,sm_90")
    assert multi.archs == ("sm_86", "sm_90", "sm_120") and multi.name == "sm_86,sm_90,sm_120"
    assert str(multi.tvm_target().attrs["arch"]) == "sm_86"  # kernels generated for the lowest arch
    rocm = get_target("gfx1151").tvm_target()
    assert int(rocm.attrs["thread_warp_size"]) == 32 and int(rocm.attrs["max_num_threads"]) == 256
    with pytest.raises(LuceError, match="only CUDA archs combine"):
        get_target("sm_90,gfx1201")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sm_90", "gfx1201"])
def test_cuda_artifacts_carry_the_decode_megakernels(name, built, tiny_gguf):
    """GPU artifacts carry the megakernels (one per batch size, real cubins or HSACO), their task tables (the
    programs the generator plans from this graph) and, per stacked weight argument, the per-op planes of its layers,
    which the runtime stacks into exactly the GGUF's planes. CUDA's default build is the fast one; ROCm's precision
    resolves to f32 (no tensor-core matmuls there), and its megakernels never take the tensor-core bodies."""
    import numpy as np
    from luce_runtime.artifact import load_artifact
    from luce_runtime.device_views import layer_views
    from luce_runtime.megakernel import _stack_weights

    from luce_compile.fuse.build import MegakernelOptions, kernel_name, plan_programs, program_fingerprint
    from luce_compile.gguf.reader import read_gguf
    from luce_compile.graph.registry import open_graph
    from luce_compile.lower.quant_layout import weight_planes
    from luce_compile.lower.relax_model import PLANE_SEP

    artifact, info = built(name), get_target(name)
    manifest = json.loads((artifact / "manifest.json").read_text())
    mk = manifest["megakernel"]
    assert mk["batches"] == [1, 2, 4, 8] and {mk["module"], mk["tables"]} <= set(manifest["files"])
    assert mk["kv_dtype"] == manifest["runtime"]["kv_dtype"]  # the megakernels read the engine's pages
    if info.kind == "cuda":
        # the default build is the fast one: 8-bit and tf32 matvecs, recorded in the manifest (f32: the exact build)
        assert manifest["kernels"]["precision"] == "f16" and mk["options"]["q8_activations"]
        assert mk["options"]["float_mma"]
    else:
        assert manifest["kernels"]["precision"] == "f32" and not mk["options"]["q8_activations"]
        assert not (mk["options"]["float_mma"] or mk["options"]["q8_mma"]) and mk["options"]["threads"] == 256
    (binary,) = check_library(artifact / mk["module"], info).binaries
    assert {f"{kernel_name(b)}_kernel" for b in mk["batches"]} <= set(binary.kernels[info.name])
    graph, _ = open_graph(tiny_gguf)
    options = MegakernelOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in mk["options"].items()})
    programs = plan_programs(graph, info.facts, options)
    tables = np.load(artifact / mk["tables"])
    for b, prog in programs.items():
        assert mk["kernels"][str(b)]["fingerprint"] == program_fingerprint(prog)
        assert np.array_equal(tables[f"b{b}_tasks"], prog.tasks)
    gguf = read_gguf(tiny_gguf)
    weights = load_artifact(artifact).weights()
    stacked, shareable = _stack_weights(mk, weights, tvm.cpu())
    assert len(stacked) >= 10 and shareable
    for arg, names in shareable.items():  # what the per-op kernels get in place of their own copies
        for name, view in layer_views(stacked[arg], names).items():
            assert np.array_equal(view.numpy(), weights[name]), name
    for arg, layers in mk["kernels"]["1"]["weights"].items():
        want = []
        for param in layers:
            tensor, plane = param.split(PLANE_SEP)
            t = gguf.tensor(tensor)
            planes = weight_planes(gguf.raw(tensor), t.ggml_type, 2) if len(t.shape) == 2 else None
            want.append(planes[plane] if planes else gguf.dequantize(tensor).astype(np.float32))
        assert np.array_equal(stacked[arg].numpy(), np.stack(want)), arg


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sm_90", "sm_86,sm_90,sm_120"])
def test_prompt_attention_is_the_flash_kernels(name, built, tiny_gguf, tmp_path):
    """The default build's prefill attention, ragged and paged, is flash_prefill.py's on every CUDA arch: the
    manifest records it and each arch's SASS of both kernels holds its instructions (mma.sync m16n8k16 =
    HMMA.16816, ldmatrix = LDSM, cp.async = LDGSTS). --prefill-attention wmma records the WMMA kernel for the
    first chunk and TVM's for later ones."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.codegen.device_binaries import _cuobjdump_env
    from luce_compile.codegen.gpu_toolchain import find_tool

    artifact = built(name)
    record = json.loads((artifact / "manifest.json").read_text())["kernels"]["prefill_attention"]
    assert record["choice"] == "flash" and record["ragged"].startswith("flash") and record["paged"].startswith("flash")
    wmma = compile_model(tiny_gguf, name, tmp_path / "wmma", prefill_attention="wmma")
    other = json.loads((wmma / "manifest.json").read_text())["kernels"]["prefill_attention"]
    assert other["choice"] == "wmma" and other["ragged"].startswith("wmma") and other["paged"] == "tvm"
    (binary,) = extract_binaries((artifact / "model.so").read_bytes())
    path = tmp_path / "model.fatbin"
    path.write_bytes(binary.data)
    sass = subprocess.run([find_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                          env=_cuobjdump_env(), check=True).stdout
    functions: dict[tuple[str, str], str] = {}
    arch = None
    for part in sass.split("Function : ")[1:]:
        header = sass[:sass.index(part)].rsplit("arch = ", 1)
        arch = header[1].split()[0] if len(header) > 1 else arch
        functions[(arch, part.split()[0])] = part
    for arch in sorted(get_target(name).archs or (name,)):
        for kernel in ("batch_prefill_ragged_kv_kernel", "batch_prefill_paged_kv_kernel"):
            body = functions[(arch, kernel)]
            assert "HMMA.16816.F32" in body and "LDSM" in body and "LDGSTS" in body, (arch, kernel)


@pytest.mark.slow  # ~110 s here: two sm_90 builds
def test_gemma3_gpu_artifacts_carry_megakernels_unless_asked_not_to(tmp_path):
    """A sliding-window model (tiny-gemma3, precision f32: its fast build hits TVM's tree_attn bug for one 32-dim KV
    head in f16, benchmarks/README.md) builds for sm_90 with megakernels by default (every batch size, checked
    resources; run on the H100 2026-12-07), and without them when sliding_megakernel=False, the section saying so.
    The cache layout those builds ask for is checked on the CPU (tests/runtime/test_sliding_pages.py)."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.fuse.options import SLIDING_MEGAKERNEL
    from luce_compile.synthetic import cached_synthetic

    gguf = cached_synthetic("tiny-gemma3")
    sections = {}
    for asked in (None, False):
        artifact = compile_model(gguf, "sm_90", tmp_path / str(asked), precision="f32", sliding_megakernel=asked)
        sections[asked] = json.loads((artifact / "manifest.json").read_text())["megakernel"]
    assert SLIDING_MEGAKERNEL and "sliding_megakernel=False" in sections[False]["skipped"]
    runtime = json.loads((tmp_path / "None" / "manifest.json").read_text())["runtime"]
    assert runtime["sliding_prefill_chunks"]  # prompts past the window in chunks (window_prefill, on the H100)
    mk = sections[None]
    assert mk["batches"] == [1, 2, 4, 8] and "skipped" not in mk
    assert {r["kernel"] for r in mk["resources"]} == {f"megakernel_b{b}" for b in mk["batches"]}


@pytest.mark.slow
def test_moe_builds_for_sm_90_with_the_per_op_kernels(tmp_path):
    """tiny-qwen3moe for sm_90 (issue 40): the expert sort, the gathered GEMVs and the grouped 8-bit GEMMs of
    schedules/gpu/moe.py in the binary, the grouped GEMM's types and row threshold in the manifest (what an oracle
    emulates), no megakernel (the section says why). Its numbers are checked on the GPU (device_check on the preset)."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    artifact = compile_model(cached_synthetic("tiny-qwen3moe"), "sm_90", tmp_path / "moe")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert "mixture-of-experts" in manifest["megakernel"]["skipped"]
    (binary,) = check_library(artifact / "model.so", get_target("sm_90")).binaries  # read with the vendor tools
    kernels = binary.kernels["sm_90"]
    assert "moe_sort_8_top2_kernel" in kernels
    assert any(k.startswith("expert_matmul_") for k in kernels)
    # gate/up (gathered) and down, each with its grouped form: 8 experts x 4 rows before the GEMM takes a call
    assert {"expert_matmul_q8_0_8x64x64_gather_grouped_kernel_2", "expert_matmul_q8_0_8x64x64_grouped_kernel_2"} <= \
        set(kernels)
    prefill = manifest["kernels"]["prefill_gemm"]
    assert (prefill["moe_q8_types"], prefill["moe_above_rows"]) == (["Q8_0"], 32)


@pytest.mark.slow
def test_gpt_oss_builds_for_sm_90_with_the_sink_kernels(tmp_path):
    """tiny-gptoss for sm_90 (issue 40): attention sinks fold in flash_prefill.py's ragged and decode kernels (the
    sliding layers' paged prefill stays TVM's, the rows' padding scoring nothing), its MXFP4 experts' prompt rows
    take the grouped 8-bit GEMM; the manifest says so. Its numbers are checked on the GPU (device_check)."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.synthetic import cached_synthetic

    artifact = compile_model(cached_synthetic("tiny-gptoss"), "sm_90", tmp_path / "oss")
    manifest = json.loads((artifact / "manifest.json").read_text())
    kernels_record = manifest["kernels"]
    assert kernels_record["decode_attention"] == "flash 1x128/8" and kernels_record["kv_cache"] == "f16"
    assert kernels_record["prefill_gemm"]["moe_q8_types"] == ["MXFP4"]
    assert manifest["runtime"]["kv_head_dim"] == manifest["config"]["head_dim"] + 16
    assert not manifest["runtime"]["sliding_prefill_chunks"]  # until window_prefill passes with sinks on a GPU
    (binary,) = check_library(artifact / "model.so", get_target("sm_90")).binaries
    kernels = set(binary.kernels["sm_90"])
    assert {"batch_decode_paged_kv_kernel", "batch_decode_paged_kv_sliding_window_kernel",
            "batch_prefill_ragged_kv_kernel", "batch_prefill_paged_kv_sliding_window_kernel"} <= kernels


@pytest.mark.slow
def test_prefill_gemm_q8_builds_the_integer_mma_kernels(tmp_path):
    """--prefill-gemm q8: the tiny llama in Q4_1 (its LM head Q8_0) for sm_90: the manifest records the choice and the
    types it served, and every gemm kernel's SASS above the buckets holds integer tensor-core mma (IMMA.16832) fed by
    ldmatrix (LDSM), where the default build's hold HMMA.16816 (~25 s: no megakernel)."""
    from luce_compile.codegen.compile import compile_model
    from luce_compile.codegen.device_binaries import _cuobjdump_env
    from luce_compile.codegen.gpu_toolchain import find_tool
    from luce_compile.synthetic import cached_synthetic

    gguf = cached_synthetic("tiny-llama@Q4_1")
    artifact = compile_model(gguf, "sm_90", tmp_path / "q8", megakernel=False, prefill_gemm="q8")
    kernels = json.loads((artifact / "manifest.json").read_text())["kernels"]
    assert kernels["prefill_gemm"] == {"choice": "q8", "q8_types": ["Q4_1", "Q8_0"]}
    (binary,) = extract_binaries((artifact / "model.so").read_bytes())
    path = tmp_path / "model.fatbin"
    path.write_bytes(binary.data)
    sass = subprocess.run([find_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                          env=_cuobjdump_env(), check=True).stdout
    bodies = {part.split()[0]: part for part in sass.split("Function : ")[1:]}
    gemm = [body for name, body in bodies.items() if name.startswith("gemm_")]
    integer = [body for body in gemm if "IMMA.16832.S8.S8" in body]
    assert integer and all("LDSM" in body for body in integer) and not any("HMMA" in body for body in gemm)
