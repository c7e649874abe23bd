"""README's flag lists, generated from the CLI's own argparse parsers, so README and `--help` cannot drift apart.

    .venv/bin/python scripts/readme_flags.py           # print every block
    .venv/bin/python scripts/readme_flags.py --write   # rewrite the blocks in README.md in place
    .venv/bin/python scripts/readme_flags.py --check   # exit 1 when README.md is out of step (tests/test_readme.py)

A block sits in README between `<!-- flags:NAME -->` and `<!-- /flags -->`: NAME is a luce-compile subcommand, or
`luce-compile` for the options every subcommand takes. luce-runtime's `run` and `serve` are built by the same
argument functions (runtime/luce_runtime/cli.py), so they get no blocks of their own; the test checks they match.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- flags:([\w-]+) -->\n)(.*?)(<!-- /flags -->)", re.S)
WIDTH = 118  # README's prose width
MARKUP = re.compile(r"`[^`]*`|[<*]")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """NAME → the subcommand's parser, in the order the CLI defines them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def invocation(action: argparse.Action) -> str:
    """`--target TARGET`, `-o, --output OUTPUT`, `MODEL`, `--fetch [NAME ...]`: how a user writes the argument."""
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.metavar or action.dest.upper()
    if not action.option_strings:
        return {"?": f"[{metavar}]", "*": f"[{metavar} ...]", "+": f"{metavar} [{metavar} ...]"}.get(action.nargs,
                                                                                                    metavar)
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    value = {"?": f"[{metavar}]", "*": f"[{metavar} ...]", "+": f"{metavar} [{metavar} ...]"}.get(action.nargs,
                                                                                                   metavar)
    return f"{flags} {value}"


def describe(action: argparse.Action, prog: str) -> str:
    """The help text as --help prints it (%-expanded), plus the default where the help does not name one."""
    text = (action.help or "") % dict(vars(action), prog=prog) if action.help else ""
    default = action.default
    if (action.option_strings and action.nargs != 0 and default not in (None, [], argparse.SUPPRESS)
            and "default" not in text.lower()):
        text = f"{text} (default {default})" if text else f"default {default}"
    if action.required and action.option_strings:
        text = f"required; {text}" if text else "required"
    # outside code spans, `<target>` would be read as an HTML tag and `*` as emphasis
    return MARKUP.sub(lambda m: m[0] if m[0].startswith("`") else "\\" + m[0], text)


def flags_markdown(parser: argparse.ArgumentParser) -> str:
    """One bullet per argument (help and version left out), wrapped at README's width."""
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
            continue
        text = describe(action, parser.prog)
        item = f"- `{invocation(action)}`" + (f": {text}" if text else "")
        lines += textwrap.wrap(item, WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines) + "\n"


def blocks() -> dict[str, str]:
    """Block NAME → its generated markdown: luce-compile's own options, then each subcommand's."""
    from luce_compile.cli import build_parser

    parser = build_parser()
    return {"luce-compile": flags_markdown(parser),
            **{name: flags_markdown(s) for name, s in subcommands(parser).items()}}


def render(readme: str, generated: dict[str, str]) -> str:
    """README with every flags block replaced by its generated text; a block naming no command is an error."""
    def replace(m: re.Match) -> str:
        if m.group(2) not in generated:
            raise KeyError(f"README has a flags block for {m.group(2)!r}, which is no luce-compile command "
                           f"(known: {', '.join(generated)})")
        return m.group(1) + generated[m.group(2)] + m.group(4)

    return BLOCK.sub(replace, readme)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite README.md's flags blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's flags blocks are out of step")
    args = p.parse_args(argv)
    generated = blocks()
    if not (args.write or args.check):
        for name, text in generated.items():
            print(f"<!-- flags:{name} -->\n{text}<!-- /flags -->\n")
        return 0
    readme = README.read_text()
    updated = render(readme, generated)
    if args.write:
        README.write_text(updated)
        return 0
    if updated != readme:
        print("README.md's flags blocks differ from the CLI: run .venv/bin/python scripts/readme_flags.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
