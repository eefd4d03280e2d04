"""The fused plan: the default sources captured, applied and restored in one call each.

A block does little work: two 2.5 KB copies per Mersenne Twister, a torch
state tensor, a few dozen C-level flag reads and writes, four environment
writes.  Done source by source, most of its cost was Python calls around that
work (209 per block).  This plan does the same work for the default
:data:`~deterministic_ctx.sources.SOURCES` in one frame per phase, with what
each source needs bound once: memory views, bound C methods, the sources'
seeding caches.  It also uses what a phase already knows: applying compares
the flags and the two environment variables a block sets with the values just
captured instead of reading them again.

**Exactness.**  The per-source objects stay the reference implementation
(and what checkpoints use).  The plan produces the very states their
``capture()`` produces, leaves the process in the state their ``apply`` and
``restore`` leave, and runs the reference method of a source whenever that
source is not in its common state: a replaced NumPy bit generator, a state
loaded from a checkpoint, an accelerator with queued work, registered user
RNGs.  ``tests/sources/test_fused.py`` proves it equal to the reference with a
Hypothesis differential test over random workloads.

**Which source is which.**  Each source class the plan inlines declares its
slot (``fused_slot = "random"``, ``"numpy"``, ...) in its own class body, so
a subclass, which may behave otherwise, declares none.  The plan takes the
sources in the order the states are laid out: the Python, NumPy and torch
CPU slots, then device generators (a ``"device"`` slot is read inline where
the device can never be initialized; any other device source runs its own
methods), then the flags, compiler, defaults, environment and user slots.
Sources the plan cannot take (tests swap ``SOURCES``) get no plan:
:func:`build` returns ``None``, :func:`why_not` says why, and the engine
runs the reference loop.  ``tests/sources/test_fused.py`` fails if the default
sources have no plan, so a new source cannot turn it off unnoticed.

Failure paths stay the reference's: :class:`~deterministic_ctx.core.world.World`
reruns the reference restore after any exception here.
"""

from __future__ import annotations

import random
from operator import is_
from typing import Any, TypeVar

from .._torch.internals import lazy_seed_queue
from ..base.settings import Settings
from ._base import Source
from .accelerators import LazyAcceleratorSource, LazyState
from .compiler import TorchCompileSource
from .environ import EnvironSource
from .flags import TorchFlagsSource
from .numpy_global import NumpyGlobalSource, NumpyState, seed_views
from .python_random import PythonRandomSource, PythonRandomState, seed_view
from .torch_cpu import TorchCPUSource, seed_generator
from .torch_defaults import TorchDefaultsSource
from .user_rngs import UserRngSource

__all__ = ["FusedPlan", "build", "why_not"]

#: Builds a NamedTuple state from a tuple without the Python-level ``__new__``
#: of the class (one C call instead of a frame).
_new = tuple.__new__
_S = TypeVar("_S")


