"""The command line: ``python -m deterministic_ctx`` and the ``deterministic-ctx`` console script.

Every behaviour is checked on the real entry points in subprocesses; only
argument errors, which return before anything is seeded, are also checked
in-process.  Expected numbers come from private generators (``random.Random``,
``np.random.RandomState``, ``torch.Generator``), never from this process's
global state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import IO

import numpy as np
import pytest
import torch

import deterministic_ctx
from deterministic_ctx.integrations import cli as cli_module
from deterministic_ctx.integrations.cli import _split, main
from deterministic_ctx.internal import MAX_SEED
from deterministic_ctx.reporting import report
from tests.helpers import run_python

SCRIPT_NAME = "deterministic-ctx.exe" if os.name == "nt" else "deterministic-ctx"


def _find_console_script() -> tuple[Path | None, str]:
    """The console script as a shell finds it, else beside this interpreter; or why not.

    On ``PATH`` first (an activated environment, ``pip install --user``, a system
    interpreter's ``/usr/local/bin``), then in the interpreter's own folder (a virtual
    environment run by path, not activated).  An install without scripts (``pip install
    --target``, the checkout on ``PYTHONPATH``) has neither: the tests that need the script
    skip, saying where it was looked for.
    """
    on_path = shutil.which(SCRIPT_NAME)
    if on_path:
        return Path(on_path), ""
    beside = Path(sys.executable).with_name(SCRIPT_NAME)
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside, ""
    return None, (
        f"no {SCRIPT_NAME} console script on PATH nor beside {sys.executable} "
        "(installed without scripts: pip install -e . makes one)"
    )


CONSOLE_SCRIPT, NO_CONSOLE_SCRIPT = _find_console_script()


def console_script_path() -> Path:
    """The console script's path; the test skips, saying why, where there is none."""
    if CONSOLE_SCRIPT is None:
        pytest.skip(NO_CONSOLE_SCRIPT)
    return CONSOLE_SCRIPT


PROBE = """\
import json, os, random, sys
import numpy as np
import torch
import sibling  # found because the script's directory is first on sys.path

print(json.dumps({
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "random": random.random(),
    "numpy": float(np.random.rand()),
    "torch": torch.rand(3).tolist(),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    "cudnn_deterministic": torch.backends.cudnn.deterministic,
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "hashseed": os.environ.get("PYTHONHASHSEED"),
    "hash": hash("deterministic"),
    "set": list({"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}),
}))
"""


def expected_draws(seed: int) -> dict[str, object]:
    """What the classic recipe ``random.seed(s); np.random.seed(s); torch.manual_seed(s)`` draws."""
    return {
        "random": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed).rand()),
        "torch": torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist(),
    }


def reference_hash(hashseed: int) -> int:
    """``hash("deterministic")`` in an interpreter started with ``PYTHONHASHSEED=hashseed``."""
    out = run_python(
        [], code="print(hash('deterministic'))", env={"PYTHONHASHSEED": str(hashseed)}, check=True
    )
    return int(out.stdout)


