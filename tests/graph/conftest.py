"""Synthetic tiny models for the graph tests, written once per session into a temp folder."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3")


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """synthetic(preset, **spec_changes) → path of a random-weight GGUF (same spec → same file)."""
    from luce_compile.synthetic import PRESETS, cached_synthetic

    folder = tmp_path_factory.mktemp("synthetic")

    def make(preset: str, **changes: object) -> Path:
        return cached_synthetic(dataclasses.replace(PRESETS[preset], **changes), folder)

    return make
