"""User-owned RNG objects registered with :func:`register_rng`.

Each registered object is captured, seeded and restored with every block.
Its seed inside a block is ``derive_seed(block_seed, "user", key)``: stable
across runs as long as the key is, and unrelated to the seed of any other
object.  Under ``rank=`` the block's per-rank seed takes the place of
``block_seed`` (user RNGs are data-side, like ``random`` and NumPy).  The key
is the one given to ``register_rng`` or, by default, the registration
ordinal (``"0"``, ``"1"``, …).

``random.Random`` and ``torch.Generator`` are held by weak reference.  NumPy
generators and bit generators cannot be weakly referenced (their C types
lack ``__weakref__``), so they are held until :func:`unregister_rng`.

The registry stays as small as the set of live RNGs, however many were
registered and collected: each weak reference's callback removes its entry
the moment the object dies, and the duplicate check in ``register_rng`` and
``unregister_rng`` is a dict lookup by ``id``, not a scan.  A callback can run
at any moment a reference count drops to zero or a collection runs: in the
middle of a block's capture loop, while this thread holds ``_lock``, or in
another thread.  So callbacks take no lock and do nothing but single dict
operations (atomic under the GIL), and every loop runs over an immutable
tuple of the entries, rebuilt only when the registry has changed since.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from .._seed import derive_seed
from .._settings import Settings
from . import _plain
from .numpy_global import bit_generator_state_from_plain, numpy_state_to_plain
from .python_random import (
    PythonRandomState,
    capture_rng,
    fast_layout_for,
    public_state,
    random_state_from_plain,
    random_state_to_plain,
    restore_rng,
    seed_rng,
)
from .torch_cpu import generator_state_from_plain

__all__ = [
    "UserRngSource",
    "register_rng",
    "registered_rngs",
    "seed_registered_rngs",
    "unregister_rng",
]

T = TypeVar("T")


@dataclass(frozen=True)
class _Kind:
    name: str
    get: Callable[[Any], Any]
    set: Callable[[Any, Any], None]
    seed: Callable[[Any, int], None]
    bits: int


def _np_generator_seed(gen: np.random.Generator, seed: int) -> None:
    bg = gen.bit_generator
    bg.state = type(bg)(seed).state


_KINDS: tuple[tuple[type, _Kind], ...] = (
    (
        random.Random,
        _Kind(
            "random.Random",
            lambda r: r.getstate(),
            lambda r, s: r.setstate(s),
            lambda r, s: r.seed(s),
            64,
        ),
    ),
    (
        np.random.Generator,
        _Kind(
            "numpy.random.Generator",
            lambda g: g.bit_generator.state,
            lambda g, s: setattr(g.bit_generator, "state", s),
            _np_generator_seed,
            64,
        ),
    ),
    (
        np.random.RandomState,
        _Kind(
            "numpy.random.RandomState",
            lambda r: r.get_state(legacy=False),
            lambda r, s: r.set_state(s),
            lambda r, s: r.seed(s),
            32,
        ),
    ),
    (
        torch.Generator,
        _Kind(
            "torch.Generator",
            lambda g: g.get_state(),
            lambda g, s: g.set_state(s),
            lambda g, s: g.manual_seed(s),
            64,
        ),
    ),
)


def _kind_of(obj: object) -> _Kind:
    if isinstance(obj, random.SystemRandom):
        raise TypeError(
            "register_rng() cannot manage random.SystemRandom: it draws from the OS and "
            "has no state to seed or restore"
        )
    for cls, kind in _KINDS:
        if isinstance(obj, cls):
            return kind
    accepted = ", ".join(k.name for _, k in _KINDS)
    raise TypeError(
        f"register_rng() cannot manage {type(obj).__qualname__} {obj!r}; accepted: {accepted}"
    )


class _Ref(weakref.ref[Any]):
    """A weak reference that knows its registry entry's token and the object's id,
    so its callback finds what to remove without holding the entry (no cycle)."""

    __slots__ = ("oid", "token")
    oid: int
    token: int

    def __new__(cls, obj: object, callback: Callable[[_Ref], None], token: int) -> _Ref:
        self = super().__new__(cls, obj, callback)
        self.token = token
        self.oid = id(obj)
        return self

    def __init__(self, obj: object, callback: Callable[[_Ref], None], token: int) -> None:
        # ``weakref.ref.__init__`` only checks its two arguments; all is done in __new__.
        pass


class _Entry:
    __slots__ = ("_memo", "get", "key", "kind", "layout", "token")

    def __init__(self, obj: object, key: str, kind: _Kind, token: int) -> None:
        # ``get()`` returns the object, or ``None`` once it has been collected.
        self.get: Callable[[], Any]
        try:
            self.get = _Ref(obj, _on_collect, token)
        except TypeError:  # NumPy's types lack __weakref__: held (see the module docstring)
            self.get = _strong(obj)
        self.token = token
        self.key = key
        self.kind = kind
        # Exact random.Random instances share the global ``random``'s proven
        # memory fast path (~1 µs instead of ~15 µs per block).
        self.layout = fast_layout_for(obj)
        self._memo: tuple[int, int] | None = None

    def derived_seed(self, seed: int) -> int:
        # Blocks in a loop reuse one seed: skip the SeedSequence on repeats.
        memo = self._memo
        if memo is None or memo[0] != seed:
            memo = self._memo = (seed, derive_seed(seed, "user", self.key, bits=self.kind.bits))
        return memo[1]


def _strong(obj: object) -> Callable[[], object]:
    return lambda: obj


#: Serializes ``register_rng`` / ``unregister_rng`` against each other.  Never
#: taken by a weak-reference callback, which may run while this thread holds it.
_lock = threading.Lock()
#: token -> entry, in registration order (tokens only grow; dicts keep insertion order).
_entries: dict[int, _Entry] = {}
#: id(object) -> token of its entry: the O(1) duplicate check.
_by_id: dict[int, int] = {}
_tokens = itertools.count()
#: Default keys: the ordinal among registrations without ``key=`` (never reused).
_counter = itertools.count()
#: Bumped after every change to ``_entries``; ``_cache`` is valid while it matches.
_versions = itertools.count(1)
_version = 0
_cache: tuple[int, tuple[_Entry, ...]] = (0, ())


def _changed() -> None:
    # ``next()`` on a C counter is atomic: racing bumps never produce one value
    # twice, so a cache built before a change never matches after it.
    global _version
    _version = next(_versions)


def _on_collect(
    ref: _Ref,
    _entries: dict[int, _Entry] = _entries,
    _by_id: dict[int, int] = _by_id,
) -> None:
    """Drop a collected RNG's entry.  Runs wherever the object died (see the
    module docstring): no lock, single dict operations only.  The tables are
    bound as defaults so that a callback at interpreter shutdown still finds them."""
    if _entries.pop(ref.token, None) is None:
        return  # unregistered before it died (a snapshot kept the entry alive)
    # The dying object still occupies its address until this returns, so no
    # other object can have registered under the same id meanwhile.
    if _by_id.get(ref.oid) == ref.token:
        _by_id.pop(ref.oid, None)
    _changed()


def _live() -> tuple[_Entry, ...]:
    """The entries in registration order, as an immutable tuple to iterate over."""
    global _cache
    version, entries = _cache
    if version == _version:
        return entries
    while True:
        version = _version  # read before copying: a change after it makes a mismatch
        try:
            # ``dict.copy`` runs no Python code and no collection, so no callback
            # can change the dict halfway; the retry is a guard, not a path.
            entries = tuple(_entries.copy().values())
        except RuntimeError:  # pragma: no cover - "dictionary changed size"
            continue
        _cache = (version, entries)
        return entries


def _after_fork_in_child() -> None:
    """A thread that was inside ``register_rng`` when another thread forked does
    not exist in the child: give the child a free lock, and rebuild the id
    index from the entries, which a registration cut short may have left
    without its id."""
    global _lock
    _lock = threading.Lock()
    _by_id.clear()
    for entry in tuple(_entries.copy().values()):
        obj = entry.get()
        if obj is not None:
            _by_id[id(obj)] = entry.token
    _changed()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _find(obj: object) -> _Entry | None:
    """The live entry of ``obj``, or ``None``.  Caller holds ``_lock``."""
    token = _by_id.get(id(obj))
    if token is None:
        return None
    entry = _entries.get(token)
    # ``is``: an entry whose object died and whose callback has not run yet
    # (it is on its way) has the same id but another object, or none.
    return entry if entry is not None and entry.get() is obj else None


def register_rng(obj: T, *, key: str | None = None) -> T:
    """Manage a user-owned RNG in every deterministic block; returns ``obj``.

    Accepted: ``random.Random``, ``numpy.random.Generator``,
    ``numpy.random.RandomState`` and ``torch.Generator`` (any device).  Inside a
    block the object is seeded with ``derive_seed(seed, "user", key)``; on exit
    its state is restored.  Registering the same object again is a no-op.
    ``random.Random`` and ``torch.Generator`` are held by weak reference and
    leave the registry when collected; NumPy's types are held until
    :func:`unregister_rng`.

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
    """
    kind = _kind_of(obj)
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a str or None, got {type(key).__name__} {key!r}")
    with _lock:
        if _find(obj) is not None:
            return obj
        token = next(_tokens)
        entry = _Entry(obj, key if key is not None else str(next(_counter)), kind, token)
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

    Example:
        >>> registered_rngs()
        []
    """
    live = [(e.key, e.get()) for e in _live()]
    return [(k, o) for k, o in live if o is not None]


