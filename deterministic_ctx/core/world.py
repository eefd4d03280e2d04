"""World: the captured state of every source at one moment, and how to put it back.

The engine's unit of state (a block's caller's world, a suspended block's own
world) and what :class:`~deterministic_ctx.state.snapshot.Snapshot` wraps.  It knows
nothing of seeds, blocks or files.
"""

from __future__ import annotations

import warnings
from operator import methodcaller
from typing import Any

from .. import sources as _sources
from .._errors import StateWarning
from ..base.completion import retry
from ..base.errors import RestoreError
from ..sources import Source

__all__ = ["World"]

#: ``_capture(source)`` is ``source.capture()``, called from C: no frame per source.
_capture = methodcaller("capture")
_new = object.__new__


class World:
    """The state of each of ``sources`` (``states[i]`` is ``sources[i]``'s).

    Never mutated after it is built: it may be restored any number of times.

    Example:
        >>> import random
        >>> world = World.capture()
        >>> first = random.random()
        >>> world.restore()
        >>> random.random() == first
        True
    """

    __slots__ = ("sources", "states")

    def __init__(self, sources: tuple[Source, ...], states: tuple[Any, ...]) -> None:
        self.sources = sources
        self.states = states

    @classmethod
    def capture(cls, sources: tuple[Source, ...] | None = None) -> World:
        """The state now of each of ``sources``: by default every source of
        :data:`~deterministic_ctx.sources.SOURCES`; a block over a part of them
        (a keyed item's RNGs, a stream's generators) passes that part."""
        if sources is None:
            sources = _sources.SOURCES
        world = _new(cls)  # without ``__init__``'s Python frame: a swap captures twice
        world.sources = sources
        world.states = tuple(map(_capture, sources))
        return world

    def restore(self) -> None:
        """Put every captured source back; raise :class:`RestoreError` on failure.

        Sources are restored in reverse capture order, as the completion step
        (:func:`~deterministic_ctx.base.completion.complete_each`) runs steps:
        one whose restore raises is restored once more (restores are idempotent),
        with a few frames more on the stack, and the others are restored
        whatever it does.  Then, for a source whose first restore raised:

        * the retry raised an ordinary exception too: it has failed, and
          :class:`RestoreError` names it (and every other that failed);
        * the retry, or the first restore, raised what is no ordinary
          ``Exception`` (``KeyboardInterrupt``, ``SystemExit``): that is
          raised once everything is back;
        * the retry succeeded after an ordinary exception: the source is back
          and nothing is raised for it; one :class:`StateWarning` names the
          source and the exception (a signal handler raising ``TimeoutError``
          during the restore is reported so), except for a ``RecursionError``,
          which was a lack of stack that the retry's headroom cured.
        """
        failures: list[tuple[Source, BaseException, BaseException | None]] | None = None
        # The loop of the completion step (``complete_each``), written out:
        # each source's ``restore`` is called directly, without a bound method
        # made per source (a block's exit restores every source).
        for source, state in zip(reversed(self.sources), reversed(self.states), strict=True):
            try:
                source.restore(state)
            except BaseException as first:
                failures = failures or []
                failures.append((source, first, retry(source.restore, state)))
        if failures:
            _report(failures)


def _report(failures: list[tuple[Source, BaseException, BaseException | None]]) -> None:
    """Raise or warn for the sources whose restore raised (:meth:`World.restore`)."""
    interrupt: BaseException | None = None
    failed: dict[str, BaseException] = {}
    for source, first, again in failures:
        if again is None:
            if not isinstance(first, Exception):
                interrupt = interrupt or first
            elif not isinstance(first, RecursionError):
                warnings.warn(
                    f"restoring {source.name} failed once ({first!r}) and succeeded when retried",
                    StateWarning,
                    stacklevel=3,
                )
        elif isinstance(again, Exception):
            failed[source.name] = again
        else:  # interrupted again
            interrupt = interrupt or again
    if interrupt is not None:
        raise interrupt
    if failed:
        raise RestoreError(failed)
