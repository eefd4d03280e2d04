"""One adapter per kind of RNG, and which kind an object is.

A :class:`Kind` is everything the package knows about one family of RNG:
its public API (``get``, ``set``, ``seed``, :attr:`~Kind.bits`), its
checkpoint codec (``to_plain``/``from_plain``, :mod:`.persistence`) and its
fast paths (:attr:`Kind.fast_paths`, all off with
``DETERMINISTIC_CTX_NO_FAST_PATHS=1``): :meth:`Kind.bind` gives one object's
capture, put and public-state functions, on its C records where its layout
was proven (:class:`Bound`), which an :class:`~.entries.Entry` calls
directly, and ``random.Random``'s :attr:`~Kind.batch` copies many records at
once (:class:`MtBatch`).  :func:`kind_of` picks an object's kind for
``register_rng``, or refuses the object with the reason.

Records are used only while the object is known alive (the entry's
``get()`` returned it, or a capture holds it), and a NumPy object's only
while it still has the bit generator they belong to (``__init__`` can
install another).  A state loaded from a checkpoint is in the public API's
form, restored through the public API, which checks it, never as raw memory.
"""

from __future__ import annotations

import operator
import random
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from io import BytesIO
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import torch

from ...base import plain as _plain
from ...base.fast_paths import FastPath
from ...base.seed import short_repr
from . import layouts, uncollected
from . import persistence as plain

__all__ = [
    "BY_NAME",
    "C_SEED",
    "GENERATOR",
    "KINDS",
    "MT_BATCH_MIN",
    "RANDOM",
    "RANDOM_LIKE",
    "RANDOM_STATE",
    "TORCH",
    "Bound",
    "Kind",
    "MtBatch",
    "kind_of",
    "manageable",
]


#: Runs an iterator of C calls to its end, keeping nothing.
_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend


def _as_is(obj: Any, state: Any) -> Any:
    return state


class Bound(NamedTuple):
    """One object's paths, as its kind binds them (:meth:`Kind.bind`)."""

    #: ``capture(obj)``: its state now, as records or in the public form.
    capture: Callable[[Any], Any]
    #: ``put(obj, state)``: a state ``capture`` returned, or a public one, put back.
    put: Callable[[Any, Any], None]
    #: ``public(obj, state)``: a state ``capture`` returned, in the public form.
    public: Callable[[Any, Any], Any]
    #: Views over its C records (the fast path), or ``()``: the public API.
    views: tuple[memoryview, ...] = ()
    #: What the records and the memo belong to (a NumPy object's bit generator),
    #: held so the views never outlive its memory, and how to read the current one.
    part: Any = None
    part_of: Callable[[Any], Any] | None = None
    #: Whether writing back the state seeding left is seeding (an entry's memo).
    remember: bool = False


class Kind:
    """How one family of RNG is read, written, seeded and saved; this base is
    the random-like protocol (``getstate()``, ``setstate()``, ``seed()``, a
    32-bit seed: see :data:`RANDOM_LIKE`), with no fast path."""

    name = "random-like"
    bits = 32
    #: What this kind's fast paths speed up, and whether this process takes them.
    fast_paths: tuple[FastPath, ...] = ()
    #: Its batch over many objects on records (``None``: one by one).
    batch: Callable[[tuple[Any, ...]], Any] | None = None

    def get(self, obj: Any) -> Any:
        """The public state of ``obj``."""
        return obj.getstate()

    def set(self, obj: Any, state: Any) -> None:
        """Put a public state back into ``obj``."""
        obj.setstate(state)

    def seed(self, obj: Any, seed: int) -> None:
        """Seed ``obj`` with ``seed`` (of :attr:`bits` bits)."""
        obj.seed(seed)

    def to_plain(self, obj: Any, state: Any) -> Any:
        """A public state as checkpoint data (``ValueError``: it cannot be saved)."""
        return plain.random_like_to_plain(obj, state)

    def from_plain(self, obj: Any, data: object, path: str) -> Any:
        """Checkpoint data as a public state for ``obj``, checked."""
        return plain.random_like_from_plain(obj, data, path)

    def bind(self, obj: Any, fast: bool) -> Bound:
        """The paths for ``obj`` (on records only where ``fast``): here the public API."""
        return Bound(self.get, self.set, _as_is, remember=fast and self.remembers(obj))

    def remembers(self, obj: Any) -> bool:
        """Whether writing back the state seeding left in ``obj`` is exactly
        seeding it (then an entry remembers it per seed)."""
        return False

    def __repr__(self) -> str:
        return f"<kind {self.name}>"


