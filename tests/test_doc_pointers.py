"""Pointers between the documents, and BENCHMARKS.md as today's results.

Where prose (Markdown, code comments and docstrings) names a section (`BENCHMARKS.md, "Scale"`,
`docs/x.md#anchor`, `History, "From 4.1"`), that heading exists; outside BENCHMARKS.md a pointer
names the heading, not its number. BENCHMARKS.md keeps at most about 500 lines above History, each
section names its machine and command, the README's figures are BENCHMARKS.md's, and no doc or
code speaks of issue numbers.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

BENCHMARKS = ROOT / "BENCHMARKS.md"
BENCHMARKS_HISTORY = ROOT / "BENCHMARKS-history.md"  # superseded figures and the notes behind the tables
MARKDOWN = [*DOCS, BENCHMARKS, BENCHMARKS_HISTORY]
# Where prose names a section: the Markdown files and the comments and docstrings of the code.
POINTING = [
    *MARKDOWN,
    ROOT / "main.py",
    *sorted(ROOT.glob("acco/**/*.py")),
    *sorted(ROOT.glob("acco/conf/**/*.yaml")),
    *sorted(ROOT.glob("acco_bench/**/*.py")),
    *sorted(p for p in ROOT.glob("tests/*.py") if p.name != "test_doc_pointers.py"),
]
FILE = r"(?P<file>(?:\.\./)?(?:docs/)?[A-Za-z][\w-]*\.md|BENCHMARKS|README)"
# FILE, "Heading" (also FILE's "Heading", [FILE](FILE), "Heading" and FILE, section "Heading")
QUOTED = re.compile(FILE + r"(?:\]\([^)\s]*\))?(?:'s?)?,?\s+(?:section\s+)?\\?\"(?P<name>[^\"\\]{2,80})\\?\"")
# BENCHMARKS.md section 5.1, BENCHMARKS §5.2, and the map's §1.1 labels
NUMBERED = re.compile(
    r"(?:BENCHMARKS(?:\.md)?(?:'s?)?,?\s+(?:sections?\s+|§\s*)|§)"
    r"(?P<number>\d+(?:\.\d+)*)"
)
IN_BENCHMARKS = re.compile(r"\b[Ss]ections?\s+(?P<number>\d+(?:\.\d+)*)")
# within BENCHMARKS-history.md: History, "From 4.1"
HISTORY = re.compile(r"History,?\s+\(?\"(?P<name>[^\"]{2,80})\"")
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
        "# the bounds: docs/benchmarking.md#how-the-figures-are-computed, README.md#documentation\n"
        '# and docs/benchmarking.md#no-such-heading, BENCHMARKS.md, "Where each method wins"\n'
    )
    found = "\n".join(stale_pointers(code))
    assert "#no-such-heading" in found and "#documentation" not in found and "how-the-figures" not in found


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


def test_the_readmes_tables_are_short_and_not_benchmarks_tables():
    """The README is a front page: its headline at most 4 rows by 4 columns, every cell of its tables
    one short reason or figure, and no table (nor a row of one) copied from BENCHMARKS.md."""
    readme = (ROOT / "README.md").read_text()
    headline = markdown_tables(readme.split("## Headline", 1)[1])[0]
    assert len(headline) - 1 <= 4 and all(len(row) <= 4 for row in headline), headline
    bench_rows = {tuple(row) for t in markdown_tables(BENCHMARKS.read_text()) for row in t[1:]}
    for table in markdown_tables(readme):
        assert not bench_rows & {tuple(row) for row in table[1:]}, "a README row copied from BENCHMARKS.md"
        long = [c for row in table for c in row if len(c) > 110]
        assert not long, f"README cells over 110 characters: {long}"


# This repository's issue numbers; an upstream project's ("pytorch issue N", owner/repo#N) is a reference.
ISSUE = re.compile(r"(?<!pytorch )(?<!torch )(?<!transformers )\b[Ii]ssues? #?\d+")
ISSUE_PENDING: set[str] = set()


def test_no_issue_numbers_in_the_docs_and_the_code():
    """Issue numbers mean nothing to a reader of the repository: say what was found instead."""
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in [*POINTING, ROOT / "tests" / "test_doc_pointers.py"]
        if str(p.relative_to(ROOT)) not in ISSUE_PENDING
        for m in ISSUE.finditer(prose(p))
    ]
    assert not found, "\n".join(found)
