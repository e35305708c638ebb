"""Imports point down (DESIGN §2): every module of engine/ belongs to a layer of the order
engine/README.md writes down ("Layers") and imports only from its own layer and those below;
no two modules import each other, directly or through a loop; nothing in engine/ imports app/.
Imports are read with `ast`, module level and inside functions alike (a `TYPE_CHECKING` import
counts too), relative ones resolved."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "app")
LAYERS_BEGIN, LAYERS_END = "<!-- layers -->", "<!-- /layers -->"
TOP_LEVEL_MAX = 12  # engine/'s own modules, __init__ included; the rest live in packages


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


def test_engine_has_few_top_level_modules() -> None:
    """DESIGN §2: a few top-level modules (config, errors, the public surface); the rest in
    packages whose names tell what they hold."""
    top = sorted(f.name for f in (ROOT / "engine").glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, f"{len(top)} modules at engine/'s top level: {top}"


def test_engine_never_imports_app() -> None:
    bad = app_imports(find_modules())
    assert not bad, "\n".join(bad)


def test_app_modules_never_import_each_other_in_a_loop(graph: dict[str, set[str]]) -> None:
    groups = [g for g in cycles(graph) if any(inside(m, "app") for m in g)]
    assert not groups, "\n" + report(graph, groups)


def read_layers(readme: Path = ROOT / "engine" / "README.md") -> list[tuple[str, list[str]]]:
    """The layer order of engine/README.md, lowest first: (layer, module prefixes) from the
    lines `name: a b c` between the layers markers (an indented line goes on with the layer
    above); prefixes are relative to engine/ and name a module or a package."""
    text = readme.read_text(encoding="utf-8")
    assert LAYERS_BEGIN in text and LAYERS_END in text, f"{readme}: no {LAYERS_BEGIN} block"
    block = text.split(LAYERS_BEGIN, 1)[1].split(LAYERS_END, 1)[0]
    layers = []
    name = lambda p: f"engine.{p.strip('/').replace('/', '.')}"
    for line in block.splitlines():
        m = re.fullmatch(r"(\w+):\s+(.+?)\s*", line)
        if m:
            layers.append((m.group(1), [name(p) for p in m.group(2).split()]))
        elif line.startswith(" ") and line.strip() and layers:
            layers[-1][1].extend(name(p) for p in line.split())
    assert layers, f"{readme}: the layers block names no layer"
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """Index of the layer whose longest prefix names `module` (None: no layer does)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if inside(module, p) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """'a (layer) imports b (higher layer)' for each import above the importer's layer, and
    'a has no layer' for each engine module the order leaves out (packages' own __init__
    with no imports excepted)."""
    out = []
    for m in sorted(graph):
        if not inside(m, "engine") or m == "engine":
            continue
        here = layer_of(m, layers)
        if here is None:
            out.append(f"{m} has no layer: place it in engine/README.md's layers")
            continue
        for t in sorted(graph[m]):
            there = layer_of(t, layers) if inside(t, "engine") and t != "engine" else None
            if there is not None and there > here:
                out.append(f"{m} ({layers[here][0]}) imports {t} ({layers[there][0]}), a "
                           f"higher layer")
    return out


def test_engine_imports_point_down_the_layers(graph: dict[str, set[str]]) -> None:
    bad = upward_imports(graph, read_layers())
    assert not bad, "\n" + "\n".join(bad)


def test_an_upward_import_and_a_module_without_a_layer_are_found(tmp_path: Path) -> None:
    for pkg in ("engine", "engine/low", "engine/high"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "engine" / "low" / "a.py").write_text("def f():\n    from engine.high.b import g\n")
    (tmp_path / "engine" / "low" / "tool.py").write_text("from engine.high.b import g\n")
    (tmp_path / "engine" / "high" / "b.py").write_text("from engine.low import a\n")
    (tmp_path / "engine" / "stray.py").write_text("")
    readme = tmp_path / "README.md"
    readme.write_text(f"{LAYERS_BEGIN}\n```\nlow:   low\nhigh:  high\n       low/tool\n```\n"
                      f"{LAYERS_END}\n")
    layers = read_layers(readme)
    assert layers == [("low", ["engine.low"]), ("high", ["engine.high", "engine.low.tool"])]
    assert layer_of("engine.low.tool", layers) == 1  # the longest prefix wins
    assert upward_imports(import_graph(find_modules(tmp_path)), layers) == [
        "engine.low.a (low) imports engine.high.b (high), a higher layer",
        "engine.stray has no layer: place it in engine/README.md's layers",
    ]


