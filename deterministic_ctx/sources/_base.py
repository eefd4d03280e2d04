"""The contract every source of global state implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._settings import Settings

__all__ = ["Source"]


@runtime_checkable
class Source(Protocol):
    """One piece of process-global state that decides random draws or algorithms.

    A source is the only code that knows the API behind its state.  It must:

    * ``capture()`` return an object describing the state now, never mutated
      afterwards (a snapshot may restore it many times), without lasting side
      effects (a source may write for a moment to read what torch does not
      report, and puts it back before returning);
    * ``restore(state)`` put that state back exactly;
    * ``apply(settings)`` set the reproducible state a block starts from.
    """

    name: str

    def capture(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def apply(self, settings: Settings) -> None: ...
