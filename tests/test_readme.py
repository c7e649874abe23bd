"""README is a reference a user scans (issue 41.3): its flag lists are the CLI's own help, regenerated here and
compared; its targets table says what `luce-compile targets` says; no table row is too long to read in a diff."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIX = ".venv/bin/python scripts/readme_flags.py --write"
MAX_ROW = 200  # characters: a longer row is a paragraph that belongs in prose or benchmarks/README.md


def load_readme_flags():
    """scripts/ is a folder of scripts, not a package: load the generator by path."""
    spec = importlib.util.spec_from_file_location("readme_flags", ROOT / "scripts" / "readme_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_has_a_flags_block():
    generated = load_readme_flags().blocks()
    in_readme = re.findall(r"<!-- flags:([\w-]+) -->", README)
    missing = [name for name in generated if name not in in_readme]
    assert not missing, f"README has no <!-- flags:NAME --> block for {missing}: add the markers, then run {FIX}"
    assert len(in_readme) == len(set(in_readme)), "README has a flags block twice"


def test_the_flags_blocks_are_the_clis_help():
    readme_flags = load_readme_flags()
    generated = readme_flags.blocks()
    for m in readme_flags.BLOCK.finditer(README):
        name, text = m.group(2), m.group(3)
        assert name in generated, f"README's flags block {name!r} names no luce-compile command"
        assert text == generated[name], f"README's flags for `{name}` differ from its --help: run {FIX}"


def options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    """Each option's flags → what --help says of it (its help, choices, default)."""
    return {", ".join(a.option_strings): (a.help, a.choices, a.default, a.nargs) for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


@pytest.mark.parametrize("command", ["run", "serve"])
def test_luce_runtime_takes_luce_compiles_flags(command):
    """README documents luce-runtime's run and serve as luce-compile's with the same flags (serve less --target and
    --kv-cache, which only compile a GGUF): true while both CLIs build them from runtime/luce_runtime/cli.py's
    argument functions."""
    from luce_runtime.cli import build_parser as runtime_parser

    from luce_compile.cli import build_parser as compile_parser

    subcommands = load_readme_flags().subcommands
    ours = options(subcommands(compile_parser())[command])
    ours.pop("--target", None)
    ours.pop("--kv-cache", None)
    assert options(subcommands(runtime_parser())[command]) == ours
    assert "luce-runtime run" in README and "luce-runtime serve" in README


def test_no_table_row_is_too_long():
    long_rows = [(n, len(line)) for n, line in enumerate(README.splitlines(), 1)
                 if line.startswith("|") and len(line) > MAX_ROW]
    assert not long_rows, f"README table rows over {MAX_ROW} characters (line, length): {long_rows}; move the " \
                          "detail to prose or benchmarks/README.md"


def test_the_targets_table_says_what_targets_says():
    """A row per target, `| `name` | hardware | status | ...`, with the status `luce-compile targets` prints."""
    from luce_compile.targets import TARGETS

    rows = dict(re.findall(r"^\| `([\w,]+)` \| [^|]+ \| (\w+) \|", README, re.M))
    assert rows == {t.name: t.status for t in TARGETS.values()}, "README's targets table and `luce-compile " \
                                                                 "targets` differ: update the table"
