"""tests/conftest.py keeps `pytest -m unit` fast: a unit test that needs a real model fails, whichever way it asks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

INNER = '''
import pytest


@pytest.mark.unit
def test_fixture(smollm2_path):
    pass


@pytest.fixture
def artifact(smollm2_path):
    return smollm2_path


@pytest.mark.unit
def test_through_a_fixture(artifact):
    pass


@pytest.mark.unit
def test_by_name(request):
    request.getfixturevalue("gemma3_path")


@pytest.mark.unit
def test_download():
    from luce_compile.models import fetch

    fetch("qwen2.5-coder-1.5b")


@pytest.mark.unit
@pytest.mark.slow
def test_both_marks():
    pass


@pytest.mark.unit
def test_plain():
    pass


@pytest.mark.slow
def test_slow_may_fetch():
    from luce_compile.models import fetch

    assert fetch.__module__ == "luce_compile.models"
'''


@pytest.mark.slow  # a pytest subprocess that imports TVM (~8 s): too slow for the -m unit run it guards
def test_unit_tests_that_need_a_real_model_fail(pytester: pytest.Pytester, monkeypatch, tmp_path: Path):
    # SmolLM2 "cached" (so its fixture would not download: only the fixture check can refuse it), nothing else
    monkeypatch.setenv("LUCE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    pytester.makeini("[pytest]\nmarkers =\n    unit: u\n    slow: s\naddopts = --strict-markers\n")
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    outcomes = {line.split()[1].split("::")[-1]: line.split()[0] for line in result.outlines
                if line.startswith(("PASSED", "FAILED", "ERROR"))}
    assert outcomes == {"test_fixture": "ERROR", "test_through_a_fixture": "ERROR", "test_by_name": "FAILED",
                        "test_download": "FAILED", "test_both_marks": "ERROR", "test_plain": "PASSED",
                        "test_slow_may_fetch": "PASSED"}
    result.stdout.fnmatch_lines(["*test_download is marked unit but downloads the real model 'qwen2.5-coder-1.5b'*"])
