#!/usr/bin/env python3
"""The support matrix: the test suite in each corner of the versions we declare.

``pyproject.toml`` promises ``torch>=2.1``, ``numpy>=1.24`` and Python 3.10 and
later.  A promise is only as good as its test, so this runs the suite in the
corners of that range, each in a virtual environment of its own:

========  ======  =======  =======================================
corner    Python  torch    NumPy
========  ======  =======  =======================================
lowest    3.10    2.1.2    1.26.4 (the last 1.x with 3.10 wheels)
middle    3.12    2.6.0    1.26.4
torch211  3.12    2.11.x   2.x (GPU machines' torch; no weakly
                           referenceable ``torch.Generator``)
newest    3.13    2.15.0   2.x (the newest pip finds)
========  ======  =======  =======================================

Usage::

    python tools/compat.py                      # every corner, pytest -m "not slow" -n 2
    python tools/compat.py --corner lowest      # one corner
    python tools/compat.py --corner middle -- tests/sources/test_flags.py -x -n 0
    python tools/compat.py --build-only         # make (or check) the environments, run nothing
    python tools/compat.py --rebuild --corner newest
    python tools/compat.py --all                # every minor torch release, 2.1 to the newest
    python tools/compat.py --all --releases 2.3,2.5 --jobs 2 -- -m "not slow" -n 2 -x

**Every release** (``--all``): each minor torch release from the lowest
corner's to the newest corner's, once.  A release that a corner pins runs in
that corner's environment; the others get an environment named
``torch2.N`` (Python 3.11, the newest patch of 2.N, NumPy 1.26.4 up to torch
2.3, whose wheels were built against NumPy 1, else the newest 2.x), which is
removed after its run unless ``--keep`` is given (a few GB each).  ``--jobs
N`` builds N environments at a time while the tests run one release at a
time.  The closing table (Markdown) is what ``docs/how-to/support.md`` shows.

Whatever follows ``--`` replaces the default pytest arguments (``-m "not slow"
-n 2``).  The exit status is non-zero when any corner's environment could not
be built or its pytest run failed; a summary line per corner closes the output.

**Environments.**  Each corner's lies in
``~/.cache/deterministic-ctx-compat/<corner>`` (``$DETERMINISTIC_CTX_COMPAT_CACHE``
moves the folder).  Beside it, ``<corner>.json`` records what it was built
from: the interpreter's version, the pins, and the project's requirements
(its dependencies and ``test`` extra, read from ``pyproject.toml``).  A
later run reuses the environment while that record matches, so a repeat costs
only the tests, and builds it again from scratch when the record differs (or
with ``--rebuild``).  The pins are passed to pip as a constraint file through
``PIP_CONSTRAINT``, which also replaces a machine-wide constraint file (one
that caps torch below the newest corner's, say) for these pip calls only.

Downloads are large (torch from PyPI brings CUDA libraries: a few GB per
corner), pip's own cache keeps them for the next build.

**The project** is installed editable (``pip install --no-deps -e``) from the
checkout this file belongs to, again only when the environment last held
another checkout: worktrees share one environment per corner.

**Test extras that cannot be installed.**  The ``test`` extra is installed in
one pip call; if pip cannot resolve it with the corner's pins (a package whose
every release wants a newer torch or Python), each requirement is tried on
its own and those that fail are left out, named in the record and in the
output.  The tests that need them skip, saying which package is missing.

**Interpreters** are found as ``pythonX.Y`` on ``PATH``, else under pyenv's
``versions/X.Y.*``; ``$DETERMINISTIC_CTX_COMPAT_PYTHON_X_Y`` (e.g.
``..._PYTHON_3_10=/opt/py310/bin/python``) names one explicitly.

Only the standard library is used: the runner needs no environment of its own.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTEST_ARGS = ("-m", "not slow", "-n", "2")
#: Bumped when what a build does changes, so that old environments are rebuilt.
RUNNER_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Corner:
    name: str
    python: str
    torch: str
    numpy: str

    def pins(self) -> list[str]:
        """The constraint lines for pip."""
        return [f"torch{self.torch}", f"numpy{self.numpy}"]


CORNERS = {
    c.name: c
    for c in (
        # numpy 1.26.4 is the last 1.x release and has wheels for 3.10 to 3.12.
        Corner("lowest", "3.10", "==2.1.2", "==1.26.4"),
        Corner("middle", "3.12", "==2.6.0", "==1.26.4"),
        # The torch that GPU machines here carry, and the one release in our range
        # whose torch.Generator cannot be weakly referenced (the registry then holds
        # generators strongly until unregister_rng): a behaviour no other corner has.
        Corner("torch211", "3.12", "==2.11.*", ">=2,<3"),
        Corner("newest", "3.13", "==2.15.0", ">=2,<3"),
    )
}


#: The lowest and the newest minor release of torch 2 that ``--all`` runs.
ALL_MINORS = range(1, 16)
#: The interpreter of the environments ``--all`` makes for releases without a corner:
#: one that every torch from 2.1 to the newest has wheels for.
ALL_PYTHON = "3.11"


def release_corner(minor: int) -> tuple[Corner, bool]:
    """The environment that runs torch ``2.minor`` for ``--all``: a corner that pins
    that release (``True``: kept), else one of its own (``False``: removed after its run)."""
    for corner in CORNERS.values():
        if re.fullmatch(rf"==2\.{minor}(\.[0-9*]+)?", corner.torch):
            return corner, True
    numpy = "==1.26.4" if minor <= 3 else ">=2,<3"
    return Corner(f"torch2.{minor}", ALL_PYTHON, f"==2.{minor}.*", numpy), False


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "deterministic-ctx-compat"
    return Path(os.environ.get("DETERMINISTIC_CTX_COMPAT_CACHE", default))


def log(message: str) -> None:
    print(f"[compat] {message}", flush=True)


# -- the project's requirements -----------------------------------------------------


def project_requirements() -> tuple[list[str], list[str]]:
    """``(dependencies, test extra)`` from pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    if sys.version_info < (3, 11):  # no tomllib: a small reader for the two lists we need
        return _list_after(text, "dependencies"), _list_after(text, "test")
    import tomllib  # type: ignore[import-not-found,unused-ignore]  # mypy reads as 3.10

    data = tomllib.loads(text)
    project = data["project"]
    return list(project["dependencies"]), list(project["optional-dependencies"]["test"])


