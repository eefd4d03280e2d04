"""User-owned RNG objects registered with :func:`register_rng`.

Each registered object is captured, seeded and restored with every block.
Its seed inside a block is ``derive_seed(block_seed, "user", key)``: stable
across runs as long as the key is, and unrelated to the seed of any other
object.  Under ``rank=`` the block's per-rank seed takes the place of
``block_seed`` (user RNGs are data-side, like ``random`` and NumPy), except
for RNGs registered with ``shared=True``: they keep the block's shared seed,
like torch's generators, for state that must agree across ranks (parallel RNG
streams, :mod:`deterministic_ctx.streams`).  The key is the one given to
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
``RuntimeWarning`` naming it and the error, registering none of its RNGs.

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
middle of a block's capture loop, while this thread holds ``_lock``, or in
another thread.  So callbacks take no lock and do nothing but single dict
operations (atomic under the GIL), and every loop runs over an immutable
tuple of the entries, rebuilt only when the registry has changed since.

**Cost per registered RNG** is flat in their number: each entry carries
what its loops need, bound once at registration.

* Exact ``random.Random``, and exact NumPy ``Generator`` / ``RandomState``
  whose bit generator's memory layout was proven at import (MT19937, PCG64,
  PCG64DXSM; ``RandomState`` on MT19937 only), are captured and restored as
  copies of their C record through a view made at registration (see
  :mod:`._memory`; NumPy's under the bit generator's lock, as the global
  source does); the view is used only while the entry's object is known
  alive (``get()`` returned it, or a snapshot holds it), so it never
  outlives the memory under it.  The entry holds the NumPy bit generator
  its views belong to, and uses them only while the object still has that
  one (``Generator.__init__`` and ``RandomState.__init__`` can install
  another: the public API then takes over).  A state loaded from a
  checkpoint is restored through the public API, which checks it, never as
  raw memory.
* Each entry remembers the state seeding left it in for the last block seed
  (``memo``), read back from the object right after the real seeding call:
  a block with the same seed writes that state instead of seeding again
  (no ``SeedSequence``, no 624-word initialization).  Seeding that has no
  such equivalent (``random.Random`` subclasses, whose ``seed()`` may do
  more, a non-CPU ``torch.Generator``, a ``RandomState`` off the fast path,
  random-like objects) calls the object's own ``seed()`` every time.
* Runs of such records registered one after another (at least 8 exact
  ``random.Random``, 5 NumPy ones) are handled as one :class:`Batch`:
  ``map`` over their views, weak references and locks, one ``bytes.join``
  to copy all records out and one ``BytesIO.readinto`` per RNG to copy them
  back, so no Python bytecode runs per RNG.  A batch falls back to its
  entries, one by one, whenever it cannot do its work this way.
  ``tests/test_user_rngs_fast.py`` proves every path equal to the public
  API with a Hypothesis differential test over random workloads.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

from ..._settings import Settings
from .. import _plain
from .batches import Batch, BatchRecord, batched
from .entries import (
    RECORD,
    Entry,
    Record,
    Ref,
)
from .kinds import (
    KINDS,
    kind_of,
    random_like,
    short_repr,
)
from .persistence import CODECS, NotPlain, class_path

__all__ = [
    "ENTRY_POINT_GROUP",
    "UserRngSource",
    "register_rng",
    "registered_rngs",
    "seed_registered_rngs",
    "unregister_rng",
]

T = TypeVar("T")

#: The entry-point group through which an installed package contributes RNGs:
#: each entry point loads to a zero-argument callable returning an RNG, an
#: iterable of RNGs, a mapping of names to RNGs, or ``None`` (nothing).
ENTRY_POINT_GROUP = "deterministic_ctx.rngs"


#: Serializes ``register_rng`` / ``unregister_rng`` against each other.  Never
#: taken by a weak-reference callback, which may run while this thread holds it.
_lock = threading.Lock()
#: token -> entry, in registration order (tokens only grow; dicts keep insertion order).
_entries: dict[int, Entry] = {}
#: id(object) -> token of its entry: the O(1) duplicate check.
_by_id: dict[int, int] = {}
_tokens = itertools.count()
#: Default keys: the ordinal among registrations without ``key=`` (never reused).
_counter = itertools.count()
#: Bumped after every change to ``_entries``; ``_cache`` is valid while it matches.
_versions = itertools.count(1)
_version = 0
#: ``(version, entries, steps)``; starts stale, so that the first
#: :func:`_live` loads the entry points.
_cache: tuple[int, tuple[Entry, ...], tuple[Entry | Batch, ...]] = (-1, (), ())


def _changed() -> None:
    # ``next()`` on a C counter is atomic: racing bumps never produce one value
    # twice, so a cache built before a change never matches after it.
    global _version
    _version = next(_versions)


def _on_collect(
    ref: Ref,
    _entries: dict[int, Entry] = _entries,
    _by_id: dict[int, int] = _by_id,
    _changed: Callable[[], None] = _changed,
) -> None:
    """Drop a collected RNG's entry.  Runs wherever the object died (see the
    module docstring): no lock, single dict operations only.  The tables (and
    the version bump) are bound as defaults so that a callback at interpreter
    shutdown, when module globals may already be None, still finds them."""
    if _entries.pop(ref.token, None) is None:
        return  # unregistered before it died (a snapshot kept the entry alive)
    # The dying object still occupies its address until this returns, so no
    # other object can have registered under the same id meanwhile.
    if _by_id.get(ref.oid) == ref.token:
        _by_id.pop(ref.oid, None)
    # Not contextlib.suppress: at interpreter shutdown that module's name may be gone too.
    try:  # noqa: SIM105
        _changed()
    except TypeError:  # interpreter shutdown: the module's globals are gone, no block follows
        pass


def _live() -> tuple[Entry, ...]:
    """The entries in registration order, as an immutable tuple to iterate over."""
    cache = _cache
    return cache[1] if cache[0] == _version else _refresh()[1]


def _steps() -> tuple[Entry | Batch, ...]:
    """The entries in registration order, runs of batchable ones as
    batches (:func:`batched`): what the blocks' loops go through."""
    cache = _cache
    return cache[2] if cache[0] == _version else _refresh()[2]


