"""`luce-compile compile -o DIR` never deletes what the project did not write (issue 10.1).

Before the fix, an existing DIR was removed whatever it held (a user's notes included) and replaced by the artifact;
`--force` did not exist. Now: anything that is not an artifact is refused, --force or not; an artifact is replaced
only with --force, through a sibling folder swapped into place. The tiny model is compiled once per session (then
copied from the compile cache), so each CLI call here is a copy, not a compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from luce_compile.cli import main
from luce_compile.errors import ArtifactError

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gguf(tiny) -> Path:
    return tiny("tiny-llama").gguf  # compiled once: later compiles of it are copies from the cache


def compile_cli(capsys: pytest.CaptureFixture, gguf: Path, out: Path, *flags: str) -> tuple[int, str]:
    code = main(["compile", str(gguf), "-o", str(out), *flags])
    return code, capsys.readouterr().err


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir())


def test_a_users_folder_survives_and_the_command_says_what_to_do(gguf, tmp_path, capsys):
    notes = tmp_path / "work"
    notes.mkdir()
    (notes / "notes.txt").write_text("three weeks of notes")
    for flags in ((), ("--force",)):  # --force replaces artifacts only
        code, err = compile_cli(capsys, gguf, notes, *flags)
        assert code != 0
        assert "not an artifact" in err and "another -o" in err and len(err.strip().splitlines()) == 1
        assert [p.name for p in notes.iterdir()] == ["notes.txt"]
        assert (notes / "notes.txt").read_text() == "three weeks of notes"
    assert siblings(notes) == ["work"]  # no staging folder left beside it


def test_a_folder_with_someone_elses_manifest_is_not_an_artifact(gguf, tmp_path, capsys):
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text(json.dumps({"name": "my web app", "version": 3}))
    code, err = compile_cli(capsys, gguf, app, "--force")
    assert code != 0 and "not an artifact" in err
    assert json.loads((app / "manifest.json").read_text())["name"] == "my web app"


def test_a_file_at_the_destination_is_refused(gguf, tmp_path, capsys):
    target = tmp_path / "model.cpu"
    target.write_text("not a folder")
    code, err = compile_cli(capsys, gguf, target, "--force")
    assert code != 0 and "not an artifact" in err and target.read_text() == "not a folder"


def test_an_artifact_is_replaced_only_with_force(gguf, tmp_path, capsys):
    art = tmp_path / "model.cpu"
    code, err = compile_cli(capsys, gguf, art)
    assert code == 0, err
    assert json.loads((art / "manifest.json").read_text())["format"] == "luce-artifact"
    (art / "marker").write_text("from the first compile")  # still an artifact: its manifest says so

    code, err = compile_cli(capsys, gguf, art)
    assert code != 0 and "already exists" in err and "--force" in err
    assert (art / "marker").is_file()  # untouched without --force

    code, _ = compile_cli(capsys, gguf, art, "--force")
    assert code == 0
    assert not (art / "marker").exists() and (art / "manifest.json").is_file()  # replaced by a fresh copy
    assert siblings(art) == ["model.cpu"]  # the old copy and the staging folder are gone


def test_an_empty_folder_made_ahead_is_filled(gguf, tmp_path, capsys):
    out = tmp_path / "made-ahead"
    out.mkdir()
    code, _ = compile_cli(capsys, gguf, out)
    assert code == 0 and (out / "manifest.json").is_file()


def test_a_sibling_named_like_the_old_staging_folder_survives(gguf, tmp_path, capsys):
    """The old copy staged through DIR.tmp and deleted whatever was there first."""
    mine = tmp_path / "model.cpu.tmp"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    code, _ = compile_cli(capsys, gguf, tmp_path / "model.cpu")
    assert code == 0 and (mine / "keep.txt").read_text() == "mine"


def test_a_failed_copy_leaves_the_old_artifact_in_place(gguf, tmp_path, monkeypatch):
    from luce_compile.codegen import compile as codegen

    art = codegen.compile_model(gguf, "cpu", tmp_path / "model.cpu")
    before = (art / "manifest.json").read_bytes()

    def broken_copy(src, dst, *args, **kwargs):
        Path(dst).mkdir()
        (Path(dst) / "half").write_text("partial")
        raise OSError("disk full")

    monkeypatch.setattr(codegen.shutil, "copytree", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        codegen.compile_model(gguf, "cpu", art, overwrite=True)
    assert (art / "manifest.json").read_bytes() == before and not (art / "half").exists()
    assert siblings(art) == ["model.cpu"]


def test_the_library_refuses_before_compiling(tmp_path, monkeypatch):
    """compile_model checks the destination first: no hashing, no lowering, no minutes lost."""
    from luce_compile.codegen import compile as codegen

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    monkeypatch.setattr(codegen, "file_sha256", lambda _p: pytest.fail("hashed before checking the destination"))
    with pytest.raises(ArtifactError, match="not an artifact"):
        codegen.compile_model(tmp_path / "missing.gguf", "cpu", tmp_path / "out")


def test_a_cached_build_pruned_while_it_is_copied_is_built_again(gguf, tmp_path, monkeypatch):
    """Two compiles sharing the cache: one can prune (KEEP_CACHED) the entry the other is copying from. The copy
    fails before anything reaches -o, and compile builds the model instead of failing (seen once, 2026-12-02, as a
    test failing while a device_check prepare compiled in parallel)."""
    import shutil

    import luce_compile.codegen.compile as compile_module

    real = compile_module._copy_tree
    monkeypatch.setenv("LUCE_CACHE", str(tmp_path / "cache"))  # a cache of this test's own
    compile_module.compile_model(gguf, "cpu", tmp_path / "first")

    def pruned_meanwhile(src: Path, dst: Path, overwrite: bool, move: bool = False) -> None:
        if "artifacts" in src.parts:  # the reuse: the other compile removes the entry under it
            shutil.rmtree(src)
            raise FileNotFoundError(src)
        real(src, dst, overwrite, move=move)

    monkeypatch.setattr(compile_module, "_copy_tree", pruned_meanwhile)
    messages: list[str] = []
    out = compile_module.compile_model(gguf, "cpu", tmp_path / "second", progress=messages.append)
    assert json.loads((out / "manifest.json").read_text())["target"]["name"] == "cpu"
    assert any("went away" in m for m in messages)


def test_a_build_is_written_once_without_the_cache_and_twice_with_it(gguf, tmp_path, monkeypatch):
    """compile moves the finished build to -o (no cache) or into the cache after copying it to -o: a 17 GB artifact
    takes one or two times its size on disk, not two or three."""
    import shutil

    import luce_compile.codegen.compile as compile_module

    monkeypatch.setenv("LUCE_CACHE", str(tmp_path / "cache"))
    copies: list[Path] = []
    real = shutil.copytree
    def counted(src, dst, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202  (shutil's signature)
        copies.append(Path(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copytree", counted)
    compile_module.compile_model(gguf, "cpu", tmp_path / "alone", use_cache=False)
    assert copies == []
    compile_module.compile_model(gguf, "cpu", tmp_path / "cached", use_cache=True, overwrite=True)
    assert len(copies) == 1 and copies[0].name == "cached"
    cached = list((tmp_path / "cache" / "artifacts").iterdir())
    assert [p.name for p in cached if (p / "manifest.json").is_file()]  # the build itself, moved there
    assert (tmp_path / "alone" / "weights.bin").read_bytes() == (tmp_path / "cached" / "weights.bin").read_bytes()
