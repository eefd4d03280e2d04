"""``seed_everything``: the classic global recipe, without a block."""

from __future__ import annotations

from . import sources as _sources
from ._lock import LOCK
from ._settings import Settings
from .snapshot import Snapshot

__all__ = ["seed_everything"]


def seed_everything(seed: int, *, warn_only: bool = False) -> int:
    """Seed every RNG and turn on deterministic algorithms for the whole process.

    For the top of a script, where nothing needs to be put back: it applies
    exactly what a ``deterministic(seed)`` block applies on entry, and never
    restores.  If applying fails half-way, the previous state is restored
    before the error propagates.  Returns the seed.

    Example:
        >>> import random
        >>> from deterministic_ctx import Snapshot, seed_everything
        >>> before = Snapshot.capture()
        >>> seed_everything(0)
        0
        >>> a = random.random()
        >>> random.seed(0)
        >>> random.random() == a
        True
        >>> before.restore()
    """
    settings = Settings.build(seed, warn_only)
    LOCK.acquire()
    try:
        before = Snapshot.capture()
        try:
            _sources.apply_all(settings)
        except BaseException:
            before.restore()
            raise
    finally:
        LOCK.release()
    return settings.seed
