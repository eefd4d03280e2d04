"""The pytest plugin of deterministic-ctx (registered as ``deterministic_ctx``).

* ``@pytest.mark.deterministic`` / ``@pytest.mark.deterministic(seed=3, warn_only=True)``
  (also ``flags=False``, ``fill_uninitialized_memory=False``, as for ``deterministic``): the
  test and its function-scoped fixtures run inside one ``deterministic`` block.  The marker also
  works on classes and modules (``pytestmark``); without ``seed``, the session seed is used.
* ``--deterministic-seed=N|last|random`` sets the session seed (default 0), printed in the report
  header; ``--deterministic-all`` runs every test as if marked.
* ``--deterministic-leaks=off|warn|error`` (default ``warn``): report a test that changes the
  determinism flags or environment variables the library manages and does not put them back.
* The ``deterministic_seed`` fixture is the seed the current test runs with.

Importing this module loads neither torch nor NumPy, on purpose: pytest imports every installed
plugin at start-up, in every project of the environment, and the library's engine imports torch
(about a second).  Like Hypothesis' ``_hypothesis_pytestplugin``, the plugin imports the library
only when a test needs a block, or, for the leak guard, once torch is loaded anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import sys
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from .._errors import DeterministicCtxWarning
from .cli import MAX_SEED, parse_seed

if TYPE_CHECKING:
    from .. import Snapshot

__all__ = ["DEFAULT_SEED", "DeterministicLeakWarning", "deterministic_seed"]

#: The session seed when ``--deterministic-seed`` is not given: runs are reproducible by default.
#: It is also the seed of a bare ``@reproducible``.
DEFAULT_SEED = 0

_MARKER = "deterministic"
_MARKER_ARGS = ("seed", "warn_only", "flags", "fill_uninitialized_memory", "compiled_rng")
_CACHE_KEY = "deterministic_ctx/seed"
_WORKER_KEY = "deterministic_ctx_seed"
_LEAK_MODES = ("off", "warn", "error")


class DeterministicLeakWarning(DeterministicCtxWarning, UserWarning):
    """A test changed determinism flags or environment variables and did not restore them.

    Emitted by the leak guard in ``--deterministic-leaks=warn`` mode (the default); in ``error``
    mode the same message fails the test at teardown instead.  The guard only reports: it never
    puts the state back itself, so the suite behaves as it would without the plugin.

    Example:
        >>> issubclass(DeterministicLeakWarning, UserWarning)
        True
    """


@dataclasses.dataclass(frozen=True)
class _Session:
    seed: int
    run_all: bool
    leaks: str


@dataclasses.dataclass
class _Run:
    """How one test runs in a block, and the block's state at the end of its setup."""

    seed: int
    from_marker: bool
    #: The block's other arguments: the marker's (``warn_only``, ``flags``,
    #: ``fill_uninitialized_memory``, ``compiled_rng``) as given, ``warn_only`` first and
    #: ``False`` unless given, as a failure's report always shows it.
    options: dict[str, object] = dataclasses.field(default_factory=lambda: {"warn_only": False})
    inner: Snapshot | None = None


_SESSION = pytest.StashKey[_Session]()
_RUN = pytest.StashKey[_Run]()


