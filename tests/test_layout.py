"""The layout docs/internals.md's "How it is built" promises: no import circles (function-level imports
count), no function over 80 lines in the library or the benchmarks (argument tables excepted), the
library (acco) never importing the benchmarks (acco_bench), no benchmark module reaching for another's
private (underscore) names, and no test module importing another (shared helpers live in
tests/*_helpers.py, distributed.py, faults.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
ARGUMENT_TABLES = {"build_parser"}  # a table of options is as long as its options
PACKAGES = ("acco", "acco_bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _files() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PACKAGES)


def import_graph() -> dict[str, set[str]]:
    """module of acco or acco_bench -> the modules of either it imports anywhere in its file (a
    package counts as its __init__; ``from pkg import name`` counts as pkg.name when that is a
    module, and as the submodule that defines `name` when the package loads it lazily, else as pkg)."""
    files = _files()
    defines = {name: _defined_names(path) for name, path in files.items()}

    def where(package: str, attr: str) -> str:
        if attr in defines.get(package, ()):
            return package
        owners = [m for m in files if m.rpartition(".")[0] == package and attr in defines[m]]
        return owners[0] if len(owners) == 1 else package  # a lazy package's name: its real module

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else where(base, a.name)
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in files:  # acco.engine.comm.X -> acco.engine.comm
                    target = target.rpartition(".")[0]
                if _ours(target) and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles():
    assert find_cycles(import_graph()) == []


def test_the_circle_finder_sees_function_level_imports():
    graph = {"acco.a": {"acco.b"}, "acco.b": {"acco.a"}, "acco.c": {"acco.a"}}
    assert find_cycles(graph) == [["acco.a", "acco.b"]]
    real = import_graph()
    assert "acco.engine" in real["acco.trainer"]  # a module-level import is seen
    # CheckpointError: from acco.engine, defined in config
    assert "acco.engine.config" in real["acco.checkpoint"]


def test_the_library_never_imports_the_benchmarks():
    reach = {m: {t for t in edges if t == "acco_bench" or t.startswith("acco_bench.")}
             for m, edges in import_graph().items() if m == "acco" or m.startswith("acco.")}
    assert {m: t for m, t in reach.items() if t} == {}


def _private_uses(path: Path, modules: set[str]) -> list[str]:
    """``from M import _x`` and ``m._x`` (m bound to an imported module of ours) in one file."""
    found, bound = [], set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and _ours(node.module or ""):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in modules:
                    bound.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            bound.update(a.asname for a in node.names if a.asname and _ours(a.name))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_benchmark_module_uses_another_modules_private_names():
    files = _files()
    uses = {name: u for name, path in files.items() if name.startswith("acco_bench")
            if (u := _private_uses(path, set(files)))}
    assert uses == {}


def test_the_private_name_finder_sees_both_forms(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from acco_bench.report import _plt, fmt\nfrom acco_bench import report\n"
                    "def f():\n    return report._plt(), fmt, report.__doc__\n")
    assert _private_uses(path, {"acco_bench.report"}) == ["from acco_bench.report import _plt", "report._plt"]


def test_no_test_module_imports_another():
    imports = {}
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits = [n for n in names if n.split(".")[0].startswith("test_")]
            if hits:
                imports.setdefault(path.name, []).extend(hits)
    assert imports == {}


def long_functions(paths, root: Path = ROOT) -> dict[str, int]:
    """'file:function' -> lines, for each function over MAX_FUNCTION_LINES (nested ones counted too)."""
    found = {}
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name not in ARGUMENT_TABLES:
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    found[f"{p.relative_to(root)}:{node.name}"] = n
    return found


def test_no_function_over_the_limit():
    found = long_functions([*ROOT.glob("acco/**/*.py"), *ROOT.glob("acco_bench/**/*.py")])
    assert {k: n for k, n in found.items() if n > MAX_FUNCTION_LINES} == {}


def test_the_function_finder_counts_lines(tmp_path):
    path = tmp_path / "m.py"
    body = "".join("    x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    path.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    assert {k.split(":")[1]: n for k, n in long_functions([path], tmp_path).items()} == {"long": 81}