def base_env(hashseed: int | None = None) -> dict[str, str]:
    """The environment of a subprocess; with ``hashseed``, ``run`` needs no restart."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = str(hashseed)
    return env


def cli(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    console_script: bool = False,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    command = (
        [str(console_script_path())]
        if console_script
        else [sys.executable, "-m", "deterministic_ctx"]
    )
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=base_env(0) if env is None else env,
        input=stdin,
        timeout=300,
    )


def probe_output(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "sibling.py").write_text("")
    path = folder / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory that is not the script's."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


# --- help, version, report --------------------------------------------------------------------------


def test_help_reads_well(capsys):
    top = cli("--help")  # the real entry point once; the subcommands' help in-process
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith(
        "usage: deterministic-ctx [-h] [--version] {report,run,trace,check-resume} ..."
    )
    words = ("report", "run", "trace", "check-resume", "examples:", "exit status:", "130")
    for text in (*words, "usage error"):
        assert text in top.stdout

    assert main(["run", "--help"]) == 0
    run = capsys.readouterr().out
    assert "deterministic-ctx run [-h] [--seed N] [--warn-only] [--no-flags] [--no-fill]" in run
    assert "[--compiled-rng eager] [--deterministic-collectives]\n" in run
    assert "[--] script.py [args ...]" in run
    for text in (
        "-m module",
        "--seed N",
        "--warn-only",
        "NCCL_ALGO=Ring",
        "-m torch.distributed.run",
        "PYTHONHASHSEED",
        "(default: 0)",
        "exit status",
    ):
        assert text in run

    assert main(["report", "--help"]) == 0
    rep = capsys.readouterr().out
    assert "--json" in rep and "--init-cuda" in rep

    assert main(["trace", "record", "--help"]) == 0
    record = capsys.readouterr().out
    assert "trace record [-h] [--seed N] [--backward] [--ops] [--warn-only]" in record
    for text in ("\n  --ops ", "trace record --ops c.trace train.py", "exit status"):
        assert text in record
    texts = (top.stdout, run, rep, record)
    assert all(len(line) <= 100 for text in texts for line in text.splitlines())


def test_console_script_is_installed_and_matches_python_m():
    proc = cli("--version", console_script=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"deterministic-ctx {deterministic_ctx.__version__}"
    assert cli("--version").stdout == proc.stdout


@pytest.mark.slow
def test_report_text():
    proc = cli("report")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Determinism report\n")
    for section in ("\nFlags\n", "\nEnvironment\n", "\nRNGs\n", "\nCUDA\n", "\nProblems: "):
        assert section in proc.stdout
    # A fresh interpreter has deterministic algorithms off: the report warns about it.
    assert "[nondeterministic-algorithms]" in proc.stdout


@pytest.mark.slow
def test_report_json_is_the_report_as_data():
    proc = cli("report", "--json", console_script=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == set(report().to_dict())
    assert data["versions"]["deterministic-ctx"] == deterministic_ctx.__version__
    assert data["in_block"] is False
    assert data["flags"]["deterministic_algorithms"] is False
    assert "nondeterministic-algorithms" in {p["code"] for p in data["problems"]}
    assert data["cuda"]["initialized"] is False  # the report never starts CUDA by itself


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_report_init_cuda_includes_devices():
    data = json.loads(cli("report", "--json", "--init-cuda").stdout)
    assert data["cuda"]["initialized"] is True
    assert data["cuda"]["device_count"] >= 1
    assert data["cuda"]["devices"][0]["name"]


@pytest.mark.slow
def test_report_init_cuda_without_cuda_is_harmless():
    proc = cli("report", "--json", "--init-cuda")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cuda"]["initialized"] is torch.cuda.is_available()


# --- run: seeding -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_no_flags_seeds_only(probe, elsewhere):
    env = base_env(3)
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    out = probe_output(cli("run", "--seed", "3", "--no-flags", str(probe), env=env, cwd=elsewhere))
    assert {k: out[k] for k in ("random", "numpy", "torch")} == expected_draws(3)
    assert out["deterministic"] is False
    assert out["cudnn_deterministic"] is False
    assert out["cublas"] is None


@pytest.mark.slow
def test_run_compiled_rng_eager(tmp_path, elsewhere):
    script = tmp_path / "compiled.py"
    script.write_text(
        "import torch._inductor.config as inductor\nprint(inductor.fallback_random)\n"
    )
    plain = cli("run", str(script), env=base_env(0), cwd=elsewhere)
    eager = cli("run", "--compiled-rng", "eager", str(script), env=base_env(0), cwd=elsewhere)
    assert (plain.returncode, plain.stdout) == (0, "False\n"), plain.stderr
    assert (eager.returncode, eager.stdout) == (0, "True\n"), eager.stderr
    bad = cli("run", "--compiled-rng", "inductor", str(script), env=base_env(0), cwd=elsewhere)
    assert bad.returncode == 2
    assert "invalid choice: 'inductor'" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "seed"), [((), 0), (("--seed", "3"), 3), (("--seed=4294967295",), 2**32 - 1)]
)
def test_run_seeds_like_the_classic_recipe(probe, elsewhere, options, seed):
    out = probe_output(cli("run", *options, "--", str(probe), env=base_env(seed), cwd=elsewhere))
    assert {k: out[k] for k in ("random", "numpy", "torch")} == expected_draws(seed)
    assert out["deterministic"] is True
    assert out["warn_only"] is False
    assert out["cudnn_deterministic"] is True
    assert out["cublas"] in (":4096:8", ":16:8")
    assert out["hashseed"] == str(seed)
    # As `python probe.py` would run it.
    assert out["name"] == "__main__"
    assert out["argv"] == [str(probe)]
    assert out["path0"] == str(probe.parent)


@pytest.mark.slow
def test_run_is_reproducible_with_string_hashes_and_set_order(probe, elsewhere):
    """Without PYTHONHASHSEED in the environment, run restarts with it set: hashes are fixed."""
    env = base_env(None)
    first = probe_output(cli("run", "--seed", "7", str(probe), env=env, cwd=elsewhere))
    second = probe_output(cli("run", "--seed", "7", str(probe), env=env, cwd=elsewhere))
    assert first == second
    assert first["hashseed"] == "7"
    assert first["hash"] == reference_hash(7)
    assert {k: first[k] for k in ("random", "numpy", "torch")} == expected_draws(7)


@pytest.mark.slow
def test_run_replaces_a_different_pythonhashseed(probe):
    out = probe_output(cli("run", "--seed", "3", str(probe), env=base_env(123)))
    assert out["hashseed"] == "3"
    assert out["hash"] == reference_hash(3)


@pytest.mark.slow
def test_run_with_the_console_script(probe, elsewhere):
    out = probe_output(
        cli(
            "run",
            "--seed",
            "5",
            str(probe),
            "x",
            env=base_env(None),
            cwd=elsewhere,
            console_script=True,
        )
    )
    assert {k: out[k] for k in ("random", "numpy", "torch")} == expected_draws(5)
    assert out["hash"] == reference_hash(5)
    assert out["argv"] == [str(probe), "x"]
    assert out["path0"] == str(probe.parent)


@pytest.mark.slow
def test_warn_only(probe):
    out = probe_output(cli("run", "--warn-only", str(probe)))
    assert out["deterministic"] is True
    assert out["warn_only"] is True


# --- run: arguments ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_arguments_after_the_script_belong_to_the_script(probe):
    out = probe_output(cli("run", str(probe), "--seed", "5", "--", "-m", "x", "--warn-only"))
    assert out["argv"] == [str(probe), "--seed", "5", "--", "-m", "x", "--warn-only"]
    assert out["warn_only"] is False
    assert out["random"] == expected_draws(0)["random"]


@pytest.mark.slow
def test_double_dash_separates_our_options(probe):
    out = probe_output(cli("run", "--seed", "2", "--", str(probe), "--warn-only", env=base_env(2)))
    assert out["argv"] == [str(probe), "--warn-only"]
    assert out["warn_only"] is False
    assert out["random"] == expected_draws(2)["random"]


@pytest.mark.slow
def test_relative_script_path_is_kept_in_argv(probe):
    out = probe_output(cli("run", "probe.py", "a", cwd=probe.parent))
    assert out["argv"] == ["probe.py", "a"]
    assert out["path0"] == str(probe.parent)


@pytest.mark.slow
@pytest.mark.parametrize("spelling", [("-m", "tools.probe"), ("-mtools.probe",)])
def test_module(tmp_path, spelling):
    package = tmp_path / "tools"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(PROBE)
    (tmp_path / "sibling.py").write_text("")
    out = probe_output(
        cli("run", "--seed", "3", *spelling, "a", "--b", cwd=tmp_path, env=base_env(3))
    )
    assert out["name"] == "__main__"
    assert out["argv"] == [str(package / "probe.py"), "a", "--b"]
    assert out["path0"] == str(tmp_path)
    assert {k: out[k] for k in ("random", "numpy", "torch")} == expected_draws(3)


@pytest.mark.slow
def test_package_main_and_imports_run_after_seeding(tmp_path):
    """Like `python -m pkg`: the package's __init__ (imported first) already draws seeded numbers."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import random\nAT_IMPORT = random.random()\n")
    (package / "__main__.py").write_text(
        "import json, pkg, random\nprint(json.dumps([pkg.AT_IMPORT, random.random()]))\n"
    )
    proc = cli("run", "--seed", "3", "-m", "pkg", cwd=tmp_path, env=base_env(3))
    assert proc.returncode == 0, proc.stderr
    r = random.Random(3)
    assert json.loads(proc.stdout) == [r.random(), r.random()]


