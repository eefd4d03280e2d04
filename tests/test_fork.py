"""fork: the child starts with a usable lock and a consistent state."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import pytest

from deterministic_ctx import Snapshot, deterministic
from tests.helpers import draw, solo

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork start method")


def _child(queue):
    # The lock must be usable; draws continue the state the child inherited.
    inherited = draw()
    with deterministic(seed=21):
        inside = draw()
    after = draw()
    queue.put((inherited, inside, after))


def _fork_run():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0
    return result


def test_fork_inside_a_block():
    with deterministic(seed=3):
        inherited, inside, after = _fork_run()
        parent = [draw(), draw()]
    assert inside == solo(21, 1)[0]
    # The child continued the block's stream; the parent was not affected by the child.
    assert [inherited, after] == solo(3, 2) == parent


def test_fork_outside_a_block():
    with deterministic(seed=4):
        with deterministic(seed=5):
            pass
        inherited, inside, after = _fork_run()
    assert inside == solo(21, 1)[0]
    assert [inherited, after] == solo(4, 2)


def test_fork_while_another_thread_holds_a_block():
    snap = Snapshot.capture()
    expected = [draw(), draw()]  # what the forking thread's view continues with
    snap.restore()
    entered, release = threading.Event(), threading.Event()

    def holder():
        with deterministic(seed=99):
            entered.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert entered.wait(30)
    try:
        inherited, inside, after = _fork_run()
    finally:
        release.set()
        t.join(30)
    # The child left the other thread's block (that thread does not exist there)
    # and its lock is free: it sees the state outside the block.
    assert [inherited, after] == expected
    assert inside == solo(21, 1)[0]
