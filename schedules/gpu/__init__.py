"""Schedule rules for GPU targets (cuda, rocm), one file per op family; RULES is the order they are tried in.

dlight's default GPU rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback) follow these in the build
(build/pipeline.py): norms, elementwise ops and the fused reshapes go to them; attention and the KV-cache kernels
come from TVM's TIRPagedKVCache already scheduled.
"""

from luce_schedules.gpu.embedding import QuantEmbedding
from luce_schedules.gpu.moe import ExpertGEMV
from luce_schedules.gpu.quant_gemm import QuantGEMM
from luce_schedules.gpu.quant_gemv import QuantGEMV
from luce_schedules.gpu.rope import Rope

RULES = (ExpertGEMV(), QuantGEMV(), QuantGEMM(), QuantEmbedding(), Rope())

__all__ = ["RULES", "ExpertGEMV", "QuantEmbedding", "QuantGEMM", "QuantGEMV", "Rope"]
