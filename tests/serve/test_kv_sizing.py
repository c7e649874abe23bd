"""The KV pool's size comes from the free memory when --max-batch is not given."""

import pytest
from luce_runtime.engine import kv_bytes_per_token, max_batch_for_memory

SMOLLM2 = {"n_layer": 30, "n_head_kv": 3, "head_dim": 64}


@pytest.mark.unit
def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 4


@pytest.mark.unit
def test_max_batch_follows_the_memory(monkeypatch):
    import luce_runtime.engine as engine

    per_seq = kv_bytes_per_token(SMOLLM2) * 4096
    monkeypatch.setattr(engine, "available_memory", lambda kind: 40 * per_seq)
    assert max_batch_for_memory(SMOLLM2, "llvm", 4096, fraction=0.25) == 10
    monkeypatch.setattr(engine, "available_memory", lambda kind: per_seq)
    assert max_batch_for_memory(SMOLLM2, "llvm", 4096, fraction=0.25) == 1  # never below one sequence


@pytest.mark.unit
def test_host_memory_is_read_from_proc():
    from luce_runtime.engine import available_memory

    assert available_memory("llvm") > 1 << 28
