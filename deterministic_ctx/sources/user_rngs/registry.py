"""The registry of user RNGs: who is registered, under which key, and the
order the blocks' loops go through them.

:func:`register_rng` and :func:`unregister_rng` change it under ``_lock``.
A weakly held RNG's entry holds it by a :class:`weakref.KeyedRef` whose
callback drops the entry when the object is collected, wherever that
happens (in a block's capture loop, while this thread holds ``_lock``, in
another thread): the callback takes no lock and does single dict operations
only.  An unregistered entry takes its reference with it, so its callback
never runs.  An RNG that cannot be weakly referenced is held by its entry
until :func:`unregister_rng`.  :func:`live_entries` gives the loops
immutable tuples, rebuilt only when the registry changed; the entry points
of :data:`ENTRY_POINT_GROUP` are loaded here too, at the first read of the
registry, since they register RNGs.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from ..._errors import StateWarning
from ...base.completion import guarded
from ...base.seed import short_repr
from ...base.settings import check_bool
from ..rngs.entries import Entry, Step, batched
from ..rngs.kinds import kind_of, manageable

T = TypeVar("T")

#: The entry-point group through which an installed package contributes RNGs:
#: each entry point loads to a zero-argument callable returning an RNG, an
#: iterable of RNGs, a mapping of names to RNGs, or ``None`` (nothing).
ENTRY_POINT_GROUP = "deterministic_ctx.rngs"


#: Serializes ``register_rng`` / ``unregister_rng`` against each other.  Never
#: taken by a reference's callback, which may run while this thread holds it.
_lock = threading.Lock()
#: id(object) -> its entry, in registration order (dicts keep insertion order);
#: also the O(1) duplicate check.  A registered object's id is its own while
#: the entry lives: a held object cannot die, and a weakly held one still
#: occupies its address while its reference's callback removes the entry.
_entries: dict[int, Entry] = {}
#: Default keys: the ordinal among registrations without ``key=`` (never reused).
_counter = itertools.count()
#: Bumped (``next()`` on a C counter: atomic) after every change to ``_entries``;
#: ``_cache`` is valid while it matches, so a tuple built before a change never
#: matches after it.
_versions = itertools.count(1)
_version = 0
#: ``(version, entries, the loops' steps)``; starts stale, so that the first
#: :func:`live_entries` loads the entry points.
_cache: tuple[int, tuple[Entry, ...], tuple[Step, ...]] = (-1, (), ())


def _changed() -> None:
    global _version
    _version = next(_versions)


def _forget(
    ref: weakref.KeyedRef[int, Any],
    entries: dict[int, Entry] = _entries,
    versions: itertools.count[int] = _versions,
) -> None:
    """The callback of a registered object's reference: drop its entry (the
    object of id ``ref.key`` was collected).  What it uses is bound as defaults,
    as in :class:`weakref.WeakValueDictionary`: it may run while the interpreter
    shuts down."""
    global _version
    entry = entries.get(ref.key)
    if entry is not None and entry.get is ref:
        entries.pop(ref.key, None)
        _version = next(versions)


def _rebuild() -> tuple[int, tuple[Entry, ...], tuple[Step, ...]]:
    """The tuples for the registry as it is now (the first time, after the entry points load)."""
    global _cache
    if _plugins_pending:
        _load_plugins()
    version = _version  # read before copying: a change after it makes a mismatch
    # ``dict.copy`` runs no Python code and no collection, so no callback can
    # change the dict halfway.
    entries = tuple(_entries.copy().values())
    _cache = cache = (version, entries, batched(entries))
    return cache


def live_entries() -> tuple[Entry, ...]:
    """The entries in registration order, as an immutable tuple to iterate over:
    the cached one, rebuilt after a change."""
    cache = _cache
    return cache[1] if cache[0] == _version else _rebuild()[1]


def live_steps() -> tuple[Step, ...]:
    """:func:`live_entries` as the loops go through them: runs of one kind as
    that kind's batch (:func:`~..rngs.entries.batched`)."""
    cache = _cache
    return cache[2] if cache[0] == _version else _rebuild()[2]


