"""One registered RNG: how it is captured, seeded and restored, chosen once.

An :class:`Entry` is made at registration and binds what the blocks' loops
need: the object (by weak reference where it can be), its kind and key, and
its path, of two independent choices (both off with the fast paths).  The
global ``random`` (:mod:`..python_random`) and NumPy's global ``RandomState``
(:mod:`..numpy_global`) are captured and restored by an entry too, one per
kind's records for all:

* **records**: an exact ``random.Random``, and an exact NumPy ``Generator``
  or ``RandomState`` whose bit generator's record was proven (see
  :mod:`.._memory`), is captured and restored as copies of its C records
  through views made here (NumPy's under the bit generator's lock); any
  other RNG through its kind's public API (:mod:`.kinds`);
* **memo**: where writing back the state seeding left is exactly seeding
  (exact ``random.Random``, NumPy ``Generator`` and ``RandomState``, a CPU
  ``torch.Generator``, whose state holds its seed and normal caches), the
  entry remembers that state for the last block seed and writes it instead
  of seeding again; other RNGs call their own ``seed()`` every time.

Views are used only while the object is known alive (``get()`` returned it,
or a snapshot holds it).  A NumPy entry holds the bit generator its views
and memo belong to, and uses them only while the object still has it
(``__init__`` can install another: the public API then takes over).  A
state loaded from a checkpoint is in the public API's form, which no record
is taken for: it is restored through the public API, which checks it, never
as raw memory.
"""

from __future__ import annotations

import random
import weakref
from collections import deque
from collections.abc import Callable
from io import BytesIO
from typing import Any

import numpy as np
import torch

from ...base.seed import derive_seed
from .._memory import ENABLED, NUMPY_LAYOUT, RANDOM_LAYOUT, mt19937_view, proven_records
from .._seeded import SeededCache
from .kinds import Kind

#: What a capture holds per RNG: ``(entry, object, state)``.
Record = tuple["Entry", Any, Any]

_NUMPY = (np.random.Generator, np.random.RandomState)
_consume: Callable[[Any], None] = deque(maxlen=0).extend


def _views(obj: Any) -> tuple[memoryview, ...]:
    """Views over the C records of ``obj``, or ``()``: the public API."""
    kind, bg = type(obj), getattr(obj, "_bit_generator", None)
    if kind is random.Random and RANDOM_LAYOUT is not None:
        return (RANDOM_LAYOUT.view(obj),)
    if kind is np.random.Generator:
        record = proven_records().get(type(bg))
        view = record(bg) if record is not None else None
        return () if view is None else (view,)
    if kind is np.random.RandomState and NUMPY_LAYOUT is not None and type(bg) is np.random.MT19937:
        return (mt19937_view(bg), NUMPY_LAYOUT.view(obj))  # its record and the gaussian cache
    return ()


