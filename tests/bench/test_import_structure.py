"""The tooling's import structure (issue 30, Note [tooling layers] in ``ppbackward._tools.bench``): read
from the source with ``ast``, nothing imported. Every ``import`` counts, at the top of a module or inside
a function; a ``__main__`` module is a program's entry, which nothing imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ppbackward

SRC = Path(ppbackward.__file__).resolve().parent.parent  # the folder holding the ``ppbackward`` package


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules one ``import`` statement names: ``from a import b`` is ``a.b`` where that is a module,
    else ``a``; relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(root: Path, package: str = "ppbackward") -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module of ``package`` under ``root`` (only imports of
    that package's own modules are kept)."""
    paths = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {
            name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in _imported(node, module, is_package, known)
            if name == package or name.startswith(package + ".")
        }
    return graph


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles(graph: dict[str, set[str]], package: str) -> list[list[str]]:
    """Each circle among ``package``'s modules, as the path that closes it (``[a, b, a]``); a depth-first
    walk, one circle reported per back edge."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if not _inside(other, package) or other == module:
                continue
            if state.get(other) == 1:
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if _inside(module, package) and module not in state:
            visit(module)
    return found


def upward_imports(graph: dict[str, set[str]], lower: str, upper: str) -> list[str]:
    """``"a -> b"`` for each module ``a`` in ``lower`` (not a ``__main__``: Note [tooling layers]) that
    imports a module ``b`` of ``upper``."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if _inside(a, lower) and not a.endswith(".__main__")
        for b in targets
        if _inside(b, upper)
    )


def test_no_circle_among_the_bench_modules():
    assert cycles(import_graph(SRC), "ppbackward._tools.bench") == []


def test_no_circle_in_the_tooling():
    assert cycles(import_graph(SRC), "ppbackward._tools") == []


def test_bench_and_harness_never_import_the_command_line():
    graph = import_graph(SRC)
    bad = upward_imports(graph, "ppbackward._tools.bench", "ppbackward._tools.cli")
    bad += upward_imports(graph, "ppbackward._tools.harness", "ppbackward._tools.cli")
    assert bad == []


def test_the_harness_never_imports_the_bench():
    """The bench builds on the harness (its zoo, its worker for the schedule step), never the reverse."""
    assert upward_imports(import_graph(SRC), "ppbackward._tools.harness", "ppbackward._tools.bench") == []


def test_the_library_never_imports_the_tooling():
    graph = import_graph(SRC)
    library = {m: t for m, t in graph.items() if not _inside(m, "ppbackward._tools") and m != "ppbackward.__main__"}
    assert upward_imports(library, "ppbackward", "ppbackward._tools") == []
    assert "ppbackward._tools.cli" in graph["ppbackward.__main__"]  # the one import allowed, seen by the walk


def test_the_checks_see_a_planted_circle_and_upward_import(tmp_path):
    """Negative control: a package with a function-level circle, a relative import and an import back up."""
    pkg = tmp_path / "ppbackward"
    (pkg / "_tools" / "bench").mkdir(parents=True)
    (pkg / "_tools" / "cli").mkdir()
    for folder in (pkg, pkg / "_tools", pkg / "_tools" / "bench", pkg / "_tools" / "cli"):
        (folder / "__init__.py").write_text("")
    (pkg / "_tools" / "cli" / "bench.py").write_text("")
    (pkg / "_tools" / "bench" / "a.py").write_text("from . import b\n")
    (pkg / "_tools" / "bench" / "b.py").write_text(
        "def f():\n    from ppbackward._tools.bench import a\n    from ppbackward._tools.cli.bench import x\n"
    )
    (pkg / "_saved.py").write_text("import ppbackward._tools.bench.a\n")
    graph = import_graph(tmp_path)
    assert graph["ppbackward._tools.bench.b"] == {"ppbackward._tools.bench.a", "ppbackward._tools.cli.bench"}
    assert cycles(graph, "ppbackward._tools.bench") == [
        ["ppbackward._tools.bench.a", "ppbackward._tools.bench.b", "ppbackward._tools.bench.a"]
    ]
    assert upward_imports(graph, "ppbackward._tools.bench", "ppbackward._tools.cli") == [
        "ppbackward._tools.bench.b -> ppbackward._tools.cli.bench"
    ]
    assert upward_imports(graph, "ppbackward._saved", "ppbackward._tools") == [
        "ppbackward._saved -> ppbackward._tools.bench.a"
    ]
