"""The CPU pipeline's one correction to TVM's own kernels: the paged KV cache's tree-attention kernels are marked
noalias (codegen/pipeline.py says why: without it every kernel of the module ran ~1.7x slower)."""

from __future__ import annotations

import pytest

from luce_compile.codegen.pipeline import NOALIAS_KV_KERNELS, relax_pipeline
from luce_compile.graph.registry import open_graph
from luce_compile.lower.relax_model import lower_graph
from luce_compile.synthetic import cached_synthetic, preset
from luce_compile.targets import get_target

pytestmark = pytest.mark.unit


def test_tree_attention_kernels_are_noalias_after_the_cpu_pipeline():
    graph, _ = open_graph(cached_synthetic(preset("tiny-llama")))
    target = get_target("cpu").tvm_target()
    mod, _ = lower_graph(graph, target)
    with target:
        before = {gv.name_hint: f for gv, f in mod.functions_items()}
        out = relax_pipeline(target)(mod)
    prims = {gv.name_hint: f for gv, f in out.functions_items() if hasattr(f, "body")}
    for name in NOALIAS_KV_KERNELS:
        # the names are TVM's (kv_cache.py): if a TVM upgrade renames them, this says so instead of a slow build
        assert name in prims, f"TVM no longer emits {name}; update NOALIAS_KV_KERNELS"
        assert not (before[name].attrs or {}).get("tirx.noalias"), f"TVM marks {name} noalias itself now"
        assert prims[name].attrs["tirx.noalias"]
