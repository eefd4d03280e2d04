"""The process-wide lock: one thread inside blocks at a time, and taking over a dead holder's.

RNG state is process-global, so two threads inside blocks at once would draw
from each other's streams.  Blocks (and each step of a decorated generator or
coroutine) run holding :data:`LOCK`.  A thread holds the C ``RLock`` *once*,
while it has blocks open (and while it enters its first one or leaves its
last one); which blocks are open, and how deeply they nest, is the scope
stack's record (:mod:`deterministic_ctx.base.scopes`), not a count in the
lock, and the lock asks it before giving itself back.  Each thread has a
liveness token (its record, a ``threading.local``, freed when the thread
ends); the holder's token reference and ``since`` describe the holder in
warnings.

Waiting: a thread waits as long as the holder lives, and warns once after
``warn_after`` seconds (:class:`LockWaitWarning`; see
``docs/explanation/concurrency.md``).

Dead owners: a thread that ends inside a block (``__enter__`` without
``__exit__``) can never release the lock, and a C ``RLock`` cannot be
released by another thread.  Waiters therefore wake every :data:`POLL`
seconds and check that the owner's token still lives: a weak reference to
it dies with the thread's local storage.  When it has died, one waiter
*takes over*: under a small mutex it installs a fresh ``RLock`` that it
already holds, then calls :attr:`ProcessLock.on_dead_owner` (the engine
puts back the state from before the dead thread's blocks).  Threads waiting
on the old lock see it replaced at their next wake-up.  Thread idents are
not used for identity: they are reused, and the ``RLock`` takes a new thread
with a dead owner's ident for its owner, so "mine" is the ``RLock``'s C
ownership *and* the calling thread's token.

Interrupts: acquiring and releasing are single C calls, and the ``RLock``'s
own ownership (``_is_owned``) is the truth of whether this thread holds it;
the scope stack changes by single list operations.  An exception raised by a
signal handler (``KeyboardInterrupt``) lands before or after each, never
half-way, so :meth:`ProcessLock.release` (give the lock back if this thread
holds it with no block open) can simply be called again by a caller that was
interrupted.

Fork: in the child only the forking thread survives.  If it held the lock, it
still holds it; otherwise the lock is made free.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .completion import guarded
from .errors import LockWaitWarning
from .scopes import SCOPES

__all__ = ["LOCK", "POLL", "set_lock_warning"]

DEFAULT_WARN_AFTER = 10.0
#: How often (seconds) a waiting thread checks that the lock's owner still
#: lives: a thread that ended inside a block is noticed within about this long.
POLL = 0.25
_monotonic = time.monotonic
_new_rlock = threading.RLock


class _Alive:
    """A thread's token: the only strong reference is the thread's local storage."""

    __slots__ = ("__weakref__",)


class _OwnerRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a thread's token that remembers the thread, for messages."""

    __slots__ = ("thread",)
    thread: threading.Thread


class _PerThread(threading.local):
    """Each thread's record, made at its first use: its token and the weak
    reference to it (its identity, which unlike its ident no later thread
    ever shares)."""

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
        "on_dead_owner",
        "since",
        "threads",
        "warn_after",
    )

    def __init__(self) -> None:
        self._rlock: Any = _new_rlock()
        self.since = 0.0
        self.warn_after: float | None = DEFAULT_WARN_AFTER
        self.threads = _PerThread()
        #: The holder's token reference (``None`` while the lock is free, or
        #: for an instant after the C acquire: see :meth:`mine`).
        self._owner_ref: _OwnerRef | None = None
        #: Serializes take-overs of a dead owner's lock.
        self._swap = threading.Lock()
        #: Called by the thread that took over a dead owner's lock, holding it,
        #: with the dead thread; set by the engine.
        self.on_dead_owner: Callable[[threading.Thread], None] | None = None

    @property
    def depth(self) -> int:
        """How many blocks the *calling* thread has open (0: none; 1 while it
        holds the lock entering its first block or leaving its last)."""
        return (len(SCOPES.active) or 1) if self.mine() else 0

    def mine(self) -> bool:
        """Whether the calling thread holds the lock (not a dead thread with its ident).

        The C ownership decides; a token other than the caller's means a dead
        owner with the same ident, and no token yet means the caller was
        interrupted between the C acquire and recording itself.
        """
        if not self._rlock._is_owned():
            return False
        ref = self._owner_ref
        return ref is None or ref is self.threads.ref

    def acquire(self) -> None:
        """Take the lock for the calling thread (nothing if it holds it already)."""
        rlock = self._rlock
        if rlock._is_owned():
            ref = self._owner_ref
            if ref is None or ref is self.threads.ref:  # nested (see mine)
                return
        elif rlock.acquire(False):
            self._own()
            return
        self._wait(rlock)

    def _own(self) -> None:
        """Record the calling thread, which has just taken the lock, as the owner."""
        self._owner_ref = self.threads.ref
        self.since = _monotonic()

    def _wait(self, rlock: Any) -> None:
        started = _monotonic()
        warned = self.warn_after is None
        while True:
            timeout = POLL
            if not warned:
                assert self.warn_after is not None
                timeout = max(0.0, min(POLL, started + self.warn_after - _monotonic()))
            if rlock._is_owned():  # by ident only: its owner, a dead thread, had this ident
                time.sleep(timeout)
            elif rlock.acquire(True, timeout):
                self._own()
                return
            if self._rlock is not rlock:  # another thread took over a dead owner's lock
                rlock = self._rlock
                continue
            ref = self._owner_ref
            if ref is not None and ref() is None and self._take_over(rlock, ref):
                return
            if not warned and _monotonic() - started >= (self.warn_after or 0.0):
                warned = True
                held = _monotonic() - self.since
                holder = "" if ref is None else ref.thread.name
                warnings.warn(
                    f"thread {threading.current_thread().name!r} has waited "
                    f"{self.warn_after:g} s to enter a deterministic block held by thread "
                    f"{holder!r} for {held:.1f} s; RNG state is process-global, "
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
            self._rlock = fresh
            self._own()
        # Outside the mutex: the engine's clean-up restores state, and other
        # waiters now wait on ``fresh``, which this thread holds.
        callback = self.on_dead_owner
        if callback is not None:
            guarded(self._give_back, callback, ref.thread)
        return True

    def _give_back(self) -> None:
        """The dead thread's clean-up failed: forget its blocks (nobody can
        leave them) and give the lock back."""
        SCOPES.drop()
        self.release()

    def release(self) -> None:
        """Give the lock back if the calling thread holds it with no block open.

        Idempotent, so a caller interrupted half-way through can simply call
        it again.
        """
        if not SCOPES.active and self.mine():
            # Before the release: a waiter that still sees this thread's token
            # after it has ended knows the lock was never given back.
            self._owner_ref = None
            self._rlock.release()

    def reset_after_fork(self) -> None:
        """In a forked child: free the lock unless the forking thread holds it
        (the engine has dropped the open blocks of the thread that held it)."""
        self._swap = threading.Lock()  # another thread may have held it at the fork
        if not self.mine():
            self._rlock._at_fork_reinit()
            self._owner_ref = None


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
