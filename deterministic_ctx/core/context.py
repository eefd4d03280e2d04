"""``deterministic``: the ``with`` / ``async with`` block, and the decorator.

Each ``with`` is one :class:`~deterministic_ctx.core.engine.Block`; this module
only validates the arguments, finds the block an ``__exit__`` means (the
latest one of the object that its thread and asyncio task entered, from the
scope stack's record of the thread's ``with`` blocks) and makes sure an
interrupted ``__exit__`` still leaves.  As a decorator, ``deterministic`` is
:func:`~deterministic_ctx.core.decorate.reproducible`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from inspect import CO_ASYNC_GENERATOR, CO_COROUTINE, CO_GENERATOR, CO_ITERABLE_COROUTINE
from types import FrameType, TracebackType
from typing import Any, TypeVar, cast, overload

from .._errors import MisuseError
from ..base.scopes import SCOPES
from ..base.settings import CompiledRng, Rank, Settings, check_bool
from .decorate import decorate
from .engine import Block, drain_signals, opaque, pause_compiler, resume_compiler

__all__ = ["deterministic", "isolated"]

F = TypeVar("F", bound=Callable[..., Any])
_B = TypeVar("_B", bound="_Blocks")


#: What a ``with`` entered inside compiled code paused: dynamo's callback, and
#: the frame that entered, which alone may give it back (see ``__exit__``).
_Paused = tuple[object, FrameType] | None
#: Frames that can suspend with the block open and resume after the compiled
#: call that paused dynamo has returned: their exit never gives its callback back.
_SUSPENDABLE = CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR | CO_ITERABLE_COROUTINE

#: Dynamo's message when a block appears in compiled code: a graph break, or
#: under ``fullgraph=True`` an error whose text includes this.
_IN_COMPILED_CODE = (
    "deterministic-ctx: a `with deterministic(...)` / `isolated()` block changes "
    "process-global RNG state and flags, which cannot be part of a graph; dynamo runs "
    "the function that contains it eagerly (the block's body draws eager's random "
    "numbers). Under fullgraph=True, move the block around the compiled call instead: "
    "`with deterministic(0): compiled(x)`."
)


class _With(Block):
    """One ``with`` (or ``async with``) of a block object ``of``: a
    :class:`~deterministic_ctx.core.engine.Block` that also knows the asyncio
    task (``task``, ``None`` for a ``with``) that entered it, what its entry
    paused (``paused``), and whether its ``__exit__`` has completed
    (``exited``).  Its thread is the one whose ``with`` blocks list it
    (:meth:`~deterministic_ctx.base.scopes.Scopes.withs`)."""

    __slots__ = ("exited", "of", "paused", "task")

    def __init__(self, of: _Blocks, task: object, paused: _Paused) -> None:
        Block.__init__(self, of._settings)
        self.of = of
        self.task = task
        self.paused = paused
        self.exited = False


#: The ``task`` of the blocks :meth:`_Blocks.start` enters: never an asyncio task
#: or ``None``, so ``__exit__`` never leaves one of them and ``stop()`` nothing else.
_STARTED = object()


def _enter(block: _With) -> None:
    """Record ``block`` in its thread's ``with`` blocks and start it; pending
    signal handlers run at its end, while the entry can still be undone."""
    SCOPES.enter_with(block)  # recorded first: an interrupt below still finds it
    block.start()
    drain_signals()


def _undo_entry(block: _With) -> None:
    """``__enter__`` (or ``start()``) failed: ``with`` calls ``__exit__`` only
    if ``__enter__`` returned, so leave ``block`` now (nothing to do if it was
    never entered).  Not the decorator's ``_abandon``, which closes a body."""
    try:
        block.stop()
    finally:
        block.exited = True
        if block.paused is not None:
            resume_compiler(block.paused[0])