#: The C seeding under ``random.Random.seed`` (the class of ``_random``), which the
#: Python method calls for an int after its checks: seeding an exact ``random.Random``
#: through it saves that method's frame (the kind's ``seed``, the random source's reseeder).
C_SEED: Any = random.Random.__mro__[1].seed  # type: ignore[attr-defined]


# -- random.Random's batch --------------------------------------------------------

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
    """``random.Random``'s batch: consecutive exact ones' entries (weakly held,
    on records, :class:`~.entries.Entry`) of one ``shared``, as one step of the
    blocks' loops.

    Records are copied out with one ``b"".join`` of the views and back with
    the ``readinto`` of one ``BytesIO`` over the joined bytes, in the same
    order: each RNG gets exactly its bytes.  Both are C copies that hold the
    GIL from the first RNG to the last.  ``memo`` is the entries' seeded
    records joined, for one block seed.  The views are used only while a
    tuple of the objects, just read from the weak references and all alive,
    holds them; with one collected, its entries do the work one by one.
    """

    __slots__ = ("entries", "memo", "refs", "shared", "views")

    def __init__(self, entries: tuple[Any, ...]) -> None:
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

    def fallback(self) -> tuple[tuple[Any, Any, Any], ...]:
        """The records of the live entries, one by one (one was collected)."""
        out = []
        for entry in self.entries:
            obj = entry.get()
            if obj is not None:
                out.append((entry, obj, entry.capture(obj)))
        return tuple(out)

    def split(
        self, objs: tuple[Any, ...], state: tuple[bytes, tuple[Any, ...]]
    ) -> tuple[tuple[Any, Any, Any], ...]:
        """A record of this batch as its entries' records, in order."""
        raw, gauss = state
        out, at = [], 0
        for entry, obj, view, g in zip(self.entries, objs, self.views, gauss, strict=True):
            out.append((entry, obj, (raw[at : at + len(view)], g)))
            at += len(view)
        return tuple(out)


class _Random(Kind):
    """``random.Random``: a 64-bit seed; an exact one is copied as its
    2500-byte Mersenne Twister record (plus ``gauss_next``), and many of them
    in one batch (:class:`MtBatch`)."""

    name = "random.Random"
    bits = 64
    batch = MtBatch
    fast_paths = (
        FastPath(
            "random.Random: state copied as memory", lambda: layouts.RANDOM_LAYOUT is not None
        ),
        FastPath(
            "registered random.Random: 8 or more in a row copied in one batch",
            lambda: layouts.RANDOM_LAYOUT is not None,
        ),
    )

    def seed(self, obj: Any, seed: int) -> None:
        """``obj.seed(seed)``; for an exact ``random.Random`` what that method
        does for an int, without its Python frame: the C seeding (``_random.Random.seed``)
        and ``gauss_next = None`` (a keyed item seeds a new key every time)."""
        if type(obj) is random.Random:
            C_SEED(obj, seed)
            obj.gauss_next = None  # type: ignore[attr-defined]
        else:
            obj.seed(seed)

    def to_plain(self, obj: Any, state: Any) -> Any:
        return plain.random_state_to_plain(state)

    def from_plain(self, obj: Any, data: object, path: str) -> Any:
        return plain.random_state_from_plain(data, path)

    def bind(self, obj: Any, fast: bool) -> Bound:
        """An exact ``random.Random`` on records: a state is ``(record, gauss_next)``."""
        layout = layouts.RANDOM_LAYOUT
        if not fast or type(obj) is not random.Random or layout is None:
            return super().bind(obj, fast)
        view = layout.view(obj)

        def capture(obj: Any) -> Any:
            return view.tobytes(), obj.gauss_next

        def put(obj: Any, state: Any) -> None:
            if type(state[0]) is bytes:
                view[:], obj.gauss_next = state
            else:
                obj.setstate(state)

        return Bound(capture, put, _random_public, (view,), remember=True)

    def remembers(self, obj: Any) -> bool:
        return type(obj) is random.Random


def _random_public(obj: Any, state: Any) -> Any:
    """A ``random.Random`` state in ``getstate()`` form: records are put into a
    throw-away one and read back."""
    if type(state[0]) is not bytes:
        return state
    scratch = random.Random()
    RANDOM.bind(scratch, True).put(scratch, state)
    return scratch.getstate()


