"""One RNG bound to its kind's paths, and the blocks' steps over many.

An :class:`Entry` is made once per RNG (at registration; for the global
``random`` and NumPy sources, when they are made) and binds what the blocks'
loops need: how to reach the object (``get()``), its kind (:mod:`.kinds`),
key and ``shared``, and the functions its kind gives for it
(:meth:`~.kinds.Kind.bind`), called directly: **records** (the state copied
through views over the object's C records) where the kind's layout was
proven, and **memo** (where the kind ``remembers`` it, the state seeding
left is kept for the last block seed and written instead of seeding again);
both are off with ``DETERMINISTIC_CTX_NO_FAST_PATHS=1``.

:func:`batched` makes each run of entries its kind batches (``random.Random``'s
:class:`~.kinds.MtBatch`) one step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from itertools import repeat
from typing import Any

from ...base.fast_paths import ENABLED
from ...base.seed import derive_seed
from .._seeded import SeededCache
from .kinds import MT_BATCH_MIN, Kind, MtBatch

__all__ = ["Entry", "Record", "Step", "batched"]

#: What a capture holds per step: ``(entry or batch, object(s), state)``.
Record = tuple[Any, Any, Any]


class Entry:
    """One RNG and everything its loops need, bound once."""

    __slots__ = (
        "capture",
        "get",
        "key",
        "kind",
        "memo",
        "part",
        "part_of",
        "public",
        "put",
        "remember",
        "shared",
        "views",
    )

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
        (
            self.capture,
            self.put,
            self.public,
            self.views,
            self.part,
            self.part_of,
            self.remember,
        ) = kind.bind(obj, fast)

    def seed(self, seed: int) -> None:
        """Seed this RNG for the block seed ``seed`` (nothing once it was collected)."""
        obj = self.get()
        if obj is None:
            return
        block_seed, derived, seeded = self.memo
        # The memo belongs to the part it was taken from (a NumPy bit generator).
        own = self.part_of is None or self.part_of(obj) is self.part
        if block_seed == seed and seeded is not None and own:
            self.put(obj, seeded)
            return
        if block_seed != seed:
            derived = derive_seed(seed, "user", self.key, bits=self.kind.bits)
        self.kind.seed(obj, derived)
        self.memo = (seed, derived, self.capture(obj) if self.remember and own else None)

    def seed_exactly(self, obj: Any, seed: int, cache: SeededCache[Any]) -> None:
        """Seed ``obj`` with ``seed`` itself, by its kind's seeding (the global
        sources' way): where the kind remembers it, the state that seeding left
        for a seed seen before is written from ``cache`` instead, one copy."""
        seeded = cache.get(seed) if self.remember else None
        if seeded is not None:
            self.put(obj, seeded)
            return
        self.kind.seed(obj, seed)
        if self.remember:  # remembered (a 2.5 KB read; a tensor for torch)
            cache.offer(seed, lambda: self.capture(obj))

    def fallback(self) -> tuple[Record, ...]:
        """The records of this step when ``get()`` found it dead: none."""
        return ()

    def split(self, obj: Any, state: Any) -> tuple[Record, ...]:
        """A record of this step as the records of its entries: itself."""
        return ((self, obj, state),)


#: One step of the registered RNGs' loops: an entry, or a batch of them.
Step = Entry | MtBatch


def batched(entries: tuple[Entry, ...]) -> tuple[Step, ...]:
    """``entries`` with each run of at least :data:`~.kinds.MT_BATCH_MIN`
    consecutive entries of a kind with a batch, on records and weakly held, of
    one ``shared``, as one step, the kind's batch.  The order stays: an RNG
    seeded through another (a random-like wrapper around a registered
    ``random.Random``) may depend on it."""
    steps: list[Step] = []
    run: list[Entry] = []

    def close() -> None:
        batch = run[0].kind.batch if run else None
        if batch is not None and len(run) >= MT_BATCH_MIN:
            steps.append(batch(tuple(run)))
        else:
            steps.extend(run)
        run.clear()

    for entry in entries:
        if entry.kind.batch is not None and entry.views and isinstance(entry.get, weakref.ref):
            if run and (run[0].kind, run[0].shared) != (entry.kind, entry.shared):
                close()
            run.append(entry)
        else:
            close()
            steps.append(entry)
    close()
    return tuple(steps)