def _after_fork_in_child() -> None:
    """A thread that was inside ``register_rng`` (or loading the entry points)
    when another thread forked does not exist in the child: give the child
    free locks, and a new version, for a registration cut short between its
    one change to the table and its version bump."""
    global _lock, _plugins_lock
    _lock = threading.Lock()
    _plugins_lock = threading.RLock()
    _changed()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _find(obj: object) -> Entry | None:
    """The live entry of ``obj``, or ``None``.  Caller holds ``_lock``."""
    entry = _entries.get(id(obj))
    # ``is``: an entry whose object died and whose callback has not run yet
    # (it is on its way) has the same id but another object, or none.
    return entry if entry is not None and entry.get() is obj else None


def register_rng(obj: T, *, key: str | None = None, shared: bool = False) -> T:
    """Manage a user-owned RNG in every deterministic block; returns ``obj``.

    Accepted: ``random.Random``, ``numpy.random.Generator``,
    ``numpy.random.RandomState``, ``torch.Generator`` (any device), and any
    object with ``seed()``, ``getstate()`` and ``setstate()`` methods (the
    protocol of Hypothesis's ``register_random``).  Inside a block the object
    is seeded with ``derive_seed(seed, "user", key)`` (64 bits for
    ``random.Random``, ``Generator`` and torch, 32 for ``RandomState`` and
    random-like objects, whose ``seed(int)`` is called); on exit its state is
    restored (``setstate(getstate())`` for random-like objects).  Registering
    the same object again is a no-op (with another ``shared``, a
    ``ValueError``).  Objects that can be weakly referenced are held by weak
    reference and leave the registry when collected; NumPy's types are held
    until :func:`unregister_rng`.

    ``seed`` above is the block's per-rank seed under ``rank=`` (user RNGs
    are data-side, like ``random`` and NumPy: augmentation differs across
    ranks).  With ``shared=True`` it is the block's shared seed instead, the
    one torch's generators get, so the RNG draws alike on every rank: for
    state that must agree across ranks, such as the streams of
    :class:`~deterministic_ctx.parallel.streams.RngStreams` (registered this way).

    Example:
        >>> import random
        >>> from deterministic_ctx import deterministic, register_rng, unregister_rng
        >>> augment = register_rng(random.Random(), key="augment")
        >>> with deterministic(seed=0):
        ...     a = augment.random()
        >>> with deterministic(seed=0):
        ...     b = augment.random()
        >>> a == b
        True
        >>> unregister_rng(augment)
        >>> masks = register_rng(random.Random(), key="masks", shared=True)
        >>> with deterministic(seed=0, rank=1):
        ...     on_rank_1 = masks.random()
        >>> with deterministic(seed=0, rank=2):
        ...     on_rank_1 == masks.random()  # the shared seed: alike on every rank
        True
        >>> unregister_rng(masks)
    """
    kind = kind_of(obj)
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a str or None, got {type(key).__name__} {key!r}")
    check_bool(shared, "shared")
    with _lock:
        found = _find(obj)
        if found is not None:
            if found.shared != shared:
                raise ValueError(
                    f"register_rng(): {short_repr(obj)} is registered already with "
                    f"shared={found.shared}; call unregister_rng() first to register it with "
                    f"shared={shared}"
                )
            return obj
        key = key if key is not None else str(next(_counter))
        _entries[id(obj)] = Entry(obj, key, kind, shared, forget=_forget)
        _changed()
    return obj


def unregister_rng(obj: object) -> None:
    """Stop managing ``obj``; ``ValueError`` if it was not registered.

    Example:
        >>> import random
        >>> from deterministic_ctx import register_rng, unregister_rng
        >>> rng = register_rng(random.Random(1))
        >>> unregister_rng(rng)
    """
    with _lock:
        entry = _find(obj)
        if entry is not None:
            del _entries[id(obj)]  # its reference's callback finds another entry, or none
            _changed()
            return
    raise ValueError(f"unregister_rng(): {obj!r} is not registered")


