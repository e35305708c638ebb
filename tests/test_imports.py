"""Imports point down (DESIGN §2): no two modules of engine/ import each other, directly or
through a loop; nothing in engine/ imports app/. Imports are read with `ast`, module level and
inside functions alike (a `TYPE_CHECKING` import counts too), relative ones resolved."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "app")


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """'engine.model.loader' -> its file, for every module of the packages."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            mods[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return mods


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name `name` imports (for `from X import y`: X.y and X), relative resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def app_imports(mods: dict[str, Path]) -> list[str]:
    """'engine.x imports app.y' for every import of app/ in engine/."""
    return sorted(
        f"{m} imports {n}"
        for m, path in mods.items()
        if inside(m, "engine")
        for n in imported_names(m, path)
        if inside(n, "app")
    )


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports. A module's own packages are left out
    (Python imports them first anyway; they are not a dependency between modules)."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for m, path in mods.items():
        targets = {resolve(n) for n in imported_names(m, path)}
        graph[m] = {t for t in targets if t and t != m and not m.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def loop(graph: dict[str, set[str]], group: list[str]) -> str:
    """One concrete loop through the group's first module: 'a -> b -> c -> a'."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return " -> ".join([*paths[v], start])
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    raise AssertionError(f"{group} is not a cycle")


def report(graph: dict[str, set[str]], groups: list[list[str]]) -> str:
    return "\n".join(f"import cycle: {' <-> '.join(g)} (e.g. {loop(graph, g)})" for g in groups)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(find_modules())


def test_the_walk_finds_both_packages(graph: dict[str, set[str]]) -> None:
    assert "engine.model.transformer" in graph and "app.app" in graph
    assert "engine.kv" in graph["engine.model.transformer"]  # an absolute import
    assert "engine.backend.base" in graph["engine.model.moe"]


def test_relative_imports_cycles_and_app_imports_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "engine" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "engine" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")  # a function-level import
    (pkg / "b.py").write_text("from ..top import x\n")
    (tmp_path / "engine" / "top.py").write_text("from engine.sub.a import f\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "engine" / "ui.py").write_text("def f():\n    import app.widgets\n")
    mods = find_modules(tmp_path)
    assert app_imports(mods) == ["engine.ui imports app.widgets"]
    g = import_graph(mods)
    assert g["engine.sub"] == {"engine.sub.a"}
    assert g["engine.sub.b"] == {"engine.top"}
    assert g["engine.top"] == {"engine.sub.a"}
    groups = cycles(g)
    assert groups == [["engine.sub.a", "engine.sub.b", "engine.top"]]
    assert loop(g, groups[0]) == "engine.sub.a -> engine.sub.b -> engine.top -> engine.sub.a"


def test_engine_modules_never_import_each_other_in_a_loop(graph: dict[str, set[str]]) -> None:
    engine = {
        m: {t for t in ts if inside(t, "engine")} for m, ts in graph.items() if inside(m, "engine")
    }
    groups = cycles(engine)
    assert not groups, "\n" + report(engine, groups)


def test_engine_never_imports_app() -> None:
    bad = app_imports(find_modules())
    assert not bad, "\n".join(bad)


def test_app_modules_never_import_each_other_in_a_loop(graph: dict[str, set[str]]) -> None:
    groups = [g for g in cycles(graph) if any(inside(m, "app") for m in g)]
    assert not groups, "\n" + report(graph, groups)
