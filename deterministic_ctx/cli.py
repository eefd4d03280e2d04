"""The command line: ``deterministic-ctx`` / ``python -m deterministic_ctx``.

Two subcommands:

* ``report [--json] [--init-cuda]`` prints the determinism report of a fresh
  interpreter (see :func:`deterministic_ctx.reporting.report`).
* ``run [--seed N] [--warn-only] [--no-flags] [--no-fill] [--compiled-rng eager]
  [--] script.py [args ...]`` (or ``-m module``)
  runs an unmodified script as ``python script.py args ...`` would, after
  applying :func:`~deterministic_ctx.seed_everything` settings, so that it
  draws the same numbers on every run.

``PYTHONHASHSEED`` only takes effect when an interpreter starts, so ``run``
restarts the interpreter once with ``PYTHONHASHSEED`` set to the seed when it
is not already: ``str`` and ``bytes`` hashes, and so the iteration order of
sets, are then the same on every run too.  Everything up to that restart
(parsing, checking the script exists) imports neither torch nor NumPy, so the
interpreter that is thrown away costs milliseconds, not the seconds torch takes
to load; the engine is imported only in the restarted interpreter.

Exit codes: ``0`` success; for ``run``, the script's own exit status
(``sys.exit(n)`` gives ``n``; an uncaught exception ``1``, its traceback
printed as Python prints it); ``2`` a usage error (bad arguments, a script or
module that does not exist); ``130`` interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple

# The version only: a leaf module, so ``--version`` and ``run``'s restart load no torch.
from ._version import __version__

# Nothing from the engine here: ``deterministic_ctx.internal`` imports torch and
# NumPy, which ``run`` must not load before it restarts the interpreter.

__all__ = ["main"]

PROG = "deterministic-ctx"

#: Exit statuses of the command (the script's own status aside).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: The largest seed (NumPy's legacy global RNG takes 32 bits).  The same value
#: as ``deterministic_ctx.internal.MAX_SEED``, repeated because that module
#: imports torch; ``tests/test_cli.py`` checks that the two agree, and
#: ``seed_everything`` validates the seed again after the restart.
MAX_SEED = 2**32 - 1

_EXIT_CODES = f"""\
exit status:
  {EXIT_OK}    success
  N    run: the script's own exit status (sys.exit(N)); {EXIT_ERROR} if it raised an uncaught
       exception, whose traceback is printed as Python prints it
  {EXIT_USAGE}    usage error: bad arguments, a script or module that does not exist
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
"""

_DESCRIPTION = """\
Reproducible randomness for PyTorch programs from the command line: check an
environment's determinism setup, or run an unmodified script reproducibly.
"""

_EPILOG = f"""\
examples:
  {PROG} report
  {PROG} report --json > determinism.json
  {PROG} run --seed 3 -- train.py --epochs 2
  {PROG} run -m mypackage.train --epochs 2
  python -m deterministic_ctx run train.py

{_EXIT_CODES}"""

_RUN_USAGE = f"""\
{PROG} run [-h] [--seed N] [--warn-only] [--no-flags] [--no-fill]
                             [--compiled-rng eager] [--] script.py [args ...]
       {PROG} run [options] -m module [args ...]"""

_RUN_DESCRIPTION = """\
Run a Python script as `python script.py args ...` would (as __main__, with
sys.argv set to [script.py, args ...] and the script's directory first on
sys.path), after seeding Python's random, NumPy's global RNG and torch
exactly as random.seed(N); np.random.seed(N); torch.manual_seed(N) would,
and turning deterministic algorithms on (seed_everything(N)). The script
needs no change to become reproducible.

PYTHONHASHSEED only takes effect when Python starts, so when it is not
already N the interpreter is restarted once with PYTHONHASHSEED=N: string
hashes and set iteration order are then reproducible as well (export
PYTHONHASHSEED=N beforehand to skip the restart). Child processes inherit it.

The options above end at the script (or module) name: everything after it
goes to the script. `--` may separate them."""

_RUN_EPILOG = f"""\
examples:
  {PROG} run train.py --lr 0.1            # seed 0
  {PROG} run --seed 3 -- train.py --seed-is-not-mine 7
  {PROG} run --warn-only -m mypackage.train

