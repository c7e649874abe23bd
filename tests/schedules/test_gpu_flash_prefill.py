"""schedules/gpu/flash_prefill.py: the mma.sync flash-attention prefill kernels (ragged and paged).

No GPU here. What can fail here: the tile schedule (tests/schedules/flash_emulation.py runs the kernel's own
schedule functions in numpy with its float16 roundings and float32 online softmax) against float64 attention on
fresh random ragged batches, causal edges included; the CUDA the kernels compile to (the instructions, the barriers,
the shared memory); the signatures the cache calls positionally. The GPU numbers: `scripts/device_check.py
attention` (the kernels against float64 on the device, then timed against attention_prefill.py's).

Tolerance: output within 2e-3 of max|ref| against float64 attention of the same float16 Q, K, V: P is rounded to
float16 (2⁻¹¹ relative a probability) and so is the output (2⁻¹¹ relative an element); the base-2 log-sum-exp
within 1e-4 (its sum is of float32 probabilities)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from luce_schedules.gpu import flash_prefill as fp
from luce_schedules.gpu.flash_prefill import FlashTile, default_tile, kv_steps, row_limit, shared_bytes, supports
from tvm.relax.frontend.nn.llm import _prefill_kernels
from tvm.target import Target

from luce_compile.checks import rel_err
from luce_compile.codegen.gpu_toolchain import cuda_source
from tests.bench._load import load_script
from tests.schedules import flash_emulation
from tests.schedules._signature import assert_same_signature
from tests.schedules.flash_emulation import emulate, reference

CUDA = Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024, "thread_warp_size": 32})
OUT_TOL, LSE_TOL = 2e-3, 1e-4

# (q_lens, kv_lens, causal): several sequences of odd lengths, a cached prefix (kv > q), one query token,
# sequences shorter than a tile, longer than several, and non-causal cross attention
CASES = [((1, 17, 100, 300), (1, 17, 100, 300), True),
         ((37, 64, 5), (77, 64, 200), True),
         ((45, 130), (45, 200), False),
         ((129,), (129,), True),
         ((1, 1, 3), (40, 1, 70), True)]


def _inputs(rng, q_lens, kv_lens, h_kv, h_q, d, d_v):
    q = rng.standard_normal((sum(q_lens), h_q, d)).astype(np.float16)
    k = rng.standard_normal((sum(kv_lens), h_kv, d)).astype(np.float16)
    v = rng.standard_normal((sum(kv_lens), h_kv, d_v)).astype(np.float16)
    return q, k, v


@pytest.mark.unit
@pytest.mark.parametrize("h_kv,h_q,d,tile", [(2, 8, 128, FlashTile(8, 64)), (3, 9, 64, FlashTile(8, 64)),
                                             (2, 2, 64, FlashTile(4, 32)), (1, 4, 128, FlashTile(4, 64))])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_tile_schedule_matches_float64_attention(h_kv, h_q, d, tile, case):
    q_lens, kv_lens, causal = CASES[case]
    rng = np.random.default_rng(case)
    q, k, v = _inputs(rng, q_lens, kv_lens, h_kv, h_q, d, d)
    sm_scale = 1 / np.sqrt(d)
    out, lse, visited = emulate(q, k, v, q_lens, kv_lens, causal, sm_scale, h_kv, tile)
    want, want_lse = reference(q, k, v, q_lens, kv_lens, causal, sm_scale)
    assert rel_err(out, want) < OUT_TOL
    assert np.abs(lse - want_lse).max() < LSE_TOL
    # every tile of every sequence exactly once, within the grid's bound
    tiles = [(b, t) for b, n in enumerate(q_lens) for t in range(fp.tiles_of(n, h_q // h_kv, tile.rows))]
    assert sorted(visited) == tiles


@pytest.mark.unit
def test_the_emulation_fails_when_a_tile_stops_one_step_short(monkeypatch):
    """The check above can fail: one key step fewer at the causal edge is visible."""
    monkeypatch.setattr(flash_emulation, "kv_steps", lambda *a: max(kv_steps(*a) - 1, 0))
    q_lens, kv_lens, causal = CASES[0]
    q, k, v = _inputs(np.random.default_rng(7), q_lens, kv_lens, 2, 8, 64, 64)
    out, _, _ = emulate(q, k, v, q_lens, kv_lens, causal, 0.125, 2, FlashTile(8, 64))
    want, _ = reference(q, k, v, q_lens, kv_lens, causal, 0.125)
    assert not rel_err(np.nan_to_num(out), want) < OUT_TOL


@pytest.mark.unit
@pytest.mark.parametrize("qo_n,kv_n,group", [(32768, 32768, 4), (513, 513, 3), (37, 77, 1), (1, 300, 4)])
def test_causal_tiles_walk_exactly_to_their_last_visible_key(qo_n, kv_n, group):
    tile = FlashTile(8, 64)
    for t in range(fp.tiles_of(qo_n, group, tile.rows)):
        last_tok = min(qo_n - 1, ((t + 1) * tile.rows - 1) // group)
        visible = row_limit(last_tok, qo_n, kv_n, True)
        steps = kv_steps(t, qo_n, kv_n, True, group, tile)
        assert (steps - 1) * tile.keys < visible <= steps * tile.keys
        assert kv_steps(t, qo_n, kv_n, False, group, tile) == -(-kv_n // tile.keys)


@pytest.mark.unit
def test_tiles_per_head_dim_fit_every_cuda_target():
    assert default_tile(128, 128) == FlashTile(8, 64) and default_tile(64, 64) == FlashTile(8, 64)
    assert shared_bytes(FlashTile(8, 64), 128, 128) == 2 * 2 * 64 * 136 * 2  # 68 KiB: Q fits in one stage
    assert all(shared_bytes(default_tile(d, d), d, d) <= fp.MAX_DYNAMIC_SHARED for d in (16, 32, 64, 96, 128))
    assert supports(128, 128, "float16") and supports(64, 64, "float16") and supports(96, 96, "float16")
    # float32 caches, head dims past the registers' budget or not multiples of 16: attention_prefill.py or TVM's
    assert not supports(128, 128, "float32") and not supports(256, 256, "float16") and not supports(72, 72, "float16")
    with pytest.raises(ValueError, match="not taken"):
        fp.ragged_prefill(1, 4, 256, 256, "float16")


@pytest.mark.unit
def test_signatures_are_tvms():
    assert_same_signature(fp.ragged_prefill(8, 32, 128, 128, "float16"),
                          _prefill_kernels._attention_prefill_ragged(8, 32, 128, 128, "float16", {}, CUDA))
    assert_same_signature(fp.paged_prefill(8, 32, 128, "float16"),
                          _prefill_kernels._attention_prefill(8, 32, 128, "float16", False, {}, CUDA))


def _body(func) -> str:
    src = cuda_source(tvm.IRModule({"main": func}), CUDA)
    return src[src.rindex("__global__"):]


@pytest.mark.unit
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_is_mma_sync_ldmatrix_and_cp_async_with_four_barriers(paged, d):
    tile = default_tile(d, d)
    func = fp.paged_prefill(8, 32, d, "float16") if paged else fp.ragged_prefill(8, 32, d, d, "float16")
    body = _body(func)
    assert f"__launch_bounds__({32 * tile.warps})" in body
    mmas = d // 16 * tile.keys // 8 + tile.keys // 16 * d // 8  # S = Q·Kᵀ, then O += P·V, a warp a step
    assert body.count("tvm_builtin_ptx_mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32") == mmas
    ld_q, ld_k, ld_v = d // 16, d // 16 * tile.keys // 16, tile.keys // 16 * d // 16
    assert body.count("ldmatrix_sync_aligned_m8n8_x4_shared_b16") == ld_q + ld_k
    assert body.count("ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16") == ld_v
    copies = tile.rows * d // 8 // (32 * tile.warps) + 2 * 2 * tile.keys * d // 8 // (32 * tile.warps)
    assert body.count("cp_async_cg_src_size") == copies  # Q once, K and V before the loop and in it
    assert "extern __shared__" in body and "wmma" not in body
    # Q landed, Q in registers; per step: the step's copies landed, the stage read by every warp
    assert body.count("__syncthreads()") == 4
    assert "int64_t" not in body.split("{", 1)[1] or paged  # int32 indexing; pages index in int64


@pytest.mark.unit
def test_scores_and_probabilities_stay_in_registers():
    """S, P and O are local arrays indexed by constants only (registers, not local memory)."""
    body = _body(fp.ragged_prefill(8, 32, 128, 128, "float16"))
    arrays = re.findall(r"alignas\(\d+\) (?:float|uint|int) (\w+)\[(\d+)\];", body)
    assert {int(n) for _, n in arrays} >= {32, 64}  # Q fragments 32 words, S 32 floats, O 64 floats
    for name, _ in arrays:
        assert not re.search(rf"\b{name}\[[^\]]*[a-z_(][^\]]*\]", body), name  # no variable index


@pytest.mark.unit
def test_the_choice_and_the_swap_of_both_prefill_kernels():
    from tvm.relax.frontend.nn.llm import kv_cache

    from luce_compile.lower.relax_model import prefill_attention_kernels, tensor_core_prefill_attention

    assert prefill_attention_kernels(CUDA, "f16", "flash", 128, 128, "float16") == \
        {"ragged": "flash 8x64", "paged": "flash 8x64"}
    assert prefill_attention_kernels(CUDA, "f16", "wmma", 128, 128, "float16") == \
        {"ragged": "wmma 4x32", "paged": "tvm"}
    assert prefill_attention_kernels(CUDA, "f16", "flash", 256, 256, "float16")["ragged"] == "wmma 2x32"
    assert prefill_attention_kernels(CUDA, "f32", "flash", 128, 128, "float16") == {"ragged": "tvm", "paged": "tvm"}
    originals = kv_cache._attention_prefill_ragged, kv_cache._attention_prefill
    with tensor_core_prefill_attention(CUDA, "f16", "flash"):
        assert "T.ptx.cp(" in kv_cache._attention_prefill_ragged(8, 32, 128, 128, "float16", {}, CUDA).script()
        assert "T.ptx.cp(" in kv_cache._attention_prefill(8, 32, 128, "float16", False, {}, CUDA).script()
        # sliding-window layers and float32 caches keep what they had
        assert "T.ptx.cp(" not in kv_cache._attention_prefill(8, 32, 128, "float16", True, {}, CUDA,
                                                             sliding_window_size=512).script()
        assert "wmma" in kv_cache._attention_prefill_ragged(8, 32, 128, 128, "float32", {}, CUDA).script()
    with tensor_core_prefill_attention(CUDA, "f16", "wmma"):
        assert "wmma" in kv_cache._attention_prefill_ragged(8, 32, 128, 128, "float16", {}, CUDA).script()
        assert "T.ptx.cp(" not in kv_cache._attention_prefill(8, 32, 128, "float16", False, {}, CUDA).script()
    assert (kv_cache._attention_prefill_ragged, kv_cache._attention_prefill) == originals


# ---- attention sinks (gpt-oss; lower/attention_sinks.py): rows of the head's columns, then the padding ------------
def _rows_with_sinks(rng, q_lens, kv_lens, h_kv, h_q, d_att):
    """Q, K, V rows as pad_with_sinks lays them out (float16), each query at its own key's position, and the sinks
    (Σq, h_q): scripts/device_check.py's inputs for the same kernels on the device, its layout constants the
    lowering's."""
    from luce_compile.lower import attention_sinks

    dc = load_script("device_check")
    assert (dc.SINK_COLUMNS, dc.SINK, dc.KEY_POSITION, dc.QUERY_POSITION) == (
        attention_sinks.SINK_COLUMNS, attention_sinks.SINK, attention_sinks.KEY_POSITION,
        attention_sinks.QUERY_POSITION)
    return dc._sink_inputs(rng, q_lens, kv_lens, h_kv, h_q, d_att, [True] * len(q_lens))


