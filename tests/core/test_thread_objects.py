"""Threads as real programs use them: shared block objects, pools, asyncio, dead owners.

Every scenario runs in a fresh interpreter with a time limit (``_run``): a
deadlock fails its test instead of hanging the suite, and a thread left
inside a block cannot touch the next test.  The scenarios are the functions
``scenario_*`` of this module, imported by the child.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import draw, run_python, solo

#: Seed of the caller's world (outside every block) in the scenarios.
BASE = 5


#: Run first in the child to make the process lock a pure-Python ``RLock``:
#: the lock relies only on what every supported Python's ``RLock`` has
#: (``acquire``, ``release``, ``_is_owned``), which this checks.
PY310_LOCK = """
import threading
from deterministic_ctx.base import lock as _lock
_lock._new_rlock = threading._PyRLock
_lock.LOCK._rlock = threading._PyRLock()
"""


def _run(name: str, timeout: float = 120, prelude: str = "") -> str:
    """Run ``scenario_<name>`` in a fresh interpreter; its stdout.  A hang fails."""
    code = f"{prelude}\nfrom tests.core.test_thread_objects import scenario_{name} as s; s()"
    proc = run_python([], code=code, timeout=timeout)
    assert proc.returncode == 0, f"scenario {name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _seed_caller() -> None:
    random.seed(BASE)
    np.random.seed(BASE)
    torch.manual_seed(BASE)


def _caller_untouched() -> None:
    """The caller's world is the one ``_seed_caller`` made, and no block is open."""
    from deterministic_ctx.base.lock import LOCK
    from deterministic_ctx.core import engine
    from tests.core.test_interrupts import _lock_free

    assert draw() == solo(BASE, 1)[0], "the caller's streams moved"
    assert not engine._active and LOCK.depth == 0 and _lock_free()


def _in_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """``target(i)`` in ``n`` threads started together; their results (or exceptions)."""
    results: list[Any] = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = target(i)
        except BaseException as exc:  # reported by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# -- one object shared by threads ------------------------------------------------------


def scenario_shared_deterministic() -> None:
    from deterministic_ctx import deterministic

    det = deterministic(seed=12)
    inner = deterministic(seed=13)
    outer_expected = solo(12, 3)
    inner_expected = solo(13, 2)
    _seed_caller()

    def work(i: int) -> bool:
        for _ in range(20):
            with det:
                a = draw()
                time.sleep(0.0005)  # another thread is waiting now
                with det:  # the same object nested in the same thread
                    nested = [draw(), draw()]
                with inner:
                    other = [draw(), draw()]
                b, c = draw(), draw()
            assert [a, b, c] == outer_expected, (i, [a, b, c])
            assert nested == outer_expected[:2]
            assert other == inner_expected
        return True

    for n in (4, 8):
        assert all(_in_threads(n, work))
    _caller_untouched()
    print("OK")


def scenario_shared_isolated() -> None:
    from deterministic_ctx import deterministic, isolated

    iso = isolated()
    det = deterministic(seed=3)
    caller_next = solo(BASE, 3)
    _seed_caller()

    def work(i: int) -> bool:
        for _ in range(20):
            with iso:  # draws the caller's next numbers, and puts the stream back
                a = draw()
                time.sleep(0.0005)
                with det, iso:  # an isolated block inside a deterministic one, shared too
                    inside = [draw(), draw()]
                b, c = draw(), draw()
            assert [a, b, c] == caller_next, (i, [a, b, c])
            assert inside == solo(3, 2)
        return True

    assert all(_in_threads(8, work))
    _caller_untouched()
    print("OK")


def scenario_each_thread_leaves_in_its_own_order() -> None:
    from deterministic_ctx import deterministic, isolated

    a, b = deterministic(seed=1), isolated()
    expected = solo(1, 4)
    _seed_caller()

    def work(i: int) -> bool:
        for _ in range(10):
            a.__enter__()
            first = draw()
            b.__enter__()  # isolated inside a: continues a's stream
            second = draw()
            if i % 2:  # odd threads leave a first, even threads b first
                a.__exit__(None, None, None)
                third = draw()  # b's world is still the live one
                b.__exit__(None, None, None)
            else:
                b.__exit__(None, None, None)
                third = draw()  # back in a's world, where b began
                a.__exit__(None, None, None)
            want = expected[:3] if i % 2 else [expected[0], expected[1], expected[1]]
            assert [first, second, third] == want, (i, [first, second, third])
        return True

    assert all(_in_threads(6, work))
    _caller_untouched()
    print("OK")


# -- pools ----------------------------------------------------------------------------


