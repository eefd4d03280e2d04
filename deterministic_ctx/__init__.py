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

from typing import Any

from ._errors import InvalidSnapshotError, LockWaitWarning, RestoreError
from ._lock import set_lock_warning
from ._seed import derive_seed
from .context import deterministic
from .data import chain_worker_init, seed_worker, seeded_generator
from .decorate import reproducible
from .distributed import broadcast_seed, rank_seed
from .locate import DivergenceReport, locate_divergence
from .report import DeterminismReport
from .report import report as determinism_report
from .seeding import seed_everything
from .snapshot import Snapshot
from .sources import register_rng, registered_rngs, unregister_rng
from .sources.environ import managed_env_vars, register_env_var
from .verify import NotReproducibleError, assert_reproducible

__all__ = [
    "DeterminismReport",
    "DivergenceReport",
    "InvalidSnapshotError",
    "LockWaitWarning",
    "NotReproducibleError",
    "RestoreError",
    "Snapshot",
    "assert_reproducible",
    "broadcast_seed",
    "chain_worker_init",
    "derive_seed",
    "determinism_report",
    "deterministic",
    "locate_divergence",
    "managed_env_vars",
    "rank_seed",
    "register_env_var",
    "register_rng",
    "registered_rngs",
    "reproducible",
    "seed_everything",
    "seed_worker",
    "seeded_generator",
    "set_lock_warning",
    "unregister_rng",
]

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext deterministic_ctx``: registers ``%%deterministic`` and
    ``%deterministic_report`` (see :mod:`deterministic_ctx.ipython`).

    IPython is imported only here, never at package import.
    """
    from .ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext deterministic_ctx``."""
    from .ipython import unload_ipython_extension as unload

    unload(ipython)
