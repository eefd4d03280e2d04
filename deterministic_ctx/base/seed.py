"""Seed validation and derivation of well-mixed sub-seeds.

This is the one place that decides what a valid seed is, so every public entry
point rejects the same inputs with the same message.
"""

from __future__ import annotations

import numbers
import zlib

import numpy as np

from .cache import BoundedCache
from .fast_paths import FastPath

__all__ = ["MAX_SEED", "derive_seed", "short_repr", "show_int", "validate_seed"]

#: NumPy's legacy global RNG (``np.random.seed``) accepts ``0 .. 2**32 - 1``;
#: torch accepts 64 bits.  A block seeds both, so the narrower range wins.
MAX_SEED = 2**32 - 1


def validate_seed(seed: object, *, name: str = "seed") -> int:
    """Return ``seed`` as a plain ``int`` or raise a clear error.

    Accepts Python and NumPy integers in ``0 .. 2**32 - 1``.  ``bool`` is
    rejected although it is an ``int`` subclass: ``seed=True`` is always a bug.

    Example:
        >>> validate_seed(np.int64(7))
        7
        >>> validate_seed(-1)
        Traceback (most recent call last):
        ...
        ValueError: seed must be in 0 .. 4294967295 (NumPy's legacy RNG accepts no more), got -1
    """
    if type(seed) is int and 0 <= seed <= MAX_SEED:  # the common case, without ABC checks
        return seed
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{name} must be an int in 0 .. {MAX_SEED} (NumPy integers accepted), "
            f"got {type(seed).__name__} {short_repr(seed)}"
        )
    value = int(seed)
    if not 0 <= value <= MAX_SEED:
        raise ValueError(
            f"{name} must be in 0 .. {MAX_SEED} (NumPy's legacy RNG accepts no more), "
            f"got {show_int(value)}"
        )
    return value


def show_int(value: int) -> str:
    """``value`` for an error message: its digits, or its size when printing
    it would be slow or refused (``int`` → ``str`` is capped at 4300 digits)."""
    if value.bit_length() <= 256:
        return str(value)
    return f"a{' negative' if value < 0 else 'n'} int of {value.bit_length()} bits"


def short_repr(value: object) -> str:
    """``repr(value)`` for an error message: cut at 80 characters, and a repr
    that raises is named instead of hiding the real error."""
    try:
        text = repr(value)
    except Exception as exc:  # a huge int subclass, a repr that raises, ...
        return f"(unprintable: {type(exc).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."


def _key_word(key: int | str) -> int:
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8"))
    if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
        raise TypeError(f"derivation keys must be str or non-negative int, got {key!r}")
    return int(key)


#: Sub-seeds derived already, by ``(seed, key words, bits)``.
_DERIVED: BoundedCache[tuple[int, tuple[int, ...], int], int] = BoundedCache(4096)
FAST_PATH = FastPath("derive_seed: sub-seeds remembered per seed and keys", lambda: True)


def derive_seed(seed: int, *keys: int | str, bits: int = 32) -> int:
    """Derive a well-mixed sub-seed of ``seed`` for the path ``keys``.

    Uses :class:`numpy.random.SeedSequence` (``spawn_key`` = the keys, strings
    hashed with CRC-32), so sub-seeds of nearby seeds or keys share no
    structure, unlike ``seed + k`` offsets which collide across runs.  The
    result is stable across processes, platforms and releases.

    Example:
        >>> derive_seed(0, "rank", 1) != derive_seed(1, "rank", 0)
        True
        >>> 0 <= derive_seed(0, "worker", 3) < 2**32
        True
    """
    if bits not in (32, 64):
        raise ValueError(f"bits must be 32 or 64, got {bits!r}")
    key = (validate_seed(seed), tuple(_key_word(k) for k in keys), bits)
    derived = _DERIVED.get(key)
    if derived is None:
        sequence = np.random.SeedSequence(entropy=key[0], spawn_key=key[1])
        lo, hi = (int(w) for w in sequence.generate_state(2, np.uint32))
        derived = lo if bits == 32 else lo | (hi << 32)
        _DERIVED.put(key, derived)
    return derived
