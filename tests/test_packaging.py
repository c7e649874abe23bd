"""The package list in pyproject.toml is explicit (schedules/ and runtime/ are mapped to other names): keep it whole."""

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"luce_compile": ROOT / "luce_compile"} | {k: ROOT / v for k, v in setuptools["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(setuptools["packages"]), "add the missing package(s) to [tool.setuptools] packages"


@pytest.mark.unit
def test_runtime_never_imports_the_compiler():
    for path in (ROOT / "runtime").rglob("*.py"):
        text = path.read_text()
        assert "import luce_compile" not in text and "from luce_compile" not in text, path


# Folder names that build tools and test runners take for their own output and skip or delete: pytest's default
# norecursedirs skipped the tests of a stage once named build (issue 10), and generic tooling ignores such folders.
TOOL_OWNED_NAMES = {"build", "dist", "venv", "node_modules", "site-packages"}


@pytest.mark.unit
def test_no_source_or_test_folder_has_a_name_tools_own():
    bad = [p.relative_to(ROOT) for top in ("luce_compile", "runtime", "schedules", "tests")
           for p in (ROOT / top).rglob("*") if p.is_dir() and p.name in TOOL_OWNED_NAMES]
    assert not bad, f"rename these folders (tools skip or delete folders of these names): {bad}"