def _paused_here(callback: object) -> _Paused:
    """What ``__enter__`` keeps when it paused dynamo's ``callback``: the
    callback and the frame of the ``with``."""
    frame = sys._getframe(2)  # the frame of the ``with`` (above __enter__)
    return None if frame.f_code.co_flags & _SUSPENDABLE else (callback, frame)


def _current_task() -> object:
    """The running asyncio task, or ``None``: never imports asyncio itself."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop (another framework drives the coroutine)
        return None


class _Blocks:
    """What :class:`deterministic` and :class:`isolated` share: each ``with``
    (or ``async with``) is one :class:`~deterministic_ctx.core.engine.Block` of
    these settings (``None``: capture and restore, apply nothing)."""

    __slots__ = ("_enabled", "_settings")

    _settings: Settings | None
    #: ``False``: ``deterministic(..., enabled=False)``, every use a no-op.
    _enabled: bool

    def _find(self, task: object) -> _With | None:
        """The calling thread's latest block of this object for ``task`` (an
        asyncio task, ``None`` for a ``with``, :data:`_STARTED` for
        :meth:`start`) that has not left: so one object (``DET =
        deterministic(seed=0)`` at module level) can be entered by many
        threads and tasks at once, each leaving its blocks in its own order."""
        # The stack keeps the ``with`` records of this module only, each a _With.
        return cast("_With | None", SCOPES.latest_with(self, task))

    def _latest(self, task: object) -> _With:
        """:meth:`_find`'s block; :class:`MisuseError` if there is none."""
        block = cast("_With | None", SCOPES.latest_with(self, task))
        if block is not None:
            return block
        if task is _STARTED:
            raise MisuseError(
                f"{self!r}.stop() without a matching start() in this thread: each stop() "
                f"leaves the latest block that start() opened on this object in the same "
                f"thread (not a `with` block of it), once"
            )
        raise MisuseError("deterministic block exited without being entered")

    def _leave(self, task: object) -> _Paused:
        """Complete an interrupted ``__exit__`` (``stop()`` is idempotent) and
        return what its entry paused."""
        block = self._latest(task)
        block.stop()
        block.exited = True
        return block.paused

    def __enter__(self: _B) -> _B:
        if not self._enabled:
            return self
        # Inside a compiled function (which dynamo then runs eagerly, see
        # _IN_COMPILED_CODE) the frames the body calls must run eagerly too,
        # or they would be compiled and draw inductor's numbers: dynamo is
        # paused first, until the exit.  Outside compiled code this swaps None
        # for None (``_paused_here`` only inside compiled code: no frame for it
        # elsewhere).
        callback = pause_compiler()
        block = _With(self, None, None if callback is None else _paused_here(callback))
        # Written out, not through a helper that enters: Python 3.10 runs
        # pending signal handlers as every call returns (CALL_FUNCTION's
        # eval-breaker check), and so does any Python with a PEP 523 frame
        # evaluator installed (dynamo's, once anything was compiled), so an
        # interrupt as such a helper returned would raise from ``__enter__``
        # with the block open, and ``with`` calls no ``__exit__`` then.  Here
        # it lands in the ``try``; ``_enter`` runs the last pending ones at its
        # end, and ``return self`` checks none.  The same for ``__aenter__``
        # and ``start()``.
        try:
            _enter(block)
            return self
        except BaseException:
            _undo_entry(block)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Written out, ``try`` first: 3.10 checks for pending signals at a
        # frame's start unless it opens a ``try`` (SETUP_FINALLY), and a
        # helper's frame start (3.11+: its RESUME) would be one more point
        # outside every handler, where the block is left open.
        try:
            if not self._enabled:
                return
            # Dynamo paused before any Python frame (see __enter__).
            now = pause_compiler()
            block = self._latest(None)
            block.stop()
            block.exited = True  # last, and no call after it: an interrupt lands before it or never
        except BaseException:
            if self._enabled:
                paused = self._leave(None)
                if paused is not None and paused[1] is sys._getframe(1):
                    resume_compiler(paused[0])
            raise
        # Given back: the callback the entry paused, by the frame that entered
        # (a ``with`` in compiled code); anywhere else (an ExitStack, a
        # generator resumed later) what was in force here, which may be no
        # callback at all: a compiled call's callback must not outlive it.
        # After the block is left, an interrupt here costs dynamo its callback
        # until the compiled call returns, never a restore.
        paused = block.paused
        resume_compiler(paused[0] if paused is not None and paused[1] is sys._getframe(1) else now)
        block.paused = None  # the left block stays listed until the next entry: not its frame

    async def __aenter__(self: _B) -> _B:
        if not self._enabled:
            return self
        # Written out, as ``__enter__``: the block is made before the ``try``,
        # so an interrupt at any line of the entry finds it to undo.
        block = _With(self, _current_task(), None)
        try:
            _enter(block)
            return self
        except BaseException:
            _undo_entry(block)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Each task leaves its own block, whatever the order the tasks leave in.
        try:
            if not self._enabled:
                return
            block = self._latest(_current_task())
            block.stop()
            block.exited = True  # last, and no call after it, as in __exit__
        except BaseException:
            if self._enabled:
                self._leave(_current_task())
            raise

    def start(self: _B) -> _B:
        """Enter a block, as ``__enter__`` does, for code that cannot use ``with``
        (``setUp`` with ``addCleanup(obj.stop)``, a pytest fixture); returns the object.

        Leave it with :meth:`stop` in the same thread.  The block is an
        ordinary one: nested with ``with`` blocks and other started ones in
        any order, one thread at a time (the lock is held until ``stop()``),
        and a thread that ends without ``stop()`` is handled like one that
        ends inside a ``with`` (:class:`~deterministic_ctx.AbandonedBlockWarning`).

        Example:
            >>> import torch
            >>> from deterministic_ctx import deterministic
            >>> det = deterministic(seed=0).start()
            >>> a = torch.rand(2)
            >>> det.stop()
            >>> with deterministic(seed=0):
            ...     torch.equal(torch.rand(2), a)
            True
        """
        if not self._enabled:
            return self
        # Written out, as ``__enter__``; once it returns, an interrupt lands in
        # the caller, which has no block to stop yet: a window no entry closes.
        block = _With(self, _STARTED, None)
        try:
            _enter(block)
            return self
        except BaseException:
            _undo_entry(block)
            raise

    def stop(self) -> None:
        """Leave the latest block :meth:`start` entered on this object in this
        thread, as ``__exit__`` does: everything is restored (or handed on to
        a block entered after it that is still open), even if interrupted.

        Raises :class:`~deterministic_ctx.MisuseError` if this thread has no
        such block open: stop() without start(), twice, or in another thread.
        """
        try:
            if not self._enabled:
                return
            block = self._latest(_STARTED)
            block.stop()
            block.exited = True  # last, and no call after it, as in __exit__
        except BaseException:
            if self._enabled and self._find(_STARTED) is not None:
                self._leave(_STARTED)
            raise

    def __call__(self, func: F) -> F:
        return decorate(func, self._settings) if self._enabled else func


