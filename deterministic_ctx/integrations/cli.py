"""The command line: ``deterministic-ctx`` / ``python -m deterministic_ctx``.

Four subcommands:

* ``report [--json] [--init-cuda]`` prints the determinism report of a fresh
  interpreter (see :func:`deterministic_ctx.reporting.report`).
* ``run [--seed N] [--warn-only] [--no-flags] [--no-fill] [--compiled-rng eager]
  [--deterministic-collectives] [--] script.py [args ...]`` (or ``-m module``)
  runs an unmodified script as ``python script.py args ...`` would, after
  applying :func:`~deterministic_ctx.seed_everything` settings, so that it
  draws the same numbers on every run; ``--deterministic-collectives`` sets
  NCCL's variables for reductions in a fixed order (``DETERMINISTIC_COLLECTIVES``)
  in its environment, before it can start a process group.
* ``trace record [run's options] [--backward] [--ops] OUT [--] script.py [args ...]``
  runs a script as ``run`` does, in a ``deterministic`` block of those
  settings, and writes its trace to ``OUT`` (see :mod:`deterministic_ctx.trace`;
  ``--ops`` records every aten op call too);
  ``trace compare [--json] A B`` compares two trace files, recorded on any
  machines.
* ``check-resume --at K [--at K ...] [--keep] [--timeout S] [--json] [--]
  script.py [args ...]`` (or ``-m module``) proves that a training script
  resumes bit for bit: it runs the script uninterrupted, then for each ``K``
  kills it with ``SIGKILL`` once the checkpoint of step ``K`` is on disk and
  starts it again to resume, each in a fresh working directory, and compares
  every step's record (data, RNG state, loss) with the uninterrupted run's
  (see :mod:`deterministic_ctx.integrations.check_resume`; the script makes
  the records with ``record_step`` and ``checkpoint_saved``, or the Lightning
  and transformers callbacks).

``PYTHONHASHSEED`` only takes effect when an interpreter starts, so ``run``
(and ``trace record``) restarts the interpreter once with ``PYTHONHASHSEED`` set to the seed when it
is not already: ``str`` and ``bytes`` hashes, and so the iteration order of
sets, are then the same on every run too.  Everything up to that restart
(parsing, checking the script exists) imports neither torch nor NumPy, so the
interpreter that is thrown away costs milliseconds, not the seconds torch takes
to load; the engine is imported only in the restarted interpreter.

Exit codes: ``0`` success (for ``trace compare``: the traces agree; for
``check-resume``: every resumed run matches the uninterrupted run); for
``trace compare``, ``1`` when the traces differ; for ``check-resume``, ``1``
when a resumed run differs from the uninterrupted run (or fails), or the runs
differ even before the restart; for ``run`` and ``trace record``, the
script's own exit status (``sys.exit(n)`` gives ``n``; an uncaught exception
``1``, its traceback printed as Python prints it); ``2`` a usage error (bad
arguments, a script or module that does not exist, a file that is not a
trace) and, for ``check-resume``, a check that could not be made (the
uninterrupted run failed or recorded no step, or a run to interrupt did not
end by ``SIGKILL`` after the checkpoint of step ``K``); ``130`` interrupted
by Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NamedTuple

# The version only: a leaf module, so ``--version`` and ``run``'s restart load no torch.
from .._errors import DeterministicCtxError
from ..base.version import __version__

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
#: imports torch; ``tests/integrations/test_cli.py`` checks that the two agree, and
#: ``seed_everything`` validates the seed again after the restart.
MAX_SEED = 2**32 - 1
#: The signature of trace files, ``deterministic_ctx.trace.TRACE_FILE.magic``: repeated for the
#: same reason, and checked the same way.
TRACE_MAGIC = b"\x89DCT\r\n\x1a\n"

_EXIT_CODES = f"""\
exit status:
  {EXIT_OK}    success (trace compare: the traces agree; check-resume: every resumed run
       matches the uninterrupted run)
  {EXIT_ERROR}    trace compare: the traces differ
  {EXIT_ERROR}    check-resume: a resumed run differs (first differing step named), or fails
  N    run, trace record: the script's own exit status (sys.exit(N)); {EXIT_ERROR} if it raised
       an uncaught exception, whose traceback is printed as Python prints it
  {EXIT_USAGE}    usage error: bad arguments, a script or module that does not exist, a file
       that is not a trace; check-resume: nothing to compare (the uninterrupted run
       failed or recorded no step, or a run did not end by SIGKILL at checkpoint K)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