def scenario_thread_pool() -> None:
    from deterministic_ctx import deterministic, isolated, reproducible

    det = deterministic(seed=21)

    @reproducible(seed=20)
    def sample() -> list[tuple[float, float, float]]:
        time.sleep(0.0002)
        return [draw() for _ in range(3)]

    @det  # one shared object used as a decorator
    def shared() -> list[tuple[float, float, float]]:
        return [draw() for _ in range(2)]

    @reproducible(seed=22)
    def gen(n: int) -> Any:
        for _ in range(n):
            yield draw()

    @isolated
    def peek() -> tuple[float, float, float]:
        return draw()

    _seed_caller()
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(r == solo(20, 3) for r in pool.map(lambda _: sample(), range(400)))
        assert all(r == solo(21, 2) for r in pool.map(lambda _: shared(), range(400)))
        assert all(r == solo(BASE, 1)[0] for r in pool.map(lambda _: peek(), range(100)))
        # Generators stepped from whichever pool thread is free, interleaved.
        gens = [gen(12) for _ in range(6)]
        got: list[list[Any]] = [[] for _ in gens]
        lock = threading.Lock()

        def step(k: int) -> None:
            value = next(gens[k % len(gens)])
            with lock:
                got[k % len(gens)].append(value)

        for _ in range(12):  # one step of every generator per round, rounds in order
            list(pool.map(step, range(len(gens))))
        assert all(g == solo(22, 12) for g in got), got
    _caller_untouched()
    print("OK")


def scenario_asyncio_with_threads() -> None:
    from deterministic_ctx import deterministic, reproducible

    det = deterministic(seed=30)

    @reproducible(seed=31)
    def in_thread() -> list[tuple[float, float, float]]:
        with det:
            first = draw()
        return [first, *(draw() for _ in range(2))]

    @reproducible(seed=32)
    async def coro() -> list[tuple[float, float, float]]:
        out = [draw()]
        await asyncio.sleep(0.001)  # other tasks and the threads' blocks run here
        out.append(draw())
        return out

    async def with_blocks() -> list[list[tuple[float, float, float]]]:
        runs = []
        for _ in range(5):
            async with det:
                a = draw()
                await asyncio.sleep(0)  # the lock stays held: threads wait
                runs.append([a, draw()])
            await asyncio.sleep(0.001)
        return runs

    async def main() -> None:
        threads = [asyncio.to_thread(in_thread) for _ in range(6)]
        results = await asyncio.gather(with_blocks(), *(coro() for _ in range(4)), *threads)
        blocks, coros, thread_results = results[0], results[1:5], results[5:]
        assert all(r == solo(30, 2) for r in blocks), blocks
        assert all(r == solo(32, 2) for r in coros), coros
        expected = [solo(30, 1)[0], *solo(31, 2)]
        assert all(r == expected for r in thread_results), thread_results

    _seed_caller()
    asyncio.run(main())
    _caller_untouched()
    print("OK")


# -- a thread that ends inside a block --------------------------------------------------


def _leave_open(obj: Any, depth: int = 1) -> threading.Thread:
    """A thread named 'leaver' that enters ``obj`` ``depth`` times, draws and returns."""
    entered = threading.Event()

    def leave() -> None:
        for _ in range(depth):
            obj.__enter__()
            draw()
        entered.set()

    t = threading.Thread(target=leave, name="leaver")
    t.start()
    assert entered.wait(10)
    return t


def scenario_dead_owner_with_waiting_threads() -> None:
    from deterministic_ctx import AbandonedBlockWarning, deterministic

    det = deterministic(seed=12)
    _seed_caller()
    caught: list[warnings.WarningMessage] = []
    show = warnings.showwarning
    warnings.showwarning = lambda *a, **k: caught.append(warnings.WarningMessage(*a, **k))  # type: ignore[assignment]
    warnings.simplefilter("always")
    hold = threading.Event()
    entered = threading.Event()

    def leave() -> None:
        det.__enter__()
        entered.set()
        hold.wait(10)  # returns with the block open once the others wait

    leaver = threading.Thread(target=leave, name="leaver")
    leaver.start()
    assert entered.wait(10)
    started = time.monotonic()

    def wait_then_enter(i: int) -> list[tuple[float, float, float]]:
        if i == 0:
            time.sleep(0.2)  # the others are waiting on the lock by now
            hold.set()
            return solo(12, 2)
        with det:
            return [draw(), draw()]

    results = _in_threads(4, wait_then_enter)
    took = time.monotonic() - started
    leaver.join(10)
    warnings.showwarning = show  # type: ignore[assignment]
    assert all(r == solo(12, 2) for r in results), results
    abandoned = [w for w in caught if issubclass(w.category, AbandonedBlockWarning)]
    assert len(abandoned) == 1, [str(w.message) for w in caught]
    message = str(abandoned[0].message)
    assert "thread 'leaver' ended inside an open deterministic(seed=12) block" in message
    assert took < 5, took
    _caller_untouched()
    print(f"taken over in {took:.2f} s")
    print("OK")


