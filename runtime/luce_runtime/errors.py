"""Error types shared by the runtime and the compiler (the compiler may import the runtime, never the reverse).

Every message names the stage, the bad value, what was expected, and what to do next.
"""


class LuceError(Exception):
    """Base of every error luce-compile raises on purpose."""


class GGUFError(LuceError, ValueError):
    """A GGUF file is malformed, truncated, or contradicts itself."""


class TokenizerError(LuceError, ValueError):
    """Tokenizer metadata is missing or inconsistent, or a chat template cannot be rendered."""


class ArtifactError(LuceError, ValueError):
    """A compiled artifact is missing files, was tampered with, or was built for something else."""
