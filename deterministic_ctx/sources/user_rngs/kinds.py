"""The kinds of RNG that :func:`.registry.register_rng` accepts, and which
one an object is.

A :class:`Kind` is how the public API of one family of RNG reads, writes and
seeds its state, how many bits its seed has, and how its public state is
saved (:mod:`.persistence`); :func:`kind_of` picks an object's kind, or
refuses the object with the reason.  The copies of :mod:`.entries` fall back
to these, and are tested equal to them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ...base.seed import short_repr
from . import persistence as plain


class Kind(NamedTuple):
    """How the public API of one family of RNG reads, writes and seeds its
    state; ``bits``: the width of the seed ``derive_seed`` makes for it;
    ``to_plain(obj, state)`` and ``from_plain(obj, data, path)``: its public
    state as checkpoint data and back, checked (see :mod:`.persistence`).
    ``get``, ``set`` and ``seed`` default to ``random.Random``'s methods
    (``getstate()``, ``setstate()``, ``seed()``), the random-like protocol."""

    name: str
    bits: int
    to_plain: Callable[[Any, Any], Any]
    from_plain: Callable[[Any, object, str], Any]
    get: Callable[[Any], Any] = lambda o: o.getstate()
    set: Callable[[Any, Any], None] = lambda o, s: o.setstate(s)
    seed: Callable[[Any, int], None] = lambda o, s: o.seed(s)


RANDOM = Kind(
    "random.Random",
    64,
    lambda r, s: plain.random_state_to_plain(s),
    lambda r, data, path: plain.random_state_from_plain(data, path),
)
GENERATOR = Kind(
    "numpy.random.Generator",
    64,
    plain.numpy_to_plain,
    plain.numpy_from_plain,
    lambda g: g.bit_generator.state,
    lambda g, s: setattr(g.bit_generator, "state", s),
    lambda g, s: setattr(g.bit_generator, "state", type(g.bit_generator)(s).state),
)
RANDOM_STATE = Kind(  # seeded by its own seed()
    "numpy.random.RandomState",
    32,
    plain.numpy_to_plain,
    plain.numpy_from_plain,
    lambda r: r.get_state(legacy=False),
    lambda r, s: r.set_state(s),
)
TORCH = Kind(
    "torch.Generator",
    64,
    plain.torch_to_plain,
    plain.torch_from_plain,
    lambda g: g.get_state(),
    lambda g, s: g.set_state(s),
    lambda g, s: g.manual_seed(s),
)
#: Any object with ``seed()``, ``getstate()`` and ``setstate()``, through those
#: methods, as ``random.Random``.  Its seed is 32 bits: ``seed()`` is the
#: object's own code, and 0 .. 2**32 - 1 is what every integer-seeded generator
#: accepts (NumPy's legacy seeding, C++ ``std::mt19937``, bindings that take a
#: ``uint32_t``), where 64 bits would be refused or silently truncated by some.
RANDOM_LIKE = Kind("random-like", 32, plain.random_like_to_plain, plain.random_like_from_plain)

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