def scenario_dead_owner_nested_then_later_blocks() -> None:
    from deterministic_ctx import AbandonedBlockWarning, deterministic, isolated

    _seed_caller()
    # Module-wide (``catch_warnings`` patches ``warnings.showwarning``): the
    # take-overs happen in other threads.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _leave_open(isolated(), depth=1)
        # Nested blocks: the world from before the first one comes back.
        _leave_open(deterministic(seed=4), depth=2)
        # Idents are reused: threads started now may get the dead thread's
        # ident, which the RLock takes for its owner's.  Each must still get in.
        for _ in range(5):
            assert _in_threads(3, lambda i: solo(12, 2)) == [solo(12, 2)] * 3
        _leave_open(deterministic(seed=6), depth=1)
        started = time.monotonic()
        with deterministic(seed=12):  # the main thread takes over
            assert draw() == solo(12, 1)[0]
        assert time.monotonic() - started < 5
    messages = [str(w.message) for w in caught if w.category is AbandonedBlockWarning]
    assert len(messages) == 3, messages
    # The first dead thread was noticed by the second leaver's first entry.
    assert any("inside an open isolated() block" in m for m in messages), messages
    assert any(
        "inside an open deterministic(seed=4) block and 1 more nested in it" in m for m in messages
    ), messages
    assert any("inside an open deterministic(seed=6) block;" in m for m in messages), messages
    _caller_untouched()
    print("OK")


def scenario_dead_owner_with_warnings_as_errors() -> None:
    from deterministic_ctx import AbandonedBlockWarning, deterministic

    _seed_caller()
    _leave_open(deterministic(seed=4), depth=2).join(10)
    with warnings.catch_warnings():
        # A suite run with -W error (or filterwarnings = error): the warning raises in
        # the thread that takes over, after the dead thread's state is put back.
        warnings.simplefilter("error", AbandonedBlockWarning)
        expected = "thread 'leaver' ended inside an open deterministic\\(seed=4\\)"
        with pytest.raises(AbandonedBlockWarning, match=expected), deterministic(seed=12):
            raise AssertionError("entered a block although the warning raised")
    _caller_untouched()
    _seed_caller()  # _caller_untouched drew from the caller's streams
    with deterministic(seed=12):  # the lock is free and the engine empty
        assert draw() == solo(12, 1)[0]
    _caller_untouched()
    print("OK")


@pytest.mark.parametrize(
    "name",
    [
        "shared_deterministic",
        "shared_isolated",
        "each_thread_leaves_in_its_own_order",
        "thread_pool",
        "asyncio_with_threads",
        "dead_owner_with_waiting_threads",
        "dead_owner_nested_then_later_blocks",
        "dead_owner_with_warnings_as_errors",
    ],
)
def test_scenario(name):
    _run(name)


@pytest.mark.parametrize(
    "name", ["shared_deterministic", "thread_pool", "dead_owner_nested_then_later_blocks"]
)
def test_scenario_with_the_python_3_10_lock(name):
    _run(name, prelude=PY310_LOCK)


# -- a random schedule: threads x shared/separate objects x nesting x exit order -------------


@dataclass
class _Stream:
    """A position in one seed's stream of ``draw()`` results."""

    seed: int
    pos: int = 0

    def copy(self) -> _Stream:
        return _Stream(self.seed, self.pos)


@dataclass
class _Open:
    obj: Any
    outer: _Stream  # the world at entry, given back at exit
    live: _Stream  # the block's own stream


@dataclass
class _Worker:
    """A thread that runs the callables it is sent, one at a time."""

    name: str
    inbox: queue.Queue[Any] = field(default_factory=queue.Queue)
    done: queue.Queue[Any] = field(default_factory=queue.Queue)
    open: list[_Open] = field(default_factory=list)
    pending: Any = None  # the object it is waiting to enter

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.inbox.get()) is not None:
            try:
                self.done.put(job())
            except BaseException as exc:
                self.done.put(exc)

    def call(self, job: Callable[[], Any]) -> Any:
        self.inbox.put(job)
        return self.result()

    def result(self, timeout: float = 10) -> Any:
        got = self.done.get(timeout=timeout)
        if isinstance(got, BaseException):
            raise got
        return got


def _expected(stream: _Stream, cache: dict[int, list[Any]]) -> Any:
    # From a cache filled beforehand: computing it here would enter a block
    # in the main thread while a worker holds the lock.
    return cache[stream.seed][stream.pos]


