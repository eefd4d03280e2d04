"""NumPy's legacy global RNG (``np.random.seed``, ``np.random.rand``, …).

The state is: which bit generator is installed (``np.random.set_bit_generator``
can replace it), that bit generator's state, and the ``RandomState``'s legacy
gaussian cache (``has_gauss``/``gauss``), which changes what the next
``np.random.randn()`` returns.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from ..base.settings import Settings
from . import _plain
from ._memory import NUMPY_LAYOUT, Layout, mt19937_view
from ._seeded import SeededCache

__all__ = [
    "BIT_GENERATORS",
    "NumpyGlobalSource",
    "NumpyState",
    "bit_generator_state_from_plain",
    "numpy_state_to_plain",
]

# Public since NumPy 1.25, missing from its type stubs.
_set_bit_generator: Any = np.random.set_bit_generator  # type: ignore[attr-defined]


#: Builds a NamedTuple from a tuple without the class's Python ``__new__``.
_new = tuple.__new__

_NO_GAUSS = bytes(16)  # has_gauss = 0, padding, gauss = 0.0


#: The MT19937 record legacy seeding (``np.random.seed``) produces, by seed.
_SEEDED: SeededCache[bytes] = SeededCache()


class NumpyState(NamedTuple):
    """``raw`` holds ``(mt19937 record, gauss record)`` on the fast path, else
    the dict of ``RandomState.get_state(legacy=False)``."""

    bit_generator: Any
    raw: tuple[bytes, bytes] | dict[str, Any]


def _free_global_lock_in_child() -> None:
    """Free the global bit generator's lock in a forked child if a thread that
    does not exist there held it at the fork (it was drawing, or a block was
    copying its state): otherwise the child's first draw would wait forever.

    Registered with ``os.register_at_fork`` when this module is imported,
    before the block engine registers its own hook, so it runs first: that
    hook may restore NumPy's state, which takes this lock.
    """
    lock = getattr(np.random.mtrand._rand._bit_generator, "lock", None)
    # ``_is_owned`` (Python >= 3.11 for plain locks, NumPy 1.x's kind): without it, a
    # lock held here is taken for a dead thread's, since the forking thread cannot
    # be inside a draw or a state copy while it forks.
    owned = getattr(lock, "_is_owned", None)
    if lock is None or not hasattr(lock, "_at_fork_reinit") or (owned is not None and owned()):
        return
    if lock.acquire(False):
        lock.release()
    else:
        lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_global_lock_in_child)


class NumpyGlobalSource:
    """The ``RandomState`` singleton behind the ``np.random.*`` functions."""

    name = "numpy"
    device_type: str | None = None  # not a device generator: saved under "sources"

    def __init__(
        self,
        rs: np.random.RandomState | None = None,
        layout: Layout | None = NUMPY_LAYOUT,
    ) -> None:
        self._rs: np.random.RandomState = rs if rs is not None else np.random.mtrand._rand
        self._layout = layout if type(self._rs) is np.random.RandomState else None
        # The RandomState lives as long as this source: one view for good.
        self._gauss = self._layout.view(self._rs) if self._layout is not None else None
        #: ``(bit generator, its views or None)``: the path chosen for the bit
        #: generator installed last, replaced whole (another thread may read it).
        self._cache: tuple[Any, tuple[memoryview, memoryview] | None] = (None, None)

    def _views(self, bit_generator: Any) -> tuple[memoryview, memoryview] | None:
        """Views over ``bit_generator``'s MT19937 record and the gaussian cache
        (see :mod:`._memory`), or ``None`` where the fast path is off for it.
        Chosen once per bit generator; the cache holds it, so the memory under
        the views stays alive."""
        cached = self._cache
        if cached[0] is not bit_generator:
            gauss = self._gauss
            views = None
            if gauss is not None and type(bit_generator) is np.random.MT19937:
                views = (mt19937_view(bit_generator), gauss)
            self._cache = cached = (bit_generator, views)
        return cached[1]

    def capture(self) -> NumpyState:
        rs = self._rs
        bg = rs._bit_generator
        views = self._views(bg)
        if views is not None:
            mt, gauss = views
            # The bit generator's lock keeps a draw in another thread (NumPy
            # releases the GIL for large fills) from tearing the copy.  Each
            # locked copy is a one-line ``with``: CPython gives the exit of a
            # ``with`` the statement's line, so with the body on another line
            # a tracer (or debugger) raising at that line event would skip the
            # release and leave NumPy's lock held for good.
            # (``tuple.__new__``: NumpyState(...) without its Python ``__new__``.)
            with bg.lock: return _new(NumpyState, (bg, (bytes(mt), bytes(gauss))))  # noqa: E701  # fmt: skip
        return NumpyState(bg, rs.get_state(legacy=False))

    def restore(self, state: NumpyState) -> None:
        rs = self._rs
        bg = state.bit_generator
        if rs._bit_generator is not bg:
            _set_bit_generator(bg)
        if isinstance(state.raw, tuple):
            views = self._views(bg)
            assert views is not None  # only this source's own capture holds records
            mt, gauss = views
            raw_mt, raw_gauss = state.raw
            with bg.lock: mt[:], gauss[:] = raw_mt, raw_gauss  # noqa: E701  # fmt: skip
        else:
            rs.set_state(state.raw)

    def apply(self, settings: Settings) -> None:
        rs = self._rs
        if type(rs._bit_generator) is not np.random.MT19937:
            # ``np.random.seed`` only works on MT19937; inside a block the global
            # RNG is exactly the classic legacy-seeded one.  Restore reinstalls
            # the user's bit generator.
            _set_bit_generator(np.random.MT19937(0))
        bg = rs._bit_generator
        views = self._views(bg)
        seed = settings.rank_seed
        # Exactly ``np.random.seed(seed)``: the record it left for a seed seen
        # before and a cleared gaussian cache, as two copies.
        if views is not None and (raw := _SEEDED.lookup(seed)) is not None:
            mt, gauss = views
            with bg.lock: mt[:], gauss[:] = raw, _NO_GAUSS  # noqa: E701  # fmt: skip
            return
        rs.seed(seed)  # legacy seeding; also clears the gaussian cache
        if views is not None:  # remembered (a 2.5 KB read)
            with bg.lock: _SEEDED.offer(seed, views[0].tobytes)  # noqa: E701  # fmt: skip

    def to_public(self, state: NumpyState) -> dict[str, Any]:
        """The state in ``RandomState.get_state(legacy=False)`` form: a copied
        record is written into a throw-away ``RandomState`` that NumPy then reads."""
        if isinstance(state.raw, dict):
            return state.raw
        assert self._layout is not None  # a copied record came through the views
        rs = np.random.RandomState()
        mt19937_view(rs._bit_generator)[:], self._layout.view(rs)[:] = state.raw
        return rs.get_state(legacy=False)

    def export_state(self, state: NumpyState) -> dict[str, Any]:
        """The state as plain data for a checkpoint: ``get_state(legacy=False)``
        with arrays as lists of ints."""
        return numpy_state_to_plain(self.to_public(state))

    def import_state(self, data: object, path: str) -> NumpyState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The bit generator installed now is kept if it is of the saved type
        (others may hold it through ``np.random.get_bit_generator()``);
        otherwise a new one of that type is installed on restore.  The state
        is kept in dict form, so ``restore`` goes through ``set_state``.
        """
        public = bit_generator_state_from_plain(data, path, legacy=True)
        cls = getattr(np.random, public["bit_generator"])  # a name from BIT_GENERATORS
        current = self._rs._bit_generator
        return NumpyState(current if type(current) is cls else cls(), public)


