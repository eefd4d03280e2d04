"""``start()`` / ``stop()``: a block without ``with``, with the same guarantees."""

from __future__ import annotations

import threading
import unittest
import warnings
from collections.abc import Iterator

import pytest

from deterministic_ctx import AbandonedBlockWarning, MisuseError, deterministic, isolated
from deterministic_ctx.base.lock import LOCK
from deterministic_ctx.base.scopes import SCOPES
from tests._oracle import World
from tests.core.test_interrupts import EXCEPTIONS, _clean, _leave_open_blocks, _Tracer
from tests.helpers import draw, solo


@pytest.fixture(autouse=True)
def _no_block_left_open() -> Iterator[None]:
    # A failing test must not leave its started block holding the lock for the next ones.
    yield
    if SCOPES.active:
        _leave_open_blocks()
        pytest.fail("a block was left open")


def test_start_and_stop_run_a_block():
    before = World.now()
    det = deterministic(seed=7)
    assert det.start() is det
    assert LOCK.depth == 1
    inside = [draw(), draw()]
    det.stop()
    assert inside == solo(7, 2)
    assert LOCK.depth == 0
    assert World.now() == before


def test_isolated_start_and_stop_put_everything_back():
    before = World.now()
    iso = isolated()
    iso.start()
    draw()
    iso.stop()
    assert World.now() == before


@pytest.mark.parametrize("before", [[], ["start", "stop"]])
def test_stop_without_a_matching_start_is_a_clear_error(before):
    det = deterministic(seed=1)
    for name in before:
        getattr(det, name)()
    with pytest.raises(MisuseError, match=r"stop\(\) without a matching start\(\) in this thread"):
        det.stop()
    assert LOCK.depth == 0


def test_stop_never_leaves_a_with_block_and_exit_never_a_started_one():
    before = World.now()
    det = deterministic(seed=2)
    with det:
        with pytest.raises(MisuseError, match="without a matching start"):
            det.stop()
        assert LOCK.depth == 1
    det.start()
    with pytest.raises(MisuseError, match="exited without being entered"):
        det.__exit__(None, None, None)
    det.stop()
    assert LOCK.depth == 0
    assert World.now() == before


def test_started_blocks_nest_with_with_blocks_in_any_exit_order():
    before = World.now()
    outer, inner = deterministic(seed=3), deterministic(seed=4)
    outer.start()
    with inner:
        assert draw() == solo(4, 1)[0]
    assert draw() == solo(3, 1)[0]  # the outer block continues where it was
    outer.stop()
    assert World.now() == before

    # Out of order: the started block leaves while a `with` block entered after it is open.
    outer.start()
    with inner:
        outer.stop()  # restores nothing yet: the inner world is the live one
        assert draw() == solo(4, 1)[0]
    assert LOCK.depth == 0
    assert World.now() == before


def test_one_object_started_twice_stops_its_latest_block_first():
    before = World.now()
    det = deterministic(seed=5)
    det.start()
    draw()
    det.start()  # a fresh block from the seed
    assert draw() == solo(5, 1)[0]
    det.stop()
    assert draw() == solo(5, 2)[1]
    det.stop()
    assert World.now() == before


def test_stop_in_another_thread_is_refused_and_the_block_stays_its_threads():
    before = World.now()
    det = deterministic(seed=6)
    det.start()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            det.stop()
        except MisuseError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and "in this thread" in str(errors[0])
    assert draw() == solo(6, 1)[0]
    det.stop()
    assert World.now() == before


def test_threads_sharing_one_object_each_get_their_own_block_one_at_a_time():
    before = World.now()
    det = deterministic(seed=8)
    results: list[object] = []

    def work() -> None:
        det.start()
        try:
            results.append([draw(), draw()])
        finally:
            det.stop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [solo(8, 2)] * 4
    assert World.now() == before


def test_a_thread_that_ends_without_stop_is_handled_like_an_unfinished_with():
    before = World.now()
    thread = threading.Thread(target=lambda: deterministic(seed=9).start())
    thread.start()
    thread.join(10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deterministic(seed=10):  # takes the dead thread's lock over
            assert draw() == solo(10, 1)[0]
    assert [w.category for w in caught] == [AbandonedBlockWarning]
    assert "deterministic(seed=9)" in str(caught[0].message)
    assert World.now() == before


class _Case(unittest.TestCase):
    def setUp(self) -> None:
        self.det = deterministic(seed=11)
        self.det.start()
        self.addCleanup(self.det.stop)

    def test_draws(self) -> None:
        self.assertEqual(draw(), solo(11, 1)[0])


def test_unittest_setup_with_add_cleanup():
    before = World.now()
    result = unittest.TestResult()
    _Case("test_draws").run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert LOCK.depth == 0
    assert World.now() == before


@pytest.fixture
def seeded() -> Iterator[deterministic]:
    det = deterministic(seed=12).start()
    yield det
    det.stop()


def test_a_pytest_fixture_runs_the_test_in_the_started_block(seeded):
    # The leak guard (tests/conftest.py) checks that stop() put everything back.
    assert LOCK.depth == 1
    assert [draw(), draw()] == solo(12, 2)


def test_a_disabled_object_starts_and_stops_nothing():
    det = deterministic(seed=0, enabled=False)
    det.start()
    assert LOCK.depth == 0
    det.stop()
    det.stop()  # like its __exit__: nothing to leave, nothing to refuse


@pytest.mark.slow
def test_an_exception_at_any_line_of_start_or_stop_leaves_nothing_behind():
    det = deterministic(seed=13)

    def operation() -> None:
        det.start()
        draw()
        det.stop()

    before = World.now()
    for _ in range(2):  # warm the caches, so every run takes the same path
        _Tracer().run(operation)
    dry = _Tracer()
    dry.run(operation)
    assert _clean(before)
    assert dry.count > 20
    problems, boundary = [], 0
    for exc_type in EXCEPTIONS:
        for k in range(1, dry.count + 1):
            tracer = _Tracer(k, exc_type)
            raised = tracer.run(operation)
            assert isinstance(raised, exc_type), (tracer.fired, raised)
            if _clean(before):
                continue
            assert tracer.fired is not None
            name, _line, first = tracer.fired
            if name == "stop" and first:
                # Before the first line of stop(): the block is open, as an
                # interrupt before the call would leave it; stop() again leaves it.
                boundary += 1
                det.stop()
                if _clean(before):
                    continue
            problems.append((exc_type.__name__, k, tracer.fired))
            while LOCK.depth:
                det.stop()
    assert problems == []
    assert boundary <= len(EXCEPTIONS)
