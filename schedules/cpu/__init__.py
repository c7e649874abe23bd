"""Schedule rules for CPU (llvm) targets, one file per op family; RULES is the order they are tried in."""

from luce_schedules.cpu.elementwise import Injective
from luce_schedules.cpu.moe import ExpertMatmul
from luce_schedules.cpu.quant_matmul import QuantGEMM, QuantGEMV, match_matmul

RULES = (QuantGEMV(), QuantGEMM(), ExpertMatmul(), Injective())

__all__ = ["RULES", "ExpertMatmul", "Injective", "QuantGEMM", "QuantGEMV", "match_matmul"]
