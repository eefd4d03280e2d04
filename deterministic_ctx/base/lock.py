"""The process-wide lock that serializes deterministic blocks across threads.

RNG state is process-global, so two threads inside blocks at once would draw
from each other's streams.  Blocks (and each step of a decorated generator or
coroutine) hold this lock.  It is re-entrant for the owning thread, so blocks
nest.

Waiting policy: a thread waits as long as the holder lives — giving up would
break the isolation the caller asked for — but after ``warn_after`` seconds it
emits one :class:`LockWaitWarning` naming the thread that holds the lock and
for how long it has held it, which is what one needs to debug a stall or a
deadlock (a block that joins a thread which itself waits to enter a block).

Dead owners: a thread that ends inside a block (``__enter__`` without
``__exit__``) can never release a lock, and a C ``RLock`` cannot be released
by another thread.  Waiters therefore wake every :data:`POLL` seconds and
check that the owner still lives; when it has ended, one of them *takes
over*: under a small mutex it installs a fresh ``RLock`` that it already
holds, then calls :attr:`ProcessLock.on_dead_owner` (the engine puts back
the state from before the dead thread's blocks).  Threads waiting on the old
lock see it replaced at their next wake-up and wait on the new one.  Whether
a thread lives is told by a per-thread token in a ``threading.local``: its
storage is freed when the thread ends, whatever started the thread, so a weak
reference to the token dies with it.  Thread idents are not used for this:
they are reused, and a new thread with a dead owner's ident would be taken
by the ``RLock`` for its owner (checked on every re-entry).

Interrupts: the C ``RLock`` is the only record of how many levels a thread
holds (:meth:`ProcessLock.depth` reads its count).  Acquiring or releasing is
one C call, so an exception raised by a signal handler (``KeyboardInterrupt``)
can arrive before or after it, never half-way, and a caller that is
interrupted finds out what happened by reading the count: nothing is kept in
Python variables that an interrupt could leave out of step.  ``owner``,
``since`` and the owner's token only describe the holder (in warnings,
reports and the dead-owner check).

Fork: in the child only the forking thread survives.  If it held the lock, it
still holds it at the same depth; otherwise the lock is made free.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .errors import LockWaitWarning

__all__ = ["LOCK", "POLL", "set_lock_warning"]

DEFAULT_WARN_AFTER = 10.0
#: How often (seconds) a waiting thread checks that the lock's owner still
#: lives: a thread that ended inside a block is noticed within about this long.
POLL = 0.25
_get_ident = threading.get_ident
_monotonic = time.monotonic


class _Alive:
    """A thread's token: the only strong reference is the thread's local storage."""

    __slots__ = ("__weakref__",)


class _OwnerRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a thread's token that remembers the thread, for messages."""

    __slots__ = ("thread",)
    thread: threading.Thread


class _PerThread(threading.local):
    """Each thread's token and the weak reference to it, made at its first use."""

    token: _Alive
    ref: _OwnerRef

    def __init__(self) -> None:
        self.token = token = _Alive()
        ref = _OwnerRef(token)
        # The Thread object outlives its thread, so a dead owner is named too.
        ref.thread = threading.current_thread()
        self.ref = ref