class _Numpy(Kind):
    """NumPy's two: a ``Generator`` (64-bit seed, a new bit generator's state)
    and a ``RandomState`` (32-bit, its own legacy ``seed()``)."""

    def to_plain(self, obj: Any, state: Any) -> Any:
        name = state.get("bit_generator")
        if name not in plain.BIT_GENERATORS:
            raise ValueError(
                f"its bit generator is a {name}, and a snapshot holds the state of NumPy's own "
                f"bit generators only ({', '.join(plain.BIT_GENERATORS)})"
            )
        return plain.numpy_state_to_plain(state)

    def from_plain(self, obj: Any, data: object, path: str) -> Any:
        legacy = isinstance(obj, np.random.RandomState)
        state = plain.bit_generator_state_from_plain(data, path, legacy=legacy)
        uses = type(obj._bit_generator).__name__  # a Generator's or a RandomState's
        if state["bit_generator"] != uses:
            raise ValueError(
                f"{path}.bit_generator: saved {state['bit_generator']}, but the registered RNG "
                f"uses {uses}"
            )
        return state

    def remembers(self, obj: Any) -> bool:
        return type(obj) in (np.random.Generator, np.random.RandomState)

    def views(self, obj: Any, bg: Any) -> tuple[memoryview, ...]:
        """Views over the C records of ``obj`` and its bit generator ``bg``, or ``()``."""
        return ()

    def bind(self, obj: Any, fast: bool) -> Bound:
        """On records, a state is their bytes joined, copied under the bit
        generator's lock (a draw in another thread, NumPy releasing the GIL for
        large fills, would tear the copy); with another bit generator installed
        since, the public API."""
        bg, get, set_ = obj._bit_generator, self.get, self.set
        remember, part_of = fast and self.remembers(obj), operator.attrgetter("_bit_generator")
        views = self.views(obj, bg) if fast else ()
        if not views:
            return Bound(get, set_, _as_is, (), bg, part_of, remember)
        lock, (first, *rest) = bg.lock, views
        # Each locked copy is a one-line ``with``: CPython gives the exit of a
        # ``with`` the statement's line, so with the body on another line a
        # tracer (or debugger) raising at that line event would skip the
        # release and leave NumPy's lock held for good.  And it allocates no
        # object the garbage collector tracks: a collection there runs
        # finalizers (a decorated generator's close, which captures NumPy's
        # state), and NumPy 1.x's lock is not reentrant.

        def capture(obj: Any) -> Any:
            if obj._bit_generator is not bg:
                return get(obj)
            with lock: return b"".join(views)  # noqa: E701  # fmt: skip

        def public(obj: Any, state: Any) -> Any:
            if type(state) is not bytes:
                return state
            scratch = type(obj)(type(bg)())
            self.bind(scratch, True).put(scratch, state)
            return get(scratch)

        def put_one(obj: Any, state: Any) -> None:  # a Generator: half the time of put_all's loop
            if type(state) is bytes and obj._bit_generator is bg:
                with lock: first[:] = state  # noqa: E701  # fmt: skip
            else:
                set_(obj, public(obj, state))

        def put_all(
            obj: Any, state: Any
        ) -> None:  # a RandomState: MT19937, then the gaussian cache
            if type(state) is bytes and obj._bit_generator is bg:
                fill = map(BytesIO(state).readinto, views)  # allocated before the lock
                with lock: _drain(fill)  # noqa: E701  # fmt: skip
            else:
                set_(obj, public(obj, state))

        return Bound(capture, put_all if rest else put_one, public, views, bg, part_of, remember)


class _Generator(_Numpy):
    name = "numpy.random.Generator"
    bits = 64
    fast_paths = (
        FastPath(
            "NumPy Generators: state copied as memory (PCG64, PCG64DXSM)",
            lambda: {"PCG64", "PCG64DXSM"} <= {t.__name__ for t in layouts.proven_records()},
        ),
        FastPath(
            "NumPy Generators: state copied as memory (MT19937)",
            lambda: np.random.MT19937 in layouts.proven_records(),
        ),
    )

    def get(self, obj: Any) -> Any:
        return obj.bit_generator.state

    def set(self, obj: Any, state: Any) -> None:
        obj.bit_generator.state = state

    def seed(self, obj: Any, seed: int) -> None:
        obj.bit_generator.state = type(obj.bit_generator)(seed).state

    def views(self, obj: Any, bg: Any) -> tuple[memoryview, ...]:
        if type(obj) is not np.random.Generator:
            return ()
        record = layouts.proven_records().get(type(bg))
        view = record(bg) if record is not None else None
        return () if view is None else (view,)


class _RandomState(_Numpy):
    name = "numpy.random.RandomState"
    bits = 32
    fast_paths = (
        FastPath(
            "NumPy legacy RNG: state copied as memory", lambda: layouts.NUMPY_LAYOUT is not None
        ),
    )

    def get(self, obj: Any) -> Any:
        return obj.get_state(legacy=False)

    def seed(self, obj: Any, seed: int) -> None:
        uncollected.seed_random_state(obj, seed)

    def set(self, obj: Any, state: Any) -> None:
        obj.set_state(state)

    def views(self, obj: Any, bg: Any) -> tuple[memoryview, ...]:
        layout = layouts.NUMPY_LAYOUT
        if type(obj) is not np.random.RandomState or layout is None:
            return ()
        if type(bg) is not np.random.MT19937:
            return ()
        # Its bit generator's record, then the gaussian cache.
        return layouts.mt19937_view(bg), layout.view(obj)


