"""The layout the README's "How it is built" promises: no import circles (function-level imports
count) and no source file over 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """acco module -> the acco modules it imports anywhere in its file (a package counts as its
    __init__; ``from pkg import name`` counts as pkg.name when that is a module, else pkg)."""
    files = {_module_name(p): p for p in (ROOT / "acco").rglob("*.py")}
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
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # acco.engine.comm.X -> acco.engine.comm
                    target = target.rpartition(".")[0]
                if target.startswith("acco") and target != name:
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


def test_no_source_file_over_the_limit():
    sources = [*ROOT.glob("acco/**/*.py"), *ROOT.glob("tests/*.py"), ROOT / "main.py"]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
