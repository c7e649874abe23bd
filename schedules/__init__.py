"""Schedule rules per op family and target family, imported as `luce_schedules` (one file per op family).

A rule is dlight-shaped: `apply(func, target) -> tvm.s_tir.Schedule | None`, None when the function is not its
kind. `rules_for(target)` is the ordered list, specific to general, that the build tries on every PrimFunc.
"""

from __future__ import annotations


def rules_for(target) -> list:
    """The ordered rule list for a TVM target's family."""
    if target.kind.name == "llvm":
        try:
            from luce_schedules.cpu import RULES
        except ImportError:  # the CPU rules are being written; until then every function stays unscheduled
            return []
        return list(RULES)
    raise NotImplementedError(f"schedules: no rules for {target.kind.name} targets yet (the GPU issue adds them).")