def seed_registered_rngs(seed: int) -> None:
    """Seed every registered RNG from ``seed`` as a block seeded with it does
    (each with ``derive_seed(seed, "user", key)``), without capturing anything."""
    entries = _live()
    if not entries:
        return
    for entry in entries:
        obj = entry.get()
        if obj is None:
            continue
        if entry.layout is not None:
            seed_rng(obj, entry.layout, entry.derived_seed(seed))
        else:
            entry.kind.seed(obj, entry.derived_seed(seed))


class UserRngSource:
    """All registered RNGs: captured, seeded and restored together."""

    name = "user"
    device_type: str | None = None  # not a device generator: saved under "sources"

    def capture(self) -> tuple[tuple[_Entry, Any, Any], ...]:
        entries = _live()
        if not entries:
            return ()
        out = []
        for entry in entries:
            obj = entry.get()
            if obj is None:  # collected after the tuple was made: its callback has run
                continue
            if entry.layout is not None:
                out.append((entry, obj, capture_rng(obj, entry.layout)))
            else:
                out.append((entry, obj, entry.kind.get(obj)))
        return tuple(out)

    def apply(self, settings: Settings) -> None:
        seed_registered_rngs(settings.rank_seed)  # per rank, like ``random`` and NumPy

    def restore(self, state: tuple[tuple[_Entry, Any, Any], ...]) -> None:
        # The object is kept alive by the snapshot only while the snapshot lives;
        # an RNG collected meanwhile has no state left to restore.
        for entry, obj, saved in state:
            if type(saved) is PythonRandomState:
                restore_rng(obj, entry.layout, saved)
            else:
                entry.kind.set(obj, saved)

    def export_state(self, state: tuple[tuple[_Entry, Any, Any], ...]) -> list[dict[str, Any]]:
        """The state as plain data: ``[{"key", "kind", "state"}, ...]``.

        Raises ``ValueError`` if two registered RNGs share a key: a loaded
        snapshot finds each RNG by its key, so it could not tell them apart.
        """
        out: list[dict[str, Any]] = []
        keys: set[str] = set()
        for entry, obj, saved in state:
            if entry.key in keys:
                raise ValueError(
                    f"two registered RNGs share the key {entry.key!r}, so a saved snapshot "
                    f"could not tell them apart: register them with distinct keys"
                )
            keys.add(entry.key)
            plain = _CODECS[entry.kind.name][0](obj, saved)
            out.append({"key": entry.key, "kind": entry.kind.name, "state": plain})
        return out

    def import_state(self, data: object, path: str) -> tuple[tuple[_Entry, Any, Any], ...]:
        """Bind each saved state to the RNG registered here under the same key.

        Every saved RNG must be registered (``register_rng(obj, key=...)``)
        before loading, with the same kind: otherwise ``ValueError``, since its
        state could not be restored.  RNGs registered here but absent from the
        snapshot are left alone, as by any snapshot taken before they existed.
        """
        if type(data) is not list:
            raise ValueError(f"{path}: expected a list, got {type(data).__name__}")
        by_key: dict[str, list[tuple[_Entry, Any]]] = {}
        for e in _live():
            obj = e.get()
            if obj is not None:
                by_key.setdefault(e.key, []).append((e, obj))
        out: list[tuple[_Entry, Any, Any]] = []
        seen: set[str] = set()
        for i, item in enumerate(data):
            where = f"{path}[{i}]"
            d = _plain.fields(item, where, ["key", "kind", "state"])
            key = _plain.text(d["key"], f"{where}.key")
            kind = _plain.text(d["kind"], f"{where}.kind", choices=_CODECS)
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
            out.append((entry, obj, _CODECS[kind][1](obj, d["state"], f"{where}.state")))
        return tuple(out)


