"""Calls made with the garbage collector's collections held off.

The collector runs finalizers at any allocation of a tracked object, and a
finalizer may run a whole block: a suspended ``@reproducible`` generator it
collects closes in its own block, which captures and writes every source.
A few third-party calls cannot be re-entered that way while they allocate:
NumPy 1.x's seeding and torch 2.1's ``Generator.get_state`` hold a lock
that is not reentrant (the finalizer would wait for ever), and
``ContextVar.set`` (torch's config overrides from torch 2.12) keeps the old
mapping of its context by a borrowed reference while it builds the new one
(a finalizer that sets a variable of the same context frees it: a crash).
The sources make those calls through :func:`without_collections`.

Example:
    >>> import gc
    >>> from deterministic_ctx.base.collector import without_collections
    >>> without_collections(gc.isenabled)
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

from .completion import guarded

__all__ = ["without_collections"]

R = TypeVar("R")


def without_collections(call: Callable[..., R], *args: Any) -> R:
    """``call(*args)`` with collections held off, and the collector given back
    as it was: through :func:`~.completion.guarded`, so an interrupt cannot
    leave it off; where it is off already, a plain call."""
    if not gc.isenabled():
        return call(*args)
    result: R = guarded(gc.enable, _disabled, call, *args, after=True)
    return result


def _disabled(call: Callable[..., R], *args: Any) -> R:
    gc.disable()
    return call(*args)
