"""``seed_everything``: the classic global recipe, without a block."""

from __future__ import annotations

import logging
import os
from typing import Any

from .._torch.compiler import opaque
from .._torch.distributed import process_rank
from ..internal import (
    SEED_ENV_VAR,
    Block,
    CompiledRng,
    Rank,
    Settings,
    check_bool,
    complete,
    export_env_var,
    validate_seed,
)

__all__ = ["seed_everything"]

_log = logging.getLogger("deterministic_ctx")


#: The default of ``seed``: the seed a parent process exported, else a fresh one.
_INHERIT: Any = type("_Inherit", (), {"__repr__": lambda self: "<inherited or fresh>"})()


def seed_everything(
    seed: int | None = _INHERIT,
    *,
    warn_only: bool = False,
    rank: Rank = None,
    broadcast: bool = False,
    flags: bool = True,
    fill_uninitialized_memory: bool = True,
    compiled_rng: CompiledRng = None,
) -> int:
    """Seed every RNG and turn on deterministic algorithms for the whole process.

    For the top of a script, where nothing needs to be put back: it applies
    exactly what a ``deterministic(seed, rank=rank)`` block applies on entry,
    and never restores.  If applying fails half-way, the previous state is
    restored before the error propagates.

    It returns the seed it applied, and logs it at INFO level on the
    ``deterministic_ctx`` logger.  Keep the returned value: with ``seed=None``
    (or no argument and nothing inherited) it is a fresh seed, and the only way
    to replay the run.  The log line is invisible unless logging is set up
    (Python shows only WARNING and above by default): call
    ``logging.basicConfig(level=logging.INFO)`` first to see it.

    The seed is exported in the environment variable ``DETERMINISTIC_CTX_SEED``
    (a block restores it like its other variables), so child processes
    (``torch.multiprocessing.spawn`` workers, ``subprocess`` runs) inherit it:
    ``seed_everything()`` there applies the same seed.  ``PYTHONHASHSEED`` is
    exported too, as in a block (not with ``flags=False``, which sets no
    variable), so string hashing in children is fixed.

    Args:
        seed: an int in ``0 .. 2**32 - 1``, or ``None`` to draw a fresh one
            from the operating system (returned, and logged at INFO level, so
            the run can be replayed with that seed).  Left out, the seed a
            ``seed_everything`` of a parent process exported, else a fresh one.
        warn_only: as in :class:`deterministic`.
        rank: as in :class:`deterministic`: ``random``, NumPy and registered
            user RNGs get a per-rank seed, torch keeps the shared one.
        flags: as in :class:`deterministic`.
        fill_uninitialized_memory: as in :class:`deterministic`.
        compiled_rng: as in :class:`deterministic` (``compiled_rng="eager"``
            stays set for the rest of the process).
        broadcast: a collective on ``torch.distributed``'s default group:
            every rank uses rank 0's seed (drawn there if ``None``).  Without
            a process group it changes nothing.  ``seed=None`` on more than
            one rank requires it, since each rank would draw its own seed.

    Returns:
        The seed applied: the shared one, not the per-rank one (which
        ``rank_seed(seed, rank)`` gives); the drawn one for ``seed=None``.

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
        >>> seed = seed_everything(None)  # a fresh seed: print or store it to replay the run
        >>> 0 <= seed < 2**32
        True
        >>> before.restore()
    """
    check_bool(broadcast, "broadcast")
    # Validate everything before the collective, so a bad argument fails on
    # its own rank instead of leaving the others waiting in the broadcast.
    inherited = False
    if seed is _INHERIT:
        seed = None
        exported = os.environ.get(SEED_ENV_VAR)
        if exported is not None:
            try:
                seed = validate_seed(int(exported), name=f"the {SEED_ENV_VAR} environment variable")
            except ValueError as exc:
                raise ValueError(
                    f"{SEED_ENV_VAR}={exported!r} (exported for child processes) is not a "
                    f"seed: an int in 0 .. 2**32 - 1 is expected"
                ) from exc
            inherited = True
    # The other arguments (and a given seed) checked as a block checks them.
    checked = Settings.build(
        0 if seed is None else seed, warn_only, rank, flags, fill_uninitialized_memory, compiled_rng
    )
    rank = checked.rank
    drawn = seed is None
    if broadcast or drawn:
        from .ranks import broadcast_seed, ranks

        if not broadcast and (world := ranks().world_size) > 1:
            raise ValueError(
                f"seed=None draws a different seed on every rank of the run "
                f"(world size {world}); pass broadcast=True so that every "
                f"rank uses rank 0's seed"
            )
        seed = broadcast_seed(seed)  # in a one-process run: seed, or a fresh one
    settings = Settings.build(seed, warn_only, rank, flags, fill_uninitialized_memory, compiled_rng)
    block = Block(settings)
    # Stopped (its stop completed) if anything stops it before the commit:
    # nothing stays applied.
    try:
        _apply_and_export(block, settings.seed)
    except BaseException:
        complete(block.stop)
        raise
    _log.info(
        "seed_everything: seed %d%s, rank %s",
        settings.seed,
        " (drawn fresh: pass it as seed to replay)"
        if drawn
        else f" (from {SEED_ENV_VAR}, exported by a parent process)"
        if inherited
        else "",
        process_rank() if rank == "auto" else rank,  # as ranks.resolve_rank, None kept
    )
    return settings.seed


def _apply_and_export(block: Block, seed: int) -> None:
    block.start()  # applies, or rolls back to the previous state and raises
    # Inside the block's lock, before the commit: an interrupt before the
    # commit rolls this back with everything else.  Through the environment
    # source's owned entry: a new seed each call must not grow the process.
    export_env_var(SEED_ENV_VAR, str(seed))
    block.commit()


# Called from compiled code: one graph break, the call eager (see _torch/compiler.py).
opaque(
    seed_everything,
    "deterministic-ctx: seed_everything() changes process-global RNG state and flags, which "
    "cannot be part of a graph; dynamo calls it eagerly, outside the graph. Under "
    "fullgraph=True, call it before the compiled function.",
    recursive=True,
)
