"""Schedule rules per op family and target family, importable as luce_schedules (one file per op family)."""
