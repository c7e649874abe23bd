"""The Relax pipeline per target family: TVM's default passes with our schedule rules applied after fusion.

TVM's CPU pipeline (relax/backend/cpu_generic) legalizes, fuses and lowers, but leaves every TIR function
unscheduled (one thread, no vectors). Ours runs the same passes and, between fusion and lowering, gives each
PrimFunc to the ordered rule list of `luce_schedules` for its target family: the first rule that accepts it
schedules it; a function no rule accepts stays as it is (correct, slow) and is logged.
"""

from __future__ import annotations

import logging

import tvm

log = logging.getLogger(__name__)


def apply_schedule_rules(target: tvm.target.Target) -> tvm.transform.Pass:
    """A module pass: schedule every unscheduled PrimFunc with the first matching rule of `luce_schedules`."""
    from luce_schedules import rules_for

    rules = rules_for(target)

    @tvm.transform.module_pass(opt_level=0, name="LuceApplyScheduleRules")
    def _apply(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs and "tirx.is_scheduled" in func.attrs:
                continue
            for rule in rules:
                sch = rule.apply(func, target)
                if sch is not None:
                    updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                    log.debug("%s ← %s", gv.name_hint, type(rule).__name__)
                    break
            else:
                log.info("no schedule rule for %s: left unscheduled", gv.name_hint)
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _apply


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    if target.kind.name != "llvm":
        raise NotImplementedError(f"build: the {target.kind.name} pipeline comes with the GPU targets issue.")
    from tvm.relax.backend.cpu_generic import pipeline as backend

    @tvm.transform.module_pass(opt_level=0, name="LucePipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target:
            passes = (backend.library_dispatch_passes(target) + backend.legalize_passes(target)
                      + [apply_schedule_rules(target)] + backend.dataflow_lower_passes(target)
                      + backend.finalize_passes(target))
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline



