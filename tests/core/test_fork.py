"""fork: the child starts with a usable lock and a consistent state."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

from deterministic_ctx import Snapshot, deterministic, reproducible
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


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_many_forks_while_another_thread_enters_and_leaves_blocks():
    # The other thread is at a random instant of entering, running or leaving
    # a block (or copying NumPy's state under its lock) at each fork.  Every
    # child must start from the state outside that thread's blocks, and be
    # able to enter a block and draw from NumPy.
    snap = Snapshot.capture()
    # NumPy and torch: ``random`` is reseeded by CPython in a child forked
    # while the other thread happens to be between blocks.
    outside = draw()[1:]
    snap.restore()
    inside = solo(21, 1)[0]
    stop = threading.Event()

    @reproducible(seed=8)
    def busy():
        np.random.rand(64)
        random.random()

    def loop():
        while not stop.is_set():
            busy()

    worker = threading.Thread(target=loop)
    worker.start()
    failures = []
    try:
        for _ in range(150):
            pid = os.fork()
            if pid == 0:  # the child: report through the exit code, never return
                code = 0
                try:
                    if draw()[1:] != outside:
                        code = 1
                    else:
                        snap.restore()
                        with deterministic(seed=21):
                            if draw() != inside:
                                code = 2
                except BaseException:
                    code = 3
                os._exit(code)
            failures.append(_wait(pid))
    finally:
        stop.set()
        worker.join(30)
    assert [f for f in failures if f] == []


def _wait(pid: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1  # hung: a lock held by a thread that does not exist in the child
