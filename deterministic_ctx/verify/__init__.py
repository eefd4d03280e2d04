"""``assert_reproducible``, ``assert_compiled_matches_eager``, ``assert_batch_invariant``."""

from __future__ import annotations

from .batch import (
    BatchInvarianceError,
    CompiledMismatchError,
    NotReproducibleError,
    assert_batch_invariant,
    assert_compiled_matches_eager,
    assert_reproducible,
)

__all__ = [
    "BatchInvarianceError",
    "CompiledMismatchError",
    "NotReproducibleError",
    "assert_batch_invariant",
    "assert_compiled_matches_eager",
    "assert_reproducible",
]
