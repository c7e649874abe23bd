"""Fault injection at the engine's compiled functions (Engine._fns: the one place a step calls compiled code)."""

from __future__ import annotations

from collections.abc import Callable


def fails_on_call(real: Callable, n: int, message: str = "injected fault") -> Callable:
    """`real`, except that its n-th call raises after it ran (the kernels wrote their KV entries, then the step
    failed). The wrapper's `calls` counts the calls."""

    def wrapper(*args):
        wrapper.calls += 1
        out = real(*args)
        if wrapper.calls == n:
            raise RuntimeError(message)
        return out

    wrapper.calls = 0
    return wrapper