def _list_after(text: str, key: str) -> list[str]:
    found = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", text, re.M | re.S)
    if found is None:
        raise SystemExit(f"pyproject.toml: no `{key} = [...]` found")
    body = "\n".join(line.split("#", 1)[0] for line in found[1].splitlines())
    return re.findall(r'"([^"]+)"', body)


# -- interpreters ---------------------------------------------------------------------


def find_python(version: str) -> str:
    """The path of a Python ``version`` interpreter (see the module docstring)."""
    override = os.environ.get(f"DETERMINISTIC_CTX_COMPAT_PYTHON_{version.replace('.', '_')}")
    if override:
        return override
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    installed = sorted(
        glob.glob(str(pyenv / "versions" / f"{version}.*" / "bin" / "python")),
        key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parent.parent.name)],
        reverse=True,
    )
    candidates = [shutil.which(f"python{version}"), *installed]
    for path in candidates:
        if path and _python_version(path) == version:
            return path
    raise SystemExit(
        f"no Python {version} found (looked for python{version} on PATH and under "
        f"{pyenv}/versions); set DETERMINISTIC_CTX_COMPAT_PYTHON_{version.replace('.', '_')}"
    )


def _python_version(path: str) -> str | None:
    try:
        out = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.strip()


# -- environments ---------------------------------------------------------------------


