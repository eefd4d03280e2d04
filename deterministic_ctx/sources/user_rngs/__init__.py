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
on torch 2.13, most Python classes) are held by weak reference.  NumPy
generators and bit generators cannot be (their C types lack ``__weakref__``),
nor can torch 2.11's ``torch.Generator`` (seen on a GPU machine), so they are
held until :func:`unregister_rng`.

The registry stays as small as the set of live RNGs, however many were
registered and collected: each weak reference's callback removes its entry
the moment the object dies, and the duplicate check in ``register_rng`` and
``unregister_rng`` is a dict lookup by ``id``, not a scan.  A callback can run
at any moment a reference count drops to zero or a collection runs: in the
middle of a block's capture loop, while this thread holds the registry's
``_lock``, or in another thread.  So callbacks take no lock and do nothing
but single dict operations (atomic under the GIL), and every loop runs over
an immutable tuple of the entries, rebuilt only when the registry has
changed since.

**Cost per registered RNG** is flat in their number: each entry chose at
registration how it is captured, seeded and restored (:mod:`.entries`).

**Layout.**  This package's ``__init__`` is its face to users
(:func:`register_rng` and the rest); the global ``random`` and NumPy sources
also build on :mod:`.entries`, :mod:`.kinds` and :mod:`.persistence`
directly.  Each module has one job, and each imports only those listed
before it:

* :mod:`.persistence`: states as checkpoint data and back, checked (the
  global ``random``'s and NumPy's codecs too);
* :mod:`.kinds`: the kinds of RNG accepted, which one an object is, and
  each kind's public API and codec;
* :mod:`.entries`: one RNG, captured, seeded and restored (also the global
  ``random`` and NumPy's global ``RandomState``, whose sources use one);
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