class ProcessLock:
    __slots__ = (
        "_owner_ref",
        "_rlock",
        "_swap",
        "count",
        "on_dead_owner",
        "owner",
        "since",
        "threads",
        "warn_after",
    )

    def __init__(self) -> None:
        self._rlock: Any = _new_rlock()
        #: ``count()``: how many levels the *calling* thread holds (0: none);
        #: a C method on CPython 3.11+, read without a Python frame.
        self.count: Callable[[], int] = _counter(self._rlock)
        self.owner: int | None = None
        self.since = 0.0
        self.warn_after: float | None = DEFAULT_WARN_AFTER
        #: Each thread's token (``threads.token``) and the weak reference to it
        #: (``threads.ref``): the ref is the calling thread's identity, which,
        #: unlike its ident, no later thread ever shares.
        self.threads = _PerThread()
        #: The holder's token reference (``None`` while the lock is free).
        self._owner_ref: _OwnerRef | None = None
        #: Serializes take-overs of a dead owner's lock.
        self._swap = threading.Lock()
        #: Called by the thread that took over a dead owner's lock, holding it
        #: at depth 1, with the dead thread; set by the engine.
        self.on_dead_owner: Callable[[threading.Thread], None] | None = None

    @property
    def depth(self) -> int:
        """How many levels the *calling* thread holds (0: none)."""
        return self.count()

    @property
    def owner_name(self) -> str:
        """The name of the thread holding the lock, for messages ("" if none)."""
        ref = self._owner_ref
        if ref is not None:
            return ref.thread.name
        return "" if self.owner is None else f"<thread {self.owner}>"

    def mine(self) -> bool:
        """Whether the calling thread holds the lock (not a dead thread with its ident)."""
        return self.count() > 0 and self._owner_ref is self.threads.ref

    def acquire(self) -> None:
        rlock = self._rlock
        # The fast path: the lock is free, or this thread holds it (nested blocks).
        if rlock.acquire(False):
            if self.count() == 1:
                self._own()
                return
            if self._owner_ref is self.threads.ref:
                return
            # The RLock knows its owner by ident only, and idents are reused: a
            # thread that ended inside a block had this thread's ident.
            rlock.release()
        self._wait(rlock)

    def _own(self) -> None:
        """Record the calling thread, which has just taken the first level, as the owner."""
        self._owner_ref = self.threads.ref
        self.owner = _get_ident()
        self.since = _monotonic()

    def _wait(self, rlock: Any) -> None:
        started = _monotonic()
        warned = self.warn_after is None
        while True:
            timeout = POLL
            if not warned:
                assert self.warn_after is not None
                timeout = max(0.0, min(POLL, started + self.warn_after - _monotonic()))
            if rlock.acquire(True, timeout):
                if self.count() == 1:
                    self._own()
                    return
                rlock.release()  # taken by ident only (see acquire): the owner is dead
            if self._rlock is not rlock:  # another thread took over a dead owner's lock
                rlock = self._rlock
                continue
            ref = self._owner_ref
            if ref is not None and ref() is None and self._take_over(rlock, ref):
                return
            if not warned and _monotonic() - started >= (self.warn_after or 0.0):
                warned = True
                held = _monotonic() - self.since
                warnings.warn(
                    f"thread {threading.current_thread().name!r} has waited "
                    f"{self.warn_after:g} s to enter a deterministic block held by thread "
                    f"{self.owner_name!r} for {held:.1f} s; RNG state is process-global, "
                    "so blocks in different threads run one at a time",
                    LockWaitWarning,
                    stacklevel=5,
                )

    def _take_over(self, rlock: Any, ref: _OwnerRef) -> bool:
        """Replace the lock of the dead thread behind ``ref``; ``False`` if
        another thread did (or the owner changed) first."""
        with self._swap:
            if self._rlock is not rlock or self._owner_ref is not ref or ref() is not None:
                return False
            fresh = _new_rlock()
            fresh.acquire()
            self.count = _counter(fresh)
            self._rlock = fresh
            self._own()
        # Outside the mutex: the engine's clean-up restores state, and other
        # waiters now wait on ``fresh``, which this thread holds.
        callback = self.on_dead_owner
        if callback is not None:
            try:
                callback(ref.thread)
            except BaseException:
                self.release_to(0)
                raise
        return True

    def release_to(self, depth: int) -> None:
        """Release the calling thread's levels above ``depth``.

        Idempotent, so a caller interrupted half-way through a release can
        simply call it again.
        """
        count, release = self.count, self._rlock.release
        while count() > depth:
            if count() == 1:
                # Before the last release: a waiter that still sees this
                # thread's token after it has ended knows the lock was never
                # given back.
                self._owner_ref = None
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
        self._swap = threading.Lock()  # another thread may have held it at the fork
        if not self.count():
            self._rlock._at_fork_reinit()
            self._owner_ref = None
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
