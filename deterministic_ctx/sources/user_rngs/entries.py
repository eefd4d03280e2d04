"""One registered RNG: how it is captured, seeded and restored, chosen once.

An :class:`Entry` is made at registration and holds everything its loops
need, bound then: the object (by weak reference where it can be), its kind,
its key, the path it takes (``mode``: the public API, or copies of its C
records through views, see :mod:`.._memory`) and the state seeding left it in
for the last block seed (``memo``).  An entry is one step of the blocks'
loops (:mod:`.registry`, :mod:`.source`), as a :class:`.batches.Batch` is:
``capture_into``, ``seed`` and ``restore``.
"""

from __future__ import annotations

import operator
import struct
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from ...base.seed import derive_seed
from .._memory import ENABLED, NUMPY_LAYOUT, MtRecord, PcgRecord, mt19937_view, proven_records
from ..python_random import PythonRandomState, fast_layout_for, public_state
from .kinds import GENERATOR, RANDOM, RANDOM_STATE, TORCH, Kind

#: How an entry is captured, seeded and restored (chosen at registration).
API = 0  # the kind's get / set / seed, every time
MT = 1  # exact random.Random: a 2500-byte record and ``gauss_next``
RECORD = 2  # numpy.random.Generator on a proven bit generator: one record
LEGACY = 3  # exact numpy.random.RandomState on MT19937: two records
SET = 4  # the kind's get / set, seeding by setting the remembered seeded state


#: What a capture holds per RNG: ``(entry, object, state, gauss_next)``; the
#: last is the ``random.Random`` record's companion on the ``MT`` path and
#: ``None`` elsewhere (one tuple per RNG, not two: blocks allocate less).
Record = tuple["Entry", Any, Any, Any]


class Ref(weakref.ref[Any]):
    """A weak reference that knows its registry entry's token and the object's id,
    so its callback finds what to remove without holding the entry (no cycle)."""

    __slots__ = ("oid", "token")
    oid: int
    token: int

    def __new__(cls, obj: object, callback: Callable[[Ref], None], token: int) -> Ref:
        self = super().__new__(cls, obj, callback)
        self.token = token
        self.oid = id(obj)
        return self

    def __init__(self, obj: object, callback: Callable[[Ref], None], token: int) -> None:
        # ``weakref.ref.__init__`` only checks its two arguments; all is done in __new__.
        pass