"""

_DESCRIPTION = """\
Reproducible randomness for PyTorch programs from the command line: check an
environment's determinism setup, run an unmodified script reproducibly, or
record its trace on one machine and compare it with another's.
"""

_EPILOG = f"""\
examples:
  {PROG} report
  {PROG} report --json > determinism.json
  {PROG} run --seed 3 -- train.py --epochs 2
  {PROG} run -m mypackage.train --epochs 2
  python -m deterministic_ctx run train.py
  {PROG} trace record a.trace -- train.py --epochs 1
  {PROG} trace compare a.trace b.trace
  {PROG} check-resume --at 6 --at 8 -- train.py --epochs 2

{_EXIT_CODES}"""

_RUN_USAGE = f"""\
{PROG} run [-h] [--seed N] [--warn-only] [--no-flags] [--no-fill]
                             [--compiled-rng eager] [--deterministic-collectives]
                             [--] script.py [args ...]
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

--deterministic-collectives sets NCCL_ALGO=Ring, NCCL_NVLS_ENABLE=0 and
NCCL_COLLNET_ENABLE=0 in the script's environment (replacing other values),
so that NCCL all-reduces sum in the same order on every run: NCCL reads them
when the script starts its process group. To launch several ranks, run
torchrun under it (`run --deterministic-collectives -m torch.distributed.run
...`), or it under torchrun (`torchrun ... -m deterministic_ctx run ...`).

The options above end at the script (or module) name: everything after it
goes to the script. `--` may separate them."""

_SCRIPT_EXIT = f"""\
exit status: the script's own (sys.exit(N) gives N, an uncaught exception {EXIT_ERROR});
{EXIT_INTERRUPTED} when interrupted (Ctrl-C), and then no trace is written; {EXIT_USAGE} for a usage
error or a script or module that does not exist.
"""

_RUN_EPILOG = f"""\
examples:
  {PROG} run train.py --lr 0.1            # seed 0
  {PROG} run --seed 3 -- train.py --seed-is-not-mine 7
  {PROG} run --warn-only -m mypackage.train
  {PROG} run --deterministic-collectives -m torch.distributed.run --nproc-per-node=2 t.py

{_SCRIPT_EXIT}"""

_REPORT_DESCRIPTION = """\
Print the determinism setup of a fresh Python process in this environment:
library versions, determinism flags, the relevant environment variables,
which RNGs are seeded, CUDA facts and warnings for known problems. The
report never initializes CUDA itself; pass --init-cuda to include device
facts (device names, cuDNN version)."""

_TRACE_DESCRIPTION = """\
Record the trace of a script on one machine, and compare traces recorded on
different machines, GPU models, thread counts or library versions: the first
module call whose results differ, and the facts of the environments that
differ, most likely culprits first."""

_TRACE_RECORD_USAGE = f"""\
{PROG} trace record [-h] [--seed N] [--backward] [--ops] [--warn-only]
                                      [--no-flags] [--no-fill] [--compiled-rng eager]
                                      OUT [--] script.py [args ...]
       {PROG} trace record [options] OUT -m module [args ...]"""

_TRACE_RECORD_DESCRIPTION = """\
Run a Python script as `deterministic-ctx run` does (as __main__, seeded as
random.seed(N); np.random.seed(N); torch.manual_seed(N) would, deterministic
algorithms on, PYTHONHASHSEED=N), inside one deterministic block whose global
module hooks fingerprint the outputs of every module call of the whole script
(with --backward, the gradients too; with --ops, every aten op call too, with
the line of the script that made it), then write the trace to OUT: those
fingerprints, the final parameters and buffers of every model, the tensors
left in the script's global variables (a script has no return value), and
the environment (versions, CPU, threads, CUDA devices once the script used
CUDA, precision and determinism flags). The trace is written also when the
script exits with an error (not when interrupted); the exit status is the
script's. `trace compare` of two traces recorded with --ops names the first
op call whose results differ, and its file:line; --ops makes the script run
several times slower and the file larger: record a step or two.

