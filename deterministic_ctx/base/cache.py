"""One bounded cache, for everything the package remembers to go faster.

A block with a new seed every time (``with deterministic(seed=idx):`` per
sample) must not grow the process: every cache is bounded, the oldest entry
first out.  Safe without a lock: each operation is one or two dict calls
under the GIL, and a race at worst evicts an entry early or keeps one extra.
A cache is a fast path: with ``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` it
remembers nothing (:mod:`.fast_paths`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from .fast_paths import ENABLED

__all__ = ["BoundedCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """Key -> value for at most ``size`` keys, oldest first out; with
    ``enabled`` false (the default under the switch) it stays empty.

    Example:
        >>> cache: BoundedCache[int, str] = BoundedCache(2, enabled=True)
        >>> for n in range(3):
        ...     cache.put(n, str(n))
        >>> cache.get(0), cache.get(2), len(cache)
        (None, '2', 2)
        >>> off: BoundedCache[int, str] = BoundedCache(2, enabled=False)
        >>> off.put(1, "one")
        >>> off.get(1) is None
        True
    """

    __slots__ = ("_enabled", "_items", "_size", "get")

    def __init__(self, size: int, *, enabled: bool = ENABLED) -> None:
        self._items: dict[K, V] = {}
        self._size = size
        self._enabled = enabled
        #: ``get(key)``: the value or ``None``; a bound C method, so that a hit
        #: costs no Python frame.
        self.get = self._items.get

    def put(self, key: K, value: V) -> None:
        """Remember ``value`` for ``key`` (the oldest key goes when full)."""
        if self._enabled:
            items = self._items
            if len(items) >= self._size and key not in items:  # one in, one out
                # Not contextlib.suppress: a block with a new seed evicts every time.
                try:  # noqa: SIM105
                    del items[next(iter(items))]
                except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                    pass
            items[key] = value

    def __len__(self) -> int:
        return len(self._items)
