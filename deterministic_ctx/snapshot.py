"""Snapshot: an immutable capture of every source of global random state."""

from __future__ import annotations

from typing import Any

from . import sources as _sources
from ._errors import RestoreError
from .sources import Source

__all__ = ["Snapshot"]


class Snapshot:
    """The state of every RNG and determinism flag at one moment.

    ``Snapshot.capture()`` records Python's ``random``, NumPy's global RNG,
    torch's CPU and accelerator generators (without initializing CUDA), the
    determinism and precision flags, the relevant environment variables and
    every registered user RNG.  ``restore()`` puts all of it back, bit for
    bit, and can be called any number of times.  It knows nothing of seeds.

    If a source fails to restore, every other source is still restored, then
    :class:`RestoreError` names the ones that failed.

    Example:
        >>> import random
        >>> snap = Snapshot.capture()
        >>> first = random.random()
        >>> snap.restore()
        >>> random.random() == first
        True
    """

    __slots__ = ("_sources", "_states")
    _sources: tuple[Source, ...]
    _states: tuple[Any, ...]

    def __init__(self) -> None:
        raise TypeError("use Snapshot.capture() to take a snapshot")

    @classmethod
    def capture(cls) -> Snapshot:
        """Capture the current state of every source.

        Example:
            >>> isinstance(Snapshot.capture(), Snapshot)
            True
        """
        sources = _sources.SOURCES
        return cls._build(sources, tuple([s.capture() for s in sources]))

    @classmethod
    def _build(cls, sources: tuple[Source, ...], states: tuple[Any, ...]) -> Snapshot:
        snap = object.__new__(cls)
        object.__setattr__(snap, "_sources", sources)
        object.__setattr__(snap, "_states", states)
        return snap

    def restore(self) -> None:
        """Put every captured source back; raise :class:`RestoreError` on failure.

        Sources are restored in reverse capture order.  A ``KeyboardInterrupt``
        raised while restoring does not stop the others from being restored;
        it is re-raised afterwards.

        Example:
            >>> import numpy as np
            >>> snap = Snapshot.capture()
            >>> a = np.random.rand()
            >>> snap.restore()
            >>> float(np.random.rand()) == a
            True
        """
        failures: dict[str, BaseException] | None = None
        interrupt: BaseException | None = None
        for source, state in zip(reversed(self._sources), reversed(self._states)):
            try:
                source.restore(state)
            except Exception as exc:
                failures = failures or {}
                failures[source.name] = exc
            except BaseException as exc:  # KeyboardInterrupt: finish restoring first
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt
        if failures:
            raise RestoreError(failures)

    @property
    def sources(self) -> tuple[str, ...]:
        """Names of the captured sources, in capture order.

        Example:
            >>> "random" in Snapshot.capture().sources
            True
        """
        return tuple(s.name for s in self._sources)

    def state_of(self, name: str) -> Any:
        """The captured state of the source called ``name`` (read-only use).

        Example:
            >>> Snapshot.capture().state_of("environ") is not None
            True
        """
        for source, state in zip(self._sources, self._states):
            if source.name == name:
                return state
        raise KeyError(f"no source named {name!r}; captured: {', '.join(self.sources)}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Snapshot is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Snapshot is immutable")

    def __repr__(self) -> str:
        return f"Snapshot(sources={list(self.sources)})"
