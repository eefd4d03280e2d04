"""Where RNG objects keep their state in memory: the only module that
touches RNG memory directly, for the kinds' fast paths (:mod:`.kinds`).

Nothing here is probed or used with ``DETERMINISTIC_CTX_NO_FAST_PATHS=1``
(:mod:`deterministic_ctx.base.fast_paths`).

**Raw memory.**  Copying the 2.5 KB of a Mersenne Twister through a view
costs ~0.3 µs.  Through the public APIs, measured here (torch 2.13 CPU, NumPy
2, on a loaded 2-core machine, so absolute figures are high):
``random.Random.getstate()`` + ``setstate()`` 15 µs against 0.3 µs for the
two copies; NumPy's ``RandomState.get_state()`` + ``set_state()`` 144 µs
(``bit_generator.state`` get + set: 132 µs) against 1.8 µs for the two
locked copies of the MT19937 record and the gaussian cache; a block with
four registered PCG64 Generators (``np.random.default_rng()``) 42 µs with
their records copied, 62 µs through ``bit_generator.state`` (with none: 33
µs; medians of 11, CPU time, 2026-11-27).

We never assume a layout: each is *probed* once, on throw-away objects, by
comparing the raw bytes with what the public API reports and by writing bytes
and reading them back through the API.  Any mismatch, a non-CPython
interpreter or an unexpected type disables that path for good, and the
sources take the exact public API.  Addresses come from NumPy's documented
``BitGenerator.ctypes.state_address`` where NumPy has one (every bit
generator's record); only two layouts are found from ``id()``, because their
owners document none: CPython's ``random.Random`` record
(:data:`RANDOM_LAYOUT`) and NumPy's legacy gaussian cache in a
``RandomState`` (:data:`NUMPY_LAYOUT`).  Reads and writes stay inside the
object's ``__basicsize__`` (or the bit generator's state struct).
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...base.fast_paths import ENABLED

__all__ = [
    "NUMPY_LAYOUT",
    "RANDOM_LAYOUT",
    "Layout",
    "PcgRecord",
    "mt19937_view",
    "proven_records",
]

#: The 32-bit words of a Mersenne Twister state.
MT_WORDS = 624
#: ``int index; uint32_t state[624]`` (CPython) and ``uint32_t key[624]; int pos``
#: (NumPy) are both 2500 bytes.
MT_BYTES = 4 + 4 * MT_WORDS
_HEAD = object.__basicsize__  # PyObject_HEAD
_POINTER = struct.calcsize("@P")


def _is_cpython() -> bool:
    # id() is an address only on CPython; the free-threaded build has another header.
    gil_check = getattr(sys, "_is_gil_enabled", None)
    free_threaded = gil_check is not None and not gil_check()
    return sys.implementation.name == "cpython" and not free_threaded


def _view(address: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``address``.

    Reading (``bytes(view)``) and writing (``view[:] = raw``) are single C
    copies that hold the GIL: no Python thread can draw half-way through one,
    a fork cannot split one, and unlike ``ctypes.memmove`` (which releases the
    GIL and converts its arguments in Python, failing with ``ArgumentError``
    near the recursion limit) no Python code runs.  The view does not keep
    the object alive: only use it while something else does.
    """
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


# -- CPython's random.Random -------------------------------------------------------


class Layout(NamedTuple):
    """Where an object keeps a record its owner documents no address for:
    ``size`` bytes at ``id(obj) + offset``.  Two are probed: CPython's
    ``random.Random`` keeps its Mersenne Twister state there (:data:`RANDOM_LAYOUT`),
    NumPy's ``RandomState`` its legacy gaussian cache (:data:`NUMPY_LAYOUT`:
    ``has_gauss``, a C int, and ``gauss``, a double, together in the object's
    ``aug_bitgen_t``, read and written as one 16-byte record: NumPy has no public
    accessor but ``get_state()``, which builds the whole 624-word state; see the
    module docstring)."""

    offset: int
    size: int

    def view(self, obj: object) -> memoryview:
        """The record of ``obj`` (see :func:`_view`)."""
        return _view(id(obj) + self.offset, self.size)


def _probe_random() -> Layout | None:
    base = random.Random.__mro__[1]  # _random.Random, the C type holding the state
    if not _is_cpython() or base.__basicsize__ < _HEAD + MT_BYTES:
        return None
    layout = Layout(_HEAD, MT_BYTES)
    try:
        a = random.Random(20_240_521)
        a.random()  # move the index away from its seeded value
        raw = bytes(layout.view(a))
        index, *words = struct.unpack(f"=i{MT_WORDS}I", raw)
        if (*words, index) != a.getstate()[1]:
            return None
        b = random.Random(7)
        layout.view(b)[:] = raw
        if b.getstate()[1] != a.getstate()[1] or b.random() != a.random():
            return None
    except Exception:
        return None
    return layout


# -- NumPy ---------------------------------------------------------------------------


def mt19937_view(bit_generator: Any) -> memoryview:
    """The ``key[624], pos`` record of an MT19937 bit generator, at NumPy's
    documented ``ctypes.state_address`` (see :func:`_view`)."""
    return _view(bit_generator.ctypes.state_address, MT_BYTES)