def scenario_random_schedules() -> None:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    from deterministic_ctx import AbandonedBlockWarning, deterministic, isolated
    from deterministic_ctx.base import lock as _lock

    warnings.simplefilter("ignore", AbandonedBlockWarning)
    # Waiters notice a dead owner sooner: the schedules kill many threads.
    _lock.POLL = 0.02
    shared = [deterministic(seed=7), isolated(), deterministic(seed=9)]
    steps = 30
    cache = {seed: solo(seed, steps + 1) for seed in (BASE, 7, 9, 11)}

    class Schedules(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            _seed_caller()
            self.workers = [_Worker(f"w{i}") for i in range(3)]
            self.owner: _Worker | None = None
            #: The lock is held by a thread that ended, and nobody entered since.
            self.dead = False

        def _live(self) -> _Stream:
            assert self.owner is not None
            return self.owner.open[-1].live

        def _idle(self, i: int) -> _Worker | None:
            w = self.workers[i % len(self.workers)]
            return None if w.pending is not None else w

        def _enter_model(self, w: _Worker, obj: Any) -> None:
            self.dead = False
            outer = self.owner.open[-1].live.copy() if self.owner is w else _Stream(BASE)
            seed = getattr(obj, "seed", None)
            live = outer.copy() if seed is None else _Stream(seed)
            w.open.append(_Open(obj, outer, live))
            self.owner = w

        def _hand_on(self) -> None:
            """The lock is free or its owner dead: one waiting thread gets in."""
            self.owner = None
            waiting = [w for w in self.workers if w.pending is not None]
            if not waiting:
                return
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                for w in waiting:
                    try:
                        w.result(timeout=0.01)
                    except queue.Empty:
                        continue
                    obj, w.pending = w.pending, None
                    self._enter_model(w, obj)
                    return
            raise AssertionError("no waiting thread got in within 10 s")

        @rule(i=st.integers(0, 2), which=st.integers(0, 4))
        def enter(self, i: int, which: int) -> None:
            w = self._idle(i)
            if w is None:
                return
            obj = (
                shared[which]
                if which < len(shared)
                else (deterministic(seed=11) if which == 3 else isolated())
            )
            if self.owner is None or self.owner is w:
                w.call(obj.__enter__)
                self._enter_model(w, obj)
            else:  # it waits for the lock
                w.pending = obj
                w.inbox.put(obj.__enter__)

        @precondition(lambda self: self.owner is not None)
        @rule()
        def draw_in_block(self) -> None:
            assert self.owner is not None
            live = self._live()
            got = self.owner.call(draw)
            assert got == _expected(live, cache), (self.owner.name, live)
            live.pos += 1

        @precondition(lambda self: self.owner is not None)
        @rule(k=st.integers(0, 10))
        def leave(self, k: int) -> None:
            w = self.owner
            assert w is not None
            # Leaving an object leaves its latest open block in this thread.
            objs = list(dict.fromkeys(o.obj for o in w.open))
            obj = objs[k % len(objs)]
            i = max(j for j, o in enumerate(w.open) if o.obj is obj)
            w.call(lambda: obj.__exit__(None, None, None))
            left = w.open.pop(i)
            if i < len(w.open):  # a later block is open: it gives back what this one had
                w.open[i].outer = left.outer
            elif w.open:
                w.open[-1].live = left.outer.copy()
            else:
                assert left.outer == _Stream(BASE)
                self._hand_on()

        @precondition(lambda self: self.owner is not None)
        @rule()
        def owner_dies(self) -> None:
            w = self.owner
            assert w is not None
            w.inbox.put(None)  # the thread returns with its blocks open
            w.thread.join(10)
            index = self.workers.index(w)
            self.workers[index] = _Worker(f"{w.name}'")
            self._hand_on()
            self.dead = self.owner is None

        @invariant()
        def lock_matches_the_model(self) -> None:
            from deterministic_ctx.core import engine

            if self.owner is not None:
                assert len(engine._active) == len(self.owner.open)

        def teardown(self) -> None:
            while self.owner is not None:
                w = self.owner
                for opened in reversed(w.open):
                    w.call(lambda o=opened.obj: o.__exit__(None, None, None))
                w.open.clear()
                self._hand_on()
            for w in self.workers:
                w.inbox.put(None)
                w.thread.join(10)
            if self.dead:  # the dead thread's world is live until the next block starts
                with isolated():
                    pass
            _caller_untouched()

    run = Schedules.TestCase
    run.settings = settings(
        max_examples=50,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    import unittest

    result = unittest.TextTestRunner(verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(run)
    )
    assert result.wasSuccessful()
    print("OK")


def test_random_schedules_of_threads_objects_nesting_and_exit_order():
    _run("random_schedules", timeout=600)
