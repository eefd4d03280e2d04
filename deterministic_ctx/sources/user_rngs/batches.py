"""Runs of registered RNGs handled together, by C-level loops.

A :class:`Batch` is consecutive entries whose state is a C record copied
through a view (exact ``random.Random``, NumPy ones on a proven record): it
captures, seeds and restores all of them with ``map`` over their views,
objects and locks, so that no bytecode runs per RNG.  :func:`batched` makes
the steps the blocks' loops go through, batching runs long enough to pay.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from io import BytesIO
from itertools import compress, repeat
from typing import Any, TypeVar

from .entries import LEGACY, OWN_BIT_GENERATOR, RECORD, Entry, Record, Ref, parts, seed_entry

T = TypeVar("T")

#: What a capture holds per :class:`Batch`: ``(batch, objects, joined
#: records, extra)`` (``gauss_next`` values for ``random.Random``, else ``None``).
BatchRecord = tuple["Batch", tuple[Any, ...], bytes, Any]

#: How many consecutive entries of a kind make a batch: below it a batch's
#: fixed cost (a few tuples and C calls, 2-3 µs) exceeds what it saves per
#: RNG (measured in blocks: exact ``random.Random`` break even at 8 to 12,
#: NumPy Generators, whose entries run more Python per RNG, at 4 to 6).
_MT_BATCH_MIN = 8
_RECORD_BATCH_MIN = 5
#: ``operator.call`` (Python 3.11+) calls a weak reference without the slot
#: wrapper's argument tuple; ``weakref.ref.__call__`` is the same call, slower.
_call: Callable[[Any], Any] = getattr(operator, "call", weakref.ref.__call__)
_gauss_next = operator.attrgetter("gauss_next")
#: Runs an iterator of C calls to its end, keeping nothing.
_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
_NO_BATCH_MEMO: tuple[int, bytes] = (-1, b"")
#: Endless, and never advanced by ``map`` past its shortest argument: shared
#: by every call (``next`` on an endless ``repeat`` changes nothing, so
#: threads can share them too).
_GAUSS_NEXT = repeat("gauss_next")
_NONE = repeat(None)
_NO_WAIT = repeat(False)
#: NumPy's bit generators' lock (``threading.RLock()`` is this C type).
_RLOCK = type(threading.RLock())
_acquire = _RLOCK.acquire
_release = _RLOCK.release


class Batch:
    """Consecutive entries of one kind and one ``shared``, captured, seeded
    and restored by C-level loops: ``map`` over their views and objects, so
    that no bytecode runs per RNG.  Made with the registry's tuple of
    entries, dropped with it.

    Records are copied out with one ``b"".join`` of the views (one
    allocation for all of them) and back with the ``readinto`` of one
    ``BytesIO`` over the joined bytes, the views in the same order: each RNG
    gets exactly the bytes read from it.  Both are C copies that hold the
    GIL from the first RNG to the last (``bytes.join`` releases it only for
    ``bytes`` items).  ``memo`` is the entries' memos joined, for one block
    seed: the seeded records of the whole batch, written the same way.
    Whatever a batch cannot do this way (an object collected since it was
    made, a bit generator replaced or locked by another thread, a memo
    another thread changed), its entries do one by one, as alone.
    """

    __slots__ = ("entries", "memo", "shared", "views")
    #: As an entry's, for the loops' first test: a batch is not an ``MT`` entry.
    mt: Any = None

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        self.entries = entries
        self.views = tuple(e.view for e in entries)
        self.shared = entries[0].shared
        #: ``(block seed, the seeded records joined in order)``.
        self.memo = _NO_BATCH_MEMO

    def capture_into(self, out: list[Any]) -> None:
        """Append this batch's record ``(batch, objects, joined records,
        extra)`` to ``out``, or its entries' own records."""
        raise NotImplementedError

    def restore(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> None:
        """Put back a record of this batch: at once, or RNG by RNG where it
        cannot (:meth:`put`) or was interrupted half-way.  One RNG that fails
        does not stop the others; the first failure is raised once all were tried."""
        error: BaseException | None = None
        try:
            if self.put(objs, raw, extra):
                return
        except BaseException as exc:  # an interrupt too: RNG by RNG, past it
            error = exc
        for entry, obj, saved, gauss in self.records(objs, raw, extra):
            try:
                entry.restore(obj, saved, gauss)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def seed(self, seed: int) -> None:
        """:func:`.registry.seed_registered_rngs` for the entries of this batch."""
        raise NotImplementedError

    def put(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> bool:
        """Restore a record of this batch; ``False`` where the entries must
        (:meth:`records`, one by one)."""
        raise NotImplementedError

    def records(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> Iterator[Record]:
        """A record of this batch as the entries' own records, in order."""
        extras = extra if extra is not None else (None,) * len(self.entries)
        at = 0
        for entry, obj, view, x in zip(self.entries, objs, self.views, extras, strict=True):
            yield entry, obj, raw[at : at + len(view)], x
            at += len(view)

    def seeded(self, objs: tuple[Any, ...], seed: int) -> bytes | None:
        """The seeded records joined, for ``seed``: remembered, or made by
        seeding the entries whose memo misses it; ``None`` if another thread
        changed a memo meanwhile."""
        memo = self.memo
        if memo[0] == seed:
            return memo[1]
        for entry, obj in zip(self.entries, objs, strict=True):
            if entry.memo[0] != seed:
                entry.seed_slow(obj, seed)
        memos = [entry.memo for entry in self.entries]
        if any(m[0] != seed for m in memos):  # pragma: no cover - another thread seeded
            return None
        # A ``LEGACY`` entry's state is two records, in the order of its views.
        joined = b"".join(itertools.chain.from_iterable(parts(m[1]) for m in memos))
        self.memo = (seed, joined)
        return joined

    def seed_each(self, objs: Iterable[Any], seed: int) -> None:
        for entry, obj in zip(self.entries, objs, strict=True):
            if obj is not None:
                seed_entry(entry, obj, seed)


class _MtBatch(Batch):
    """Exact ``random.Random`` entries (``MT``), held by weak reference.

    The views are used only while a tuple of the objects, just read from the
    weak references and all alive, holds them (see the package docstring).
    ``extra`` is their ``gauss_next`` values.
    """

    __slots__ = ("refs",)

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        super().__init__(entries)
        self.refs = tuple(e.get for e in entries)

    def objects(self) -> tuple[Any, ...] | None:
        """The objects, or ``None`` if one was collected since the batch was
        made (its callback has run or is running: the next batch lacks it)."""
        objs = tuple(map(_call, self.refs))
        # ``all``: an exact random.Random is always true (no __bool__ or
        # __len__), ``None`` never; a false object would only take the slow path.
        return objs if all(objs) else None

    def capture_into(self, out: list[Any]) -> None:
        objs = self.objects()
        if objs is not None:
            out.append((self, objs, b"".join(self.views), tuple(map(_gauss_next, objs))))
            return
        for entry in self.entries:
            entry.capture_into(out)

    def seed(self, seed: int) -> None:
        objs = self.objects()
        joined = self.seeded(objs, seed) if objs is not None else None
        if objs is None or joined is None:
            self.seed_each(map(_call, self.refs), seed)
            return
        _drain(map(BytesIO(joined).readinto, self.views))
        _drain(map(setattr, objs, _GAUSS_NEXT, _NONE))

    def put(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> bool:
        _drain(map(BytesIO(raw).readinto, self.views))
        _drain(map(setattr, objs, _GAUSS_NEXT, extra))
        return True


class _RecordBatch(Batch):
    """NumPy Generators on a proven record (``RECORD``) and RandomStates on
    MT19937 (``LEGACY``: two records, the bit generator's and the gaussian
    cache's, in that order), held strongly by the registry (NumPy's types
    cannot be weakly referenced), so by the batch too.

    Each record is read and written under its bit generator's lock, as one
    entry does.  The batch takes every lock without waiting (``RLock``: a
    bit generator shared by two Generators, or locked by this thread
    already, is taken again) and, if one is held by another thread, releases
    those it took and leaves the work to its entries, which wait for it:
    never waiting while holding another lock, it cannot deadlock.
    """

    __slots__ = ("bgs", "locks", "objs")

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        super().__init__(entries)
        self.views = tuple(v for e in entries for v in (e.view, e.view2) if v is not None)
        self.objs = tuple(e.get() for e in entries)
        self.bgs = tuple(e.bg for e in entries)
        self.locks = tuple(e.lock for e in entries)

    def records(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> Iterator[Record]:
        at = 0
        for entry, obj in zip(self.entries, objs, strict=True):
            parts = []
            for view in (entry.view, entry.view2) if entry.view2 is not None else (entry.view,):
                parts.append(raw[at : at + len(view)])
                at += len(view)
            yield entry, obj, tuple(parts) if len(parts) == 2 else parts[0], None

    def locked(self, work: Callable[[], T]) -> T | None:
        """``work()``, run holding every lock; ``None`` (nothing run) unless
        every object still has the bit generator the records belong to and
        every lock is free or this thread's.

        The locks are taken without waiting, in one C call, inside the ``try``
        whose ``finally`` releases exactly those taken: an interrupt (a signal
        handler's ``KeyboardInterrupt``) at any line leaves none of them held,
        which would hang every other thread that draws from them.
        """
        if not all(map(operator.is_, map(OWN_BIT_GENERATOR, self.objs), self.bgs)):
            return None
        taken: list[bool] = []
        try:
            taken.extend(map(_acquire, self.locks, _NO_WAIT))
            return work() if all(taken) else None
        finally:
            _drain(map(_release, compress(self.locks, taken)))

    def capture_into(self, out: list[Any]) -> None:
        objs = self.objs
        raw = self.locked(partial(b"".join, self.views))
        if raw is not None:
            out.append((self, objs, raw, None))
            return
        for entry in self.entries:
            entry.capture_into(out)

    def seed(self, seed: int) -> None:
        objs = self.objs
        ok = all(map(operator.is_, map(OWN_BIT_GENERATOR, objs), self.bgs))
        joined = self.seeded(objs, seed) if ok else None
        if joined is None or self.locked(partial(self._write, joined)) is None:
            self.seed_each(objs, seed)

    def put(self, objs: tuple[Any, ...], raw: bytes, extra: Any) -> bool:
        return self.locked(partial(self._write, raw)) is not None

    def _write(self, raw: bytes) -> bool:
        """Copy ``raw`` into the records (the locks held); ``True``."""
        _drain(map(BytesIO(raw).readinto, self.views))
        return True


def batched(entries: tuple[Entry, ...]) -> tuple[Entry | Batch, ...]:
    """``entries`` with runs of batchable ones as batches (see :class:`Batch`).

    A run is consecutive exact ``random.Random`` (``MT``) and NumPy
    (``RECORD``, ``LEGACY``) entries of one ``shared``; its ``MT``
    entries become an :class:`_MtBatch` (at least :data:`_MT_BATCH_MIN`),
    then its NumPy ones a :class:`_RecordBatch` (at least
    :data:`_RECORD_BATCH_MIN`), each in registration order, fewer stay
    entries.  Within a run only the two families trade places: they touch
    disjoint memory and run no code of the user's.  Across runs, and within
    a family (a Generator and a RandomState may share a bit generator), the
    registration order stays: an RNG seeded through another (a random-like
    wrapper around a registered ``random.Random``) may depend on it.
    """
    steps: list[Entry | Batch] = []
    mts: list[Entry] = []
    records: list[Entry] = []

    def close() -> None:
        for run, make, least in (
            (mts, _MtBatch, _MT_BATCH_MIN),
            (records, _RecordBatch, _RECORD_BATCH_MIN),
        ):
            if len(run) >= least:
                steps.append(make(tuple(run)))
            else:
                steps.extend(run)
            run.clear()

    shared = False
    for entry in entries:
        if entry.mt is not None and type(entry.get) is Ref:
            run = mts
        elif (
            entry.mode in (RECORD, LEGACY)
            and type(entry.lock) is _RLOCK
            and type(entry.get) is not Ref
        ):
            run = records  # strongly held: the batch holds the objects too
        else:
            close()
            steps.append(entry)
            continue
        if entry.shared != shared:
            close()
            shared = entry.shared
        run.append(entry)
    close()
    return tuple(steps)
