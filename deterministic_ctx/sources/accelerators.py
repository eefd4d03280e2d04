"""Accelerator generators: CUDA, XPU and MTIA (lazily initialized), and MPS.

CUDA, XPU and MTIA share torch's lazy-initialization design, and its traps:

* ``torch.cuda.get_rng_state()`` *initializes* CUDA (and breaks forked
  workers, Lightning #16262).  Before initialization the only RNG state is
  what torch has *queued* for initialization: the latest ``manual_seed`` /
  ``manual_seed_all`` in ``_lazy_seed_tracker``, and ``set_rng_state`` calls
  appended to ``_queued_calls`` (a list that never drains on a machine
  without the device, so calling ``set_rng_state`` per block leaks).
* ``torch.manual_seed`` queues through that tracker with a formatted stack
  trace (~150 µs).  We queue our own seed callback with a one-line note.

So a captured state is either *live* (per-device generator states, read only
once the device is initialized) or *lazy* (what is queued).  If the device is
first initialized inside a block, it was seeded from the block's seed, and on
exit every generator is set to what initialization would have produced from
the captured queue: a fresh generator, then the captured queued calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .._settings import Settings

__all__ = ["LazyAcceleratorSource", "MPSSource", "accelerator_sources"]

_NOTE = ["  (seed queued by deterministic_ctx on entry to a deterministic block)\n"]
_REQUIRED = ("is_initialized", "_lazy_seed_tracker", "_queued_calls", "default_generators")
_TRACKER_FIELDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")


@dataclass(frozen=True)
class LiveState:
    states: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LazyState:
    seed_all: Any
    seed_one: Any
    call_order: tuple[Any, ...]
    queued: tuple[Any, ...]


def _is_rng_call(entry: Any) -> bool:
    # ``set_rng_state(s)`` queues ``set_rng_state.<locals>.cb``; other queued
    # calls (capability checks, ...) are not RNG state and are left alone.
    fn = entry[0] if isinstance(entry, tuple) and entry else entry
    return "rng_state" in getattr(fn, "__qualname__", "") or "seed" in getattr(
        fn, "__qualname__", ""
    )


class LazyAcceleratorSource:
    """The default generators of a lazily initialized device type."""

    def __init__(
        self,
        module: ModuleType | Any,
        device_type: str,
        fresh_state: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.name = f"torch.{device_type}"
        self._m = module
        self._device_type = device_type
        self._fresh_state = fresh_state or self._torch_fresh_state

    def _torch_fresh_state(self, index: int) -> torch.Tensor:
        return torch.Generator(device=torch.device(self._device_type, index)).get_state()

    def _bad_fork(self) -> bool:
        check = getattr(self._m, "_is_in_bad_fork", None)
        return bool(check()) if check is not None else False

    def capture(self) -> LiveState | LazyState:
        m = self._m
        if m.is_initialized():
            return LiveState(tuple(g.get_state() for g in m.default_generators))
        t = m._lazy_seed_tracker
        return LazyState(
            t.manual_seed_all_cb, t.manual_seed_cb, tuple(t.call_order), tuple(m._queued_calls)
        )

    def apply(self, settings: Settings) -> None:
        m = self._m
        if self._bad_fork():
            return  # like torch.manual_seed: the device cannot be used in this process
        seed = settings.seed
        if m.is_initialized():
            for gen in m.default_generators:
                gen.manual_seed(seed)
            return

        def seed_all() -> None:  # runs at initialization, when the generators exist
            for gen in m.default_generators:
                gen.manual_seed(seed)

        m._lazy_seed_tracker.queue_seed_all(seed_all, _NOTE)

    def restore(self, state: LiveState | LazyState) -> None:
        m = self._m
        if isinstance(state, LiveState):
            if len(m.default_generators) != len(state.states):
                raise RuntimeError(
                    f"{self.name}: {len(state.states)} device generator(s) captured, "
                    f"{len(m.default_generators)} present"
                )
            for gen, saved in zip(m.default_generators, state.states):
                gen.set_state(saved)
            return
        self._restore_tracker(state)
        if not m.is_initialized():
            if len(m._queued_calls) == len(state.queued):
                return
            # Drop RNG calls queued inside the block; keep everything else.
            kept = set(map(id, state.queued))
            m._queued_calls[:] = [
                c for c in m._queued_calls if id(c) in kept or not _is_rng_call(c)
            ]
            return
        if self._bad_fork():
            return
        # First initialized inside the block: recompute what initialization
        # would have produced without the block.
        for index, gen in enumerate(m.default_generators):
            gen.set_state(self._fresh_state(index))
        replay = [c for c in state.queued if _is_rng_call(c)]
        replay += [c for c in state.call_order if c]
        for fn, _trace in replay:
            fn()

    def _restore_tracker(self, state: LazyState) -> None:
        t = self._m._lazy_seed_tracker
        if t.manual_seed_all_cb is not state.seed_all:
            t.manual_seed_all_cb = state.seed_all
        if t.manual_seed_cb is not state.seed_one:
            t.manual_seed_cb = state.seed_one
        if tuple(t.call_order) != state.call_order:
            t.call_order = list(state.call_order)


class MPSSource:
    """Apple's MPS generator (one device, no lazy initialization)."""

    name = "torch.mps"

    def capture(self) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def restore(self, state: torch.Tensor) -> None:
        torch.mps.set_rng_state(state)

    def apply(self, settings: Settings) -> None:
        torch.mps.manual_seed(settings.seed)


def _usable(module: Any) -> bool:
    tracker = getattr(module, "_lazy_seed_tracker", None)
    return all(hasattr(module, a) for a in _REQUIRED) and all(
        hasattr(tracker, f) for f in _TRACKER_FIELDS
    )


def accelerator_sources() -> Sequence[LazyAcceleratorSource | MPSSource]:
    """The accelerator sources this torch build has.

    CUDA, XPU and MTIA are managed even on builds without them: ``torch.manual_seed``
    inside a block still queues lazy seeds for them, and those must not outlive
    the block.  A module that lacks the attributes we rely on is not silently
    skipped: we fail loudly at import, since its state could not be restored.
    """
    found: list[LazyAcceleratorSource | MPSSource] = []
    for device_type in ("cuda", "xpu", "mtia"):
        module = getattr(torch, device_type, None)
        if module is None:
            continue
        if not _usable(module):
            raise ImportError(
                f"deterministic_ctx does not support this torch build: torch.{device_type} "
                f"lacks the lazy-seeding internals it captures ({', '.join(_REQUIRED)})"
            )
        found.append(LazyAcceleratorSource(module, device_type))
    if getattr(torch._C, "_has_mps", False) and torch.backends.mps.is_available():
        found.append(MPSSource())
    return found
