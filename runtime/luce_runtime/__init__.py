"""The thin runtime: loads a luce-compile artifact with the TVM runtime alone. Never imports luce_compile."""

__version__ = "0.1.0"