exit status: the script's own (sys.exit(N) gives N, an uncaught exception
{EXIT_ERROR}, Ctrl-C {EXIT_INTERRUPTED}); {EXIT_USAGE} for a usage error or a script or module that
does not exist.
"""

_REPORT_DESCRIPTION = """\
Print the determinism setup of a fresh Python process in this environment:
library versions, determinism flags, the relevant environment variables,
which RNGs are seeded, CUDA facts and warnings for known problems. The
report never initializes CUDA itself; pass --init-cuda to include device
facts (device names, cuDNN version)."""


def _seed_argument(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``0 .. 2**32 - 1``.

    Parsed without the library's ``validate_seed``, which would import NumPy
    before ``run`` decides to restart the interpreter.
    """
    with contextlib.suppress(ValueError):  # not an integer: the same error as out of range
        seed = int(text, 10)
        if 0 <= seed <= MAX_SEED:
            return seed
    raise argparse.ArgumentTypeError(f"must be an integer in 0 .. {MAX_SEED}, got {text!r}")


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its ``run`` subparser."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{report,run}")
    commands.required = True

    report = commands.add_parser(
        "report",
        help="print this environment's determinism setup and known problems",
        description=_REPORT_DESCRIPTION,
        epilog=_EXIT_CODES,
        formatter_class=formatter,
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON, for tools")
    report.add_argument(
        "--init-cuda",
        action="store_true",
        help="initialize CUDA first, so the report includes device facts "
        "(does nothing where CUDA is not available)",
    )

    run = commands.add_parser(
        "run",
        help="run a Python script reproducibly",
        usage=_RUN_USAGE,
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=formatter,
    )
    run.add_argument(
        "--seed",
        type=_seed_argument,
        default=0,
        metavar="N",
        help=f"the seed, an integer in 0 .. {MAX_SEED} (default: 0)",
    )
    run.add_argument(
        "--warn-only",
        action="store_true",
        help="operations without a deterministic implementation warn instead of raising",
    )
    run.add_argument(
        "--no-flags",
        action="store_true",
        help="seed only: leave the determinism flags and variables as they are",
    )
    run.add_argument(
        "--no-fill",
        action="store_true",
        help="torch.utils.deterministic.fill_uninitialized_memory off",
    )
    run.add_argument(
        "--compiled-rng",
        choices=["eager"],
        default=None,
        help="eager: code compiled with torch.compile draws eager's random numbers "
        "(inductor's fallback_random)",
    )
    run.add_argument(
        "-m",
        dest="module",
        metavar="module",
        help="run a library module as a script, like python -m module",
    )
    return parser, run


#: ``run`` options that take a value, for splitting the command line at the script.
_RUN_VALUE_OPTIONS = ("--seed", "--compiled-rng", "-m")


def _split_run(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the words after ``run`` into our options and the script's command.

    Like ``python`` itself, our options end at the first word that is not one
    of them (the script), at ``--``, or right after ``-m module``.

    Example:
        >>> _split_run(["--seed", "3", "train.py", "--seed", "5"])
        (['--seed', '3'], ['train.py', '--seed', '5'])
        >>> _split_run(["--", "train.py"])
        ([], ['train.py'])
        >>> _split_run(["-m", "pkg.mod", "-v"])
        (['-m', 'pkg.mod'], ['-v'])
    """
    options: list[str] = []
    rest = list(tokens)
    while rest and _is_option(rest[0]):
        token = rest.pop(0)
        options.append(token)
        if token in _RUN_VALUE_OPTIONS and rest:
            options.append(rest.pop(0))
        if token.startswith("-m"):  # -m module, or -mmodule: the module's arguments follow
            return options, rest
    return options, rest[1:] if rest[:1] == ["--"] else rest


def _is_option(word: str) -> bool:
    """Whether ``word`` is one of our options (``-`` is stdin's name and ``--`` the separator)."""
    return word.startswith("-") and word not in ("-", "--")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit status.

    Args:
        argv: the arguments after the program name; ``None`` (the console
            script and ``python -m deterministic_ctx``) reads ``sys.argv``.
            Called with a list, ``run`` runs the script in this process
            (seeding it and changing ``sys.argv`` and ``sys.path`` for good,
            as the script's own process would) and never restarts the
            interpreter, so ``PYTHONHASHSEED`` is then only set for child
            processes.

    Example:
        >>> main(["run", "--seed", "abc", "train.py"])  # the usage error goes to stderr
        2
    """
    from_command_line = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    parser, run_parser = _parsers()
    command: list[str] = []
    if args and args[0] == "run":
        options, command = _split_run(args[1:])
        args = ["run", *options]
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if ns.command == "report":
        return _report(as_json=ns.json, init_cuda=ns.init_cuda)
    return _run(
        run_parser,
        seed=ns.seed,
        warn_only=ns.warn_only,
        flags=not ns.no_flags,
        fill_uninitialized_memory=not ns.no_fill,
        compiled_rng=ns.compiled_rng,
        module=ns.module,
        command=command,
        restart=from_command_line,
    )


# --- report ---------------------------------------------------------------------------------------


def _report(*, as_json: bool, init_cuda: bool) -> int:
    from .reporting import report

    if init_cuda:
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()  # type: ignore[no-untyped-call]
    r = report()
    if as_json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        print(r)
    return EXIT_OK


# --- run ------------------------------------------------------------------------------------------


class _Target(NamedTuple):
    """What ``run`` runs: a script file or, with ``-m``, a module; and its arguments."""

    name: str
    args: list[str]
    is_module: bool

    @property
    def path0(self) -> str:
        """``sys.path[0]`` as ``python`` sets it: the current directory for ``-m``,
        the script's own directory otherwise."""
        if self.is_module:
            return os.getcwd()
        return os.path.dirname(os.path.abspath(self.name))

    def run(self) -> None:
        """Run it as ``__main__``, as ``python script.py`` / ``python -m module`` would."""
        if self.is_module:
            runpy.run_module(self.name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(self.name, run_name="__main__")


class _UsageError(Exception):
    """A usage error of ``run``: printed as ``deterministic-ctx run: error: ...``, status 2."""

    def __init__(self, message: str, *, show_usage: bool = False) -> None:
        super().__init__(message)
        self.show_usage = show_usage


def _run(
    parser: argparse.ArgumentParser,
    *,
    seed: int,
    warn_only: bool,
    flags: bool,
    fill_uninitialized_memory: bool,
    compiled_rng: str | None,
    module: str | None,
    command: list[str],
    restart: bool,
) -> int:
    """``run``: check the target, restart for ``PYTHONHASHSEED``, seed, then run the target."""
    try:
        target = _target(module, command)
        status = _restart_with_hashseed(seed) if restart else None
        if status is not None:  # Windows: the restarted command ran in a child process
            return status
        # From here on this is the interpreter that runs the script: only now
        # does the engine, and with it torch and NumPy, get imported.
        _set_up_main(target)
        from .seeding import seed_everything

        seed_everything(
            seed,
            warn_only=warn_only,
            flags=flags,
            fill_uninitialized_memory=fill_uninitialized_memory,
            compiled_rng=compiled_rng,  # type: ignore[arg-type]  # argparse checked the choice
        )
        _find_module(target)
    except _UsageError as exc:
        if exc.show_usage:
            parser.print_usage(sys.stderr)
        print(f"{PROG} run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return _execute(target)


def _target(module: str | None, command: list[str]) -> _Target:
    """The script (the first word of ``command``, which must exist) or the module to run.

    Raises:
        _UsageError: no script was given, or the script does not exist.
    """
    if module is not None:
        return _Target(module, command, is_module=True)
    if not command:
        raise _UsageError("a script (or -m module) is required", show_usage=True)
    script, *script_args = command
    if not os.path.exists(script):
        raise _UsageError(f"can't open file {script!r}: no such file or directory")
    return _Target(script, script_args, is_module=False)


def _set_up_main(target: _Target) -> None:
    """Set ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them for ``target``."""
    sys.argv[:] = [target.name, *target.args]
    if getattr(sys.flags, "safe_path", False):  # python -P: nothing is put in front
        return
    if sys.path:
        sys.path[0] = target.path0
    else:
        sys.path.insert(0, target.path0)


def _find_module(target: _Target) -> None:
    """Check that the module of ``-m`` exists; a script was checked before the restart.

    Called after seeding: finding a module imports its parent packages, which
    are part of the program and may draw random numbers at import.

    Raises:
        _UsageError: the module, or one of its parent packages, cannot be found.
    """
    if not target.is_module:
        return
    try:
        found = importlib.util.find_spec(target.name) is not None
    except (ImportError, ValueError) as exc:
        raise _UsageError(f"cannot find module {target.name!r}: {exc}") from None
    if not found:
        raise _UsageError(f"no module named {target.name!r}")


def _execute(target: _Target) -> int:
    """Run ``target`` and return its exit status; its ``SystemExit`` propagates.

    ``SystemExit`` is left to Python, which prints a message and picks the
    status exactly as for ``python script.py``; any other exception is printed
    as Python prints an uncaught one.
    """
    try:
        target.run()
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        return EXIT_INTERRUPTED
    except BaseException as exc:
        _print_exception(exc)
        return EXIT_ERROR
    return EXIT_OK


def _restart_with_hashseed(seed: int) -> int | None:
    """Restart this command with ``PYTHONHASHSEED=seed``; ``None`` if not needed.

    On POSIX the process is replaced (``os.execv``: same pid, same standard
    streams, signals go to the script), so this returns only on Windows,
    where the command runs in a child process whose status is returned.
    """
    value = str(seed)
    if os.environ.get("PYTHONHASHSEED") == value:
        return None
    if sys.flags.ignore_environment:
        print(
            f"{PROG} run: note: python -E/-I ignores PYTHONHASHSEED; str hashes and set order "
            "stay randomized in this run",
            file=sys.stderr,
        )
        return None
    argv = [sys.executable, *sys.orig_argv[1:]]
    env = {**os.environ, "PYTHONHASHSEED": value}
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":  # pragma: no cover - os.execv does not keep the exit status on Windows
        try:
            return subprocess.call(argv, env=env)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable")  # pragma: no cover


def _print_exception(exc: BaseException) -> None:
    """Print ``exc`` as Python prints an uncaught exception, without our own frames."""
    ours = (__name__, runpy.__name__)
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in ours:
        tb = tb.tb_next
    exc.__traceback__ = tb  # the default hook prints the exception's own traceback
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # a broken excepthook: fall back to the standard format
        traceback.print_exception(type(exc), exc, tb)
