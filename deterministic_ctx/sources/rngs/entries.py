"""One RNG bound to its kind's paths, and a batch of many ``random.Random``.

An :class:`Entry` is made once per RNG (at registration; for the global
``random`` and NumPy sources, when they are made) and binds what the blocks'
loops need: how to reach the object (``get()``), its kind (:mod:`.kinds`),
key and ``shared``, and two fast paths, both off with
``DETERMINISTIC_CTX_NO_FAST_PATHS=1``: **records** (where the kind gives
views over the object's C records, its state is copied through them, under
the bit generator's lock for NumPy) and **memo** (where the kind
``remembers`` it, the state seeding left is kept for the last block seed and
written instead of seeding again).

Views are used only while the object is known alive (``get()`` returned it,
or a capture holds it), and a NumPy entry's only while the object still has
the bit generator they belong to (``__init__`` can install another).  A
state loaded from a checkpoint is in the public API's form, restored through
the public API, which checks it, never as raw memory.

:class:`MtBatch` is ``random.Random``'s batch: C-level loops over many.
"""

from __future__ import annotations

import operator
import random
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from io import BytesIO
from itertools import repeat
from typing import Any

import numpy as np

from ...base.fast_paths import ENABLED
from ...base.seed import derive_seed
from .._seeded import SeededCache
from .kinds import RANDOM, Kind

__all__ = ["MT_BATCH_MIN", "Entry", "MtBatch", "Record", "Step", "batched"]

#: What a capture holds per step: ``(entry or batch, object(s), state)``.
Record = tuple[Any, Any, Any]

_NUMPY = (np.random.Generator, np.random.RandomState)
#: Runs an iterator of C calls to its end, keeping nothing.
_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend


class Entry:
    """One RNG and everything its loops need, bound once."""

    __slots__ = ("bg", "get", "key", "kind", "lock", "memo", "remember", "shared", "views")

    def __init__(
        self,
        obj: Any,
        key: str,
        kind: Kind,
        shared: bool = False,
        *,
        fast: bool = ENABLED,
        forget: Callable[[weakref.KeyedRef[int, Any]], object] | None = None,
    ) -> None:
        #: ``get()``: the object, or ``None`` once it was collected (then
        #: ``forget(get)`` runs, with ``get.key == id(obj)``).  Objects that
        #: cannot be weakly referenced (NumPy's types, torch 2.11's Generator) are
        #: held by the entry, as a C callable returning them.
        self.get: Callable[[], Any]
        try:
            self.get = (
                weakref.ref(obj) if forget is None else weakref.KeyedRef(obj, forget, id(obj))
            )
        except TypeError:
            self.get = repeat(obj).__next__
        self.key, self.kind = key, kind
        #: Seeded from a block's shared seed (``Settings.seed``), not its per-rank one.
        self.shared = shared
        #: ``(block seed, derived seed, the state seeding left or None)``; -1: none yet.
        self.memo: tuple[int, int, Any] = (-1, 0, None)
        #: Whether writing back the state seeding left is seeding (the memo's condition).
        self.remember = fast and kind.remembers(obj)
        #: The NumPy bit generator the views and memo belong to, held (so the
        #: views never outlive its memory).
        self.bg = obj._bit_generator if type(obj) in _NUMPY else None
        self.views = kind.views(obj) if fast else ()
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
        seeded = cache.get(seed) if self.views else None
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
                with self.lock: _drain(map(BytesIO(state).readinto, views))  # noqa: E701  # fmt: skip
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

    def fallback(self) -> tuple[Record, ...]:
        """The records of this step when ``get()`` found it dead: none."""
        return ()

    def split(self, obj: Any, state: Any) -> tuple[Record, ...]:
        """A record of this step as the records of its entries: itself."""
        return ((self, obj, state),)


# -- random.Random's batch ------------------------------------------------------------

#: How many consecutive exact ``random.Random`` make a batch: below it a
#: batch's fixed cost (a few tuples and C calls) exceeds what it saves per RNG
#: (measured at c0861d0: they break even at 8 to 12).
MT_BATCH_MIN = 8
#: ``operator.call`` (Python 3.11+) calls a weak reference without the slot
#: wrapper's argument tuple; ``weakref.ref.__call__`` is the same call, slower.
_call: Callable[[Any], Any] = getattr(operator, "call", weakref.ref.__call__)
_gauss_next = operator.attrgetter("gauss_next")
#: Endless, and never advanced by ``map`` past its shortest argument: shared by
#: every call (and every thread).
_GAUSS_NEXT = repeat("gauss_next")
_NONE = repeat(None)


