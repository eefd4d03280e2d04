"""Where blocks meet ``torch.compile``: dynamo's frame hook and per-code strategy.

A block's entry and exit, and a decorated function's call, change
process-global state through C functions and ``os.putenv``, which dynamo
cannot put in a graph: traced, each would be a graph break with a warning, and
the body of a decorated function would be compiled, drawing inductor's
numbers.  So they are opaque to dynamo (:func:`opaque`): calling one from
compiled code is one clean graph break (an error under ``fullgraph=True``,
whose message says why), and the block's body runs eagerly, with eager's
random numbers, exactly as without ``torch.compile``.  A ``with`` block inside
a compiled function makes dynamo run that function eagerly; the frames called
in the block's body are kept eager by :func:`pause_compiler` until the block
exits.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

from . import DISPATCH_MODES, FRAME_EXEC_STRATEGY, IS_COMPILING, is_compiling
from .flags import set_eval_frame
from .internals import mark_opaque_to_dynamo

__all__ = ["opaque", "pause_compiler", "refuse_while_tracing", "resume_compiler", "tracing_here"]

_F = TypeVar("_F", bound=Callable[..., Any])
# dynamo's C frame hook, in every supported torch.
_set_eval_frame: Any = set_eval_frame
_set_strategy: Any
_Strategy: Any
_Action: Any
_set_strategy, _Strategy, _Action = FRAME_EXEC_STRATEGY.value or (None, None, None)


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


_is_compiling: Callable[[], bool] = IS_COMPILING.value or is_compiling
_get_mode: Any
_MODE_KEYS: tuple[Any, ...]
_get_mode, _MODE_KEYS = DISPATCH_MODES.value or (None, ())


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


def tracing_here() -> bool:
    """Whether torch traces the calling thread's code into a graph: as
    :func:`refuse_while_tracing` tells it (the thread's fake or proxy tensor
    mode with ``is_compiling()``; a fake or proxy mode alone is enough here,
    since an op call under one is recorded, not run)."""
    if _get_mode is not None:
        return any(map(_get_mode, _MODE_KEYS))
    return bool(_is_compiling())


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
