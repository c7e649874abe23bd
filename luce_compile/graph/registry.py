"""Architecture → graph builder: a new architecture is one folder under graph/ and one line here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from luce_compile.errors import LuceError, UnsupportedError
from luce_compile.gguf.config import ModelConfig, model_config
from luce_compile.gguf.reader import GGUFFile, TensorInfo, read_gguf
from luce_compile.graph import gemma3, gptoss, llama, qwen2, qwen3, qwen3moe
from luce_compile.graph.ir import Graph

Builder = Callable[[ModelConfig, Mapping[str, TensorInfo]], Graph]

BUILDERS: dict[str, Builder] = {
    "llama": llama.build,
    "qwen2": qwen2.build,
    "qwen3": qwen3.build,
    "gemma3": gemma3.build,
    "qwen3moe": qwen3moe.build,
    "gpt-oss": gptoss.build,
}


def build_graph(gguf: GGUFFile) -> Graph:
    """The model's graph, from the file's metadata (model_config) and tensor table; validated against the file."""
    config = model_config(gguf)
    if config.arch not in BUILDERS:
        raise UnsupportedError(f"graph: no graph builder for architecture {config.arch!r} "
                               f"(available: {', '.join(BUILDERS)}).")
    graph = BUILDERS[config.arch](config, gguf.tensors)
    graph.source = gguf.path
    return graph


def open_graph(source: Graph | GGUFFile | str | Path) -> tuple[Graph, GGUFFile]:
    """A graph and the file its weights live in, from either (executors take both kinds of argument)."""
    if isinstance(source, Graph):
        if source.source is None:
            raise LuceError("graph: this graph has no source GGUF file to read weights from; build it with "
                            "build_graph(read_gguf(path)).")
        return source, read_gguf(source.source)
    gguf = source if isinstance(source, GGUFFile) else read_gguf(source)
    return build_graph(gguf), gguf
