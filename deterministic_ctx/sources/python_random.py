"""Python's global ``random`` module: Mersenne Twister state and gaussian cache."""

from __future__ import annotations

import random
import struct
from typing import Any, NamedTuple

from ..base.settings import Settings
from . import _plain
from ._memory import MT_WORDS, RANDOM_LAYOUT, Layout
from ._seeded import SeededCache

__all__ = [
    "PythonRandomSource",
    "PythonRandomState",
    "random_state_from_plain",
    "random_state_to_plain",
]

class PythonRandomState(NamedTuple):
    """``raw`` is the 2500-byte C record (fast path) or ``getstate()[1]``."""

    raw: bytes | tuple[int, ...]
    gauss_next: float | None


#: The 2500-byte record ``random.Random.seed(seed)`` produces, by seed.
_SEEDED: SeededCache[bytes] = SeededCache()


class PythonRandomSource:
    """The hidden ``random.Random`` instance behind ``random.random()`` & co."""

    name = "random"
    device_type: str | None = None  # not a device generator: saved under "sources"

    def __init__(
        self, rng: random.Random | None = None, layout: Layout | None = RANDOM_LAYOUT
    ) -> None:
        # Module-level functions are bound methods of this instance, so it is the
        # one to manage even if someone rebinds ``random._inst``.
        bound: random.Random = getattr(random.random, "__self__")  # noqa: B009 - untyped attribute
        self._rng = rng if rng is not None else bound
        # The record's layout is the C type's, subclasses included (their
        # state is copied as memory too, but seeded by their own ``seed()``);
        # the instance lives as long as this source, so the view stays valid.
        self._view = (
            layout.view(self._rng) if layout and isinstance(self._rng, random.Random) else None
        )
        # ``seed()`` through the record only for an exact ``random.Random``: a
        # subclass's may differ, and its result must not enter the shared cache.
        self._exact = self._view is not None and type(self._rng) is random.Random
        # Only the module's own generator is checked for being rebound.
        self._warned: object = self._rng if rng is None else None

    def capture(self) -> PythonRandomState:
        view = self._view
        if view is not None:
            # PythonRandomState(...) without its Python ``__new__``.
            return tuple.__new__(PythonRandomState, (bytes(view), self._rng.gauss_next))  # type: ignore[attr-defined]
        _version, internal, gauss_next = self._rng.getstate()
        return PythonRandomState(internal, gauss_next)

    def restore(self, state: PythonRandomState) -> None:
        if type(state.raw) is bytes:
            view = self._view
            assert view is not None  # only this source's own capture holds a record
            view[:] = state.raw
            self._rng.gauss_next = state.gauss_next  # type: ignore[attr-defined]
        else:
            self._rng.setstate((3, state.raw, state.gauss_next))

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
        seed = settings.rank_seed
        if not self._exact:
            self._rng.seed(seed)
            return
        # Exactly ``seed(seed)``: seeding runs ``init_by_array`` over 624 words
        # (~3.5 µs); the record it left for a seed seen before is one copy.
        view = self._view
        assert view is not None
        raw = _SEEDED.lookup(seed)
        if raw is None:
            random.Random.seed(self._rng, seed)  # a miss costs a 2.5 KB read more
            _SEEDED.offer(seed, view.tobytes)
        else:
            view[:] = raw
            self._rng.gauss_next = None  # type: ignore[attr-defined]

    @staticmethod
    def to_public(state: PythonRandomState) -> tuple[Any, ...]:
        """The state in ``random.getstate()`` form, whichever path captured it."""
        if isinstance(state.raw, bytes):
            index, *words = struct.unpack(f"=i{MT_WORDS}I", state.raw)
            return (3, (*words, index), state.gauss_next)
        return (3, state.raw, state.gauss_next)

    def export_state(self, state: PythonRandomState) -> dict[str, Any]:
        """The state as plain data for a checkpoint (see :func:`random_state_to_plain`)."""
        return random_state_to_plain(self.to_public(state))

    def import_state(self, data: object, path: str) -> PythonRandomState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The state is kept in ``getstate()`` form, so ``restore`` goes through
        ``random.setstate``, which checks it again, never through raw memory.
        """
        _version, internal, gauss_next = random_state_from_plain(data, path)
        return PythonRandomState(internal, gauss_next)


def random_state_to_plain(public: tuple[Any, ...]) -> dict[str, Any]:
    """``random.getstate()`` as ``{"state": [625 ints], "gauss_next": float}``.

    ``gauss_next`` is left out when it is ``None`` (a checkpoint holds no ``None``).
    """
    _version, internal, gauss_next = public
    out: dict[str, Any] = {"state": list(internal)}
    if gauss_next is not None:
        out["gauss_next"] = float(gauss_next)
    return out


def random_state_from_plain(data: object, path: str) -> tuple[Any, ...]:
    """The checked inverse of :func:`random_state_to_plain`, in ``getstate()`` form."""
    d = _plain.fields(data, path, ["state"], ["gauss_next"])
    words = _plain.integers(d["state"], f"{path}.state", MT_WORDS + 1, 0, 2**32 - 1)
    _plain.integer(words[-1], f"{path}.state[{MT_WORDS}] (the index)", 0, MT_WORDS)
    gauss = _plain.real(d["gauss_next"], f"{path}.gauss_next") if "gauss_next" in d else None
    public = (3, tuple(words), gauss)
    try:  # CPython's own check, on a throw-away generator
        random.Random().setstate(public)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{path}: random.setstate() rejects the state ({exc})") from exc
    return public
