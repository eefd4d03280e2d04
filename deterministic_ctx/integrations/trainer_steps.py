"""What the trainers' callbacks share: one block around training, seeded afresh at each step.

:class:`~deterministic_ctx.LightningCallback` and
:class:`~deterministic_ctx.TransformersCallback` enter one block when training
starts (it sets the determinism flags once, and gives the caller's random
state and flags back when training ends) and, when a training step starts,
seed that block's random number generators afresh from the step's key
(``Block.reseed``): the step's draws depend on the seed and the step only,
and the capture and the restore are paid once a training run, not once a
step.  A resumed run seeds its steps from the same keys, so it needs nothing
of the block's state from before the crash.

Example:
    >>> import torch
    >>> from deterministic_ctx.integrations.trainer_steps import TrainingBlock
    >>> training = TrainingBlock(0, owner="an example")
    >>> training.start()
    >>> training.step(epoch=0, index=5)
    >>> a = torch.rand(2)
    >>> training.step(epoch=0, index=5)  # the same step's key again: the same draws
    >>> torch.equal(torch.rand(2), a)
    True
    >>> training.close()
"""

from __future__ import annotations

from typing import Any

from .._errors import MisuseError
from ..internal import Block, Settings, derive_seed
from ..parallel.keyed import ItemKeys

__all__ = ["StepKeys", "TrainingBlock"]

#: How many steps' keys :class:`StepKeys` derives at once.
CHUNK = 64


class StepKeys:
    """The keys of training steps: ``key(epoch, index)`` is
    :meth:`SeededDataset.item_seed <deterministic_ctx.SeededDataset.item_seed>`
    ``(index, epoch)`` of a keyed stream with ``seed`` (the same code,
    :class:`~deterministic_ctx.parallel.keyed.ItemKeys`: one ``derive_seed`` per
    epoch, a SplitMix64 step per index).

    The keys are derived :data:`CHUNK` at a time: a step then finds its key in
    a list, which costs less than a call into ``item_seed`` right after the
    previous step's work has evicted that code from the caches.

    Example:
        >>> from deterministic_ctx import SeededDataset
        >>> from deterministic_ctx.integrations.trainer_steps import StepKeys
        >>> StepKeys(7).key(2, 100) == SeededDataset([], 7).item_seed(100, epoch=2)
        True
    """

    def __init__(self, seed: int) -> None:
        self._stream = ItemKeys(seed)
        self._chunk: tuple[int, int, list[int]] = (-1, 0, [])  # epoch, first index, keys

    def key(self, epoch: int, index: int) -> int:
        """The key of step ``index`` of ``epoch`` (both non-negative ints)."""
        chunk_epoch, first, keys = self._chunk
        i = index - first
        if chunk_epoch != epoch or not 0 <= i < len(keys):
            stream = self._stream
            keys = [stream(k, epoch) for k in range(index, index + CHUNK)]
            self._chunk = (epoch, index, keys)
            i = 0
        return keys[i]


class TrainingBlock:
    """One block around training (``deterministic(derive_seed(seed, "fit"), ...)``'s
    settings: ``warn_only``, ``flags`` and ``fill_uninitialized_memory`` as
    there) whose generators :meth:`step` seeds afresh from each step's key, as
    ``deterministic(seed=key, flags=False)`` would seed them.

    ``owner`` names the callback in the error raised when a step cannot be
    seeded: another block entered after this one is still open at the step's
    start.  A copy (a pickle) of it is closed.

    Example:
        >>> import random
        >>> from deterministic_ctx.integrations.trainer_steps import TrainingBlock
        >>> state = random.getstate()
        >>> training = TrainingBlock(3, owner="an example")
        >>> training.step(epoch=1, index=0)  # opens the block if it is not open
        >>> training.is_open
        True
        >>> _ = random.random()
        >>> training.close()  # the caller's state is back
        >>> random.getstate() == state
        True
    """

    def __init__(
        self,
        seed: int,
        *,
        owner: str,
        warn_only: bool = False,
        flags: bool = True,
        fill_uninitialized_memory: bool = True,
    ) -> None:
        self._settings = Settings.build(
            derive_seed(seed, "fit"), warn_only, None, flags, fill_uninitialized_memory
        )
        self._keys = StepKeys(derive_seed(seed, "step"))
        self._owner = owner
        self._block: Block | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _block=None)  # the open block is this object's only

    @property
    def is_open(self) -> bool:
        """Whether the block is open (from :meth:`start` or :meth:`step` to :meth:`close`)."""
        return self._block is not None

    def start(self) -> None:
        """Enter the block (after leaving it, if it is open): training starts."""
        self.close()
        block = Block(self._settings)
        block.start()
        self._block = block

    def step(self, epoch: int, index: int) -> None:
        """Seed the block's generators from the key of step ``index`` of ``epoch``;
        the block is entered first if it is not open (after an error closed it)."""
        if self._block is None:
            self.start()
        assert self._block is not None
        try:
            self._block.reseed(self._keys.key(epoch, index))
        except MisuseError as error:
            raise MisuseError(
                f"{self._owner} seeds each training step in its block around training, but a "
                f"block entered after that one is still open when the step starts (a "
                f"deterministic or isolated block started in a hook or a callback and not left): "
                f"leave it before the step ends"
            ) from error

    def close(self) -> None:
        """Leave the block if it is open: the caller's random state and flags are back."""
        block, self._block = self._block, None
        if block is not None:
            block.stop()
