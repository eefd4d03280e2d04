"""``torch.compile``: the settings that decide compiled random numbers.

Code compiled by inductor draws random numbers with its own
generator (Philox offsets into torch's seed), not with eager's kernels: under
the same seed a compiled model's dropout masks differ from the eager model's.
These config entries decide that, or decide determinism of compiled code,
and are captured and restored like the other flags (see :mod:`.config_entries`
for how an entry's state is its *user override*):

* ``torch._inductor.config``: ``fallback_random`` (random ops fall back to
  eager's kernels: compiled numbers equal eager ones), ``align_random_eager``
  (torch's newer alignment of compiled random ops with eager), and
  ``batch_invariant`` (which implies deterministic kernels);
* ``torch._functorch.config``: ``functionalize_rng_ops`` and
  ``graphsafe_rng_functionalization`` (how AOTAutograd turns CUDA random ops
  into Philox calls with explicit seeds and offsets);
* ``torch._dynamo.config``: ``use_numpy_random_stream`` (NumPy random calls in
  compiled code use NumPy's stream instead of torch's).

``torch._inductor.config.deterministic`` is a determinism flag, set by
``torch.use_deterministic_algorithms``: it lives with them in :mod:`.flags`.

Nothing here imports a config module that is not imported already (importing
inductor costs about a second): an entry of a module imported inside a block
is put back to its default on exit.  The one exception is the block option
``compiled_rng="eager"``, whose whole point is inductor's ``fallback_random``:
it imports ``torch._inductor.config`` when the block starts.

What dynamo guards on (not inductor's config) is in ``docs/how-to/compile.md``;
where blocks meet the compiler (graph breaks, paused frames) is
:mod:`deterministic_ctx._torch.compiler`.
"""

from __future__ import annotations

import importlib
import sys
from operator import is_
from typing import Any

from .. import _torch
from .._torch.internals import DYNAMO_CONFIG as _DYNAMO
from .._torch.internals import FUNCTORCH_CONFIG as _FUNCTORCH
from .._torch.internals import INDUCTOR_CONFIG as _INDUCTOR
from .._torch.internals import config_unset
from ..base import plain as _plain
from ..base.fast_paths import ENABLED, FastPath
from ..base.settings import Settings
from ._base import SettingSource
from .config_entries import AT_DEFAULT, ConfigEntry

__all__ = [
    "ENTRIES",
    "TorchCompileSource",
    "compiled_settings",
]

#: The entries captured and restored, in the state's order.
ENTRIES: tuple[ConfigEntry, ...] = (
    ConfigEntry(_INDUCTOR, "fallback_random"),
    ConfigEntry(_INDUCTOR, "align_random_eager"),
    ConfigEntry(_INDUCTOR, "batch_invariant"),
    ConfigEntry(_FUNCTORCH, "functionalize_rng_ops"),
    ConfigEntry(_FUNCTORCH, "graphsafe_rng_functionalization"),
    ConfigEntry(_DYNAMO, "use_numpy_random_stream"),
)
_FALLBACK_RANDOM = ENTRIES[0]

#: The state when none of the config modules is imported (the usual case
#: outside compiled programs): every entry nobody's.
_UNTOUCHED: tuple[object, ...] = (AT_DEFAULT,) * len(ENTRIES)
#: ``(the config modules as last seen, every entry's override variable, their
#: get)``: the variables (torch's ``ContextVar``) where every entry is imported
#: and in the known layout, read with one ``map`` over their unbound ``get`` (a
#: C method, no frame per call); else ``None``, and the entries' methods run.
#: Rebuilt whenever a module is imported (or replaced).
_binding: tuple[tuple[Any, ...], tuple[Any, ...] | None, Any] = ((None, None, None), None, None)


def _variables(modules: tuple[Any, ...]) -> tuple[tuple[Any, ...] | None, Any]:
    """The override variables of :data:`ENTRIES` with ``modules`` imported, and their get;
    ``(None, None)`` with the fast paths off."""
    global _binding
    if not ENABLED:
        return None, None
    if _binding[0] != modules:  # modules compare by identity
        found = [entry.located() for entry in ENTRIES]
        if all(f is not None and f.entry is not None and f.plain and f.var for f in found):
            variables = tuple(f.entry.user_override for f in found)  # type: ignore[union-attr]
            _binding = (modules, variables, type(variables[0]).get)
        else:
            _binding = (modules, None, None)
    return _binding[1], _binding[2]


