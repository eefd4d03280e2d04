"""Seeds for multi-process training on ``torch.distributed``, on one node or many.

What is per rank and what is shared, under ``deterministic(seed=s, rank=...)``
and ``seed_everything(s, rank=...)``:

=====================================  =========================================
per rank (``rank_seed(s, rank)``)      shared (``s`` on every rank)
=====================================  =========================================
Python ``random``                      torch CPU generator (model initialization)
NumPy's global RNG                     CUDA / XPU / MTIA / MPS generators
registered user RNGs                   ``PYTHONHASHSEED`` for child processes
DataLoader workers (``seed_worker``)   ``DistributedSampler(seed=s)`` (pass it)
=====================================  =========================================

Model initialization must be identical on every rank, and it draws from torch's
generators, so they keep the shared seed.  Augmentation must differ, and it
draws from ``random``, NumPy, user RNGs and DataLoader workers, so they get
``rank_seed(s, rank)``: ``s`` itself on rank 0 (a one-process run draws what
rank 0 draws), a well-mixed ``derive_seed(s, "rank", rank)`` elsewhere, which
shares no structure with other seeds (``s + rank`` makes seed 0 rank 1 collide
with seed 1 rank 0).  To make torch ops such as dropout differ per rank, reseed
torch after building the model: ``torch.manual_seed(rank_seed(s))``.

Under ``torchrun`` with several nodes, the *global* rank alone decides
(:func:`ranks` tells the three apart): the local rank picks the device
(``torch.cuda.set_device(local_rank)``; every device generator gets the shared
seed, so which one a rank drives changes no draw) and the node rank enters
nothing, so global rank 2 draws the same numbers as 1 node x 4 processes or as
2 nodes x 2.  ``rank="auto"`` reads the default process group where one is
initialized, else the ``RANK`` the launcher exported, so seeding before
``init_process_group`` seeds what seeding after it does.
"""

from __future__ import annotations

import os
import secrets
from typing import NamedTuple

import torch.distributed as dist

from .._errors import MisuseError
from .._torch.distributed import launcher_variables, process_rank
from ..internal import Rank, Settings, validate_rank, validate_seed

__all__ = [
    "Ranks",
    "broadcast_seed",
    "rank_seed",
    "ranks",
    "resolve_rank",
]


class Ranks(NamedTuple):
    """Where this process sits in a distributed run (see :func:`ranks`)."""

    #: The global rank, ``0 .. world_size - 1``: the only one that enters seeds.
    rank: int
    #: How many processes the run has, on all nodes.
    world_size: int
    #: The rank among the processes of this node (``LOCAL_RANK``): which device
    #: to drive.  ``None`` where a process group exists but no launcher said
    #: (``torch.multiprocessing.spawn`` exports nothing).
    local_rank: int | None
    #: Which node (``GROUP_RANK``, torchrun's number of this agent), ``None``
    #: where the launcher did not say.
    node_rank: int | None


def ranks() -> Ranks:
    """This process's global rank, world size, local rank and node rank.

    The global rank and world size come from the default process group where
    one is initialized, else from the launcher's ``RANK`` and ``WORLD_SIZE``
    (torchrun exports them before the script starts), else a one-process run
    (0 of 1); the global rank is what ``rank="auto"`` stands for.  The local
    and node ranks come from the launcher's ``LOCAL_RANK`` and ``GROUP_RANK``;
    no seed depends on them.  Malformed or contradictory variables raise
    ``ValueError`` naming them.

    Example:
        >>> from deterministic_ctx import ranks
        >>> ranks()  # one process, no launcher
        Ranks(rank=0, world_size=1, local_rank=0, node_rank=0)

        Under ``torchrun --nnodes=2 --nproc-per-node=2``, the second process of
        the second node gets ``Ranks(rank=3, world_size=4, local_rank=1,
        node_rank=1)``, before ``init_process_group`` and after it.
    """
    rank = process_rank()  # the group's, else the launcher's (checked), else 0
    grouped = dist.is_available() and dist.is_initialized()
    found = launcher_variables(strict=not grouped)
    if grouped:
        world = int(dist.get_world_size())
    elif found is not None:
        world = found["WORLD_SIZE"]
    else:
        world = int(os.environ.get("WORLD_SIZE", "1")) if _digits("WORLD_SIZE") else 1
    if found is None:
        # No (whole) launcher: one process, or a group from mp.spawn or Lightning's launcher,
        # which exports LOCAL_RANK but no RANK; a well-formed LOCAL_RANK still says the device.
        local = int(os.environ["LOCAL_RANK"]) if _digits("LOCAL_RANK") else None
        if world == 1:
            return Ranks(0, 1, 0, 0)
        return Ranks(rank, world, local, None)
    return Ranks(rank, world, found.get("LOCAL_RANK"), found.get("GROUP_RANK"))


