"""schedules/gpu/moe.py: the expert sort and the gathered expert GEMV for GPUs.

Here (no GPU): both compile to device code for CUDA (the sort for ROCm too), the sort as one block of a thread per
expert, the GEMV with the rows' experts and tokens read through the gather. On a CUDA GPU the same kernels run
against numpy: the sort against a stable argsort (the CPU sort's order), the GEMV against gguf-py's dequantized
weights in float64; the whole model is checked there by scripts/device_check.py on tiny-qwen3moe.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType
from luce_schedules.gpu import mmq_blocks, mmq_gemm
from luce_schedules.gpu.moe import SORT_TILE, ExpertGEMV, ExpertTile, expert_route, expert_sort, grouped_mmq_gemm
from tvm import tirx
from tvm.target import Target

from luce_compile.codegen.device_binaries import device_sources
from luce_compile.codegen.gpu_toolchain import gpu_toolchain
from luce_compile.lower.moe import GROUPED_ATTR, expert_matmul, grouped_above, route_func
from luce_compile.lower.q8_gemm import q8_gemm_format
from luce_compile.lower.quant_matmul import quant_matmul
from luce_compile.targets import get_target
from tests.bench._load import load_script
from tests.codegen.test_gpu_device import cuda_device_count
from tests.schedules.test_gpu_mmq_gemm import _run_cpu, activations, random_weights, stager

CUDA = get_target("sm_90").tvm_target()
ROCM = get_target("gfx1201").tvm_target()
T = GGMLQuantizationType
on_gpu = pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU")


def _source(func, target: Target) -> str:
    info = get_target("sm_90" if target.kind.name == "cuda" else "gfx1201")
    with gpu_toolchain(info.kind, info.archs or (info.name,), info.name), target:
        ex = tvm.compile(tvm.IRModule({"main": func}), target=target)
    ((_, source),) = device_sources(ex)
    return source


@pytest.mark.unit
@pytest.mark.parametrize("n_expert", [8, 96, 128])
def test_sort_is_one_block_of_a_thread_per_expert(n_expert):
    source = _source(expert_sort(n_expert, 8, "moe_sort"), CUDA)
    threads = -(-n_expert // 32) * 32
    assert f"__launch_bounds__({threads})" in source
    assert "atomic" not in source  # the order is the CPU sort's: each expert's thread places its own rows
    assert source.count("__syncthreads()") == 5  # a tile in, a tile read, twice; the counts before the starts


@pytest.mark.unit
@pytest.mark.parametrize(("n_expert", "used", "norm_w"), [(8, 2, True), (128, 8, True), (32, 4, False)])
def test_route_kernel_is_route_func_bit_for_bit(n_expert, used, norm_w, rng):
    """expert_route's statements with a serial loop over rows (the CPU harness) give route_func's ids and weights
    bit for bit on llvm, ties included (equal logits: the lower expert first), rows of every magnitude."""
    import tvm

    cpu = Target({"kind": "llvm", "num-cores": 1})
    logits = (rng.standard_normal((37, n_expert)) * 4).astype(np.float32)
    logits[3] = 0.5  # every expert tied
    logits[5, :used + 1] = logits[5, used + 1]  # a tie across the cut
    logits[7] *= 1e-4
    outs = []
    for func in (route_func(n_expert, used, norm_w, "te"), expert_route(n_expert, used, norm_w, "one", False)):
        args = [tvm.runtime.tensor(logits), tvm.runtime.tensor(np.zeros((37, used), np.int32)),
                tvm.runtime.tensor(np.zeros((37, used), np.float32))]
        tvm.compile(tvm.IRModule({"main": func}), target=cpu)["main"](*args)
        outs.append([a.numpy() for a in args[1:]])
    (want_ids, want_w), (ids, w) = outs
    assert np.array_equal(ids, want_ids) and np.array_equal(w, want_w)
    assert list(ids[3]) == list(range(used))  # ties: the lower experts, in order
    assert len({tuple(r) for r in ids}) > 15  # the routing varies: not a constant answer


@pytest.mark.unit
def test_route_kernel_is_one_kernel_a_thread_per_row():
    source = _source(expert_route(128, 8, True, "moe_route"), CUDA)
    assert len(re.findall(r"__global__ void[^;]*\{", source)) == 1 and "__launch_bounds__(64)" in source
    assert "__syncthreads" not in source and "__shared__" not in source
    assert "moe_route" in _source(expert_route(32, 4, False, "moe_route"), ROCM)


@pytest.mark.unit
def test_sort_refuses_more_experts_than_a_block_has_threads():
    with pytest.raises(ValueError, match="1024 threads"):
        expert_sort(1025, 8, "moe_sort")


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4, T.IQ4_XS])
@pytest.mark.parametrize("gather", [True, False])
def test_expert_matmul_is_the_gathered_gemv(qtype, gather):
    func = expert_matmul(qtype, 8, 64, 256, gather, "em")
    with CUDA:
        sch = ExpertGEMV().apply(func, CUDA)
    assert sch is not None
    source = _source(sch.mod["main"], CUDA)
    assert "experts_ptr[" in source and ("tokens_ptr[" in source) == gather
    assert "__shfl" in source  # a warp's lanes share a row's K, summed by shuffles


@pytest.mark.unit
def test_expert_gemv_takes_only_expert_matmuls():
    assert ExpertGEMV().apply(quant_matmul("Q4_K", 64, 256, batch=1), CUDA) is None
    func = expert_matmul(T.Q4_K, 8, 64, 256, True, "em")
    assert ExpertGEMV().apply(func, Target("llvm")) is None  # the CPU's is schedules/cpu/moe.py


@pytest.mark.unit
def test_rocm_builds_the_sort_and_leaves_the_gemv_to_dlight():
    assert "moe_sort" in _source(expert_sort(32, 4, "moe_sort"), ROCM)
    with ROCM:  # the warp sum over int64 rows fails LLVM's verifier there (schedules/gpu/moe.py)
        assert ExpertGEMV().apply(expert_matmul(T.Q4_K, 8, 64, 256, True, "em"), ROCM) is None


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [6, 64, 3 * SORT_TILE + 5])
def test_sort_on_the_gpu_equals_a_stable_sort(rows):
    n_expert, used = 96, 8
    rng = np.random.default_rng(rows)
    ids = rng.integers(0, n_expert, rows, dtype=np.int32)
    dev = tvm.cuda(0)
    with gpu_toolchain("cuda", ("sm_90",), "sm_90"), CUDA:
        lib = tvm.compile(tvm.IRModule({"main": expert_sort(n_expert, used, "moe_sort")}), target=CUDA)
    outs = [tvm.runtime.tensor(np.zeros(rows, np.int32), dev) for _ in range(3)]
    lib["main"](tvm.runtime.tensor(ids, dev), *outs)
    experts, tokens, inverse = (o.numpy() for o in outs)
    order = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(experts, ids[order])
    np.testing.assert_array_equal(tokens, order // used)
    np.testing.assert_array_equal(inverse[order], np.arange(rows))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0])
def test_expert_gemv_on_the_gpu_equals_the_dequantized_rows(qtype):
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from luce_compile.lower.quant_layout import repack

    n_expert, n_out, n_in, tokens, used = 4, 64, 256, 5, 2
    rng = np.random.default_rng(7)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_expert * n_out, n_in // block * size), dtype=np.uint8)
    scales = 4 if qtype == T.Q4_K else 2  # the blocks' leading f16 scales finite and small
    raw.reshape(n_expert * n_out, -1, size)[..., :scales] = np.tile(
        np.frombuffer(np.float16(0.01).tobytes(), np.uint8), scales // 2)
    w = dequantize(raw, qtype).astype(np.float64).reshape(n_expert, n_out, n_in)
    experts = np.sort(rng.integers(0, n_expert, tokens * used)).astype(np.int32)
    rows = rng.integers(0, tokens, tokens * used).astype(np.int32)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    func = expert_matmul(qtype, n_expert, n_out, n_in, True, "em")
    with CUDA:
        sch = ExpertGEMV().apply(func, CUDA)
    with gpu_toolchain("cuda", ("sm_90",), "sm_90"), CUDA:
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    dev = tvm.cuda(0)
    args = [x, experts, rows, *repack(raw, qtype).values(), np.zeros((tokens * used, n_out), np.float32)]
    args = [tvm.runtime.tensor(a, dev) for a in args]
    lib["main"](*args)
    want = np.einsum("pk,pnk->pn", x[rows].astype(np.float64), w[experts])
    np.testing.assert_allclose(args[-1].numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- the grouped expert GEMM (a prompt's expert matmuls) -------------------------------------------------------------
def _stacked(qtype: str, n_expert: int, n_out: int, n_in: int, rng: np.random.Generator):
    """Random stacked expert weights: (raw rows, repacked planes of n_expert·n_out rows)."""
    raw, planes, _ = random_weights(qtype, n_expert * n_out, n_in, rng)
    return raw, planes


def _expert_planes(planes: dict, e: int, n_out: int) -> dict:
    return {name: plane[e * n_out:(e + 1) * n_out] for name, plane in planes.items()}


def _tile_stager(qtype: str, n_expert: int, n_out: int, n_in: int, tile: tuple[int, int, int], rows: int,
                 x_rows: int, origin: tuple[int, int], expert: int, step: int) -> tirx.PrimFunc:
    """ExpertTile's load_step then store_step of K step `step` into stage 0 (the mmq stager's harness, with the rows'
    tokens and an expert)."""
    with_sum = q8_gemm_format(qtype).with_sum

    def kernel(views, tx, tokens):  # noqa: ANN001, ANN202
        k = ExpertTile(qtype, n_out, n_in, tile, views, rows, tx, origin[0], origin[1], with_sum)
        k.tokens, k.expert = tokens, tirx.const(expert, "int32")
        return k

    return stager(qtype, n_expert * n_out, n_in, tile, x_rows, kernel, step, 0, tokens=rows)


@pytest.mark.unit
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_an_expert_tile_stages_its_tokens_rows_and_its_experts_weight_rows(qtype, rng):
    """Sorted rows 32.. of 50 (past the end: clamped to the last) read the quantized rows of their tokens (of 20), and
    the tile's features 64.. of 100 (clamped to 99) read expert 2's weight rows of the stacked tensor, in the mmq
    kernel's slots: what the mma.sync multiply for that expert."""
    n_expert, n_out, n_in, tile, rows, x_rows, origin, expert, step = 4, 100, 512, (32, 64, 128), 50, 20, (32, 64), 2, 1
    _, planes = _stacked(qtype, n_expert, n_out, n_in, rng)
    fmt = q8_gemm_format(qtype)
    tokens = rng.integers(0, x_rows, rows).astype(np.int32)
    xq = rng.integers(0, 2**32, x_rows * n_in // 4, dtype=np.uint32)
    xs = [rng.standard_normal(x_rows * n_in // 32).astype(np.float32) for _ in range(2 if fmt.with_sum else 1)]
    (tiles, scales), _ = mmq_gemm._shared_words(qtype, tile)
    outs = [np.zeros(n, np.uint32) for n in tiles.values()] + \
        [np.zeros(n, np.float32) for n in scales.values() for _ in range(2)]
    func = _tile_stager(qtype, n_expert, n_out, n_in, tile, rows, x_rows, origin, expert, step)
    got = _run_cpu(func, *planes.values(), tokens, xq, *xs, *outs)[len(planes) + 2 + len(xs):]
    tile_m, tile_n, tile_k = tile
    nblk, row = tile_k // 32, mmq_gemm.row_words(tile_k)
    slots = list(mmq_blocks.Q6_SLOTS if qtype == "Q6_K" else range(8))
    blocks = step * nblk + np.arange(nblk)
    x_rows_read = tokens[np.minimum(origin[0] + np.arange(tile_m), rows - 1)]
    want_x = xq.reshape(x_rows, -1, 8)[x_rows_read][:, blocks][..., slots]
    assert np.array_equal(got[0].reshape(2, tile_m, row)[0][:, :nblk * 8].reshape(tile_m, nblk, 8), want_x)
    sx = got[2].reshape(nblk, tile_m, len(xs))  # stage 0's x scales
    for p, plane in enumerate(xs):
        assert np.array_equal(sx[..., p], plane.reshape(x_rows, -1)[x_rows_read][:, blocks].T)
    q, _, _ = mmq_blocks.weight_integers(qtype, planes)
    feats = expert * n_out + np.minimum(origin[1] + np.arange(tile_n), n_out - 1)
    positions = [fmt.position_element(p) for p in range(32)]
    in_position = np.ascontiguousarray(q.reshape(n_expert * n_out, -1, 32)[..., positions].astype(np.int8))
    want_w = in_position.view(np.uint32).reshape(n_expert * n_out, -1, 8)[feats][:, blocks][..., slots]
    assert np.array_equal(got[1].reshape(2, tile_n, row)[0][:, :nblk * 8].reshape(tile_n, nblk, 8), want_w)


@pytest.mark.unit
@pytest.mark.parametrize("gather", [True, False])
def test_the_grouped_form_runs_the_gemv_up_to_grouped_above_rows_and_the_mma_gemm_above(gather):
    n_expert = 8
    func = expert_matmul(T.Q4_K, n_expert, 64, 256, gather, "em", grouped=True)
    assert [str(p.name) for p in func.params][-3:] == ["xq", "xd", "xs"]  # the quantized input: scratch after y
    with CUDA:
        (dispatched,) = ExpertGEMV().apply(func, CUDA)
    main = dispatched.mod["main"]
    assert GROUPED_ATTR not in main.attrs
    assert f"tvm_thread_invariant(rows <= T.int64({grouped_above(n_expert)}))" in main.script()
    source = _source(main, CUDA)
    assert "__shfl" in source  # the GEMV
    assert "mma_int_sync_aligned_m16n8k32_row_col_s32_s8_s8_s32" in source  # the grouped GEMM
    assert ("tokens_ptr[" in source) == gather


@pytest.mark.unit
def test_grouped_gemm_refuses_types_the_8_bit_gemm_does_not_take():
    with pytest.raises(ValueError, match="not supported"):
        grouped_mmq_gemm("BF16", 8, 64, 256, True)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_gemm_on_the_gpu_is_the_emulation_bit_for_bit(qtype, gather):
    """40 tokens x 3 of 8 experts (expert 5 never chosen: a tile's absent expert), 120 sorted rows in tiles of 32,
    most holding two or three experts' rows; 192 features (a partial tile of 128): every output is mmq_blocks.emulate's
    for its expert's rows, bit for bit (the mmq kernel's arithmetic, exact int32 dots and float32 scales in order)."""
    n_expert, n_out, n_in, tokens, used = 8, 192, 512, 40, 3
    rng = np.random.default_rng(11)
    _, planes = _stacked(qtype, n_expert, n_out, n_in, rng)
    experts, rows_token = load_script("moe_gemm_check").routed_rows(rng, tokens, used, n_expert, absent=5)
    p_rows = len(experts)
    x = activations(rng, tokens if gather else p_rows, n_in)
    func = grouped_mmq_gemm(qtype, n_expert, n_out, n_in, gather, tile_n=128)
    with gpu_toolchain("cuda", ("sm_90",), "sm_90"), CUDA:
        lib = tvm.compile(tvm.IRModule({"main": func}), target=CUDA)
    dev = tvm.cuda(0)
    fmt = q8_gemm_format(qtype)
    scratch = [np.zeros((x.shape[0], shape[1]), dtype) for shape, dtype in fmt.specs(n_in).values()]
    args = [x, experts, *([rows_token] if gather else []), *planes.values(), np.zeros((p_rows, n_out), np.float32),
            *scratch]
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in args]
    lib["main"](*args)
    got = args[-1 - len(scratch)].numpy()
    rows_x = x[rows_token] if gather else x
    for e in set(experts.tolist()):
        mine = experts == e
        want = mmq_blocks.emulate(qtype, _expert_planes(planes, e, n_out), rows_x[mine])
        np.testing.assert_array_equal(got[mine], want)


@pytest.mark.unit
def test_the_device_check_prepares_each_case_with_its_branch_and_expected_rows(tmp_path, monkeypatch):
    """scripts/moe_gemm_check.py prepare (what the GPU machine runs): a case above grouped_above takes the grouped
    GEMM and expects mmq_blocks.emulate's rows of each expert, one at or below it the GEMV and float64; the routing
    is sorted and leaves an expert out."""
    check = load_script("moe_gemm_check")
    cases = (("g", "Q8_0", 8, 64, 256, True, 40, 2), ("d", "Q8_0", 8, 64, 256, True, 6, 2))
    monkeypatch.setattr(check, "CHECKED", cases)
    monkeypatch.setattr(check, "TIMED", ())
    assert check.prepare(check.argparse.Namespace(dir=str(tmp_path), target="sm_90", seed=0, tiles=[])) == 0
    cases = {c["case"]: c for c in json.loads((tmp_path / "index.json").read_text())["cases"]}
    assert (cases["g"]["grouped"], cases["d"]["grouped"]) == (True, False)
    npz = np.load(tmp_path / "g.npz")
    experts, tokens = npz["experts"], npz["tokens"]
    assert np.all(np.diff(experts) >= 0) and 1 not in experts and len(experts) == 80 and tokens.max() < 40
    planes = {str(k): npz[f"plane_{k}"] for k in npz["plane_names"]}
    e = int(experts[0])
    mine = experts == e
    sub = {k: v[e * 64:(e + 1) * 64] for k, v in planes.items()}
    assert np.array_equal(npz["want"][mine], mmq_blocks.emulate("Q8_0", sub, npz["x"][tokens[mine]]))
    assert (tmp_path / "g.so").is_file() and (tmp_path / "d.so").is_file()
