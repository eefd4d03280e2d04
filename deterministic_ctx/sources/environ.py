"""Environment variables that decide determinism.

* ``CUBLAS_WORKSPACE_CONFIG``: cuBLAS is only deterministic with ``:4096:8``
  or ``:16:8``; a valid user value is kept, anything else is replaced inside
  the block.  cuBLAS reads it once, at its first use in the process: setting
  it after CUDA work has started may have no effect (the report says so).
* ``PYTHONHASHSEED``: set to the block's seed, so child processes started in
  the block (``spawn`` DataLoader workers, subprocesses) hash strings
  reproducibly.  It cannot change the running interpreter.

A variable that was absent is absent again after the block.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from .._settings import Settings
from . import _plain

__all__ = ["CUBLAS_VALID", "EnvironSource"]

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
HASHSEED = "PYTHONHASHSEED"
CUBLAS_VALID = (":4096:8", ":16:8")
_NAMES = (CUBLAS, HASHSEED)


class EnvironSource:
    """``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED`` in ``os.environ``."""

    name = "environ"

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._env = environ if environ is not None else os.environ

    def capture(self) -> tuple[str | None, ...]:
        get = self._env.get
        return tuple(get(n) for n in _NAMES)

    def apply(self, settings: Settings) -> None:
        env = self._env
        if env.get(CUBLAS) not in CUBLAS_VALID:
            env[CUBLAS] = CUBLAS_VALID[0]
        seed = str(settings.seed)
        if env.get(HASHSEED) != seed:
            env[HASHSEED] = seed

    def restore(self, state: tuple[str | None, ...]) -> None:
        env = self._env
        for name, value in zip(_NAMES, state, strict=True):
            if env.get(name) == value:
                continue
            if value is None:
                del env[name]
            else:
                env[name] = value

    def export_state(self, state: tuple[str | None, ...]) -> dict[str, str]:
        """The state as plain data: ``{name: value}``, an unset variable left out."""
        return {name: value for name, value in zip(_NAMES, state, strict=True) if value is not None}

    def import_state(self, data: object, path: str) -> tuple[str | None, ...]:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field."""
        d = _plain.fields(data, path, (), _NAMES)
        return tuple(
            _plain.text(d[name], f"{path}.{name}") if name in d else None for name in _NAMES
        )
