"""The KV pool's size (runtime/luce_runtime/kv_memory.py): a token's bytes at the artifact's KV type, the budget
from --kv-memory or a quarter of the free memory, the context refused past the trained one."""

import pytest
from luce_runtime.kv_memory import KVMemoryError, kv_bytes_per_token, parse_memory, plan_kv_pool

SMOLLM2 = {"n_layer": 30, "n_head_kv": 3, "head_dim": 64, "n_ctx_train": 8192}
pytestmark = pytest.mark.unit


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer_at_the_kv_type():
    assert kv_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(SMOLLM2, "float16") == 2 * 30 * 3 * 64 * 2


def test_sequences_follow_the_free_memory():
    per_seq = kv_bytes_per_token(SMOLLM2) * 4096
    assert plan_kv_pool(SMOLLM2, "float32", "llvm", available=40 * per_seq).sequences == 10  # a quarter of it
    assert plan_kv_pool(SMOLLM2, "float16", "llvm", available=40 * per_seq).sequences == 20  # half the bytes
    # the prefix cache's sequences come out of the same budget, and give way first
    plan = plan_kv_pool(SMOLLM2, "float32", "llvm", available=40 * per_seq, extra=4)
    assert (plan.sequences, plan.extra, plan.tokens) == (6, 4, 10 * 4096)
    plan = plan_kv_pool(SMOLLM2, "float32", "llvm", available=8 * per_seq, extra=4)
    assert (plan.sequences, plan.extra) == (1, 1)
    # the weights the engine loads into that memory after the plan come off it first
    plan = plan_kv_pool(SMOLLM2, "float32", "llvm", available=40 * per_seq, weights=20 * per_seq)
    assert plan.sequences == 5 and "less" in plan.describe()


def test_the_weights_are_the_manifest_planes_bytes():
    from luce_runtime.kv_memory import weights_bytes

    manifest = {"weights": {"params": [{"name": "a", "nbytes": 1000}, {"name": "b", "nbytes": 24}]}}
    assert weights_bytes(manifest) == 1024 and weights_bytes({}) == 0


def test_kv_memory_sets_the_budget_and_the_start_line_says_what_it_holds():
    plan = plan_kv_pool(SMOLLM2, "float16", "llvm", context=8192, kv_memory=parse_memory("1G"))
    per_token = 2 * 30 * 3 * 64 * 2
    assert plan.sequences == 2**30 // (per_token * 8192) and plan.context == 8192
    line = plan.describe()
    assert "float16" in line and "22.5 KiB a token" in line and f"{plan.tokens:,} tokens" in line
    assert "--kv-memory" in line


def test_refusals_name_what_to_change():
    with pytest.raises(KVMemoryError, match="trained context of 8192"):
        plan_kv_pool(SMOLLM2, "float32", "llvm", context=8193, available=1 << 40)
    with pytest.raises(KVMemoryError, match="lower --ctx, raise --kv-memory"):
        plan_kv_pool(SMOLLM2, "float32", "llvm", context=8192, kv_memory=1 << 20)
    with pytest.raises(KVMemoryError, match="not the 5 asked"):
        plan_kv_pool(SMOLLM2, "float32", "llvm", context=4096, sequences=5, kv_memory=4 * 4096 * 46080)


@pytest.mark.parametrize("text,size", [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                       ("2gb", 2 << 30)])
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0"])
def test_parse_memory_refuses_what_is_no_size(text):
    with pytest.raises(KVMemoryError, match="is not a size"):
        parse_memory(text)


def test_host_memory_is_read_from_proc():
    from luce_runtime.engine import available_memory

    assert available_memory("llvm") > 1 << 28


def test_wider_cache_rows_of_the_contract_count():
    """An artifact whose cache rows are wider than its heads (gpt-oss's attention sinks: 64 + 16 columns) says so in
    its contract's kv_head_dim, and the pool is sized by the rows."""
    gptoss = {"n_layer": 24, "n_head_kv": 8, "head_dim": 64, "n_ctx_train": 131072}
    assert kv_bytes_per_token(gptoss, "float32", kv_head_dim=80) == 2 * 24 * 8 * 80 * 4
    plan = plan_kv_pool(gptoss, "float32", "llvm", context=4096, available=80 * 2 * 24 * 8 * 80 * 4 * 4096,
                        kv_head_dim=80)
    assert plan.sequences == 20 and plan.bytes_per_token == 2 * 24 * 8 * 80 * 4
