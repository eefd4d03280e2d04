"""What seeding produces, remembered per seed: the caches behind fast seeding.

Seeding a Mersenne Twister runs its 624-word initialization (1-4 µs); writing
a remembered result is a 2.5 KB copy (~0.1 µs).  A loop of blocks with one
seed hits the cache every time.  A block with a *new* seed each time (the
per-sample pattern: ``with deterministic(seed=idx):`` in ``__getitem__``)
never does, so a miss must cost no more than seeding itself: the caller seeds
the live generator directly and offers the result, and remembering it is a
dict insert.  Where taking the result costs an allocation (torch's state
tensor), it is taken only for a seed seen before (``eager=False``).

The cache is bounded (oldest first out) and safe without a lock: every
operation is one or two dict calls under the GIL, and a race at worst
evicts an entry early or keeps one extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ._memory import ENABLED

__all__ = ["SeededCache"]

T = TypeVar("T")


class SeededCache(Generic[T]):
    """Seed -> what seeding produced, for at most ``size`` seeds.

    ``enabled`` defaults to :data:`._memory.ENABLED`: with the fast paths
    off, nothing is remembered.

    Example:
        >>> cache: SeededCache[bytes] = SeededCache(size=2, enabled=True)
        >>> cache.lookup(7) is None
        True
        >>> cache.offer(7, lambda: b"state")
        >>> cache.lookup(7)
        b'state'
    """

    __slots__ = ("_eager", "_enabled", "_entries", "_size", "lookup")

    def __init__(self, size: int = 64, *, eager: bool = True, enabled: bool = ENABLED) -> None:
        self._enabled = enabled
        #: Seed -> value, oldest first; ``None`` for a seed that missed once and
        #: was not taken yet (``eager=False``).
        self._entries: dict[int, T | None] = {}
        self._size = size
        self._eager = eager
        #: ``lookup(seed)``: the remembered value or ``None``; a bound C method,
        #: so a hit costs no Python frame.  Disabled, nothing is ever
        #: remembered: the dict stays empty.
        self.lookup = self._entries.get

    def offer(self, seed: int, take: Callable[[], T]) -> None:
        """After a miss for ``seed``, remember ``take()``, what seeding left (the
        oldest seed goes when full): always when eager, else only the second
        time the seed misses, so that ``take`` runs for seeds seen before only;
        never with the fast paths off."""
        if not self._enabled:
            return
        entries = self._entries
        if seed in entries:  # missed once before (eager=False)
            entries[seed] = take()
            return
        while len(entries) >= self._size:  # make room for one more: oldest first out
            try:
                del entries[next(iter(entries))]
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                break
        entries[seed] = take() if self._eager else None