class MtBatch:
    """Consecutive exact ``random.Random`` entries (weakly held, on records) of
    one ``shared``, as one step of the blocks' loops.

    Records are copied out with one ``b"".join`` of the views and back with
    the ``readinto`` of one ``BytesIO`` over the joined bytes, in the same
    order: each RNG gets exactly its bytes.  Both are C copies that hold the
    GIL from the first RNG to the last.  ``memo`` is the entries' seeded
    records joined, for one block seed.  The views are used only while a
    tuple of the objects, just read from the weak references and all alive,
    holds them; with one collected, its entries do the work one by one.
    """

    __slots__ = ("entries", "memo", "refs", "shared", "views")

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        self.entries = entries
        self.refs = tuple(e.get for e in entries)
        self.views = tuple(e.views[0] for e in entries)
        self.shared = entries[0].shared
        #: ``(block seed, the seeded records joined in order)``.
        self.memo: tuple[int, bytes] = (-1, b"")

    def get(self) -> tuple[Any, ...] | None:
        """The objects, or ``None`` if one was collected since the batch was made."""
        objs = tuple(map(_call, self.refs))
        # An exact random.Random is always true (no __bool__ or __len__), None never.
        return objs if all(objs) else None

    def capture(self, objs: tuple[Any, ...]) -> tuple[bytes, tuple[Any, ...]]:
        return b"".join(self.views), tuple(map(_gauss_next, objs))

    def put(self, objs: tuple[Any, ...], state: tuple[bytes, tuple[Any, ...]]) -> None:
        raw, gauss = state
        _drain(map(BytesIO(raw).readinto, self.views))
        _drain(map(setattr, objs, _GAUSS_NEXT, gauss))

    def seed(self, seed: int) -> None:
        """Seed every entry for the block seed ``seed``: the remembered records
        for a seed seen last time, else each entry seeds (and remembers)."""
        objs = self.get()
        memo = self.memo
        if objs is not None and memo[0] == seed:
            _drain(map(BytesIO(memo[1]).readinto, self.views))
            _drain(map(setattr, objs, _GAUSS_NEXT, _NONE))
            return
        for entry in self.entries:
            entry.seed(seed)
        memos = [entry.memo for entry in self.entries]
        if objs is not None and all(m[0] == seed and m[2] is not None for m in memos):
            self.memo = (seed, b"".join(m[2][0] for m in memos))

    def fallback(self) -> tuple[Record, ...]:
        """The records of the live entries, one by one (one was collected)."""
        out = []
        for entry in self.entries:
            obj = entry.get()
            if obj is not None:
                out.append((entry, obj, entry.capture(obj)))
        return tuple(out)

    def split(
        self, objs: tuple[Any, ...], state: tuple[bytes, tuple[Any, ...]]
    ) -> tuple[Record, ...]:
        """A record of this batch as its entries' records, in order."""
        raw, gauss = state
        out, at = [], 0
        for entry, obj, view, g in zip(self.entries, objs, self.views, gauss, strict=True):
            out.append((entry, obj, (raw[at : at + len(view)], g)))
            at += len(view)
        return tuple(out)


#: One step of the registered RNGs' loops: an entry, or a batch of them.
Step = Entry | MtBatch


def batched(entries: tuple[Entry, ...]) -> tuple[Step, ...]:
    """``entries`` with each run of at least :data:`MT_BATCH_MIN` consecutive
    exact ``random.Random`` on records (weakly held) of one ``shared`` as one
    :class:`MtBatch`.  The order stays: an RNG seeded through another (a
    random-like wrapper around a registered ``random.Random``) may depend on it."""
    steps: list[Step] = []
    run: list[Entry] = []

    def close() -> None:
        if len(run) >= MT_BATCH_MIN:
            steps.append(MtBatch(tuple(run)))
        else:
            steps.extend(run)
        run.clear()

    for entry in entries:
        if entry.kind is RANDOM and entry.views and isinstance(entry.get, weakref.ref):
            if run and run[0].shared != entry.shared:
                close()
            run.append(entry)
        else:
            close()
            steps.append(entry)
    close()
    return tuple(steps)
