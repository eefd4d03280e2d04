"""The completion step every restore and exit of the engine is run by (base/completion.py)."""

from __future__ import annotations

import sys

import pytest

from deterministic_ctx.base.completion import HEADROOM, complete, complete_each, guarded


class _Steps:
    """A step that raises each of ``raises`` in turn (``None``: succeeds), and
    records the recursion limit it ran under."""

    def __init__(self, *raises: BaseException | None) -> None:
        self.raises = list(raises)
        self.limits: list[int] = []

    def __call__(self, *args: object) -> None:
        self.limits.append(sys.getrecursionlimit())
        exc = self.raises.pop(0) if self.raises else None
        if exc is not None:
            raise exc


def test_complete_runs_an_interrupted_step_again_with_headroom_then_raises():
    limit = sys.getrecursionlimit()
    step = _Steps(KeyboardInterrupt("first"), None)
    with pytest.raises(KeyboardInterrupt, match="first"):
        complete(step)
    assert step.limits == [limit, limit + HEADROOM]
    assert sys.getrecursionlimit() == limit


def test_complete_raises_a_second_interrupt_but_not_the_retrys_ordinary_exception():
    with pytest.raises(SystemExit) as info:
        complete(_Steps(KeyboardInterrupt("first"), SystemExit("again")))
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt, match="first"):
        complete(_Steps(KeyboardInterrupt("first"), ValueError("again")))


def test_complete_each_runs_every_step_and_reports_each_failure():
    done: list[int] = []
    first, second = ValueError("x"), KeyboardInterrupt("y")
    steps = {1: _Steps(first, second), 3: _Steps(second, None)}

    def step(i: int) -> None:
        if i in steps:
            steps[i]()
        done.append(i)

    failures = complete_each((step, i) for i in range(5))
    assert done == [0, 2, 3, 4]  # 1 failed twice; 3 was interrupted and retried
    assert failures == [(1, first, second), (3, second, None)]


@pytest.mark.parametrize("after", [False, True])
def test_guarded_completes_the_undo_when_anything_stops_the_action(after):
    undo = _Steps()
    with pytest.raises(ValueError, match="action"):
        guarded(undo, _Steps(ValueError("action")), after=after)
    assert len(undo.limits) == 1
    # The undo interrupted in turn is completed, then its interrupt propagates.
    undo = _Steps(KeyboardInterrupt("in undo"), None)
    with pytest.raises(KeyboardInterrupt, match="in undo") as info:
        guarded(undo, _Steps(ValueError("action")), after=after)
    assert len(undo.limits) == 2
    assert isinstance(info.value.__context__, ValueError)
    ran = _Steps()
    assert guarded(ran, lambda x: x * 2, 21, after=after) == 42
    assert len(ran.limits) == int(after)
