"""Python's global ``random`` module: Mersenne Twister state and gaussian cache."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from ..base import plain as _plain
from ..base.fast_paths import ENABLED, FastPath
from ..base.settings import Settings
from ._base import Reseeder
from ._seeded import SeededCache
from .rngs.entries import Entry
from .rngs.kinds import C_SEED, RANDOM

__all__ = ["PythonRandomSource"]

#: The ``(record, None)`` state ``random.Random.seed(seed)`` produces, by seed.
_SEEDED: SeededCache[tuple[bytes, None]] = SeededCache()


class PythonRandomSource:
    """The hidden ``random.Random`` instance behind ``random.random()`` & co.,
    declared as one object of the ``random.Random`` kind (:mod:`.rngs.kinds`),
    captured and restored as a registered one is: ``(2500-byte C record,
    gauss_next)`` on the fast path, else ``random.getstate()``."""

    name = "random"
    device_type: str | None = None  # not a device generator: saved under "sources"
    applies_nothing = False
    fast_paths = (
        *RANDOM.fast_paths[:1],
        FastPath("random: the state seeding left remembered per seed", lambda: True),
        FastPath(
            "random: reseeded per step by its C seeding, without the per-seed cache", lambda: True
        ),
    )

    def __init__(self, rng: random.Random | None = None, *, fast: bool = ENABLED) -> None:
        # Module-level functions are bound methods of this instance, so it is the
        # one to manage even if someone rebinds ``random._inst``.
        bound: random.Random = getattr(random.random, "__self__")  # noqa: B009 - untyped attribute
        self._rng = rng if rng is not None else bound
        self._fast = fast
        # Records only for an exact ``random.Random``: a subclass's own
        # ``seed()`` and ``setstate()`` run, and its seeding never enters the
        # shared cache.  The instance lives as long as this source.
        self._entry = entry = Entry(self._rng, self.name, RANDOM, fast=fast)
        #: ``capture()`` and ``restore(state)``: the entry's, bound to the generator.
        self.capture = partial(entry.capture, self._rng)
        self.restore = partial(entry.put, self._rng)
        # Only the module's own generator is checked for being rebound.
        self._warned: object = self._rng if rng is None else None

    def apply(self, settings: Settings) -> None:
        bound = getattr(random.random, "__self__", None)
        if bound is not self._rng and self._warned is not None and bound is not self._warned:
            # ``random.random = other.random`` (a test double, a library's own
            # instance) makes ``random.random()`` draw from an object blocks do
            # not seed, so every later block would silently stop being
            # reproducible: say so, once per rebinding.
            self._warned = bound
            _plain.warn(
                "random.random is no longer a method of the random module's own generator, "
                "so deterministic blocks do not seed or restore what it draws; put it back "
                "(random.random = random._inst.random) or register the new generator with "
                "register_rng()"
            )
        # Exactly ``seed(seed)``: seeding runs ``init_by_array`` over 624 words
        # (~3.5 µs); the record it left for a seed seen before is one copy.
        self._entry.seed_exactly(self._rng, settings.rank_seed, _SEEDED)

    def reseeder(self) -> Reseeder | None:
        """``random.seed(rank_seed)`` as the C seeding and ``gauss_next = None``
        (what the method does for an int), for an exact ``random.Random``; else
        (a subclass, whose own ``seed()`` must run; the fast paths off) ``None``."""
        rng = self._rng
        if not self._fast or type(rng) is not random.Random:
            return None
        c_seed = C_SEED

        def reseed(seed: int, rank_seed: int) -> None:
            c_seed(rng, rank_seed)
            rng.gauss_next = None  # type: ignore[attr-defined]

        return reseed

    def export_state(self, state: Any) -> dict[str, Any]:
        """The state as plain data for a checkpoint (``{"state": [625 ints], "gauss_next"}``)."""
        plain: dict[str, Any] = RANDOM.to_plain(self._rng, self._entry.public(self._rng, state))
        return plain

    def import_state(self, data: object, path: str) -> tuple[Any, ...]:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The state is kept in ``getstate()`` form, so ``restore`` goes through
        ``random.setstate``, which checks it again, never through raw memory.
        """
        result: tuple[Any, ...] = RANDOM.from_plain(self._rng, data, path)
        return result
