"""What every schedule rule shares, whatever the target: named knobs with defaults and a declared search space.

A rule's DEFAULTS are what `compile` uses until tuning records exist; SPACE is what luce_compile/tune searches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from tvm.s_tir.dlight.base import ScheduleRule

from luce_compile.errors import UnsupportedError

Knobs = Mapping[str, int]


def fit(extent: int, want: int) -> int:
    """The largest divisor of `extent` not above `want` (a split by it needs no bounds check)."""
    return max(d for d in range(1, min(extent, max(want, 1)) + 1) if extent % d == 0)


class KnobbedRule(ScheduleRule):
    """A dlight ScheduleRule with named knobs."""

    name: ClassVar[str]
    DEFAULTS: ClassVar[dict[str, int]]
    SPACE: ClassVar[dict[str, tuple[int, ...]]]

    def knobs(self, knobs: Knobs | bool | None = None) -> dict[str, int]:
        """DEFAULTS overridden by `knobs` (a bool is dlight's `tunable` flag and means defaults)."""
        given = dict(knobs) if isinstance(knobs, Mapping) else {}
        unknown = set(given) - set(self.DEFAULTS)
        if unknown:
            raise UnsupportedError(f"schedules: {self.name} has no knob(s) {sorted(unknown)}; "
                                   f"its knobs are {sorted(self.DEFAULTS)}")
        return self.DEFAULTS | given
