"""What seeding produces, remembered per seed: the caches behind fast seeding.

Seeding a Mersenne Twister runs its 624-word initialization (1-4 µs); writing
a remembered result is a 2.5 KB copy (~0.1 µs).  A loop of blocks with one
seed hits the cache every time.  A block with a *new* seed each time (the
per-sample pattern: ``with deterministic(seed=idx):`` in ``__getitem__``)
never does, so a miss must cost no more than seeding itself: the caller seeds
the live generator directly and offers the result, and remembering it is a
dict insert.  Where taking the result costs an allocation (torch's state
tensor), it is taken only for a seed seen before (``eager=False``).

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
    """Seed -> what seeding produced, for at most ``size`` seeds; ``lookup``
    is ``get`` (``None``: seed, then :meth:`offer`).

    Example:
        >>> cache: SeededCache[bytes] = SeededCache(size=2, enabled=True)
        >>> cache.lookup(7) is None
        True
        >>> cache.offer(7, lambda: b"state")
        >>> cache.lookup(7)
        b'state'
    """

    __slots__ = ("_eager", "lookup")

    def __init__(self, size: int = 64, *, eager: bool = True, enabled: bool = ENABLED) -> None:
        super().__init__(size, enabled=enabled)
        self._eager = eager
        self.lookup = self.get

    def offer(self, seed: int, take: Callable[[], T]) -> None:
        """After a miss for ``seed``, remember ``take()``, what seeding left:
        always when eager, else only the second time the seed misses (a
        ``None`` marks the first), so that ``take`` runs for seeds seen
        before only; never with the fast paths off."""
        if self._enabled:
            self.put(seed, take() if self._eager or seed in self._items else None)