# Opaque to dynamo (see _torch/compiler.py): a ``with`` in compiled code is one
# clean graph break, never a trace through the engine's C calls.
# Entry and exit pause dynamo themselves (recursive=False): the pause must
# outlive the entry's frame.  Dynamo compiles no coroutine: the async pair
# only needs to stay untraced.
opaque(_Blocks.__enter__, _IN_COMPILED_CODE, recursive=False)
opaque(_Blocks.__exit__, _IN_COMPILED_CODE, recursive=False)
opaque(_Blocks.__aenter__, _IN_COMPILED_CODE, recursive=True)
opaque(_Blocks.__aexit__, _IN_COMPILED_CODE, recursive=True)
opaque(_Blocks.start, _IN_COMPILED_CODE, recursive=True)
opaque(_Blocks.stop, _IN_COMPILED_CODE, recursive=True)


class deterministic(
    _Blocks
):  # lowercase: it reads like a function, ``with deterministic(seed=0):``
    """Run a block reproducibly and isolated from the rest of the program.

    On entry every RNG (Python ``random``, NumPy's global RNG, torch CPU and
    accelerators, registered user RNGs) and every determinism flag is
    captured; then the RNGs are seeded exactly as ``random.seed(seed);
    np.random.seed(seed); torch.manual_seed(seed)`` would, and deterministic
    algorithms are turned on (``warn_only`` as given), cuDNN made
    deterministic, ``CUBLAS_WORKSPACE_CONFIG`` and ``PYTHONHASHSEED`` set.
    On exit, by any route, everything is restored bit for bit: the caller's
    streams continue as if the block never ran.

    The object can be reused for any number of blocks, nested or in a row;
    each starts from ``seed``.  One object may be shared by many threads: its
    open blocks are kept per thread, and blocks in different threads run one
    at a time.  As a decorator it is exactly :func:`reproducible`.

    ``async with`` works too and restores on every exit, but cannot hide the
    block from other tasks that run while it awaits: to isolate interleaved
    tasks, decorate the coroutine function with :func:`reproducible` instead.

    Args:
        seed: an int in ``0 .. 2**32 - 1`` (NumPy integers accepted).
        warn_only: deterministic algorithms warn instead of raising when an
            operation has no deterministic implementation.
        rank: for multi-process training, the process's rank (a non-negative
            int), ``"auto"`` for its rank in the initialized
            ``torch.distributed`` process group (0 without one, looked up each
            time a block starts), or ``None``.  Python ``random``, NumPy and
            registered user RNGs then get a well-mixed per-rank seed, so
            augmentation differs across ranks; torch's generators keep
            ``seed`` on every rank, so model initialization is identical.
            Rank 0 draws exactly what ``rank=None`` draws.
        flags: with ``False``, the block seeds and isolates but applies no
            determinism flag and no environment variable: the caller's stay
            in force (and are still captured and restored).  For models that
            use ops without a deterministic CUDA kernel.
        fill_uninitialized_memory: the value of
            ``torch.utils.deterministic.fill_uninitialized_memory`` inside the
            block: ``False`` skips filling new tensors (torchtitan's choice:
            the fill costs time and races with communication streams).  With
            ``flags=False`` no flag is set, this one included.
        compiled_rng: ``"eager"`` makes code compiled with ``torch.compile``
            in the block draw eager's random numbers (inductor's
            ``fallback_random``: random ops run eager's kernels, unfused;
            ``torch._inductor`` is imported if it is not yet).  ``None``
            (default) leaves inductor's setting as it is: compiled code draws
            its own numbers, reproducible run to run but not equal to eager's.
            Either way, inductor's random-number settings are restored on exit.
        enabled: with ``False`` (like ``torch.random.fork_rng(enabled=False)``)
            every use of the object does nothing: a block neither seeds nor
            captures nor isolates (the body draws from the caller's streams
            and keeps what it changes), and as a decorator it returns the
            function unchanged.  For code that makes determinism a switch:
            ``with deterministic(seed=0, enabled=args.deterministic):``.  The
            other arguments are still checked.

    Inside a function compiled with ``torch.compile``, a block is a graph
    break: dynamo runs that function eagerly and the block's body draws
    eager's random numbers (an error under ``fullgraph=True``).

    Example:
        >>> import torch
        >>> from deterministic_ctx import deterministic
        >>> with deterministic(seed=0):
        ...     a = torch.rand(2)
        >>> with deterministic(seed=0):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """

    __slots__ = ()
    _settings: Settings

    def __init__(
        self,
        seed: int,
        *,
        warn_only: bool = False,
        rank: Rank = None,
        flags: bool = True,
        fill_uninitialized_memory: bool = True,
        compiled_rng: CompiledRng = None,
        enabled: bool = True,
    ) -> None:
        if callable(seed):  # ``@deterministic`` without arguments: say what to write
            name = getattr(seed, "__name__", type(seed).__name__)
            raise TypeError(
                f"deterministic needs a seed: write @deterministic(seed=0) above {name}, "
                f"or @reproducible, whose seed defaults to 0"
            )
        self._settings = Settings.build(
            seed, warn_only, rank, flags, fill_uninitialized_memory, compiled_rng
        )
        self._enabled = check_bool(enabled, "enabled")

    @property
    def seed(self) -> int:
        """The seed every block of this object starts from."""
        return self._settings.seed

    @property
    def warn_only(self) -> bool:
        """Whether deterministic algorithms only warn inside the block."""
        return self._settings.warn_only

    @property
    def rank(self) -> Rank:
        """The ``rank`` given: an int, ``"auto"`` or ``None``."""
        return self._settings.rank

    @property
    def flags(self) -> bool:
        """Whether the block sets the determinism flags and variables (else the caller's stay)."""
        return self._settings.flags

    @property
    def fill_uninitialized_memory(self) -> bool:
        """``torch.utils.deterministic.fill_uninitialized_memory`` inside the block."""
        return self._settings.fill_uninitialized_memory

    @property
    def compiled_rng(self) -> CompiledRng:
        """``"eager"`` if compiled code draws eager's random numbers in the block, else ``None``."""
        return self._settings.compiled_rng

    @property
    def enabled(self) -> bool:
        """``False`` if every use of this object is a no-op (``enabled=False``)."""
        return self._enabled

    def __repr__(self) -> str:
        rank = "" if self.rank is None else f", rank={self.rank!r}"
        flags = "" if self.flags else ", flags=False"
        fill = "" if self.fill_uninitialized_memory else ", fill_uninitialized_memory=False"
        rng = "" if self.compiled_rng is None else f", compiled_rng={self.compiled_rng!r}"
        off = "" if self._enabled else ", enabled=False"
        return (
            f"deterministic(seed={self.seed}, warn_only={self.warn_only}"
            f"{rank}{flags}{fill}{rng}{off})"
        )