The options end at the script (or module) name, after OUT: everything after
it goes to the script. `--` may separate them."""

_TRACE_RECORD_EPILOG = f"""\
examples:
  {PROG} trace record a.trace train.py --steps 2
  {PROG} trace record --seed 3 --backward b.trace -- train.py --steps 2
  {PROG} trace record --ops c.trace train.py --steps 1
  {PROG} trace record d.trace -m mypackage.train

{_SCRIPT_EXIT}"""

_TRACE_COMPARE_DESCRIPTION = """\
Compare two traces written by `trace record` or record_trace(): the first
module call (or gradient, return value, final parameter; of two traces
recorded with --ops, the op call, with its file:line) whose fingerprints
differ, and the environment facts that differ, most likely culprits first."""

_TRACE_COMPARE_EPILOG = f"""\
exit status: {EXIT_OK} the traces agree, {EXIT_ERROR} they differ, {EXIT_USAGE} a usage error \
or a file that
is not a readable trace.
"""


_CHECK_RESUME_USAGE = f"""\
{PROG} check-resume [-h] --at K [--at K ...] [--keep] [--timeout S] [--json]
                                    [--] script.py [args ...]
       {PROG} check-resume [options] -m module [args ...]"""

_CHECK_RESUME_DESCRIPTION = """\
Prove that a training script resumes bit for bit after a crash. The script
runs once uninterrupted; then, for each --at K, it runs again until the
checkpoint of step K is on disk, where it is killed (SIGKILL, a real crash),
and is started again in the same directory to resume from its checkpoint.
Every step's record of the interrupted run (up to K) and the resumed run is
compared, in step order, with the uninterrupted run's: a fingerprint of the
step's batch, of the random state it left (random, NumPy, torch) and the
loss's bits. The first step that differs is named, with what differs (data,
then RNG state, then loss), or the steps that are missing or repeated.

Each run starts in a fresh empty working directory (the script's path is
resolved first), so checkpoints written to relative paths never collide and
a resumed run finds its own; give inputs by absolute path. The directories
are removed afterwards unless --keep. The environment passes through to the
script; it runs as `python script.py args ...` (or `python -m module`, with
this directory on PYTHONPATH), output kept and shown when a run fails.

The script makes the records: the Lightning and transformers callbacks do it;
a plain loop adds two lines, `record_step(step, loss=loss, batch=batch)`
after each step and `checkpoint_saved(step)` once a checkpoint is saved
(from deterministic_ctx; they do nothing outside check-resume)."""

_CHECK_RESUME_EPILOG = f"""\
examples:
  {PROG} check-resume --at 6 -- train.py --epochs 2
  {PROG} check-resume --at 3 --at 8 --keep --timeout 600 -m mypackage.train

exit status:
  {EXIT_OK}    every resumed run matches the uninterrupted run
  {EXIT_ERROR}    a resumed run differs (first differing step, and what differs), or fails;
       or the runs differ even before the restart (not reproducible at all)
  {EXIT_USAGE}    usage error (no --at, K not a positive integer, no such script), or nothing
       to compare: the uninterrupted run failed or recorded no step, or a run did
       not end by SIGKILL after reporting the checkpoint of step K
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
"""


def parse_seed(text: str) -> int:
    """argparse type of a seed: an integer in ``0 .. 2**32 - 1``.

    Parsed without the library's ``validate_seed``, which would import NumPy
    before ``run`` decides to restart the interpreter.  The pytest plugin and
    the ``%%deterministic`` magic parse their seeds with it too.
    """
    with contextlib.suppress(ValueError):  # not an integer: the same error as out of range
        seed = int(text, 10)
        if 0 <= seed <= MAX_SEED:
            return seed
    raise argparse.ArgumentTypeError(f"must be an integer in 0 .. {MAX_SEED}, got {text!r}")


def _positive(kind: type[int] | type[float]) -> Any:
    """argparse type of a positive ``int`` (``--at``) or number (``--timeout``)."""

    def parse(text: str) -> int | float:
        with contextlib.suppress(ValueError):
            value = kind(text)
            if value > 0 and value == value and value != float("inf"):
                return value
        noun = "integer" if kind is int else "number"
        raise argparse.ArgumentTypeError(f"must be a positive {noun}, got {text!r}")

    return parse


def _add_switches(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Options that are off unless given (``--warn-only`` sets ``warn_only``), with their help."""
    for dest, text in helps.items():
        parser.add_argument(f"--{dest.replace('_', '-')}", action="store_true", help=text)


