"""The process-wide lock that serializes deterministic blocks across threads.

RNG state is process-global, so two threads inside blocks at once would draw
from each other's streams.  Blocks (and each step of a decorated generator or
coroutine) hold this lock.  It is re-entrant for the owning thread, so blocks
nest.

Waiting policy: a thread waits as long as it takes — giving up would break
the isolation the caller asked for — but after ``warn_after`` seconds it emits
one :class:`LockWaitWarning` naming the thread that holds the lock and for how
long it has held it, which is what one needs to debug a stall or a deadlock
(a block that joins a thread which itself waits to enter a block).

Interrupts: the C ``RLock`` is the only record of how many levels a thread
holds (:meth:`ProcessLock.depth` reads its count).  Acquiring or releasing is
one C call, so an exception raised by a signal handler (``KeyboardInterrupt``)
can arrive before or after it, never half-way, and a caller that is
interrupted finds out what happened by reading the count: nothing is kept in
Python variables that an interrupt could leave out of step.  ``owner`` and
``since`` only describe the holder in warnings and reports.

Fork: in the child only the forking thread survives.  If it held the lock, it
still holds it at the same depth; otherwise the lock is made free.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ._errors import LockWaitWarning

__all__ = ["LOCK", "set_lock_warning"]

DEFAULT_WARN_AFTER = 10.0
_get_ident = threading.get_ident
_monotonic = time.monotonic


class ProcessLock:
    __slots__ = ("_rlock", "count", "owner", "since", "warn_after")

    def __init__(self) -> None:
        self._rlock: Any = _new_rlock()
        #: ``count()``: how many levels the *calling* thread holds (0: none);
        #: a C method on CPython 3.11+, read without a Python frame.
        self.count: Callable[[], int] = _counter(self._rlock)
        self.owner: int | None = None
        self.since = 0.0
        self.warn_after: float | None = DEFAULT_WARN_AFTER

    @property
    def depth(self) -> int:
        """How many levels the *calling* thread holds (0: none)."""
        return self.count()

    @property
    def owner_name(self) -> str:
        """The name of the thread holding the lock, for messages ("" if none)."""
        owner = self.owner
        if owner is None:
            return ""
        # Looked up only when a message needs it: a block does not pay for
        # ``current_thread().name`` (a Python call) on every entry.
        for thread in threading.enumerate():
            if thread.ident == owner:
                return thread.name
        return f"<thread {owner}>"

    def acquire(self) -> None:
        rlock = self._rlock
        # The fast path: the lock is free, or this thread holds it (nested blocks).
        if not rlock.acquire(False):
            wait = self.warn_after
            if wait is None:
                rlock.acquire()
            elif not rlock.acquire(True, wait):
                held = time.monotonic() - self.since
                warnings.warn(
                    f"thread {threading.current_thread().name!r} has waited {wait:g} s to "
                    f"enter a deterministic block held by thread {self.owner_name!r} for "
                    f"{held:.1f} s; RNG state is process-global, so blocks in different "
                    "threads run one at a time",
                    LockWaitWarning,
                    stacklevel=4,
                )
                rlock.acquire()
        if self.count() == 1:
            self.owner = _get_ident()
            self.since = _monotonic()

    def release_to(self, depth: int) -> None:
        """Release the calling thread's levels above ``depth``.

        Idempotent, so a caller interrupted half-way through a release can
        simply call it again.
        """
        count, release = self.count, self._rlock.release
        while count() > depth:
            if count() == 1:
                self.owner = None
            release()

    def held_by_other_thread(self) -> bool:
        if self.count():
            return False
        if self._rlock.acquire(False):
            self._rlock.release()
            return False
        return True

    def reset_after_fork(self) -> None:
        """In a forked child: free the lock unless the forking thread holds it."""
        if not self.count():
            self._rlock._at_fork_reinit()
            self.owner = None


def _counter(rlock: Any) -> Callable[[], int]:
    """``rlock``'s recursion count for the calling thread (0 if it does not own it)."""
    count: Callable[[], int] | None = getattr(rlock, "_recursion_count", None)
    if count is None:  # only CPython 3.11+ exposes it; see _CountingRLock
        count = rlock.count
    return count


class _CountingRLock:
    """An ``RLock`` that counts its owner's levels in Python, for interpreters
    without ``RLock._recursion_count`` (CPython 3.10).  An interrupt that lands
    between the C call and the count update is not recovered there."""

    __slots__ = ("_depth", "_rlock")

    def __init__(self) -> None:
        self._rlock = threading.RLock()
        self._depth = 0

    def count(self) -> int:
        return self._depth if self._rlock._is_owned() else 0  # type: ignore[attr-defined]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._rlock.acquire(blocking, timeout)
        if got:
            self._depth += 1
        return got

    def release(self) -> None:
        self._depth -= 1
        self._rlock.release()

    def _at_fork_reinit(self) -> None:
        self._rlock._at_fork_reinit()  # type: ignore[attr-defined]
        self._depth = 0


def _new_rlock() -> Any:
    rlock = threading.RLock()
    return rlock if hasattr(rlock, "_recursion_count") else _CountingRLock()


LOCK = ProcessLock()


def set_lock_warning(seconds: float | None) -> None:
    """Warn after a thread has waited ``seconds`` to enter a block (``None``: never).

    The default is 10 seconds.  The thread keeps waiting after the warning.

    Example:
        >>> from deterministic_ctx import set_lock_warning
        >>> set_lock_warning(30.0)
        >>> set_lock_warning(10.0)
    """
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
    ):
        raise ValueError(f"seconds must be a positive number or None, got {seconds!r}")
    LOCK.warn_after = None if seconds is None else float(seconds)
