"""deterministic-ctx: reproducible, isolated randomness for PyTorch.

``with deterministic(seed=0):`` seeds every RNG and turns on deterministic
algorithms for a block, then restores everything bit for bit on exit.

Example:
    >>> import random
    >>> from deterministic_ctx import deterministic
    >>> before = random.getstate()
    >>> with deterministic(seed=0):
    ...     _ = random.random()
    >>> random.getstate() == before
    True
"""

from __future__ import annotations

from ._errors import InvalidSnapshotError, LockWaitWarning, RestoreError
from ._lock import set_lock_warning
from ._seed import derive_seed
from .context import deterministic
from .decorate import reproducible
from .seeding import seed_everything
from .snapshot import Snapshot
from .sources import register_rng, registered_rngs, unregister_rng

__all__ = [
    "InvalidSnapshotError",
    "LockWaitWarning",
    "RestoreError",
    "Snapshot",
    "derive_seed",
    "deterministic",
    "register_rng",
    "registered_rngs",
    "reproducible",
    "seed_everything",
    "set_lock_warning",
    "unregister_rng",
]

__version__ = "0.1.0"
