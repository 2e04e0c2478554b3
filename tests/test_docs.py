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
- `python -m pytest PATH[::TEST]`, `python -m MODULE`, `sbatch FILE`: the file, test or module exists;
- any argument that points into the repository (acco/, acco_bench/, tests/, examples/, docs/)
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
REPO_DIRS = ("acco/", "acco_bench/", "tests/", "examples/", "docs/")
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
    if prog == "sbatch":
        files = [a for a in args if not a.startswith("-")]
        return None if files and (ROOT / files[0]).is_file() else f"no batch script {files[:1]}"
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


# --------------------------------------------------------------------------- pointers to sections

BENCHMARKS = ROOT / "BENCHMARKS.md"
MARKDOWN = [*DOCS, BENCHMARKS]
# Where prose names a section: the Markdown files and the comments and docstrings of the code.
POINTING = [
    *MARKDOWN,
    ROOT / "main.py",
    *sorted(ROOT.glob("acco/**/*.py")),
    *sorted(ROOT.glob("acco/conf/**/*.yaml")),
    *sorted(ROOT.glob("acco_bench/**/*.py")),
    *sorted(p for p in ROOT.glob("tests/*.py") if p.name != "test_docs.py"),
]
FILE = r"(?P<file>(?:\.\./)?(?:docs/)?[A-Za-z][\w-]*\.md|BENCHMARKS|README)"
# FILE, "Heading" (also FILE's "Heading", [FILE](FILE), "Heading" and FILE, section "Heading")
QUOTED = re.compile(FILE + r"(?:\]\([^)\s]*\))?(?:'s?)?,?\s+(?:section\s+)?\\?\"(?P<name>[^\"\\]{2,80})\\?\"")
# BENCHMARKS.md section 5.0, BENCHMARKS §5.1, and the map's §1.4 labels
NUMBERED = re.compile(
    r"(?:BENCHMARKS(?:\.md)?(?:'s?)?,?\s+(?:sections?\s+|§\s*)|§)"
    r"(?P<number>\d+(?:\.\d+)*)"
)
IN_BENCHMARKS = re.compile(r"\b[Ss]ections?\s+(?P<number>\d+(?:\.\d+)*)")
HISTORY = re.compile(r"History,?\s+\(?\"(?P<name>[^\"]{2,80})\"")  # within BENCHMARKS.md: History, "From 4.1"
LINKED = re.compile(r"\]\((?P<file>[^)\s#]*)#(?P<anchor>[^)\s]+)\)")  # [text](FILE#anchor), [text](#anchor)
ANCHORED = re.compile(
    r"(?P<file>(?:\.\./)?(?:docs/)?[A-Za-z][\w-]*\.md)#(?P<anchor>[\w-]+)"
)  # in code: docs/x.md#anchor
# Files whose pointers into BENCHMARKS.md still go by number (being changed elsewhere; the report of
# the change that named headings says how): each must still name a numbered section that exists.
BY_NUMBER_PENDING: set[str] = set()


def prose(path: Path) -> str:
    """The file's text as one line: comment markers that continue a sentence are dropped."""
    text = path.read_text()
    if path.suffix != ".md":
        text = re.sub(r"\n\s*#\s?", " ", text)
    return re.sub(r"\s+", " ", text)