@dataclasses.dataclass
class Env:
    corner: Corner
    path: Path
    #: Test requirements that could not be installed here.
    missing: list[str]

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def wanted_record(corner: Corner, interpreter: str) -> dict[str, object]:
    deps, test = project_requirements()
    return {
        "runner": RUNNER_VERSION,
        "python": corner.python,
        "interpreter": interpreter,
        "pins": corner.pins(),
        "dependencies": deps,
        "test": test,
    }


def _pip(env_python: Path, args: list[str], constraints: Path, logfile: Path) -> bool:
    """Run pip in the environment, output appended to ``logfile``; whether it succeeded."""
    environ = dict(os.environ, PIP_CONSTRAINT=str(constraints), PIP_DISABLE_PIP_VERSION_CHECK="1")
    with logfile.open("a", encoding="utf-8") as out:
        out.write(f"\n$ pip {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(
            [str(env_python), "-m", "pip", *args], stdout=out, stderr=subprocess.STDOUT, env=environ
        )
    return done.returncode == 0


def _tail(logfile: Path, lines: int = 25) -> str:
    try:
        return "\n".join(logfile.read_text(encoding="utf-8").splitlines()[-lines:])
    except OSError:
        return ""


def build(corner: Corner, *, rebuild: bool) -> Env:
    """The corner's environment, built or reused (see the module docstring)."""
    base = cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    path = base / corner.name
    record_file = base / f"{corner.name}.json"
    logfile = base / f"{corner.name}.log"
    interpreter = find_python(corner.python)
    wanted = wanted_record(corner, interpreter)
    record: dict[str, object] = {}
    if record_file.exists():
        try:
            record = json.loads(record_file.read_text(encoding="utf-8"))
        except ValueError:
            record = {}
    built = record.get("built") or {}
    if not rebuild and built == wanted and (path / "bin" / "python").exists():
        missing = record.get("missing") or []
        env = Env(corner, path, [str(m) for m in missing] if isinstance(missing, list) else [])
        log(f"{corner.name}: reusing {path}")
    else:
        env = _build_fresh(corner, path, record_file, logfile, interpreter, wanted, record, rebuild)
    _install_project(env, record_file, logfile)
    return env


def _build_fresh(
    corner: Corner,
    path: Path,
    record_file: Path,
    logfile: Path,
    interpreter: str,
    wanted: dict[str, object],
    record: dict[str, object],
    rebuild: bool,
) -> Env:
    # A build that was interrupted (no "built" yet), or a folder with no record at
    # all, goes on in the same folder, keeping what pip installed there (pip then
    # only checks it); one built from other requirements or another interpreter
    # starts over.
    stale = rebuild or (bool(record) and record.get("building") != wanted)
    venv_python = path / "bin" / "python"
    if venv_python.exists() and _python_version(str(venv_python)) != corner.python:
        stale = True
    if path.exists() and stale:
        log(f"{corner.name}: built from other requirements, removing {path}")
        shutil.rmtree(path)
    record_file.write_text(json.dumps({"building": wanted}, indent=1), encoding="utf-8")
    logfile.write_text("", encoding="utf-8")
    started = time.monotonic()
    log(f"{corner.name}: building {path} (Python {corner.python}, {', '.join(corner.pins())})")
    log(f"{corner.name}: pip's output goes to {logfile}")
    if not (path / "bin" / "python").exists():
        subprocess.run([interpreter, "-m", "venv", str(path)], check=True)
    env_python = path / "bin" / "python"
    constraints = path / "constraints.txt"
    constraints.write_text("\n".join(corner.pins()) + "\n", encoding="utf-8")
    deps, test = project_requirements()
    missing: list[str] = []
    if not _pip(env_python, ["install", "--upgrade", "pip"], constraints, logfile):
        log(f"{corner.name}: could not upgrade pip (going on with the one the venv has)")
    if not _pip(env_python, ["install", *corner.pins(), *deps, *test], constraints, logfile):
        log(f"{corner.name}: the test extra does not install whole; trying each requirement")
        if not _pip(env_python, ["install", *corner.pins(), *deps], constraints, logfile):
            raise SystemExit(
                f"{corner.name}: cannot install {', '.join(corner.pins() + deps)}; "
                f"the end of {logfile}:\n{_tail(logfile)}"
            )
        for requirement in test:
            if not _pip(env_python, ["install", requirement], constraints, logfile):
                missing.append(requirement)
        log(f"{corner.name}: left out (their tests skip): {', '.join(missing) or 'nothing'}")
    record = {"built": wanted, "missing": missing, "project": None}
    record_file.write_text(json.dumps(record, indent=1), encoding="utf-8")
    log(f"{corner.name}: built in {time.monotonic() - started:.0f} s")
    return Env(corner, path, missing)


