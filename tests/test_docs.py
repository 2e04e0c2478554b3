"""Every shell command in README.md and docs/*.md names things that exist, as written.

The ```bash / ```sh / ```console blocks are read command by command (a console block: its `$ `
lines) and each command is checked without running anything:

- `python main.py ...`, `torchrun ... main.py ...`, `srun ... python main.py ...`, `acco-train ...`:
  the overrides are composed with `acco.config.compose`, so an unknown group, option or key, or a
  value of the wrong type, fails;
- `acco-prepare ...`: its flags by its own parser, its overrides composed;
- `acco-bench ...`: its argparse parser (found through pyproject's entry point) parses the
  arguments: an unknown subcommand, flag or method fails;
- `make X`: X is a target of the Makefile;
- `python -m pytest PATH[::TEST]`, `python -m MODULE`, `sbatch FILE`, `bash FILE`: the file, test or
  module exists;
- any argument that points into the repository (acco/, acco_bench/, tests/, examples/, docs/, tools/)
  exists.

A program the checker does not know fails too: teach it here rather than let a command go
unchecked. Links and repository paths in the prose are checked by the second test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import sys
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
REPO_DIRS = ("acco/", "acco_bench/", "tests/", "examples/", "docs/", "tools/")
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}


# --------------------------------------------------------------------------- reading the docs


def shell_blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line number of the first line, language, lines) of every shell code block in `path`."""
    blocks, current = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"\s*```\s*([\w-]*)", line)
        if fence and current is None:
            current = (n + 1, fence.group(1).lower(), [])
        elif fence:
            if current[1] in SHELL_LANGS:
                blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    return blocks


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """("FILE:LINE", argv) for every command of every shell block in `path`; `a && b`, `a; b` and
    `a | b` are two commands, a trailing backslash continues a line, `# ...` is a comment."""
    out = []
    for first, lang, lines in shell_blocks(path):
        pending, start = "", first
        for n, line in enumerate(lines, first):
            if lang == "console":
                if not line.lstrip().startswith("$ ") and not pending:
                    continue  # output
                line = line.lstrip()[2:] if not pending else line
            if not pending:
                start = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending = pending + line, ""
            tokens = shlex.split(text, comments=True)
            argv: list[str] = []
            for tok in tokens + [";"]:
                if tok in (";", "&&", "||", "|"):
                    if argv:
                        out.append((f"{path.relative_to(ROOT)}:{start}", argv))
                    argv = []
                else:
                    argv.append(tok)
    return out


# --------------------------------------------------------------------------- the checks


