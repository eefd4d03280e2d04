"""``reproducible``: one isolated block per call, for every kind of callable.

A sync context manager around a generator or coroutine function exits before
the body runs (the bug of ``contextlib.ContextDecorator``, ``mock.patch``,
``np.errstate`` on coroutines).  Here each call gets its own
:class:`~deterministic_ctx.context._Block`; for generators, coroutines and
async generators the block is *resumed* before every step of the body and
*suspended* at every ``yield``/``await`` suspension, so callers and
interleaved tasks never see each other's streams.  Nothing here depends on
asyncio: the driver only forwards ``send``/``throw``/``close``.
"""

from __future__ import annotations

import functools
import inspect
import unittest
from collections.abc import Callable, Generator
from typing import Any, TypeVar, cast, overload

from ._settings import Rank, Settings
from .context import _Block

__all__ = ["DEFAULT_SEED", "decorate", "reproducible"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

#: The seed of a bare ``@reproducible``.
DEFAULT_SEED = 0


def _steps(it: Any, block: _Block, *, final: bool) -> Generator[Any, Any, Any]:
    """Drive ``it`` (generator, coroutine, or awaitable iterator) step by step,
    resuming ``block`` around each step.

    ``final``: the block ends with ``it`` (generators, coroutines); otherwise
    it is suspended, because more steps of the same world follow (async gens).
    """
    end = block.finish if final else block.suspend
    send_value: Any = None
    to_throw: BaseException | None = None
    while True:
        block.resume()
        try:
            if to_throw is not None:
                exc, to_throw = to_throw, None
                value = it.throw(exc)
            else:
                value = it.send(send_value)
        except StopIteration as stop:
            end()
            return stop.value
        except BaseException:
            end()
            raise
        block.suspend()
        try:
            send_value = yield value
        except GeneratorExit:
            # close() or garbage collection: run the body's cleanup in its own world.
            block.resume()
            try:
                it.close()
            finally:
                end()
            raise
        except BaseException as exc:
            to_throw, send_value = exc, None


class _Isolated:
    """An awaitable that runs ``awaitable``'s steps inside ``block``."""

    __slots__ = ("_awaitable", "_block", "_final")

    def __init__(self, awaitable: Any, block: _Block, final: bool) -> None:
        self._awaitable, self._block, self._final = awaitable, block, final

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self._awaitable
        if not hasattr(it, "send"):  # an awaitable object, not a coroutine
            it = it.__await__()
        return _steps(it, self._block, final=self._final)


def _wrap_function(func: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        block = _Block(settings)
        block.resume()
        try:
            return func(*args, **kwargs)
        finally:
            block.finish()

    return wrapper


def _wrap_generator(func: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Creating the generator runs none of its code; the block is seeded on
        # the first next().
        return (yield from _steps(func(*args, **kwargs), _Block(settings), final=True))

    return wrapper


def _wrap_coroutine(func: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await _Isolated(func(*args, **kwargs), _Block(settings), final=True)

    return wrapper


def _wrap_async_generator(func: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        agen = func(*args, **kwargs)
        block = _Block(settings)
        send_value: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                if to_throw is not None:
                    exc, to_throw = to_throw, None
                    step = agen.athrow(exc)
                else:
                    step = agen.asend(send_value)
                try:
                    value = await _Isolated(step, block, final=False)
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
            await _Isolated(agen.aclose(), block, final=False)

    return wrapper


def _decorate_testcase(cls: type[unittest.TestCase], settings: Settings) -> type[unittest.TestCase]:
    own_setup = cls.__dict__.get("setUp")
    own_setup_class = cls.__dict__.get("setUpClass")

    def setUp(self: unittest.TestCase) -> None:
        block = _Block(settings)
        block.resume()
        # The first cleanup registered runs last: after tearDown and every
        # other cleanup, and also when setUp itself fails.
        self.addCleanup(block.finish)
        if own_setup is not None:
            own_setup(self)
        else:
            cast(Any, super(cls, self)).setUp()

    def setUpClass(klass: type[unittest.TestCase]) -> None:
        block = _Block(settings)
        block.resume()
        try:
            if own_setup_class is not None:
                own_setup_class.__func__(klass)
            else:
                cast(Any, super(cls, klass)).setUpClass()
        finally:
            block.finish()

    setUp.__qualname__ = f"{cls.__qualname__}.setUp"
    setUpClass.__qualname__ = f"{cls.__qualname__}.setUpClass"
    cls.setUp = setUp  # type: ignore[method-assign]
    cls.setUpClass = classmethod(setUpClass)  # type: ignore[assignment,method-assign]
    return cls


def decorate(obj: C, settings: Settings) -> C:
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
    return cast(C, wrapper)


@overload
def reproducible(func: F, /) -> F: ...
@overload
def reproducible(
    *, seed: int = ..., warn_only: bool = ..., rank: Rank = ...
) -> Callable[[F], F]: ...


def reproducible(
    func: Any = None, /, *, seed: int = DEFAULT_SEED, warn_only: bool = False, rank: Rank = None
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

    Example:
        >>> import numpy as np
        >>> from deterministic_ctx import reproducible
        >>> @reproducible(seed=3)
        ... def noise(n):
        ...     return np.random.rand(n)
        >>> bool((noise(4) == noise(4)).all())
        True
    """
    settings = Settings.build(seed, warn_only, rank)
    if func is None:
        return lambda f: decorate(f, settings)
    return decorate(func, settings)
