"""The ``deterministic_ctx.rngs`` entry-point group: installed packages' RNGs.

A tiny distribution is installed for real in a temporary directory (a
``*.dist-info`` with ``entry_points.txt``, found by ``importlib.metadata``
on ``sys.path``), and each test runs a fresh interpreter on it, so the test
process's registry and ``sys.modules`` stay untouched.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.slow  # fresh interpreters that import torch

MODULE = """
import random

RNG = random.Random(5)
EXTRA = [random.Random(1), random.Random(2)]


class Like:
    def __init__(self):
        self._r = random.Random(0)

    def seed(self, s):
        self._r.seed(s)

    def getstate(self):
        return self._r.getstate()

    def setstate(self, state):
        self._r.setstate(state)

    def random(self):
        return self._r.random()


LIKE = Like()
CALLS = []


def single():
    CALLS.append("single")
    return RNG


def many():
    return EXTRA


def named():
    return {"like": LIKE}


def nothing():
    return None


def broken():
    raise RuntimeError("no RNG today")


def wrong():
    return 42


def half_wrong():
    return [random.Random(3), "not an rng"]


NOT_CALLABLE = 7
"""

ENTRY_POINTS = """
[deterministic_ctx.rngs]
demo = dctx_demo_rngs:single
many = dctx_demo_rngs:many
named = dctx_demo_rngs:named
nothing = dctx_demo_rngs:nothing
broken = dctx_demo_rngs:broken
wrong = dctx_demo_rngs:wrong
half = dctx_demo_rngs:half_wrong
value = dctx_demo_rngs:NOT_CALLABLE
missing = dctx_no_such_module:factory
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    (root / "dctx_demo_rngs.py").write_text(MODULE)
    info = root / "dctx_demo_rngs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dctx-demo-rngs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def child(site: Path, code: str) -> dict:
    prologue = textwrap.dedent(
        """
        import json, random, sys, warnings
        warnings.simplefilter("always")
        caught = warnings.catch_warnings(record=True)
        log = caught.__enter__()
        warnings.simplefilter("always")
        out = {}
        """
    )
    epilogue = textwrap.dedent(
        """
        from deterministic_ctx import StateWarning
        out["warnings"] = [str(w.message) for w in log if w.category is StateWarning]
        print("RESULT " + json.dumps(out))
        """
    )
    proc = run_python(
        [], code=prologue + textwrap.dedent(code) + epilogue, env={"PYTHONPATH": str(site)}
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_entry_points_load_at_the_first_block_and_their_rngs_are_managed(site: Path):
    out = child(
        site,
        """
        import deterministic_ctx
        out["after_import"] = sorted(
            m for m in ("dctx_demo_rngs", "torch", "numpy") if m in sys.modules
        )
        from deterministic_ctx import deterministic, derive_seed, registered_rngs
        deterministic(seed=0)  # the engine is loaded, and still no entry point
        out["after_engine"] = "dctx_demo_rngs" in sys.modules
        import dctx_demo_rngs as demo
        before = demo.RNG.getstate(), demo.LIKE.getstate(), demo.EXTRA[1].getstate()
        with deterministic(seed=0):
            out["inside"] = [demo.RNG.random(), demo.LIKE.random(), demo.EXTRA[1].random()]
        out["expected"] = [
            random.Random(derive_seed(0, "user", "demo", bits=64)).random(),
            random.Random(derive_seed(0, "user", "named.like", bits=32)).random(),
            random.Random(derive_seed(0, "user", "many.1", bits=64)).random(),
        ]
        out["restored"] = before == (
            demo.RNG.getstate(), demo.LIKE.getstate(), demo.EXTRA[1].getstate()
        )
        with deterministic(seed=0):
            pass
        out["keys"] = [k for k, _ in registered_rngs()]
        out["calls"] = demo.CALLS
        """,
    )
    assert out["after_import"] == []  # import deterministic_ctx loads none of them
    assert out["after_engine"] is False
    assert out["inside"] == out["expected"]
    assert out["restored"] is True
    # sorted by entry-point name; "half" registers nothing (all or nothing)
    assert out["keys"] == ["demo", "many.0", "many.1", "named.like"]
    assert out["calls"] == ["single"]  # loaded once, however many blocks


def test_a_broken_entry_point_warns_naming_it_and_blocks_still_work(site: Path):
    out = child(
        site,
        """
        from deterministic_ctx import deterministic, registered_rngs
        out["keys"] = [k for k, _ in registered_rngs()]  # the first call loads them
        out["again"] = [k for k, _ in registered_rngs()]
        with deterministic(seed=1):
            x = random.random()
        with deterministic(seed=1):
            out["same"] = random.random() == x
        """,
    )
    assert out["keys"] == out["again"] == ["demo", "many.0", "many.1", "named.like"]
    assert out["same"] is True
    messages = out["warnings"]
    assert len(messages) == 5, messages  # once each, not once per block
    expected = {
        "broken": "RuntimeError: no RNG today",
        "wrong": "TypeError: it returned a int: expected an RNG",
        "half": "TypeError: register_rng() cannot manage str",
        "value": "TypeError: it loads to a int, not a callable",
        "missing": "ModuleNotFoundError",
    }
    for name, error in expected.items():
        (message,) = [m for m in messages if m.startswith(f"entry point {name!r}")]
        assert "of group 'deterministic_ctx.rngs' failed" in message
        assert error in message


def test_a_snapshot_of_an_entry_point_rng_loads_in_another_process(site: Path):
    """The key is the entry point's name, the same in every process."""
    out = child(
        site,
        """
        import tempfile, os
        from deterministic_ctx import Snapshot
        import dctx_demo_rngs as demo
        path = os.path.join(tempfile.mkdtemp(), "s.snap")
        Snapshot.capture().save(path)
        expected = [demo.RNG.random(), demo.LIKE.random()]
        Snapshot.load(path).restore()
        out["same"] = [demo.RNG.random(), demo.LIKE.random()] == expected
        """,
    )
    assert out["same"] is True
