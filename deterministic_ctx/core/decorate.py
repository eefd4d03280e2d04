"""``reproducible``: one isolated block per call, for every kind of callable.

A sync context manager around a generator or coroutine function exits before
the body runs (the bug of ``contextlib.ContextDecorator``, ``mock.patch``,
``np.errstate`` on coroutines).  Here each call gets its own
:class:`~deterministic_ctx.core.engine.Block`; for generators, coroutines and
async generators the block is *resumed* before every step of the body and
*suspended* at every ``yield``/``await`` suspension, so callers and
interleaved tasks never see each other's streams.  Nothing here depends on
asyncio: the driver only forwards ``send``/``throw``/``close``.
"""

from __future__ import annotations

import functools
import inspect
import types
import unittest
from collections.abc import Callable, Generator
from typing import Any, NoReturn, TypeVar, cast, overload

from ..base.completion import guarded
from ..base.settings import CompiledRng, Rank, Settings, check_bool
from .engine import Block, opaque

__all__ = ["DEFAULT_SEED", "decorate", "reproducible"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

#: The seed of a bare ``@reproducible``.
DEFAULT_SEED = 0

#: Dynamo's message when compiled code calls a decorated function: a graph
#: break, or under ``fullgraph=True`` an error whose text includes this.
_IN_COMPILED_CODE = (
    "deterministic-ctx: a @reproducible / @isolated function runs in its own block, "
    "which changes process-global RNG state and flags and cannot be part of a graph; "
    "it is called eagerly, outside the graph (its body draws eager's random numbers). "
    "Under fullgraph=True, call it outside the compiled function, or compile its body "
    "and decorate the compiled function."
)


def _step(
    it: Any, block: Block, end: Callable[[], None], value: Any, to_throw: BaseException | None
) -> tuple[Any, bool]:
    """One step of ``it`` in ``block``: ``(value, finished)``; the block is left
    after it (``end`` when ``it`` is finished, else suspended).  An exception
    of the body propagates with the block entered: the caller's guard leaves it."""
    block.start()
    try:
        value = it.send(value) if to_throw is None else it.throw(to_throw)
    except StopIteration as stop:
        end()
        return stop.value, True
    block.suspend()
    return value, False


def _close(it: Any, block: Block, end: Callable[[], None]) -> None:
    """Close ``it`` in its own world: its cleanup neither runs later, outside
    every block, nor is lost.  ``end`` leaves the block then."""
    if block.suspended:
        block.start()
    close = getattr(it, "close", None)  # an ``__await__`` iterator may have none
    if close is not None:
        close()
    end()


@types.coroutine
def _steps(it: Any, block: Block, *, final: bool) -> Generator[Any, Any, Any]:
    """Drive ``it`` step by step in ``block`` (:func:`_drive`); whatever ends the
    driving with an exception, ``it`` is closed in its own world first.

    ``yield from`` it in a generator, ``await`` it in a coroutine: ``it`` may
    be an awaitable object (an async generator's ``asend()``), driven through
    its ``__await__``.  :func:`_drive` is a frame of its own: an interrupt
    at the line of its ``try:`` around a ``yield`` (as ``close()`` resumes
    it) has no handler in that frame, and is caught here."""
    if not hasattr(it, "send"):
        it = it.__await__()
    end = block.stop if final else block.suspend
    try:
        return (yield from _drive(it, block, end))
    except BaseException:
        _abandon(it, block, end)
        raise


def _drive(it: Any, block: Block, end: Callable[[], None]) -> Generator[Any, Any, Any]:
    """Drive ``it`` (generator, coroutine, or awaitable iterator) step by step,
    resuming ``block`` around each step.

    ``end`` leaves the block when ``it`` is done: ``stop`` (generators,
    coroutines), or ``suspend`` when more steps of the same world follow
    (async generators).  Each step (:func:`_step`) is guarded by
    ``suspend`` (:func:`~deterministic_ctx.base.completion.guarded`;
    ``stop``/``suspend`` are idempotent), so an interrupt at any point of the
    step still leaves the caller's state restored.
    """
    send_value: Any = None
    to_throw: BaseException | None = None
    while True:
        # Interrupted: keep the body's world (``_steps`` closes the body in
        # it); suspending is a no-op if the block already left.
        value, done = guarded(block.suspend, _step, it, block, end, send_value, to_throw)
        to_throw = None
        if done:
            return value
        try:
            send_value = yield value
        except GeneratorExit:
            # close() or garbage collection: run the body's cleanup in its own
            # world; interrupted, as above (``_steps`` finishes the closing).
            guarded(block.suspend, _close, it, block, end)
            raise
        except BaseException as exc:
            to_throw, send_value = exc, None


def _abandon(it: Any, block: Block, end: Callable[[], None]) -> None:
    """An exception stopped the driver of ``it``: the body's own, or an
    interrupt (the exit it stopped has completed itself).  Close ``it`` in its
    own world, and leave it whatever the closing does."""
    guarded(end, _close, it, block, end)


def _run(block: Block, func: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Start ``block``, then call ``func``: ``(result, None)`` or ``(None,
    exception)``.  The body's exception is returned, not raised: its block is
    then left on the normal path, inside the guard's ``try``, not in a handler
    that an interrupt could stop at its first line."""
    block.start()
    try:
        return func(*args, **kwargs), None
    except BaseException as exc:
        return None, exc


def _reraise(error: BaseException) -> NoReturn:
    """Raise the body's exception again once the block is left, without
    listing the wrapper twice in its traceback."""
    tb = error.__traceback__
    try:
        raise error.with_traceback(tb.tb_next if tb is not None else None)
    finally:
        del error, tb  # no reference cycle through this frame


def _wrap_function(func: Callable[..., Any], settings: Settings | None) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        block = Block(settings)
        # Left on both outcomes of the body, and completed whatever line an
        # interrupt lands on; the body's own exception is raised once it is left.
        result, error = guarded(block.stop, _run, block, func, args, kwargs, after=True)
        if error is not None:
            _reraise(error)
        return result

    return wrapper


def _wrap_generator(func: Callable[..., Any], settings: Settings | None) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Creating the generator runs none of its code; the block is seeded on
        # the first next().
        return (yield from _steps(func(*args, **kwargs), Block(settings), final=True))

    return wrapper


def _wrap_coroutine(func: Callable[..., Any], settings: Settings | None) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await _steps(func(*args, **kwargs), Block(settings), final=True)

    return wrapper


def _wrap_async_generator(
    func: Callable[..., Any], settings: Settings | None
) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen = func(*args, **kwargs)
        block = Block(settings)
        send_value: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                step = agen.asend(send_value) if to_throw is None else agen.athrow(to_throw)
                to_throw = None
                try:
                    value = await _steps(step, block, final=False)
                except StopAsyncIteration:
                    return
                try:
                    send_value = yield value
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    to_throw, send_value = exc, None
        finally:
            # Closing runs the body's own finally blocks inside its world.
            await _steps(agen.aclose(), block, final=False)

    return wrapper


#: Set on the ``setUp``/``setUpClass`` a decorated TestCase gets: the class's
#: own method it wraps, or ``None`` if it had none (the inherited one runs).
_WRAPPED = "__deterministic_ctx_wraps__"


def _own(klass: type, name: str) -> Any:
    """``klass``'s own ``name`` (not inherited), as a plain function; ``None``: none."""
    found = klass.__dict__.get(name)
    return found.__func__ if isinstance(found, classmethod) else found


def _inherited(cls: type, name: str) -> Callable[..., Any]:
    """The first ``name`` after ``cls`` in its MRO, as a plain function, with the
    block of a decorated base taken off: the closest decoration wins, so a
    decorated subclass runs its base's setUp in its own block, not in two."""
    for base in cls.__mro__[1:]:
        func = _own(base, name)
        if func is not None and (wrapped := getattr(func, _WRAPPED, func)) is not None:
            return cast(Callable[..., Any], wrapped)
    raise AttributeError(name)  # unreachable: unittest.TestCase defines both


def _closest(klass: type, name: str) -> type | None:
    """The class nearest to ``klass`` in its MRO whose ``name`` is a decorated wrapper."""
    return next((base for base in klass.__mro__ if hasattr(_own(base, name), _WRAPPED)), None)


def _start_until_cleanup(block: Block, test: unittest.TestCase) -> None:
    block.start()
    test.addCleanup(block.stop)


def _decorate_testcase(
    cls: type[unittest.TestCase], settings: Settings | None
) -> type[unittest.TestCase]:
    # Decorated twice: the closest decoration wins.
    own_setup, own_setup_class = (
        getattr(func, _WRAPPED, func) for func in (_own(cls, "setUp"), _own(cls, "setUpClass"))
    )

    def setUp(self: unittest.TestCase) -> None:
        setup = own_setup or _inherited(cls, "setUp")
        if _closest(type(self), "setUp") is not cls:
            # ``super().setUp()`` from a decorated subclass: its block is open.
            setup(self)
            return
        block = Block(settings)
        # The first cleanup registered runs last: after tearDown and every
        # other cleanup, and also when setUp itself fails.
        guarded(block.stop, _start_until_cleanup, block, self)
        setup(self)

    def setUpClass(klass: type[unittest.TestCase]) -> None:
        setup_class = own_setup_class or _inherited(cls, "setUpClass")
        if _closest(klass, "setUpClass") is not cls:
            setup_class(klass)
            return
        _wrap_function(setup_class, settings)(klass)  # one block, as for a decorated call

    setattr(setUp, _WRAPPED, own_setup)
    setattr(setUpClass, _WRAPPED, own_setup_class)
    setUp.__qualname__ = f"{cls.__qualname__}.setUp"
    setUpClass.__qualname__ = f"{cls.__qualname__}.setUpClass"
    cls.setUp = setUp  # type: ignore[method-assign]
    cls.setUpClass = classmethod(setUpClass)  # type: ignore[assignment,method-assign]
    return cls


def decorate(obj: C, settings: Settings | None) -> C:
    """Wrap ``obj`` so each call (or each test) runs in its own block.

    Dispatches on the kind of callable: ``unittest.TestCase`` subclass, async
    generator function, coroutine function, generator function, other callable.
    """
    if isinstance(obj, (staticmethod, classmethod)):
        return type(obj)(decorate(obj.__func__, settings))
    if isinstance(obj, type):
        if issubclass(obj, unittest.TestCase):
            return _decorate_testcase(obj, settings)  # type: ignore[return-value]
        raise TypeError(
            f"reproducible cannot decorate class {obj.__qualname__}: only functions, "
            "methods, generator/coroutine functions and unittest.TestCase subclasses"
        )
    if isinstance(obj, property):
        raise TypeError(
            "reproducible cannot decorate a property object: put it below @property, so "
            "that it decorates the getter (@property, then @reproducible, then def ...)"
        )
    if not callable(obj):
        raise TypeError(
            f"reproducible expects a callable or a unittest.TestCase subclass, "
            f"got {type(obj).__name__} {obj!r}"
        )
    if inspect.isasyncgenfunction(obj):
        wrapper = _wrap_async_generator(obj, settings)
    elif inspect.iscoroutinefunction(obj):
        wrapper = _wrap_coroutine(obj, settings)
    elif inspect.isgeneratorfunction(obj):
        wrapper = _wrap_generator(obj, settings)
    else:
        wrapper = _wrap_function(obj, settings)
    # Called from compiled code: one graph break, then the whole call (entry,
    # body, exit) runs eagerly (see _torch/compiler.py).
    return cast(C, opaque(wrapper, _IN_COMPILED_CODE, recursive=True))


@overload
def reproducible(func: F, /) -> F: ...
@overload
def reproducible(
    *,
    seed: int = ...,
    warn_only: bool = ...,
    rank: Rank = ...,
    flags: bool = ...,
    fill_uninitialized_memory: bool = ...,
    compiled_rng: CompiledRng = ...,
    enabled: bool = ...,
) -> Callable[[F], F]: ...


def reproducible(
    func: Any = None,
    /,
    *,
    seed: int = DEFAULT_SEED,
    warn_only: bool = False,
    rank: Rank = None,
    flags: bool = True,
    fill_uninitialized_memory: bool = True,
    compiled_rng: CompiledRng = None,
    enabled: bool = True,
) -> Any:
    """Make every call of a function (or every test of a TestCase) a fresh block.

    Works on plain functions and methods, generator functions, coroutine
    functions, async generator functions and ``unittest.TestCase`` classes.
    Each call starts from ``seed`` (default 0) and leaves the caller's random
    state untouched.  A generator or coroutine gets its own RNG world, seeded
    at its first step and swapped out at every ``yield``/``await``, so the
    values it produces do not depend on what the caller or other tasks draw
    in between.  ``@deterministic(seed=s)`` is the same decorator.  ``rank``
    is as in :class:`deterministic`; ``"auto"`` is looked up at each call, so
    decorating at import time, before the process group exists, is fine.
    ``flags``, ``fill_uninitialized_memory`` and ``compiled_rng`` are as in
    :class:`deterministic`.  With ``enabled=False`` (checked like the other
    options) the function is returned unchanged: its calls run no block.
    Called from code compiled with ``torch.compile``,
    a decorated function is a graph break and runs eagerly, body included.

    Example:
        >>> import numpy as np
        >>> from deterministic_ctx import reproducible
        >>> @reproducible(seed=3)
        ... def noise(n):
        ...     return np.random.rand(n)
        >>> bool((noise(4) == noise(4)).all())
        True
    """
    settings = Settings.build(seed, warn_only, rank, flags, fill_uninitialized_memory, compiled_rng)
    if not check_bool(enabled, "enabled"):
        return (lambda f: f) if func is None else func
    if func is None:
        return lambda f: decorate(f, settings)
    return decorate(func, settings)
