"""The immutable description of what a block applies."""

from __future__ import annotations

from dataclasses import dataclass

from ._seed import validate_seed

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """What a deterministic block applies on entry: the seed and the flag mode.

    Built (and validated) once, where the user writes ``deterministic(...)`` or
    ``@reproducible(...)``; every source reads it when a block starts.
    """

    __slots__ = ("seed", "warn_only")
    seed: int
    warn_only: bool

    @classmethod
    def build(cls, seed: object, warn_only: object) -> Settings:
        if not isinstance(warn_only, bool):
            raise TypeError(f"warn_only must be True or False, got {warn_only!r}")
        return cls(validate_seed(seed), warn_only)
