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
from collections.abc import Callable, MutableMapping

from .._settings import Settings
from . import _plain

__all__ = ["CUBLAS_VALID", "EnvironSource"]

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
HASHSEED = "PYTHONHASHSEED"
CUBLAS_VALID = (":4096:8", ":16:8")
_NAMES = (CUBLAS, HASHSEED)


def _fast_reader(env: object) -> Callable[[str], str | None] | None:
    """A reader of ``os.environ`` that does not raise internally for absent names.

    ``os.environ.get`` goes through ``Mapping.get``, which raises and catches a
    ``KeyError`` for every absent variable (~0.7 µs, six times per block, and
    these variables are usually absent).  ``os._Environ`` keeps its values in
    a plain dict, ``_data``, under encoded keys: reading that is ~0.1 µs.  It
    is used only after proving, on a probe variable set and deleted through
    the public API, that it reads what ``os.environ`` reads; writes always go
    through the public API.
    """
    if type(env) is not os._Environ:
        return None
    data = getattr(env, "_data", None)
    encodekey = getattr(env, "encodekey", None)
    decodevalue = getattr(env, "decodevalue", None)
    if type(data) is not dict or not callable(encodekey) or not callable(decodevalue):
        return None
    keys = {name: encodekey(name) for name in (*_NAMES, _PROBE)}

    def get(name: str) -> str | None:
        value = data.get(keys[name])
        return None if value is None else str(decodevalue(value))

    try:
        env[_PROBE] = "probe value é"
        seen = get(_PROBE)
        del env[_PROBE]
        proven = seen == "probe value é" and get(_PROBE) is None
        proven = proven and all(get(n) == env.get(n) for n in _NAMES)
    except Exception:
        return None
    finally:
        env.pop(_PROBE, None)
    return get if proven else None


_PROBE = "DETERMINISTIC_CTX_ENV_PROBE"


class EnvironSource:
    """``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED`` in ``os.environ``."""

    name = "environ"

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._env = environ if environ is not None else os.environ
        self._get: Callable[[str], str | None] = _fast_reader(self._env) or self._env.get

    def capture(self) -> tuple[str | None, ...]:
        get = self._get
        return (get(CUBLAS), get(HASHSEED))

    def apply(self, settings: Settings) -> None:
        env, get = self._env, self._get
        if get(CUBLAS) not in CUBLAS_VALID:
            env[CUBLAS] = CUBLAS_VALID[0]
        seed = str(settings.seed)
        if get(HASHSEED) != seed:
            env[HASHSEED] = seed

    def restore(self, state: tuple[str | None, ...]) -> None:
        env, get = self._env, self._get
        for name, value in zip(_NAMES, state, strict=True):
            if get(name) == value:
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
