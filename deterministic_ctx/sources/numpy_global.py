"""NumPy's legacy global RNG (``np.random.seed``, ``np.random.rand``, …).

The state is: which bit generator is installed (``np.random.set_bit_generator``
can replace it), that bit generator's state, and the ``RandomState``'s legacy
gaussian cache (``has_gauss``/``gauss``), which changes what the next
``np.random.randn()`` returns.  A captured state is ``(bit generator, raw)``:
``raw`` holds the MT19937 record and the gaussian cache, joined, on the fast
path, else the dict of ``RandomState.get_state(legacy=False)``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..base.fast_paths import ENABLED, FastPath
from ..base.settings import Settings
from ._base import Reseeder
from ._seeded import SeededCache
from .rngs.entries import Entry
from .rngs.kinds import RANDOM_STATE
from .rngs.persistence import bit_generator_state_from_plain, numpy_state_to_plain

__all__ = ["NumpyGlobalSource"]

#: ``(bit generator, raw)`` (see the module docstring).
NumpyState = tuple[Any, bytes | dict[str, Any]]

# Public since NumPy 1.25, missing from its type stubs.
_set_bit_generator: Any = np.random.set_bit_generator  # type: ignore[attr-defined]


#: The records legacy seeding (``np.random.seed``) leaves, by seed.
_SEEDED: SeededCache[bytes] = SeededCache()


def _free_global_lock_in_child() -> None:
    """Free the global bit generator's lock in a forked child if a thread that
    does not exist there held it at the fork (it was drawing, or a block was
    copying its state): otherwise the child's first draw would wait forever.

    Registered with ``os.register_at_fork`` when this module is imported,
    before the block engine registers its own hook, so it runs first: that
    hook may restore NumPy's state, which takes this lock.
    """
    lock = getattr(np.random.mtrand._rand._bit_generator, "lock", None)
    # ``_is_owned`` (Python >= 3.11 for plain locks, NumPy 1.x's kind): without it, a
    # lock held here is taken for a dead thread's, since the forking thread cannot
    # be inside a draw or a state copy while it forks.
    owned = getattr(lock, "_is_owned", None)
    if lock is None or not hasattr(lock, "_at_fork_reinit") or (owned is not None and owned()):
        return
    if lock.acquire(False):
        lock.release()
    else:
        lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_global_lock_in_child)


class NumpyGlobalSource:
    """The ``RandomState`` singleton behind the ``np.random.*`` functions,
    declared as one object of the ``RandomState`` kind (:mod:`.rngs.kinds`),
    captured and restored as a registered one is: by an
    :class:`~.rngs.entries.Entry` for the bit generator installed."""

    name = "numpy"
    device_type: str | None = None  # not a device generator: saved under "sources"
    applies_nothing = False
    fast_paths = (
        *RANDOM_STATE.fast_paths,
        FastPath("NumPy legacy RNG: the records seeding left remembered per seed", lambda: True),
        FastPath(
            "NumPy: reseeded per step by its own seeding call, without the per-seed cache",
            lambda: True,
        ),
    )

    def __init__(self, rs: np.random.RandomState | None = None, *, fast: bool = ENABLED) -> None:
        self._rs: np.random.RandomState = rs if rs is not None else np.random.mtrand._rand
        self._fast = fast
        #: The entry for the bit generator installed last, replaced whole
        #: (another thread may read it).
        self._last = Entry(self._rs, self.name, RANDOM_STATE, fast=fast)

    def _entry(self, bit_generator: Any) -> Entry:
        """The entry for ``bit_generator``, installed now: made once per bit
        generator, which it holds, so the memory under its views stays alive."""
        entry = self._last
        if entry.part is not bit_generator:
            self._last = entry = Entry(self._rs, self.name, RANDOM_STATE, fast=self._fast)
        return entry

    def capture(self) -> NumpyState:
        rs = self._rs
        bg = rs._bit_generator
        return bg, self._entry(bg).capture(rs)

    def restore(self, state: NumpyState) -> None:
        rs, (bg, raw) = self._rs, state
        if rs._bit_generator is not bg:
            _set_bit_generator(bg)
        self._entry(bg).put(rs, raw)

    def apply(self, settings: Settings) -> None:
        rs = self._rs
        if type(rs._bit_generator) is not np.random.MT19937:
            # ``np.random.seed`` only works on MT19937; inside a block the global
            # RNG is exactly the classic legacy-seeded one.  Restore reinstalls
            # the user's bit generator.
            _set_bit_generator(np.random.MT19937(0))
        # Exactly ``np.random.seed(seed)`` (legacy seeding, which also clears
        # the gaussian cache): the records it left for a seed seen before, as
        # one locked copy.
        self._entry(rs._bit_generator).seed_exactly(rs, settings.rank_seed, _SEEDED)

    def reseeder(self) -> Reseeder | None:
        """``np.random.seed(rank_seed)`` itself (legacy seeding, which also clears
        the gaussian cache) while the bit generator is an MT19937, else ``apply``;
        ``None`` with the fast paths off."""
        if not self._fast:
            return None
        rs, apply, mt19937 = self._rs, self.apply, np.random.MT19937

        def reseed(seed: int, rank_seed: int) -> None:
            if type(rs._bit_generator) is mt19937:
                rs.seed(rank_seed)
            else:  # np.random.seed refuses it: apply installs an MT19937
                apply(Settings(rank_seed, False, None, False))

        return reseed

    def export_state(self, state: NumpyState) -> dict[str, Any]:
        """The state as plain data for a checkpoint: ``get_state(legacy=False)``
        with arrays as lists of ints (copied records are read back through a
        throw-away ``RandomState``)."""
        scratch = np.random.RandomState()
        public = Entry(scratch, self.name, RANDOM_STATE).public(scratch, state[1])
        return numpy_state_to_plain(public)

    def import_state(self, data: object, path: str) -> NumpyState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The bit generator installed now is kept if it is of the saved type
        (others may hold it through ``np.random.get_bit_generator()``);
        otherwise a new one of that type is installed on restore.  The state
        is kept in dict form, so ``restore`` goes through ``set_state``.
        """
        public = bit_generator_state_from_plain(data, path, legacy=True)
        cls = getattr(np.random, public["bit_generator"])  # a name from BIT_GENERATORS
        current = self._rs._bit_generator
        return current if type(current) is cls else cls(), public
