"""Validated direct-memory copies of RNG state: the fast paths.

Copying the 2.5 KB of a Mersenne Twister with ``memmove`` costs ~0.3 µs;
``random.getstate()`` costs ~8 µs and NumPy's ``get_state()`` + ``set_state()``
~50 µs, most of it building and checking dicts and tuples.  Blocks are entered
per sample or per test, so that difference is most of a block's cost.

Touching an object's memory is only safe if we know its layout.  We never
assume it: each layout below is *probed* once, on throw-away objects, by
comparing the raw bytes with what the public API reports and by writing bytes
and reading them back through the API.  Any mismatch, a non-CPython
interpreter, or an unexpected type disables the fast path for good and the
sources fall back to the exact public API.  Reads and writes stay inside the
object's ``__basicsize__`` (or NumPy's documented ``state_address``).
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "NUMPY_LAYOUT",
    "RANDOM_LAYOUT",
    "MTLayout",
    "NumpyGaussLayout",
    "is_cpython",
    "mt19937_view",
    "read_mt19937",
    "view",
    "write_mt19937",
]

_MT_WORDS = 624
#: ``int index; uint32_t state[624]`` (CPython) and ``uint32_t key[624]; int pos``
#: (NumPy) are both 2500 bytes.
MT_BYTES = 4 + 4 * _MT_WORDS
_HEAD = object.__basicsize__  # PyObject_HEAD


def is_cpython() -> bool:
    # id() is an address only on CPython; the free-threaded build has another header.
    gil_check = getattr(sys, "_is_gil_enabled", None)
    free_threaded = gil_check is not None and not gil_check()
    return sys.implementation.name == "cpython" and not free_threaded


def view(address: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``address``.

    Reading (``bytes(view)``) and writing (``view[:] = raw``) are single C
    copies that hold the GIL: no Python thread can draw half-way through one,
    a fork cannot split one, and unlike ``ctypes.memmove`` (which releases the
    GIL and converts its arguments in Python, failing with ``ArgumentError``
    near the recursion limit) no Python code runs.  The view does not keep
    the object alive: only use it while something else does.
    """
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class MTLayout(NamedTuple):
    """Where a CPython ``random.Random`` keeps its Mersenne Twister state."""

    offset: int

    def view(self, rng: random.Random) -> memoryview:
        """The 2500-byte record of ``rng`` (see :func:`view`)."""
        return view(id(rng) + self.offset, MT_BYTES)

    def read(self, rng: random.Random) -> bytes:
        return bytes(self.view(rng))

    def write(self, rng: random.Random, raw: bytes) -> None:
        self.view(rng)[:] = raw


def _probe_random() -> MTLayout | None:
    base = random.Random.__mro__[1]  # _random.Random, the C type holding the state
    if not is_cpython() or base.__basicsize__ < _HEAD + MT_BYTES:
        return None
    layout = MTLayout(_HEAD)
    try:
        a = random.Random(20_240_521)
        a.random()  # move the index away from its seeded value
        raw = layout.read(a)
        index, *words = struct.unpack(f"=i{_MT_WORDS}I", raw)
        if (*words, index) != a.getstate()[1]:
            return None
        b = random.Random(7)
        layout.write(b, raw)
        if b.getstate()[1] != a.getstate()[1] or b.random() != a.random():
            return None
    except Exception:
        return None
    return layout


class NumpyGaussLayout(NamedTuple):
    """Where NumPy's ``RandomState`` keeps its legacy gaussian cache.

    ``has_gauss`` (C int) and ``gauss`` (double) sit together in the object's
    ``aug_bitgen_t``; they are read and written as one 16-byte record.
    """

    offset: int

    def view(self, rs: np.random.RandomState) -> memoryview:
        """The 16-byte record of ``rs`` (see :func:`view`)."""
        return view(id(rs) + self.offset, 16)

    def read(self, rs: np.random.RandomState) -> bytes:
        return bytes(self.view(rs))

    def write(self, rs: np.random.RandomState, raw: bytes) -> None:
        self.view(rs)[:] = raw


def mt19937_view(bit_generator: Any) -> memoryview:
    """The ``key[624], pos`` record of an MT19937 bit generator (see :func:`view`)."""
    return view(bit_generator.ctypes.state_address, MT_BYTES)


def read_mt19937(bit_generator: Any) -> bytes:
    return bytes(mt19937_view(bit_generator))


def write_mt19937(bit_generator: Any, raw: bytes) -> None:
    mt19937_view(bit_generator)[:] = raw


def _gauss_record(has_gauss: int, gauss: float) -> tuple[bytes, bytes]:
    return struct.pack("=i", has_gauss), struct.pack("=d", gauss)


def _probe_numpy() -> NumpyGaussLayout | None:
    if not is_cpython() or type(np.random.mtrand._rand) is not np.random.RandomState:
        return None
    try:
        size = np.random.RandomState.__basicsize__
        rs = np.random.RandomState(np.random.MT19937(5))
        # 1. the MT19937 record matches the public state
        bg = rs._bit_generator
        raw = read_mt19937(bg)
        *key, pos = struct.unpack(f"={_MT_WORDS}Ii", raw)
        public = bg.state["state"]
        if list(key) != public["key"].tolist() or pos != public["pos"]:
            return None
        # 2. find the gaussian cache by planting a distinctive value
        marker = 1234.5678901234567
        state = rs.get_state(legacy=False)
        state["has_gauss"], state["gauss"] = 1, marker
        rs.set_state(state)
        memory = ctypes.string_at(id(rs), size)
        packed = struct.pack("=d", marker)
        hits = [i for i in range(_HEAD, size - 7) if memory[i : i + 8] == packed]
        if len(hits) != 1 or hits[0] - 8 < _HEAD:
            return None
        layout = NumpyGaussLayout(hits[0] - 8)
        if layout.read(rs)[:4] != struct.pack("=i", 1):
            return None
        # 3. writing through the layout is what the public API then reports
        other = np.random.RandomState(np.random.MT19937(9))
        has, value = _gauss_record(1, -0.25)
        layout.write(other, has + b"\0\0\0\0" + value)
        write_mt19937(other._bit_generator, raw)
        check = other.get_state(legacy=False)
        if check["has_gauss"] != 1 or check["gauss"] != -0.25:
            return None
        if check["state"]["key"].tolist() != list(key):
            return None
        if other.standard_normal() != -0.25:  # the cache is consumed first
            return None
        layout.write(other, b"\0" * 16)
        if other.get_state(legacy=False)["has_gauss"] != 0:
            return None
    except Exception:
        return None
    return layout


#: ``None`` when the interpreter or library layout could not be proven.
RANDOM_LAYOUT: MTLayout | None = _probe_random()
NUMPY_LAYOUT: NumpyGaussLayout | None = _probe_numpy()
