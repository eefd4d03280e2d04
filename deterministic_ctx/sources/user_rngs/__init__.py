"""User-owned RNG objects registered with :func:`register_rng`.

Each registered object is captured, seeded (``derive_seed(block_seed,
"user", key)``; the block's per-rank seed under ``rank=``, its shared seed
for ``shared=True``) and restored with every block: what is accepted, how
each kind is seeded and saved, how objects are held and what installed
packages contribute through :data:`ENTRY_POINT_GROUP` is documented on
:func:`register_rng` and in ``docs/how-to/own-rngs.md``.  How each kind of
RNG is captured, seeded and restored is :mod:`..rngs`, below this package
and shared with the global ``random`` and NumPy sources.

* :mod:`.registry`: registration, the seeding loop, entry points;
* :mod:`.source`: :class:`UserRngSource`, the blocks' and snapshots' source.
"""

from __future__ import annotations

from .registry import (
    ENTRY_POINT_GROUP,
    register_rng,
    registered_rngs,
    seed_registered_rngs,
    unregister_rng,
)
from .source import UserRngSource

__all__ = [
    "ENTRY_POINT_GROUP",
    "UserRngSource",
    "register_rng",
    "registered_rngs",
    "seed_registered_rngs",
    "unregister_rng",
]
