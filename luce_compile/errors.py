"""The compiler's error types; the base classes live in the runtime so both sides raise the same ones."""

from luce_runtime.errors import ArtifactError, GGUFError, LuceError, TokenizerError

__all__ = ["ArtifactError", "GGUFError", "LuceError", "TokenizerError", "UnsupportedError"]


class UnsupportedError(LuceError, NotImplementedError):
    """Valid input that luce-compile does not handle yet (an architecture, a quant type)."""