def _refresh() -> tuple[int, tuple[Entry, ...], tuple[Entry | Batch, ...]]:
    global _cache
    if _plugins_pending:
        _load_plugins()
    while True:
        version = _version  # read before copying: a change after it makes a mismatch
        try:
            # ``dict.copy`` runs no Python code and no collection, so no callback
            # can change the dict halfway; the retry is a guard, not a path.
            entries = tuple(_entries.copy().values())
        except RuntimeError:  # pragma: no cover - "dictionary changed size"
            continue
        _cache = cache = (version, entries, batched(entries))
        return cache


def _after_fork_in_child() -> None:
    """A thread that was inside ``register_rng`` when another thread forked does
    not exist in the child: give the child a free lock, and rebuild the id
    index from the entries, which a registration cut short may have left
    without its id."""
    global _lock, _plugins_lock
    _lock = threading.Lock()
    _plugins_lock = threading.RLock()
    _by_id.clear()
    for entry in tuple(_entries.copy().values()):
        obj = entry.get()
        if obj is not None:
            _by_id[id(obj)] = entry.token
    _changed()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _find(obj: object) -> Entry | None:
    """The live entry of ``obj``, or ``None``.  Caller holds ``_lock``."""
    token = _by_id.get(id(obj))
    if token is None:
        return None
    entry = _entries.get(token)
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
    :class:`~deterministic_ctx.streams.RngStreams` (registered this way).

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
    if not isinstance(shared, bool):
        raise TypeError(f"shared must be True or False, got {shared!r:.80}")
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
        token = next(_tokens)
        entry = Entry(
            obj,
            key if key is not None else str(next(_counter)),
            kind,
            token,
            shared,
            on_collect=_on_collect,
        )
        _entries[token] = entry
        _by_id[id(obj)] = token
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
            _entries.pop(entry.token, None)
            if _by_id.get(id(obj)) == entry.token:
                _by_id.pop(id(obj), None)
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
    live = [(e.key, e.get()) for e in _live()]
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
        >>> seed_registered_rngs(5)
        >>> rng.random() == random.Random(derive_seed(5, "user", "doc", bits=64)).random()
        True
        >>> unregister_rng(rng)
    """
    steps: tuple[Any, ...] = _steps()  # entries and batches
    for entry in steps:
        s = shared_seed if entry.shared and shared_seed is not None else seed
        mt = entry.mt
        if mt is None and type(entry) is not Entry:  # a batch
            entry.seed(s)
            continue
        obj = entry.get()
        if obj is None:
            continue
        memo = entry.memo
        if memo[0] != s:
            entry.seed_slow(obj, s)
        elif mt is not None:  # inline: one copy and an attribute
            mt[:] = memo[1]
            obj.gauss_next = None
        elif entry.mode == RECORD and obj._bit_generator is entry.bg:  # Entry.seed_again's
            with entry.lock: entry.view[:] = memo[1]  # noqa: E701  # fmt: skip
        else:
            entry.seed_again(obj, s)


class UserRngSource:
    """All registered RNGs: captured, seeded and restored together."""

    name = "user"
    #: The slot of the fused plan (sources/fused.py) this exact class fills.
    fused_slot = "user"
    device_type: str | None = None  # not a device generator: saved under "sources"

    def capture(self) -> tuple[Record | BatchRecord, ...]:
        """One record per live RNG, or per batch of them; ``()`` when there are none.

        A record is ``(entry, object, state, gauss_next)``, or ``(batch,
        objects, joined records, extra)`` for a :class:`Batch`.
        """
        steps = _steps()
        if not steps:
            return ()
        out: list[Any] = []
        append = out.append
        entries: tuple[Any, ...] = steps  # entries and batches
        for entry in entries:
            mt = entry.mt
            if mt is None and type(entry) is not Entry:  # a batch
                entry.capture(out)
                continue
            obj = entry.get()
            if obj is None:  # collected after the tuple was made: its callback has run
                continue
            if mt is not None:  # inline: one copy and an attribute
                append((entry, obj, mt.tobytes(), obj.gauss_next))
            elif entry.mode == RECORD and obj._bit_generator is entry.bg:  # Entry.capture's
                with entry.lock: raw = entry.view.tobytes()  # noqa: E701  # fmt: skip
                append((entry, obj, raw, None))
            else:
                append((entry, obj, entry.capture(obj), None))
        return tuple(out)

    def apply(self, settings: Settings) -> None:
        # Per rank, like ``random`` and NumPy; ``shared=True`` ones like torch.
        seed_registered_rngs(settings.rank_seed, shared_seed=settings.seed)

    def restore(self, state: tuple[Record | BatchRecord, ...]) -> None:
        """Put every RNG of ``state`` back.  One that fails does not stop the
        others; the first failure is raised once all were tried."""
        # The object is kept alive by the snapshot only while the snapshot lives;
        # an RNG collected meanwhile has no state left to restore.
        error: BaseException | None = None
        records: tuple[tuple[Any, Any, Any, Any], ...] = state
        for first, obj, saved, extra in records:
            try:
                mt = first.mt
                if mt is not None:
                    mt[:] = saved
                    obj.gauss_next = extra
                elif type(first) is not Entry:  # a batch
                    if not first.put(obj, saved, extra):
                        error = _put_each(first.records(obj, saved, extra), error)
                elif (  # Entry.put's common case, inline
                    first.mode == RECORD and type(saved) is bytes and obj._bit_generator is first.bg
                ):
                    with first.lock: first.view[:] = saved  # noqa: E701  # fmt: skip
                else:
                    first.put(obj, saved)
            except BaseException as exc:  # an interrupt too: the rest are restored first
                error = error or exc
                if type(first) is not Entry:  # a batch: RNG by RNG, past the failure
                    error = _put_each(first.records(obj, saved, extra), error)
        if error is not None:
            raise error

    def export_state(self, state: tuple[Record | BatchRecord, ...]) -> list[dict[str, Any]]:
        """The state as plain data: ``[{"key", "kind", "state"}, ...]``.

        Raises ``ValueError`` if two registered RNGs share a key (a loaded
        snapshot finds each RNG by its key, so it could not tell them apart),
        or if a random-like object's ``getstate()`` returned something that is
        not plain data (see :mod:`.persistence`): its state cannot be saved.
        """
        out: list[dict[str, Any]] = []
        keys: set[str] = set()
        for entry, obj, saved, gauss in _per_rng(state):
            if entry.key in keys:
                raise ValueError(
                    f"two registered RNGs share the key {entry.key!r}, so a saved snapshot "
                    f"could not tell them apart: register them with distinct keys"
                )
            keys.add(entry.key)
            try:
                plain = CODECS[entry.kind.name][0](obj, entry.public(saved, gauss))
            except NotPlain as exc:
                raise ValueError(
                    f"the state of user RNG {entry.key!r} ({class_path(obj)}) cannot be "
                    f"saved: {exc}. Unregister it before saving a snapshot"
                ) from None
            out.append({"key": entry.key, "kind": entry.kind.name, "state": plain})
        return out

    def import_state(self, data: object, path: str) -> tuple[Record, ...]:
        """Bind each saved state to the RNG registered here under the same key.

        Every saved RNG must be registered (``register_rng(obj, key=...)``)
        before loading, with the same kind: otherwise ``ValueError``, since its
        state could not be restored.  RNGs registered here but absent from the
        snapshot are left alone, as by any snapshot taken before they existed.
        Loaded states are restored through each kind's public API, which
        checks them again, never by writing raw memory.  NumPy and torch
        states are also checked here, on throw-away generators; a random-like
        object's state is checked only by its ``setstate()``, at restore.
        """
        if type(data) is not list:
            raise ValueError(f"{path}: expected a list, got {type(data).__name__}")
        by_key: dict[str, list[tuple[Entry, Any]]] = {}
        for e in _live():
            obj = e.get()
            if obj is not None:
                by_key.setdefault(e.key, []).append((e, obj))
        out: list[Record] = []
        seen: set[str] = set()
        for i, item in enumerate(data):
            where = f"{path}[{i}]"
            d = _plain.fields(item, where, ["key", "kind", "state"])
            key = _plain.text(d["key"], f"{where}.key")
            kind = _plain.text(d["kind"], f"{where}.kind", choices=CODECS)
            if key in seen:
                raise ValueError(f"{where}.key: {key!r} is saved twice")
            seen.add(key)
            found = by_key.get(key, [])
            if len(found) != 1:
                raise ValueError(
                    f"{where}: the snapshot holds user RNG {key!r} ({kind}), and "
                    + (
                        f"no RNG is registered with that key here: call "
                        f"register_rng(rng, key={key!r}) before loading"
                        if not found
                        else f"{len(found)} RNGs are registered with that key here"
                    )
                )
            entry, obj = found[0]
            if entry.kind.name != kind:
                raise ValueError(
                    f"{where}.kind: saved a {kind}, but the RNG registered here with key "
                    f"{key!r} is a {entry.kind.name}"
                )
            state = CODECS[kind][1](obj, d["state"], f"{where}.state")
            out.append((entry.loaded(), obj, state, None))
        return tuple(out)


def _per_rng(state: tuple[Record | BatchRecord, ...]) -> Iterator[Record]:
    """One ``(entry, object, state, gauss_next)`` per RNG of a captured state
    (a batch's record as its entries' records), in registration order but
    within a run of batches, whose ``random.Random`` come before its NumPy
    objects (they touch separate memory; a saved state is matched by key)."""
    for record in state:
        first = record[0]
        if isinstance(first, Batch):
            yield from first.records(record[1], record[2], record[3])
        else:
            yield cast(Record, record)


def _put_each(records: Iterable[Record], error: BaseException | None) -> BaseException | None:
    """Restore each RNG's record (the restore loop's body, for a batch's slow
    path); the first error, ``error`` if given, is returned once all were tried."""
    for entry, obj, saved, gauss in records:
        try:
            if entry.mt is not None:
                entry.mt[:] = saved
                obj.gauss_next = gauss
            else:
                entry.put(obj, saved)
        except BaseException as exc:  # an interrupt too, as in the restore loop
            error = error or exc
    return error


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
    ``register_rng`` rejects) is skipped with a ``RuntimeWarning`` naming it
    and the error: a block must not fail because of another package.
    """
    global _plugins_pending
    with _plugins_lock:
        if not _plugins_pending:
            return
        _plugins_pending = False
        try:
            for ep in _entry_points():
                _register_entry_point(ep)
        except BaseException:  # an interrupt: the next block tries again
            _plugins_pending = True
            raise


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # broken metadata of some installed distribution
        warnings.warn(
            f"deterministic_ctx could not list the {ENTRY_POINT_GROUP!r} entry points, so no "
            f"installed package's RNGs are managed: {type(exc).__name__}: {exc}",
            RuntimeWarning,
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
            RuntimeWarning,
            stacklevel=5,
        )


def _manageable(obj: object) -> bool:
    return isinstance(obj, tuple(cls for cls, _ in KINDS)) or random_like(obj)


def _contributions(name: str, produced: object) -> list[tuple[str, object]]:
    """``(key, object)`` pairs from what an entry point's callable returned."""
    if produced is None:
        return []
    if _manageable(produced):
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
