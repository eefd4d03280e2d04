"""User-owned RNG objects registered with :func:`register_rng`.

Each registered object is captured, seeded and restored with every block.
Its seed inside a block is ``derive_seed(block_seed, "user", key)``: stable
across runs as long as the key is, and unrelated to the seed of any other
object.  Under ``rank=`` the block's per-rank seed takes the place of
``block_seed`` (user RNGs are data-side, like ``random`` and NumPy), except
for RNGs registered with ``shared=True``: they keep the block's shared seed,
like torch's generators, for state that must agree across ranks (parallel RNG
streams, :mod:`deterministic_ctx.parallel.streams`).  The key is the one given to
``register_rng`` or, by default, the registration ordinal (``"0"``, ``"1"``,
…).

Accepted: ``random.Random``, ``numpy.random.Generator``,
``numpy.random.RandomState``, ``torch.Generator``, and any object with
``seed()``, ``getstate()`` and ``setstate()`` methods (Hypothesis's
``register_random`` protocol), seeded with a 32-bit
``derive_seed(block_seed, "user", key)``.  A snapshot saves such an object's
state when ``getstate()`` returns plain data: ints, floats, strings, bools,
``None``, and 1-D uint8 CPU tensors (generator states, as
``torch.Generator.get_state()`` returns them) in lists, tuples and dicts.

Installed packages contribute RNGs through the ``deterministic_ctx.rngs``
entry-point group (:data:`ENTRY_POINT_GROUP`): each entry point loads to a
zero-argument callable returning an RNG (key: the entry point's name), an
iterable of RNGs (``name.0``, ``name.1``, …), a mapping of names to RNGs
(``name.<name>``) or ``None``.  They are loaded once, at the first block or
the first call of :func:`registered_rngs` (whichever reads the registry
first), never at ``import deterministic_ctx``; an object registered already
keeps its first key (as for any second ``register_rng``).  A broken entry point is skipped with a
``StateWarning`` (a ``RuntimeWarning``) naming it and the error, registering none of its RNGs.

Objects that can be weakly referenced (``random.Random``, ``torch.Generator``
on torch 2.13, most Python classes) are held by weak reference and leave the
registry when collected (a :class:`weakref.finalize` removes the entry, so
the registry stays as small as the set of live RNGs).  NumPy generators and
bit generators cannot be (their C types lack ``__weakref__``), nor can torch
2.11's ``torch.Generator`` (seen on a GPU machine), so they are held until
:func:`unregister_rng`.

**Cost per registered RNG** is flat in their number: each entry chose at
registration how it is captured, seeded and restored, by its kind
(:mod:`..rngs.kinds`); 8 or more exact ``random.Random`` in a row run as one
batch (:class:`~..rngs.entries.MtBatch`).

**Layout.**  :func:`register_rng`, :func:`unregister_rng`,
:func:`registered_rngs`, :func:`seed_registered_rngs` and
:data:`ENTRY_POINT_GROUP` are this package's public face, re-exported by
``deterministic_ctx``; :class:`UserRngSource` is for the block engine.  The
kinds of RNG themselves are :mod:`..rngs`, below this package and shared
with the global ``random`` and NumPy sources:

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