_U32, _U64, _U128 = 2**32 - 1, 2**64 - 1, 2**128 - 1
#: field -> (array length, or None for a scalar int; largest value)
_Fields = dict[str, tuple[int | None, int]]
_BUFFERED: _Fields = {"has_uint32": (None, 1), "uinteger": (None, _U32)}
#: The state of each bit generator that NumPy ships: ``(state["state"], the rest)``.
#: ``pos`` and ``buffer_pos`` index C arrays, and NumPy's setters do not check
#: them: out of range, the next draw reads outside the generator's memory.
BIT_GENERATORS: dict[str, tuple[_Fields, _Fields]] = {
    "MT19937": ({"key": (624, _U32), "pos": (None, 624)}, {}),
    "PCG64": ({"state": (None, _U128), "inc": (None, _U128)}, _BUFFERED),
    "PCG64DXSM": ({"state": (None, _U128), "inc": (None, _U128)}, _BUFFERED),
    "Philox": (
        {"counter": (4, _U64), "key": (2, _U64)},
        {"buffer": (4, _U64), "buffer_pos": (None, 4), **_BUFFERED},
    ),
    "SFC64": ({"state": (4, _U64)}, _BUFFERED),
}
_LEGACY: _Fields = {"has_gauss": (None, 1)}


def numpy_state_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    """A bit generator's ``state`` dict (or ``RandomState.get_state(legacy=False)``)
    with arrays turned into lists of ints and NumPy scalars into Python ones."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        # An array's tolist() is a list of Python ints, a NumPy scalar's a Python scalar.
        return value.tolist() if isinstance(value, np.ndarray | np.generic) else value

    result: dict[str, Any] = plain(state)
    return result


def _read(data: object, path: str, spec: _Fields, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    d = _plain.fields(data, path, [*spec, *extra])
    out: dict[str, Any] = {}
    for name, (length, hi) in spec.items():
        where = f"{path}.{name}"
        if length is None:
            out[name] = _plain.integer(d[name], where, 0, hi)
        else:
            values = _plain.integers(d[name], where, length, 0, hi)
            out[name] = np.array(values, dtype=np.uint32 if hi == _U32 else np.uint64)
    return out


def bit_generator_state_from_plain(
    data: object, path: str, *, legacy: bool = False
) -> dict[str, Any]:
    """The checked inverse of :func:`numpy_state_to_plain`, ready for
    ``bit_generator.state = ...`` (or, with ``legacy``, ``RandomState.set_state``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict, got {type(data).__name__}")
    name = _plain.text(data.get("bit_generator"), f"{path}.bit_generator", choices=BIT_GENERATORS)
    inner, outer = BIT_GENERATORS[name]
    outer = {**outer, **_LEGACY} if legacy else outer
    extra = ("bit_generator", "state", "gauss") if legacy else ("bit_generator", "state")
    rest = _read(data, path, outer, extra)  # checks the whole key set
    public = {"bit_generator": name, "state": _read(data["state"], f"{path}.state", inner), **rest}
    if legacy:
        public["gauss"] = _plain.real(data["gauss"], f"{path}.gauss")
    try:  # NumPy's own checks, on a throw-away generator
        probe = getattr(np.random, name)()
        if legacy:
            np.random.RandomState(probe).set_state(public)
        else:
            probe.state = public
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise ValueError(f"{path}: NumPy rejects the {name} state ({exc})") from exc
    return public
