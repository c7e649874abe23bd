"""lower/relax_model.py: the tiles TVM's GPU prefill-attention kernels get (PREFILL_TILES, measured on the H200)."""

from __future__ import annotations

import pytest
from tvm.relax.frontend.nn.llm import _prefill_kernels
from tvm.target import Target

from luce_compile.lower.relax_model import prefill_attention_tiles, prefill_tiles

CUDA = Target({"kind": "cuda", "arch": "sm_90", "max_num_threads": 1024, "thread_warp_size": 32})


@pytest.mark.unit
def test_the_largest_tile_that_fits_static_shared_memory():
    assert prefill_tiles(64, "float32") == (64, 32)  # Llama-1B, SmolLM2: the best measured
    assert prefill_tiles(128, "float32") == (32, 16)  # Qwen3: 64×32 would need 72 KiB
    assert prefill_tiles(256, "float32") is None  # Gemma 3: 16×16 needs 49 KiB (ptxas refused it); TVM's 8×8 stays
    assert prefill_tiles(128, "float16") == (64, 32)


@pytest.mark.unit
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tvm_config_is_swapped_only_while_the_cache_is_built(head_dim):
    original = _prefill_kernels._get_prefill_kernel_config
    want = original(8, 32, head_dim, "float32", CUDA)
    with prefill_attention_tiles(CUDA, head_dim, "float32"):
        got = _prefill_kernels._get_prefill_kernel_config(8, 32, head_dim, "float32", CUDA)
    assert _prefill_kernels._get_prefill_kernel_config is original
    queries, keys = prefill_tiles(head_dim, "float32")
    num_blocks, load_vec, group, bdx, warps, tile_x, tile_y, tile_z = got
    assert (num_blocks, load_vec, group, bdx, warps) == want[:5]  # only the tile changes
    assert (tile_x, tile_z) == (queries, keys) != (want[5], want[7])
    assert tile_y % head_dim == 0 and (tile_x * tile_y) % (bdx * warps) == 0


@pytest.mark.unit
@pytest.mark.parametrize("target,head_dim", [(Target("llvm"), 64), (CUDA, 256)])
def test_other_targets_and_head_dims_keep_tvm_tiles(target, head_dim):
    original = _prefill_kernels._get_prefill_kernel_config
    with prefill_attention_tiles(target, head_dim, "float32"):
        assert _prefill_kernels._get_prefill_kernel_config is original
