"""A GPU target on a machine without its toolchain fails fast, saying how to get it (issue 10.3).

The lean install (scripts/install.sh) has no nvcc, lld, LLVM tools or ROCm device libraries. `compile --target
gfx1201` used to fetch the model, read it and lower every op before the ROCm build found ld.lld missing; now the
CLI checks first. The tools are hidden here by pointing the lookups at nothing, whatever this machine has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from luce_compile import cli
from luce_compile.codegen import gpu_toolchain

pytestmark = pytest.mark.unit


@pytest.fixture()
def bare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU tools on PATH, in the CUDA/ROCm folders or in pip packages; no driver."""
    from tvm.support import rocm as tvm_rocm

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(gpu_toolchain, "ROCM_PATH_CANDIDATES", ())
    monkeypatch.setattr(gpu_toolchain, "find_tool", lambda name, extra_dirs=(): None)
    monkeypatch.setattr(gpu_toolchain, "_loads", lambda library: False)
    monkeypatch.setattr(tvm_rocm, "find_lld", lambda required=False: None)


@pytest.fixture()
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the CLI gets as far as fetching or compiling the model."""
    monkeypatch.setattr(cli, "resolve_model", lambda model: pytest.fail("resolved the model before the check"))


@pytest.mark.parametrize("target, words", [
    ("gfx1201", ["ld.lld-", "ROCm device libraries", "apt-get install lld-", "rocm-device-libs", "scripts/setup.sh"]),
    ("sm_90", ["nvcc", "cuda-downloads", "cuobjdump", ".[gpu]", "gcc"]),
])
def test_compile_for_a_gpu_fails_fast_and_says_how_to_get_the_toolchain(target, words, bare_machine, no_work,
                                                                         tmp_path, capsys):
    code = cli.main(["compile", "smollm2-135m", "--target", target, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert f"--target {target} needs a GPU toolchain" in err and "--target cpu" in err
    for word in words:
        assert word in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_bench_and_serve_of_a_gguf_for_a_gpu_fail_fast_too(command, bare_machine, no_work, capsys):
    code = cli.main([command, "smollm2-135m", "--target", "gfx1201"])
    err = capsys.readouterr().err
    assert code == 2 and "--target gfx1201 needs a GPU toolchain" in err and "rocm-device-libs" in err


def test_the_cpu_needs_no_toolchain(bare_machine):
    assert gpu_toolchain.missing_gpu_tools("llvm") == []


def test_nothing_is_missing_where_setup_installed_the_toolchain():
    """The test world (scripts/setup.sh) installs every GPU tool, and tests/codegen/test_gpu_targets.py builds with
    them: the check must not refuse a toolchain that works."""
    assert gpu_toolchain.missing_gpu_tools("cuda") == []
    assert gpu_toolchain.missing_gpu_tools("rocm") == []
