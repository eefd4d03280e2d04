"""Threads: blocks are serialized process-wide; the waiting policy; no deadlock."""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from deterministic_ctx import LockWaitWarning, deterministic, reproducible, set_lock_warning
from deterministic_ctx.base.lock import LOCK
from tests.helpers import draw, solo


@reproducible(seed=12)
def sample():
    return [draw() for _ in range(3)]


def test_eight_threads_two_hundred_calls_all_identical():
    expected = solo(12, 3)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: sample(), range(1600)))
    assert all(r == expected for r in results)


def test_generators_in_threads_are_isolated():
    @reproducible(seed=3)
    def gen(n):
        for _ in range(n):
            yield draw()
            time.sleep(0.0005)

    expected = solo(3, 20)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: list(gen(20)), range(8)))
    assert all(r == expected for r in results)


def test_block_that_starts_a_thread_which_does_not_enter_a_block_does_not_deadlock():
    out = []
    with deterministic(seed=0):
        t = threading.Thread(target=lambda: out.append(sum(range(10))))
        t.start()
        t.join(timeout=10)
    assert out == [45]


def test_nesting_in_one_thread_is_reentrant():
    with deterministic(seed=0):
        assert LOCK.depth == 1
        with deterministic(seed=1):
            assert LOCK.depth == 2
    assert LOCK.depth == 0


def test_long_wait_warns_naming_the_holder_then_keeps_waiting():
    entered = threading.Event()
    release = threading.Event()

    def holder():
        with deterministic(seed=0):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=holder, name="holder-thread")
    t.start()
    entered.wait(10)
    set_lock_warning(0.05)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def release_once_warned() -> None:
                # Not after a fixed delay: on a busy machine this thread might start
                # waiting only after it, and then never wait long enough to be warned.
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not any(
                    issubclass(w.category, LockWaitWarning) for w in list(caught)
                ):
                    time.sleep(0.01)
                release.set()

            threading.Thread(target=release_once_warned).start()
            with deterministic(seed=1):
                got_in = True
    finally:
        set_lock_warning(10.0)
        release.set()
        t.join(10)
    assert got_in
    messages = [str(w.message) for w in caught if issubclass(w.category, LockWaitWarning)]
    assert len(messages) == 1
    assert "'holder-thread'" in messages[0] and "waited 0.05 s" in messages[0]


def test_no_warning_when_disabled():
    set_lock_warning(None)
    try:
        assert LOCK.warn_after is None
        with deterministic(seed=0):
            pass
    finally:
        set_lock_warning(10.0)


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_set_lock_warning_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="seconds must be a positive number or None"):
        set_lock_warning(bad)
