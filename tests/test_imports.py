"""The modules import one way: no module of the package imports one that imports it
back, directly or through others, imports under ``if TYPE_CHECKING:`` included
(lint-imports leaves those out, and checks layers, not modules within one)."""

from __future__ import annotations

import ast
from pathlib import Path

import deterministic_ctx

PACKAGE = Path(deterministic_ctx.__file__).parent


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, wherever in the file."""
    package = _name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1])
            if node.module:
                base = f"{base}.{node.module}"
            for alias in node.names:  # ``from . import x`` imports the module x
                name = f"{base}.{alias.name}"
                found.add(name if name in known else base)
    return found & known - {_name(path)}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (its modules in import order), or ``[]``."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return []
        for imported in sorted(graph[name]):
            found = visit(imported, [*path, name])
            if found:
                return found
        done.add(name)
        return []

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return []


def test_no_module_imports_one_that_imports_it_back() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {_name(p) for p in paths}
    # The package's root re-exports the public names lazily (``_WHERE``): not
    # an arrow between modules.
    graph = {_name(p): {m for m in _imports(p, known) if m != "deterministic_ctx"} for p in paths}
    assert _cycle(graph) == []


def test_the_check_finds_a_cycle_through_three_modules() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