class FusedPlan:
    """capture / apply / restore of one exact tuple of default sources."""

    __slots__ = (
        "_compiler",
        "_defaults",
        "_devices",
        "_environ",
        "_flags",
        "_generator",
        "_np",
        "_numpy",
        "_random",
        "_random_bytes",
        "_recent",
        "_rng",
        "_rs",
        "_user",
        "_view",
        "sources",
    )

    def __init__(self, sources: tuple[Source, ...]) -> None:
        found = _by_slot(sources)
        rnd = _exact(found["random"], PythonRandomSource)
        npy = _exact(found["numpy"], NumpyGlobalSource)
        cpu = _exact(found["torch.cpu"], TorchCPUSource)
        middle = sources[len(_HEAD) : len(sources) - len(_TAIL)]
        flags = _exact(found["flags"], TorchFlagsSource)
        compiler = _exact(found["compiler"], TorchCompileSource)
        defaults = _exact(found["defaults"], TorchDefaultsSource)
        environ = _exact(found["environ"], EnvironSource)
        user = _exact(found["user"], UserRngSource)
        view = rnd.view
        if view is None:
            raise TypeError(
                "random's fast path is off: its generator is not an exact random.Random"
            )
        self.sources = sources
        self._random, self._rng, self._view = rnd, rnd.rng, view
        self._random_bytes = view.tobytes
        self._numpy, self._rs = npy, npy.random_state
        # (bit generator, view of its record, view of the gaussian cache, their
        # two ``tobytes``): one tuple, replaced whole, so that a capture in
        # another thread (``Snapshot.capture()`` needs no block) never pairs
        # one bit generator with another's views.
        self._np: tuple[Any, ...] = (None, None, None, None, None)
        self._generator = cpu.generator
        # The device sources, in order, each with its torch module's seed tracker
        # and queued calls where this build can never initialize the device (a
        # CPU build's cuda, xpu, mtia): that state is only torch's queue, read
        # here inline.  Every other device source (``None``) runs its own methods.
        self._devices: tuple[tuple[Any, Source], ...] = tuple(
            (lazy_seed_queue(s.module), s)
            if isinstance(s, LazyAcceleratorSource) and not s.can_initialize
            else (None, s)
            for s in middle
        )
        #: Per device, the last state captured inline, with its ``call_order``
        #: and queued calls as lists (compared with torch's without a copy).
        self._recent: list[tuple[Any, list[Any], list[Any]]] = [
            (None, [], []) for _ in self._devices
        ]
        self._flags, self._compiler, self._defaults = flags, compiler, defaults
        self._environ, self._user = environ, user

    def _numpy_views(self, bg: Any) -> tuple[Any, ...] | None:
        """The views over ``bg``, NumPy's current bit generator, bound for the
        next calls too; ``None`` where the fast path is off for it (the
        source's own methods then run)."""
        views = self._numpy.views(bg)
        if views is None:
            return None
        mt, gauss = views
        self._np = found = (bg, mt, gauss, mt.tobytes, gauss.tobytes)
        return found

    def capture(self) -> tuple[Any, ...]:
        """Exactly ``tuple(s.capture() for s in sources)``."""
        gauss_next = self._rng.gauss_next  # type: ignore[attr-defined]
        states: list[Any] = [_new(PythonRandomState, (self._random_bytes(), gauss_next))]
        bg = self._rs._bit_generator
        np_views: tuple[Any, ...] | None = self._np
        if np_views is not None and np_views[0] is not bg:
            np_views = self._numpy_views(bg)
        if np_views is not None:
            mt_bytes, gauss_bytes = np_views[3], np_views[4]
            # One-line ``with``: see NumpyGlobalSource.capture.
            with bg.lock: states.append(_new(NumpyState, (bg, (mt_bytes(), gauss_bytes()))))  # noqa: E701  # fmt: skip
        else:
            states.append(self._numpy.capture())
        states.append(self._generator.get_state())
        recent = self._recent
        for k, (lazy, source) in enumerate(self._devices):
            if lazy is None:
                states.append(source.capture())
                continue
            # The device's queue, as LazyAcceleratorSource.capture reads it.
            # Unchanged since the last capture (the usual case: nothing in a
            # CPU build touches it but ``torch.manual_seed`` and friends), the
            # state built then is equal to a new one, and immutable: reused.
            t, now_queued = lazy
            last, order, queued = recent[k]
            now_order = t.call_order
            # The same objects in the same order (identity: the state built
            # from them must be the one a new capture would build), compared
            # in C and inline: three devices, every block.  (torch.cuda queues
            # capability checks at import: its ``_queued_calls`` is not empty.)
            if not (
                last is not None
                and t.manual_seed_all_cb is last.seed_all
                and t.manual_seed_cb is last.seed_one
                and len(now_queued) == len(queued)
                and len(now_order) == len(order)
                and (not queued or all(map(is_, now_queued, queued)))
                and (not order or all(map(is_, now_order, order)))
            ):
                order, queued = list(now_order), list(now_queued)
                last = _new(
                    LazyState,
                    (t.manual_seed_all_cb, t.manual_seed_cb, tuple(order), tuple(queued)),
                )
                recent[k] = (last, order, queued)
            states.append(last)
        states.append(self._flags.capture())
        states.append(self._compiler.capture())
        states.append(self._defaults.capture())
        states.append(self._environ.capture())
        states.append(self._user.capture())
        return tuple(states)

    def apply(self, settings: Settings, states: tuple[Any, ...]) -> None:
        """Exactly ``apply_all(settings)``, given ``states`` just captured by
        :meth:`capture` (nothing has run since but the engine's bookkeeping)."""
        settings = settings.resolved()
        rank_seed = settings.rank_seed
        rnd = self._random
        if getattr(random.random, "__self__", None) is self._rng:
            seed_view(self._rng, self._view, rank_seed)
        else:
            rnd.apply(settings)  # warns about the rebinding
        rs = self._rs
        bg = rs._bit_generator
        np_views = self._np
        if bg is np_views[0]:
            seed_views(rs, bg, np_views[1], np_views[2], rank_seed)
        else:
            self._numpy.apply(settings)
        seed_generator(self._generator, settings.seed)
        for lazy, source in self._devices:
            if lazy is None:  # devices that cannot initialize get no seed (see their apply)
                source.apply(settings)
        self._flags.apply_after_capture(states[-5], settings)
        if settings.compiled_rng is not None:
            self._compiler.apply(settings)
        # torch.defaults applies nothing.
        self._environ.apply_after_capture(states[-2], settings)
        if states[-1]:  # nothing registered (or alive) at capture: nothing to seed
            self._user.apply(settings)

    def restore(self, states: tuple[Any, ...]) -> None:
        """Exactly ``for s, state in reversed(zip(sources, states)): s.restore(state)``
        when it returns; on an exception the caller runs the reference restore."""
        if states[-1]:
            self._user.restore(states[-1])
        self._environ.restore(states[-2])
        self._defaults.restore(states[-3])
        self._compiler.restore(states[-4])
        self._flags.restore(states[-5])
        devices = self._devices
        for k in range(len(devices) - 1, -1, -1):
            lazy, source = devices[k]
            state = states[3 + k]
            if lazy is not None and type(state) is LazyState:
                t, now_queued = lazy
                if (
                    t.manual_seed_all_cb is state.seed_all
                    and t.manual_seed_cb is state.seed_one
                    and len(now_queued) == len(state.queued)
                    and tuple(t.call_order) == state.call_order
                ):
                    continue  # nothing queued since: the reference restore writes nothing
            source.restore(state)
        self._restore_generators(states)

    def restore_over(self, states: tuple[Any, ...], now: tuple[Any, ...]) -> None:
        """:meth:`restore` of ``states`` where :meth:`capture` has just
        returned ``now`` (a decorated generator or coroutine swapping its
        world and its caller's): what restore reads back to find what changed
        is taken from ``now`` instead.  The price: a signal handler or a
        finalizer that changes a flag or variable between that capture and
        this restore is not seen (a plain restore reads again)."""
        if states[-1]:
            self._user.restore(states[-1])
        self._environ.restore_over(states[-2], now[-2])
        self._defaults.restore_over(states[-3], now[-3])
        self._compiler.restore(states[-4])
        self._flags.restore_over(states[-5], now[-5])
        devices = self._devices
        for k in range(len(devices) - 1, -1, -1):
            state = states[3 + k]
            # The same object: captured inline and unchanged since (see capture).
            if state is not now[3 + k] or devices[k][0] is None:
                devices[k][1].restore(state)
        self._restore_generators(states)

    def _restore_generators(self, states: tuple[Any, ...]) -> None:
        """The last steps of both restores: torch's CPU generator, NumPy, ``random``."""
        self._generator.set_state(states[2])
        self._restore_numpy(states[1])
        r = states[0]
        if type(r.raw) is bytes:
            self._view[:] = r.raw
            self._rng.gauss_next = r.gauss_next  # type: ignore[attr-defined]
        else:
            self._random.restore(r)

    def _restore_numpy(self, n: Any) -> None:
        bg = n.bit_generator
        np_views = self._np
        if bg is np_views[0] and type(n.raw) is tuple and self._rs._bit_generator is bg:
            mt, gauss = np_views[1], np_views[2]
            with bg.lock: mt[:], gauss[:] = n.raw  # noqa: E701  # fmt: skip
        else:
            self._numpy.restore(n)


