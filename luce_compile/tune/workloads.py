"""Workloads: the distinct kernels of a model that a knobbed schedule rule takes, and the key a record is filed under.

A workload is one PrimFunc of the Relax module after fusion (what the schedule pass sees), together with the rule
that schedules it: the first rule of the target's ordered list that accepts it, when that rule is a
`luce_schedules.knobs.KnobbedRule` with a non-empty SPACE (anything else has nothing to tune). Its key is plain
text, readable in a log and stable across runs:

    <target>|<rule>|<function>|<weight type>|<dtype[shape]> of every argument

e.g. `cpu|cpu.int8_gemv|int8_gemv_q4_1_1536x576|Q4_1|int8[1,576] float32[1,18] ... float32[1,1536]`. Symbolic
extents keep their names (`float32[batch,576]`): one kernel serves every batch, and so does its record. The
function name is part of the key because two kernels can share a signature and differ in body (RoPE's base).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import tvm
from gguf import GGMLQuantizationType
from luce_schedules.knobs import KnobbedRule
from tvm import s_tir, tirx
from tvm.target import Target

from luce_compile.errors import LuceError
from luce_compile.lower.cpu_int8 import INT8_GEMV_ATTR

log = logging.getLogger(__name__)
# what a rule or its primitives raise for knobs they cannot take (TVM's errors are RuntimeErrors; an unknown knob is
# an UnsupportedError): a candidate that raises one is invalid, not a crash
SCHEDULE_ERRORS = (s_tir.ScheduleError, LuceError, RuntimeError, ValueError)


@dataclass(frozen=True)
class ArgSpec:
    """One argument of a kernel: a buffer's shape (ints, or names of symbolic extents) and dtype, or a scalar."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    scalar: bool = False

    def text(self) -> str:
        return self.dtype if self.scalar else f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "scalar": self.scalar}


@dataclass(frozen=True)
class Workload:
    key: str
    rule: str
    function: str
    weight_type: str
    target: str
    args: tuple[ArgSpec, ...]
    func: tirx.PrimFunc = field(compare=False, repr=False)

    def fields(self) -> dict:
        """What a record says about its workload (besides the key itself)."""
        return {"rule": self.rule, "function": self.function, "weight_type": self.weight_type,
                "target": self.target, "args": [a.to_dict() for a in self.args]}

    def symbols(self) -> list[str]:
        """The names of the symbolic extents, in order of first appearance."""
        names = (d for a in self.args for d in a.shape if isinstance(d, str))
        return list(dict.fromkeys(names))


def _dim(value: tirx.PrimExpr) -> int | str:
    if isinstance(value, tirx.IntImm):
        return int(value)
    return value.name if isinstance(value, tirx.Var) else str(value)


def arg_specs(func: tirx.PrimFunc) -> tuple[ArgSpec, ...]:
    """Every parameter of a PrimFunc (TVM 0.27: buffers are the parameters; scalars are plain Vars)."""
    out = []
    for p in func.params:
        try:
            out.append(ArgSpec(p.name, tuple(_dim(d) for d in p.shape), str(p.dtype)))
        except AttributeError:  # a scalar parameter: no buffer type
            out.append(ArgSpec(p.name, (), str(getattr(p, "expr_ty", "int64")), scalar=True))
    return tuple(out)


_GGML_NAMES = sorted((t.name.lower() for t in GGMLQuantizationType), key=len, reverse=True)


def weight_type(name: str, func: tirx.PrimFunc) -> str:
    """The GGUF weight type a kernel reads: the int8 kernels carry it as an attribute, the others in their name
    (lower/relax_model.py names them gemv_q4_1_…); "-" for kernels without a quantized weight (RoPE)."""
    if func.attrs and INT8_GEMV_ATTR in func.attrs:
        return str(func.attrs[INT8_GEMV_ATTR])
    padded = f"_{name.lower()}_"
    found = next((t for t in _GGML_NAMES if f"_{t}_" in padded), None)
    return found.upper() if found else "-"


def workload_key(target: str, rule: str, name: str, func: tirx.PrimFunc) -> str:
    return "|".join((target, rule, name, weight_type(name, func), " ".join(a.text() for a in arg_specs(func))))


def tunable(rule: object) -> bool:
    return isinstance(rule, KnobbedRule) and bool(getattr(rule, "SPACE", None))


def schedule_rules(target: Target) -> list:
    """The ordered rules the schedule pass tries (ours; dlight's defaults follow them on GPU targets).

    CPU: Int8GEMV goes first. QuantGEMV hands the int8 kernels to it without knobs (its own note calls that
    temporary: Int8GEMV belongs ahead of it in the list), so listed here first it schedules the same functions the
    same way with defaults, and its knobs can reach it."""
    from luce_schedules import rules_for

    rules = list(rules_for(target))
    if target.kind.name == "llvm":
        from luce_schedules.cpu.int8_gemv import Int8GEMV

        rules = [Int8GEMV(), *rules]
    seen: set[type] = set()
    return [r for r in rules if not (type(r) in seen or seen.add(type(r)))]


def first_rule(func: tirx.PrimFunc, target: Target, rules: Iterable) -> tuple[object, object] | tuple[None, None]:
    """(the first rule that accepts func with its defaults, what it returned), or (None, None)."""
    for rule in rules:
        result = rule.apply(func, target)
        if result is not None:
            return rule, result
    return None, None


def scheduled_func(result: object) -> tirx.PrimFunc:
    """A rule's result as a scheduled PrimFunc: a Schedule, or dlight's list form (one element with `.mod`)."""
    sch = result[0] if isinstance(result, list | tuple) else result
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def unscheduled_funcs(mod: tvm.ir.IRModule) -> list[tuple[str, tirx.PrimFunc]]:
    """(name, PrimFunc) of every function the schedule pass would see, sorted by name."""
    out = [(gv.name_hint, f) for gv, f in mod.functions_items()
           if isinstance(f, tirx.PrimFunc) and not (f.attrs and "tirx.is_scheduled" in f.attrs)]
    return sorted(out, key=lambda item: item[0])


def find_workloads(mod: tvm.ir.IRModule, target: Target, target_name: str) -> list[Workload]:
    """The tunable workloads of a fused module, sorted by key (deterministic: the same module, the same list)."""
    rules = schedule_rules(target)
    found: dict[str, Workload] = {}
    with target:
        for name, func in unscheduled_funcs(mod):
            rule, _ = first_rule(func, target, rules)
            if rule is None or not tunable(rule):
                continue
            key = workload_key(target_name, rule.name, name, func)
            found.setdefault(key, Workload(key, rule.name, name, weight_type(name, func), target_name,
                                           arg_specs(func), func))
    return [found[k] for k in sorted(found)]


def rule_by_name(target: Target, name: str) -> KnobbedRule:
    for rule in schedule_rules(target):
        if getattr(rule, "name", None) == name:
            return rule
    raise KeyError(f"tune: no rule named {name!r} for {target.kind.name} targets")
