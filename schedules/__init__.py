"""Schedule rules per op family and target family, imported as `luce_schedules` (one file per op family).

A rule is dlight-shaped: `apply(func, target) -> tvm.s_tir.Schedule | None`, None when the function is not its
kind. `rules_for(target)` is the ordered list, specific to general, that the build tries on every PrimFunc; on GPU
targets the build appends dlight's default rules after these (build/pipeline.py).
"""

from __future__ import annotations


def rules_for(target) -> list:
    """The ordered rule list for a TVM target's family."""
    kind = target.kind.name
    if kind == "llvm":
        from luce_schedules.cpu import RULES
    elif kind in ("cuda", "rocm"):
        from luce_schedules.gpu import RULES
    else:
        raise NotImplementedError(f"schedules: no rules for {kind} targets (cpu/llvm, cuda and rocm have them).")
    return list(RULES)