#: The slots before and after the device generators, in the order of the states.
_HEAD = ("random", "numpy", "torch.cpu")
_TAIL = ("flags", "compiler", "defaults", "environ", "user")


def _slot(source: Source) -> str | None:
    # The class's own declaration only: a subclass may behave otherwise.
    slot = type(source).__dict__.get("fused_slot")
    return slot if isinstance(slot, str) else None


def _by_slot(sources: tuple[Source, ...]) -> dict[str, Source]:
    """The sources of :data:`_HEAD` and :data:`_TAIL` by slot; ``TypeError``
    saying which source does not fit where."""
    if len(sources) < len(_HEAD) + len(_TAIL):
        raise TypeError(
            f"{len(sources)} sources, fewer than the plan's {len(_HEAD) + len(_TAIL)} slots"
        )
    head, tail = sources[: len(_HEAD)], sources[len(sources) - len(_TAIL) :]
    ends = [*zip(_HEAD, head, strict=True), *zip(_TAIL, tail, strict=True)]
    for want, source in ends:
        if _slot(source) != want:
            raise TypeError(
                f"{source.name!r} ({type(source).__name__}) is where the plan's {want!r} slot "
                f"is, and declares {_slot(source)!r}"
            )
    for source in sources[len(_HEAD) : len(sources) - len(_TAIL)]:
        if source.device_type is None:
            raise TypeError(
                f"{source.name!r} ({type(source).__name__}) is among the device generators "
                "but is not one"
            )
    return dict(ends)


def _exact(source: Source, cls: type[_S]) -> _S:
    """``source``, if it is exactly a ``cls`` (a subclass may behave otherwise)."""
    if type(source) is not cls:
        raise TypeError(f"{source!r} is not a {cls.__name__}")
    return source  # checked just above


def build(sources: tuple[Source, ...]) -> FusedPlan | None:
    """The plan for ``sources``, or ``None`` where they do not fill the plan's
    slots with their fast paths on (the reference then runs; see :func:`why_not`)."""
    try:
        return FusedPlan(sources)
    except TypeError:
        return None


def why_not(sources: tuple[Source, ...]) -> str | None:
    """Why ``sources`` get no plan (``None``: they get one)."""
    try:
        FusedPlan(sources)
    except TypeError as exc:
        return str(exc)
    return None
