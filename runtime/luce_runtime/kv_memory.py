"""The KV page pool sized from memory: how many sequences of how many tokens the cache holds, and the line that says
so when `serve` or `run` starts.

Every live sequence is given its whole context of pages up front (Engine: admission can never run out of pages), so
the pool is sequences × context tokens. The budget is `--kv-memory`, else a quarter of what is free once the weights
are loaded: the host's MemAvailable on the CPU, the GPU's free memory where the artifact is a GPU's
(engine.available_memory), less the artifact's weights, which the engine loads after the pool is planned (once on
a GPU: the per-op kernels' weights are views of the megakernel's, device_views.py).
A token's bytes are the artifact's KV type's (its manifest's kv_dtype: float32 4, float16 2 per value).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from luce_runtime.errors import LuceError

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
BUDGET_FRACTION = 0.25  # of the free memory, when --kv-memory is not given (the weights and activations need room)
MAX_SEQUENCES = 64  # the most sequences a memory-sized pool is given (a decode batch past this is not faster here)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class KVMemoryError(LuceError, ValueError):
    """A KV pool that cannot be made as asked (a context past the model's, a budget that holds no sequence)."""


def parse_memory(text: str) -> int:
    """'8G', '512M', '1.5GiB', '2gb' or plain bytes → bytes (binary units: G = 2**30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise KVMemoryError(f"--kv-memory {text!r} is not a size; write it as 8G, 512M or a number of bytes.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def kv_bytes_per_token(config: dict, kv_dtype: str = "float32", kv_head_dim: int = 0) -> int:
    """KV-cache bytes one token takes over all layers: keys and values of every KV head, in the cache's dtype; a
    head's row is kv_head_dim wide where the artifact's contract says so (attention sinks), else head_dim."""
    if kv_dtype not in DTYPE_BYTES:
        raise KVMemoryError(f"engine: unknown KV cache dtype {kv_dtype!r} (known: {', '.join(DTYPE_BYTES)}).")
    head = int(kv_head_dim or config["head_dim"])
    return 2 * int(config["n_layer"]) * int(config["n_head_kv"]) * head * DTYPE_BYTES[kv_dtype]


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class KVPlan:
    """The pool serve/run make: `sequences` of `context` tokens (`extra` of them cached prompt prefixes)."""

    kv_dtype: str
    bytes_per_token: int
    budget: int  # bytes the pool may take
    budget_from: str  # where the budget came from, for the start line
    context: int  # tokens per sequence
    sequences: int  # decode batch slots
    extra: int = 0  # more sequences in the pool (the prefix cache's)

    @property
    def tokens(self) -> int:
        return self.context * (self.sequences + self.extra)

    def describe(self) -> str:
        extra = f" + {self.extra} cached prompt prefixes" if self.extra else ""
        return (f"KV cache {self.kv_dtype}, {_size(self.bytes_per_token)} a token: {self.tokens:,} tokens of context "
                f"in {_size(self.tokens * self.bytes_per_token)} ({self.sequences} sequence"
                f"{'s' if self.sequences != 1 else ''} of {self.context:,}{extra}; budget {_size(self.budget)}, "
                f"{self.budget_from})")


def check_context(config: dict, context: int) -> int:
    """The context asked for (0: the model's trained context, capped at 4096), refused past the trained context."""
    trained = int(config["n_ctx_train"])
    if context < 0:
        raise KVMemoryError(f"--ctx must be positive, got {context}.")
    if context > trained:
        raise KVMemoryError(f"--ctx {context} is past the model's trained context of {trained} tokens (its GGUF's "
                            "context_length); positions past it were never trained. Pass --ctx of at most that.")
    return context or min(trained, 4096)


def sliding_window(config: dict) -> int:
    """The model's sliding window where any of its layers slides (Gemma 3, gpt-oss), else 0."""
    window = int(config.get("sliding_window") or 0)
    return window if window and any(config.get("sliding") or ()) else 0


def weights_bytes(manifest: dict) -> int:
    """The bytes of an artifact's weights as the engine loads them (its manifest's planes)."""
    return sum(int(p.get("nbytes", 0)) for p in manifest.get("weights", {}).get("params", []))


def plan_kv_pool(config: dict, kv_dtype: str, kind: str, *, context: int = 0, sequences: int = 0, extra: int = 0,
                 kv_memory: int = 0, available: int | None = None, kv_head_dim: int = 0,
                 weights: int = 0) -> KVPlan:
    """How many sequences of `context` tokens (plus up to `extra` for cached prefixes) the budget holds: `sequences`
    when given (refused when it does not fit an explicit kv_memory), else as many as fit, between 1 and MAX_SEQUENCES,
    after the prefixes' (fewer of those where the budget holds fewer sequences than extra + 1).
    `available`: the free memory (default: engine.available_memory(kind)); `kv_head_dim`: the contract's;
    `weights`: the bytes of the weights the engine will load into that memory (weights_bytes)."""
    context = check_context(config, context)
    per_token = kv_bytes_per_token(config, kv_dtype, kv_head_dim)
    if kv_memory:
        budget, source = kv_memory, "--kv-memory"
    else:
        if available is None:
            from luce_runtime.engine import available_memory

            available = available_memory(kind)
        budget = int(max(0, available - weights) * BUDGET_FRACTION)
        source = (f"a quarter of the {_size(available)} free, less {_size(weights)} of weights" if weights else
                  f"a quarter of the {_size(available)} free")
    per_seq = per_token * context
    fit = budget // per_seq
    if sequences:
        if kv_memory and (sequences + extra) * per_seq > budget:
            raise KVMemoryError(f"--kv-memory {_size(budget)} holds {fit} sequences of {context:,} tokens "
                                f"({_size(per_seq)} each at {kv_dtype}), not the {sequences + extra} asked; lower "
                                "--max-batch or --ctx, or raise --kv-memory.")
    elif fit < 1:
        raise KVMemoryError(f"one sequence of {context:,} tokens needs {_size(per_seq)} of KV cache at {kv_dtype}, "
                            f"more than the budget of {_size(budget)} ({source}); lower --ctx, raise --kv-memory, or "
                            "compile with --kv-cache f16 (half the bytes).")
    else:  # the prefix cache gives up sequences first: at least one decode slot
        extra = min(extra, fit - 1)
        sequences = max(1, min(MAX_SEQUENCES, fit - extra))
    plan = KVPlan(kv_dtype, per_token, budget, source, context, sequences, extra)
    log.info("%s", plan.describe())
    return plan
