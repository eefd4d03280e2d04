"""The command line: ``deterministic-ctx`` / ``python -m deterministic_ctx``.

Two subcommands:

* ``report [--json] [--init-cuda]`` prints the determinism report of a fresh
  interpreter (see :func:`deterministic_ctx.report.report`).
* ``run [--seed N] [--warn-only] [--] script.py [args ...]`` (or ``-m module``)
  runs an unmodified script as ``python script.py args ...`` would, after
  applying :func:`~deterministic_ctx.seed_everything` settings, so that it
  draws the same numbers on every run.

``PYTHONHASHSEED`` only takes effect when an interpreter starts, so ``run``
restarts the interpreter once with ``PYTHONHASHSEED`` set to the seed when it
is not already: ``str`` and ``bytes`` hashes, and so the iteration order of
sets, are then the same on every run too.

Exit codes: ``0`` success; for ``run``, the script's own exit status
(``sys.exit(n)`` gives ``n``; an uncaught exception ``1``, its traceback
printed as Python prints it); ``2`` a usage error (bad arguments, a script or
module that does not exist); ``130`` interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType

from ._seed import MAX_SEED, validate_seed

__all__ = ["main"]

PROG = "deterministic-ctx"

#: Exit statuses of the command (the script's own status aside).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

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
{PROG} run [-h] [--seed N] [--warn-only] [--] script.py [args ...]
       {PROG} run [-h] [--seed N] [--warn-only] -m module [args ...]"""

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


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``0 .. 2**32 - 1``."""
    try:
        return validate_seed(int(text, 10))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in 0 .. {MAX_SEED}, got {text!r}"
        ) from None


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its ``run`` subparser."""
    from . import __version__

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
        type=_seed,
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
        "-m",
        dest="module",
        metavar="module",
        help="run a library module as a script, like python -m module",
    )
    return parser, run


#: ``run`` options that take a value, for splitting the command line at the script.
_RUN_VALUE_OPTIONS = ("--seed", "-m")


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
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return options, list(tokens[i + 1 :])
        if not token.startswith("-") or token == "-":
            return options, list(tokens[i:])
        options.append(token)
        if token in _RUN_VALUE_OPTIONS and i + 1 < len(tokens):
            options.append(tokens[i + 1])
            i += 1
            if token == "-m":
                return options, list(tokens[i + 1 :])
        elif token.startswith("-m") and not token.startswith("--"):
            return options, list(tokens[i + 1 :])  # -mpkg.mod
        i += 1
    return options, []


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
        module=ns.module,
        command=command,
        restart=from_command_line,
    )


# --- report ---------------------------------------------------------------------------------------


def _report(*, as_json: bool, init_cuda: bool) -> int:
    from .report import report

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


def _run(
    parser: argparse.ArgumentParser,
    *,
    seed: int,
    warn_only: bool,
    module: str | None,
    command: list[str],
    restart: bool,
) -> int:
    if module is None:
        if not command:
            parser.print_usage(sys.stderr)
            print(f"{PROG} run: error: a script (or -m module) is required", file=sys.stderr)
            return EXIT_USAGE
        script, *script_args = command
        if not os.path.exists(script):
            print(
                f"{PROG} run: error: can't open file {script!r}: no such file or directory",
                file=sys.stderr,
            )
            return EXIT_USAGE
    else:
        script, script_args = module, command

    if restart:
        status = _restart_with_hashseed(seed)
        if status is not None:
            return status

    # What `python script.py args` / `python -m module args` set up.
    sys.argv[:] = [script, *script_args]
    if not getattr(sys.flags, "safe_path", False):
        first = os.getcwd() if module is not None else os.path.dirname(os.path.abspath(script))
        if sys.path:
            sys.path[0] = first
        else:
            sys.path.insert(0, first)

    from .seeding import seed_everything

    seed_everything(seed, warn_only=warn_only)
    # After seeding: finding the module imports its parent packages, which are
    # part of the program.  A missing module is a usage error.
    if module is not None:
        import importlib.util

        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as exc:
            print(f"{PROG} run: error: cannot find module {module!r}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not found:
            print(f"{PROG} run: error: no module named {module!r}", file=sys.stderr)
            return EXIT_USAGE

    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise  # the script's own exit status, with Python's own handling of it
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
