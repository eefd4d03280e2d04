"""The package's layout keeps its promises: one import path per module, entry points, sizes,
errors with one base and their public path.

The modules live in layer packages (docs/explanation/architecture.md); users import the
public names from ``deterministic_ctx`` itself, other tools find the plugins through entry
points, and the tree must stay readable: no giant module, a short package root.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest

import deterministic_ctx
from tests.helpers import ROOT, run_python

PACKAGE = ROOT / "deterministic_ctx"

#: Paths that were a second name of a module (aliases replacing themselves in
#: ``sys.modules``) before the first release: each module has one path now.
REMOVED = [
    "deterministic_ctx.data",
    "deterministic_ctx.distributed",
    "deterministic_ctx.dcp",
    "deterministic_ctx.snapshot",
    "deterministic_ctx.locate",
    "deterministic_ctx.ops",
    "deterministic_ctx.hypothesis",
    "deterministic_ctx.streams",
    "_deterministic_ctx_pytest",
]
#: Public paths that are packages (or modules) of their own.
PACKAGES = [
    "deterministic_ctx.trace",
    "deterministic_ctx.audit",
    "deterministic_ctx.verify",
    "deterministic_ctx.verify.ops",
    "deterministic_ctx.reporting",
    "deterministic_ctx.internal",
    "deterministic_ctx.integrations.hypothesis",
    "deterministic_ctx.integrations.pytest_plugin",
    "deterministic_ctx.sources",
    "deterministic_ctx.sources.user_rngs",
]


@pytest.mark.parametrize("old", REMOVED)
def test_a_second_name_of_a_module_is_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_no_module_replaces_itself_in_sys_modules():
    # The way the aliases worked: a module assigning to sys.modules[__name__].
    offenders = [
        str(p.relative_to(ROOT))
        for p in [*_modules(), *ROOT.glob("*.py")]
        if re.search(r"sys\.modules\[__name__\]\s*=", p.read_text())
    ]
    assert offenders == []


def test_the_docs_import_public_names_from_the_package():
    # One path per name in what users read (the docs, the examples, and the docstring
    # examples the API reference shows): a name exported by deterministic_ctx is imported
    # from deterministic_ctx, never from the module that defines it.
    public = set(deterministic_ctx.__all__)
    texts = [
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        *(ROOT / "examples").glob("*.py"),
        *(ROOT / "examples").glob("*.ipynb"),
        *_modules(),
    ]
    found = []
    for path in texts:
        for line in path.read_text().splitlines():
            if path.suffix == ".py" and path.is_relative_to(PACKAGE) and ">>>" not in line:
                continue  # the package's own code imports from where names are defined
            for names in re.findall(r"from deterministic_ctx\.[\w.]+ import ([\w, ]+)", line):
                if public & {n.strip() for n in names.split(",")}:
                    found.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("name", PACKAGES)
def test_public_packages_import(name):
    importlib.import_module(name)


@pytest.mark.parametrize("name", deterministic_ctx.__all__)
def test_every_public_name_resolves(name):
    assert getattr(deterministic_ctx, name) is not None


def _entry_point(group: str, name: str) -> importlib.metadata.EntryPoint:
    (found,) = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    return found


def test_the_entry_points_load():
    from deterministic_ctx.integrations import pytest_plugin, randomly
    from deterministic_ctx.integrations.cli import main

    assert _entry_point("pytest11", "deterministic_ctx").load() is pytest_plugin
    assert _entry_point("pytest_randomly.random_seeder", "deterministic_ctx").load() is (
        randomly.reseed
    )
    assert _entry_point("console_scripts", "deterministic-ctx").load() is main


def test_the_rng_entry_point_group_keeps_its_name():
    from deterministic_ctx.sources.user_rngs import ENTRY_POINT_GROUP

    assert ENTRY_POINT_GROUP == "deterministic_ctx.rngs"


def test_the_ipython_extension_is_the_package():
    assert callable(deterministic_ctx.load_ipython_extension)
    assert callable(deterministic_ctx.unload_ipython_extension)


def test_python_dash_m_runs_the_cli():
    proc = run_python(["-m", "deterministic_ctx", "--version"], check=True, timeout=120)
    assert proc.stdout.strip().endswith(deterministic_ctx.__version__)


# -- the tree stays readable ---------------------------------------------------------------


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_900_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > 900
    }
    assert long == {}


def test_at_most_ten_plain_modules_at_the_package_root():
    plain = sorted(p.name for p in PACKAGE.glob("*.py") if not p.name.startswith("__"))
    assert len(plain) <= 10, plain


def test_every_folder_of_the_package_is_a_package():
    for folder in PACKAGE.rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__":
            assert (folder / "__init__.py").exists(), folder


def test_tests_mirror_the_package():
    tests = ROOT / "tests"
    for layer in ("core", "sources", "state", "parallel", "verify", "reporting", "integrations"):
        assert (PACKAGE / layer).is_dir(), layer
        assert list((tests / layer).glob("test_*.py")), f"no tests/{layer}/test_*.py"
    assert not list(tests.glob("test_*.py")) or all(
        p.name == Path(__file__).name for p in tests.glob("test_*.py")
    ), "tests at the top of tests/ belong in the folder of what they test"


#: A private torch name in code: ``torch._x``, ``torch.mod._x``, ``_C`` (torch's C module).
_PRIVATE_TORCH = re.compile(r"torch\._[A-Za-z]|\b_C\b|torch\.[a-z_]+(\.[a-z_]+)*\._[a-z]")


def _code_without_docs(source: str) -> str:
    """``source``'s tokens without comments and docstrings (which may name anything)."""
    docstrings = {
        node.value.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    kept = [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type != tokenize.COMMENT
        and not (tok.type == tokenize.STRING and tok.start[0] in docstrings)
    ]
    return " ".join(kept)


def test_private_torch_names_live_in_one_place():
    naming = sorted(
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if _PRIVATE_TORCH.search(_code_without_docs(p.read_text()))
    )
    assert len(naming) <= 3, naming
    assert all(name.startswith("_torch/") for name in naming), naming


# -- the internal API: narrow, and nothing private through it (issue 42) ----------------------

INTERNAL = PACKAGE / "internal.py"
#: Names still re-exported from a private module for a module above that imports them from
#: deterministic_ctx.internal: each goes once that module imports it from where it lives.
PENDING: dict[str, str] = {}


def _internal_imports() -> list[tuple[str, str]]:
    """``(module it comes from, name)`` for each name internal.py imports."""
    return [
        ("." * node.level + (node.module or ""), alias.asname or alias.name)
        for node in ast.parse(INTERNAL.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for alias in node.names
    ]


def test_the_internal_api_is_narrow():
    from deterministic_ctx import internal

    assert len(internal.__all__) <= 30, len(internal.__all__)
    assert sorted(internal.__all__) == sorted(name for _, name in _internal_imports())


def test_the_internal_api_takes_nothing_from_a_private_module():
    # A private module's name passed on here would let the layers above reach what the
    # contracts in .importlinter forbid them, through the one module they may import.
    private = sorted(
        f"{name} from {module}"
        for module, name in _internal_imports()
        if any(part.startswith("_") for part in module.lstrip(".").split("."))
        and name not in PENDING
    )
    assert private == []
    from deterministic_ctx import internal

    assert set(PENDING) <= set(internal.__all__), "a pending name is gone: drop it from PENDING"


def _names_taken_from_internal(path: Path) -> set[str]:
    """The names ``path`` imports from deterministic_ctx.internal, and the attributes it
    reads where it imports the module itself (``from .. import internal``)."""
    tree = ast.parse(path.read_text())
    taken: set[str] = set()
    whole = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if (node.module or "").split(".")[-1] == "internal":
                taken.update(alias.name for alias in node.names)
            elif any(alias.name == "internal" for alias in node.names):
                whole = True
    if whole:
        taken.update(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute))
    return taken


def test_every_internal_name_is_used_above_the_engine():
    # Each name is there because a layer above needs it: a name nobody imports any more goes.
    from deterministic_ctx import internal

    used = set().union(*(_names_taken_from_internal(p) for p in _modules() if p != INTERNAL))
    assert sorted(set(internal.__all__) - used) == []


# -- errors and warnings: one base, one public path --------------------------------------------


def _package_modules() -> list[str]:
    import pkgutil

    names = ["deterministic_ctx"]
    for info in pkgutil.walk_packages(deterministic_ctx.__path__, "deterministic_ctx."):
        # __main__ runs the command line when imported.
        if not info.name.endswith(".__main__"):
            names.append(info.name)
    return names


def _exception_classes_defined_in_the_package() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _package_modules():
        for value in vars(importlib.import_module(name)).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__.split(".")[0] == "deterministic_ctx"
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def _exported_exception_classes() -> list[type[BaseException]]:
    return [
        value
        for name in deterministic_ctx.__all__
        if isinstance(value := getattr(deterministic_ctx, name), type)
        and issubclass(value, BaseException)
    ]


def test_the_walk_finds_every_kind_of_error():
    # A walk that found nothing would pass the tests below: it must see the
    # private and the deep ones too.
    found = {cls.__name__ for cls in _exception_classes_defined_in_the_package().values()}
    assert {"InvalidTraceError", "TableError", "DeterministicLeakWarning", "_LoadError"} <= found
    assert len(found) >= 18, sorted(found)


def test_every_error_and_warning_of_the_package_has_the_common_base():
    Error, Warn = deterministic_ctx.DeterministicCtxError, deterministic_ctx.DeterministicCtxWarning
    stray = sorted(
        where
        for where, cls in _exception_classes_defined_in_the_package().items()
        if not issubclass(cls, Warn if issubclass(cls, Warning) else Error)
    )
    assert stray == []


def test_every_warning_the_package_gives_has_the_common_base():
    # One filter (``-W error::deterministic_ctx.DeterministicCtxWarning``) must cover
    # every warnings.warn call of the package, not only the classes it defines: a call
    # without a category (a plain UserWarning) or with a builtin one would escape it.
    calls, stray = 0, []
    for path in sorted((ROOT / "deterministic_ctx").rglob("*.py")):
        module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module_name = module_name.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if not (isinstance(node, ast.Call) and isinstance(func, ast.Attribute)):
                continue
            if not (func.attr == "warn" and isinstance(func.value, ast.Name)):
                continue
            if func.value.id != "warnings":
                continue
            calls += 1
            args = node.args[1:2] or [k.value for k in node.keywords if k.arg == "category"]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if not args or not isinstance(args[0], ast.Name):
                stray.append(f"{where}: no category named")
                continue
            category = getattr(importlib.import_module(module_name), args[0].id)
            if not issubclass(category, deterministic_ctx.DeterministicCtxWarning):
                stray.append(f"{where}: {category.__name__}")
    assert calls >= 9  # the walk sees the calls
    assert stray == []


@pytest.mark.parametrize("cls", _exported_exception_classes(), ids=lambda cls: cls.__name__)
def test_every_exported_error_derives_from_the_base_and_keeps_a_builtin_one(cls):
    roots = (deterministic_ctx.DeterministicCtxError, deterministic_ctx.DeterministicCtxWarning)
    if cls in roots:
        return
    base = roots[1] if issubclass(cls, Warning) else roots[0]
    assert issubclass(cls, base)
    # e.g. ValueError, RuntimeWarning: existing ``except`` clauses and filters keep working.
    builtin = {c for c in cls.__mro__ if c.__module__ == "builtins"}
    assert builtin - {Exception, Warning, BaseException, object}, cls.__mro__


@pytest.mark.parametrize("cls", _exported_exception_classes(), ids=lambda cls: cls.__name__)
def test_every_exported_error_prints_its_public_path(cls):
    import pickle

    assert cls.__module__ == "deterministic_ctx"
    assert repr(cls) == f"<class 'deterministic_ctx.{cls.__name__}'>"
    # Pickles (multiprocessing, xdist) find the class by that path.
    assert getattr(deterministic_ctx, cls.__qualname__) is cls
    assert pickle.loads(pickle.dumps(cls)) is cls


def test_a_traceback_names_the_public_path(tmp_path):
    import traceback

    path = tmp_path / "not-a-snapshot.bin"
    path.write_bytes(b"hello")
    with pytest.raises(deterministic_ctx.InvalidSnapshotError) as info:
        deterministic_ctx.Snapshot.load(path)
    last = traceback.format_exception_only(info.type, info.value)[-1]
    assert last.startswith("deterministic_ctx.InvalidSnapshotError: invalid snapshot"), last


def test_the_base_classes_catch_what_the_library_raises():
    with pytest.raises(deterministic_ctx.DeterministicCtxError):
        deterministic_ctx.Snapshot.from_state_dict({})
    with pytest.raises(deterministic_ctx.DeterministicCtxError):
        # A counter answers 0, then 1: never the same twice.
        deterministic_ctx.assert_reproducible(itertools.count().__next__)


# -- no import cycles: TYPE_CHECKING imports included (lint-imports leaves those out,
# and checks layers, not modules within one) ------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, wherever in the file."""
    package = _module_name(path).split(".")
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
    return found & known - {_module_name(path)}


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
    known = {_module_name(p) for p in paths}
    # The package's root re-exports the public names lazily (``_WHERE``): not
    # an arrow between modules.
    graph = {
        _module_name(p): {m for m in _imports(p, known) if m != "deterministic_ctx"} for p in paths
    }
    assert _cycle(graph) == []


def test_the_check_finds_a_cycle_through_three_modules() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
