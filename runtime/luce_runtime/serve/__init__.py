"""OpenAI- and Anthropic-compatible HTTP serving of a compiled artifact (FastAPI + uvicorn), with continuous batching.

    from luce_runtime.serve import ServeOptions, create_app, serve
"""

from luce_runtime.serve.app import ServeOptions, Service, create_app, serve

__all__ = ["ServeOptions", "Service", "create_app", "serve"]
