"""Every example in examples/ and every docstring example runs in the suite.

Each example runs once: the tests that check what it printed share the run of
``test_example_runs`` (with the arguments of ``ARGS``) through a module-scoped fixture
(under pytest-xdist too: the suite runs each file whole on one worker, ``--dist loadfile``).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import re
import subprocess

import pytest
import torch

import deterministic_ctx
from deterministic_ctx import Snapshot, _torch
from tests.helpers import ROOT, needs_gloo, run_python

#: Examples with a test module of their own, which runs them and checks what they print:
#: run again here, they would only double the suite's time.
OWN_TESTS = {
    "multinode_resume.py": "tests/parallel/test_multinode_example.py",
    "resume_mid_epoch.py": "tests/parallel/test_resume_mid_epoch.py",
    "check_resume_loop.py": "tests/integrations/test_check_resume.py",
    "transformers_resume.py": "tests/integrations/test_transformers.py",
}
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name not in OWN_TESTS)
#: Seconds per training run of the DDP example (its ranks, their workers, a gloo group).
LAUNCH_TIMEOUT = 180.0

#: The arguments each example runs with, where not none: the DDP example trains twice, each
#: time on fresh ranks and workers, so that one run shows that two runs print the same.
ARGS = {"ddp_training.py": ("--seed", "3", "--runs", "2")}
TIMEOUTS = {"ddp_training.py": 2 * LAUNCH_TIMEOUT}
#: Examples and modules whose examples need an optional library: skipped where it does not import.
LIBRARIES = {
    "lightning_resume.py": "lightning",
    "deterministic_ctx.integrations.lightning": "lightning",
    "deterministic_ctx.integrations.transformers": "transformers",
}


def needs_library(name: str) -> None:
    """Skip, with the reason, when what ``name``'s examples need is not installed (looked
    up, not imported: importing Lightning draws from ``random`` outside the examples' snapshot)."""
    library = LIBRARIES.get(name)
    if library is not None and importlib.util.find_spec(library) is None:
        pytest.skip(f"{name}'s examples need {library}, which is not installed")


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """The example runs of this module so far, by file name."""
    return {}


def run_example(
    runs: dict[str, subprocess.CompletedProcess[str]], name: str
) -> subprocess.CompletedProcess[str]:
    """The run of ``examples/name``: now, or earlier by another test.

    A session of its own: a timeout kills the processes the example started along with it.
    """
    if name not in runs:
        runs[name] = run_python(
            [str(ROOT / "examples" / name), *ARGS.get(name, ())],
            timeout=TIMEOUTS.get(name, 300),
            own_session=True,
        )
    return runs[name]


def test_there_are_examples():
    assert any(p.name == "quickstart.py" for p in EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(runs, path):
    needs_library(path.name)
    proc = run_example(runs, path.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_quickstart_output(runs):
    stdout = run_example(runs, "quickstart.py").stdout
    assert "identical losses: True" in stdout
    assert "caller's torch RNG untouched: True" in stdout


@pytest.mark.slow
def test_trace_compare_example_names_the_loss_and_the_thread_count(runs):
    proc = run_example(runs, "trace_compare.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert sum(line.startswith("recorded ") for line in out.splitlines()) == 2
    assert "Traces diverge: B differs from A first at module call #4, (root) (MSELoss)" in out
    assert "process.num_threads: 1 (A) vs 2 (B)" in out
    assert "`deterministic-ctx trace compare` would exit with status 1" in out


@needs_gloo
@pytest.mark.slow
def test_ddp_example_prints_the_same_losses_twice(runs):
    proc = run_example(runs, "ddp_training.py")
    assert proc.returncode == 0, proc.stderr
    # Each training run prints from its "seed" line on: two runs, the same output.
    before, first, second = re.split(r"^(?=seed )", proc.stdout, flags=re.MULTILINE)
    assert before == ""
    assert first == second
    assert "model initialization identical on all ranks: True" in first
    losses = re.findall(r"^rank (\d) losses: (.*)$", first, flags=re.MULTILINE)
    assert [rank for rank, _ in losses] == ["0", "1"]
    assert losses[0][1] != losses[1][1]
    assert len(losses[0][1].split()) == 8


def _modules():
    names = [deterministic_ctx.__name__]
    for info in pkgutil.walk_packages(deterministic_ctx.__path__, prefix="deterministic_ctx."):
        names.append(info.name)
    return sorted(names)


OPTIONAL = {"deterministic_ctx.integrations.ipython", "deterministic_ctx.integrations.transformers"}
#: Modules whose examples need a torch capability (``deterministic_ctx._torch``).
NEEDS = {
    "deterministic_ctx.state.dcp": _torch.DCP_STATEFUL,
    "deterministic_ctx.core.exempt": _torch.SCOPED_EXEMPTION,
}


@pytest.mark.usefixtures("registry")  # an example registers an environment variable
@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if name in OPTIONAL:
            pytest.skip(f"optional dependency missing: {exc}")
        raise
    needs_library(name)
    capability = NEEDS.get(name)
    if capability is not None and not capability.available:
        pytest.skip(
            f"its examples need {capability.reads} (torch >= {capability.since}); "
            f"torch {torch.__version__} lacks it"
        )
    snap = Snapshot.capture()  # docstring examples may draw from the global RNGs
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    finally:
        snap.restore()
    assert result.failed == 0
