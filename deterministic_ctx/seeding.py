"""``seed_everything``: the classic global recipe, without a block."""

from __future__ import annotations

import logging

from .internal import AUTO, Block, Rank, Settings, process_rank, validate_rank, validate_seed

__all__ = ["seed_everything"]

_log = logging.getLogger("deterministic_ctx")


def seed_everything(
    seed: int | None,
    *,
    warn_only: bool = False,
    rank: Rank = None,
    broadcast: bool = False,
) -> int:
    """Seed every RNG and turn on deterministic algorithms for the whole process.

    For the top of a script, where nothing needs to be put back: it applies
    exactly what a ``deterministic(seed, rank=rank)`` block applies on entry,
    and never restores.  If applying fails half-way, the previous state is
    restored before the error propagates.  Returns the seed (the shared one,
    not the per-rank one), and logs it on the ``deterministic_ctx`` logger.

    Args:
        seed: an int in ``0 .. 2**32 - 1``, or ``None`` to draw a fresh one
            from the operating system (logged at INFO level and returned, so
            the run can be replayed with that seed).
        warn_only: as in :class:`deterministic`.
        rank: as in :class:`deterministic`: ``random``, NumPy and registered
            user RNGs get a per-rank seed, torch keeps the shared one.
        broadcast: a collective on ``torch.distributed``'s default group:
            every rank uses rank 0's seed (drawn there if ``None``).  Without
            a process group it changes nothing.  ``seed=None`` on more than
            one rank requires it, since each rank would draw its own seed.

    Example:
        >>> import random
        >>> from deterministic_ctx import Snapshot, seed_everything
        >>> before = Snapshot.capture()
        >>> seed_everything(0)
        0
        >>> a = random.random()
        >>> random.seed(0)
        >>> random.random() == a
        True
        >>> before.restore()
    """
    if not isinstance(broadcast, bool):
        raise TypeError(f"broadcast must be True or False, got {broadcast!r}")
    # Validate everything before the collective, so a bad argument fails on
    # its own rank instead of leaving the others waiting in the broadcast.
    if seed is not None:
        validate_seed(seed)
    rank = validate_rank(rank)
    drawn = seed is None
    if broadcast or drawn:
        from . import distributed  # the integration layer, only when asked for

        if broadcast:
            seed = distributed.broadcast_seed(seed)
        elif distributed.world_size() > 1:
            raise ValueError(
                "seed=None draws a different seed on every rank of the process group; "
                "pass broadcast=True so that every rank uses rank 0's seed"
            )
        else:
            seed = distributed.draw_seed()
    settings = Settings.build(seed, warn_only, rank)
    block = Block(settings)
    try:
        block.start()  # applies, or rolls back to the previous state and raises
        block.commit()
    except BaseException:
        block.stop()  # interrupted before the commit: nothing stays applied
        raise
    _log.info(
        "seed_everything: seed %d%s, rank %s",
        settings.seed,
        " (drawn fresh: pass it as seed to replay)" if drawn else "",
        process_rank() if rank == AUTO else rank,
    )
    return settings.seed
