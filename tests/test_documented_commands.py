"""Every command README documents, run as a user types it: only its required arguments, every default left alone.

The commands come from README itself (the set-up blocks and the command table), so a documented command cannot go
untested: `luce-compile bench ART` crashed with its defaults while every test passed --prefill-lens (issue 10.2).
Placeholders become a tiny synthetic model (MODEL) and its artifact (ART); a real model name in the set-up command
becomes the synthetic one, so the whole file runs in well under a minute once the tiny model is compiled.
"""

from __future__ import annotations

import json
import re
import shlex
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from luce_compile.cli import main
from luce_compile.models import REAL_MODELS
from tests.serve.process import serve_process

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MODEL = "synthetic:tiny-llama"  # a documented MODEL form: resolved (and written once) into the synthetic cache
TEXT = "The capital of France is"


def setup_blocks() -> list[str]:
    """README's first two bash blocks (the main job, the tests), each as one command line."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", README, re.S)[:2]
    return [" ".join(line.strip() for line in b.strip().splitlines() if not line.strip().startswith("#"))
            for b in blocks]


def table_commands() -> dict[str, str]:
    """subcommand → its usage from the command table, plus serve's from its own section."""
    usages = re.findall(r"^\| `(luce-compile [^`]+)` \|", README, re.M)
    usages += re.findall(r"`(luce-compile serve [^`]+)`", README)[:1]
    return {usage.split()[1]: usage for usage in usages}


def required_args(usage: str, art: Path) -> list[str]:
    """The usage's words outside [...], placeholders filled in: `run ART -p TEXT [--chat] -n N` → run ART -p … -n 4."""
    words = re.sub(r"\[[^\]]*\]", " ", usage).split()[1:]
    fill = {"MODEL": MODEL, "ART": str(art), "ART|MODEL": str(art), "TEXT": TEXT, "T": "cpu", "N": "4"}
    return [fill.get(w.replace("\\|", "|"), w) for w in words]  # the table escapes | as \|


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's artifact, compiled (or copied from the compile cache) through the CLI once for this file."""
    out = tmp_path_factory.mktemp("documented") / "tiny.cpu"
    assert main(["compile", MODEL, "--target", "cpu", "-o", str(out)]) == 0
    return out


@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # commands write their default outputs (compile, pack) into the working folder
    return tmp_path


def run_cli(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, f"luce-compile {shlex.join(args)} exited {code}: {err}"
    return out, err


def test_readme_documents_every_subcommand():
    parser_commands = set(re.findall(r"^    s = sub\.add_parser\(\"(\w+)\"", (ROOT / "luce_compile/cli.py").read_text(),
                                     re.M))
    assert parser_commands, "cli.py's subcommands were not found; update this test with the parser"
    assert parser_commands == set(table_commands()), "README's command table and the CLI's subcommands differ"


def test_the_main_job_command(in_tmp: Path, capsys):
    """README's first block: the install script it names exists; the luce-compile steps run as written, on the
    tiny model in place of the real one."""
    steps = [s.strip() for s in setup_blocks()[0].split("&&")]
    ran = []
    for step in steps:
        words = shlex.split(step)
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file(), f"README's main job runs {words[1]}, which does not exist"
            continue
        assert Path(words[0]).name == "luce-compile", f"unexpected step in README's main job: {step}"
        args = [MODEL if w in REAL_MODELS else w for w in words[1:]]
        out, err = run_cli(capsys, args)
        ran.append((args[0], out, err))
    assert [name for name, *_ in ran] == ["compile", "run"]
    assert (in_tmp / ran[0][1].strip() / "manifest.json").is_file()  # compile prints the artifact it wrote
    assert "generated tokens" in ran[1][2]


def test_the_test_command_is_what_ci_runs():
    tests = setup_blocks()[1]
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text(), ".ci/run must run README's test command as written"


def test_models(capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["models"], Path()))
    assert all(name in out for name in REAL_MODELS)