def _install_project(env: Env, record_file: Path, logfile: Path) -> None:
    """Install this checkout editable, without dependencies, unless it is already."""
    record = json.loads(record_file.read_text(encoding="utf-8"))
    if record.get("project") == str(ROOT) and _imports_from_here(env):
        return
    log(f"{env.corner.name}: installing {ROOT} (editable, no dependencies)")
    constraints = env.path / "constraints.txt"
    if not _pip(env.python, ["install", "--no-deps", "-e", str(ROOT)], constraints, logfile):
        raise SystemExit(f"{env.corner.name}: cannot install the project:\n{_tail(logfile)}")
    record["project"] = str(ROOT)
    record_file.write_text(json.dumps(record, indent=1), encoding="utf-8")


def _imports_from_here(env: Env) -> bool:
    code = "import importlib.util as u; print(u.find_spec('deterministic_ctx').origin)"
    done = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, cwd="/")
    return done.returncode == 0 and Path(done.stdout.strip()).is_relative_to(ROOT)


# -- running --------------------------------------------------------------------------


def versions(env: Env) -> str:
    code = (
        "import sys, torch, numpy; "
        "print('Python %d.%d.%d' % sys.version_info[:3], 'torch', torch.__version__, "
        "'numpy', numpy.__version__)"
    )
    done = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or f"(versions unknown: {done.stderr.strip()[-200:]})"


def run_tests(env: Env, pytest_args: list[str]) -> tuple[int, str]:
    """Run pytest in the checkout with the corner's environment; (exit status, summary)."""
    log(f"{env.corner.name}: {versions(env)}")
    if env.missing:
        log(f"{env.corner.name}: not installed here: {', '.join(env.missing)}")
    command = [str(env.python), "-m", "pytest", *pytest_args]
    log(f"{env.corner.name}: {' '.join(command)}")
    environ = dict(os.environ)
    environ.pop("PYTHONPATH", None)
    environ["VIRTUAL_ENV"] = str(env.path)
    environ["PATH"] = f"{env.path / 'bin'}{os.pathsep}{environ.get('PATH', '')}"
    with tempfile.TemporaryFile("w+", encoding="utf-8") as copy:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            copy.write(line)
        status = process.wait()
        copy.seek(0)
        summary = _summary(copy.read())
    return status, summary


def _summary(output: str) -> str:
    """pytest's closing line (``=== 3 passed, 1 skipped in 2.0s ===``), unframed."""
    for line in reversed(output.splitlines()):
        stripped = line.strip().strip("=").strip()
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", stripped):
            return stripped
    return "(no pytest summary)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = list(DEFAULT_PYTEST_ARGS)
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="tools/compat.py",
        description="Run the test suite in the corners of the supported versions "
        "(see this file's docstring).",
        epilog="Arguments after -- go to pytest instead of the default -m 'not slow' -n 2.",
    )
    parser.add_argument("--corner", choices=[*CORNERS, "all"], default="all")
    parser.add_argument(
        "--all",
        action="store_true",
        help="every minor torch release from the lowest corner's to the newest's, once",
    )
    parser.add_argument(
        "--releases", metavar="2.N,...", help="with --all: only these minor releases"
    )
    parser.add_argument(
        "--keep", action="store_true", help="with --all: keep the environments made for it"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="with --all: environments built at a time"
    )
    parser.add_argument("--rebuild", action="store_true", help="build the environments anew")
    parser.add_argument(
        "--build-only", action="store_true", help="build or check the environments, run no test"
    )
    options = parser.parse_args(argv)
    if options.all:
        return run_all(options, pytest_args)
    names = list(CORNERS) if options.corner == "all" else [options.corner]
    results: list[tuple[str, int, str]] = []
    for name in names:
        corner = CORNERS[name]
        status, summary, _ = build_and_run(corner, options, pytest_args)
        results.append((name, status, summary))
    print()
    for name, status, summary in results:
        verdict = "ok" if status == 0 else f"FAILED (exit {status})"
        log(f"{name}: {verdict}: {summary}")
    return 0 if all(status == 0 for _, status, _ in results) else 1


