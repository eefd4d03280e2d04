"""One adapter per kind of RNG, and which kind an object is.

A :class:`Kind` is everything the package knows about one family of RNG:
its public API (``get``, ``set``, ``seed``, :attr:`~Kind.bits`), its
checkpoint codec (``to_plain``/``from_plain``, :mod:`.persistence`) and its
fast paths (:attr:`Kind.fast_paths`, all off with
``DETERMINISTIC_CTX_NO_FAST_PATHS=1``), which :class:`~.entries.Entry` takes
for each object.  :func:`kind_of` picks an object's kind for
``register_rng``, or refuses the object with the reason.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ...base import plain as _plain
from ...base.fast_paths import FastPath
from ...base.seed import short_repr
from . import layouts
from . import persistence as plain

__all__ = [
    "BY_NAME",
    "C_SEED",
    "GENERATOR",
    "KINDS",
    "RANDOM",
    "RANDOM_LIKE",
    "RANDOM_STATE",
    "TORCH",
    "Kind",
    "kind_of",
    "manageable",
]


class Kind:
    """How one family of RNG is read, written, seeded and saved; this base is
    the random-like protocol (``getstate()``, ``setstate()``, ``seed()``, a
    32-bit seed: see :data:`RANDOM_LIKE`), with no fast path."""

    name = "random-like"
    bits = 32
    #: What this kind's fast paths speed up, and whether this process takes them.
    fast_paths: tuple[FastPath, ...] = ()

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

    def views(self, obj: Any) -> tuple[memoryview, ...]:
        """Views over the C records holding the state of ``obj`` (the fast
        path), or ``()``: the public API.  Only called with the fast paths on."""
        return ()

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


class _Random(Kind):
    """``random.Random``: a 64-bit seed; an exact one is copied as its
    2500-byte Mersenne Twister record (plus ``gauss_next``), and many of them
    in one batch (:class:`~.entries.MtBatch`)."""

    name = "random.Random"
    bits = 64
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

    def views(self, obj: Any) -> tuple[memoryview, ...]:
        layout = layouts.RANDOM_LAYOUT
        return (layout.view(obj),) if type(obj) is random.Random and layout is not None else ()

    def remembers(self, obj: Any) -> bool:
        return type(obj) is random.Random


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

    def views(self, obj: Any) -> tuple[memoryview, ...]:
        if type(obj) is not np.random.Generator:
            return ()
        bg = obj.bit_generator
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

    def set(self, obj: Any, state: Any) -> None:
        obj.set_state(state)

    def views(self, obj: Any) -> tuple[memoryview, ...]:
        layout, bg = layouts.NUMPY_LAYOUT, obj._bit_generator
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
        return obj.get_state()

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