def add_block_options(parser: argparse.ArgumentParser, *, seed: str = "--seed") -> None:
    """The options of a deterministic block, which ``run``, ``trace record`` and the
    ``%%deterministic`` magic share: the seed (``--seed N``; ``seed="SEED"``: an optional
    positional) and :class:`~deterministic_ctx.deterministic`'s switches, read back by
    :func:`block_settings`."""
    seed_help = f"the seed, an integer in 0 .. {MAX_SEED} (default: 0)"
    if seed.startswith("-"):
        parser.add_argument(seed, type=parse_seed, default=0, metavar="N", help=seed_help)
    else:
        parser.add_argument(
            "seed", nargs="?", type=parse_seed, default=0, metavar=seed, help=seed_help
        )
    _add_switches(
        parser,
        warn_only="operations without a deterministic implementation warn instead of raising",
        no_flags="seed only: leave the determinism flags and variables as they are",
        no_fill="torch.utils.deterministic.fill_uninitialized_memory off",
    )
    parser.add_argument(
        "--compiled-rng",
        choices=["eager"],
        default=None,
        help="eager: code compiled with torch.compile draws eager's random numbers "
        "(inductor's fallback_random)",
    )


def block_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``deterministic`` (and ``seed_everything``) that the options
    of :func:`add_block_options` ask for."""
    return {
        "seed": ns.seed,
        "warn_only": ns.warn_only,
        "flags": not ns.no_flags,
        "fill_uninitialized_memory": not ns.no_fill,
        "compiled_rng": ns.compiled_rng,
    }


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``run``, which ``trace record`` shares."""
    add_block_options(parser)
    parser.add_argument(
        "-m",
        dest="module",
        metavar="module",
        help="run a library module as a script, like python -m module",
    )