def _seed_option(value: str) -> int | str:
    if value in ("last", "random"):
        return value
    try:
        return parse_seed(value)  # the CLI's: it imports no torch either
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer in 0 .. {MAX_SEED}, 'last' or 'random', got {value!r}"
        ) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deterministic_ctx", "deterministic-ctx: reproducible, isolated tests")
    group.addoption(
        "--deterministic-seed",
        dest="deterministic_seed",
        metavar="N|last|random",
        type=_seed_option,
        default=DEFAULT_SEED,
        help=f"seed of marked tests that give none (default {DEFAULT_SEED}); 'last' reuses the "
        "previous run's seed, 'random' draws a new one.  The report header shows the seed.",
    )
    group.addoption(
        "--deterministic-all",
        dest="deterministic_all",
        action="store_true",
        default=False,
        help="run every test as if marked @pytest.mark.deterministic.",
    )
    group.addoption(
        "--deterministic-leaks",
        dest="deterministic_leaks",
        choices=_LEAK_MODES,
        default="warn",
        help="what to do when a test leaves torch determinism flags or the environment variables "
        "deterministic-ctx manages (CUBLAS_WORKSPACE_CONFIG, PYTHONHASHSEED, PL_GLOBAL_SEED, ...; "
        "see managed_env_vars()) changed: off, warn (default) or error (fail the test at "
        "teardown).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(seed=None, warn_only=False, flags=True, fill_uninitialized_memory=True, "
        "compiled_rng=None): "
        f"run the test and its function-scoped fixtures in "
        "one deterministic_ctx block; seed defaults to --deterministic-seed.",
    )
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks())
    config.stash[_SESSION] = _Session(
        _session_seed(config),
        bool(config.getoption("deterministic_all")),
        str(config.getoption("deterministic_leaks")),
    )


def _session_seed(config: pytest.Config) -> int:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and _WORKER_KEY in workerinput:
        # pytest-xdist worker: the controller resolved the seed (and wrote the cache).
        return int(workerinput[_WORKER_KEY])
    option = config.getoption("deterministic_seed")
    cache: pytest.Cache | None = getattr(config, "cache", None)
    if option == "random":
        seed = secrets.randbits(32)  # not the global RNG: drawing must not change it
    elif option == "last":
        if cache is None:
            raise pytest.UsageError(
                "--deterministic-seed=last needs pytest's cache, but the cacheprovider plugin "
                "is disabled"
            )
        last = cache.get(_CACHE_KEY, DEFAULT_SEED)
        valid = isinstance(last, int) and not isinstance(last, bool) and 0 <= last <= MAX_SEED
        seed = last if valid else DEFAULT_SEED
    else:
        seed = int(option)
    if cache is not None:
        cache.set(_CACHE_KEY, seed)
    return seed


class _XdistHooks:
    """Registered only when pytest-xdist is active: its hooks are unknown to pytest otherwise."""

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[_WORKER_KEY] = node.config.stash[_SESSION].seed


def pytest_report_header(config: pytest.Config) -> str:
    session = config.stash[_SESSION]
    extra = " --deterministic-all" if session.run_all else ""
    return (
        f"deterministic-ctx: --deterministic-seed={session.seed}{extra} "
        f"--deterministic-leaks={session.leaks}"
    )


def _run_for(item: pytest.Item, session: _Session) -> _Run | None:
    """The block ``item`` runs in (``None``: none), from its closest marker or the options."""
    marker = item.get_closest_marker(_MARKER)
    if marker is None:
        return _Run(session.seed, from_marker=False) if session.run_all else None
    where = f"@pytest.mark.{_MARKER} on {item.nodeid}"
    if marker.args:
        pytest.fail(
            f"{where}: takes keyword arguments only (seed=..., warn_only=...), "
            f"got positional {marker.args!r}",
            pytrace=False,
        )
    unknown = sorted(set(marker.kwargs) - set(_MARKER_ARGS))
    if unknown:
        pytest.fail(
            f"{where}: unknown argument(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(_MARKER_ARGS)}",
            pytrace=False,
        )
    seed = marker.kwargs.get("seed")
    return _Run(
        session.seed if seed is None else seed,
        from_marker=seed is not None,
        options={"warn_only": False, **{k: v for k, v in marker.kwargs.items() if k != "seed"}},
    )