def _probe_numpy() -> Layout | None:
    if not _is_cpython() or type(np.random.mtrand._rand) is not np.random.RandomState:
        return None

    def public(rs: np.random.RandomState) -> tuple[Any, ...]:
        s = rs.get_state(legacy=False)
        return s["state"]["key"].tolist(), s["state"]["pos"], s["has_gauss"], s["gauss"]

    try:
        size = np.random.RandomState.__basicsize__
        rs = np.random.RandomState(np.random.MT19937(5))
        rs.random()  # move the position away from its seeded value
        # 1. find the gaussian cache by planting a distinctive value
        marker = 1234.5678901234567
        state = rs.get_state(legacy=False)
        state["has_gauss"], state["gauss"] = 1, marker
        rs.set_state(state)
        memory = ctypes.string_at(id(rs), size)
        packed = struct.pack("=d", marker)
        hits = [i for i in range(_HEAD, size - 7) if memory[i : i + 8] == packed]
        if len(hits) != 1 or hits[0] - 8 < _HEAD:
            return None
        layout = Layout(hits[0] - 8, 16)
        # 2. both records copied into another RandomState give it the same
        # public state and the same draws, the cached gaussian first
        other = np.random.RandomState(np.random.MT19937(9))
        layout.view(other)[:] = layout.view(rs)
        mt19937_view(other._bit_generator)[:] = mt19937_view(rs._bit_generator)
        if public(other) != public(rs) or other.standard_normal() != marker:
            return None
        if rs.standard_normal() != marker or other.random(3).tolist() != rs.random(3).tolist():
            return None
        # 3. a cleared cache record is an empty cache
        layout.view(other)[:] = bytes(16)
        if other.get_state(legacy=False)["has_gauss"] != 0:
            return None
    except Exception:
        return None
    return layout


class PcgRecord(NamedTuple):
    """The state of a PCG64 / PCG64DXSM bit generator as one C record.

    At ``state_address`` NumPy keeps ``{pcg64_random_t *pcg_state; int
    has_uint32; uint32_t uinteger}``; the pointer leads to ``{state, inc}``,
    two native 128-bit integers inside the same object, ``gap`` bytes after
    ``state_address``.  The record is everything from ``has_uint32`` to the
    end of ``inc`` (padding included), and *not* the pointer: it is the same
    for every object of the type, so a record can be written to any of them.
    Kept because it is measured: a registered Generator costs a block ~2.4 µs
    this way, ~7.4 µs through ``bit_generator.state`` (module docstring).
    """

    gap: int

    def view(self, bg: Any) -> memoryview | None:
        """The record of ``bg``, or ``None`` if this object is laid out otherwise."""
        address = int(bg.ctypes.state_address)
        (pointer,) = struct.unpack("@P", ctypes.string_at(address, _POINTER))
        start, end = address + _POINTER, address + self.gap + 32
        if pointer != address + self.gap or address <= id(bg):
            return None
        if end > id(bg) + type(bg).__basicsize__:
            return None
        return _view(start, end - start)


def probe_pcg(cls: type) -> PcgRecord | None:
    """The record layout of ``cls``, proven on throw-away objects, or ``None``:
    a record copied into another object gives it the same public state and
    the same draws, before and after drawing."""
    if not _is_cpython():
        return None
    try:
        a = cls(20_240_521)
        state = a.state
        state["has_uint32"], state["uinteger"] = 1, 0x9E37_79B9  # a buffered half-draw
        a.state = state
        address = int(a.ctypes.state_address)
        (pointer,) = struct.unpack("@P", ctypes.string_at(address, _POINTER))
        layout = PcgRecord(pointer - address)
        if layout.gap < _POINTER + 8:
            return None
        ga, gb = np.random.Generator(a), np.random.Generator(cls(7))
        for _ in range(2):  # the buffered half first, then fresh draws
            view_a, view_b = layout.view(a), layout.view(gb.bit_generator)
            if view_a is None or view_b is None:
                return None
            view_b[:] = view_a
            if gb.bit_generator.state != a.state:
                return None
            if ga.integers(0, 2**32, dtype=np.uint32) != gb.integers(0, 2**32, dtype=np.uint32):
                return None
            if ga.random(3).tolist() != gb.random(3).tolist():
                return None
    except Exception:
        return None
    return layout


#: Exact bit-generator type -> how to view its record (``None``: another layout);
#: absent: the public ``state`` API.  Probed by :func:`proven_records` when the
#: first NumPy Generator is registered, not at import (a few ms).
_RECORDS: dict[type, Callable[[Any], memoryview | None]] | None = None


def proven_records() -> dict[type, Callable[[Any], memoryview | None]]:
    """The bit-generator types whose record registered Generators copy, and
    how to view it (empty with the fast paths off)."""
    global _RECORDS
    if _RECORDS is None:
        found: dict[type, Callable[[Any], memoryview | None]] = {}
        for cls in (np.random.PCG64, np.random.PCG64DXSM) if ENABLED else ():
            if (layout := probe_pcg(cls)) is not None:
                found[cls] = layout.view
        if NUMPY_LAYOUT is not None:  # _probe_numpy proved the MT19937 record
            found[np.random.MT19937] = mt19937_view
        _RECORDS = found
    return _RECORDS


#: ``None`` where the fast paths are off, or the layout could not be proven.
RANDOM_LAYOUT: Layout | None = _probe_random() if ENABLED else None
NUMPY_LAYOUT: Layout | None = _probe_numpy() if ENABLED else None