def test_inspect(capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["inspect"], Path()))
    assert "arch llama" in out and "tensors:" in out


def test_tokenize(capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["tokenize"], Path()))
    ids = [int(line.split()[0]) for line in out.splitlines()]
    assert len(ids) >= 5 and all(0 <= i < 49152 for i in ids)


def test_targets(capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["targets"], Path()))
    assert re.search(r"^cpu\s+measured", out, re.M)


def test_compile_to_its_default_folder(in_tmp: Path, capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["compile"], Path()))
    art = Path(out.strip())
    assert art.parent == Path(".") and art.name.endswith(".cpu")  # <model>.<target> in the working folder
    assert json.loads((in_tmp / art / "manifest.json").read_text())["target"]["name"] == "cpu"


def test_tune(in_tmp: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    """The documented usage with a short search (its defaults search for 15 minutes), into a logs folder of its own
    ($LUCE_TUNE_LOGS: never the shipped autotune_logs/); compile then reports the records it took."""
    monkeypatch.setenv("LUCE_TUNE_LOGS", str(in_tmp / "logs"))
    out, err = run_cli(capsys, [*required_args(table_commands()["tune"], Path()), "--trials", "2", "--minutes", "0.5"])
    log = Path(out.split(":")[0])
    # CPU records go to a folder per int8 level (cpu-avx2, cpu-avx512vnni, ...): tune/records.py records_folder
    assert log.parent.parent == in_tmp / "logs" and re.fullmatch(r"cpu-[\w-]+", log.parent.name)
    assert log.suffix == ".jsonl" and "[1/" in err
    assert all(json.loads(line)["knobs"] for line in log.read_text().splitlines())
    _, err = run_cli(capsys, ["compile", MODEL, "--target", "cpu", "-o", "tuned.cpu"])
    assert re.search(r"kernels: [1-9]\d* tuned from .*\.jsonl", err)


def test_run(art: Path, capsys):
    _, err = run_cli(capsys, required_args(table_commands()["run"], art))
    assert re.search(r"\[runtime: \d+ prompt \+ 4 generated tokens", err)


def test_bench_with_its_defaults(art: Path, capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["bench"], art))
    assert re.search(r"prefill [\d.]+ tok/s \(pp128\)", out) and "% of roofline" in out


def test_runtime_bench_with_its_defaults(art: Path, capsys):
    """`python -m luce_runtime.bench ART`, documented beside luce-compile bench."""
    assert "python -m luce_runtime.bench ART" in README
    from luce_runtime.bench import main as runtime_bench

    assert runtime_bench([str(art)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_len"] == 128 and result["decode_tok_s"] > 0


def test_pack(art: Path, in_tmp: Path, capsys):
    out, _ = run_cli(capsys, required_args(table_commands()["pack"], art))
    packed = in_tmp / out.strip()
    assert packed.name == "tiny.cpu.luce"
    with tarfile.open(packed) as tar:
        assert tar.getnames()[0] == "manifest.json"


def test_generate(capsys):
    _, err = run_cli(capsys, required_args(table_commands()["generate"], Path()))
    assert re.search(r"\[oracle: \d+ prompt \+ \d+ generated tokens", err)


@pytest.fixture()
def served(art: Path) -> Iterator[str]:
    """`luce-compile serve ART` with its defaults in a subprocess; only the port is chosen, so that parallel test
    runs on one machine do not collide on 8000. (tests/serve always passes --max-batch and --ctx.)"""
    args = required_args(table_commands()["serve"], art)
    assert args == ["serve", str(art)]
    with serve_process(args) as (url, _proc, _health):
        yield url


def test_serve_with_its_defaults(served: str):
    model = json.loads(urllib.request.urlopen(served + "/v1/models", timeout=10).read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": TEXT, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(served + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert reply["usage"]["completion_tokens"] >= 1 and isinstance(reply["choices"][0]["text"], str)
