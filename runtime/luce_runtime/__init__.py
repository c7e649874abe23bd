"""The thin runtime: loads a luce-compile artifact with the TVM runtime alone. Never imports luce_compile."""

from luce_runtime.threads import claim_cores

__version__ = "0.1.0"

claim_cores()  # before TVM's thread pool starts, which TVM sizes to half the cores on x86 (threads.py says why)
