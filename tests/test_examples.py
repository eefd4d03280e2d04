"""Every example in examples/ and every docstring example runs in the suite."""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import deterministic_ctx
from deterministic_ctx import Snapshot

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert any(p.name == "quickstart.py" for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_quickstart_output():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert "identical losses: True" in proc.stdout
    assert "caller's torch RNG untouched: True" in proc.stdout


def _modules():
    names = [deterministic_ctx.__name__]
    for info in pkgutil.walk_packages(deterministic_ctx.__path__, prefix="deterministic_ctx."):
        names.append(info.name)
    return sorted(names)


OPTIONAL = {"deterministic_ctx.ipython", "deterministic_ctx.pytest_plugin"}


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if name in OPTIONAL:
            pytest.skip(f"optional dependency missing: {exc}")
        raise
    snap = Snapshot.capture()  # docstring examples may draw from the global RNGs
    try:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    finally:
        snap.restore()
    assert result.failed == 0