DEVICE_PARSING = ("engine.devices",)  # the one module that reads a device's kind from its name
DEVICE_KINDS = ("cuda", "sim", "hip")
DECODE_ROWS_OWNER = "engine.config"
# Row bounds equal to a decode step's rows today that are other things: where uploading
# quantized embedding rows starts to pay (engine/backend/cuda_ops.py).
OTHER_ROW_BOUNDS = ("EMBED_ON_HOST_ROWS",)


def device_string_tests(mods: dict[str, Path]) -> list[str]:
    """'module:line' for each `.startswith(...)` of a device kind ('cuda', 'sim', 'hip', or
    one with its ':') outside device parsing (DESIGN §2: CPU or GPU is asked of the backend's
    traits, never read from a device string)."""
    out = []
    for m, path in mods.items():
        if m in DEVICE_PARSING:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "startswith" and node.args):
                continue
            arg = node.args[0]
            for v in arg.elts if isinstance(arg, ast.Tuple) else [arg]:
                if (isinstance(v, ast.Constant) and isinstance(v.value, str)
                        and v.value.partition(":")[0] in DEVICE_KINDS):
                    out.append(f"{m}:{node.lineno} tests a device string ({v.value!r})")
    return sorted(out)


def module_constants(mods: dict[str, Path]) -> list[tuple[str, str, ast.expr]]:
    """(module, name, value) of every module-level `NAME = value` (tuples unpacked)."""
    out = []
    for m, path in mods.items():
        for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            else:
                continue
            for target, value in pairs:
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs.extend(zip(target.elts, value.elts))
                elif isinstance(target, ast.Name):
                    out.append((m, target.id, value))
    return out


def decode_row_copies(mods: dict[str, Path]) -> list[str]:
    """The decode row limit is one constant: `DECODE_ROWS` assigned once, in its owner; a row
    or window bound elsewhere with the same number written out is a copy of it (unless named
    in OTHER_ROW_BOUNDS), to be derived from it instead."""
    consts = module_constants(mods)
    owners = [(m, v) for m, name, v in consts if name == "DECODE_ROWS"]
    if [m for m, _ in owners] != [DECODE_ROWS_OWNER] or not isinstance(owners[0][1], ast.Constant):
        where = [m for m, _ in owners]
        return [f"DECODE_ROWS is assigned in {where}, not once in {DECODE_ROWS_OWNER} as a number"]
    rows = owners[0][1].value
    return sorted(
        f"{m}.{name} = {rows}: derive it from DECODE_ROWS (or name it in OTHER_ROW_BOUNDS)"
        for m, name, v in consts
        if name != "DECODE_ROWS" and name not in OTHER_ROW_BOUNDS
        and name.endswith(("ROWS", "WINDOW"))
        and isinstance(v, ast.Constant) and v.value == rows
    )


def test_no_device_string_is_tested_outside_device_parsing() -> None:
    bad = device_string_tests(find_modules())
    assert not bad, "\n" + "\n".join(bad)


def test_the_decode_row_limit_is_defined_once() -> None:
    bad = decode_row_copies(find_modules())
    assert not bad, "\n" + "\n".join(bad)


