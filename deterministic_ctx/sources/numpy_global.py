"""NumPy's legacy global RNG (``np.random.seed``, ``np.random.rand``, …).

The state is: which bit generator is installed (``np.random.set_bit_generator``
can replace it), that bit generator's state, and the ``RandomState``'s legacy
gaussian cache (``has_gauss``/``gauss``), which changes what the next
``np.random.randn()`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._settings import Settings
from ._memory import NUMPY_LAYOUT, NumpyGaussLayout, read_mt19937, write_mt19937

__all__ = ["NumpyGlobalSource", "NumpyState"]


@dataclass(frozen=True)
class NumpyState:
    """``raw`` holds ``(mt19937 record, gauss record)`` on the fast path, else
    the dict of ``RandomState.get_state(legacy=False)``."""

    bit_generator: Any
    raw: tuple[bytes, bytes] | dict[str, Any]


class NumpyGlobalSource:
    """The ``RandomState`` singleton behind the ``np.random.*`` functions."""

    name = "numpy"

    def __init__(
        self,
        rs: np.random.RandomState | None = None,
        layout: NumpyGaussLayout | None = NUMPY_LAYOUT,
    ) -> None:
        self._rs: np.random.RandomState = rs if rs is not None else np.random.mtrand._rand
        self._layout = layout if type(self._rs) is np.random.RandomState else None

    def _fast(self, bit_generator: Any) -> NumpyGaussLayout | None:
        return self._layout if type(bit_generator) is np.random.MT19937 else None

    def capture(self) -> NumpyState:
        rs = self._rs
        bg = rs._bit_generator
        layout = self._fast(bg)
        if layout is not None:
            # The bit generator's lock keeps a draw in another thread (NumPy
            # releases the GIL for large fills) from tearing the copy.
            with bg.lock:
                return NumpyState(bg, (read_mt19937(bg), layout.read(rs)))
        return NumpyState(bg, rs.get_state(legacy=False))

    def restore(self, state: NumpyState) -> None:
        rs = self._rs
        if rs._bit_generator is not state.bit_generator:
            np.random.set_bit_generator(state.bit_generator)
        bg = state.bit_generator
        if isinstance(state.raw, tuple):
            layout = self._fast(bg)
            if layout is None:
                raise ValueError("NumPy state was captured through the fast path, which is off")
            mt, gauss = state.raw
            with bg.lock:
                write_mt19937(bg, mt)
                layout.write(rs, gauss)
        else:
            rs.set_state(state.raw)

    def apply(self, settings: Settings) -> None:
        rs = self._rs
        if type(rs._bit_generator) is not np.random.MT19937:
            # ``np.random.seed`` only works on MT19937; inside a block the global
            # RNG is exactly the classic legacy-seeded one.  Restore reinstalls
            # the user's bit generator.
            np.random.set_bit_generator(np.random.MT19937(0))
        rs.seed(settings.seed)  # legacy seeding; also clears the gaussian cache

    def to_public(self, state: NumpyState) -> dict[str, Any]:
        """The state in ``RandomState.get_state(legacy=False)`` form."""
        if isinstance(state.raw, dict):
            return state.raw
        import struct

        mt, gauss = state.raw
        *key, pos = struct.unpack("=624Ii", mt)
        (has_gauss,) = struct.unpack("=i", gauss[:4])
        (value,) = struct.unpack("=d", gauss[8:])
        return {
            "bit_generator": "MT19937",
            "state": {"key": np.array(key, dtype=np.uint32), "pos": pos},
            "has_gauss": has_gauss,
            "gauss": value,
        }
