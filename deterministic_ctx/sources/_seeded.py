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
operation is a single dict or set call under the GIL, and a race at worst
evicts an entry early or keeps one extra.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ._memory import ENABLED

__all__ = ["SeededCache"]

T = TypeVar("T")


class SeededCache(Generic[T]):
    """Seed -> what seeding produced, for at most ``size`` seeds.

    ``enabled`` defaults to :data:`._memory.ENABLED`: with the fast paths
    off, nothing is remembered (:meth:`wants` is always false).

    Example:
        >>> cache: SeededCache[bytes] = SeededCache(size=2, enabled=True)
        >>> cache.lookup(7) is None
        True
        >>> cache.wants(7)
        True
        >>> cache.put(7, b"state")
        >>> cache.lookup(7)
        b'state'
    """

    __slots__ = ("_eager", "_enabled", "_entries", "_seen", "_size", "lookup")

    def __init__(self, size: int = 64, *, eager: bool = True, enabled: bool = ENABLED) -> None:
        self._enabled = enabled
        self._entries: dict[int, T] = {}
        self._seen: dict[int, None] = {}  # misses not stored yet (eager=False), oldest first
        self._size = size
        self._eager = eager
        #: ``lookup(seed)``: the remembered value or ``None``; a bound C method,
        #: so a hit costs no Python frame.  Disabled, nothing is ever
        #: remembered: the dict stays empty.
        self.lookup = self._entries.get

    def wants(self, seed: int) -> bool:
        """Whether a miss for ``seed`` should be :meth:`put`: always when eager,
        else only the second time the seed misses; never with the fast paths off."""
        if not self._enabled:
            return False
        if self._eager:
            return True
        seen = self._seen
        if seed in seen:
            return True
        _bounded(seen, self._size)
        seen[seed] = None
        return False

    def put(self, seed: int, value: T) -> None:
        """Remember ``value`` for ``seed``, evicting the oldest seed when full
        (nothing with the fast paths off)."""
        if not self._enabled:
            return
        entries = self._entries
        _bounded(entries, self._size)
        entries[seed] = value
        self._seen.pop(seed, None)


def _bounded(d: dict[int, Any], size: int) -> None:
    """Make room for one more key in ``d`` (oldest first out)."""
    while len(d) >= size:
        try:
            del d[next(iter(d))]
        except (KeyError, RuntimeError, StopIteration):  # another thread got there first
            return
