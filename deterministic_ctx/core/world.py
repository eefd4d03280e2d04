"""World: the captured state of every source at one moment, and how to put it back.

The engine's unit of state (a block's caller's world, a suspended block's own
world) and what :class:`~deterministic_ctx.state.snapshot.Snapshot` wraps.  It knows
nothing of seeds, blocks or files.
"""

from __future__ import annotations

import sys
from operator import methodcaller
from typing import Any

from .. import sources as _sources
from ..base.errors import RestoreError
from ..sources import Source

__all__ = ["World", "headroom"]

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

        Sources are restored in reverse capture order.  A ``KeyboardInterrupt``
        (or any exception a signal handler raises) while restoring does not
        leave a source half-restored or stop the others: the interrupted
        source is restored again, then the rest, and the interrupt is
        re-raised afterwards.  A source that fails twice in a row has failed;
        every other source is still restored, then :class:`RestoreError`
        names the ones that failed.  A ``RecursionError`` that the retry, with
        a few frames more, does not meet again was a lack of stack, not an
        interruption: the source is restored and nothing is raised for it.
        """
        failures: dict[str, BaseException] | None = None
        interrupt: BaseException | None = None
        for source, state in zip(reversed(self.sources), reversed(self.states), strict=True):
            try:
                source.restore(state)
            except BaseException as exc:
                # A failure, or an exception a signal handler raised half-way
                # (``KeyboardInterrupt``, a timeout): restores are idempotent,
                # so try once more.  If that works, the first one was an
                # interruption, re-raised once everything is back.
                # The first may have failed at the recursion limit (a block left
                # by deep recursion): the retry gets a few frames more.  Inline,
                # not ``headroom``: its ``__exit__`` is one frame deeper, where
                # lowering the limit again can itself fail.
                limit = sys.getrecursionlimit()
                sys.setrecursionlimit(limit + 100)
                try:
                    source.restore(state)
                except Exception as again:
                    failures = failures or {}
                    failures[source.name] = again
                except BaseException as again:  # interrupted again: go on with the others
                    interrupt = interrupt or again
                else:
                    # Any other exception may have come from a signal handler
                    # (a SIGALRM timeout raises an ordinary one): it propagates.
                    # A RecursionError the headroom cured was the stack's: the
                    # source is back, and a fully restored block must not raise.
                    if not isinstance(exc, RecursionError):
                        interrupt = interrupt or exc
                finally:
                    sys.setrecursionlimit(limit)
        if interrupt is not None:
            raise interrupt
        if failures:
            raise RestoreError(failures)


class headroom:
    """Room on the stack to finish an exit or a roll-back.

    A decorated function that recursed to the limit fails to enter its block
    with ``RecursionError``, and the blocks it leaves on the way back up are
    left near the limit; putting the caller's state back needs a few frames
    more.  The limit is raised by a little for as long as that takes (only on
    failure paths: the engine's retries and roll-backs; a source's second
    restore in :meth:`World.restore` does the same inline).
    """

    __slots__ = ("_limit",)

    def __enter__(self) -> None:
        self._limit = sys.getrecursionlimit()
        sys.setrecursionlimit(self._limit + 100)

    def __exit__(self, *exc: object) -> None:
        sys.setrecursionlimit(self._limit)
