"""The C records of NumPy bit generators that entries copy as raw memory.

A record is the part of a bit generator's C struct that is its whole state.
Its layout is taken as known only where it was proven on throw-away objects
(:func:`probe_pcg`, and :mod:`.._memory` for MT19937): read back as the public
``state`` says, written to another object that then draws alike.  A type
without a proven record takes the public ``state`` API (see :mod:`.entries`).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, NamedTuple

import numpy as np

from .._memory import NUMPY_LAYOUT, is_cpython, mt19937_view
from .._memory import view as _memory_view

_POINTER = struct.calcsize("@P")


class PcgRecord(NamedTuple):
    """The state of a PCG64 / PCG64DXSM bit generator as one C record.

    At ``state_address`` NumPy keeps ``{pcg64_random_t *pcg_state; int
    has_uint32; uint32_t uinteger}``; the pointer leads to ``{state, inc}``,
    two native 128-bit integers inside the same object, ``gap`` bytes after
    ``state_address``.  The record is everything from ``has_uint32`` to the
    end of ``inc`` (padding included), and *not* the pointer: it is the same
    for every object of the type, so a record can be written to any of them.
    """

    name: str
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
        return _memory_view(start, end - start)

    def decode(self, raw: bytes) -> dict[str, Any]:
        """The record as ``bit_generator.state``."""
        has_uint32, uinteger = struct.unpack_from("=iI", raw)
        at = self.gap - _POINTER
        return {
            "bit_generator": self.name,
            "state": {
                "state": int.from_bytes(raw[at : at + 16], "little"),
                "inc": int.from_bytes(raw[at + 16 : at + 32], "little"),
            },
            "has_uint32": has_uint32,
            "uinteger": uinteger,
        }


class MtRecord(NamedTuple):
    """An MT19937 bit generator's ``key[624], pos`` (proven in :mod:`._memory`)."""

    name: str = "MT19937"

    def view(self, bg: Any) -> memoryview | None:
        return mt19937_view(bg)

    def decode(self, raw: bytes) -> dict[str, Any]:
        *key, pos = struct.unpack("=624Ii", raw)
        return {
            "bit_generator": "MT19937",
            "state": {"key": np.array(key, dtype=np.uint32), "pos": pos},
        }


def probe_pcg(cls: type) -> PcgRecord | None:
    """The record layout of ``cls``, proven on throw-away objects, or ``None``."""
    if not is_cpython():
        return None
    try:
        a = cls(20_240_521)
        state = a.state
        state["has_uint32"], state["uinteger"] = 1, 0x9E37_79B9  # a buffered half-draw
        a.state = state
        address = int(a.ctypes.state_address)
        (pointer,) = struct.unpack("@P", ctypes.string_at(address, _POINTER))
        layout = PcgRecord(cls.__name__, pointer - address)
        if layout.gap < _POINTER + 8:
            return None
        view_a = layout.view(a)
        # 1. the record reads as the public state says
        if view_a is None or layout.decode(bytes(view_a)) != a.state:
            return None
        # 2. another object given the record has that state and draws the same
        b = cls(7)
        view_b = layout.view(b)
        if view_b is None:
            return None
        view_b[:] = bytes(view_a)
        if b.state != a.state:
            return None
        ga, gb = np.random.Generator(a), np.random.Generator(b)
        for _ in range(2):  # the buffered half first, then a fresh draw
            if ga.integers(0, 2**32, dtype=np.uint32) != gb.integers(0, 2**32, dtype=np.uint32):
                return None
        if ga.random(3).tolist() != gb.random(3).tolist():
            return None
        # 3. the record follows the state through draws
        if layout.decode(bytes(view_b)) != b.state:
            return None
    except Exception:
        return None
    return layout


#: Exact bit-generator type -> its proven record; absent: the public ``state`` API.
#: Probed by :func:`proven_records` when the first NumPy Generator is registered, not
#: at import (the probes build throw-away generators: a few ms).
_RECORDS: dict[type, PcgRecord | MtRecord] | None = None


def proven_records() -> dict[type, PcgRecord | MtRecord]:
    global _RECORDS
    if _RECORDS is None:
        _RECORDS = {
            cls: record
            for cls, record in (
                (np.random.PCG64, probe_pcg(np.random.PCG64)),
                (np.random.PCG64DXSM, probe_pcg(np.random.PCG64DXSM)),
                (np.random.MT19937, MtRecord() if NUMPY_LAYOUT is not None else None),
            )
            if record is not None
        }
    return _RECORDS
