"""Entries of torch's config modules (``torch._inductor.config``, ...), read
and written as torch's own patcher does.

A config module tells a value the user set from a default (``_is_default``),
and its compile-cache keys see the difference.  So the state of an entry is
its *user override*: the value someone set, or :data:`AT_DEFAULT` when nobody
did.  It is read and written the way torch's own patcher does, in either of
the two layouts torch has had:

* torch 2.12 and later: the override is a ``ContextVar`` (per thread and per
  asyncio task, so a restore writes the calling thread's), and the module's
  hash and ``get_dict`` caches are marked dirty after a write;
* torch 2.11 and earlier: the override is a plain attribute of the entry
  (process-wide), and the module's ``_is_dirty`` flag is set after a write.

That is also cheaper than ``getattr(config, key)`` (about 1.2 µs per read,
0.8 µs per write).

A module that is not imported is never imported here: its entries read as
not imported, and a restore leaves them alone.  An entry imported *after* a
capture is put back to :data:`AT_DEFAULT`: as if nobody had touched it.
Where torch's config layout is not the one this module knows, the value itself
is read and written with ``getattr``/``setattr``, and "back to default" writes
the default torch recorded when it imported the module (torch 2.1 to 2.5 keep
it in the module's ``_default`` table; see ``config_default`` in
:mod:`deterministic_ctx._torch.internals`).
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .._torch.internals import (
    config_default,
    config_entries,
    config_layout,
    config_unset,
    write_config_override,
)
from ..base.collector import without_collections

__all__ = ["AT_DEFAULT", "ConfigEntry", "unchanged_config"]


class _AtDefault(enum.Enum):
    """An entry as nobody set it: at its default, or its module not imported yet.
    An enum member: one object, also after a copy or a pickle, compared by identity."""

    AT_DEFAULT = "default"

    def __repr__(self) -> str:
        return "default"


AT_DEFAULT = _AtDefault.AT_DEFAULT


class _Found(NamedTuple):
    config: Any
    #: torch's ``_ConfigEntry``; ``None`` where the layout is not the known one.
    entry: Any
    #: torch's "no user override" sentinel.
    unset: object
    #: The value is the override, else the entry's default (no alias, env
    #: variable or justknob in between): no need for the costly getattr.
    plain: bool
    #: The override is a ``ContextVar`` (torch >= 2.12), else a plain attribute.
    var: bool


def _get(found: _Found) -> object:
    """The entry's user override (torch's sentinel where nobody set it)."""
    override = found.entry.user_override
    return override.get() if found.var else override


def _put(found: _Found, key: str, target: object) -> None:
    """Write the entry's user override, unless it is ``target`` already.

    A ``ContextVar`` is set with collections held off: ``ContextVar.set``
    keeps its context's old mapping by a borrowed reference while it
    allocates the new one, and a finalizer run there that sets a variable of
    the same context (a collected decorated generator's block writes these
    overrides too) frees that mapping under it: a crash
    (:mod:`~deterministic_ctx.base.collector`)."""
    if _get(found) is target:
        return
    if found.var:
        without_collections(write_config_override, found.config, found.entry, True, key, target)
    else:
        write_config_override(found.config, found.entry, False, key, target)


class ConfigEntry:
    """One entry of one torch config module, e.g. ``ConfigEntry("torch._inductor.config",
    "fallback_random")``."""

    __slots__ = ("_found", "_unknown_default", "key", "module")

    def __init__(
        self, module: str, key: str, unknown_default: Callable[[], Any] | None = None
    ) -> None:
        self.module = module
        self.key = key
        #: The default where torch's layout does not say (an older torch).
        self._unknown_default = unknown_default
        self._found: _Found | None = None

    @property
    def name(self) -> str:
        """``module.key``: how checkpoints and reports name the entry."""
        return f"{self.module}.{self.key}"

    def located(self) -> _Found | None:
        """The module's config and entry, or ``None`` where the module is not
        imported or has no such entry (another torch)."""
        config = sys.modules.get(self.module)
        if config is None:
            return None
        found = self._found
        if found is None or found.config is not config:
            found = self._found = _inspect(config, self.key)
        if found.entry is None and not hasattr(found.config, self.key):
            return None
        return found

    def read(self) -> tuple[Any, object]:
        """``(value, override or AT_DEFAULT)``; ``(None, AT_DEFAULT)`` where
        the module is not imported or has no such entry."""
        found = self.located()
        if found is None:
            return None, AT_DEFAULT
        if found.entry is None:
            value = getattr(found.config, self.key)
            return value, value
        override = _get(found)
        if override is found.unset:
            value = found.entry.default if found.plain else getattr(found.config, self.key)
            return value, AT_DEFAULT
        value = override if found.plain else getattr(found.config, self.key)
        return value, override

    def set(self, value: object) -> None:
        """Override the entry with ``value`` (``config.key = value``); nothing
        where the module is not imported."""
        found = self.located()
        if found is None:
            return
        if found.entry is None or not found.plain:
            setattr(found.config, self.key, value)
        else:
            _put(found, self.key, value)

    def restore(self, want: object) -> None:
        """Put back an override :meth:`read` returned (:data:`AT_DEFAULT`:
        nobody's); nothing where the module is not imported."""
        found = self.located()
        if found is None:
            return
        if found.entry is None:
            if want is AT_DEFAULT:
                known, want = config_default(found.config, self.key)
                if not known and self._unknown_default is not None:
                    want = self._unknown_default()
            setattr(found.config, self.key, want)
            return
        _put(found, self.key, found.unset if want is AT_DEFAULT else want)


def _inspect(config: Any, key: str) -> _Found:
    entries = config_entries(config)
    entry = entries.get(key) if entries is not None else None
    unset = config_unset()
    var = config_layout(config, entry)
    if unset is None or var is None:
        return _Found(config, None, None, False, False)
    plain = (
        getattr(entry, "alias", None) is None
        and getattr(entry, "justknob", None) is None
        and getattr(entry, "env_value_force", None) is unset
        and getattr(entry, "env_value_default", None) is unset
        and isinstance(getattr(entry, "default", None), (bool, int, float, str))
    )
    return _Found(config, entry, unset, plain, var)


@contextlib.contextmanager
def unchanged_config(module: str) -> Iterator[None]:
    """Put every entry of a config module back as it was, overrides and all.

    ``torch.compile(options=...)`` and ``config.patch`` write values back when
    they end, and so leave the entries they touched marked as set by the user,
    which changes inductor's compile-cache keys.  This restores each entry's
    override itself (nothing where ``module`` is not imported at entry, or
    its layout is not the known one: a later import is left alone).
    """
    config = sys.modules.get(module)
    found = {key: _inspect(config, key) for key in config_entries(config) or ()}
    if not all(f.entry is not None for f in found.values()):
        found = {}  # a layout not the known one
    saved = [(key, f, _get(f)) for key, f in found.items()]
    try:
        yield
    finally:
        for key, f, override in saved:
            _put(f, key, override)
