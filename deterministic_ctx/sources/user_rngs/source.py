"""The source of all registered RNGs: what a block captures, applies and
restores for them, and what a snapshot saves of them.

:class:`UserRngSource` runs the blocks' loops over :func:`.registry.live_steps`
(each entry, or each kind's batch of them, captures, seeds and restores its
RNGs); its checkpoint methods turn states into plain data and back through
each kind's codec (:mod:`..rngs.kinds`).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

from ...base import plain as _plain
from ...base.completion import complete_each
from ...base.fast_paths import FastPath
from ...base.settings import Settings
from .._base import Reseeder
from ..rngs.entries import Entry, Record
from ..rngs.kinds import BY_NAME
from ..rngs.persistence import class_path
from .registry import live_entries, live_steps, seed_registered_rngs


class UserRngSource:
    """All registered RNGs: captured, seeded and restored together."""

    name = "user"
    device_type: str | None = None  # not a device generator: saved under "sources"

    #: Nothing to skip: registering an RNG makes a block seed it.
    applies_nothing = False
    #: Each kind's (:mod:`..rngs.kinds`), and each entry's memo of its seeded state.
    fast_paths = (
        *(path for kind in BY_NAME.values() for path in kind.fast_paths),
        FastPath("registered RNGs: the state seeding left remembered per block seed", lambda: True),
    )

    def capture(self) -> tuple[Record, ...]:
        """One record ``(step, object(s), state)`` per live RNG or batch of them;
        ``()`` when there are none."""
        steps = live_steps()
        if not steps:  # nothing registered: the usual case
            return ()
        out: list[Record] = []
        for step in steps:
            obj = step.get()
            if obj is not None:
                out.append((step, obj, step.capture(obj)))
            else:  # collected (an entry), or one of them collected (a batch)
                out.extend(step.fallback())
        return tuple(out)

    def apply(self, settings: Settings) -> None:
        # Per rank, like ``random`` and NumPy; ``shared=True`` ones like torch.
        # Not through ``_reseed``: a frame more on every block's entry.
        if live_steps():  # nothing registered (the usual case): nothing to seed
            seed_registered_rngs(settings.rank_seed, shared_seed=settings.seed)

    def reseeder(self) -> Reseeder:
        """What ``apply`` does, without building its settings: each registered
        RNG seeded from ``rank_seed`` (``shared=True`` ones from ``seed``)."""
        return _reseed

    def restore(self, state: tuple[Record, ...]) -> None:
        """Put every RNG of ``state`` back.  One that fails does not stop the
        others (the completion step retries it once and goes on); the first
        failure is raised once all were tried, and the world's restore, which
        retries this source whole, decides what it was."""
        # The object is kept alive by the snapshot only while the snapshot lives;
        # an RNG collected meanwhile has no state left to restore.
        if not state:  # nothing registered (the usual case): no loop to set up
            return
        failures = complete_each(zip(repeat(_put), state))
        if failures:
            raise failures[0][1]

    def export_state(self, state: tuple[Record, ...]) -> list[dict[str, Any]]:
        """The state as plain data: ``[{"key", "kind", "state"}, ...]``.

        Raises ``ValueError`` if two registered RNGs share a key (a loaded
        snapshot finds each RNG by its key, so it could not tell them apart),
        or if a random-like object's ``getstate()`` returned something that is
        not plain data (see :mod:`.persistence`): its state cannot be saved.
        """
        out: list[dict[str, Any]] = []
        keys: set[str] = set()
        for entry, obj, saved in (r for record in state for r in record[0].split(*record[1:])):
            if entry.key in keys:
                raise ValueError(
                    f"two registered RNGs share the key {entry.key!r}, so a saved snapshot "
                    f"could not tell them apart: register them with distinct keys"
                )
            keys.add(entry.key)
            try:
                plain = entry.kind.to_plain(obj, entry.public(obj, saved))
            except ValueError as exc:
                raise ValueError(
                    f"the state of user RNG {entry.key!r} ({class_path(obj)}) cannot be "
                    f"saved: {exc}. Unregister it before saving a snapshot"
                ) from None
            out.append({"key": entry.key, "kind": entry.kind.name, "state": plain})
        return out

    def import_state(self, data: object, path: str) -> tuple[Record, ...]:
        """Bind each saved state to the RNG registered here under the same key.

        Every saved RNG must be registered (``register_rng(obj, key=...)``)
        before loading, with the same kind: otherwise ``ValueError``, since its
        state could not be restored.  RNGs registered here but absent from the
        snapshot are left alone, as by any snapshot taken before they existed.
        Loaded states are restored through each kind's public API, which
        checks them again, never by writing raw memory.  NumPy and torch
        states are also checked here, on throw-away generators; a random-like
        object's state is checked only by its ``setstate()``, at restore.
        """
        if type(data) is not list:
            raise ValueError(f"{path}: expected a list, got {type(data).__name__}")
        by_key: dict[str, list[tuple[Entry, Any]]] = {}
        for e in live_entries():
            obj = e.get()
            if obj is not None:
                by_key.setdefault(e.key, []).append((e, obj))
        out: list[Record] = []
        seen: set[str] = set()
        for i, item in enumerate(data):
            where = f"{path}[{i}]"
            d = _plain.fields(item, where, ["key", "kind", "state"])
            key = _plain.text(d["key"], f"{where}.key")
            kind = _plain.text(d["kind"], f"{where}.kind", choices=BY_NAME)
            if key in seen:
                raise ValueError(f"{where}.key: {key!r} is saved twice")
            seen.add(key)
            found = by_key.get(key, [])
            if len(found) != 1:
                raise ValueError(
                    f"{where}: the snapshot holds user RNG {key!r} ({kind}), and "
                    + (
                        f"no RNG is registered with that key here: call "
                        f"register_rng(rng, key={key!r}) before loading"
                        if not found
                        else f"{len(found)} RNGs are registered with that key here"
                    )
                )
            entry, obj = found[0]
            if entry.kind.name != kind:
                raise ValueError(
                    f"{where}.kind: saved a {kind}, but the RNG registered here with key "
                    f"{key!r} is a {entry.kind.name}"
                )
            state = entry.kind.from_plain(obj, d["state"], f"{where}.state")
            out.append((entry, obj, state))
        return tuple(out)


def _put(record: Record) -> None:
    """Put one record back: ``(entry or batch, its object(s), their state)``."""
    entry, obj, saved = record
    entry.put(obj, saved)


def _reseed(seed: int, rank_seed: int) -> None:
    if live_steps():  # nothing registered (the usual case): nothing to seed
        seed_registered_rngs(rank_seed, shared_seed=seed)