def _bit_generator_name(obj: np.random.Generator | np.random.RandomState) -> str:
    bg = obj.bit_generator if isinstance(obj, np.random.Generator) else obj._bit_generator
    return type(bg).__name__


def _numpy_from_plain(obj: Any, data: object, path: str) -> dict[str, Any]:
    legacy = isinstance(obj, np.random.RandomState)
    state = bit_generator_state_from_plain(data, path, legacy=legacy)
    if state["bit_generator"] != _bit_generator_name(obj):
        raise ValueError(
            f"{path}.bit_generator: saved {state['bit_generator']}, but the registered RNG "
            f"uses {_bit_generator_name(obj)}"
        )
    return state


def _torch_from_plain(obj: torch.Generator, data: object, path: str) -> torch.Tensor:
    d = _plain.fields(data, path, ["device", "state"])
    _plain.text(d["device"], f"{path}.device", choices=(str(obj.device),))
    return generator_state_from_plain(d["state"], f"{path}.state", obj)


#: kind name -> (state to plain data, checked plain data to state) for checkpoints.
_CODECS: dict[str, tuple[Callable[[Any, Any], Any], Callable[[Any, object, str], Any]]] = {
    "random.Random": (
        lambda _obj, s: random_state_to_plain(
            public_state(s) if type(s) is PythonRandomState else s
        ),
        lambda _obj, d, p: random_state_from_plain(d, p),
    ),
    "numpy.random.Generator": (lambda _obj, s: numpy_state_to_plain(s), _numpy_from_plain),
    "numpy.random.RandomState": (lambda _obj, s: numpy_state_to_plain(s), _numpy_from_plain),
    "torch.Generator": (
        lambda obj, s: {"device": str(obj.device), "state": s.clone()},
        _torch_from_plain,
    ),
}
assert set(_CODECS) == {kind.name for _cls, kind in _KINDS}, "every kind needs a codec"