def entry_point(name: str):
    """The function pyproject's [project.scripts] runs for `name`."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    found = re.search(rf'^{re.escape(name)}\s*=\s*"([^"]+)"', scripts, re.M)
    assert found, f"pyproject.toml has no [project.scripts] entry {name}"
    module, _, func = found.group(1).partition(":")
    return importlib.import_module(module), func


@cache
def _compose(overrides: tuple[str, ...]) -> str | None:
    from acco.config import compose

    try:
        compose(list(overrides))
    except Exception as e:  # InputError: one line saying what is wrong
        return f"{type(e).__name__}: {e}"
    return None


def check_overrides(args: list[str]) -> str | None:
    if any(a.startswith("-") for a in args):
        return f"Hydra flags are not checked here: {' '.join(a for a in args if a.startswith('-'))}"
    names = [a.split("=", 1)[0] for a in args]
    key = (
        tuple(sorted(args)) if len(set(names)) == len(names) else tuple(args)
    )  # order-free unless a key repeats
    return _compose(key)


class _Parsed(BaseException):
    """Raised by the patched parse_args: the arguments parsed, stop before the command runs."""


def check_argparse_main(name: str, args: list[str]) -> str | None:
    """Run the entry point of `name` up to its argparse parse_args, which must accept `args`."""
    module, func = entry_point(name)
    main = getattr(module, func)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    err = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        mock.patch.object(sys, "argv", [name, *args]),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            main(args) if inspect.signature(main).parameters else main()
        except _Parsed:
            return None
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else "argparse exited"
    return f"{name}'s entry point returned without parsing its arguments"


def check_prepare(args: list[str]) -> str | None:
    module, _ = entry_point("acco-prepare")
    try:
        _, overrides = module.parse_args(args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return check_overrides(overrides)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?!=)", text, re.M)}


def check_pytest(args: list[str]) -> str | None:
    paths = [a for a in args if not a.startswith("-")]
    if not paths:
        return "pytest with no test file"
    for p in paths:
        file, _, test = p.partition("::")
        if not (ROOT / file).exists():
            return f"no file {file}"
        if test and not re.search(
            rf"^\s*def {re.escape(test.split('[')[0])}\(", (ROOT / file).read_text(), re.M
        ):
            return f"no test {test} in {file}"
    return None


def check_python(args: list[str]) -> str | None:
    if args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    if args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        if importlib.util.find_spec(module) is None:
            return f"no module {module}"
        return check_overrides(args[2:]) if module == "acco.cli" else None
    if not args:
        return "python with nothing to run"
    script, rest = args[0], args[1:]
    if not (ROOT / script).exists():
        return f"no file {script}"
    return check_overrides(rest) if script == "main.py" else None


def _after_options(args: list[str], stop) -> list[str]:
    """`args` from the first token `stop` accepts (a launcher's options come before the program)."""
    for i, a in enumerate(args):
        if stop(a):
            return args[i:]
    return []


def check_command(argv: list[str]) -> str | None:
    """None if the command names things that exist, else why not."""
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value before a command
        argv = argv[1:]
    if not argv:
        return None
    for a in argv:  # arguments that point into the repository
        path = a.split("=", 1)[-1].split("::")[0]
        if path.startswith(REPO_DIRS) and not any(c in path for c in "*<$") and not (ROOT / path).exists():
            return f"no such file or folder: {path}"
    prog, args = argv[0], argv[1:]
    if prog in PYTHONS:
        return check_python(args)
    if prog == "make":
        targets = makefile_targets()
        missing = [t for t in args if not t.startswith("-") and "=" not in t and t not in targets]
        return (
            f"no make target {', '.join(missing)} (targets: {', '.join(sorted(targets))})"
            if missing
            else None
        )
    if prog == "torchrun":
        rest = _after_options(args, lambda a: a.endswith(".py") or a == "-m")
        return check_python(rest) if rest else "torchrun runs nothing"
    if prog == "srun":
        rest = _after_options(args, lambda a: a in PYTHONS or a.startswith("acco-"))
        return check_command(rest) if rest else "srun runs nothing"
    if prog == "acco-train":
        return check_overrides(args)
    if prog == "acco-prepare":
        return check_prepare(args)
    if prog == "acco-bench":
        return check_argparse_main("acco-bench", args)
    if prog in ("sbatch", "bash"):
        files = [a for a in args if not a.startswith("-")]
        return None if files and (ROOT / files[0]).is_file() else f"no script {files[:1]}"
    return f"the docs test does not know the program {prog!r}: teach tests/test_docs.py to check it"


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_command_names_what_exists(doc):
    found = commands(doc)
    if doc.name == "README.md":
        assert len(found) >= 5, f"only {len(found)} commands read from README.md: is the block reader broken?"
    failures = [
        f"{where}: {shlex.join(argv)}\n    -> {why}" for where, argv in found if (why := check_command(argv))
    ]
    assert not failures, "commands in the docs that would not run as written:\n" + "\n".join(failures)


def test_links_and_repository_paths_in_the_prose_exist():
    failures = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):  # [text](path) and ![alt](path)
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                failures.append(f"{doc.relative_to(ROOT)}: link to {target}")
        for m in re.finditer(r"`([A-Za-z0-9_./-]+)`", text):  # `acco/engine/comm.py` and the like
            path = m.group(1).split("::")[0]
            if path.startswith(REPO_DIRS) and not (ROOT / path).exists():
                failures.append(f"{doc.relative_to(ROOT)}: `{path}`")
    assert not failures, "paths the docs name that do not exist:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    "command",
    [
        "python main.py train=acco train.lerning_rate=1e-3",  # a typo'd key
        "torchrun --nproc-per-node 8 main.py train=acco model=gptneo-126m",  # a typo'd option
        "srun --kill-on-bad-exit=1 python main.py trian=acco",  # a typo'd group
        "acco-prepare train=acco data=text data.pth=corpus.txt",
        "acco-prepare --num-procs 2 train=acco",
        "acco-bench clustr --out outputs/bench/cluster",
        "acco-bench cluster --bandwith 100mbit",
        "acco-bench race --methods ddp,acco,dilocco",
        "make tset",
        ".venv/bin/python -m pytest -q tests/test_cuda_one_gpu.py::test_no_such_test",
        "sbatch examples/slurm_alpaca.sh",
        "python main.py train=acco train.resume_from_checkpoint=latest acco/conf/train/nope.yaml",
        "frobnicate --all",
    ],
)
def test_the_checker_fails_on_a_typo(command):
    assert check_command(shlex.split(command)) is not None, command


def test_the_checker_passes_the_same_commands_spelt_right():
    for command in [
        "python main.py train=acco train.learning_rate=1e-3",
        "acco-bench cluster --bandwidth 100mbit",
        "make test",
        "sbatch examples/slurm_alpaca.sbatch",
    ]:
        assert check_command(shlex.split(command)) is None, command


def ci_commands(run: Path) -> list[list[str]]:
    """The commands a CI script runs, less its shell set-up (`set`, `cd`)."""
    argvs = [shlex.split(line, comments=True) for line in run.read_text().splitlines()]
    return [argv for argv in argvs if argv and argv[0] not in ("set", "cd")]


def test_ci_runs_the_test_commands_the_readme_gives():
    """.ci/run, on a clean clone, runs exactly the README's test commands, in its order."""
    tests = (["make", "test"], ["make", "test-slow"])
    readme_tests = [argv for _, argv in commands(ROOT / "README.md") if argv in tests]
    assert readme_tests == [["make", "test"], ["make", "test-slow"]], readme_tests
    assert ci_commands(ROOT / ".ci" / "run") == readme_tests



def test_the_glossary_gives_every_counting_key_its_unit():
    """Every train key that counts something (an integer, or acco's cap and split) has a row in
    docs/training.md's glossary saying what it counts: the seed's names (nb_steps_tot, warmup) count
    micro-batches where n_warmup_steps counts updates, and only the glossary says which."""
    import dataclasses
    import typing

    from acco.config import TrainArgs

    text = (ROOT / "docs" / "training.md").read_text()
    glossary = text.split("## Glossary: what counts micro-batches and what counts updates", 1)[1]
    glossary = glossary.split("\n## ", 1)[0]
    named = set(re.findall(r"^\| (.+?) \|", glossary, re.M))
    rows = {key for cell in named for key in re.findall(r"`(\w+)`", cell)}
    hints = typing.get_type_hints(TrainArgs)
    integers = {name for name, hint in hints.items() if int in (hint, *typing.get_args(hint))}
    # seed is a number, not a count
    counting = ({f.name for f in dataclasses.fields(TrainArgs)} & integers) - {"seed"}
    counting |= {"accumulate_cap", "estimate_micro_batches"}
    assert counting <= rows, f"no glossary row for {sorted(counting - rows)}"
