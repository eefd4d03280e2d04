"""Third-party calls that hold a lock while they allocate, made so that no
garbage collection starts inside them.

The garbage collector runs finalizers at any allocation of a tracked object,
and a suspended ``@reproducible`` generator that it collects closes in its
own block: it captures every RNG's state, taking each RNG's lock.  Where a
library holds such a lock while it allocates, and the lock is not reentrant,
that finalizer waits for it for ever.  Two do, each on some versions:

* NumPy 1.x seeds a ``RandomState`` under its bit generator's lock, a plain
  ``Lock`` there (an ``RLock`` from NumPy 2: a finalizer inside then proceeds);
* ``torch.Generator.get_state`` makes the state's tensor object holding the
  generator's mutex on torch 2.1 (not from 2.11 on).

Around those calls collections are held off
(:func:`~deterministic_ctx.base.collector.without_collections`); elsewhere
the call is the plain one.  The library's own locked copies allocate
nothing (see :mod:`.kinds`).

Example:
    >>> import torch
    >>> from deterministic_ctx.sources.rngs import uncollected
    >>> gen = torch.Generator().manual_seed(0)
    >>> torch.equal(uncollected.get_state(gen), gen.get_state())
    True
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...base.collector import without_collections

__all__ = ["GET_STATE_COLLECTS", "NUMPY_LOCK_REENTRANT", "get_state", "seed_random_state"]


#: Whether NumPy's bit generators hold an ``RLock`` (NumPy 2) rather than a ``Lock``.
NUMPY_LOCK_REENTRANT: bool = isinstance(np.random.MT19937(0).lock, type(threading.RLock()))

#: Whether a collection that starts inside ``torch.Generator.get_state`` finds
#: the generator's mutex held.  Seen on torch 2.1.2 (a finalizer reading the
#: generator there waits for ever), not on 2.11, 2.13 or 2.15 (it reads it and
#: returns), with the collector run at every allocation (the suite's
#: ``test_a_generator_collected_at_any_allocation_...``).  A collection can
#: start inside the call on every version, and whether the mutex is held then
#: cannot be asked without waiting on it: the versions in between are taken
#: for 2.1's, which costs them ~0.3 µs per call.
GET_STATE_COLLECTS: bool = torch.__version__ < "2.11"

_get_state: Callable[[Any], torch.Tensor] = operator.methodcaller("get_state")


def get_state(gen: Any) -> torch.Tensor:
    """``gen.get_state()``, for a ``torch.Generator`` of any device (or a
    stand-in with that method); collections held off where
    :data:`GET_STATE_COLLECTS`."""
    if GET_STATE_COLLECTS:
        return without_collections(_get_state, gen)
    state: torch.Tensor = gen.get_state()
    return state


def seed_random_state(rs: Any, seed: int) -> None:
    """``rs.seed(seed)`` for a NumPy ``RandomState``; collections held off
    unless :data:`NUMPY_LOCK_REENTRANT`."""
    if NUMPY_LOCK_REENTRANT:
        rs.seed(seed)
    else:
        without_collections(rs.seed, seed)