def registered_rngs() -> list[tuple[str, object]]:
    """``(key, object)`` for every live registered RNG, in registration order.

    The first call (or the first block) also registers what installed
    packages contribute through the ``deterministic_ctx.rngs`` entry points.

    Example:
        >>> import random
        >>> rng = register_rng(random.Random(), key="doc")
        >>> [key for key, obj in registered_rngs() if obj is rng]
        ['doc']
        >>> unregister_rng(rng)
    """
    live = [(e.key, e.get()) for e in live_entries()]
    return [(k, o) for k, o in live if o is not None]


def seed_registered_rngs(seed: int, *, shared_seed: int | None = None) -> None:
    """Seed every registered RNG from ``seed`` as a block seeded with it does
    (each with ``derive_seed(seed, "user", key)``), without capturing anything.

    RNGs registered with ``shared=True`` are seeded from ``shared_seed``
    instead, where it is given (a block under ``rank=`` gives its shared
    seed there and its per-rank seed as ``seed``).

    Example:
        >>> import random
        >>> rng = register_rng(random.Random(), key="doc")
        >>> from deterministic_ctx import derive_seed
        >>> seed_registered_rngs(5)
        >>> rng.random() == random.Random(derive_seed(5, "user", "doc", bits=64)).random()
        True
        >>> unregister_rng(rng)
    """
    for step in live_steps():
        step.seed(shared_seed if step.shared and shared_seed is not None else seed)


# -- entry points ------------------------------------------------------------------------

#: True until the entry points of :data:`ENTRY_POINT_GROUP` were loaded.
_plugins_pending = True
#: Held while loading, so a second thread waits for the RNGs the first is
#: registering; re-entrant, for an entry point whose code reaches
#: ``registered_rngs()`` or a block itself (then it sees what is registered so far).
_plugins_lock = threading.RLock()


def _load_plugins() -> None:
    """Register what every installed entry point of the group contributes, once.

    A broken entry point (it fails to load, raises, or returns something
    ``register_rng`` rejects) is skipped with a :class:`~deterministic_ctx.StateWarning` naming it
    and the error: a block must not fail because of another package.
    """
    global _plugins_pending
    with _plugins_lock:
        if _plugins_pending:
            # False while loading: an entry point reaching the registry sees what
            # is registered so far.  Stopped (an interrupt), the next read tries again.
            _plugins_pending = False
            guarded(_retry_plugins, _register_all)


def _register_all() -> None:
    for ep in _entry_points():
        _register_entry_point(ep)


def _retry_plugins() -> None:
    global _plugins_pending
    _plugins_pending = True


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # broken metadata of some installed distribution
        warnings.warn(
            f"deterministic_ctx could not list the {ENTRY_POINT_GROUP!r} entry points, so no "
            f"installed package's RNGs are managed: {type(exc).__name__}: {exc}",
            StateWarning,
            stacklevel=4,
        )
        return []
    return sorted(found, key=lambda ep: (ep.name, ep.value))


def _register_entry_point(ep: Any) -> None:
    try:
        factory = ep.load()
        if not callable(factory):
            raise TypeError(f"it loads to a {type(factory).__qualname__}, not a callable")
        pairs = _contributions(ep.name, factory())
        for _key, obj in pairs:
            kind_of(obj)  # all or nothing: check every object before registering any
        for key, obj in pairs:
            register_rng(obj, key=key)
    except Exception as exc:
        warnings.warn(
            f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r} failed, so "
            f"deterministic blocks do not manage the RNGs it contributes: "
            f"{type(exc).__name__}: {exc}",
            StateWarning,
            stacklevel=5,
        )


def _contributions(name: str, produced: object) -> list[tuple[str, object]]:
    """``(key, object)`` pairs from what an entry point's callable returned."""
    if produced is None:
        return []
    if manageable(produced):
        return [(name, produced)]
    if isinstance(produced, Mapping):
        out = []
        for k, v in produced.items():
            if not isinstance(k, str):
                raise TypeError(f"its mapping has a key of type {type(k).__qualname__}, not str")
            out.append((f"{name}.{k}", v))
        return out
    if isinstance(produced, Iterable) and not isinstance(produced, (str, bytes)):
        return [(f"{name}.{i}", v) for i, v in enumerate(produced)]
    raise TypeError(
        f"it returned a {type(produced).__qualname__}: expected an RNG, an iterable of RNGs, "
        f"a mapping of names to RNGs, or None"
    )
