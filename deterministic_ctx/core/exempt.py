"""``allow_nondeterministic(*ops)``: deterministic everywhere except the ops you name.

torch's ``use_deterministic_algorithms`` is one process-wide flag, checked
inside each kernel that has no deterministic implementation.  Inside an
exemption, each call of a named op runs with the flag off, and the flag is
back as it was as soon as the call returns; every other op sees the flag as
the surrounding block set it.  The dispatcher's side (a kernel in front of
each named op, reached only while an exemption is open in the thread) is in
:mod:`deterministic_ctx._torch.internals`; the flag is read and written by
:mod:`deterministic_ctx.sources.flags`.

**Interrupts.**  Putting the flag back is run by the completion step
(:func:`~deterministic_ctx.base.completion.complete`): a ``KeyboardInterrupt``
raised by a signal handler anywhere in an exempted call, or in the exit of
an exemption, is re-raised only once the flag (and the thread's dispatch
state) are back.

**Threads.**  The flag is process-wide: while an exempted op runs, an op of
another thread that alerts is not refused either (the window is the
exempted call, on CUDA the kernel's launch).  Calls of exempted ops in
several threads at once share one window: the flag is turned off by the
first and put back by the last.  Which ops an exemption names is
process-wide too, but only threads inside an exemption (and the autograd
threads running their ``backward()``) reach them.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from types import TracebackType
from typing import Any, TypeVar

from .._errors import MisuseError
from .._torch import internals as _dispatch
from .._torch.compiler import tracing_here
from ..base.completion import complete, guarded
from ..sources.flags import read_alerts, write_alerts
from .engine import drain_signals

__all__ = ["active_exemptions", "allow_nondeterministic", "exempted_calls", "is_exempted"]

F = TypeVar("F", bound=Callable[..., Any])

#: The open exemptions (by entry token): the ops each names, the thread that opened
#: it.  Only C-level dict operations touch it (atomic under the GIL): no lock to
#: leave held when an interrupt lands.
_entries: dict[object, tuple[tuple[Any, ...], int]] = {}
#: Whether each thread with an exemption open included the key before its first one.
_bases: dict[int, bool] = {}
_labels: dict[Any, str] = {}

#: The exempted calls running now (by token), and the flag's state before the
#: first of them turned it off (``None``: it was off, or no call runs).
_holders: dict[object, int] = {}  # token -> the thread making the call
_saved: list[tuple[bool, bool] | None] = [None]

#: Who holds the window's lock: ``{0: thread id}``.  ``dict.setdefault`` takes it
#: in one C call, so the thread that holds it knows it does, and a completion
#: step run again after an interrupt takes it again and gives it back (a
#: ``threading.Lock`` left held by an interrupt between its acquire and the
#: protected lines would stop every later exempted call).
_owner: dict[int, int] = {}

#: Every exempted op that ran with the flag turned off since the process
#: started, with its number of calls (for the verify messages' suspects).
_ran: dict[str, int] = {}


_NOT_FOUND = object()


def _exempted(op: Any) -> bool:
    return any(op in ops for ops, _ in tuple(_entries.values()))


def _kernel(op: Any, keyset: Any, *args: Any, **kwargs: Any) -> Any:
    if not _exempted(op):  # another thread's exemption, or a key included by torch itself
        return _dispatch.redispatch_exempted(op, keyset, args, kwargs)
    if tracing_here():
        raise MisuseError(
            f"deterministic-ctx: allow_nondeterministic cannot exempt {_labels[op]} in a graph "
            f"that torch traces (torch.compile, torch.export): the compiled code would run it "
            f"later, outside the exemption, and its check cannot be turned off for one op "
            f"there. Call the op eagerly (torch.compiler.disable on the function that calls "
            f"it), or compile outside the exemption and keep the op out of the compiled region"
        )
    label = _labels[op]
    _ran[label] = _ran.get(label, 0) + 1
    token = object()
    # The window is closed on both outcomes, whatever line an interrupt lands
    # on (not in a ``finally``: see ``guarded``).
    return guarded(
        functools.partial(_resume, token), _paused_call, token, op, keyset, args, kwargs, after=True
    )


def _paused_call(token: object, op: Any, keyset: Any, args: Any, kwargs: Any) -> Any:
    _pause(token)
    return _dispatch.redispatch_exempted(op, keyset, args, kwargs)


def _acquire() -> None:
    me = threading.get_ident()
    while _owner.setdefault(0, me) != me:
        time.sleep(0)  # another thread's exempted call is opening or closing the window


def _release() -> None:
    if _owner.get(0) == threading.get_ident():
        del _owner[0]


def _pause(token: object) -> None:
    """Open the window for one call (the first call turns the flag off).  An
    interrupt is undone by :func:`_resume`, which the caller runs then."""
    _acquire()
    if not _holders:
        now = read_alerts()
        if now[0]:
            _saved[0] = now  # recorded before the write: _resume undoes it
            write_alerts((False, now[1]))
    _holders[token] = threading.get_ident()
    _release()


def _resume(token: object) -> None:
    """Close the window for one call (the last call puts the flag back).
    Idempotent, lock included: the completion step may run it twice."""
    _acquire()
    _holders.pop(token, None)
    saved = _saved[0]
    if not _holders and saved is not None:
        write_alerts(saved)
        _saved[0] = None
    _release()


class allow_nondeterministic:
    """Deterministic everywhere except the ops you name: inside it, each call of
    one of ``ops`` runs without torch's deterministic-algorithms check (no
    error, and no warning under ``warn_only=True``); every other op stays
    checked as the surrounding block set it.  A context manager and a decorator.

    Args:
        *ops: the ops to exempt, named as torch's alert and
            :func:`~deterministic_ctx.audit_nondeterminism` name them:
            ``"aten::upsample_bilinear2d_backward"`` (``"aten.name"`` too; all
            overloads) or ``"aten::index_add.out"`` (one overload), or op
            objects: ``torch.ops.aten.index_add`` (all overloads) or
            ``torch.ops.aten.index_add.default`` (that one).

    The flag is turned off for exactly each call of a named op (what its kernel
    calls included) and put back when it returns, also if a
    ``KeyboardInterrupt`` lands in between; outside any block (deterministic
    algorithms off) it changes nothing.  A ``backward()`` called inside reaches
    the backward ops; ops in a graph that ``torch.compile`` traces inside an
    exemption raise :class:`~deterministic_ctx.MisuseError` saying so.  While an
    exempted op runs, the flag is off for the other threads of the process too
    (it is process-wide).

    Raises:
        ValueError: an op torch does not know (named in the message); nothing is
            changed.
        TypeError: something else than a name or an op.
        TorchFeatureError: this torch cannot intercept one op's call.

    Example:
        >>> import torch
        >>> from deterministic_ctx import allow_nondeterministic, deterministic
        >>> with deterministic(seed=0), allow_nondeterministic("aten::index_add"):
        ...     x = torch.zeros(3).index_add(0, torch.tensor([0, 0]), torch.ones(2))
        >>> x.tolist()
        [2.0, 0.0, 0.0]
    """

    __slots__ = ("_open", "_ops", "names")

    def __init__(self, *ops: object) -> None:
        if not ops:
            raise TypeError(
                "allow_nondeterministic() needs at least one op, e.g. "
                "allow_nondeterministic('aten::upsample_bilinear2d_backward')"
            )
        _dispatch.require_exemption()
        found: dict[Any, None] = {}
        for spec in ops:
            for op in _dispatch.resolve_ops(spec):
                found[op] = None
        self._ops = tuple(found)
        #: The names of the exempted overloads, as torch names them.
        self.names: tuple[str, ...] = tuple(_dispatch.op_label(op) for op in self._ops)
        self._open: list[tuple[object, int, bool]] = []  # (token, thread, key included before)

    def __repr__(self) -> str:
        return f"allow_nondeterministic({', '.join(map(repr, self.names))})"

    def __enter__(self) -> allow_nondeterministic:
        for op in self._ops:  # before anything changes: may raise TorchFeatureError
            if op not in _labels:
                _dispatch.install_exemption(op, functools.partial(_kernel, op))
                _labels[op] = _dispatch.op_label(op)
        token = object()
        # Written out, not through ``guarded``: as a block's entry (see
        # ``deterministic.__enter__``), an interrupt as a helper that entered
        # returns must land under this frame's handler, or ``with`` would call
        # no ``__exit__`` and the ops would stay exempted.
        try:
            return self._enter(token)
        except BaseException:
            complete(self._leave, token)
            raise

    def _enter(self, token: object) -> allow_nondeterministic:
        # Recorded before anything changes: _leave undoes what was done of it.
        me = threading.get_ident()
        before = _dispatch.exemption_included()
        self._open.append((token, me, before))
        _bases.setdefault(me, before)  # the thread's first open exemption sets it
        _entries[token] = (self._ops, me)
        _dispatch.include_exemption(True)
        # Pending signals run here, where they are still undone (as a block's entry).
        drain_signals()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:  # the first line: every later one is under the handler
            token = self._latest()
            complete(self._leave, token)
        except BaseException:
            # Interrupted before ``token`` was found: nothing was left yet.
            found = locals().get("token", _NOT_FOUND)
            complete(self._leave, self._latest() if found is _NOT_FOUND else found)
            raise

    def _latest(self) -> object:
        """The token of the calling thread's latest entry (``None``: none open)."""
        me = threading.get_ident()
        for token, thread, _ in reversed(tuple(self._open)):
            if thread == me:
                return token
        return None

    def _leave(self, token: object) -> None:
        """Idempotent: drop the entry ``token``; once the thread has no exemption
        open, put its dispatch state back as before its first (tasks of one
        thread may leave theirs in any order)."""
        _entries.pop(token, None)
        me = threading.get_ident()
        alone = not any(thread == me for _, thread in tuple(_entries.values()))
        for entry in tuple(self._open):  # other threads may use the same object
            if entry[0] is token:
                if alone:
                    _dispatch.include_exemption(_bases.get(me, entry[2]))
                with suppress(ValueError):
                    self._open.remove(entry)
                break
        if alone:
            _bases.pop(me, None)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                f"allow_nondeterministic(...) decorates a function, not {type(func).__name__}"
            )
        if (
            inspect.isgeneratorfunction(func)
            or inspect.iscoroutinefunction(func)
            or (inspect.isasyncgenfunction(func))
        ):
            raise TypeError(
                f"allow_nondeterministic(...) decorates plain functions; {func.__qualname__} "
                f"is a generator or coroutine function: use `with allow_nondeterministic(...):` "
                f"around the steps that call the op"
            )

        @functools.wraps(func)
        def exempted(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return exempted  # type: ignore[return-value]


def active_exemptions() -> tuple[str, ...]:
    """The ops exempted now by an open ``allow_nondeterministic`` (any thread), sorted."""
    ops = {op for ops, _ in tuple(_entries.values()) for op in ops}
    return tuple(sorted(_labels.get(op, "?") for op in ops))


def is_exempted(op: Any) -> bool:
    """Whether an open ``allow_nondeterministic`` (any thread) exempts the overload ``op``."""
    return bool(_entries) and _exempted(op)


def exempted_calls() -> dict[str, int]:
    """How often each exempted op has run with the check off, since the process
    started (a copy: compare two of them to see what ran in between)."""
    return dict(_ran)


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in a child: the calls, windows and
    exemptions of the others are gone, and the flag is put back if only they
    held it off."""
    me = threading.get_ident()
    _owner.clear()
    for token, thread in tuple(_holders.items()):
        if thread != me:
            del _holders[token]
    saved = _saved[0]
    if not _holders and saved is not None:
        write_alerts(saved)
        _saved[0] = None
    for token, (_, thread) in tuple(_entries.items()):
        if thread != me:
            del _entries[token]
    for thread in tuple(_bases):
        if thread != me:
            del _bases[thread]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
