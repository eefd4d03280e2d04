"""Python's global ``random`` module: Mersenne Twister state and gaussian cache."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from .._settings import Settings
from ._memory import RANDOM_LAYOUT, MTLayout

__all__ = ["PythonRandomSource", "PythonRandomState"]


@dataclass(frozen=True)
class PythonRandomState:
    """``raw`` is the 2500-byte C record (fast path) or ``getstate()[1]``."""

    raw: bytes | tuple[int, ...]
    gauss_next: float | None


@functools.lru_cache(maxsize=64)
def _seeded_raw(layout: MTLayout, seed: int) -> bytes:
    # Seeding runs init_by_array over 624 words (~3.5 µs); a cached record is a memmove.
    return layout.read(random.Random(seed))


class PythonRandomSource:
    """The hidden ``random.Random`` instance behind ``random.random()`` & co."""

    name = "random"

    def __init__(self, rng: random.Random | None = None, layout: MTLayout | None = RANDOM_LAYOUT):
        # Module-level functions are bound methods of this instance, so it is the
        # one to manage even if someone rebinds ``random._inst``.
        self._rng: random.Random = rng if rng is not None else random.random.__self__  # type: ignore[assignment]
        self._layout = layout if isinstance(self._rng, random.Random) else None

    def capture(self) -> PythonRandomState:
        rng = self._rng
        if self._layout is not None:
            return PythonRandomState(self._layout.read(rng), rng.gauss_next)  # type: ignore[attr-defined]
        version, internal, gauss_next = rng.getstate()
        return PythonRandomState(internal, gauss_next)

    def restore(self, state: PythonRandomState) -> None:
        rng = self._rng
        if isinstance(state.raw, bytes):
            if self._layout is None:
                raise ValueError("random state was captured through the fast path, which is off")
            self._layout.write(rng, state.raw)
            rng.gauss_next = state.gauss_next  # type: ignore[attr-defined]
        else:
            rng.setstate((3, state.raw, state.gauss_next))

    def apply(self, settings: Settings) -> None:
        if self._layout is not None:
            self._layout.write(self._rng, _seeded_raw(self._layout, settings.seed))
            self._rng.gauss_next = None  # type: ignore[attr-defined]
        else:
            self._rng.seed(settings.seed)

    def to_public(self, state: PythonRandomState) -> tuple[Any, ...]:
        """The state in ``random.getstate()`` form, whichever path captured it."""
        if isinstance(state.raw, bytes):
            import struct

            index, *words = struct.unpack("=i624I", state.raw)
            return (3, (*words, index), state.gauss_next)
        return (3, state.raw, state.gauss_next)