def _parser() -> argparse.ArgumentParser:
    """The command's parser."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{report,run,trace,check-resume}")
    commands.required = True

    report = commands.add_parser(
        "report",
        help="print this environment's determinism setup and known problems",
        description=_REPORT_DESCRIPTION,
        epilog=_EXIT_CODES,
        formatter_class=formatter,
    )
    _add_switches(
        report,
        json="print the report as JSON, for tools",
        init_cuda="initialize CUDA first, so the report includes device facts "
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
    _add_run_options(run)
    _add_switches(
        run,
        deterministic_collectives="set NCCL_ALGO=Ring, NCCL_NVLS_ENABLE=0 and "
        "NCCL_COLLNET_ENABLE=0 for the script and its children, so that NCCL reductions sum "
        "in a fixed order",
    )

    trace = commands.add_parser(
        "trace",
        help="record a script's trace, or compare traces recorded on two machines",
        description=_TRACE_DESCRIPTION,
        epilog=_EXIT_CODES,
        formatter_class=formatter,
    )
    actions = trace.add_subparsers(dest="trace_command", metavar="{record,compare}")
    actions.required = True
    record = actions.add_parser(
        "record",
        help="run a script reproducibly and write its trace",
        usage=_TRACE_RECORD_USAGE,
        description=_TRACE_RECORD_DESCRIPTION,
        epilog=_TRACE_RECORD_EPILOG,
        formatter_class=formatter,
    )
    _add_run_options(record)
    _add_switches(
        record,
        backward="fingerprint the gradients too (each call's inputs and each module's parameters)",
        ops="record every aten op call too (its results' fingerprints and the script's "
        "file:line), so that compare names the first op that differs; several times slower",
    )
    record.add_argument("output", metavar="OUT", help="the trace file to write")
    compare = actions.add_parser(
        "compare",
        help="compare two trace files: the first differing module call, and the environments",
        description=_TRACE_COMPARE_DESCRIPTION,
        epilog=_TRACE_COMPARE_EPILOG,
        formatter_class=formatter,
    )
    _add_switches(compare, json="print the comparison as JSON")
    compare.add_argument("a", metavar="A", help="a trace file")
    compare.add_argument("b", metavar="B", help="another trace file")

    check = commands.add_parser(
        "check-resume",
        help="prove that a training script resumes bit for bit after a crash",
        usage=_CHECK_RESUME_USAGE,
        description=_CHECK_RESUME_DESCRIPTION,
        epilog=_CHECK_RESUME_EPILOG,
        formatter_class=formatter,
    )
    check.add_argument(
        "--at",
        action="append",
        required=True,
        type=_positive(int),
        metavar="K",
        help="crash right after the checkpoint of step K is on disk, then resume (repeatable)",
    )
    check.add_argument(
        "--timeout",
        type=_positive(float),
        default=None,
        metavar="S",
        help="seconds each run of the script may take (default: no limit)",
    )
    _add_switches(
        check,
        keep="keep the working directories, records and output (and print where)",
        json="print the outcome as JSON",
    )
    check.add_argument(
        "-m",
        dest="module",
        metavar="module",
        help="run a library module as a script, like python -m module",
    )
    return parser


#: ``run`` options that take a value, for splitting the command line at the script.
_RUN_VALUE_OPTIONS = ("--seed", "--compiled-rng", "-m")
#: ``check-resume``'s.
_CHECK_VALUE_OPTIONS = ("--at", "--timeout", "-m")


def _split(
    tokens: Sequence[str], *, out: bool = False, values: Sequence[str] = _RUN_VALUE_OPTIONS
) -> tuple[list[str], list[str]]:
    """Split the words after ``run`` (or, with ``out``, ``trace record``) into our options
    and the script's command.

    Like ``python`` itself, our options end at the first word that is not one
    of them (the script), at ``--``, or right after ``-m module``.  With
    ``out`` the first word that is not an option is ``OUT`` and the options may
    go on after it (the word after ``--`` is ``OUT`` if none was given yet).

    Example:
        >>> _split(["--seed", "3", "train.py", "--seed", "5"])
        (['--seed', '3'], ['train.py', '--seed', '5'])
        >>> _split(["--", "train.py"])
        ([], ['train.py'])
        >>> _split(["-m", "pkg.mod", "-v"])
        (['-m', 'pkg.mod'], ['-v'])
        >>> _split(["a.trace", "--seed", "3", "train.py", "--seed", "5"], out=True)
        (['a.trace', '--seed', '3'], ['train.py', '--seed', '5'])
        >>> _split(["--backward", "a.trace", "--", "-odd.py"], out=True)
        (['--backward', 'a.trace'], ['-odd.py'])
    """
    options: list[str] = []
    rest = list(tokens)
    while rest:
        word = rest.pop(0)
        if word == "--":
            if out and rest:  # `--` then OUT: argparse takes it as a positional
                options += ["--", rest.pop(0)]
            return options, rest
        if not word.startswith("-") or word == "-":  # `-` is stdin's name, not an option
            if not out:
                rest.insert(0, word)  # the script
                return options, rest
            out = False
        options.append(word)
        if word in values and rest:
            options.append(rest.pop(0))
        if word.startswith("-m"):  # -m module, or -mmodule: the module's arguments follow
            return options, rest
    return options, rest


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
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if args and args[0] == "run":
        options, command = _split(args[1:])
        args = ["run", *options]
    elif args[:2] == ["trace", "record"]:
        options, command = _split(args[2:], out=True)
        args = ["trace", "record", *options]
    elif args and args[0] == "check-resume":
        options, command = _split(args[1:], values=_CHECK_VALUE_OPTIONS)
        args = ["check-resume", *options]
    try:
        ns = _parser().parse_args(args)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if ns.command == "report":
        return print_report(as_json=ns.json, init_cuda=ns.init_cuda)
    if ns.command == "trace" and ns.trace_command == "compare":
        return _trace_compare(ns.a, ns.b, as_json=ns.json)
    if ns.command == "check-resume":
        return _check_resume(ns, command)
    record = ns.command == "trace"
    try:
        target = _target(ns.module, command)
        if record:
            _check_output(ns.output)
        elif ns.deterministic_collectives:  # before the restart: the new interpreter has them
            _set_collectives()
        status = _restart_with_hashseed(ns.seed) if argv is None else None
        if status is not None:  # Windows: the restarted command ran in a child process
            return status
        # From here on this is the interpreter that runs the script: only now
        # does the engine, and with it torch and NumPy, get imported.
        _set_up_main(target)
        if record:
            return _trace_record(target, block_settings(ns), ns.output, ns.backward, ns.ops)
        return _run(target, block_settings(ns), ns.deterministic_collectives)
    except _UsageError as exc:
        if exc.show_usage:
            print(f"usage: {_TRACE_RECORD_USAGE if record else _RUN_USAGE}", file=sys.stderr)
        print(f"{PROG} {'trace record' if record else 'run'}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


# --- report ---------------------------------------------------------------------------------------


def print_report(*, as_json: bool, init_cuda: bool = False) -> int:
    """The determinism report, printed as text or JSON (``report``, ``%deterministic_report``)."""
    from ..reporting import report

    if init_cuda:
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()  # type: ignore[no-untyped-call]
    r = report()
    print(json.dumps(r.to_dict(), indent=2) if as_json else r)
    return EXIT_OK


# --- run ------------------------------------------------------------------------------------------


class _Target(NamedTuple):
    """What ``run`` runs: a script file or, with ``-m``, a module; and its arguments."""

    name: str
    args: list[str]
    is_module: bool


class _UsageError(DeterministicCtxError):
    """A usage error of ``run``: printed as ``deterministic-ctx run: error: ...``, status 2."""

    def __init__(self, message: str, *, show_usage: bool = False) -> None:
        super().__init__(message)
        self.show_usage = show_usage


def _run(target: _Target, settings: dict[str, Any], collectives: bool) -> int:
    """``run``, once the target is checked and the interpreter restarted: seed, then run it."""
    from ..parallel.seeding import seed_everything

    seed_everything(**settings)
    if collectives:
        # Set in this process when it did not restart: tell the report that they were
        # set before any process group (it cannot know otherwise).
        from ..reporting.collectives import observe

        observe()
    outcome = _Outcome()
    _execute(target, outcome)
    if outcome.exit is not None:
        raise outcome.exit  # Python prints its message and picks the status
    return outcome.status


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
    # The current directory for -m, the script's own directory otherwise.
    path0 = os.getcwd() if target.is_module else os.path.dirname(os.path.abspath(target.name))
    sys.path[:1] = [path0]


def _set_collectives() -> None:
    """Set :data:`~deterministic_ctx.reporting.collectives.DETERMINISTIC_COLLECTIVES` in
    ``os.environ``, saying which values it replaces."""
    # Before the restart: that module, unlike the engine's, imports only the standard library.
    from ..reporting.collectives import DETERMINISTIC_COLLECTIVES

    for name, value in DETERMINISTIC_COLLECTIVES.items():
        before = os.environ.get(name)
        if before is not None and before != value:
            print(f"{PROG} run: note: {name} was {before!r}, now {value!r}", file=sys.stderr)
        os.environ[name] = value


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


# --- trace ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Outcome:
    """How a recorded script ended: its exit status, the ``SystemExit`` to re-raise,
    and whether Ctrl-C stopped it (a script may exit with status 130 itself)."""

    status: int = EXIT_OK
    exit: SystemExit | None = None
    interrupted: bool = False


def _trace_record(
    target: _Target,
    settings: dict[str, Any],
    output: str,
    backward: bool,
    ops: bool,
) -> int:
    """``trace record``, once the target and ``OUT`` are checked and the interpreter
    restarted: run the target in a recording block, write the trace."""
    from ..core.context import deterministic
    from ..trace import record_in, script_result

    outcome = _Outcome()

    def script() -> dict[str, Any] | None:
        namespace = _execute(target, outcome)  # in the block: see _execute
        return None if namespace is None else script_result(namespace)

    name = f"-m {target.name}" if target.is_module else target.name
    trace = record_in(
        deterministic(**settings),
        script,
        backward=backward,
        ops=ops,
        source=f"script {' '.join([name, *target.args])}",
        root="globals",
    )
    if outcome.interrupted:
        print(f"{PROG} trace record: interrupted: no trace written", file=sys.stderr)
        return EXIT_INTERRUPTED
    dataclasses.replace(trace, status=outcome.status).save(output)
    counted = f"{trace.calls} module calls"
    if ops:
        counted += f", {sum(e.phase == 'op' for e in trace.events)} op calls"
    print(
        f"{PROG} trace record: wrote {output} ({counted}, seed {settings['seed']})", file=sys.stderr
    )
    if outcome.exit is not None:
        raise outcome.exit  # Python prints its message and picks the status, as for run
    return outcome.status


def _check_output(output: str) -> None:
    """Refuse an ``OUT`` that could not be written, before the script runs, and one that
    is a file of another kind: ``trace record train.py out.trace`` (``OUT`` and the
    script swapped) must not replace the script with a trace."""
    directory = os.path.dirname(os.path.abspath(output))
    if os.path.isdir(output):
        raise _UsageError(f"OUT {output!r} is a directory")
    if not os.path.isdir(directory):
        raise _UsageError(f"can't write {output!r}: no such directory {directory!r}")
    try:
        with open(output, "rb") as f:
            start = f.read(len(TRACE_MAGIC))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _UsageError(f"can't write {output!r}: {exc.strerror or exc}") from None
    if start and start != TRACE_MAGIC:
        raise _UsageError(
            f"OUT {output!r} exists and is not a trace file: refusing to replace it "
            "(OUT comes before the script)"
        )


def _execute(target: _Target, outcome: _Outcome) -> dict[str, Any] | None:
    """Run ``target`` as ``__main__``, as ``python script.py`` / ``python -m module`` would:
    its global variables when it ended, or ``None`` if it did not end normally; how it
    ended goes to ``outcome``.

    The module of ``-m`` is found first (a script was checked before the
    restart), after seeding: finding a module imports its parent packages,
    which are part of the program and may draw random numbers at import.
    Nothing else propagates, so that a recording completes: a ``SystemExit``
    is kept to be raised once the caller is done (Python then prints its
    message and picks the status exactly as for ``python script.py``), any
    other exception printed as Python prints an uncaught one, without our
    frames.

    Raises:
        _UsageError: the module, or one of its parent packages, cannot be found.
    """
    if target.is_module:
        try:
            found = importlib.util.find_spec(target.name) is not None
        except (ImportError, ValueError) as exc:
            raise _UsageError(f"cannot find module {target.name!r}: {exc}") from None
        if not found:
            raise _UsageError(f"no module named {target.name!r}")
    try:
        if target.is_module:
            return runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        return runpy.run_path(target.name, run_name="__main__")
    except SystemExit as exc:
        outcome.exit = exc
        code = exc.code
        outcome.status = 0 if code is None else code if isinstance(code, int) else EXIT_ERROR
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        outcome.status = EXIT_INTERRUPTED
        outcome.interrupted = True
    except BaseException as exc:
        _print_exception(exc)
        outcome.status = EXIT_ERROR
    return None


def _trace_compare(a: str, b: str, *, as_json: bool) -> int:
    """``trace compare``: the comparison, printed; 0 when the traces agree, 1 when not."""
    from ..trace import InvalidTraceError, compare_traces

    try:
        comparison = compare_traces(a, b)
    except (InvalidTraceError, OSError) as exc:
        print(f"{PROG} trace compare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(comparison.to_dict(), indent=2) if as_json else comparison)
    return EXIT_OK if comparison.agree else EXIT_ERROR


# --- check-resume ---------------------------------------------------------------------------------


def _check_resume(ns: argparse.Namespace, command: list[str]) -> int:
    """``check-resume``: run the script uninterrupted, killed and resumed; compare; report."""
    # Standard library only: this process never loads torch, the runs do.
    from .check_resume import check_resume

    try:
        target = _target(ns.module, command)
    except _UsageError as exc:
        if exc.show_usage:
            print(f"usage: {_CHECK_RESUME_USAGE}", file=sys.stderr)
        print(f"{PROG} check-resume: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    env = dict(os.environ)
    if target.is_module:
        # python -m finds modules in its working directory, which is now a fresh one: this one
        # is where the user meant it to be looked for.
        paths = [os.getcwd(), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        argv = [sys.executable, "-m", target.name, *target.args]
    else:
        argv = [sys.executable, os.path.abspath(target.name), *target.args]

    def progress(text: str) -> None:
        print(f"{PROG} check-resume: {text}", file=sys.stderr, flush=True)

    try:
        outcome = check_resume(
            argv,
            list(dict.fromkeys(ns.at)),
            keep=ns.keep,
            timeout=ns.timeout,
            env=env,
            progress=progress,
        )
    except KeyboardInterrupt:
        print(f"{PROG} check-resume: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:  # a records file the script wrote by hand, wrongly
        print(f"{PROG} check-resume: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(outcome.to_dict(), indent=2) if ns.json else outcome)
    return outcome.status


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