class Entry:
    """One registered RNG and everything its loops need, bound at registration."""

    __slots__ = (
        "_memo",
        "bg",
        "bg_of",
        "codec",
        "get",
        "key",
        "kind",
        "layout",
        "lock",
        "memo",
        "mode",
        "mt",
        "shared",
        "token",
        "view",
        "view2",
    )

    def __init__(
        self,
        obj: object,
        key: str,
        kind: Kind,
        token: int,
        shared: bool = False,
        *,
        on_collect: Callable[[Ref], None],
    ) -> None:
        # ``get()`` returns the object, or ``None`` once it has been collected.
        # ``on_collect`` is the registry's: it removes this entry (see :mod:`.registry`).
        self.get: Callable[[], Any]
        try:
            self.get = Ref(obj, on_collect, token)
        except TypeError:  # NumPy's types lack __weakref__: held (see the package docstring)
            self.get = _strong(obj)
        self.token = token
        self.key = key
        self.kind = kind
        #: Seeded from a block's shared seed (``Settings.seed``), not its per-rank one.
        self.shared = shared
        self.layout = fast_layout_for(obj)
        self._memo: tuple[int, int] | None = None  # (block seed, derived seed)
        #: ``(block seed, state)``: what seeding with that block seed left (-1:
        #: none yet; seeds are never negative, so one comparison tests it).
        self.memo: tuple[int, Any] = _NO_MEMO
        self.mode = API
        # Views over the object's C records (see ``_choose_path``).
        self.view: Any = None
        self.view2: Any = None
        #: ``view`` for ``MT`` entries, else ``None``: the loops' one test for the common case.
        self.mt: Any = None
        self.lock: Any = None
        self.codec: PcgRecord | MtRecord | None = None
        #: The NumPy bit generator that ``view``, ``lock`` and ``memo`` belong
        #: to, held (so the views never outlive its memory), and how to read
        #: the object's current one: ``Generator.__init__`` and
        #: ``RandomState.__init__`` can be called again and install another.
        self.bg: Any = None
        self.bg_of: Callable[[Any], Any] | None = None
        self._choose_path(obj)

    def _choose_path(self, obj: Any) -> None:
        # Views are made here, while ``obj`` is alive; the loops use them only
        # after ``get()`` returned the object (see the package docstring).
        if not ENABLED:  # DETERMINISTIC_CTX_NO_FAST_PATHS: the kind's API every time
            return
        kind = self.kind
        if kind is RANDOM:
            if self.layout is not None:
                self.mode, self.view = MT, self.layout.view(obj)
                self.mt = self.view
        elif kind is GENERATOR:
            bg = obj.bit_generator
            # An exact Generator's ``bit_generator`` is its ``_bit_generator``
            # attribute (read without a call); a subclass may override the property.
            exact = type(obj) is np.random.Generator
            self.bg, self.bg_of = bg, OWN_BIT_GENERATOR if exact else _BIT_GENERATOR
            codec = proven_records().get(type(bg))
            view = codec.view(bg) if codec is not None and exact else None
            if codec is not None and view is not None:
                self.mode, self.view, self.lock, self.codec = RECORD, view, bg.lock, codec
            else:
                self.mode = SET
        elif kind is RANDOM_STATE:
            bg = obj._bit_generator
            if (
                NUMPY_LAYOUT is not None
                and type(obj) is np.random.RandomState
                and type(bg) is np.random.MT19937
            ):
                self.bg, self.bg_of = bg, OWN_BIT_GENERATOR
                self.mode, self.lock = LEGACY, bg.lock
                self.view, self.view2 = mt19937_view(bg), NUMPY_LAYOUT.view(obj)
        elif kind is TORCH and type(obj) is torch.Generator and obj.device.type == "cpu":
            # A CPU generator's state holds its seed and normal caches, so
            # setting the state seeding produced is ``manual_seed`` (tests
            # compare both, ``initial_seed()`` included); other devices' are
            # not known to be, and are seeded each time.
            self.mode = SET

    def replaced(self, obj: Any) -> bool:
        """Whether ``obj`` has another bit generator than the one this entry's
        views and memo belong to: then it takes the public API, as an ``API``
        entry would."""
        bg_of = self.bg_of
        return bg_of is not None and bg_of(obj) is not self.bg

    def derived_seed(self, seed: int) -> int:
        memo = self._memo
        if memo is None or memo[0] != seed:
            memo = self._memo = (seed, derive_seed(seed, "user", self.key, bits=self.kind.bits))
        return memo[1]

    def seed_slow(self, obj: Any, seed: int) -> None:
        """Seed ``obj`` for the block seed ``seed`` with the real call and, where
        it has an exact equivalent, remember the state it left."""
        derived = self.derived_seed(seed)
        mode = self.mode
        if mode == API or self.replaced(obj):
            self.kind.seed(obj, derived)
            return
        state: Any
        if mode == SET and self.kind is GENERATOR:
            bg = obj.bit_generator
            state = type(bg)(derived).state  # exactly what GENERATOR.seed sets
            bg.state = state
        elif mode == SET:
            self.kind.seed(obj, derived)
            state = self.kind.get(obj)
        else:
            self.kind.seed(obj, derived)
            state = self.capture(obj)
        self.memo = (seed, state)

    def seed_again(self, obj: Any, seed: int) -> None:
        """:meth:`seed_slow` where ``memo`` holds ``seed`` already: its state is
        written (not for ``MT`` entries: see :func:`seed_entry`)."""
        # The records and the memo are those of the bit generator the entry
        # holds; one that was replaced since takes the public API (for both
        # record modes ``_bit_generator`` is the one, and a lock is set).
        lock = self.lock
        if lock is None:  # SET, API
            bg_of = self.bg_of
            if bg_of is None or bg_of(obj) is self.bg:
                self.kind.set(obj, self.memo[1])
                return
        elif obj._bit_generator is self.bg:
            if self.mode == RECORD:
                with lock: self.view[:] = self.memo[1]  # noqa: E701  # fmt: skip
            else:
                with lock: self.view[:], self.view2[:] = self.memo[1]  # noqa: E701  # fmt: skip
            return
        self.kind.seed(obj, self.derived_seed(seed))

    def capture_into(self, out: list[Any]) -> None:
        """Append this RNG's :data:`Record` to ``out`` (nothing once it was collected)."""
        obj = self.get()
        if obj is not None:
            gauss = obj.gauss_next if self.mt is not None else None
            out.append((self, obj, self.capture(obj), gauss))

    def seed(self, seed: int) -> None:
        """Seed this RNG for the block seed ``seed`` (nothing once it was collected)."""
        obj = self.get()
        if obj is not None:
            seed_entry(self, obj, seed)

    def restore(self, obj: Any, state: Any, gauss: Any) -> None:
        """Put back a record's state (and an ``MT`` entry's ``gauss_next``)."""
        mt = self.mt
        if mt is not None:
            mt[:] = state
            obj.gauss_next = gauss
        else:
            self.put(obj, state)

    def capture(self, obj: Any) -> Any:
        """The state of ``obj`` (this entry's object) now, in this entry's form
        (an ``MT`` entry's record only: :meth:`capture_into` adds ``gauss_next``;
        the public form where the bit generator was replaced)."""
        lock = self.lock
        if lock is None:  # MT, SET, API
            mt = self.mt
            return mt.tobytes() if mt is not None else self.kind.get(obj)
        if obj._bit_generator is self.bg:  # see seed_again
            if self.mode == RECORD:
                with lock: return self.view.tobytes()  # noqa: E701  # fmt: skip
            with lock: return (self.view.tobytes(), self.view2.tobytes())  # noqa: E701  # fmt: skip
        return self.kind.get(obj)

    def put(self, obj: Any, state: Any) -> None:
        """Put back a state :meth:`capture` returned (not for ``MT`` entries:
        see :meth:`restore`)."""
        lock = self.lock
        if lock is None:  # SET, API
            assert self.mt is None
            self.kind.set(obj, state)
        elif type(state) is not dict and obj._bit_generator is self.bg:
            if self.mode == RECORD:
                with lock: self.view[:] = state  # noqa: E701  # fmt: skip
            else:
                with lock: self.view[:], self.view2[:] = state  # noqa: E701  # fmt: skip
        else:  # as the public API would, onto a replaced bit generator
            self.kind.set(obj, self.public(state, None))

    def public(self, state: Any, gauss: Any) -> Any:
        """A captured state as the kind's public API gives it."""
        mode = self.mode
        if mode == MT:
            return public_state(PythonRandomState(state, gauss))
        if type(state) is dict:  # captured through the API (``SET``, a replaced bit generator)
            return state
        if mode == RECORD:
            assert self.codec is not None
            return self.codec.decode(state)
        if mode == LEGACY:
            mt, gauss = state
            (has_gauss,) = struct.unpack_from("=i", gauss)
            (value,) = struct.unpack_from("=d", gauss, 8)
            return {
                **MtRecord().decode(mt),
                "has_gauss": has_gauss,
                "gauss": value,
            }
        return state

    def loaded(self) -> Entry:
        """A twin of this entry for a state loaded from a checkpoint: restored
        through the kind's public API (which checks it), never as raw memory."""
        twin = object.__new__(Entry)
        for name in Entry.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.mode, twin.view, twin.view2, twin.mt = API, None, None, None
        twin.codec, twin.memo, twin.lock, twin.bg, twin.bg_of = None, _NO_MEMO, None, None, None
        return twin


_BIT_GENERATOR = operator.attrgetter("bit_generator")  # what ``GENERATOR``'s API reads
#: Where both NumPy types keep their bit generator (``RandomState``'s API and an
#: exact ``Generator``'s ``bit_generator`` property read it there).
OWN_BIT_GENERATOR = operator.attrgetter("_bit_generator")

_NO_MEMO: tuple[int, Any] = (-1, None)


def _strong(obj: object) -> Callable[[], object]:
    return lambda: obj


def parts(state: bytes | tuple[bytes, ...]) -> tuple[bytes, ...]:
    """An entry's records: ``LEGACY`` states are two, the others one."""
    return state if type(state) is tuple else (cast(bytes, state),)


def seed_entry(entry: Entry, obj: Any, seed: int) -> None:
    """One entry of :func:`.registry.seed_registered_rngs`'s loop, as a function."""
    if entry.memo[0] != seed:
        entry.seed_slow(obj, seed)
    elif entry.mt is not None:
        entry.mt[:] = entry.memo[1]
        obj.gauss_next = None
    else:
        entry.seed_again(obj, seed)