class TorchCompileSource(SettingSource):
    """The config entries of inductor, AOTAutograd and dynamo that decide
    compiled random numbers (see the module docstring).  The state is a
    tuple of overrides, one per entry of :data:`ENTRIES`."""

    name = "torch.compile"
    fast_paths = (
        FastPath(
            "torch.compile: overrides read in one pass over their variables",
            lambda: ENABLED,  # taken wherever torch's config layout allows (_variables)
        ),
    )

    def capture(self) -> tuple[object, ...]:
        """Each entry's override: as set, torch's "unset" sentinel, or
        :data:`AT_DEFAULT` (its module not imported)."""
        get = sys.modules.get
        modules = (get(_INDUCTOR), get(_FUNCTORCH), get(_DYNAMO))
        if modules == (None, None, None):
            return _UNTOUCHED
        variables, get = _variables(modules)
        if variables is not None:  # all imported, torch's layout: the overrides as they are
            return tuple(map(get, variables))
        return tuple(entry.read()[1] for entry in ENTRIES)

    def apply(self, settings: Settings) -> None:
        if settings.compiled_rng == "eager":
            if _INDUCTOR not in sys.modules:
                importlib.import_module(_INDUCTOR)  # the option asks for it: see the docstring
            _torch.INDUCTOR_FALLBACK_RANDOM.require("compiled_rng='eager'")
            _FALLBACK_RANDOM.set(True)

    def restore(self, state: tuple[object, ...]) -> None:
        get = sys.modules.get
        modules = (get(_INDUCTOR), get(_FUNCTORCH), get(_DYNAMO))
        if modules == (None, None, None):
            if type(state) is not _Loaded:
                return  # nothing imported, then or now
        elif type(state) is tuple:
            # The usual case, nothing set since the capture: nothing to write.
            variables, get = _variables(modules)
            if variables is not None and all(map(is_, map(get, variables), state)):
                return
        if type(state) is _Loaded:
            # A saved override of a module not imported here is applied all
            # the same: the module is imported (rare: someone set it and saved).
            for entry, want in zip(ENTRIES, state, strict=True):
                if want is not AT_DEFAULT and entry.module not in sys.modules:
                    importlib.import_module(entry.module)
        for entry, want in zip(ENTRIES, state, strict=True):
            entry.restore(want)

    def export_state(self, state: tuple[object, ...]) -> dict[str, Any]:
        """The state as plain data: ``{"module.key": value}`` for each entry
        someone set (an entry at its default is left out)."""
        out: dict[str, Any] = {}
        unset = config_unset()
        for entry, override in zip(ENTRIES, state, strict=True):
            # torch's own "nobody set it" sentinel: what a capture that reads
            # the override directly holds for an entry at its default
            if override is AT_DEFAULT or (unset is not None and override is unset):
                continue
            if type(override) is not bool:
                raise ValueError(
                    f"{entry.name} holds {override!r}, not True or False: a snapshot cannot save it"
                )
            out[entry.name] = override
        return out

    def import_state(self, data: object, path: str) -> tuple[object, ...]:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field."""
        saved = _plain.fields(data, path, [], [entry.name for entry in ENTRIES])
        state = tuple(
            _plain.flag(saved[entry.name], f"{path}.{entry.name}")
            if entry.name in saved
            else AT_DEFAULT
            for entry in ENTRIES
        )
        return _Loaded(state)


class _Loaded(tuple):  # type: ignore[type-arg]
    """A state loaded from a snapshot: its restore imports the config modules it sets."""

    __slots__ = ()


def compiled_settings() -> dict[str, Any]:
    """``{"module.key": value}`` of every entry whose module is imported (for
    the report); entries of modules not imported are left out."""
    out: dict[str, Any] = {}
    for entry in ENTRIES:
        if entry.located() is not None:
            out[entry.name] = entry.read()[0]
    return out