class _Torch(Kind):
    """``torch.Generator``, any device: no raw memory (torch's ``get_state``
    is one C copy already); a CPU one's seeded state is remembered."""

    name = "torch.Generator"
    bits = 64

    def get(self, obj: Any) -> Any:
        return uncollected.get_state(obj)

    def set(self, obj: Any, state: Any) -> None:
        obj.set_state(state)

    def seed(self, obj: Any, seed: int) -> None:
        obj.manual_seed(seed)

    def to_plain(self, obj: Any, state: Any) -> Any:
        return {"device": str(obj.device), "state": state.clone()}

    def from_plain(self, obj: Any, data: object, path: str) -> Any:
        d = _plain.fields(data, path, ["device", "state"])
        _plain.text(d["device"], f"{path}.device", choices=(str(obj.device),))
        return plain.generator_state_from_plain(d["state"], f"{path}.state", obj)

    def bind(self, obj: Any, fast: bool) -> Bound:
        """torch's own C methods, taking the object: no Python frame."""
        cls = type(obj)
        get = uncollected.get_state if uncollected.GET_STATE_COLLECTS else cls.get_state
        return Bound(get, cls.set_state, _as_is, remember=fast and self.remembers(obj))

    def remembers(self, obj: Any) -> bool:
        # Its state holds its seed and normal caches: writing it back is seeding.
        return type(obj) is torch.Generator and obj.device.type == "cpu"


RANDOM: Kind = _Random()
GENERATOR: Kind = _Generator()
RANDOM_STATE: Kind = _RandomState()
TORCH: Kind = _Torch()
#: Any object with ``seed()``, ``getstate()`` and ``setstate()``, through those
#: methods, as ``random.Random``.  Its seed is 32 bits: ``seed()`` is the
#: object's own code, and 0 .. 2**32 - 1 is what every integer-seeded generator
#: accepts (NumPy's legacy seeding, C++ ``std::mt19937``, bindings that take a
#: ``uint32_t``), where 64 bits would be refused or silently truncated by some.
RANDOM_LIKE: Kind = Kind()

#: Every kind by name, as a snapshot saves it.
BY_NAME = {kind.name: kind for kind in (RANDOM, GENERATOR, RANDOM_STATE, TORCH, RANDOM_LIKE)}
KINDS: tuple[tuple[type, Kind], ...] = (
    (random.Random, RANDOM),
    (np.random.Generator, GENERATOR),
    (np.random.RandomState, RANDOM_STATE),
    (torch.Generator, TORCH),
)


def manageable(obj: object) -> bool:
    """Whether ``obj`` is of a kind, by its class or its methods (:func:`kind_of`
    still refuses a few)."""
    return isinstance(obj, tuple(cls for cls, _ in KINDS)) or all(
        callable(getattr(obj, name, None)) for name in ("seed", "getstate", "setstate")
    )


def kind_of(obj: object) -> Kind:
    """The kind of ``obj`` for ``register_rng``; ``TypeError``/``ValueError`` says
    why an object is refused."""
    if isinstance(obj, random.SystemRandom):
        raise TypeError(
            "register_rng() cannot manage random.SystemRandom: it draws from the OS and "
            "has no state to seed or restore"
        )
    if obj is np.random.mtrand._rand or obj is getattr(random.random, "__self__", None):
        raise ValueError(
            "register_rng() is for your own RNGs: the global random and NumPy generators "
            "are managed by every block already"
        )
    if isinstance(obj, np.random.RandomState) and not isinstance(
        obj._bit_generator, np.random.MT19937
    ):
        raise TypeError(
            f"register_rng() cannot manage a RandomState over "
            f"{type(obj._bit_generator).__name__}: RandomState.seed() only re-seeds MT19937, "
            f"so blocks could not seed it; register np.random.Generator(bit_generator) instead"
        )
    for cls, kind in KINDS:
        if isinstance(obj, cls):
            return kind
    if manageable(obj):  # by its methods
        return RANDOM_LIKE
    accepted = ", ".join(k.name for _, k in KINDS)
    raise TypeError(
        f"register_rng() cannot manage {type(obj).__qualname__} {short_repr(obj)}; "
        f"accepted: {accepted}, or an object with seed(), getstate() and setstate() methods"
    )