def modules_imported_per_interpreter(importtime: str) -> list[set[str]]:
    """The modules each interpreter imported, from ``-X importtime`` output on stderr.

    Every interpreter prints the column header once, before its first import,
    so a restarted command shows two sections: the interpreter that decided to
    restart, then the one that ran the script.
    """
    interpreters: list[set[str]] = []
    for line in importtime.splitlines():
        if line.startswith("import time: self [us]"):
            interpreters.append(set())
        elif line.startswith("import time:") and interpreters:
            interpreters[-1].add(line.rsplit("|", 1)[1].strip())
    return interpreters


@pytest.mark.slow
@pytest.mark.parametrize("console_script", [False, True], ids=["python-m", "console-script"])
def test_run_restarts_before_importing_torch_or_numpy(tmp_path, console_script):
    """The interpreter that is replaced by the restart never loaded torch or NumPy."""
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    entry = [str(console_script_path())] if console_script else ["-m", "deterministic_ctx"]
    # PYTHONHASHSEED differs from the seed, so run restarts; the restarted
    # interpreter inherits PYTHONPROFILEIMPORTTIME and reports its imports too.
    proc = run_python(
        [*entry, "run", "--seed", "3", "--deterministic-collectives", str(script)],
        env={"PYTHONHASHSEED": "123", "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert (proc.returncode, proc.stdout) == (0, "ran\n"), proc.stderr
    deciding, restarted = modules_imported_per_interpreter(proc.stderr)
    # The collectives' values come from the report's module, which needs no torch.
    assert {
        "deterministic_ctx.integrations.cli",
        "deterministic_ctx.reporting.collectives",
    } <= deciding
    assert {"torch", "numpy"} & deciding == set(), "imported before the restart"
    # The same probe sees them where they belong: the script's interpreter seeds them.
    assert {"torch", "numpy", "deterministic_ctx.parallel.seeding"} <= restarted


@pytest.mark.slow
def test_run_without_restart_is_one_interpreter(tmp_path):
    """With PYTHONHASHSEED already the seed, the command runs in the interpreter it started in."""
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    proc = run_python(
        ["-m", "deterministic_ctx", "run", "--seed", "3", str(script)],
        env={"PYTHONHASHSEED": "3", "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert (proc.returncode, proc.stdout) == (0, "ran\n"), proc.stderr
    (only,) = modules_imported_per_interpreter(proc.stderr)
    assert {"deterministic_ctx.integrations.cli", "torch", "numpy"} <= only


COLLECTIVES_PROBE = """\
import json, os, sys, tempfile
import torch.distributed as dist
from deterministic_ctx.reporting import report

names = ("NCCL_ALGO", "NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE")
dist.init_process_group(
    "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1
)
r = report()
dist.destroy_process_group()
print(json.dumps({
    "env": {n: os.environ.get(n) for n in names},
    "before": r.collectives["env_before_use"],
    "problems": [p.code for p in r.problems if p.code.startswith("nccl")],
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("restart", [True, False], ids=["restart", "no-restart"])
def test_run_deterministic_collectives(tmp_path, restart):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_PROBE)
    env = base_env(None if restart else 0)
    for name in ("NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE", "NCCL_CONF_FILE"):
        env.pop(name, None)
    env["NCCL_ALGO"] = "Tree"  # a user's value: replaced, and said so
    proc = cli("run", "--deterministic-collectives", str(script), env=env)
    out = probe_output(proc)
    assert out["env"] == {"NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}
    assert proc.stderr.count("note: NCCL_ALGO was 'Tree', now 'Ring'") == 1
    # The report knows they were set before the group: no note that it cannot tell.
    assert out["before"]["env"]["NCCL_ALGO"] == "Ring"
    assert out["problems"] == []
    # Without the option, nothing is set.
    plain = probe_output(cli("run", str(script), env=env))
    assert plain["env"] == {
        "NCCL_ALGO": "Tree",
        "NCCL_NVLS_ENABLE": None,
        "NCCL_COLLNET_ENABLE": None,
    }


def test_seed_range_is_the_librarys():
    """The CLI checks --seed before torch is loaded, against its own copy of the upper bound."""
    assert cli_module.MAX_SEED == MAX_SEED
    assert main(["run", "--seed", str(MAX_SEED), "--help"]) == 0


@pytest.mark.slow
def test_stdin_and_child_processes(tmp_path, elsewhere):
    """The restart keeps stdin; child processes inherit PYTHONHASHSEED and hash alike."""
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent("""\
        import subprocess, sys
        line = input()
        child = subprocess.run(
            [sys.executable, "-c", "print(hash('deterministic'))"],
            capture_output=True, text=True, check=True,
        )
        print(line.upper(), hash("deterministic") == int(child.stdout))
        """)
    )
    proc = cli(
        "run", "--seed", "11", str(script), env=base_env(None), cwd=elsewhere, stdin="hello\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "HELLO True\n"


# --- run: exit statuses ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "status", "stderr_has", "stderr_lacks"),
    [
        ("print('fine')", 0, [], ["Traceback"]),
        ("import sys\nsys.exit(7)", 7, [], ["Traceback"]),
        ("import sys\nsys.exit('bye')", 1, ["bye"], ["Traceback"]),
        ("raise SystemExit(0)", 0, [], ["Traceback"]),
        (
            "def f():\n    raise ValueError('boom')\nf()",
            1,
            ['File "SCRIPT", line 3, in <module>', "line 2, in f", "ValueError: boom"],
            ["cli.py", "runpy", "deterministic_ctx"],
        ),
        ("raise KeyboardInterrupt", 130, ["KeyboardInterrupt"], ["cli.py", "runpy"]),
        ("x = (\n", 1, ['File "SCRIPT", line 1', "SyntaxError"], ["cli.py", "runpy"]),
    ],
    ids=["ok", "exit-7", "exit-message", "exit-0", "exception", "interrupt", "syntax-error"],
)
def test_exit_status_is_the_scripts(tmp_path, source, status, stderr_has, stderr_lacks):
    script = tmp_path / "script.py"
    script.write_text(source + "\n")
    proc = cli("run", str(script))
    assert proc.returncode == status, proc.stderr
    for text in stderr_has:
        assert text.replace("SCRIPT", str(script)) in proc.stderr
    for text in stderr_lacks:
        assert text not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_ctrl_c_reaches_the_script_after_the_restart(tmp_path):
    """SIGINT to the process we started interrupts the script: the restart kept the process.

    A handshake, not a timing: the signal goes once the script says it is waiting, and the
    script then waits until it is interrupted, in short sleeps (if the kernel hands the signal
    to another of its threads, the main thread's sleep still ends and it raises).  The limits
    only bound a hang: a slow start on a loaded machine waits for the line.

    The command starts with SIGINT at its default, as a terminal starts it.  A test run
    launched in the background (``pytest ... &`` from a script, ``nohup``) inherits SIGINT
    *ignored*, as does every process it starts; Python then installs no handler, ``python
    script.py`` itself would never see the Ctrl-C, and this test waited out its limit.
    """
    script = tmp_path / "wait.py"
    script.write_text(
        "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "deterministic_ctx", "run", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base_env(None),
        preexec_fn=_sigint_as_a_terminal_gives_it,
    )
    try:
        assert proc.stdout is not None
        assert _first_line(proc.stdout, timeout=300) == "ready\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("KeyboardInterrupt")
    assert f'File "{script}", line ' in err  # the script's frame (line 2, 3 or 4: a race)
    assert "cli.py" not in err


def _sigint_as_a_terminal_gives_it() -> None:
    """In the child, before it runs the command: SIGINT at its default disposition, which
    Python replaces with its KeyboardInterrupt handler (an ignored SIGINT it leaves ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _first_line(stream: IO[str], *, timeout: float) -> str:
    """The first line of ``stream`` ("" if it ended first); the test fails after ``timeout`` s."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines:
        pytest.fail(f"the script printed no line in {timeout} s")
    return lines[0]


@pytest.mark.slow
def test_exit_status_matches_python_itself(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.stdout.write('out')\nsys.exit(3)\n")
    ours = cli("run", str(script))
    theirs = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert (ours.returncode, ours.stdout) == (theirs.returncode, theirs.stdout) == (3, "out")


@pytest.mark.slow
def test_missing_module_is_a_usage_error(tmp_path):
    proc = cli("run", "-m", "no_such_module_here", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no module named 'no_such_module_here'" in proc.stderr


# --- usage errors, in-process (they return before anything is seeded or changed) --------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run", "--seed", "abc", "x.py"],
            "argument --seed: must be an integer in 0 .. 4294967295, got 'abc'",
        ),
        (["run", "--seed", "-1", "x.py"], "got '-1'"),
        (["run", "--seed", "4294967296", "x.py"], "got '4294967296'"),
        (["run", "--seed", "1.5", "x.py"], "got '1.5'"),
        (["run", "--seed"], "argument --seed: expected one argument"),
        (["run", "-m"], "argument -m: expected one argument"),
        (["run", "--frob", "x.py"], "unrecognized arguments: --frob"),
        (["run"], "a script (or -m module) is required"),
        (["run", "--seed", "3", "--"], "a script (or -m module) is required"),
        (["run", "does-not-exist.py"], "can't open file 'does-not-exist.py'"),
        ([], "the following arguments are required"),
        (["frob"], "invalid choice: 'frob'"),
        (["report", "--yaml"], "unrecognized arguments: --yaml"),
    ],
)
def test_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: deterministic-ctx" in err or "can't open file" in err


@pytest.mark.slow
def test_usage_error_in_a_subprocess_runs_nothing(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("open('ran', 'w').close()\n")
    proc = cli("run", "--seed", "abc", str(script), cwd=tmp_path)
    assert proc.returncode == 2
    assert "argument --seed" in proc.stderr
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("words", "ours", "script"),
    [
        (["s.py"], [], ["s.py"]),
        (["--seed", "3", "s.py", "--seed", "5"], ["--seed", "3"], ["s.py", "--seed", "5"]),
        (["--seed=3", "--warn-only", "s.py"], ["--seed=3", "--warn-only"], ["s.py"]),
        (["--", "--weird.py", "x"], [], ["--weird.py", "x"]),
        (["--seed", "3", "--"], ["--seed", "3"], []),
        (["-m", "pkg.mod", "--", "x"], ["-m", "pkg.mod"], ["--", "x"]),
        (["-mpkg.mod", "x"], ["-mpkg.mod"], ["x"]),
        (["--seed"], ["--seed"], []),
        (["-h", "s.py"], ["-h"], ["s.py"]),
    ],
)
def test_split_run(words, ours, script):
    assert _split(words) == (ours, script)
