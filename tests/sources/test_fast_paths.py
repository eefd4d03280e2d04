"""The fast paths' off switch: ``DETERMINISTIC_CTX_NO_FAST_PATHS=1``.

Each source chooses its fast path once, at import; the variable, read then,
turns every one off.  The whole suite passes with it set (CI runs the
``not slow`` suite so once); here, fresh interpreters with and without it
check that the switch reaches every path, that ``report()`` says so, and
that the law "capture, anything, restore is the identity" holds either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deterministic_ctx.base import fast_paths as _memory
from deterministic_ctx.reporting import report
from deterministic_ctx.sources import fast_paths

ROOT = Path(__file__).resolve().parents[2]

#: What a fresh interpreter reports of its paths, as JSON.
_PATHS = textwrap.dedent("""
    import json, random
    import numpy as np
    import deterministic_ctx as dc
    from deterministic_ctx.reporting import report
    from deterministic_ctx.sources import NumpyGlobalSource, PythonRandomSource, fast_paths
    from deterministic_ctx.sources.user_rngs import registry

    rng = dc.register_rng(random.Random(3), key="r")
    gen = dc.register_rng(np.random.default_rng(4), key="g")
    (r_entry, g_entry) = registry.live_entries()
    with dc.deterministic(seed=0):
        first = (random.random(), float(np.random.rand()), rng.random(), float(gen.random()))
    with dc.deterministic(seed=0):
        again = (random.random(), float(np.random.rand()), rng.random(), float(gen.random()))
    print(json.dumps({
        "paths": fast_paths(),
        "shown": report().fast_paths,
        "random": type(PythonRandomSource().capture()[0]).__name__,
        "numpy": type(NumpyGlobalSource().capture()[1]).__name__,
        "entries": [bool(r_entry.views), bool(g_entry.views)],
        "draws": [first, again],
        "classic": [random.Random(0).random(), float(np.random.RandomState(0).rand())],
    }))
""")


def _fresh(code: str, *, off: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != _memory.SWITCH}
    if off:
        env[_memory.SWITCH] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def _paths(*, off: bool) -> dict[str, object]:
    done = _fresh(_PATHS, off=off)
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_report_shows_the_fast_paths_of_this_process():
    shown = report().fast_paths
    assert shown == fast_paths()
    # CPython: every layout is proven.
    assert set(shown.values()) == {_memory.ENABLED}
    assert "Fast paths (DETERMINISTIC_CTX_NO_FAST_PATHS=1 turns them off)" in str(report())


@pytest.mark.parametrize("off", [False, True], ids=["on", "off"])
def test_the_switch_chooses_every_path_at_import(off):
    found = _paths(off=off)
    assert found["shown"] == found["paths"]
    paths: dict[str, bool] = found["paths"]  # type: ignore[assignment]
    assert set(paths.values()) == {not off}
    # Captured as raw records, or in the public API's form.
    assert (found["random"], found["numpy"]) == (("int", "dict") if off else ("bytes", "bytes"))
    # Registered RNGs: the public API, or copies of their C records.
    assert found["entries"] == [not off, not off]
    first, again = found["draws"]  # type: ignore[misc]
    assert first == again
    assert first[:2] == found["classic"]  # the classic recipe's draws, either way


def test_only_1_or_a_value_turns_them_off():
    code = "from deterministic_ctx.base import fast_paths as _memory; print(_memory.ENABLED)"
    for value, enabled in (("0", True), ("", True), ("1", False), ("yes", False)):
        env = {**os.environ, _memory.SWITCH: value}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.stdout.strip() == str(enabled), (value, done.stderr)


@pytest.mark.slow
def test_the_laws_hold_with_the_fast_paths_off():
    """The Hypothesis laws (capture, anything, restore is the identity; nested
    blocks isolate) in an interpreter whose every fast path is off."""
    env = {**os.environ, _memory.SWITCH: "1"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"),
            "tests/core/test_properties.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


#: What the caches outside the RNG sources remember after two blocks with seed 5
#: and two derivations of one sub-seed.
_CACHES = textwrap.dedent("""
    from deterministic_ctx import deterministic, derive_seed
    from deterministic_ctx.base import seed, settings
    from deterministic_ctx.sources import source_named

    for _ in range(2):
        with deterministic(seed=5):
            pass
        derive_seed(5, "rank", 1)
    print(len(settings._BUILT), len(source_named("environ")._hash_values), len(seed._DERIVED))
""")


@pytest.mark.parametrize("off", [False, True], ids=["on", "off"])
def test_the_switch_turns_every_cache_off(off):
    done = _fresh(_CACHES, off=off)
    assert done.returncode == 0, done.stderr
    built, hash_values, derived = map(int, done.stdout.split())
    assert (built > 0, hash_values > 0, derived > 0) == (not off, not off, not off)
