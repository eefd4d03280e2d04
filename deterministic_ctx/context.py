"""``deterministic``: capture → apply → (body) → restore, serialized across threads.

A :class:`_Block` is one isolated RNG world.  Its three operations are the
whole engine; plain blocks, decorated functions, generators, coroutines and
async generators are all made of them:

* ``resume()``: take the lock, capture the caller's state, then either apply
  the block's settings (first time) or restore the block's own saved state;
* ``suspend()``: save the block's state, restore the caller's, drop the lock;
* ``finish()``: restore the caller's state, drop the lock.

This module knows nothing of torch: sources do the work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from . import sources as _sources
from ._lock import LOCK
from ._settings import Rank, Settings
from .snapshot import Snapshot

__all__ = ["deterministic"]

F = TypeVar("F", bound=Callable[..., Any])


class _Block:
    __slots__ = ("_inner", "_outer", "_settings")

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._outer: Snapshot | None = None
        self._inner: Snapshot | None = None

    def resume(self) -> None:
        global _outermost
        LOCK.acquire()
        try:
            outer = Snapshot.capture()
        except BaseException:
            LOCK.release()
            raise
        try:
            if self._inner is None:
                _sources.apply_all(self._settings)
            else:
                self._inner.restore()
        except BaseException:
            # Half-applied: roll back to the caller's state before raising.
            try:
                outer.restore()
            finally:
                LOCK.release()
            raise
        self._outer = outer
        if LOCK.depth == 1:
            _outermost = self

    def commit(self) -> None:
        """Keep the block's state as the process's own: the caller's snapshot
        is dropped, not restored (``seed_everything``)."""
        global _outermost
        self._outer = None
        if LOCK.depth == 1:
            _outermost = None
        LOCK.release()

    def suspend(self) -> None:
        try:
            self._inner = Snapshot.capture()
        finally:
            self.finish()

    def finish(self) -> None:
        global _outermost
        outer, self._outer = self._outer, None
        if outer is None:
            raise RuntimeError("deterministic block exited without being entered")
        try:
            outer.restore()
        finally:
            if LOCK.depth == 1:
                _outermost = None
            LOCK.release()


#: The block that took the lock first, so a forked child can leave another
#: thread's block (see ``_after_fork_in_child``).
_outermost: _Block | None = None


#: The state at the moment of a fork made from inside a block, for the child.
_at_fork: Snapshot | None = None


def _before_fork() -> None:
    global _at_fork
    # CPython reseeds ``random`` in every forked child.  Inside a block that
    # breaks reproducibility (NumPy and torch are inherited as they are), so
    # the child gets back exactly the state the forking thread had.
    if LOCK.depth and not LOCK.held_by_other_thread():
        _at_fork = Snapshot.capture()


def _after_fork_in_parent() -> None:
    global _at_fork
    _at_fork = None


def _after_fork_in_child() -> None:
    global _outermost, _at_fork
    other = LOCK.held_by_other_thread()
    outer = _outermost._outer if _outermost is not None else None
    LOCK.reset_after_fork()
    target, _at_fork = _at_fork, None
    if other:
        # The fork happened while another thread was inside a block: that
        # thread does not exist in the child, so the child continues from the
        # state outside the block, which is the forking thread's view.
        _outermost = None
        target = outer
    if target is not None:
        try:
            target.restore()
        except Exception as exc:
            warnings.warn(
                f"deterministic_ctx: could not restore the random state in a forked child: {exc!r}",
                RuntimeWarning,
                stacklevel=1,
            )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


class deterministic:  # lowercase: it reads like a function, ``with deterministic(seed=0):``
    """Run a block reproducibly and isolated from the rest of the program.

    On entry every RNG (Python ``random``, NumPy's global RNG, torch CPU and
    accelerators, registered user RNGs) and every determinism flag is
    captured; then the RNGs are seeded exactly as ``random.seed(seed);
    np.random.seed(seed); torch.manual_seed(seed)`` would, and deterministic
    algorithms are turned on (``warn_only`` as given), cuDNN made
    deterministic, ``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED`` set.
    On exit, by any route, everything is restored bit for bit: the caller's
    streams continue as if the block never ran.

    The object can be reused for any number of blocks, nested or in a row;
    each starts from ``seed``.  Blocks in different threads run one at a
    time.  As a decorator it is exactly :func:`reproducible`.

    ``async with`` works too and restores on every exit, but cannot hide the
    block from other tasks that run while it awaits: to isolate interleaved
    tasks, decorate the coroutine function with :func:`reproducible` instead.

    Args:
        seed: an int in ``0 .. 2**32 - 1`` (NumPy integers accepted).
        warn_only: deterministic algorithms warn instead of raising when an
            operation has no deterministic implementation.
        rank: for multi-process training, the process's rank (a non-negative
            int), ``"auto"`` for its rank in the initialized
            ``torch.distributed`` process group (0 without one, looked up each
            time a block starts), or ``None``.  Python ``random``, NumPy and
            registered user RNGs then get a well-mixed per-rank seed, so
            augmentation differs across ranks; torch's generators keep
            ``seed`` on every rank, so model initialization is identical.
            Rank 0 draws exactly what ``rank=None`` draws.

    Example:
        >>> import torch
        >>> from deterministic_ctx import deterministic
        >>> with deterministic(seed=0):
        ...     a = torch.rand(2)
        >>> with deterministic(seed=0):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """

    __slots__ = ("_blocks", "_settings")

    def __init__(self, seed: int, *, warn_only: bool = False, rank: Rank = None) -> None:
        self._settings = Settings.build(seed, warn_only, rank)
        self._blocks: list[_Block] = []

    @property
    def seed(self) -> int:
        """The seed every block of this object starts from."""
        return self._settings.seed

    @property
    def warn_only(self) -> bool:
        """Whether deterministic algorithms only warn inside the block."""
        return self._settings.warn_only

    @property
    def rank(self) -> Rank:
        """The ``rank`` given: an int, ``"auto"`` or ``None``."""
        return self._settings.rank

    def __enter__(self) -> deterministic:
        block = _Block(self._settings)
        block.resume()
        self._blocks.append(block)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._blocks.pop().finish()

    async def __aenter__(self) -> deterministic:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        # The decorator layer sits above this one; imported here, not at module
        # level, so the arrows still point one way (decorate -> context).
        from .decorate import decorate

        return decorate(func, self._settings)

    def __repr__(self) -> str:
        rank = "" if self.rank is None else f", rank={self.rank!r}"
        return f"deterministic(seed={self.seed}, warn_only={self.warn_only}{rank})"
