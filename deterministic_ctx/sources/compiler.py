"""``torch.compile``: the settings that decide compiled random numbers, and
where blocks meet the compiler.

**The source.**  Code compiled by inductor draws random numbers with its own
generator (Philox offsets into torch's seed), not with eager's kernels: under
the same seed a compiled model's dropout masks differ from the eager model's.
These config entries decide that, or decide determinism of compiled code,
and are captured and restored like the other flags (see :mod:`._config` for
how an entry's state is its *user override*):

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

Dynamo does not guard on inductor's config: a function compiled earlier keeps
the random numbers it was compiled with.  A block with ``flags=True`` turns
deterministic algorithms on, which dynamo does guard on, so a function
compiled outside blocks is compiled again for the block, with the block's
config; one compiled in an earlier block under the same global state is not.

**The boundary.**  A block's entry and exit, and a decorated function's call,
change process-global state through C functions and ``os.putenv``, which
dynamo cannot put in a graph: traced, each would be a graph break with a
warning, and the body of a decorated function would be compiled, drawing
inductor's numbers.  So they are opaque to dynamo (:func:`opaque`): calling
one from compiled code is one clean graph break (an error under
``fullgraph=True``, whose message says why), and the block's body runs
eagerly, with eager's random numbers, exactly as without ``torch.compile``.
A ``with`` block inside a compiled function makes dynamo run that function
eagerly; the frames called in the block's body are kept eager by
:func:`pause_compiler` until the block exits.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from operator import is_
from typing import Any, TypeVar

from .. import _torch
from .._torch.flags import set_eval_frame
from .._torch.internals import DYNAMO_CONFIG as _DYNAMO
from .._torch.internals import FUNCTORCH_CONFIG as _FUNCTORCH
from .._torch.internals import INDUCTOR_CONFIG as _INDUCTOR
from .._torch.internals import config_unset, mark_opaque_to_dynamo
from ..base.settings import Settings
from . import _plain
from ._config import AT_DEFAULT, ConfigEntry

__all__ = [
    "ENTRIES",
    "TorchCompileSource",
    "compiled_settings",
    "opaque",
    "pause_compiler",
    "refuse_while_tracing",
    "resume_compiler",
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
    """The override variables of :data:`ENTRIES` with ``modules`` imported, and their get."""
    global _binding
    if _binding[0] != modules:  # modules compare by identity
        found = [entry.located() for entry in ENTRIES]
        if all(f is not None and f.entry is not None and f.plain and f.var for f in found):
            variables = tuple(f.entry.user_override for f in found)  # type: ignore[union-attr]
            _binding = (modules, variables, type(variables[0]).get)
        else:
            _binding = (modules, None, None)
    return _binding[1], _binding[2]


class TorchCompileSource:
    """The config entries of inductor, AOTAutograd and dynamo that decide
    compiled random numbers (see the module docstring).  The state is a
    tuple of overrides, one per entry of :data:`ENTRIES`."""

    name = "torch.compile"
    device_type: str | None = None  # not a device generator: saved under "sources"

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


# -- the boundary ---------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])
# dynamo's C frame hook, in every supported torch.
_set_eval_frame: Any = set_eval_frame
_set_strategy: Any
_Strategy: Any
_Action: Any
_set_strategy, _Strategy, _Action = _torch.FRAME_EXEC_STRATEGY.value or (None, None, None)


def _no_compiler() -> None:
    return None


#: ``pause_compiler()`` stops dynamo from compiling the frames called from
#: here on and returns its callback for :func:`resume_compiler`.  A C
#: callable (a partial of torch's C function), not a Python function: called
#: while dynamo's callback is active, a Python frame would itself be compiled.
pause_compiler: Callable[[], object] = (
    functools.partial(_set_eval_frame, None) if _set_eval_frame is not None else _no_compiler
)


def resume_compiler(callback: object) -> None:
    """Give dynamo back the callback :func:`pause_compiler` returned."""
    if _set_eval_frame is not None:
        _set_eval_frame(callback)


_is_compiling: Callable[[], bool] = _torch.IS_COMPILING.value or _torch.is_compiling
_get_mode: Any
_MODE_KEYS: tuple[Any, ...]
_get_mode, _MODE_KEYS = _torch.DISPATCH_MODES.value or (None, ())


def refuse_while_tracing() -> None:
    """Raise ``RuntimeError`` if torch is tracing the calling code into a graph.

    ``torch.compiler.is_compiling()`` is true there, and this thread has a
    tracer's fake or proxy tensor mode: under non-strict ``torch.export``,
    which runs Python once to record the graph, or where dynamo traces what
    :func:`opaque` could not hide (a torch without the frame strategy API).
    (``is_compiling()`` alone is process-wide: a compile in another thread
    must not refuse this thread's blocks.)  A block would then seed and restore once, at trace
    time, and the graph's random ops would draw from whatever state the
    generators have when it runs: refused.  Code dynamo runs eagerly after a
    graph break is not tracing, and blocks there work.
    """
    # Whether this thread traces: is_compiling() is process-wide (true in every
    # thread while one compiles), the fake or proxy tensor mode of a tracer is per
    # thread (an older torch without them: trust is_compiling() alone).  The modes
    # first: two C calls, mapped (this runs at every block's start), where
    # is_compiling() is a Python one.
    if (_get_mode is None or any(map(_get_mode, _MODE_KEYS))) and _is_compiling():
        raise RuntimeError(
            "deterministic-ctx: a block cannot start while torch traces a graph "
            "(torch.compiler.is_compiling() is True: torch.export, say): it would seed and "
            "restore once, while tracing, not each time the graph runs. Enter the block around "
            "the call of the exported or compiled program instead: "
            "`with deterministic(0): program(x)`."
        )


def opaque(func: _F, reason: str, *, recursive: bool) -> _F:
    """Make ``func`` opaque to dynamo, in place, and return it.

    Tracing a call to it is a graph break whose message is ``reason`` (an
    error under ``fullgraph=True``): dynamo honours the attributes
    ``torch.compiler.disable`` sets, read without importing ``torch._dynamo``.
    When the call then runs, dynamo skips its frame and, with ``recursive``,
    every frame it calls, which run eagerly (torch's per-code
    ``FrameExecStrategy``, set in C).  Without ``recursive`` the frames it
    calls are compiled as usual until :func:`pause_compiler`.  Where torch
    lacks these APIs (torch < 2.6) only the attributes are set.
    """
    mark_opaque_to_dynamo(func, reason)
    code = getattr(func, "__code__", None)
    if isinstance(code, types.CodeType) and _set_strategy is not None:
        recursion = _Action.SKIP if recursive else _Action.DEFAULT
        _set_strategy(code, _Strategy(_Action.SKIP, recursion))
    return func
