"""The compiled tiny models of tests/codegen, for the runtime tests that need a real engine (one compile per session,
cached across sessions by compile_model)."""

from tests.codegen.conftest import compiled, engine_of, oracle_of, tiny  # noqa: F401  (fixtures)