class isolated(_Blocks):  # lowercase, like ``deterministic``
    """Run a block isolated from the rest of the program, seeding nothing.

    ``torch.random.fork_rng`` and Lightning's ``isolate_rng``, for every RNG
    and flag: on entry everything a :class:`deterministic` block captures is
    captured (every RNG, registered RNGs, determinism and precision flags,
    torch's defaults, the managed environment variables), and nothing is
    applied: the block draws from the caller's streams and runs with the
    caller's flags.  On exit, by any route, everything is restored bit for
    bit, so the caller's streams continue as if the block never ran.  Same
    lock, exit-path and exit-order guarantees as a deterministic block.

    As a decorator (``@isolated`` or ``@isolated()``) it works on every kind
    of callable :func:`reproducible` takes: each call of a function, and each
    generator, coroutine or async generator in its own world across every
    ``yield``/``await`` (its first step starts from the caller's state at
    that moment).

    Example:
        >>> import torch
        >>> from deterministic_ctx import isolated
        >>> _ = torch.manual_seed(1)
        >>> with isolated():
        ...     inside = torch.rand(2)  # the caller's next numbers
        >>> torch.equal(torch.rand(2), inside)  # the stream is as before the block
        True
    """

    __slots__ = ()

    @overload
    def __new__(cls, func: None = None, /) -> isolated: ...
    @overload
    def __new__(cls, func: F, /) -> F: ...  # type: ignore[misc]

    def __new__(cls, func: Any = None, /) -> Any:
        if func is not None:  # ``@isolated`` without parentheses
            return decorate(func, None)
        self = super().__new__(cls)
        self._settings = None
        self._enabled = True
        return self

    def __repr__(self) -> str:
        return "isolated()"