@pytest.mark.unit
@pytest.mark.parametrize("decode", [False, True], ids=["ragged", "decode"])
def test_sinks_fold_in_as_the_start_of_every_rows_softmax(decode):
    """The kernels multiply whole rows (padding included: no column is non-zero in both a query's and a key's) and
    start each row's online softmax from its sink: against float64 attention over the head's columns with one more
    key of the sink's score and value 0. Decode: one query token a sequence, its own key the last, the decode tile."""
    h_kv, h_q, d_att = 8, 64, 64  # gpt-oss-20b's heads
    q_lens, kv_lens, causal = ((1, 1, 1, 1), (1, 70, 300, 1000), False) if decode else ((5, 130), (5, 130), True)
    tile = fp.decode_tile(h_q // h_kv, d_att + 16) if decode else fp.default_tile(d_att + 16, d_att + 16)
    q, k, v, sinks = _rows_with_sinks(np.random.default_rng(), q_lens, kv_lens, h_kv, h_q, d_att)
    out, lse, _ = emulate(q, k, v, q_lens, kv_lens, causal, 0.125, h_kv, tile, sink_at=d_att)
    want, want_lse = reference(q[..., :d_att], k[..., :d_att], v[..., :d_att], q_lens, kv_lens, causal, 0.125,
                               sinks=sinks)
    plain, _ = reference(q[..., :d_att], k[..., :d_att], v[..., :d_att], q_lens, kv_lens, causal, 0.125)
    assert rel_err(out[..., :d_att], want) < OUT_TOL and (out[..., d_att:] == 0).all()
    assert np.abs(lse - want_lse).max() < LSE_TOL
    assert not rel_err(out[..., :d_att], plain) < OUT_TOL  # the sinks matter at these values


@pytest.mark.unit
@pytest.mark.parametrize("sliding", [False, True])
def test_the_sink_decode_kernel_has_tvms_signature(sliding):
    from tvm.relax.frontend.nn.llm import _decode_kernels

    assert_same_signature(fp.paged_decode(8, 64, 80, "float16", sliding, d_att=64),
                          _decode_kernels._attention_decode(8, 64, 80, "float16", sliding, {}, CUDA))
    body = _body(fp.paged_decode(8, 64, 80, "float16", sliding, d_att=64))
    # the group's 8 heads in one 16-row fragment, 8 warps sharing each step's 128 keys; their merge reuses the
    # stages' dynamic shared memory (88 KiB: within sm_86/sm_120's 99 KiB a block, with no static buffer beside it)
    assert fp.decode_tile(8, 80) == FlashTile(1, 128, 8) and "__launch_bounds__(256)" in body
    assert fp.shared_bytes(fp.decode_tile(8, 80), 80, 80) <= fp.MAX_DYNAMIC_SHARED
    assert not re.search(r"__shared__[^;]*\[\d+\]", body)
    with pytest.raises(ValueError, match="sinks fold"):
        fp._Flash(8, 64, 80, 80, "float16", None, mode="paged", d_att=64)


@pytest.mark.unit
def test_a_build_with_sinks_swaps_the_decode_kernel_and_refuses_what_cannot_fold():
    from tvm.relax.frontend.nn.llm import kv_cache

    from luce_compile.errors import UnsupportedError
    from luce_compile.gguf.config import ModelConfig
    from luce_compile.lower.attention_sinks import check_sinks
    from luce_compile.lower.relax_model import tensor_core_prefill_attention

    decode_tvm = kv_cache._attention_decode
    with tensor_core_prefill_attention(CUDA, "f16", "flash", d_att=64):
        assert kv_cache._attention_decode(8, 64, 80, "float16", True, {}, CUDA).attrs["global_symbol"] == \
            "batch_decode_paged_kv_sliding_window"
        assert "T.ptx.cp(" in kv_cache._attention_decode(8, 64, 80, "float16", False, {}, CUDA).script()
        assert "T.ptx.cp(" in kv_cache._attention_prefill_ragged(8, 64, 80, 80, "float16", {}, CUDA).script()
    with tensor_core_prefill_attention(CUDA, "f16", "flash"):
        assert kv_cache._attention_decode is decode_tvm  # no sinks: TVM's decode kernel
    assert kv_cache._attention_decode is decode_tvm
    c = ModelConfig(arch="gpt-oss", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, head_dim_v=64, n_ff=256,
                    n_vocab=64, n_ctx_train=4096, rms_eps=1e-5, rope_base=1e4, rope_dim=64, rope_layout="neox",
                    attn_sinks=True)
    check_sinks(c, "llvm")
    check_sinks(c, "cuda", "f16", "float16")
    for precision, dtype in (("f32", "float32"), ("f16", "float32")):
        with pytest.raises(UnsupportedError, match="--target cpu"):
            check_sinks(c, "cuda", precision, dtype)


@pytest.mark.unit
@pytest.mark.parametrize("h_kv,h_q,d", [(4, 32, 128), (8, 40, 128), (4, 28, 128), (3, 9, 64)])
def test_the_decode_kernel_builds_for_heads_without_sinks(h_kv, h_q, d):
    """Models without sinks (device_check's DECODE_SHAPES): heads of 128 take 64 keys a step (4 warps), whose two
    stages fit sm_86/sm_120's 99 KiB; the kernel keeps TVM's signature; the tile's schedule gives float64 attention."""
    from tvm.relax.frontend.nn.llm import _decode_kernels

    tile = fp.decode_tile(h_q // h_kv, d)
    assert tile == (FlashTile(1, 64, 4) if d == 128 else FlashTile(1, 128, 8))
    assert fp.shared_bytes(tile, d, d) <= fp.MAX_DYNAMIC_SHARED
    assert_same_signature(fp.paged_decode(h_kv, h_q, d, "float16", False),
                          _decode_kernels._attention_decode(h_kv, h_q, d, "float16", False, {}, CUDA))
    rng = np.random.default_rng()
    q_lens, kv_lens = (1, 1, 1), (1, 70, 1000)
    q, k, v = (rng.standard_normal((sum(n), h, d)).astype(np.float16) for n, h in ((q_lens, h_q), (kv_lens, h_kv),
                                                                                  (kv_lens, h_kv)))
    out, _, _ = emulate(q, k, v, q_lens, kv_lens, False, 1 / np.sqrt(d), h_kv, tile)
    want, _ = reference(q, k, v, q_lens, kv_lens, False, 1 / np.sqrt(d))
    assert rel_err(out, want) < OUT_TOL
