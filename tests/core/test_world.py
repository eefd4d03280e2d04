"""World.restore: each source restored, retried once, failures and interrupts told apart."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deterministic_ctx import RestoreError, StateWarning, deterministic
from deterministic_ctx import sources as sources_module
from deterministic_ctx.core.world import World
from tests._oracle import World as Oracle


class _Once:
    """A source whose first restore raises ``first``; later ones succeed."""

    def __init__(self, name: str, first: BaseException | None) -> None:
        self.name = name
        self.first = first
        self.restored = 0

    def restore(self, state: Any) -> None:
        if self.first is not None:
            first, self.first = self.first, None
            raise first
        self.restored += 1


def test_a_recursion_error_the_retry_does_not_meet_again_is_not_raised():
    # At the recursion limit the first restore fails; the retry has room and
    # succeeds: the source is back and nothing is wrong, so nothing is raised.
    flaky, other = _Once("flaky", RecursionError("limit")), _Once("other", None)
    World((other, flaky), (None, None)).restore()
    assert (flaky.restored, other.restored) == (1, 1)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_what_a_signal_handler_may_raise_propagates_once_everything_is_back(exc_type):
    flaky, other = _Once("flaky", exc_type("handler")), _Once("other", None)
    with pytest.raises(exc_type, match="handler"):
        World((other, flaky), (None, None)).restore()
    assert (flaky.restored, other.restored) == (1, 1)


@pytest.mark.parametrize("exc_type", [TimeoutError, ValueError])
def test_an_ordinary_exception_the_retry_cures_is_a_warning_not_an_error(exc_type):
    # Issue 42, defect 2: the source is back, so nothing is raised for it (it used
    # to be re-raised as if it were an interrupt); one StateWarning says what happened.
    flaky, other = _Once("flaky", exc_type("handler")), _Once("other", None)
    with pytest.warns(StateWarning) as caught:
        World((other, flaky), (None, None)).restore()
    assert (flaky.restored, other.restored) == (1, 1)
    [warning] = caught.list
    assert str(warning.message) == (
        f"restoring flaky failed once ({exc_type('handler')!r}) and succeeded when retried"
    )


def test_a_block_whose_restore_fails_once_leaves_without_raising(monkeypatch):
    source = next(s for s in sources_module.SOURCES if s.name == "numpy")
    restore = source.restore
    failures = [TimeoutError("alarm")]

    def once(state: Any) -> None:
        if failures:
            raise failures.pop()
        restore(state)

    before = Oracle.now()
    monkeypatch.setattr(source, "restore", once)
    warns = pytest.warns(StateWarning, match=r"restoring numpy failed once \(TimeoutError")
    with warns, deterministic(seed=4):
        random.random()
    assert failures == []
    assert Oracle.now() == before


def test_a_source_failing_twice_is_named_in_restore_error():
    class Broken(_Once):
        def restore(self, state: Any) -> None:
            raise ValueError("bad")

    other = _Once("other", None)
    with pytest.raises(RestoreError) as info:
        World((other, Broken("broken", None)), (None, None)).restore()
    assert list(info.value.failures) == ["broken"]
    assert other.restored == 1


def test_a_block_whose_exit_meets_the_recursion_limit_once_leaves_without_raising(monkeypatch):
    source = next(s for s in sources_module.SOURCES if s.name == "random")
    restore = source.restore
    failures = [RecursionError("limit")]

    def at_the_limit(state: Any) -> None:
        if failures:
            raise failures.pop()
        restore(state)

    before = Oracle.now()
    monkeypatch.setattr(source, "restore", at_the_limit)
    with deterministic(seed=3):
        random.random()
    assert failures == []
    assert Oracle.now() == before