@pytest.fixture(autouse=True)
def _deterministic_ctx(request: pytest.FixtureRequest) -> Iterator[None]:
    # Autouse and function-scoped, defined by a plugin: pytest sets it up after every fixture of
    # a wider scope and before every other function-scoped one, and tears it down last.  So the
    # block holds exactly the test and its function-scoped fixtures.
    item = request.node
    session = request.config.stash[_SESSION]
    run = _run_for(item, session)
    if run is None:
        yield from _leak_guard(item, session.leaks)
        return

    from .. import deterministic

    try:
        block = deterministic(run.seed, **run.options)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        pytest.fail(f"@pytest.mark.{_MARKER} on {item.nodeid}: {exc}", pytrace=False)
    runtest = item.runtest

    def runtest_in_block() -> None:
        # Between setup and call other plugins run their hooks: pytest-randomly reseeds
        # ``random`` and NumPy there.  Putting the block's state back makes the test body
        # continue the stream its fixtures drew from, as one block promises.
        if run.inner is not None:
            run.inner.restore()
        runtest()

    with block:
        item.stash[_RUN] = run
        item.runtest = runtest_in_block
        try:
            yield
        finally:
            del item.runtest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, None]:
    outcome = yield
    run = item.stash.get(_RUN, None)
    if run is not None and outcome.excinfo is None:  # each setup makes a _Run: inner is None
        from .. import Snapshot

        run.inner = Snapshot.capture()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    run = item.stash.get(_RUN, None)
    if run is None or not report.failed:
        return
    if run.from_marker:
        origin = f"from @pytest.mark.{_MARKER}(seed={run.seed})"
    else:
        origin = f"from the session; replay with --deterministic-seed={run.seed}"
    text = f"ran in a deterministic block: seed={run.seed} ({origin})"
    text += "".join(f", {key}={value!r}" for key, value in run.options.items())
    # A traceback's own section prints right under it, even with --show-capture=no.
    addsection = getattr(report.longrepr, "addsection", None)
    if addsection is not None:
        addsection("deterministic-ctx", text)
    else:
        report.sections.append(("deterministic-ctx", text))


@pytest.fixture
def deterministic_seed(request: pytest.FixtureRequest) -> int:
    """The seed the current test runs with: its marker's, else the session seed.

    Unmarked tests get the session seed too, to seed their own generators with.

    Example::

        @pytest.mark.deterministic(seed=3)
        def test_noise(deterministic_seed):
            assert deterministic_seed == 3
    """
    run = request.node.stash.get(_RUN, None)
    return run.seed if run is not None else request.config.stash[_SESSION].seed


# -- leak guard -------------------------------------------------------------------------------


def _leak_guard(item: pytest.Item, mode: str) -> Iterator[None]:
    # Without torch loaded no flag can have been set, and loading it here would cost every
    # test suite of the environment a second; a test that first imports torch is not guarded.
    if mode == "off" or "torch" not in sys.modules:
        yield
        return
    before = _managed_state()
    yield
    after = _managed_state()
    changed = [
        f"{name} ({was!r} -> {after[name]!r})"
        for name, was in before.items()
        # None: a torch flag whose module was not imported yet (inductor's), which a test may
        # import; for an environment variable it means unset, and setting it is a change.
        # A name missing after the test was unregistered by it (only tests do that).
        if name in after and after[name] != was and (was is not None or name.startswith("$"))
    ]
    if not changed:
        return
    message = (
        f"deterministic-ctx: {item.nodeid} changed {', '.join(changed)} and did not put it back"
    )
    if mode == "error":
        pytest.fail(message, pytrace=False)
    filename, lineno, _ = item.location
    # Point at the test rather than at this plugin.
    warnings.warn_explicit(message, DeterministicLeakWarning, filename, (lineno or 0) + 1)


def _managed_state() -> dict[str, Any]:
    """The flags and environment variables the library manages, by name."""
    from ..internal import managed_env_vars, source_named

    # Only the flags: RNG draws are normal in a test and are not leaks.
    flags = source_named("torch.flags").capture()
    state = {f"torch.{name}": value for name, value in flags._asdict().items()}
    # Every variable a block restores (names registered with register_env_var too), so that
    # the guard reports exactly what a block would have put back.
    for name in managed_env_vars():
        state[f"${name}"] = os.environ.get(name)
    return state
