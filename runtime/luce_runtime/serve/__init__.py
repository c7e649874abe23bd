"""OpenAI- and Anthropic-compatible HTTP serving of a compiled artifact (FastAPI + uvicorn), with continuous batching.

    from luce_runtime.serve import ServeOptions, create_app, serve

The app (FastAPI) is imported on first use, so the scheduler and the other modules of this package load where
FastAPI is not installed (the GPU machine's checks drive the scheduler directly).
"""

from __future__ import annotations

import importlib

__all__ = ["ServeOptions", "Service", "create_app", "serve"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("luce_runtime.serve.app"), name)
    raise AttributeError(f"module 'luce_runtime.serve' has no attribute {name!r}")
