"""The scope stack: which blocks are open, where, and every change to that.

Open blocks are in one of three places, all kept by :data:`SCOPES`:

* ``active``: the open blocks of the thread that holds the process lock
  (:mod:`deterministic_ctx.base.lock`), in the order they were entered.
  Each one's ``outer`` is the world at its entry, the world of the block
  below it; a block that leaves below a later one hands its ``outer`` on
  (:meth:`Scopes.leaving`).  The lock asks whether it is empty before it is
  given back.
* carried: a decorated generator or coroutine suspended at a
  ``yield``/``await`` carries the blocks opened in its step and still open
  (its ``carried``; each of them names it in ``carrier``): they belong to
  its world, not the live one, and go back on top of ``active`` when it
  resumes.
* each thread's ``with`` blocks (:meth:`Scopes.withs`): the ``with``,
  ``async with`` and ``start()`` blocks it entered and has not left, so
  that an ``__exit__`` finds the block it means.  The list is freed with its
  thread, whatever started the thread.

A block is a :class:`Scope` (the engine's ``Block`` derives from it): the
links above are its fields, and only this module changes ``carried`` and
``carrier``.  The stack knows nothing else of blocks or worlds, so it sits
below the engine that uses it.

Interrupts: the changes are list operations and attribute stores (no lock,
nothing to leave held), each ordered so that an exception a signal handler
raises between two of them leaves what a second run completes: an entry is
recorded before anything is applied (a roll-back finds it), an exit removes
its block only after it has restored (a second run of the exit finds it),
blocks are carried before their list is cut.  A ``with`` block that has left
is only marked (``exited``, stored by the exit itself as the last statement
of its ``try``) and pruned at its thread's next entry: removed at its exit,
an interrupt just after would make the exit's second run leave the block
below.

Blocks that can never be left (their thread ended inside them, or a fork
left it behind) are forgotten by :meth:`Scopes.drop`.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["SCOPES", "Entered", "Restorable", "Scope", "Scopes"]


class Restorable(Protocol):
    """What a block's ``outer`` and ``inner`` are (the engine's ``World``):
    the stack only hands them on."""

    def restore(self) -> None: ...


class Entered(Protocol):
    """What the stack reads of a ``with`` block (the context's record of one)."""

    exited: bool

    @property
    def of(self) -> object: ...
    @property
    def task(self) -> object: ...


class Scope:
    """A block's links on the stack (the block's ``__init__`` sets them to ``None``)."""

    __slots__ = ("carried", "carrier", "inner", "outer")

    #: The caller's world, while the block is open.
    outer: Restorable | None
    #: The block's own world, while it is suspended.
    inner: Restorable | None
    #: The blocks opened inside its suspended step.
    carried: list[Scope] | None
    #: The block that last carried this one: it carries it still unless the
    #: block is in ``active`` (resuming puts carried blocks back there).
    carrier: Scope | None


class _Withs(threading.local):
    """Each thread's ``with`` blocks, made at its first use."""

    withs: list[Entered]

    def __init__(self) -> None:
        self.withs = []


class Scopes:
    """Every open block of the process, and every change to where they are."""

    __slots__ = ("_threads", "active")

    def __init__(self) -> None:
        #: The open blocks of the thread that holds the lock, in entry order;
        #: the same list object for ever.
        self.active: list[Scope] = []
        self._threads = _Withs()

    # The lock holder's blocks, and the blocks suspended ones carry.

    def position(self, block: Scope) -> int | None:
        """Where ``block`` is in ``active`` (``None``: not there)."""
        active = self.active
        if active and active[-1] is block:  # nearly always: the latest leaves first
            return len(active) - 1
        return _position(block, active)

    def open(self, block: Scope) -> None:
        """Record ``block`` as entered, before anything of it is applied."""
        self.active.append(block)

    def carry(self, block: Scope, i: int) -> None:
        """Take the blocks above ``block`` (at ``active[i]``) off ``active``:
        opened in its step, they stay in its world until it resumes."""
        active = self.active
        if i + 1 < len(active):
            block.carried = carried = active[i + 1 :]
            for above in carried:
                above.carrier = block
            del active[i + 1 :]

    def put_back(self, block: Scope) -> None:
        """``block`` has resumed: the blocks opened in its last step are open again."""
        if block.carried:
            self.active.extend(block.carried)
        block.carried = None

    def leaving(self, block: Scope) -> tuple[list[Scope], int, bool] | None:
        """``block`` is leaving: the list that holds it (``active``, or its
        carrier's carried blocks), its index there, and whether its world is
        the live one, which its caller's must then replace; ``None``: it is
        not open.

        Where its world is not the live one, what it restores is handed on
        here.  A later block is open above it (interleaved ``async with``
        tasks, a generator closed inside another block): that block restores
        it when it leaves in turn.  It is the top block its carrier carries:
        the carrier's own world is the one from before it.  Handing on is a
        single store, made again if the exit runs again."""
        active = self.active
        if active and active[-1] is block:  # nearly always: the latest leaves first
            return active, len(active) - 1, True
        blocks = active
        i = _position(block, active)
        if i is None:
            carrier = block.carrier
            if carrier is None or not carrier.carried:
                return None
            blocks = carrier.carried
            i = _position(block, blocks)
            if i is None:
                return None
        if i + 1 < len(blocks):
            blocks[i + 1].outer = block.outer
        elif blocks is not active:
            assert block.carrier is not None
            block.carrier.inner = block.outer
        else:
            return blocks, i, True
        return blocks, i, False

    def remove(self, block: Scope, blocks: list[Scope], i: int) -> None:
        """``block`` (``blocks[i]``) has left: forget it."""
        del blocks[i]
        block.carrier = None  # after: until then a second run still finds it

    def drop(self) -> Restorable | None:
        """Forget the lock holder's open blocks, which no thread can leave any
        more (their thread ended, or a fork left it behind); returns the world
        from before the first of them, which ``active[0].outer`` holds from
        before the first change is applied until after the last one is undone
        (``None``: no block was open)."""
        active = self.active
        target = active[0].outer if active else None
        for block in active:
            block.outer = None
        del active[:]
        return target

    # Each thread's ``with`` blocks.

    def withs(self) -> list[Entered]:
        """The calling thread's ``with`` blocks, in entry order (left ones
        included until its next entry: see ``exited``)."""
        return self._threads.withs

    def enter_with(self, block: Entered) -> None:
        """Record the ``with`` block ``block`` in its thread's list, dropping
        the blocks at its end that have left."""
        withs = self._threads.withs
        while withs and (last := withs[-1]).exited:
            withs.remove(last)  # not pop(): a finalizer may have added a block meanwhile
        withs.append(block)

    def latest_with(self, of: object, task: object) -> Entered | None:
        """The calling thread's latest ``with`` block of the object ``of``,
        entered by ``task``, that has not left."""
        for block in self._threads.withs[::-1]:  # a copy: a finalizer may add blocks meanwhile
            if block.of is of and block.task is task and not block.exited:
                return block
        return None


def _position(block: Scope, blocks: list[Scope]) -> int | None:
    # From the top: the block that leaves or suspends is nearly always the last one.
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i] is block:
            return i
    return None


#: The process's one scope stack.
SCOPES = Scopes()
