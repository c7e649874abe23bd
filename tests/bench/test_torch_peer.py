"""The torch peer (benchmarks/peers/torch_peer.py) computes the same function as the float64 oracle.

Its forward is device- and dtype-agnostic, so here it runs on the CPU in float32, eagerly (no CUDA graph), through
the same static-KV prefill and decode paths the GPU benchmark captures. Tolerance: fp32 against fp64 on these tiny
models differs by ~1e-6 of max|logit| (measured); 1e-4 leaves room for summation order and still catches any wrong
RoPE pair, mask, bias or head mapping (those give errors of order 1). The bench() itself needs a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from luce_compile.errors import UnsupportedError  # noqa: E402
from luce_compile.gguf.reader import read_gguf  # noqa: E402
from luce_compile.graph.oracle import Oracle  # noqa: E402
from luce_compile.synthetic import SyntheticSpec, cached_synthetic  # noqa: E402

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "torch_peer.py"
REL_TOL = 1e-4  # of max|logit|: see the module docstring

MODELS = {
    "tiny-llama": "tiny-llama",  # NORM RoPE, tied head
    "tiny-qwen2": "tiny-qwen2",  # q/k/v biases, untied head, NEOX RoPE
    "tiny-qwen3": "tiny-qwen3",  # per-head q/k RMSNorm, head_dim 32 ≠ n_embd / n_head
    "llama-q4_1": SyntheticSpec(quant="Q4_1"),
    "qwen2-bf16": SyntheticSpec(arch="qwen2", tied_output=False, rope_base=1e6, rms_eps=1e-6, quant="BF16"),
}


def load_peer():
    """benchmarks/ is a folder of scripts, not a package: load the peer by path (once per session)."""
    if "torch_peer" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_peer", PEER)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["torch_peer"]


def model(name: str, dtype=torch.float32):
    return load_peer().Transformer(cached_synthetic(MODELS[name]), device="cpu", dtype=dtype, max_seq=256)


def assert_close(got, ref: np.ndarray) -> None:
    got = got.double().numpy()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= REL_TOL, f"max error {err:.2e} of max|logit| > {REL_TOL}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.unit
def test_imports_no_tvm():
    """The GPU machine has no TVM: the peer and the reader/dequantizers it uses must not import it."""
    code = ("import sys, importlib.util\n"
            "class NoTVM:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'tvm': raise ImportError('tvm is blocked here')\n"
            "sys.meta_path.insert(0, NoTVM())\n"
            f"spec = importlib.util.spec_from_file_location('torch_peer', {str(PEER)!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['torch_peer'] = m; spec.loader.exec_module(m)\n"
            "import luce_compile.gguf.quants\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'tvm'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_decode_match_oracle(name: str, rng: np.random.Generator):
    peer, m = load_peer(), model(name)
    oracle = Oracle(cached_synthetic(MODELS[name]))
    n_prompt = int(rng.integers(5, 40))
    prompt = rng.integers(0, m.config.n_vocab, n_prompt)
    cache = peer.KVCache.allocate(m.config, 1, 64, "cpu", torch.float32)
    step = peer.DecodeStep(m, cache, graph=False)  # before the prefill: building a step clears the cache
    assert_close(m.prefill(torch.from_numpy(prompt), cache, 0, all_logits=True), oracle.prefill(prompt.tolist()))
    for pos in range(n_prompt, n_prompt + 5):
        token = int(rng.integers(0, m.config.n_vocab))
        step.start([token], [pos])
        assert_close(step.step()[0], oracle.decode(token))


@pytest.mark.unit
def test_batch_decode_equals_each_sequence_alone(rng: np.random.Generator):
    """Sequences of different lengths share one decode step: each row must equal that sequence run alone, even
    with garbage in the cache slots the mask hides (the positions a sequence has not reached)."""
    peer, m = load_peer(), model("tiny-qwen3")
    lengths = [int(n) for n in rng.integers(3, 30, 3)]
    prompts = [torch.from_numpy(rng.integers(0, m.config.n_vocab, n)) for n in lengths]
    n_steps = 6

    def run(rows: list[int]) -> list[torch.Tensor]:
        cache = peer.KVCache.allocate(m.config, len(rows), 64, "cpu", torch.float32)
        step = peer.DecodeStep(m, cache, graph=False)  # greedy: each step feeds its argmax back in
        for t in cache.k + cache.v:
            t.normal_()
        first = [int(m.prefill(prompts[r], cache, slot).argmax()) for slot, r in enumerate(rows)]
        step.start(first, [lengths[r] for r in rows])
        return [step.step().clone() for _ in range(n_steps)]

    together = run([0, 1, 2])
    for r in range(3):
        alone = run([r])
        for t, a in zip(together, alone, strict=True):
            torch.testing.assert_close(t[r], a[0], rtol=1e-5, atol=1e-5 * float(a.abs().max()))
            assert int(t[r].argmax()) == int(a[0].argmax())


@pytest.mark.unit
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_per_token(name: str, dtype):
    """Every tensor in the file is read once per decoded token, except that an untied embedding table contributes
    only the looked-up row; the tied table is read whole, once, as the LM head."""
    gguf = read_gguf(cached_synthetic(MODELS[name]))
    n_vocab, n_embd = gguf.tensor("token_embd.weight").shape
    elements = sum(int(np.prod(t.shape)) for t in gguf)
    if "output.weight" in gguf.tensors:
        elements -= (n_vocab - 1) * n_embd
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert model(name, dtype).weight_bytes_per_token() == elements * itemsize


@pytest.mark.unit
def test_weight_bytes_tiny_llama_by_hand():
    # tiny-llama: 2 layers, n_embd 64, 4 heads / 2 kv heads of 16, n_ff 128, vocab 49152, tied head
    per_layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 64 + 3 * 128 * 64
    assert model("tiny-llama", torch.bfloat16).weight_bytes_per_token() == 2 * (2 * per_layer + 49152 * 64 + 64)


@pytest.mark.unit
def test_gemma3_is_refused_with_its_name():
    with pytest.raises(UnsupportedError, match="gemma3"):
        load_peer().Transformer(cached_synthetic("tiny-gemma3"), device="cpu", dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_on_gpu(tmp_path: Path):
    peer = load_peer()
    path = cached_synthetic("tiny-llama")
    out = tmp_path / "torch.json"
    assert peer.main([str(path), "--out", str(out), "--prompt-lens", "16", "64", "--gen-len", "8",
                      "--batches", "1", "2", "--repeat", "2"]) == 0
    r = json.loads(out.read_text())
    for key in ("prefill_tok_s", "prefill_eager_tok_s", "prefill_ms"):
        assert set(r[key]) == {"16", "64"} and all(v > 0 for v in r[key].values())
    assert set(r["decode_tok_s"]) == set(r["decode_step_ms"]) == {"1", "2"}
    assert r["weight_bytes_per_token"] == peer.Transformer(path, device="cpu").weight_bytes_per_token()
    assert r["bandwidth_gb_s"] > 0 and r["roofline_tok_s"] > 0 and r["roofline_fraction"] > 0
    assert 0 <= r["first_token"] < 49152 and r["dtype"] == "bfloat16"
    assert {"torch", "cuda", "gpu"} <= set(r["versions"])
