"""torch's default CPU generator."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..base import plain as _plain
from ..base.fast_paths import ENABLED, FastPath
from ..base.settings import Settings
from ._base import Reseeder
from ._seeded import SeededCache
from .rngs.entries import Entry
from .rngs.kinds import TORCH
from .rngs.persistence import generator_state_from_plain

__all__ = ["TorchCPUSource", "generator_state_from_plain"]

#: The state ``manual_seed(seed)`` gives a CPU generator, by seed.  Taking it
#: allocates a tensor (~1 µs), so only seeds seen twice are remembered.
_SEEDED: SeededCache[torch.Tensor] = SeededCache()


class TorchCPUSource:
    """``torch.default_generator``, used by every CPU op without ``generator=``,
    declared as one object of the ``torch.Generator`` kind (:mod:`.rngs.kinds`)."""

    name = "torch.cpu"
    device_type: str | None = None  # not a device generator: saved under "sources"
    applies_nothing = False
    fast_paths = (
        FastPath("torch CPU generator: the state seeding left remembered per seed", lambda: True),
        FastPath(
            "torch CPU: reseeded per step by manual_seed, without the per-seed cache", lambda: True
        ),
    )

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._gen = gen = generator if generator is not None else torch.default_generator
        self._entry = entry = Entry(gen, self.name, TORCH)
        #: ``capture()`` (a fresh ByteTensor copy, never handed out) and
        #: ``restore(state)``: the generator's own C methods, no Python frame.
        self.capture = partial(entry.capture, gen)
        self.restore = partial(entry.put, gen)

    def apply(self, settings: Settings) -> None:
        # What ``torch.manual_seed`` does for the CPU; accelerators are their
        # own sources so that no lazy seed with a formatted stack is queued.
        # ``manual_seed`` re-runs the Mersenne Twister init (~1 µs); the state
        # it gave a seed seen twice before, identical (``initial_seed()``
        # included: tests compare the two), is set in ~0.2 µs.
        self._entry.seed_exactly(self._gen, settings.seed, _SEEDED)

    def reseeder(self) -> Reseeder | None:
        """``manual_seed(seed)`` itself; ``None`` with the fast paths off."""
        if not ENABLED:
            return None
        manual_seed = self._gen.manual_seed

        def reseed(seed: int, rank_seed: int) -> None:
            manual_seed(seed)

        return reseed

    def export_state(self, state: torch.Tensor) -> dict[str, Any]:
        """The state as plain data for a checkpoint: ``{"state": uint8 tensor}``."""
        return {"state": state.clone()}

    def import_state(self, data: object, path: str) -> torch.Tensor:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field."""
        d = _plain.fields(data, path, ["state"])
        return generator_state_from_plain(d["state"], f"{path}.state", self._gen)
