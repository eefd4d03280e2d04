"""The engine: :class:`Block`, one isolated RNG world, and the bookkeeping of open blocks.

Part of the internal API (:mod:`deterministic_ctx.internal`).  A block's four
operations are the whole engine; plain blocks, decorated functions,
generators, coroutines, async generators and ``seed_everything`` are all made
of them:

* ``start()``: take the lock, capture the caller's state, then either apply
  the block's settings (first time; none for an isolation-only block) or
  restore the block's own saved state;
* ``suspend()``: save the block's state, restore the caller's, drop the lock;
* ``stop()``: restore the caller's state (or hand it on), drop the lock;
* ``commit()``: keep the block's state as the process's own, drop the lock.

Which blocks are open, where, is the scope stack's record
(:mod:`deterministic_ctx.base.scopes`), and it makes every change to it
(``_active`` here is its list of the lock holder's open blocks, for
reading).  A thread holds the lock once while it has any block open.

The RNGs and flags are the sources' work: this module reaches torch only
through :mod:`deterministic_ctx._torch.compiler` (where blocks meet
``torch.compile`` and ``torch.export``).  It also keeps the process's random
state right across ``os.fork``.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable

from .. import sources as _sources
from .._errors import MisuseError, StateWarning
from .._torch.compiler import opaque, pause_compiler, refuse_while_tracing, resume_compiler
from ..base.completion import complete
from ..base.errors import AbandonedBlockWarning, RestoreError
from ..base.fast_paths import ENABLED
from ..base.lock import LOCK
from ..base.scopes import SCOPES, Restorable, Scope
from ..base.seed import MAX_SEED, validate_seed
from ..base.settings import Settings
from .world import World

# ``opaque``, ``pause_compiler`` and ``resume_compiler`` are the boundary
# between blocks and torch.compile (_torch/compiler.py); the context and
# decorate layers take them from here, the engine they are built on.
__all__ = [
    "Block",
    "drain_signals",
    "inside_block",
    "opaque",
    "pause_compiler",
    "resume_compiler",
]


#: A block's reseeding plan (:meth:`Block.reseed`): for these sources, their
#: reseeders and the sources whose ``apply`` runs instead.
_Plan = tuple[
    tuple[_sources.Source, ...], tuple[Callable[[int, int], None], ...], tuple[_sources.Source, ...]
]


class Block(Scope):
    """One isolated RNG world: entered, left, suspended and resumed.

    **Any exit order, suspension.**  A block is a
    :class:`~deterministic_ctx.base.scopes.Scope`: the scope stack keeps where
    it is open (``_active``, or carried by a suspended generator or coroutine
    block) and its ``outer``, the world at its entry.  The top block leaves by
    restoring its ``outer``; one that leaves below a later block hands it on
    (:meth:`~deterministic_ctx.base.scopes.Scopes.leaving`).  Once every
    block has left, the state is exactly the one before the first.

    **Interrupts.**  Each operation is either rolled back (entry) or completed
    (exit) when an exception — ``KeyboardInterrupt`` from a signal handler,
    say — interrupts it at any line: entry lists the block before it applies
    anything, and each exit step reads where the block is before it acts, so
    the completion step (:func:`~deterministic_ctx.base.completion.complete`)
    completes it by running it once more; the lock is given back by
    :meth:`~deterministic_ctx.base.lock.ProcessLock.release`, which gives it
    back once the thread has no block open, however often it is called.
    """

    __slots__ = ("_plan", "_settings", "_sources", "_started")

    #: ``(sources, reseeders, sources to apply)``: :meth:`reseed`'s plan, kept
    #: from its first call (not with the fast paths off).
    _plan: _Plan

    def __init__(
        self, settings: Settings | None, sources: tuple[_sources.Source, ...] | None = None
    ) -> None:
        # Its links on the scope stack (:class:`~deterministic_ctx.base.scopes.Scope`).
        self.outer = self.inner = self.carried = self.carrier = None
        self._settings = settings  # None: isolation only, nothing applied
        # The sources the block captures, applies and restores: ``None`` for
        # every source (read at each start: a test may swap SOURCES), else a
        # part of them (a keyed item's RNGs, a stream's generators).
        self._sources = sources
        self._started = False
        # ``_plan``, :meth:`reseed`'s, is set by its first call only: every
        # ``with`` builds a block, and few blocks reseed.

    def start(self) -> None:
        """Take the lock, capture the caller's state and enter the block's world:
        the first time by applying the block's settings, after a
        :meth:`suspend` by restoring the block's own state.

        On any exception nothing is left applied and the lock is back at the
        caller's depth; then the exception propagates.  While torch traces a
        graph (``torch.export``), nothing is done: it raises (see
        :func:`~deterministic_ctx._torch.compiler.refuse_while_tracing`).
        """
        refuse_while_tracing()
        # Written out, not through ``guarded``: every block's entry runs here,
        # and the guard's frames and bound methods cost 1.5-3% of a block.
        try:
            LOCK.acquire()
            # Listed first: the thread keeps the lock while it has a block
            # listed, even if a finalizer runs a whole block during the capture.
            SCOPES.open(self)
            outer = World.capture(self._sources)
            if self.outer is None:  # else handed on by a block below that left meanwhile
                self.outer = outer
            if self._started:
                assert self.inner is not None
                self.inner.restore()
                SCOPES.put_back(self)
                self.inner = None  # last: until here a retry can still restore it
            else:
                if self._settings is not None:  # None: isolation only, nothing applied
                    _sources.apply_all(self._settings, outer.sources)
                self._started = True
        except BaseException:
            complete(self._rollback)
            raise

    def _rollback(self) -> None:
        """Undo an entry that did not complete: leave the block as
        :meth:`stop` would, its carried blocks (put back, or being put back,
        by a resume) going back to it first.  Not listed yet: nothing was
        applied, and the lock is given back."""
        i = SCOPES.position(self)
        if i is not None:
            SCOPES.carry(self, i)
        self._finish()

    def reseed(self, seed: int) -> None:
        """Seed the block's RNGs afresh, as a block of its settings started with
        ``seed`` (and ``flags=False``) would seed them; its flags, variables and
        what it will restore on exit stay as they are.

        For loops whose every step must depend on its own key only, without
        a block per step: a keyed item (:class:`~deterministic_ctx.SeededDataset`),
        a training step.  The block must be the calling thread's live world
        (its innermost open block): :class:`MisuseError` otherwise.  An
        interrupt half-way leaves some RNGs seeded anew and others not, inside
        the block only: its exit restores the caller's state all the same.
        """
        if not (_active and _active[-1] is self and LOCK.mine()):
            raise MisuseError(
                "reseed() needs the block to be the calling thread's innermost open block"
            )
        if type(seed) is not int or not 0 <= seed <= MAX_SEED:  # else valid: no call per step
            seed = validate_seed(seed)
        settings = self._settings
        # The sources' reseeders seed by the generators' own calls (no settings
        # to build, no per-seed cache that a new key each step never hits);
        # the others, and every source with the fast paths off, apply settings.
        # The plan depends on the sources only (the registered RNGs' reseeder
        # reads the registry when it runs), so the block keeps it; ``None``
        # sources are every source, read again in case a test swapped them.
        sources = self._sources or _sources.SOURCES
        try:
            plan: _Plan | None = self._plan
        except AttributeError:  # the first reseed
            plan = None
        if plan is None or plan[0] is not sources:
            plan = (sources, *_sources.reseeding(sources))
            if ENABLED:  # a cache: none with the fast paths off
                self._plan = plan
        _, fast, slow = plan
        step: Settings | None = None
        if settings is None or settings.rank is None:
            rank_seed = seed  # rank 0's seed is the seed itself (seed_for_rank)
        else:
            step = Settings(seed, False, settings.rank, False).resolved()
            rank_seed = step.rank_seed
        for reseed in fast:
            reseed(seed, rank_seed)
        if slow:
            step = step or Settings(seed, False, None, False)
            for source in slow:
                source.apply(step)

    @property
    def suspended(self) -> bool:
        """Left at a suspension point, with its own state saved to resume from."""
        return self.inner is not None and SCOPES.position(self) is None

    def suspend(self) -> None:
        """Save the block's state, restore the caller's and drop the lock.

        Completed even if interrupted; the interrupt propagates afterwards.
        """
        complete(self._suspend)

    def _suspend(self) -> None:
        i = SCOPES.position(self)
        if i is not None:
            if self.inner is None:  # not captured yet in this suspension
                self.inner = World.capture(self._sources)
            SCOPES.carry(self, i)
            assert self.outer is not None
            self.outer.restore()
            SCOPES.remove(self, _active, i)
            self.outer = None
        LOCK.release()

    def stop(self) -> None:
        """Leave the block: restore the caller's state (or hand it on) and drop the lock.

        Idempotent, and completed even if interrupted; the interrupt (or a
        :class:`RestoreError`) propagates afterwards.
        """
        complete(self._finish)

    def _finish(self) -> None:
        error: RestoreError | None = None
        place = SCOPES.leaving(self)  # in ``_active``, or carried by a suspended block
        if place is not None:
            blocks, i, live = place
            # Else handed on to the live world; ``outer`` is None for an entry
            # rolled back before its capture.
            if live and self.outer is not None:
                try:
                    self.outer.restore()
                except RestoreError as exc:  # every other source was restored: leave anyway
                    error = exc
            SCOPES.remove(self, blocks, i)
        self.outer = None
        LOCK.release()
        if error is not None:
            raise error

    def commit(self) -> None:
        """Keep the block's state as the process's own: the caller's state
        is dropped, not restored (``seed_everything``)."""
        i = SCOPES.position(self)
        if i is not None:
            SCOPES.remove(self, _active, i)
            self.outer = None
        LOCK.release()


#: The open blocks of the thread that holds the lock, in entry order: the
#: scope stack's list (module docstring), read here, changed only by it.
_active: list[Scope] = SCOPES.active


def inside_block() -> bool:
    """Whether the calling thread is inside a block (or a decorated call) now."""
    return LOCK.mine()


def _after_dead_owner(thread: threading.Thread) -> None:
    """``thread`` ended inside blocks; the calling thread has taken its lock over.

    The dead thread's open blocks can never be left, so they are left here:
    the state from before the first of them is put back, exactly what
    leaving them all would have done (``_active[0].outer`` holds it from
    before the first change is applied until after the last one is undone,
    as for a fork).  Blocks the dead thread had suspended (a decorated
    generator it was stepping) are not open and are not touched.
    """
    left = list(_active)
    target = SCOPES.drop()
    what = f"an open {_describe(left[0])} block" if left else "the lock, in no block"
    if len(left) > 1:
        what += f" and {len(left) - 1} more nested in it"
    # The state first: with warnings turned into errors (``-W error``, pytest's
    # ``filterwarnings = error``) the warning raises, and nothing after it would run.
    if target is not None:
        target.restore()
    warnings.warn(
        f"thread {thread.name!r} ended inside {what}; its blocks were left for it "
        "(the random state and flags from before them are back) and this thread took "
        "over the process-wide lock. Leave every block you enter: use `with`, or pair "
        "__enter__() with __exit__() in a finally clause",
        AbandonedBlockWarning,
        stacklevel=2,
    )


def _describe(block: Scope) -> str:
    assert isinstance(block, Block)  # the stack holds nothing else
    settings = block._settings
    return "isolated()" if settings is None else f"deterministic(seed={settings.seed})"


LOCK.on_dead_owner = _after_dead_owner


#: A call of a C function: CPython runs pending signal handlers after it, so
#: the end of ``__enter__`` calls it while the entry is still protected.
drain_signals = time.perf_counter


#: The state at the moment of the last fork, for the child, if it was made
#: from inside a block.
_at_fork: World | None = None


def _before_fork() -> None:
    global _at_fork
    # CPython reseeds ``random`` in every forked child.  Inside a block that
    # breaks reproducibility (NumPy and torch are inherited as they are), so
    # the child gets back exactly the state the forking thread had.
    _at_fork = World.capture() if LOCK.mine() else None


def _after_fork_in_child() -> None:
    global _at_fork
    target: Restorable | None = _at_fork
    _at_fork = None
    if not LOCK.mine():
        # Forked outside every block.  If another thread was inside (or
        # entering, or leaving) one, that thread does not exist here: the
        # child continues from the state outside its blocks, which is the
        # forking thread's view.
        target = SCOPES.drop()
        LOCK.reset_after_fork()
    if target is not None:
        try:
            target.restore()
        except Exception as exc:
            warnings.warn(
                f"deterministic_ctx: could not restore the random state in a forked child: {exc!r}",
                StateWarning,
                stacklevel=1,
            )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
