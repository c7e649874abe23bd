"""Fixtures of the codegen tests (tiny compiled models) for the benchmark scripts' tests."""

from tests.codegen.conftest import compiled, engine_of, oracle_of, tiny  # noqa: F401  (fixtures)