class Entry:
    """One registered RNG and everything its loops need, bound at registration."""

    __slots__ = ("bg", "get", "key", "kind", "lock", "memo", "remember", "shared", "views")

    def __init__(
        self,
        obj: Any,
        key: str,
        kind: Kind,
        shared: bool = False,
        *,
        on_collect: Callable[[Any], None] | None = None,
        fast: bool = ENABLED,
    ) -> None:
        # ``get()`` returns the object, or ``None`` once it has been collected.
        # ``on_collect`` is the registry's: it removes this entry (see :mod:`.registry`).
        self.get: Callable[[], Any]
        try:
            self.get = weakref.ref(obj, on_collect)
        except TypeError:  # NumPy's types, torch 2.11's Generator: held (see the package docstring)
            self.get = lambda: obj
        self.key, self.kind = key, kind
        #: Seeded from a block's shared seed (``Settings.seed``), not its per-rank one.
        self.shared = shared
        #: ``(block seed, derived seed, the state seeding left or None)``; -1: none yet.
        self.memo: tuple[int, int, Any] = (-1, 0, None)
        #: Whether writing back the state seeding left is seeding (the memo's condition).
        self.remember = fast and (
            type(obj) in (random.Random, *_NUMPY)
            or (type(obj) is torch.Generator and obj.device.type == "cpu")
        )
        #: The NumPy bit generator the views and memo belong to, held (so the
        #: views never outlive its memory).
        self.bg = obj._bit_generator if type(obj) in _NUMPY else None
        self.views = _views(obj) if fast else ()
        self.lock: Any = self.bg.lock if self.views and self.bg is not None else None

    def seed(self, seed: int) -> None:
        """Seed this RNG for the block seed ``seed`` (nothing once it was collected)."""
        obj = self.get()
        if obj is None:
            return
        block_seed, derived, seeded = self.memo
        own = self.bg is None or obj._bit_generator is self.bg  # the memo is its bit generator's
        if block_seed == seed and seeded is not None and own:
            self.put(obj, seeded)
            return
        if block_seed != seed:
            derived = derive_seed(seed, "user", self.key, bits=self.kind.bits)
        self.kind.seed(obj, derived)
        self.memo = (seed, derived, self.capture(obj) if self.remember and own else None)

    def seed_exactly(self, obj: Any, seed: int, cache: SeededCache[Any]) -> None:
        """Seed ``obj`` with ``seed`` itself, by its kind's seeding (the global
        ``random``'s and NumPy's way): on records, the state that seeding left
        for a seed seen before is written from ``cache`` instead, one copy."""
        seeded = cache.lookup(seed) if self.views else None
        if seeded is not None:
            self.put(obj, seeded)
            return
        self.kind.seed(obj, seed)
        if self.views:  # remembered (a 2.5 KB read)
            cache.offer(seed, lambda: self.capture(obj))

    def capture(self, obj: Any) -> Any:
        """The state of ``obj`` (this entry's object) now: ``(record,
        gauss_next)`` for ``random.Random`` on records, NumPy's records joined,
        or the public API's form (also where the bit generator was replaced)."""
        views = self.views
        if not views:
            return self.kind.get(obj)
        lock = self.lock
        if lock is None:  # random.Random
            return views[0].tobytes(), obj.gauss_next
        if obj._bit_generator is not self.bg:
            return self.kind.get(obj)
        # The bit generator's lock keeps a draw in another thread (NumPy
        # releases the GIL for large fills) from tearing the copy.  Each
        # locked copy is a one-line ``with``: CPython gives the exit of a
        # ``with`` the statement's line, so with the body on another line a
        # tracer (or debugger) raising at that line event would skip the
        # release and leave NumPy's lock held for good.
        with lock: return b"".join(views)  # noqa: E701  # fmt: skip

    def put(self, obj: Any, state: Any) -> None:
        """Put back a state :meth:`capture` returned (or a public one)."""
        views = self.views
        if views and self.lock is None and type(state[0]) is bytes:  # random.Random's record
            views[0][:], obj.gauss_next = state
        elif views and type(state) is bytes and obj._bit_generator is self.bg:
            # One line each, as in :meth:`capture`.
            if len(views) == 1:  # a Generator: half the time of the loop below
                with self.lock: views[0][:] = state  # noqa: E701  # fmt: skip
            else:  # a RandomState: its MT19937 record, then the gaussian cache
                with self.lock: _consume(map(BytesIO(state).readinto, views))  # noqa: E701  # fmt: skip
        else:
            self.kind.set(obj, self.public(obj, state))

    def public(self, obj: Any, state: Any) -> Any:
        """A state of ``obj`` as the kind's public API gives it: records are put
        into a throw-away object of the same type, and read back through the API."""
        if not self.views or type(state if self.lock is not None else state[0]) is not bytes:
            return state  # a public state already
        scratch = random.Random() if self.bg is None else type(obj)(type(self.bg)())
        Entry(scratch, self.key, self.kind).put(scratch, state)
        return self.kind.get(scratch)