def _plain(text: str) -> str:
    """A heading or label as a pointer names it: no section number, no markup, lower case."""
    text = re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", text.replace("`", "").replace("*", "").strip())
    return re.sub(r"\s+", " ", text).lower()


@cache
def sections(path: Path) -> tuple[list[str], list[str]]:
    """(headings, bold labels that open a paragraph or list item) of a Markdown file, outside code."""
    heads, labels, fenced = [], [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+)", line)):
            heads.append(m.group(1).strip())
        elif not fenced and (m := re.match(r"\s*(?:[-*]\s+|\d+\.\s+)?\*\*(.+?)\*\*", line)):
            labels.append(m.group(1))
    return heads, labels


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def names(path: Path, name: str) -> bool:
    """Whether a heading or bold label of `path` is `name`, or begins with it (a shortened title)."""
    want = _plain(name)
    for have in map(_plain, [*sections(path)[0], *sections(path)[1]]):
        if have == want or (have.startswith(want) and not have[len(want)].isalnum()):
            return True
    return False


def numbered(number: str) -> bool:
    return any(re.match(rf"{re.escape(number)}\.?\s", h) for h in sections(BENCHMARKS)[0])


def target(source: Path, file: str) -> Path | None:
    if file in ("BENCHMARKS", "README"):
        file += ".md"
    for base in (source.parent, ROOT, ROOT / "docs"):
        if (base / file).is_file():
            return (base / file).resolve()
    return None


def stale_pointers(path: Path) -> list[str]:
    text, found = prose(path), []
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for m in QUOTED.finditer(text):
        doc = target(path, m.group("file"))
        if doc is None or not names(doc, m.group("name")):
            found.append(f'{rel}: {m.group("file")}, "{m.group("name")}": no such heading or section')
    found += [
        f'{rel}: History, "{m.group("name")}": no such part'
        for m in HISTORY.finditer(text)
        if path.suffix == ".md" and not names(path, m.group("name"))
    ]
    numbers = [*NUMBERED.finditer(text), *(IN_BENCHMARKS.finditer(text) if path == BENCHMARKS else [])]
    found += [
        f"{rel}: section {m.group('number')} of BENCHMARKS.md does not exist"
        for m in numbers
        if not numbered(m.group("number"))
    ]
    links = LINKED if path.suffix == ".md" else ANCHORED
    for m in links.finditer(path.read_text()):
        doc = target(path, m.group("file")) if m.group("file") else path
        anchors = map(slug, sections(doc)[0]) if doc is not None and doc.suffix == ".md" else None
        if anchors is None and path.suffix != ".md":
            found.append(f"{rel}: {m.group('file')}#{m.group('anchor')}: no such file")
        elif anchors is not None and m.group("anchor") not in anchors:
            found.append(f"{rel}: link to {m.group('file')}#{m.group('anchor')}: no such heading")
    return found


def test_every_section_a_pointer_names_exists():
    failures = [f for path in POINTING for f in stale_pointers(path)]
    assert not failures, "pointers to sections that do not exist:\n" + "\n".join(failures)


def test_pointers_into_benchmarks_name_headings_not_numbers():
    """Numbers move when sections do: outside BENCHMARKS.md a pointer names the heading."""
    by_number = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in POINTING
        if path != BENCHMARKS and str(path.relative_to(ROOT)) not in BY_NUMBER_PENDING
        for m in NUMBERED.finditer(prose(path))
        if not m.group(0).startswith("§")
    ]
    assert not by_number, "name the heading instead:\n" + "\n".join(by_number)


def test_the_pointer_check_sees_a_stale_pointer(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        '# X\n\n## Kept\n\nSee [y](#kept), [z](#gone), BENCHMARKS.md, "Time to the same loss",\n'
        'BENCHMARKS.md, "No such section", BENCHMARKS.md section 99 and x.md, "Kept".\n'
    )
    found = "\n".join(stale_pointers(doc))
    assert "#gone" in found and '"No such section"' in found and "section 99" in found
    assert "#kept" not in found and "Time to the same loss" not in found and '"Kept"' not in found
    code = tmp_path / "y.py"
    code.write_text(
        "# the bounds: docs/benchmarking.md#how-the-figures-are-computed, README.md#two-commands\n"
        '# and docs/benchmarking.md#no-such-heading, BENCHMARKS.md, "Where each method wins"\n'
    )
    found = "\n".join(stale_pointers(code))
    assert "#no-such-heading" in found and "#two-commands" not in found and "how-the-figures" not in found


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every table of a Markdown text: its rows, header first (the --- row left out), cells stripped."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line.strip()) <= set("|- "):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            tables, rows = [*tables, rows], []
    return tables


def above_history() -> str:
    """BENCHMARKS.md's current results: everything above its History."""
    text = BENCHMARKS.read_text()
    assert "\n## History\n" in text, "BENCHMARKS.md has no '## History' heading"
    return text.split("\n## History\n", 1)[0]


def test_benchmarks_current_results_fit_in_500_lines():
    """Superseded runs and the notes behind the tables go to History; what is above stays short."""
    lines = above_history().count("\n") + 1
    assert lines <= 500, f"BENCHMARKS.md has {lines} lines above '## History' (at most 500)"


def test_every_benchmarks_section_names_its_machine_and_command():
    """Each question above History says what it ran on (a "Machine:" line) and how (a command)."""
    command = re.compile(
        r"^(?: {4}|```)\S|`(?:acco-bench|acco-prepare|python|make|bash|torchrun|/usr/bin/time)\b", re.M
    )
    missing = []
    for part in re.split(r"^(?=## )", above_history(), flags=re.M):
        head = part.splitlines()[0] if part else ""
        if re.match(r"## (?:\d+\.|Test suite)", head):
            missing += [f"{head}: no Machine: line"] if "Machine:" not in part else []
            missing += [f"{head}: no command"] if not command.search(part) else []
    assert not missing, "\n".join(missing)


# 1.13x, 0.70x / 0.74x, 1.35-1.44x: every speedup the README quotes
SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)(?:\s*[-–]\s*(\d+\.\d+))?x\b")


def speedups(text: str) -> set[float]:
    return {float(v) for m in SPEEDUP.finditer(text) for v in m.groups() if v}


def test_the_readmes_speedups_are_benchmarks_current_figures():
    """A multiple the README quotes is one of BENCHMARKS.md's current figures, not one from History."""
    current = speedups(above_history())
    quoted = speedups((ROOT / "README.md").read_text())
    assert quoted, "no speedups read from README.md: is the reader broken?"
    assert not quoted - current, (
        f"README.md quotes speedups not above BENCHMARKS.md's History: {sorted(quoted - current)}"
    )


def test_the_readmes_headline_is_benchmarks_headline():
    headline = markdown_tables((ROOT / "README.md").read_text().split("## Headline", 1)[1])[0]
    same = [t for t in markdown_tables(BENCHMARKS.read_text()) if t[0] == headline[0]]
    assert same, "BENCHMARKS.md has no table with the columns of the README's headline"
    assert same[0] == headline


# This repository's issue numbers; an upstream project's ("pytorch issue N", owner/repo#N) is a reference.
ISSUE = re.compile(r"(?<!pytorch )(?<!torch )(?<!transformers )\b[Ii]ssues? #?\d+")
ISSUE_PENDING: set[str] = set()


def test_no_issue_numbers_in_the_docs_and_the_code():
    """Issue numbers mean nothing to a reader of the repository: say what was found instead."""
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in [*POINTING, ROOT / "tests" / "test_docs.py"]
        if str(p.relative_to(ROOT)) not in ISSUE_PENDING
        for m in ISSUE.finditer(prose(p))
    ]
    assert not found, "\n".join(found)
