"""What seeding produces, remembered per seed: the caches behind fast seeding.

Seeding a Mersenne Twister runs its 624-word initialization (1-4 µs); writing
a remembered result is a 2.5 KB copy (~0.1 µs).  A loop of blocks with one
seed hits the cache every time.  A block with a *new* seed each time (the
per-sample pattern: ``with deterministic(seed=idx):`` in ``__getitem__``)
never does, and neither does a keyed item (a block reseeded with each item's
key), so a miss must cost no more than seeding itself: the caller seeds the
live generator directly and offers the result, which is taken only for a seed
that missed once before (the first miss leaves a mark, a dict insert).  Taking
it on every miss cost a keyed item about 2 µs a generator (a 2.5 KB copy and
the eviction of another copy), more than a seeding it would never save.

The cache is a :class:`~deterministic_ctx.base.cache.BoundedCache`: bounded,
safe without a lock, and empty with the fast paths off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..base.cache import BoundedCache
from ..base.fast_paths import ENABLED

__all__ = ["SeededCache"]

T = TypeVar("T")


class SeededCache(BoundedCache[int, T | None]):
    """Seed -> what seeding produced, for at most ``size`` seeds (``get``
    returns ``None``: seed, then :meth:`offer`).

    Example:
        >>> cache: SeededCache[bytes] = SeededCache(size=2, enabled=True)
        >>> cache.get(7) is None
        True
        >>> cache.offer(7, lambda: b"state")  # a first miss: marked, not taken
        >>> cache.get(7) is None
        True
        >>> cache.offer(7, lambda: b"state")  # seen before: taken
        >>> cache.get(7)
        b'state'
    """

    __slots__ = ()

    def __init__(self, size: int = 64, *, enabled: bool = ENABLED) -> None:
        super().__init__(size, enabled=enabled)

    def offer(self, seed: int, take: Callable[[], T]) -> None:
        """After a miss for ``seed``, remember ``take()``, what seeding left,
        the second time the seed misses (a ``None`` marks the first), so that
        ``take`` runs for seeds seen before only; never with the fast paths off."""
        if self._enabled:
            items = self._items
            if seed in items:
                items[seed] = take()  # already counted in the bound when first marked
            else:
                self.put(seed, None)