def _digits(name: str) -> bool:
    text = os.environ.get(name)
    return text is not None and text.isascii() and text.isdigit()


def resolve_rank(rank: Rank = "auto") -> int:
    """The rank ``rank`` stands for: itself if an int, 0 if ``None``, and for
    ``"auto"`` this process's global rank (see :func:`ranks`): in the
    initialized default process group, else the launcher's ``RANK``, else 0.

    Example:
        >>> from deterministic_ctx.parallel.ranks import resolve_rank
        >>> resolve_rank("auto")  # no process group, no launcher here
        0
        >>> resolve_rank(3)
        3
    """
    rank = validate_rank(rank)
    if rank is None:
        return 0
    return process_rank() if rank == "auto" else rank


def rank_seed(seed: int, rank: Rank = "auto") -> int:
    """The per-rank seed a block with ``seed`` and ``rank`` gives ``random``,
    NumPy and user RNGs: ``seed`` on rank 0, a well-mixed sub-seed elsewhere.

    Example:
        >>> from deterministic_ctx import rank_seed
        >>> rank_seed(7, 0)
        7
        >>> rank_seed(7, 1) != rank_seed(8, 0)  # unlike seed + rank
        True
    """
    # What a block's settings give, for the rank resolved now.
    return Settings(validate_seed(seed), False, resolve_rank(rank)).rank_seed


def broadcast_seed(seed: int | None = None) -> int:
    """Rank 0's seed, on every rank: the one it passes, or a fresh one if ``None``.

    A collective: every rank of the default process group must call it.  The
    seeds other ranks pass are validated, then ignored.  In a one-process run
    (no process group, no launcher) it returns ``seed`` (or a fresh one), so
    one script serves one-process and multi-process runs.  Under a launcher
    that started several processes (``WORLD_SIZE`` > 1), it raises
    :class:`~deterministic_ctx.MisuseError` (a ``RuntimeError``) until
    ``init_process_group`` has run: there is nothing to broadcast over yet.
    Log or save the result to replay the run with a fixed seed.

    Example:
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx import broadcast_seed
        >>> with deterministic(seed=broadcast_seed(5), rank="auto") as det:
        ...     det.seed
        5
    """
    # A fresh seed from the OS, never from a global RNG: inside a block that would repeat
    # the block's seed and shift its streams.
    own = secrets.randbits(32) if seed is None else validate_seed(seed)
    grouped = dist.is_available() and dist.is_initialized()
    if not grouped:
        world = ranks().world_size
        if world > 1:
            raise MisuseError(
                f"broadcast_seed is a collective over the default process group, and the "
                f"launcher started {world} processes (WORLD_SIZE={world}) but none has joined "
                f"one yet: call torch.distributed.init_process_group() first (under torchrun "
                f"it needs no argument but the backend)"
            )
        return own
    if int(dist.get_world_size()) == 1:
        return own
    box: list[int | None] = [own if dist.get_rank() == 0 else None]
    # broadcast_object_list picks the device the backend needs (CPU for gloo,
    # the current CUDA device for NCCL).
    dist.broadcast_object_list(box, src=0)
    value = box[0]
    if not isinstance(value, int):  # only rank 0 writes it, and it writes an int
        raise MisuseError(
            f"broadcast_seed received {value!r} from rank 0: call it at the same point "
            f"on every rank (each rank must run the same collectives in the same order)"
        )
    return value