def test_device_string_tests_and_row_copies_are_found(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "devices.py").write_text("x = 'cuda:0'.startswith('cuda')\n")
    (tmp_path / "engine" / "config.py").write_text("DECODE_ROWS = 8\n")
    (tmp_path / "engine" / "model.py").write_text(
        "from engine.config import DECODE_ROWS\n"
        "def f(d):\n    return d.startswith(('sim', 'x')) or d.startswith('simple')\n"
        "STEP_ROWS = 2 * DECODE_ROWS\nMIN_WINDOW, MAX_WINDOW = 2, 8\nGEMV_MAX_ROWS: int = 8\n"
    )
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "panel.py").write_text("def g(d):\n    return d.startswith('hip:')\n")
    mods = find_modules(tmp_path)
    assert device_string_tests(mods) == ["app.panel:2 tests a device string ('hip:')",
                                         "engine.model:3 tests a device string ('sim')"]
    assert decode_row_copies(mods) == [
        "engine.model.GEMV_MAX_ROWS = 8: derive it from DECODE_ROWS (or name it in OTHER_ROW_BOUNDS)",
        "engine.model.MAX_WINDOW = 8: derive it from DECODE_ROWS (or name it in OTHER_ROW_BOUNDS)",
    ]
    (tmp_path / "engine" / "kernels.py").write_text("DECODE_ROWS = 8\n")
    assert decode_row_copies(find_modules(tmp_path))[0].startswith("DECODE_ROWS is assigned in")


RUNTIME_RECORD = "engine.runtime.parts"  # where `Runtime` is defined
# What builds a runtime (startup) or runs requests on it (the runtime package); every other
# module takes the parts it works on.
RUNTIME_USERS = ("engine.runtime", "engine.startup.runtime")
STEP_MAX_LINES = 30  # ServeLoop.step: one screen, top to bottom


def runtime_importers(mods: dict[str, Path]) -> list[str]:
    """'module imports Runtime' for each engine module outside RUNTIME_USERS that imports the
    module of the `Runtime` record (it holds nothing else)."""
    out = []
    for m, path in mods.items():
        if not inside(m, "engine") or any(inside(m, u) for u in RUNTIME_USERS):
            continue
        if RUNTIME_RECORD in imported_names(m, path):  # `import` or `from ... import`
            out.append(f"{m} imports Runtime: pass it the parts it needs")
    return sorted(out)


def function_lines(path: Path, qualname: str) -> int:
    """Lines of the function `Class.method` (or `function`) in `path`, docstring included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    *owners, name = qualname.split(".")
    body: list[ast.stmt] = tree.body
    for owner in owners:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
              and n.name == name)
    return fn.end_lineno - fn.lineno + 1


def test_only_the_runtimes_builders_and_runners_import_it() -> None:
    bad = runtime_importers(find_modules())
    assert not bad, "\n" + "\n".join(bad)


def test_serve_loop_step_fits_on_a_screen() -> None:
    n = function_lines(ROOT / "engine" / "runtime" / "serve.py", "ServeLoop.step")
    assert n <= STEP_MAX_LINES, f"ServeLoop.step is {n} lines (at most {STEP_MAX_LINES})"


def test_runtime_importers_and_function_lengths_are_found(tmp_path: Path) -> None:
    for pkg in ("engine", "engine/runtime", "engine/loan", "engine/startup"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "engine" / "runtime" / "parts.py").write_text("class Runtime: ...\n")
    (tmp_path / "engine" / "runtime" / "serve.py").write_text(
        "from engine.runtime.parts import Runtime\n"
        "class ServeLoop:\n    def step(self):\n        '''One.'''\n        return 1\n")
    (tmp_path / "engine" / "startup" / "runtime.py").write_text(
        "from engine.runtime.parts import Runtime\n")
    (tmp_path / "engine" / "loan" / "work.py").write_text(
        "def f():\n    from engine.runtime.parts import Runtime\n")
    (tmp_path / "engine" / "loan" / "other.py").write_text("import engine.runtime.parts\n")
    (tmp_path / "engine" / "loan" / "fine.py").write_text("from engine.runtime import serve\n")
    assert runtime_importers(find_modules(tmp_path)) == [
        "engine.loan.other imports Runtime: pass it the parts it needs",
        "engine.loan.work imports Runtime: pass it the parts it needs",
    ]
    assert function_lines(tmp_path / "engine" / "runtime" / "serve.py", "ServeLoop.step") == 3
