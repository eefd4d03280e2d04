"""The sources import one way: no module of ``sources/`` imports one that imports it back,
imports under ``if TYPE_CHECKING:`` included (lint-imports leaves those out)."""

from __future__ import annotations

import ast
from pathlib import Path

import deterministic_ctx.sources

SOURCES = Path(deterministic_ctx.sources.__file__).parent


def _name(path: Path) -> str:
    parts = path.relative_to(SOURCES.parent).with_suffix("").parts
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


def test_no_module_of_the_sources_imports_one_that_imports_it_back() -> None:
    paths = sorted(SOURCES.rglob("*.py"))
    known = {_name(p) for p in paths}
    graph = {_name(p): _imports(p, known) for p in paths}
    cycles = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])
    assert cycles == []
