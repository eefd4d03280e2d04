"""The completion step: finish an idempotent step that an exception stopped, then report it.

A signal handler can raise between any two lines (``KeyboardInterrupt``, a
``SIGALRM`` timeout), and a block left by deep recursion meets the recursion
limit in its exit.  Every restore and every exit of the library is written so
that running it again does exactly what an interrupted run left undone; what
to do when it is stopped is written once, here: run it once more, with room
on the stack (the recursion limit raised by 100 for the second run), then
say what happened.

* :func:`complete`: one step (a block's exit, closing an exemption's
  window); the exception that stopped it propagates once it is done.
* :func:`complete_each`: many steps that must all run (each precision
  entry to write back, each registered RNG to restore); the others run
  whatever one of them does, and the caller decides what each failure
  means.  A world's restore, a block's hot path, runs the same loop written
  out (no bound method made per source) and uses :func:`retry`.
* :func:`guarded`: an action whose undo must be completed if anything stops
  it (a decorated call, an exempted op's call), written as one ``try``
  whose every line is under its handler.

The limit is raised and lowered in the frame that runs the retry, not in a
context manager: an ``__exit__`` is one frame deeper, where lowering the
limit again can itself fail.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["HEADROOM", "complete", "complete_each", "guarded", "retry"]

T = TypeVar("T")
R = TypeVar("R")

#: How many frames the retry gets beyond the recursion limit.
HEADROOM = 100

#: One call that failed: ``(its index, first exception, the retry's or None)``.
Failure = tuple[int, BaseException, BaseException | None]


def retry(step: Callable[..., object], *args: Any) -> BaseException | None:
    """Run ``step(*args)`` once more, with headroom: what it raised, or ``None``."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + HEADROOM)
    try:
        step(*args)
    except BaseException as again:
        return again
    finally:
        sys.setrecursionlimit(limit)
    return None


def complete(step: Callable[..., object], *args: Any) -> None:
    """Run the idempotent ``step(*args)``; if anything stops it, run it once
    more (:func:`retry`) to finish it, then raise what stopped it.

    An ordinary exception from the second run (a :class:`RestoreError` the
    step raises after its bookkeeping) is dropped: the first says what went
    wrong.  Anything else it raises (a second interrupt) propagates instead.

    Example:
        >>> done = []
        >>> def step():
        ...     done.append(1)
        ...     if len(done) == 1:
        ...         raise KeyboardInterrupt
        >>> try:
        ...     complete(step)
        ... except KeyboardInterrupt:
        ...     print(len(done))
        2
    """
    try:
        step(*args)
    except BaseException as first:
        again = retry(step, *args)
        if again is not None and not isinstance(again, Exception):
            raise again from first
        raise


def complete_each(calls: Iterable[tuple[Callable[[T], object], T]]) -> list[Failure]:
    """``step(arg)`` for each ``(step, arg)`` of ``calls``; one that raises is
    retried once (:func:`retry`) and the rest still run.  Returns the
    failures, in order, each as ``(its index in calls, first exception, the
    retry's or None)``.

    Example:
        >>> out = []
        >>> complete_each([(out.append, 1), (out.append, 2)])
        []
        >>> out
        [1, 2]
    """
    failures: list[Failure] = []
    for i, (step, arg) in enumerate(calls):
        try:
            step(arg)
        except BaseException as first:
            failures.append((i, first, retry(step, arg)))
    return failures


def guarded(undo: Callable[[], object], do: Callable[..., R], *args: Any, after: bool = False) -> R:
    """``do(*args)``; if it raises, :func:`complete` ``undo`` and raise.  With
    ``after``, ``undo`` is completed when ``do`` returns too.

    ``undo`` runs inside the ``try`` on both outcomes, not in a ``finally``:
    an interrupt between ``do``'s return and a ``finally``'s first line would
    skip it, while here every line after the ``try:`` is under its handler
    (and an interrupt at the ``try:`` line itself comes before ``do``).
    ``undo`` must be idempotent (after an interrupt it runs again) and
    must undo whatever part of ``do`` ran, none included.

    Example:
        >>> log = []
        >>> guarded(lambda: log.append("undo"), log.append, "do", after=True)
        >>> log
        ['do', 'undo']
    """
    try:
        if not after:
            # No line after ``do`` returns: an entry that has completed is
            # never undone by an interrupt that lands on its way out.
            return do(*args)
        result = do(*args)
        undo()  # if anything stops it, the handler completes it
        return result
    except BaseException:
        complete(undo)
        raise