def build_and_run(
    corner: Corner, options: argparse.Namespace, pytest_args: list[str], env: Env | None = None
) -> tuple[int, str, float]:
    """Build (unless ``env`` is given) and test one environment: (status, summary, test seconds)."""
    if env is None:
        try:
            env = build(corner, rebuild=options.rebuild)
        except (SystemExit, subprocess.CalledProcessError, OSError) as exc:
            return _not_built(corner, exc), "environment not built", 0.0
    if options.build_only:
        return 0, f"ready: {versions(env)}", 0.0
    started = time.monotonic()
    status, summary = run_tests(env, pytest_args)
    return status, f"{versions(env)}: {summary}", time.monotonic() - started


def _not_built(corner: Corner, exc: BaseException) -> int:
    message = str(exc.code) if isinstance(exc, SystemExit) else str(exc)
    log(f"{corner.name}: environment not built: {message}")
    return 2


def run_all(options: argparse.Namespace, pytest_args: list[str]) -> int:
    """``--all``: every minor release once; a Markdown table of the results at the end."""
    minors = list(ALL_MINORS)
    if options.releases:
        wanted = {int(r.strip().split(".")[1]) for r in options.releases.split(",") if r.strip()}
        minors = [m for m in minors if m in wanted]
    plan = [(minor, *release_corner(minor)) for minor in minors]
    rows: list[tuple[str, str, int, str, float]] = []

    def make(corner: Corner) -> Env:
        return build(corner, rebuild=options.rebuild)

    # Builds (downloads, mostly) overlap with each other and with the tests; the tests
    # run one release at a time, in order, so their output does not interleave.
    # At most ``jobs`` environments wait built and untested (each is a few GB): the next
    # build is submitted when a release's tests begin.
    jobs = max(1, options.jobs)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(make, corner) for _, corner, _ in plan[:jobs]]
        for i, (minor, corner, kept) in enumerate(plan):
            future = futures[i]
            if i + jobs < len(plan):
                futures.append(pool.submit(make, plan[i + jobs][1]))
            try:
                env = future.result()
            except (SystemExit, subprocess.CalledProcessError, OSError) as exc:
                status = _not_built(corner, exc)
                rows.append((f"2.{minor}", corner.name, status, "environment not built", 0.0))
                continue
            status, summary, seconds = build_and_run(corner, options, pytest_args, env)
            rows.append((f"2.{minor}", corner.name, status, summary, seconds))
            if not kept and not options.keep:
                log(f"{corner.name}: removing {env.path} (--keep keeps it)")
                shutil.rmtree(env.path, ignore_errors=True)
                (cache_dir() / f"{corner.name}.json").unlink(missing_ok=True)
    print()
    print(f"pytest {' '.join(pytest_args)}")
    print()
    print("| torch | environment | result | Python, torch, NumPy: pytest's summary | tests |")
    print("|---|---|---|---|---|")
    for release, name, status, summary, seconds in rows:
        verdict = "ok" if status == 0 else f"FAILED (exit {status})"
        print(f"| {release} | {name} | {verdict} | {summary} | {seconds:.0f} s |")
    return 0 if all(row[2] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
