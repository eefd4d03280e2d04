"""The contract every source of global state implements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..base.fast_paths import FastPath
from ..base.settings import Settings

__all__ = ["DeviceSource", "Reseeder", "SettingSource", "Source", "seeds_nothing"]


#: What ``Source.reseeder()`` returns: seeds a source for ``(seed, rank_seed)``.
Reseeder = Callable[[int, int], None]


def seeds_nothing(seed: int, rank_seed: int) -> None:
    """The reseeder of a source that seeds nothing with ``flags=False``."""


class Source(Protocol):
    """One piece of process-global state that decides random draws or algorithms.

    A source is the only code that knows the API behind its state.  It must:

    * ``capture()`` return an object describing the state now, never mutated
      afterwards (a snapshot may restore it many times), without lasting side
      effects (a source may write for a moment to read what torch does not
      report, and puts it back before returning);
    * ``restore(state)`` put that state back exactly, and be idempotent (an
      interrupted restore is simply run again);
    * ``apply(settings)`` set the reproducible state a block starts from;
    * ``export_state(state)`` turn a captured state into plain data (dicts
      with string keys, lists, str, int, float, bool, 1-D uint8 CPU tensors)
      for a checkpoint, and ``import_state(data, path)`` check such data
      field by field (``ValueError`` naming ``path`` and what is accepted) and
      turn it back into a state ``restore`` takes.

    ``device_type`` is ``None``, except for generators of a device type
    (:class:`DeviceSource`), whose entries a checkpoint keeps under
    ``"devices"`` and matches to the devices present where it is loaded.

    Every source also declares ``applies_nothing`` (``True``: its ``apply``
    never changes anything, so blocks skip it: torch's defaults, a device
    this build can never initialize) and ``fast_paths``, the fast paths it
    takes (:class:`~deterministic_ctx.base.fast_paths.FastPath`), which
    :func:`~deterministic_ctx.sources.fast_paths` lists.

    ``reseeder()`` serves :meth:`Block.reseed <deterministic_ctx.core.engine.Block.reseed>`,
    which seeds a block's generators afresh at every step of a loop (a keyed
    item, a training step): a function ``f(seed, rank_seed)`` that does what
    ``apply`` does for settings with ``flags=False`` of that seed (whose
    per-rank seed is ``rank_seed``) by the generators' own seeding calls,
    without the per-seed caches that a new key every step never hits;
    :func:`seeds_nothing` for a source that seeds nothing then (flags,
    variables); ``None`` where ``apply`` must run (the fast paths off, a
    generator without such a call).
    """

    name: str

    @property
    def device_type(self) -> str | None: ...

    @property
    def applies_nothing(self) -> bool: ...

    @property
    def fast_paths(self) -> tuple[FastPath, ...]: ...

    def capture(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def apply(self, settings: Settings) -> None: ...

    def reseeder(self) -> Reseeder | None: ...

    def export_state(self, state: Any) -> Any: ...

    def import_state(self, data: object, path: str) -> Any: ...


class DeviceSource(Source, Protocol):
    """The generators of one device type (``"cuda"``, ``"mps"``, ...).

    ``import_state`` also receives ``None`` when the checkpoint has no entry
    for the device type, and matches N saved generators to the M devices
    here: with ``strict`` a mismatch is a ``ValueError``, otherwise a warning
    and the first min(N, M) are kept.  ``None`` means nothing is left to
    restore.
    """

    @property
    def device_type(self) -> str: ...

    def import_state(self, data: object, path: str, *, strict: bool = False) -> Any: ...


class SettingSource:
    """What a source of settings (flags, defaults, variables; no generator) has
    in common: saved under ``"sources"``, no fast path of its own unless it
    says so, and nothing to seed in a reseed (``flags=False``: its ``apply``
    does nothing then)."""

    device_type: str | None = None
    applies_nothing = False
    fast_paths: tuple[FastPath, ...] = ()

    def reseeder(self) -> Reseeder:
        return seeds_nothing
