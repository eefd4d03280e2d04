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

Fork: in the child only the forking thread survives.  If it held the lock, it
still holds it at the same depth; otherwise the lock is free.
"""

from __future__ import annotations

import threading
import time
import warnings

from ._errors import LockWaitWarning

__all__ = ["LOCK", "set_lock_warning"]

DEFAULT_WARN_AFTER = 10.0


class ProcessLock:
    __slots__ = ("_rlock", "depth", "owner", "owner_name", "since", "warn_after")

    def __init__(self) -> None:
        self._rlock = threading.RLock()
        self.depth = 0
        self.owner: int | None = None
        self.owner_name = ""
        self.since = 0.0
        self.warn_after: float | None = DEFAULT_WARN_AFTER

    def acquire(self) -> None:
        rlock = self._rlock
        wait = self.warn_after
        if wait is None:
            rlock.acquire()
        elif not rlock.acquire(True, wait):
            held = time.monotonic() - self.since
            warnings.warn(
                f"thread {threading.current_thread().name!r} has waited {wait:g} s to enter a "
                f"deterministic block held by thread {self.owner_name!r} for {held:.1f} s; "
                "RNG state is process-global, so blocks in different threads run one at a time",
                LockWaitWarning,
                stacklevel=4,
            )
            rlock.acquire()
        self.depth += 1
        if self.depth == 1:
            self.owner = threading.get_ident()
            self.owner_name = threading.current_thread().name
            self.since = time.monotonic()

    def release(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.owner = None
        self._rlock.release()

    def held_by_other_thread(self) -> bool:
        return self.owner is not None and self.owner != threading.get_ident()

    def reset_after_fork(self) -> None:
        mine = self.owner is not None and self.owner == threading.get_ident()
        self._rlock = threading.RLock()
        if mine:
            for _ in range(self.depth):
                self._rlock.acquire()
        else:
            self.depth, self.owner = 0, None


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

